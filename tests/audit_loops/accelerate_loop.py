"""An Accelerate loop on the CPU: mixed_precision="bf16", gradient accumulation by
accelerator.accumulate, accelerator.clip_grad_norm_ when gradients sync, a prepared LR
scheduler, and accelerator.save_state.
"""

import tempfile
import warnings

import torch
from accelerate import Accelerator

from _common import batches, make_model, parse

args = parse((), k=2, every=100, out="")
warnings.filterwarnings("ignore")
accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=args.k)

model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
model, opt, sched = accelerator.prepare(model, opt, sched)
out = args.out or tempfile.mkdtemp(prefix="ampspec-audit-")

for i, (x, y) in enumerate(batches(args.steps * args.k)):
    with accelerator.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    if (i + 1) % (args.every * args.k) == 0:
        accelerator.save_state(out)
