"""OpenCLIP's training step: a two-tower model with a learnable 0-d temperature, and gradient
accumulation by feature cache.

Modelled on mlfoundations/open_clip, ``src/open_clip_train/train.py`` (``train_one_epoch``,
``_train_step_eager``, ``_finish_eager_train_step``, ``backward``) and
``src/open_clip_train/scheduler.py`` (``cosine_lr``), commit
89fb801f1e6087880e951fc8354b8a2077b79c6d. Reproduced, in its order: ``scheduler(step)`` sets
every group's ``lr`` by hand from ``step = batches // accum_freq``; with ``accum_freq > 1`` each
batch's features computed without gradients and cached; after ``accum_freq`` batches,
``zero_grad`` and, per batch j, a forward with gradients whose features replace the cached
ones at j (``torch.cat``), the full-batch contrastive loss with ``logit_scale.exp()``, and
``scaler.scale(total_loss).backward()``; then ``unscale_``, ``clip_grad_norm_``,
``scaler.step``, ``scaler.update`` and ``logit_scale.clamp_(0, ln 100)``; a checkpoint with the
scaler's state. ``logit_scale`` is ``nn.Parameter(torch.ones([]) * ln(1 / 0.07))``: 0-d.

The truth, from reading the original:

- the 0-d ``logit_scale`` is an ordinary AdamW parameter: every step replays;
- the ``accum_freq`` backward passes recompute the full-batch loss once per batch: not the
  microbatches of an undivided loss, no finding;
- ``lr-changed-on-skipped-step``, a warning: ``step`` counts batches, so a skipped step still
  advances the cosine schedule.
"""

import math
import os

import numpy as np
import torch
from torch import nn

from _real import overflow, parse

args = parse(accum_freq=2, warmup=3)
torch.manual_seed(0)
visual, text = nn.Linear(16, 8), nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 8))
logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))
params = [*visual.parameters(), *text.parameters(), logit_scale]
optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.2},
                               {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=5e-4)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)


def cosine_lr(step, base_lr=5e-4, steps=40):
    lr = base_lr * (step + 1) / args.warmup if step < args.warmup else \
        0.5 * (1 + math.cos(math.pi * (step - args.warmup) / (steps - args.warmup))) * base_lr
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


def features(images, texts):
    return (nn.functional.normalize(visual(images).float(), dim=-1),
            nn.functional.normalize(text(texts).mean(1).float(), dim=-1))


def clip_loss(img, txt):
    logits = logit_scale.exp() * img @ txt.t()
    labels = torch.arange(len(img))
    return (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.t(), labels)) / 2


for step in range(args.steps):
    batches = [(torch.randn(4, 16, generator=g), torch.randint(0, 32, (4, 5), generator=g))
               for _ in range(args.accum_freq)]
    cached = []
    for i, batch in enumerate(batches):
        cosine_lr((step * args.accum_freq + i) // args.accum_freq)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            cached.append(features(*batch))
    optimizer.zero_grad()
    for j, batch in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            img_j, txt_j = features(*batch)
            img = torch.cat([c[0] for c in cached[:j]] + [overflow(img_j, step in args.inf_at)] +
                            [c[0] for c in cached[j + 1:]])
            txt = torch.cat([c[1] for c in cached[:j]] + [txt_j] + [c[1] for c in cached[j + 1:]])
            total_loss = clip_loss(img, txt)
        scaler.scale(total_loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=2.0)
    scaler.step(optimizer)
    scaler.update()
    with torch.no_grad():
        logit_scale.clamp_(0, math.log(100))
    if (step + 1) % 6 == 0:
        torch.save({"epoch": step, "state_dict": {"logit_scale": logit_scale.detach()},
                    "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                   os.path.join(args.out, "epoch_latest.pt"))
