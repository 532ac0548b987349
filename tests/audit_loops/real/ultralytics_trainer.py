"""Ultralytics' trainer: the LR scheduler set back one epoch and stepped at each epoch's start,
warmup written by hand, and a resume from ``last.pt``.

Modelled on ultralytics/ultralytics, ``ultralytics/engine/trainer.py`` (``_setup_scheduler``,
``_get_warmup_iterations``, ``_build_train_pipeline``, ``build_optimizer``, ``_setup_train``,
``resume_training``, ``_load_checkpoint_state``, ``_do_train``, ``optimizer_step``,
``save_model``), commit 00016300105e79eb8b1646ab03c3d1df9274523f. Reproduced, in its order: SGD
(Nesterov) over three tagged groups (``param_group`` "weight" with decay, "bn", "bias"); the
linear ``lf`` and ``LambdaLR(optimizer, lr_lambda=lf)``; the GradScaler and the EMA; on resume
the optimizer, scaler and EMA loaded from the checkpoint and ``start_epoch = epoch + 1``; then
``scheduler.last_epoch = start_epoch - 1`` (the constructor left it at 0; a fresh run sets it to
-1); ``nw = round(min(warmup_epochs, epochs - 1) * nb)``; ``optimizer.zero_grad()``. Per epoch
``scheduler.step()`` first (its warning about the order silenced, as the original does), which
brings a fresh run's scheduler back to the position it was built at; per batch ``ni = i + nb *
epoch`` and, while ``ni < nw``, every group's ``lr`` interpolated in ``ni`` towards
``initial_lr * lf(epoch)`` (the bias group's falling from ``warmup_bias_lr``) and its
``momentum`` from ``warmup_momentum``; the forward and loss under autocast;
``scaler.scale(loss).backward()``; when ``ni - last_opt_step >= accumulate``: ``unscale_``,
``clip_grad_norm_(max_norm=10.0)``, ``scaler.step``, ``scaler.update``, ``zero_grad``, the EMA
update. After each epoch ``save_model``: ``torch.save`` into a buffer of epoch, EMA, updates,
optimizer state, **scaler state** and arguments, written to ``last.pt``. Here ``nbs`` equals the
batch size, so that every batch steps (the original accumulates up to ``nbs / batch``), and the
optimizer state is saved as it is (the original halves its tensors).

``--epochs`` and ``--batches`` (per epoch) set the length; ``--steps`` is unused. ``--resume-at
R`` (0: none) stops the run after epoch R - 1, as an interrupted run would, and a second trainer
resumes it from ``last.pt`` (its optimizer's steps are numbered from 0 again). ``--inf-at`` names
batches ``ni``, counted over both runs.

The truth, from reading the original:

- the scheduler is stepped once per epoch, at the epoch's start: a fresh run's first
  ``scheduler.step()`` returns it to its built position, a resumed run's moves it to its
  ``start_epoch``, both before any optimizer step; an epoch that applied updates earned its
  advance: no ``scheduler-on-skipped-step``;
- ``lr-changed-on-skipped-step``, a warning: the warmup interpolates in ``ni`` (batches), so it
  advances across every skipped step during warmup, including the last step of an epoch (where
  ``scheduler.step()`` ran too, and the warmup then overwrote its rate); after warmup the rate is
  the scheduler's alone;
- the checkpoint holds the scaler's state: no checkpoint finding.

``--bug scheduler-per-step`` plants ``scheduler.step()`` after every optimizer step (instead of
at the epoch's start): ``scheduler-on-skipped-step``, an error, at every skipped step.
"""

import copy
import io
import os
import warnings

import numpy as np
import torch
from torch import nn

from _real import overflow, parse

args = parse(epochs=4, batches=3, batch=8, resume_at=0, bug="none")
hyp = {"lr0": 0.01, "lrf": 0.01, "momentum": 0.937, "weight_decay": 5e-4, "warmup_epochs": 3.0,
       "warmup_momentum": 0.8, "warmup_bias_lr": 0.1, "nbs": args.batch}
nc = 3
g = torch.Generator().manual_seed(1)
data = [(torch.rand(args.batch, 3, 8, 8, generator=g), torch.rand(args.batch, 4 + nc, generator=g))
        for _ in range(args.batches)]
last = os.path.join(args.out, "last.pt")


def detector():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4 + nc))


def build_optimizer(model, lr, momentum, decay):
    weight, bn, bias = [], [], []
    norms = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    for _, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if "bias" in param_name:
                bias.append(param)
            elif isinstance(module, norms):
                bn.append(param)
            else:
                weight.append(param)
    common = {"lr": lr, "momentum": momentum, "nesterov": True}
    return torch.optim.SGD([{"params": weight, **common, "weight_decay": decay, "param_group": "weight"},
                            {"params": bn, **common, "weight_decay": 0.0, "param_group": "bn"},
                            {"params": bias, **common, "param_group": "bias"}])


class ModelEMA:
    def __init__(self, model, decay=0.9999, tau=2000):
        self.ema = copy.deepcopy(model).eval().requires_grad_(False)
        self.updates, self.decay = 0, lambda x: decay * (1 - np.exp(-x / tau))

    def update(self, model):
        self.updates += 1
        d = self.decay(self.updates)
        msd = model.state_dict()
        with torch.no_grad():
            for k, v in self.ema.state_dict().items():
                if v.dtype.is_floating_point:
                    v *= d
                    v += (1 - d) * msd[k].detach()


def loss_fn(pred, targets):
    box = nn.functional.mse_loss(pred[:, :4].float().sigmoid(), targets[:, :4])
    cls = nn.functional.binary_cross_entropy_with_logits(pred[:, 4:].float(), (targets[:, 4:] > 0.5).float())
    return torch.stack((box, cls)) * pred.shape[0]


def train(ckpt, stop_after):
    torch.manual_seed(0)
    model = detector()
    epochs, nb = args.epochs, len(data)
    accumulate = max(round(hyp["nbs"] / args.batch), 1)
    weight_decay = hyp["weight_decay"] * args.batch * accumulate / hyp["nbs"]
    optimizer = build_optimizer(model, hyp["lr0"], hyp["momentum"], weight_decay)

    def lf(x):
        return max(1 - x / epochs, 0) * (1.0 - hyp["lrf"]) + hyp["lrf"]

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    ema = ModelEMA(model)
    start_epoch = 0
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        ema.ema.load_state_dict(ckpt["ema"].float().state_dict())
        ema.updates = ckpt["updates"]
        model.load_state_dict(ckpt["ema"].float().state_dict())
        start_epoch = ckpt["epoch"] + 1
    scheduler.last_epoch = start_epoch - 1
    nw = round(min(hyp["warmup_epochs"], max(epochs - 1, 0)) * nb)
    last_opt_step = -1
    optimizer.zero_grad()
    for epoch in range(start_epoch, stop_after):
        if args.bug != "scheduler-per-step":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scheduler.step()
        model.train()
        for i, (imgs, targets) in enumerate(data):
            ni = i + nb * epoch
            if ni < nw:
                xi = [0, nw]
                accumulate = max(1, int(np.interp(ni, xi, [1, hyp["nbs"] / args.batch]).round()))
                for x in optimizer.param_groups:
                    x["lr"] = float(np.interp(ni, xi, [hyp["warmup_bias_lr"] if x.get("param_group") == "bias" else 0.0,
                                                       x["initial_lr"] * lf(epoch)]))
                    if "momentum" in x:
                        x["momentum"] = float(np.interp(ni, xi, [hyp["warmup_momentum"], hyp["momentum"]]))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pred = overflow(model(imgs), ni in args.inf_at)
                loss = loss_fn(pred, targets).sum()
            scaler.scale(loss).backward()
            if ni - last_opt_step >= accumulate:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                ema.update(model)
                if args.bug == "scheduler-per-step":  # a planted mistake: the schedule follows iterations
                    scheduler.step()
                last_opt_step = ni
        buffer = io.BytesIO()
        torch.save({"epoch": epoch, "best_fitness": 0.0, "model": None, "ema": copy.deepcopy(ema.ema).half(),
                    "updates": ema.updates, "optimizer": copy.deepcopy(optimizer.state_dict()),
                    "scaler": scaler.state_dict(), "train_args": vars(args)}, buffer)
        with open(last, "wb") as f:
            f.write(buffer.getvalue())


if args.resume_at:
    train(None, args.resume_at)  # interrupted after epoch resume_at - 1
    train(torch.load(last, weights_only=False), args.epochs)
else:
    train(None, args.epochs)
