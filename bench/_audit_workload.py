"""The audited workload of bench/audit_overhead.py: an ordinary user script.

The canonical fp16-style loop on the CPU (bf16 autocast, a GradScaler("cpu"), unscale_, clip,
scaler.step, update, zero_grad) with for-loop AdamW, on an MLP of --width and --depth. It
stamps the end of every optimizer step into ``_audit_timer.STAMPS`` for the benchmark.
"""

import argparse
import time

import torch
from torch import nn

import _audit_timer

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--width", type=int, default=256)
p.add_argument("--depth", type=int, default=4)
p.add_argument("--batch", type=int, default=64)
args = p.parse_args()

torch.manual_seed(0)
layers: list[nn.Module] = [nn.Linear(64, args.width), nn.GELU()]
for _ in range(args.depth - 1):
    layers += [nn.Linear(args.width, args.width), nn.GELU()]
model = nn.Sequential(*layers, nn.Linear(args.width, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)
data = [(torch.randn(args.batch, 64, generator=g), torch.randn(args.batch, 8, generator=g)) for _ in range(8)]

for step in range(args.steps):
    x, y = data[step % len(data)]
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    _audit_timer.STAMPS.append(time.perf_counter())
