"""The canonical fp16-style loop, on the CPU: bf16 autocast with a GradScaler("cpu").

zero_grad; forward under autocast; scaler.scale(loss).backward() outside it; unscale_; clip at
the unscaled threshold; scaler.step; scaler.update. Planted mistakes (--bug) replace one part.
``--clip split`` clips in torch's two halves: ``get_total_norm`` of the gradients, then
``clip_grads_with_norm_`` with that total (as a loop that reduces the total across ranks does).
"""

import torch
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm  # bound before any audit

from _common import batches, make_model, parse

BUGS = ("clip-before-unscale", "clip-threshold-scaled", "unscale-twice", "unscale-twice-call",
        "step-without-update", "update-without-step", "step-bypasses-scaler", "backward-in-autocast",
        "gradients-altered", "unscale-by-hand", "scale-twice", "gradients-masked")
args = parse(BUGS, optimizer="adamw", clip="norm")
bug = args.bug
if args.clip == "split":
    def clip_grad_norm_(parameters, max_norm):  # noqa: F811
        parameters = list(parameters)
        total = get_total_norm([p.grad for p in parameters if p.grad is not None])
        clip_grads_with_norm_(parameters, max_norm, total)
        return total

model = make_model()
if args.optimizer == "adamw":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
elif args.optimizer == "adam-fused":
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)
scaler = torch.amp.GradScaler("cpu", growth_interval=20)

for step, (x, y) in enumerate(batches(args.steps)):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step in args.inf_at:
            loss = loss * float("inf")
        if bug == "backward-in-autocast":
            scaler.scale(loss).backward()
    if bug != "backward-in-autocast":
        scaler.scale(loss).backward()

    if bug == "clip-before-unscale":
        clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(opt)
    elif bug == "clip-threshold-scaled":
        scaler.unscale_(opt)
        clip_grad_norm_(model.parameters(), 1.0 * scaler.get_scale())
    elif bug == "unscale-twice":
        scaler.unscale_(opt)
        for p in model.parameters():
            p.grad.mul_(1.0 / scaler.get_scale())
        clip_grad_norm_(model.parameters(), 1.0)
    elif bug == "unscale-twice-call":
        scaler.unscale_(opt)
        clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(opt)
    elif bug == "gradients-altered":
        scaler.unscale_(opt)
        next(model.parameters()).grad.mul_(0.5)  # the loop's own edit, which torch's AMP notes allow
        clip_grad_norm_(model.parameters(), 1.0)
    elif bug == "gradients-masked":
        list(model.parameters())[-1].grad[:2].zero_()  # a mask on the scaled gradients, before unscale_
        scaler.unscale_(opt)
        clip_grad_norm_(model.parameters(), 1.0)
    elif bug == "unscale-by-hand":
        for p in model.parameters():  # e.g. to log the true norm; scaler.step below unscales again
            p.grad.mul_(1.0 / scaler.get_scale())
    elif bug == "scale-twice":
        scaler.unscale_(opt)
        for p in model.parameters():
            p.grad.data.mul_(scaler.get_scale())
    elif bug not in ("step-bypasses-scaler",):
        scaler.unscale_(opt)
        clip_grad_norm_(model.parameters(), 1.0)

    if bug == "update-without-step":
        opt.step()
        scaler.update()
    elif bug == "step-bypasses-scaler":
        opt.step()
    elif bug == "step-without-update":
        scaler.step(opt)
    else:
        scaler.step(opt)
        scaler.update()
