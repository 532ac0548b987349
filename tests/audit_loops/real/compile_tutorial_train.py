"""A whole compiled train step: forward, backward and the optimizer step in one ``torch.compile``d
function, as PyTorch's introduction to ``torch.compile`` writes it.

Modelled on pytorch/tutorials, ``intermediate_source/torch_compile_tutorial.py``, commit
4c449dc746b0b4c67b73c56ee38cb11caa1adf48 ("Demonstrating Speedups", training): ``opt =
torch.optim.Adam(model.parameters())`` (defaults: lr 1e-3, the for-loop implementation on the
CPU); ``def train(mod, data): opt.zero_grad(True); pred = mod(data[0]); loss =
torch.nn.CrossEntropyLoss()(pred, data[1]); loss.backward(); opt.step()``; ``train_opt =
torch.compile(train, mode="reduce-overhead")``, called once per batch of ``generate_data(16)``
(random images, random labels). Float32, no autocast, no scaler. Here a small convolutional
network on 3x8x8 images stands for the tutorial's DenseNet-121 on 3x128x128, on the CPU (where
``reduce-overhead``'s CUDA graphs do not apply).

What torch does with it (torch 2.13, its own counters): Dynamo cannot trace ``loss.backward()``
and breaks the graph there, runs the backward eagerly through the compiled forward's backward
graph, and compiles the rest (the optimizer step) as a graph of its own; ``Optimizer.zero_grad``
is a function torch keeps Dynamo out of, another break.

The truth: no finding (the order is the step contract's, float32 has no scaler to use); 12 steps,
all applied, each replayed through the spec's compile rules (``reference.compile``). ``--inf-at``
is accepted and ignored (no scaler: nothing skips). ``--mode``: the ``torch.compile`` mode.
``--zero module``: ``mod.zero_grad(True)`` in place of ``opt.zero_grad(True)``, a call Dynamo
traces: the gradients are set to None inside the graph, where the audit does not see it, so a
compiled step is seen at the next backward with its gradients gone: not replayed, with that
reason (the last step, seen at the program's end, is replayed).
"""

import torch
from torch import nn

from _real import parse

args = parse(mode="reduce-overhead", zero="optimizer")


def init_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))


def generate_data(b: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 3, 8, 8, generator=g), torch.randint(10, (b,), generator=g)


model = init_model()
opt = torch.optim.Adam(model.parameters())


def train(mod, data):
    (mod if args.zero == "module" else opt).zero_grad(True)
    pred = mod(data[0])
    loss = torch.nn.CrossEntropyLoss()(pred, data[1])
    loss.backward()
    opt.step()


train_opt = torch.compile(train, mode=args.mode)
g = torch.Generator().manual_seed(1)
for i in range(args.steps):
    train_opt(model, generate_data(16, g))
