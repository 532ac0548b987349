"""A whole AMP train step compiled with its GradScaler: ``zero_grad``, the forward under bf16
autocast, ``scaler.scale(loss).backward()``, ``scaler.unscale_``, ``clip_grad_norm_``,
``scaler.step`` and ``scaler.update`` in one ``torch.compile``d function, the order of torch's
AMP examples ("Working with unscaled gradients"). GradScaler's methods are functions torch keeps
Dynamo out of: they run eagerly at graph breaks of torch's own, and so do the audit's wrappers
of them. The clip between ``unscale_`` and ``scaler.step`` is traced into a graph, where the
audit does not see it as a clip: its effect is reported as ``gradients-modified-after-unscale``
(info, with the norm ratio) and every step is replayed from the clipped gradients.
"""

import torch
from torch import nn

from _common import batches, make_model, parse

args = parse((), clip=1.0)

model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)


def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    if args.clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    scaler.step(opt)
    scaler.update()
    return loss


step = torch.compile(train)
for x, y in batches(args.steps):
    step(x, y)
