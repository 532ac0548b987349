"""torchvision's classification reference with ``--amp`` under ``torchrun``: two DDP ranks.

Modelled on pytorch/vision, ``references/classification/train.py``, commit
017e9b99b5daddec3d82d5b05fe26f6834c48fa9 (``train_one_epoch`` and ``main``, run with ``--amp
--model-ema --clip-grad-norm 1``). Reproduced, in its order: the process group
(``utils.init_distributed_mode``); a ``DistributedSampler`` with ``set_epoch`` each epoch; SGD
(momentum 0.9, weight decay 1e-4), ``torch.cuda.amp.GradScaler()``, ``StepLR``; the model wrapped in
``DistributedDataParallel`` after the optimizer, ``model_without_ddp = model.module``; the EMA
(an ``AveragedModel`` of ``model_without_ddp``) updated every ``model_ema_steps`` iterations and
reset during warmup epochs. Per batch: the forward **outside** autocast, ``optimizer.zero_grad()``,
only the criterion under autocast, ``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``,
``scaler.update()``; then, for every run (the ``if args.amp`` branch ends before them),
``clip_grad_norm_`` over the optimizer's parameters and ``optimizer.step()`` once more. After
each epoch ``lr_scheduler.step()`` and, on the master, a checkpoint of the model, optimizer,
scheduler, epoch and args (no scaler state).

``--epochs`` and ``--batches`` (per rank and epoch) set the length: two optimizer steps a batch;
``--steps`` is unused. Rank 1's gradients overflow at the batches ``--inf-at`` names.

The truth, from reading the original with ``--amp``:

- every iteration steps the optimizer twice: through the scaler, then ``optimizer.step()``
  again on the gradients the scaler has unscaled. The second step bypasses the scaler
  (``step-bypasses-scaler``, an error, at every iteration); on an iteration whose gradients
  overflowed, the scaler skips its step but the second one applies the inf gradients, and
  the parameters become NaN (a real bug);
- ``checkpoint-without-scaler``, an error, at every checkpoint: the scaler's state is not saved;
- the clip after the step sees unscaled gradients: no clipping finding;
- ``lr_scheduler.step()`` per epoch follows applied steps: no scheduler finding.

``--fixed 1`` arranges the step as PyTorch's AMP recipe does (``unscale_`` and the clip inside the
AMP branch, the plain ``optimizer.step()`` only without AMP): then only ``checkpoint-without-scaler``.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from _ddp import launch
from _real import overflow, parse

args = parse(epochs=3, batches=4, model_ema_steps=2, lr_warmup_epochs=1, clip_grad_norm=1.0, world=2, fixed=0)


class ExponentialMovingAverage(AveragedModel):
    def __init__(self, model, decay):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, avg_fn=ema_avg, use_buffers=True)


def train_one_epoch(model, criterion, optimizer, data_loader, epoch, model_ema, scaler, rank, done):
    model.train()
    for i, (image, target) in enumerate(data_loader):
        output = model(image)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = criterion(overflow(output, done + i in args.inf_at and rank == 1), target)
        scaler.scale(loss).backward()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if args.fixed:  # the AMP recipe's arrangement: unscale_ and clip inside the AMP branch, one step
            if args.clip_grad_norm:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(params, args.clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
        else:
            scaler.step(optimizer)
            scaler.update()
            if args.clip_grad_norm:
                nn.utils.clip_grad_norm_(params, args.clip_grad_norm)
            optimizer.step()
        if model_ema and i % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < args.lr_warmup_epochs:
                model_ema.n_averaged.fill_(0)


def main(rank, world_size):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3 * 8 * 8, 4, generator=g)
    images = torch.randn(args.batches * 4 * world_size, 3, 8, 8, generator=g)
    dataset = TensorDataset(images, (images.flatten(1) @ w).argmax(1))
    train_sampler = DistributedSampler(dataset)
    data_loader = DataLoader(dataset, batch_size=4, sampler=train_sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    model = nn.parallel.DistributedDataParallel(model)
    model_without_ddp = model.module
    model_ema = ExponentialMovingAverage(model_without_ddp, decay=0.99)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, optimizer, data_loader, epoch, model_ema, scaler, rank,
                        epoch * args.batches)
        lr_scheduler.step()
        if rank == 0:
            checkpoint = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                          "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": vars(args),
                          "model_ema": model_ema.state_dict()}
            torch.save(checkpoint, os.path.join(args.out, f"model_{epoch}.pth"))
            torch.save(checkpoint, os.path.join(args.out, "checkpoint.pth"))
    dist.barrier()


launch(main, args.world)
