"""Rule 5 of ``reference.step``: when a loss scale has collapsed, in the spec, in torchimpl and in
torch's own unscale arithmetic.

A scale is collapsed when it is not positive, or when the factor that unscales,
``f32(1 / f64(scale))`` (what ``GradScaler.unscale_`` multiplies by), is not finite. A negative
scale never arises (factors are positive); its inverse is finite, but it is no loss scale, so the
spec and torchimpl call it collapsed, and torch's arithmetic is compared on the others. All three must agree on every float32 scale:
the spec's rule (``reference.step.scale_collapsed``), torchimpl's host-side test
(``torchimpl.train.step.scale_collapsed``, which stops a run) and torch's computation itself.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference.step as ref_step
import torchimpl.train.step as ti_step

REPRO = "PYTHONPATH=. python -m pytest conformance/test_scale_collapse.py"


def _torch_collapsed(scales: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(scales.astype(np.float32))
    return (~torch.isfinite(t.double().reciprocal().float())).numpy()


def _check(bits: np.ndarray) -> None:
    scales = bits.astype(np.uint32).view(np.float32)
    expected = _torch_collapsed(scales) | np.signbit(scales)
    for s, torch_says in zip(scales, expected):
        spec, ours = ref_step.scale_collapsed(s), ti_step.scale_collapsed(float(s))
        assert spec == ours == bool(torch_says), (
            f"scale {float(s)!r} (bits {int(np.float32(s).view(np.uint32)):#010x}): torch's inverse "
            f"{'overflows' if torch_says else 'is finite'}, spec says collapsed={spec}, torchimpl says {ours}\n{REPRO}")


def test_collapse_boundary_every_scale_near_it():
    """The 8,192 float32 values around the boundary (2**-128, whose inverse rounds to 2**128),
    every 997th one from 2**-130 to 2**-125, zero and the specials."""
    edge = int(np.float32(2.0**-128).view(np.uint32))
    _check(np.arange(edge - 4096, edge + 4096, dtype=np.uint32))
    lo, hi = np.float32(2.0**-130).view(np.uint32), np.float32(2.0**-125).view(np.uint32)
    _check(np.arange(lo, hi, 997, dtype=np.uint32))
    _check(np.array([0, 0x80000000, 0x7F800000, 0x7FC00000, 0x3F800000, 0x7F7FFFFF, 1], dtype=np.uint32))


@given(st.integers(0, 2**32 - 1))
def test_collapse_agrees_on_any_float32_scale(bits):
    _check(np.array([bits], dtype=np.uint32))
