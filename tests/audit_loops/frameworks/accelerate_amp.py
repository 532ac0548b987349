"""Accelerate on the CPU: ``mixed_precision="bf16"``, or fp16 loss scaling with a CPU GradScaler.

Read from accelerate 1.16's source: ``Accelerator(gradient_accumulation_steps=k)`` with
``accelerator.accumulate(model)`` divides each loss by k in ``accelerator.backward`` and sets
``sync_gradients`` on every k-th batch; the prepared optimizer's ``step`` and ``zero_grad`` do
nothing on the other batches, and steps through ``scaler.step``/``scaler.update`` with a scaler;
``accelerator.clip_grad_norm_`` unscales first (``unscale_gradients``); the prepared scheduler
(``AcceleratedScheduler``) steps only on sync batches and not after a step the scaler skipped.
On a CPU, ``mixed_precision="fp16"`` gets no scaler and no autocast (``Accelerator.__init__``
builds them only off the CPU, and training runs in fp32), so ``--scaler 1`` gives the
accelerator a CPU GradScaler and sets ``native_amp`` before ``prepare``: the prepared model's
forward then autocasts to fp16 (torch's CPU autocast takes fp16) and the scaler is used as on a
GPU.

``--bug unscale-twice``: ``accelerator.clip_grad_norm_`` on every microbatch, not only when
gradients sync: its second ``unscale_`` in one step raises in torch (huggingface/accelerate#641).
``--bug clip-before-unscale``: ``torch.nn.utils.clip_grad_norm_`` on the scaled gradients instead
of ``accelerator.clip_grad_norm_`` (the pattern of harubaru/waifu-diffusion#64).
``--bug loss-not-divided``: k microbatches accumulated by hand, without
``gradient_accumulation_steps`` (``accelerator.backward`` then divides by 1).
"""

import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import batches, make_model, parse  # noqa: E402

args = parse(("unscale-twice", "clip-before-unscale", "loss-not-divided"), scaler=0, k=2, every=100, out="")
warnings.filterwarnings("ignore")
by_hand = args.bug == "loss-not-divided"
accelerator = Accelerator(cpu=True, mixed_precision="fp16" if args.scaler else "bf16",
                          gradient_accumulation_steps=1 if by_hand else args.k)
if args.scaler:
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=40)
    accelerator.native_amp = True  # what unscale_gradients asks before it unscales

model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
model, opt, sched = accelerator.prepare(model, opt, sched)
out = args.out or tempfile.mkdtemp(prefix="ampspec-audit-")

for i, (x, y) in enumerate(batches(args.steps * args.k)):
    step = i // args.k
    with accelerator.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step in args.inf_at:
            loss = loss * float("inf")
        accelerator.backward(loss)
        if by_hand and (i + 1) % args.k:
            continue  # the next microbatch of the window, by hand
        if args.bug == "clip-before-unscale" and accelerator.sync_gradients:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif args.bug == "unscale-twice" or (accelerator.sync_gradients and args.bug != "clip-before-unscale"):
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    if (i + 1) % (args.every * args.k) == 0:
        accelerator.save_state(os.path.join(out, f"step{step + 1}"))
