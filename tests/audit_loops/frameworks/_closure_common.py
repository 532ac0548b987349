"""What the closure loops share: a small model, deterministic batches, the forced overflow and
the command line.

Every loop takes ``--steps N`` (optimizer steps), ``--bug NAME`` (plant one mistake, named by
the audit's rule; ``none`` is the correct loop) and ``--inf-at I,J`` (the loss's gradient
overflows at those optimizer steps: a scaler must skip them).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

# Models this small gain nothing from intra-op threads (as the catalogue's loops).
torch.set_num_threads(1)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def batches(n: int, seed: int = 1, batch: int = 8):
    """``n`` (x, y) batches of a fixed regression task."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=g)
    for _ in range(n):
        x = torch.randn(batch, 16, generator=g)
        yield x, x @ w + 0.1 * torch.randn(batch, 4, generator=g)


def overflow(t: torch.Tensor, on: bool) -> torch.Tensor:
    """``t`` unchanged in the forward pass; with ``on``, its gradient multiplied by 1e36 (inf once
    scaled by the scaler's 65536, in float32)."""
    if not on:
        return t
    big = t.float() * 1e36
    return t + (big - big.detach()).to(t.dtype)


def parse(bugs: tuple[str, ...], **extra: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--bug", default="none", choices=("none",) + bugs)
    p.add_argument("--inf-at", default="", help="comma-separated optimizer steps whose gradients overflow")
    for name, default in extra.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=default)
        else:
            p.add_argument(flag, default=default, type=type(default))
    args = p.parse_args()
    args.inf_at = {int(s) for s in args.inf_at.split(",") if s}
    return args
