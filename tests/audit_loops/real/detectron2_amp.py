"""detectron2's AMPTrainer with its LR scheduler hook and gradient clipping by optimizer subclass.

Modelled on facebookresearch/detectron2, commit 02b5c4e295e990042a714712c21dc79b731e8833:
``detectron2/engine/train_loop.py`` (``AMPTrainer.run_step``, ``state_dict``),
``detectron2/engine/hooks.py`` (``LRScheduler.after_step``), ``detectron2/solver/build.py``
(``_generate_optimizer_class_with_gradient_clipping``: a subclass made with ``type()`` whose
``step`` clips every gradient by norm, then calls the parent's) and
``detectron2/solver/lr_scheduler.py`` (``LRMultiplier``, a torch ``LRScheduler``).
Reproduced, in its order: ``zero_grad``; the model's dict of losses summed under autocast;
``grad_scaler.scale(losses).backward()``; ``grad_scaler.step(optimizer)`` (the subclass's step
clips inside it, after the scaler's unscale); ``grad_scaler.update()``; the hook's
``scheduler.step()`` after every iteration; periodic checkpoints of the trainer's state
(model, optimizer, scheduler, iteration and ``grad_scaler``).

The truth, from reading the original: ``scheduler-on-skipped-step``, an error, at every step
the scaler skipped: the hook steps the schedule after every iteration, applied or not (a real
bug). The clipping inside the step sees unscaled gradients; the checkpoints hold the scaler.
"""

import os

import torch
from torch import nn

from _real import batches, overflow, parse

args = parse(period=6)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def optimizer_wgc_step(self, closure=None):
    for group in self.param_groups:
        for p in group["params"]:
            torch.nn.utils.clip_grad_norm_(p, 1.0)
    super(type(self), self).step(closure)


OptimizerWithGradientClip = type("SGDWithGradientClip", (torch.optim.SGD,), {"step": optimizer_wgc_step})
optimizer = OptimizerWithGradientClip(model.parameters(), lr=0.02, momentum=0.9)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: min(1.0, (it + 1) / 4))  # LRMultiplier's role
grad_scaler = torch.amp.GradScaler("cpu")

for it, (x, y) in enumerate(batches(args.steps)):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = overflow(model(x), it in args.inf_at)
        loss_dict = {"loss_cls": nn.functional.cross_entropy(out, y), "loss_reg": 0.1 * out.float().pow(2).mean()}
        losses = sum(loss_dict.values())
    grad_scaler.scale(losses).backward()
    grad_scaler.step(optimizer)
    grad_scaler.update()
    scheduler.step()  # hooks.LRScheduler.after_step, every iteration
    if (it + 1) % args.period == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "iteration": it,
                    "grad_scaler": grad_scaler.state_dict()}, os.path.join(args.out, f"model_{it:07d}.pth"))
