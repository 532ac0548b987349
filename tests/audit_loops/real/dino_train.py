"""DINO's self-distillation loop: a student trained by AdamW, a teacher its moving average.

Modelled on facebookresearch/dino, ``main_dino.py`` (``train_one_epoch``) and ``utils.py``
(``clip_gradients``, ``cancel_gradients_last_layer``, ``cosine_scheduler``), commit
7c446df5b9f45747937fb0d72314eb9f7b66930a. Reproduced, in its order: each iteration sets every
group's ``lr`` and the first group's ``weight_decay`` by hand from per-iteration arrays; the
teacher and student forward passes and the DINO loss (centred, sharpened teacher softmax against
the student's log-softmax) under autocast; ``optimizer.zero_grad()``;
``fp16_scaler.scale(loss).backward()``; ``fp16_scaler.unscale_``; the per-parameter clipping
``p.grad.data.mul_(clip / (norm + 1e-6))`` where that coefficient is below 1; the last layer's
gradients set to None during the first ``freeze_last_layer`` epochs; ``fp16_scaler.step``;
``fp16_scaler.update``; the teacher's EMA update; a checkpoint holding ``fp16_scaler``'s state.

The truth, from reading the original:

- ``gradients-modified-after-unscale``, info, at every step: the per-parameter clipping edits
  the unscaled gradients, as torch's AMP notes allow (not a mistake);
- ``lr-changed-on-skipped-step``, a warning: the ``lr``/``weight_decay`` arrays are indexed by
  the iteration, so a step the scaler skipped still advances them;
- no checkpoint finding: the scaler's state is saved with the rest.
"""

import os

import numpy as np
import torch
from torch import nn

from _real import batches, overflow, parse

args = parse(clip_grad=0.05, freeze_last_layer=1, per_epoch=6)
torch.manual_seed(0)


def head():
    return nn.ModuleDict({"body": nn.Sequential(nn.Linear(16, 32), nn.GELU()), "last_layer": nn.Linear(32, 8)})


def forward(m, x):
    return m["last_layer"](m["body"](x))


student, teacher = head(), head()
teacher.load_state_dict(student.state_dict())
for p in teacher.parameters():
    p.requires_grad = False
regularized = [p for n, p in student.named_parameters() if not n.endswith(".bias")]
not_regularized = [p for n, p in student.named_parameters() if n.endswith(".bias")]
optimizer = torch.optim.AdamW([{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}])
fp16_scaler = torch.amp.GradScaler("cpu")
n_it = args.steps
lr_schedule = 5e-4 * (0.5 * (1 + np.cos(np.pi * np.arange(n_it) / n_it)))
wd_schedule = 0.04 + 0.36 * np.arange(n_it) / n_it
center = torch.zeros(8)

for it, (x, _) in enumerate(batches(n_it)):
    epoch = it // args.per_epoch
    for i, param_group in enumerate(optimizer.param_groups):
        param_group["lr"] = lr_schedule[it]
        if i == 0:
            param_group["weight_decay"] = wd_schedule[it]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        teacher_out = forward(teacher, x)
        student_out = overflow(forward(student, x + 0.1 * torch.randn_like(x)), it in args.inf_at)
        t = torch.softmax((teacher_out.float() - center) / 0.04, dim=-1)
        loss = torch.sum(-t * torch.log_softmax(student_out.float() / 0.1, dim=-1), dim=-1).mean()
    optimizer.zero_grad()
    fp16_scaler.scale(loss).backward()
    fp16_scaler.unscale_(optimizer)
    for p in student.parameters():  # utils.clip_gradients
        if p.grad is not None:
            clip_coef = args.clip_grad / (p.grad.data.norm(2) + 1e-6)
            if clip_coef < 1:
                p.grad.data.mul_(clip_coef)
    if epoch < args.freeze_last_layer:  # utils.cancel_gradients_last_layer
        for n, p in student.named_parameters():
            if "last_layer" in n:
                p.grad = None
    fp16_scaler.step(optimizer)
    fp16_scaler.update()
    with torch.no_grad():
        for param_q, param_k in zip(student.parameters(), teacher.parameters()):
            param_k.data.mul_(0.996).add_(0.004 * param_q.detach().data)
        center = 0.9 * center + 0.1 * teacher_out.float().mean(dim=0)
    if (it + 1) % args.per_epoch == 0:
        torch.save({"student": student.state_dict(), "teacher": teacher.state_dict(),
                    "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                    "fp16_scaler": fp16_scaler.state_dict()}, os.path.join(args.out, "checkpoint.pth"))
