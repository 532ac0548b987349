"""What the loops modelled on public training code share: the command line, synthetic data, and
a gradient overflow that leaves the loss finite.

Every loop takes ``--steps N`` (optimizer steps), ``--inf-at I,J`` (optimizer steps whose
gradients overflow, so that the GradScaler skips them) and ``--out DIR`` (where checkpoints go).
The originals run fp16 on a GPU, where a GradScaler skips steps while its scale calibrates; here
bf16 autocast runs on the CPU with an enabled ``GradScaler("cpu")``, and `overflow` makes those
skips happen at chosen steps. Several originals stop on a non-finite loss (DINO's
``sys.exit(1)``), so the overflow is in the backward pass only: the forward value is unchanged.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

torch.set_num_threads(1)  # tiny models: intra-op threads only cost synchronisation


def parse(**extra: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--inf-at", default="", help="comma-separated optimizer steps whose gradients overflow")
    p.add_argument("--out", default="")
    for name, default in extra.items():
        p.add_argument(f"--{name.replace('_', '-')}", default=default, type=type(default))
    args = p.parse_args()
    args.inf_at = {int(s) for s in args.inf_at.split(",") if s}
    args.out = args.out or tempfile.mkdtemp(prefix="ampspec-real-")
    return args


def overflow(t: torch.Tensor, on: bool) -> torch.Tensor:
    """``t`` unchanged in the forward pass; with ``on``, its gradient multiplied by 1e36 (inf once
    scaled by 65536, in float32)."""
    if not on:
        return t
    big = t.float() * 1e36
    return t + (big - big.detach()).to(t.dtype)


def batches(n: int, dim: int = 16, classes: int = 4, batch: int = 8, seed: int = 1):
    """``n`` (x, y) batches of a fixed classification task."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, classes, generator=g)
    for _ in range(n):
        x = torch.randn(batch, dim, generator=g)
        yield x, (x @ w).argmax(dim=1)
