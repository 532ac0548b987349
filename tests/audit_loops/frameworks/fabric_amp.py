"""Lightning Fabric on the CPU: ``bf16-mixed``, or ``16-mixed`` with a CPU GradScaler.

Read from lightning 2.6's source: ``fabric.setup`` moves the model after the optimizer is built;
``fabric.backward`` calls the precision plugin's ``backward``, which scales the loss with the
plugin's scaler (``plugins/precision/amp.py``) and does not divide it by anything, so the loop
divides each microbatch's loss by k itself; ``no_backward_sync`` only skips a gradient
all-reduce; ``fabric.clip_gradients`` unscales through the plugin before clipping (and raises on
a non-finite norm unless told not to); the
optimizer ``fabric.setup`` returns steps through the plugin (``scaler.step`` then
``scaler.update``). Fabric does not wrap LR schedulers: with a scaler the loop steps its
scheduler only when the scale did not drop (the step was applied). ``fabric.save`` does not add
the precision plugin's state: the loop puts the scaler's state in by hand.

``--bug loss-not-divided``: the undivided loss goes to ``fabric.backward`` (the call that
reaches ``loss.backward`` is Fabric's). ``--bug checkpoint-without-scaler``: ``fabric.save``
without the scaler state (its ``torch.save`` is Fabric's).
"""

import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision.amp import MixedPrecision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import batches, make_model, parse  # noqa: E402

args = parse(("loss-not-divided", "checkpoint-without-scaler"), scaler=0, k=2, every=100, out="")
warnings.filterwarnings("ignore")
if args.scaler:
    # 16-mixed with a CPU GradScaler; the forward autocasts to bf16 (the plugin would ask for fp16).
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", growth_interval=40))
    plugin._desired_input_dtype = torch.bfloat16
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
else:
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")

model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
model, opt = fabric.setup(model, opt)
scaler = fabric.strategy.precision.scaler if args.scaler else None
data = batches(args.steps * args.k)
out = args.out or tempfile.mkdtemp(prefix="ampspec-audit-")
divide = args.bug != "loss-not-divided"

for step in range(args.steps):
    for micro in range(args.k):
        x, y = fabric.to_device(next(data))
        with fabric.no_backward_sync(model, enabled=micro < args.k - 1):
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step in args.inf_at:
                loss = loss * float("inf")
            fabric.backward(loss / args.k if divide else loss)
    # Fabric raises on a non-finite norm by default; with a scaler an overflow is the scaler's to skip.
    fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=scaler is None)
    before = scaler.get_scale() if scaler is not None else None
    opt.step()
    opt.zero_grad()
    if scaler is None or scaler.get_scale() >= before:
        sched.step()
    if (step + 1) % args.every == 0:
        state = {"model": model, "optimizer": opt, "scheduler": sched}
        if args.scaler and args.bug != "checkpoint-without-scaler":
            state["scaler"] = fabric.strategy.precision.state_dict()
        fabric.save(os.path.join(out, f"step{step + 1}.ckpt"), state)
