"""What the catalogue's loops share: a small model, deterministic batches, the command line.

Every loop takes ``--steps N`` (optimizer steps), ``--bug NAME`` (plant one mistake; the
names are the audit's rule names, and ``none`` is the correct loop) and ``--inf-at I,J``
(multiply the loss by inf at those optimizer steps: an overflow the scaler must skip).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

# Models this small gain nothing from intra-op threads; on a busy machine their synchronisation
# makes each tiny operation tens of times slower.
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


def parse(bugs: tuple[str, ...], **extra: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--bug", default="none", choices=("none",) + bugs)
    p.add_argument("--inf-at", default="", help="comma-separated optimizer steps whose loss overflows")
    for name, default in extra.items():
        if isinstance(default, bool):
            p.add_argument(f"--{name.replace('_', '-')}", action="store_true", default=default)
        else:
            p.add_argument(f"--{name.replace('_', '-')}", default=default, type=type(default))
    args = p.parse_args()
    args.inf_at = {int(s) for s in args.inf_at.split(",") if s}
    return args
