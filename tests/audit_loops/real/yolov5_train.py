"""YOLOv5's training loop under ``torchrun``: two DDP ranks, warmup by hand, a varying
accumulation and a checkpoint without the scaler.

Modelled on ultralytics/yolov5, commit 5081342f04fb287fc2e5f2b5a4e06752b7937b1c: ``train.py``
(``train``) and ``utils/torch_utils.py`` (``smart_optimizer``, ``ModelEMA``). Reproduced, in its
order: ``accumulate = max(round(nbs / batch_size), 1)`` and the weight decay scaled by
``batch_size * accumulate / nbs``; SGD (Nesterov) over three groups, biases first, then weights
with decay, then normalisation weights; ``LambdaLR`` with the linear ``lf``; the EMA on rank 0;
``last_opt_step = -1``; the GradScaler; the model in DDP. Per epoch ``sampler.set_epoch`` and
``optimizer.zero_grad()``; per batch ``ni = i + nb * epoch``, and while ``ni <= nw`` the warmup
written by hand: ``accumulate`` interpolated from 1 to ``nbs / batch_size`` and every group's
``lr`` (the bias group's falling from ``warmup_bias_lr``) and ``momentum`` interpolated in ``ni``;
the forward and ``compute_loss`` under autocast (box, objectness and class losses summed and
multiplied by the batch size), ``loss *= WORLD_SIZE``; ``scaler.scale(loss).backward()``; when
``ni - last_opt_step >= accumulate``: ``unscale_``, ``clip_grad_norm_(max_norm=10.0)``,
``scaler.step``, ``scaler.update``, ``zero_grad``, the EMA update. After the epoch
``scheduler.step()`` and, on rank 0, the checkpoint: epoch, model, EMA, updates, optimizer (no
scaler state).

``--epochs`` and ``--batches`` (per rank and epoch) set the length, the warmup the number of
steps; ``--steps`` is unused. Rank 1's gradients overflow at the batches ``--inf-at`` names.

The truth, from reading the original:

- ``lr-changed-on-skipped-step``, a warning: the warmup interpolates in ``ni`` (batches), so it
  advances across steps the scaler skipped (``nw`` is at least 100 batches: the whole run here
  is warmup);
- ``checkpoint-without-scaler``, an error, at every checkpoint: ``smart_resume`` restores the
  optimizer and EMA but a resumed run restarts the loss scale;
- the accumulated losses are multiplied by the batch size (a sum over the nominal batch, which
  the weight decay scaling assumes), not left undivided: no accumulation finding;
- ``scheduler.step()`` once per epoch, after applied steps: no scheduler finding;
- ``zero-grad-in-window``, an error, at the first step of an epoch whose previous epoch ended
  inside an accumulation window: the epoch's ``optimizer.zero_grad()`` discards the gradients
  of those last batches, which never reach a step (a real, small loss of data each epoch; here
  the ninth batch of epoch 0, at an accumulation of 2).

``--bug update-without-step`` plants ``optimizer.step()`` in place of ``scaler.step``:
``update-without-step``, an error, at every step.
"""

import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from _ddp import launch
from _real import overflow, parse

args = parse(epochs=2, batches=9, batch_size=4, world=2, bug="none")
hyp = {"lr0": 0.01, "lrf": 0.01, "momentum": 0.937, "weight_decay": 5e-4, "warmup_epochs": 3.0,
       "warmup_momentum": 0.8, "warmup_bias_lr": 0.1}
nc = 3


def smart_optimizer(model, lr, momentum, decay):
    g = [], [], []
    bn = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    for v in model.modules():
        for p_name, p in v.named_parameters(recurse=False):
            if p_name == "bias":
                g[2].append(p)
            elif p_name == "weight" and isinstance(v, bn):
                g[1].append(p)
            else:
                g[0].append(p)
    optimizer = torch.optim.SGD(g[2], lr=lr, momentum=momentum, nesterov=True)
    optimizer.add_param_group({"params": g[0], "weight_decay": decay})
    optimizer.add_param_group({"params": g[1], "weight_decay": 0.0})
    return optimizer


class ModelEMA:
    def __init__(self, model, decay=0.9999, tau=2000):
        self.ema = _detector()
        self.ema.load_state_dict(model.state_dict())
        self.ema.eval().requires_grad_(False)
        self.updates, self.decay = 0, lambda x: decay * (1 - np.exp(-x / tau))

    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = model.module.state_dict()
        with torch.no_grad():
            for k, v in self.ema.state_dict().items():
                if v.dtype.is_floating_point:
                    v *= d
                    v += (1 - d) * msd[k].detach()


def _detector():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 5 + nc))


def compute_loss(pred, targets):
    bs = pred.shape[0]
    lbox = nn.functional.mse_loss(pred[:, :4].float().sigmoid(), targets[:, :4])
    lobj = nn.functional.binary_cross_entropy_with_logits(pred[:, 4].float(), targets[:, 4])
    lcls = nn.functional.binary_cross_entropy_with_logits(pred[:, 5:].float(), targets[:, 5:])
    return (lbox + lobj + lcls) * bs, torch.stack((lbox, lobj, lcls)).detach()


def train(RANK, WORLD_SIZE):
    g = torch.Generator().manual_seed(1)
    imgs = torch.rand(args.batches * args.batch_size * WORLD_SIZE, 3, 8, 8, generator=g)
    targets = torch.cat([torch.rand(len(imgs), 4, generator=g), (torch.rand(len(imgs), 1 + nc, generator=g) > 0.5)
                         .float()], 1)
    dataset = TensorDataset(imgs, targets)
    sampler = DistributedSampler(dataset)
    train_loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    torch.manual_seed(0)
    model = _detector()
    batch_size, epochs = args.batch_size, args.epochs
    nbs = 64
    accumulate = max(round(nbs / batch_size), 1)
    hyp["weight_decay"] *= batch_size * accumulate / nbs
    optimizer = smart_optimizer(model, hyp["lr0"], hyp["momentum"], hyp["weight_decay"])

    def lf(x):
        return (1 - x / epochs) * (1.0 - hyp["lrf"]) + hyp["lrf"]

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model) if RANK in {-1, 0} else None
    nb = len(train_loader)
    nw = max(round(hyp["warmup_epochs"] * nb), 100)
    last_opt_step = -1
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    model = nn.parallel.DistributedDataParallel(model)
    for epoch in range(epochs):
        model.train()
        sampler.set_epoch(epoch)
        optimizer.zero_grad()
        for i, (imgs, targets) in enumerate(train_loader):
            ni = i + nb * epoch
            if ni <= nw:
                xi = [0, nw]
                accumulate = max(1, np.interp(ni, xi, [1, nbs / batch_size]).round())
                for j, x in enumerate(optimizer.param_groups):
                    x["lr"] = np.interp(ni, xi, [hyp["warmup_bias_lr"] if j == 0 else 0.0, x["initial_lr"] * lf(epoch)])
                    if "momentum" in x:
                        x["momentum"] = np.interp(ni, xi, [hyp["warmup_momentum"], hyp["momentum"]])
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pred = overflow(model(imgs), ni in args.inf_at and RANK == 1)
                loss, _loss_items = compute_loss(pred, targets)
                loss *= WORLD_SIZE
            scaler.scale(loss).backward()
            if ni - last_opt_step >= accumulate:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                if args.bug == "update-without-step":  # a planted mistake: the step bypasses the scaler
                    optimizer.step()
                else:
                    scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                if ema:
                    ema.update(model)
                last_opt_step = ni
        scheduler.step()
        if RANK in {-1, 0}:
            ckpt = {"epoch": epoch, "best_fitness": 0.0, "model": model.module.state_dict(),
                    "ema": ema.ema.state_dict(), "updates": ema.updates, "optimizer": optimizer.state_dict(),
                    "opt": vars(args)}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
    dist.barrier()


launch(train, args.world)
