"""nanoGPT's training loop, on a tiny character model on the CPU.

Modelled on karpathy/nanoGPT, ``train.py``, commit 3adf61e154c3fe3fca428ad6bc3818b27a3b8291
(the ``while True`` loop). Reproduced, in its order: the learning rate set by hand into every
param group each iteration from ``get_lr(iter_num)`` (linear warmup, then cosine decay),
counting every iteration; the evaluation and checkpoint at the start of an iteration whose
``iter_num`` is a multiple of ``eval_interval`` (model, optimizer, model_args, iter_num,
best_val_loss, config: no GradScaler state); gradient accumulation, each microbatch's loss
divided by ``gradient_accumulation_steps`` inside the autocast context;
``scaler.scale(loss).backward()``; ``scaler.unscale_`` and ``clip_grad_norm_`` when
``grad_clip != 0``; ``scaler.step``; ``scaler.update``; ``zero_grad(set_to_none=True)``. AdamW
over two groups (weight decay on matrices only), as ``GPT.configure_optimizers`` builds them.

The truth, from reading the original with ``dtype='float16'`` (its GradScaler enabled):

- ``checkpoint-without-scaler``, an error, at every checkpoint: the scaler's state is never
  saved, so ``init_from='resume'`` restarts the loss scale at 65536 (a real bug);
- ``lr-changed-on-skipped-step``, a warning: ``get_lr(iter_num)`` advances on iterations whose
  step the scaler skipped (the schedule runs ahead of the applied updates).
"""

import math
import os

import torch
from torch import nn

from _real import overflow, parse

args = parse(accum=2, eval_interval=5)
torch.manual_seed(0)
vocab, block = 16, 8
model = nn.Sequential(nn.Embedding(vocab, 32), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, vocab))
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=6e-4, betas=(0.9, 0.95))
scaler = torch.amp.GradScaler("cpu", enabled=True)  # dtype == 'float16' in the original
g = torch.Generator().manual_seed(1)
data = torch.randint(0, vocab, (4096,), generator=g)


def get_batch():
    ix = torch.randint(len(data) - block - 1, (4,), generator=g)
    return torch.stack([data[i:i + block] for i in ix]), torch.stack([data[i + 1:i + 1 + block] for i in ix])


def get_lr(it, warmup=4, lr_decay_iters=40, learning_rate=6e-4, min_lr=6e-5):
    if it < warmup:
        return learning_rate * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / (lr_decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (learning_rate - min_lr)


iter_num, X, Y = 0, *get_batch()
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % args.eval_interval == 0 and iter_num > 0:
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "model_args": {"vocab": vocab},
                      "iter_num": iter_num, "best_val_loss": 1e9, "config": {"dtype": "float16"}}
        torch.save(checkpoint, os.path.join(args.out, "ckpt.pt"))
    for micro_step in range(args.accum):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = overflow(model(X), iter_num in args.inf_at and micro_step == 0)
            loss = nn.functional.cross_entropy(logits.view(-1, vocab), Y.view(-1))
            loss = loss / args.accum
        X, Y = get_batch()
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    if iter_num >= args.steps:
        break
