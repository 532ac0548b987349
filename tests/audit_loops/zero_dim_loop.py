"""A learnable 0-d temperature beside the weights (CLIP's ``logit_scale = nn.Parameter(torch.ones([]))``).

The canonical GradScaler loop; the model's output is multiplied by ``exp(logit_scale)``, and the
0-d parameter is in the optimizer and in the clipping call like every other. Every step must
replay: 0-d parameters, gradients and optimizer state keep their shape ``()`` through the
spec. No planted mistake: the correct loop is the test.
"""

import torch
from torch import nn

from _common import batches, make_model, parse

args = parse((), optimizer="adamw")
model = make_model()
logit_scale = nn.Parameter(torch.ones([]) * 0.5)
params = [*model.parameters(), logit_scale]
if args.optimizer == "adamw":
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
elif args.optimizer == "adam-foreach":
    opt = torch.optim.Adam(params, lr=1e-3, foreach=True, amsgrad=True)
elif args.optimizer == "adam-fused":
    opt = torch.optim.Adam(params, lr=1e-3, fused=True)
else:
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
scaler = torch.amp.GradScaler("cpu", growth_interval=10)

for step, (x, y) in enumerate(batches(args.steps)):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x) * logit_scale.exp(), y)
        if step in args.inf_at:
            loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    scaler.step(opt)
    scaler.update()
