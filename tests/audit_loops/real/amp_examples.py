"""PyTorch's own AMP examples, one per ``--example``.

Modelled on pytorch/pytorch, ``docs/source/notes/amp_examples.rst``, commit
af616bb641d3825cc8216e583f2918912cc77103: "Gradient clipping" (``unscale_``, then
``clip_grad_norm_`` at the plain threshold), "Gradient accumulation" (``loss /
iters_to_accumulate``, step, update and ``zero_grad`` every ``iters_to_accumulate`` iterations),
"Gradient penalty" (``torch.autograd.grad`` of the scaled loss with ``create_graph``, unscaled by
``1 / scaler.get_scale()`` into new tensors, the penalty added to the loss under autocast) and
"Working with Multiple Models, Losses, and Optimizers" (two models, two losses on both outputs,
``scaler.scale(loss0).backward(retain_graph=True)``, ``scaler.scale(loss1).backward()``,
``unscale_(optimizer0)`` only, ``step`` of each, one ``update``).

The truth, from reading the original: each is correct, no finding. In the last, the two backward
passes are two losses of one forward (the first keeps the graph), not an accumulation window.
"""

import torch
from torch import nn

from _real import batches, overflow, parse

args = parse(example="multiple", iters_to_accumulate=2)
torch.manual_seed(0)
loss_fn = nn.CrossEntropyLoss()
model0, model1 = nn.Linear(16, 4), nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
optimizer0 = torch.optim.SGD(model0.parameters(), lr=0.05, momentum=0.9)
optimizer1 = torch.optim.AdamW(model1.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
k = args.iters_to_accumulate if args.example == "accumulation" else 1

for i, (x, target) in enumerate(batches(args.steps * k)):
    step = i // k
    hot = step in args.inf_at and i % k == 0
    if args.example == "multiple":
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output0, output1 = overflow(model0(x), hot), model1(x)
            loss0 = loss_fn(2 * output0 + 3 * output1, target)
            loss1 = loss_fn(3 * output0 - 5 * output1, target)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        scaler.unscale_(optimizer0)
        scaler.step(optimizer0)
        scaler.step(optimizer1)
        scaler.update()
        continue
    if args.example != "accumulation":
        optimizer1.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(overflow(model1(x), hot), target)
        if args.example == "accumulation":
            loss = loss / args.iters_to_accumulate
    if args.example == "penalty":
        scaled_grad_params = torch.autograd.grad(outputs=scaler.scale(loss), inputs=model1.parameters(),
                                                 create_graph=True)
        inv_scale = 1. / scaler.get_scale()
        grad_params = [p * inv_scale for p in scaled_grad_params]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            grad_norm = sum(grad.pow(2).sum() for grad in grad_params).sqrt()
            loss = loss + grad_norm
    scaler.scale(loss).backward()
    if args.example == "accumulation" and (i + 1) % k != 0:
        continue
    if args.example == "clipping":
        scaler.unscale_(optimizer1)
        torch.nn.utils.clip_grad_norm_(model1.parameters(), 0.5)
    scaler.step(optimizer1)
    scaler.update()
    if args.example == "accumulation":
        optimizer1.zero_grad()
