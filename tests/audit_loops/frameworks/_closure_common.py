"""What the closure loops add to the catalogue's shared parts (`tests/audit_loops/_common.py`:
the small model, the deterministic batches and the command line, ``--steps``, ``--bug`` and
``--inf-at``): a gradient overflow that leaves the forward value unchanged, so that a loop
whose closure returns the loss (LBFGS, Lightning) still sees a finite loss at a step the
scaler must skip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import batches, make_model, parse  # noqa: E402,F401  (the loops import them from here)

__all__ = ["batches", "make_model", "overflow", "parse"]


def overflow(t: torch.Tensor, on: bool) -> torch.Tensor:
    """``t`` unchanged in the forward pass; with ``on``, its gradient multiplied by 1e36 (inf once
    scaled by the scaler's 65536, in float32)."""
    if not on:
        return t
    big = t.float() * 1e36
    return t + (big - big.detach()).to(t.dtype)
