"""nanoGPT's training loop as ``torchrun`` runs it: two DDP ranks, the model compiled.

Modelled on karpathy/nanoGPT, ``train.py``, commit 3adf61e154c3fe3fca428ad6bc3818b27a3b8291, with
``RANK`` set (``ddp``) and ``compile = True``. Reproduced, in its order: ``init_process_group``;
``gradient_accumulation_steps //= ddp_world_size``; a seed per rank (``1337 + seed_offset``);
the GradScaler (``dtype == 'float16'``); the optimizer from ``configure_optimizers`` (AdamW, weight
decay on matrices only) built before ``model = torch.compile(model)`` and ``model = DDP(model)``;
``raw_model = model.module`` (the compiled module); per iteration the learning rate set by hand
from ``get_lr(iter_num)``, the master process's checkpoint of ``raw_model.state_dict()`` and the
optimizer (no scaler state) at every ``eval_interval``; per micro step
``model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)`` (what
``no_sync()`` toggles), the forward under autocast returning ``logits, loss``, the loss divided by
the accumulation steps, ``scaler.scale(loss).backward()``; then ``unscale_``,
``clip_grad_norm_(model.parameters(), grad_clip)``, ``scaler.step``, ``scaler.update``,
``zero_grad(set_to_none=True)``; ``destroy_process_group``.

The ranks differ in data; ``--inf-rank`` chooses the rank whose gradients overflow at
``--inf-at``. DDP averages the gradients of the last micro step across ranks, so an overflow on
either rank makes both skip the step.

The truth, from reading the original with ``dtype='float16'``, is that of the single-process
loop (``nanogpt_train.py``); neither DDP nor the compiled model changes it:

- ``checkpoint-without-scaler``, an error, at every checkpoint: the scaler's state is never saved;
- ``lr-changed-on-skipped-step``, a warning: ``get_lr(iter_num)`` counts skipped iterations too;
- the micro steps without gradient synchronisation are one accumulation window with the synced
  one (each loss divided by the number of micro steps): no accumulation finding.

``--bug clip-before-unscale`` plants the mistake of clipping before ``unscale_``:
``clip-before-unscale``, an error, at every step. ``--backend`` chooses the compiler backend
(``aot_eager`` traces and differentiates the same graph as inductor without generating C++).
"""

import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _ddp import launch
from _real import overflow, parse

args = parse(accum=4, eval_interval=5, inf_rank=1, world=2, compile=1, backend="inductor", bug="none")
vocab, block = 16, 8


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab, 32)
        self.fc = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, vocab)

    def forward(self, idx, targets=None):
        logits = self.lm_head(nn.functional.gelu(self.fc(self.wte(idx))))
        loss = nn.functional.cross_entropy(logits.view(-1, vocab), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=learning_rate, betas=betas)


def get_lr(it, warmup=4, lr_decay_iters=40, learning_rate=6e-4, min_lr=6e-5):
    if it < warmup:
        return learning_rate * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / (lr_decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (learning_rate - min_lr)


def train(ddp_rank, ddp_world_size):
    master_process = ddp_rank == 0
    gradient_accumulation_steps = args.accum // ddp_world_size
    torch.manual_seed(1337 + ddp_rank)
    data = torch.randint(0, vocab, (4096,))

    def get_batch():
        ix = torch.randint(len(data) - block - 1, (4,))
        return torch.stack([data[i:i + block] for i in ix]), torch.stack([data[i + 1:i + 1 + block] for i in ix])

    torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts rank 0's)
    model = GPT()
    scaler = torch.amp.GradScaler("cpu", enabled=True)  # dtype == 'float16' in the original
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
    if args.compile:
        model = torch.compile(model, backend=args.backend)
    model = DDP(model)
    raw_model = model.module
    iter_num, (X, Y) = 0, get_batch()
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0 and master_process and iter_num > 0:
            checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                          "model_args": {"vocab": vocab}, "iter_num": iter_num, "best_val_loss": 1e9,
                          "config": {"dtype": "float16", "compile": bool(args.compile)}}
            torch.save(checkpoint, os.path.join(args.out, "ckpt.pt"))
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            if iter_num in args.inf_at and ddp_rank == args.inf_rank and micro_step == 0:
                loss = overflow(loss, True)
            X, Y = get_batch()
            scaler.scale(loss).backward()
        if args.bug == "clip-before-unscale":  # a planted mistake: the clip sees scaled gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(optimizer)
        if args.bug != "clip-before-unscale":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num >= args.steps:
            break
    dist.barrier()


launch(train, args.world)
