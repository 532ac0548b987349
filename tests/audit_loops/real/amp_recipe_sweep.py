"""Several convergence runs in one script, each with its own model, optimizer and GradScaler.

Modelled on pytorch/tutorials, ``recipes_source/recipes/amp_recipe.py``, commit
db77dcf6e3637924f43852c014f2af9978b0f891 ("All together: Automatic Mixed Precision", and its
advice: "If you perform multiple convergence runs in the same script, each run should use a
dedicated fresh GradScaler instance"), run as a learning-rate sweep. Reproduced, in its order,
per run: ``make_model``, SGD, ``GradScaler(enabled=use_amp)``; per iteration the forward and
MSE loss under autocast, ``scaler.scale(loss).backward()``, ``scaler.step(opt)``,
``scaler.update()``, ``opt.zero_grad()``; then the recipe's checkpoint of model, optimizer and
scaler, loaded back into them.

The truth, from reading the original: correct. Each new GradScaler drives a new model's
parameters through a new optimizer: a new run, not a scaler replaced mid-run. No finding.
"""

import torch
from torch import nn

from _real import overflow, parse

args = parse(runs=3)
g = torch.Generator().manual_seed(1)
data = [torch.randn(8, 16, generator=g) for _ in range(6)]
targets = [torch.randn(8, 16, generator=g) for _ in range(6)]
loss_fn = nn.MSELoss()
per_run = args.steps // args.runs


def make_model(in_size=16, out_size=16, num_layers=2):
    layers = []
    for _ in range(num_layers - 1):
        layers += [nn.Linear(in_size, in_size), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(in_size, out_size))


for run, lr in enumerate([1e-3, 3e-3, 1e-2][:args.runs]):
    torch.manual_seed(run)
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    for it in range(per_run):
        input, target = data[it % len(data)], targets[it % len(targets)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=True):
            output = overflow(net(input), run * per_run + it in args.inf_at)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    checkpoint = {"model": net.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()}
    net.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint["scaler"])
