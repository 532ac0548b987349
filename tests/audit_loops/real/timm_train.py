"""timm's training loop: NativeScaler with gradient accumulation, adaptive gradient clipping and
a per-update scheduler of its own.

Modelled on huggingface/pytorch-image-models, commit aa4b5850c1543fa488abf260f18390eda46cf85d:
``train.py`` (``train_one_epoch``), ``timm/utils/cuda.py`` (``NativeScaler.__call__``),
``timm/utils/agc.py`` (``adaptive_clip_grad``) and ``timm/scheduler/scheduler.py``
(``Scheduler.step_update``, which writes each group's ``lr``). Reproduced, in its order: per
batch ``need_update`` every ``accum_steps`` batches; the loss under autocast, divided in place
by ``accum_steps``; the loss scaler's ``scale(loss).backward()`` and, when ``need_update``,
``unscale_``, the clipping (``--clip-mode agc``: each unit's gradient rescaled and written back
with ``p.grad.detach().copy_``; ``norm``: ``clip_grad_norm_``), ``step`` and ``update``; then
``optimizer.zero_grad()``, ``num_updates += 1`` and ``lr_scheduler.step_update(num_updates)``;
the checkpoint saver's ``amp_scaler`` state with the model and optimizer.

The truth, from reading the original:

- with ``agc``: ``gradients-modified-after-unscale``, info, at every applied step (the clip
  edits the unscaled gradients; not a mistake);
- ``lr-changed-on-skipped-step``, a warning: ``num_updates`` counts every optimizer step,
  skipped or not, so the schedule advances across skipped steps;
- no accumulation finding (each loss is divided) and no checkpoint finding.
"""

import os

import torch
from torch import nn

from _real import batches, overflow, parse

args = parse(accum_steps=2, clip_mode="agc", warmup=10)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=2e-5)
scaler = torch.amp.GradScaler("cpu")


def unitwise_norm(x):
    return x.norm(2.0) if x.ndim <= 1 else x.norm(2.0, dim=tuple(range(1, x.ndim)), keepdim=True)


def adaptive_clip_grad(parameters, clip_factor=0.01, eps=1e-3):
    for p in parameters:
        if p.grad is None:
            continue
        max_norm = unitwise_norm(p.detach()).clamp_(min=eps).mul_(clip_factor)
        g_data = p.grad.detach()
        grad_norm = unitwise_norm(g_data)
        clipped_grad = g_data * (max_norm / grad_norm.clamp(min=1e-6))
        p.grad.detach().copy_(torch.where(grad_norm < max_norm, g_data, clipped_grad))


def step_update(num_updates, base_lr=0.05):
    lr = base_lr * min(1.0, (num_updates + 1) / args.warmup)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


num_updates = 0
optimizer.zero_grad()
for batch_idx, (x, y) in enumerate(batches(args.steps * args.accum_steps)):
    need_update = (batch_idx + 1) % args.accum_steps == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(overflow(model(x), num_updates in args.inf_at), y)
        loss /= args.accum_steps
    scaler.scale(loss).backward()
    if need_update:
        scaler.unscale_(optimizer)
        if args.clip_mode == "agc":
            adaptive_clip_grad(model.parameters())
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    if not need_update:
        continue
    optimizer.zero_grad()
    num_updates += 1
    step_update(num_updates)
    if num_updates % 6 == 0:
        torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp_scaler": scaler.state_dict()}, os.path.join(args.out, "last.pth.tar"))
