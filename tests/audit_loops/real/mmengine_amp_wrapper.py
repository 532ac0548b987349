"""MMEngine's ``AmpOptimWrapper`` under its epoch-based loop: the GradScaler's state saved inside
the optimizer wrapper's state.

Modelled on open-mmlab/mmengine: ``mmengine/optim/optimizer/amp_optimizer_wrapper.py``
(``AmpOptimWrapper``: ``backward``, ``step``, ``state_dict``, ``load_state_dict``, ``optim_context``),
commit 0200622c09c64a2f19aaa3aae87dcf051e04ca70, with ``OptimWrapper.update_params`` and
``state_dict``, ``BaseModel.train_step``, ``EpochBasedTrainLoop``, ``ParamSchedulerHook``,
``CheckpointHook`` and ``Runner.save_checkpoint`` (``mmengine/runner/runner.py``, commit
8593691c1ae8b12a0bbc8a9111580ee55f6a5218). Reproduced, in its order: the wrapper holds the
optimizer and a ``GradScaler`` (``loss_scale="dynamic"``) and clips with ``clip_grad=dict(max_norm=
35, norm_type=2)``; per iteration ``train_step``: under ``optim_context`` (autocast) the forward
and the loss, then ``update_params``: the loss divided by the accumulation count (1),
``loss_scaler.scale(loss).backward()``, then ``step``: ``unscale_``, ``clip_grad_norm_``,
``loss_scaler.step(optimizer)``, ``loss_scaler.update()``, and ``zero_grad``. After each epoch the
epoch-based parameter scheduler steps (a multi-step decay of ``lr`` written into the groups, as
MMEngine's schedulers do: they are no torch ``LRScheduler``) and the checkpoint hook saves
``{"meta", "state_dict", "message_hub", "optimizer": optim_wrapper.state_dict(),
"param_schedulers"}``, where the wrapper's state is the optimizer's ``state_dict()`` with a
``loss_scaler`` entry added: the scaler's state, one level inside the optimizer's.

``--epochs`` and ``--batches`` (per epoch) set the length; ``--steps`` is unused.

The truth, from reading the original:

- the scaler's state is in every checkpoint, under ``optimizer`` / ``loss_scaler``: no
  ``checkpoint-without-scaler``;
- the epoch-based scheduler changes ``lr`` only at its milestone (after epoch 1), and the
  skipped steps chosen here are not an epoch's last: no schedule finding.

``--bug checkpoint-without-scaler`` plants the plain ``OptimWrapper.state_dict()`` (the optimizer's
state alone, as a wrapper that does not add the scaler saves it): ``checkpoint-without-scaler``,
an error, at every checkpoint.
"""

import os

import torch
from torch import nn

from _real import overflow, parse

args = parse(epochs=3, batches=4, bug="none")


class AmpOptimWrapper:
    def __init__(self, optimizer, clip_grad=None, accumulative_counts=1):
        self.optimizer = optimizer
        self.clip_grad_kwargs = clip_grad or {}
        self._accumulative_counts = accumulative_counts
        self._inner_count = 0
        self._scale_update_param = None
        self.loss_scaler = torch.amp.GradScaler("cpu")

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def optim_context(self):
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def update_params(self, loss):
        loss = loss / self._accumulative_counts
        self.backward(loss)
        if self._inner_count % self._accumulative_counts == 0:
            self.step()
            self.zero_grad()

    def backward(self, loss):
        self.loss_scaler.scale(loss).backward()
        self._inner_count += 1

    def step(self):
        if self.clip_grad_kwargs:
            self.loss_scaler.unscale_(self.optimizer)
            params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            nn.utils.clip_grad_norm_(params, **self.clip_grad_kwargs)
        self.loss_scaler.step(self.optimizer)
        self.loss_scaler.update(self._scale_update_param)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def state_dict(self):
        state_dict = self.optimizer.state_dict()  # OptimWrapper.state_dict
        if args.bug != "checkpoint-without-scaler":
            state_dict["loss_scaler"] = self.loss_scaler.state_dict()
        return state_dict


class MultiStepLR:
    """An epoch-based parameter scheduler: writes ``lr`` into the groups at its milestones."""

    def __init__(self, optim_wrapper, milestones, gamma=0.1):
        self.optim_wrapper, self.milestones, self.gamma = optim_wrapper, milestones, gamma
        self.last_step = 0
        self.by_epoch = True

    def step(self):
        self.last_step += 1
        if self.last_step in self.milestones:
            for group in self.optim_wrapper.param_groups:
                group["lr"] = group["lr"] * self.gamma

    def state_dict(self):
        return {"milestones": self.milestones, "gamma": self.gamma, "last_step": self.last_step}


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def train_step(self, data, optim_wrapper, overflowing):
        with optim_wrapper.optim_context():
            logits = overflow(self.head(self.backbone(data[0])), overflowing)
            loss = nn.functional.cross_entropy(logits.float(), data[1])
        optim_wrapper.update_params(loss)
        return {"loss": loss.detach()}


torch.manual_seed(0)
model = Classifier()
optim_wrapper = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4),
                                clip_grad=dict(max_norm=35, norm_type=2))
param_schedulers = [MultiStepLR(optim_wrapper, milestones=[2])]
g = torch.Generator().manual_seed(1)
w = torch.randn(16, 4, generator=g)
data = []
for _ in range(args.batches):
    x = torch.randn(8, 16, generator=g)
    data.append((x, (x @ w).argmax(1)))
it = 0
for epoch in range(args.epochs):
    model.train()
    for batch in data:
        model.train_step(batch, optim_wrapper, it in args.inf_at)
        it += 1
    for scheduler in param_schedulers:
        if scheduler.by_epoch:
            scheduler.step()
    checkpoint = {"meta": {"epoch": epoch + 1, "iter": it}, "state_dict": model.state_dict(),
                  "message_hub": {"log_scalars": {}, "runtime_info": {"epoch": epoch + 1, "iter": it}},
                  "optimizer": optim_wrapper.state_dict(),
                  "param_schedulers": [s.state_dict() for s in param_schedulers]}
    torch.save(checkpoint, os.path.join(args.out, f"epoch_{epoch + 1}.pth"))
