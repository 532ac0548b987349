"""A compiled loop on the CPU: ``torch.compile(model)`` under bf16 autocast and the optimizer's
step compiled too, as PyTorch's "Compiling the optimizer" recipe writes it (a function that calls
``opt.step()`` under ``@torch.compile``; foreach AdamW at a constant rate).

``--scaler 1``: the model compiled, a GradScaler("cpu"), ``scaler.step(opt)`` eager (the scaler
decides on the host whether to call the step); with ``--step attribute`` the optimizer's step
compiled in place (``opt.step = torch.compile(opt.step)``), which ``scaler.step`` calls.
``--step eager``: the optimizer step uncompiled. ``--backend``: Inductor (default) or
``aot_eager`` (the graphs traced and run eagerly, no code generated). Planted mistakes
(``--bug``): ``backward-in-autocast``; ``replay-divergence``, a hand-written compiled step that
skips the weight decay (the group's ``weight_decay`` set to 0 around the call of the compiled
step, restored after: the update is not the one the group states; edited inside the compiled
function instead, Dynamo sets the group's ``capturable`` to True, measured). The truth: no
finding; every eager step replayed bit for bit, and every compiled optimizer step replayed
through the spec's compile rules (`reference.compile`), within their bound.
"""

import torch

from _common import batches, make_model, parse

args = parse(("backward-in-autocast", "replay-divergence"), scaler=0, step="compiled", backend="inductor")

model = make_model()
cmodel = torch.compile(model, backend=args.backend)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, foreach=True)
scaler = torch.amp.GradScaler("cpu", growth_interval=3) if args.scaler else None
if args.step == "attribute":
    opt.step = torch.compile(opt.step, backend=args.backend)


@torch.compile(backend=args.backend)
def compiled_step():
    opt.step()


for step, (x, y) in enumerate(batches(args.steps)):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(cmodel(x), y)
        if step in args.inf_at:
            loss = loss * float("inf")
        if args.bug == "backward-in-autocast":
            (scaler.scale(loss) if scaler else loss).backward()
    if args.bug != "backward-in-autocast":
        (scaler.scale(loss) if scaler else loss).backward()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    elif args.step == "compiled" and args.bug == "replay-divergence":
        group = opt.param_groups[0]
        decay, group["weight_decay"] = group["weight_decay"], 0.0
        compiled_step()
        group["weight_decay"] = decay
    elif args.step == "compiled":
        compiled_step()
    else:
        opt.step()
