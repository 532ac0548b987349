"""A Lightning Fabric loop on the CPU: bf16-mixed, or 16-mixed semantics with a CPU GradScaler.

fabric.setup moves the model after the optimizer is built (Fabric's documented order); k
microbatches under no_backward_sync, each loss / k; fabric.clip_gradients (which unscales
first); optimizer.step; zero_grad; an LR scheduler; a checkpoint through fabric.save
(with the scaler state, which Fabric does not add by itself).
"""

import os
import tempfile
import warnings

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision.amp import MixedPrecision

from _common import batches, make_model, parse

args = parse(("checkpoint-without-scaler",), scaler=0, k=2, every=100, out="")
warnings.filterwarnings("ignore")
if args.scaler:
    # 16-mixed with a CPU GradScaler, autocasting to bf16 (the CPU has no fp16 autocast).
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", growth_interval=40))
    plugin._desired_input_dtype = torch.bfloat16
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
else:
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")

model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
model, opt = fabric.setup(model, opt)
data = batches(args.steps * args.k)
out = args.out or tempfile.mkdtemp(prefix="ampspec-audit-")

for step in range(args.steps):
    for micro in range(args.k):
        x, y = fabric.to_device(next(data))
        with fabric.no_backward_sync(model, enabled=micro < args.k - 1):
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss / args.k)
    fabric.clip_gradients(model, opt, max_norm=1.0)
    opt.step()
    opt.zero_grad()
    sched.step()
    if (step + 1) % args.every == 0:
        state = {"model": model, "optimizer": opt, "scheduler": sched}
        if args.scaler and args.bug != "checkpoint-without-scaler":
            # Fabric's save leaves the precision plugin's state out: the scaler's goes in by hand.
            state["scaler"] = fabric.strategy.precision.state_dict()
        fabric.save(os.path.join(out, f"step{step + 1}.ckpt"), state)
