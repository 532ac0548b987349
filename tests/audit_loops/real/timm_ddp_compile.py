"""timm's training loop under ``torchrun`` with ``--torchcompile``: two DDP ranks, the model
compiled before DDP, ``no_sync()`` on the batches that only accumulate.

Modelled on huggingface/pytorch-image-models, commit aa4b5850c1543fa488abf260f18390eda46cf85d:
``train.py`` (``main`` and ``train_one_epoch``), ``timm/task/classification.py``
(``ClassificationTask``: ``compile``, ``prepare_distributed``, ``forward``), ``timm/task/task.py``
(``no_sync``), ``timm/utils/cuda.py`` (``NativeScaler.__call__``) and
``timm/utils/checkpoint_saver.py`` (``_save``), run with ``--grad-accum-steps 2 --torchcompile``
and the default per-epoch schedule. Reproduced, in its order: the task compiled
(``torch.compile``) and then wrapped in ``DistributedDataParallel``; ``has_no_sync``; per epoch
``accum_steps``, ``last_accum_steps = len(loader) % accum_steps`` (the last window of an epoch
with fewer batches is one of ``last_accum_steps`` batches, its loss divided by that), and
``optimizer.zero_grad()``; per batch ``need_update``, then, when not ``need_update``, the forward
and backward inside ``task.no_sync()``: the forward under autocast, the loss divided in place by
``accum_steps`` when above 1, the loss scaler's ``scale(loss).backward()`` and, with
``need_update``, with ``--clip-grad`` ``unscale_`` and ``clip_grad_norm_``, then ``step`` and
``update``; after
an update ``num_updates += 1``, ``zero_grad``, the EMA update. After each epoch the scheduler's
``step(epoch + 1)``, which writes each group's ``lr`` (timm's own ``Scheduler``, not torch's), and
the primary rank's checkpoint: the optimizer, the unwrapped model's state and ``amp_scaler``.

``--epochs`` and ``--batches`` (per rank and epoch) set the length; ``--steps`` is unused. Rank
1's gradients overflow in the windows of the updates ``--inf-at`` names.

The truth, from reading the original: no finding. The ``no_sync`` batches and the synced one
form one window whose losses are each divided by the window's size (two, or one for the short
last window); the checkpoint holds the scaler; the schedule is a function of the epoch, and
the overflows here fall inside epochs, so no learning rate changes across a skipped step.
With ``--clip-grad`` the same. ``--bug clip-before-unscale`` plants the mistake of clipping before
``unscale_``: ``clip-before-unscale``, an error, at every step.
"""

import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from _ddp import launch
from _real import overflow, parse

args = parse(epochs=4, batches=5, grad_accum_steps=2, world=2, torchcompile="inductor", clip_grad=0.0, bug="none")


class ClassificationTask(nn.Module):
    def __init__(self, model, criterion):
        super().__init__()
        self.trainable_module, self.criterion = model, criterion

    def prepare_distributed(self):
        self.trainable_module = nn.parallel.DistributedDataParallel(self.trainable_module)
        return self

    def compile(self, backend):
        self.trainable_module = torch.compile(self.trainable_module, backend=backend)
        return self.trainable_module

    def no_sync(self):
        return self.trainable_module.no_sync()

    def forward(self, input, target):
        output = self.trainable_module(input)
        return {"loss": self.criterion(output, target), "output": output}


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.amp.GradScaler("cpu")

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, need_update=True):
        self._scaler.scale(loss).backward()
        if need_update:
            if clip_grad is not None:
                if args.bug == "clip-before-unscale":  # a planted mistake: the clip sees scaled gradients
                    torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
                self._scaler.unscale_(optimizer)
                if args.bug != "clip-before-unscale":
                    torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()


def unwrap_model(model):
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def scheduler_step(optimizer, epoch, base_lr=0.05, t_initial=8):
    for param_group in optimizer.param_groups:
        param_group["lr"] = 0.5 * base_lr * (1 + math.cos(math.pi * epoch / t_initial))


def train_one_epoch(epoch, task, loader, optimizer, loss_scaler, ema, rank, overflow_at):
    has_no_sync = hasattr(task.trainable_module, "no_sync")
    accum_steps = args.grad_accum_steps
    last_accum_steps = len(loader) % accum_steps
    updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
    num_updates = epoch * updates_per_epoch
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps
    optimizer.zero_grad()
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps

        def _forward(input=input, target=target, accum_steps=accum_steps, on=num_updates in overflow_at and rank == 1):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                result = task(input, target)
                _loss = overflow(result["loss"], on)
            if accum_steps > 1:
                _loss /= accum_steps
            return _loss

        clip = {"clip_grad": args.clip_grad or None, "parameters": task.parameters() if args.clip_grad else None}
        if has_no_sync and not need_update:
            with task.no_sync():
                loss_scaler(_forward(), optimizer, **clip, need_update=need_update)
        else:
            loss_scaler(_forward(), optimizer, **clip, need_update=need_update)
        if not need_update:
            continue
        num_updates += 1
        optimizer.zero_grad()
        ema.update_parameters(unwrap_model(task.trainable_module))


def main(rank, world_size):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4, generator=g)
    x = torch.randn(args.batches * 4 * world_size, 16, generator=g)
    dataset = TensorDataset(x, (x @ w).argmax(1))
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    task = ClassificationTask(model, nn.CrossEntropyLoss())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.05)
    loss_scaler = NativeScaler()
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99))
    if args.torchcompile:
        task.compile(backend=args.torchcompile)
    task.prepare_distributed()
    scheduler_step(optimizer, 0)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_one_epoch(epoch, task, loader, optimizer, loss_scaler, ema, rank, args.inf_at)
        scheduler_step(optimizer, epoch + 1)
        if rank == 0:
            save_state = {"epoch": epoch, "arch": "mlp", "optimizer": optimizer.state_dict(), "version": 2,
                          loss_scaler.state_dict_key: loss_scaler.state_dict(),
                          "state_dict": unwrap_model(task.trainable_module).state_dict()}
            torch.save(save_state, os.path.join(args.out, "last.pth.tar"))
    dist.barrier()


launch(main, args.world)
