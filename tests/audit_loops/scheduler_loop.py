"""A GradScaler loop with an LR schedule, checkpoints, and a rollback to a checkpoint.

The schedule advances only on applied steps (the scale did not drop across update). Every
--every steps a checkpoint holds model, optimizer, scheduler and scaler state; at --rollback
the run restores the newest checkpoint into its model, optimizer and scheduler and into a new
GradScaler (loaded before its first scale), and continues. Planted mistakes (--bug) replace
one part.
"""

import os
import tempfile

import torch

from _common import batches, make_model, parse

BUGS = ("scheduler-on-skipped-step", "checkpoint-without-scaler", "new-scaler-mid-run")
args = parse(BUGS, every=25, rollback=120, out="")
bug = args.bug
out = args.out or tempfile.mkdtemp(prefix="ampspec-audit-")

model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (1.0 + 0.02 * n))
scaler = torch.amp.GradScaler("cpu", growth_interval=30)
latest = None

for step, (x, y) in enumerate(batches(args.steps)):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    if step in args.inf_at:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    if bug == "scheduler-on-skipped-step" or scaler.get_scale() >= before:
        sched.step()

    if (step + 1) % args.every == 0:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "step": step}
        if bug != "checkpoint-without-scaler":
            state["scaler"] = scaler.state_dict()
        latest = os.path.join(out, f"step{step + 1}.pt")
        torch.save(state, latest)
    if step + 1 == args.rollback and latest is not None:
        ckpt = torch.load(latest, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        if "scaler" in ckpt:  # a checkpoint without one leaves the running scaler in place
            scaler = torch.amp.GradScaler("cpu", growth_interval=30)
            if bug != "new-scaler-mid-run":
                scaler.load_state_dict(ckpt["scaler"])
