"""The doctor's per-layer, per-parameter and per-float8-layer numbers, gathered over its steps.

Every number comes from ``torchimpl.precision.health`` (the spec's rules, computed with torch):

1. A layer (a module's output, ``LayerStats``): the mixed run's output dtype and amax, the
   fp32 shadow's amax and the headroom in bits it leaves in the output's format (negative: the
   values do not fit), the overflow count of the shadow's values in that format (what the
   mixed run cannot hold) and the steps on which it was non-zero, the flushed fraction of the
   shadow's non-zero outputs (zero in the mixed run), the lowest SQNR of the mixed output
   against the shadow's (and the step it was seen on), the L1 mass share of the shadow's output
   that is flushed (the spec's rule 14), and whether the shadow's output was ever non-finite.
2. The gradient reaching a layer's output: amax in the mixed run at the loss scale and
   unscaled (divided by the scale), the flushed fraction of the shadow's non-zero entries
   (zero in the mixed run, for any reason), the underflow fraction of the shadow's gradient at
   the loss scale in the output's format (rule 5: lost to the scale itself), and the
   power-of-two scale range (rule 10) of the shadow's gradient in that format, and the L1 mass
   share of the shadow's gradient that the loss scale flushes (the spec's rule 13). The loss
   scale is the step's own (the doctor's dynamic scale changes between steps).
3. A parameter (``ParamStats``): its dtype, the lost-update fraction (rule 12): of the
   entries whose update by the fp32 shadow's optimizer (the exact update) is finite and
   non-zero, those whose stored weight the mixed step left unchanged; and the flushed
   fraction of its gradient.
4. A float8 layer (``Fp8Stats``): for the input and weight (float8_e4m3fn) and grad_output
   (float8_e5m2), the amax, and the saturated and underflowed fractions under the recipe's
   scale (tensorwise: one f32(max / max(amax, 1e-12)) per tensor; the row-wise recipes: one per
   row of the last dimension), the L1 mass share of each operand that flushes (rule 13), and
   whether amax was ever 0.
5. Counts are summed over steps and calls before dividing (so fractions are over everything
   seen); maxima are maxima over steps; SQNR is the minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from torchimpl.precision import health

__all__ = ["BackwardNumbers", "Fp8Stats", "ForwardNumbers", "LayerStats", "ParamStats", "backward_numbers",
           "dtype_name", "forward_numbers"]

_LOW = (torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _ratio(pair: list[int] | list[float]) -> float:
    return pair[0] / pair[1] if pair[1] else 0.0


def _finite_or_none(x: float) -> float | None | str:
    if math.isnan(x):
        return None
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


@dataclass(frozen=True)
class ForwardNumbers:
    """Rule 1's numbers for one call (``flushed`` and ``flushed_mass`` None when the shapes differ;
    the two non-finite flags are looked at only when ``sqnr_db`` is NaN)."""

    amax: float
    shadow_amax: float
    sqnr_db: float
    shadow_nonfinite: bool
    mixed_nonfinite: bool
    overflow: int
    flushed: tuple[int, int] | None
    flushed_mass: tuple[float, float] | None


@dataclass(frozen=True)
class BackwardNumbers:
    """Rule 2's numbers for one call (``flushed`` None when the shapes differ; the scale's losses
    and range None for a gradient that is not 16-bit)."""

    amax_scaled: float
    flushed: tuple[int, int] | None
    lost_at_scale: tuple[int, int] | None
    mass_lost_at_scale: tuple[float, float] | None
    scale_range: health.ScaleRange | None


def forward_numbers(mixed: torch.Tensor, shadow: torch.Tensor) -> ForwardNumbers:
    """Rule 1 for one call, tensor by tensor (the definition ``doctor.batch`` computes in one pass)."""
    same = mixed.shape == shadow.shape
    sqnr = health.sqnr_db(shadow, mixed) if same else math.nan
    bad = math.isnan(sqnr)
    return ForwardNumbers(
        health.amax(mixed), health.amax(shadow), sqnr,
        bad and health.nonfinite_fraction(shadow) > 0, bad and health.nonfinite_fraction(mixed) > 0,
        health.overflow_count(shadow, mixed.dtype) if same and mixed.dtype in _LOW else 0,
        health.flushed_count(shadow, mixed) if same else None, health.flushed_mass(shadow, mixed) if same else None)


def backward_numbers(mixed: torch.Tensor, shadow: torch.Tensor, scale: float, keep: float) -> BackwardNumbers:
    """Rule 2 for one call, tensor by tensor (``mixed`` at the loss scale)."""
    same = mixed.shape == shadow.shape
    low = same and mixed.dtype in _LOW
    return BackwardNumbers(
        health.amax(mixed), health.flushed_count(shadow, mixed) if same else None,
        health.underflow_count(shadow, mixed.dtype, scale) if low else None,
        health.underflow_mass(shadow, mixed.dtype, scale) if low else None,
        health.scale_range(shadow, mixed.dtype, keep) if low else None)


@dataclass
class LayerStats:
    """Rules 1 and 2 for one module."""

    name: str
    dtype: str = ""
    amax: float = 0.0
    shadow_amax: float = 0.0
    overflow: int = 0
    overflow_steps: int = 0
    flushed: list[int] = field(default_factory=lambda: [0, 0])
    sqnr_db: float = math.inf
    sqnr_step: int | None = None
    last_sqnr_db: float = math.inf
    """The SQNR of the latest call (NaN where either output was non-finite)."""
    flushed_mass: list[float] = field(default_factory=lambda: [0.0, 0.0])
    shadow_nonfinite: bool = False
    mixed_nonfinite: bool = False
    grad_amax_scaled: float = 0.0
    grad_amax: float = 0.0
    grad_flushed: list[int] = field(default_factory=lambda: [0, 0])
    grad_lost_at_scale: list[int] = field(default_factory=lambda: [0, 0])
    grad_mass_lost_at_scale: list[float] = field(default_factory=lambda: [0.0, 0.0])
    scale_low: int | None = None
    scale_high: int | None = None
    same_as: str | None = None
    """The inner module whose output tensor this one returns as is (its numbers are that one's)."""
    _dtype: torch.dtype | None = None

    @property
    def low_precision(self) -> bool:
        return self._dtype in _LOW

    @property
    def headroom_bits(self) -> float:
        return health.headroom_bits(self.shadow_amax, self._dtype) if self._dtype is not None else math.inf

    @property
    def underflow(self) -> float:
        return _ratio(self.flushed)

    @property
    def grad_underflow(self) -> float:
        return _ratio(self.grad_flushed)

    @property
    def grad_underflow_at_scale(self) -> float:
        return _ratio(self.grad_lost_at_scale)

    @property
    def underflow_mass(self) -> float:
        return _ratio(self.flushed_mass)

    @property
    def grad_underflow_mass_at_scale(self) -> float:
        return _ratio(self.grad_mass_lost_at_scale)

    def add_forward(self, mixed: torch.Tensor, shadow: torch.Tensor, step: int | None = None) -> bool:
        """One call's outputs; True when the shadow's values overflow the mixed output's format."""
        return self.take_forward(mixed.dtype, forward_numbers(mixed, shadow), step)

    def take_forward(self, dtype: torch.dtype, n: ForwardNumbers, step: int | None = None) -> bool:
        """One call's forward numbers (``forward_numbers``', or the batched ``doctor.batch``')."""
        self._dtype, self.dtype = dtype, dtype_name(dtype)
        self.amax = max(self.amax, n.amax)
        self.shadow_amax = max(self.shadow_amax, n.shadow_amax)
        self.last_sqnr_db = n.sqnr_db
        if math.isnan(n.sqnr_db):  # a non-finite value in either (or shapes that differ): which one
            self.shadow_nonfinite |= n.shadow_nonfinite
            self.mixed_nonfinite |= n.mixed_nonfinite
        elif n.sqnr_db < self.sqnr_db:
            self.sqnr_db, self.sqnr_step = n.sqnr_db, step
        if n.flushed is None or n.flushed_mass is None:  # shapes that differ
            return False
        self.overflow += n.overflow
        for i, c in enumerate(n.flushed):
            self.flushed[i] += c
        for i, m in enumerate(n.flushed_mass):
            self.flushed_mass[i] += m
        return n.overflow > 0

    def add_backward(self, mixed: torch.Tensor, shadow: torch.Tensor, scale: float, keep: float) -> None:
        """One call's output gradients (``mixed`` at the loss scale)."""
        self.take_backward(backward_numbers(mixed, shadow, scale, keep), scale)

    def take_backward(self, n: BackwardNumbers, scale: float) -> None:
        """One call's gradient numbers (``backward_numbers``', or the batched ``doctor.batch``')."""
        self.grad_amax_scaled = max(self.grad_amax_scaled, n.amax_scaled)
        self.grad_amax = max(self.grad_amax, n.amax_scaled / scale)
        if n.flushed is None:  # shapes that differ
            return
        for i, c in enumerate(n.flushed):
            self.grad_flushed[i] += c
        if n.lost_at_scale is None or n.mass_lost_at_scale is None or n.scale_range is None:
            return  # a gradient held in float32: nothing is lost to the scale
        for i, c in enumerate(n.lost_at_scale):
            self.grad_lost_at_scale[i] += c
        for i, m in enumerate(n.mass_lost_at_scale):
            self.grad_mass_lost_at_scale[i] += m
        r = n.scale_range
        if r.low is not None:
            self.scale_low = r.low if self.scale_low is None else max(self.scale_low, r.low)
        if r.high is not None:
            self.scale_high = r.high if self.scale_high is None else min(self.scale_high, r.high)

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.name, "same_as": self.same_as, "dtype": self.dtype, "amax": _finite_or_none(self.amax),
                "shadow_amax": _finite_or_none(self.shadow_amax), "headroom_bits": _finite_or_none(self.headroom_bits),
                "overflow_count": self.overflow, "overflow_steps": self.overflow_steps,
                "underflow_fraction": self.underflow, "underflow_mass_fraction": self.underflow_mass,
                "sqnr_db": _finite_or_none(self.sqnr_db),
                "shadow_nonfinite": self.shadow_nonfinite, "mixed_nonfinite": self.mixed_nonfinite,
                "grad_amax_scaled": _finite_or_none(self.grad_amax_scaled), "grad_amax": _finite_or_none(self.grad_amax),
                "grad_underflow_fraction": self.grad_underflow,
                "grad_underflow_at_scale_fraction": self.grad_underflow_at_scale,
                "grad_underflow_mass_at_scale_fraction": self.grad_underflow_mass_at_scale,
                "scale_range_log2": [self.scale_low, self.scale_high]}


@dataclass
class ParamStats:
    """Rule 3 for one parameter."""

    name: str
    dtype: str
    lost: list[int] = field(default_factory=lambda: [0, 0])
    grad_flushed: list[int] = field(default_factory=lambda: [0, 0])

    @property
    def lost_update_fraction(self) -> float:
        return _ratio(self.lost)

    @property
    def grad_underflow(self) -> float:
        return _ratio(self.grad_flushed)

    def add(self, stored: torch.Tensor, after: torch.Tensor | None, update: torch.Tensor | None,
            mixed_grad: torch.Tensor | None, shadow_grad: torch.Tensor | None) -> None:
        """``stored`` and ``after``: the weight as stored before and after the mixed step (None when
        it was skipped); ``update``: the exact update, the fp32 shadow's (``reference.health`` rule 12)."""
        lost = health.applied_lost_count(stored, after, update) if update is not None and after is not None else None
        flushed = health.flushed_count(shadow_grad, mixed_grad) \
            if mixed_grad is not None and shadow_grad is not None else None
        self.take(lost, flushed)

    def take(self, lost: tuple[int, int] | None, flushed: tuple[int, int] | None) -> None:
        """One step's counts (``add``'s, or the batched ``doctor.batch``'); None: not measured this step."""
        for i, n in enumerate(lost or ()):
            self.lost[i] += n
        for i, n in enumerate(flushed or ()):
            self.grad_flushed[i] += n

    def to_dict(self) -> dict[str, Any]:
        return {"parameter": self.name, "dtype": self.dtype, "lost_update_fraction": self.lost_update_fraction,
                "updates_seen": self.lost[1], "grad_underflow_fraction": self.grad_underflow}


_FP8_FORMATS = {"input": torch.float8_e4m3fn, "weight": torch.float8_e4m3fn, "grad_output": torch.float8_e5m2}


def _recipe_scale(x: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> tuple[float | torch.Tensor, float]:
    """Rule 4: the recipe's scale for ``x`` and its amax."""
    a = x.detach().abs().double()
    amax = a.amax(dim=-1, keepdim=True) if rowwise else a.max()
    scale = (torch.finfo(dtype).max / amax.clamp_min(1e-12)).float()
    return (scale if rowwise else float(scale)), float(a.max())


@dataclass
class Fp8Stats:
    """Rule 4 for one float8 layer."""

    name: str
    rowwise: bool = False
    amax: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_FP8_FORMATS, 0.0))
    saturated: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0] for k in _FP8_FORMATS})
    underflow: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0] for k in _FP8_FORMATS})
    underflow_mass: dict[str, list[float]] = field(default_factory=lambda: {k: [0.0, 0.0] for k in _FP8_FORMATS})
    amax_zero: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(_FP8_FORMATS, False))

    def add(self, operand: str, x: torch.Tensor | None) -> None:
        if x is None:
            return
        dtype = _FP8_FORMATS[operand]
        scale, amax = _recipe_scale(x, dtype, self.rowwise)
        self.amax[operand] = max(self.amax[operand], amax)
        self.amax_zero[operand] |= amax == 0
        self.saturated[operand][0] += health.overflow_count(x, dtype, scale)
        self.saturated[operand][1] += x.numel()
        for i, n in enumerate(health.underflow_count(x, dtype, scale)):
            self.underflow[operand][i] += n
        for i, m in enumerate(health.underflow_mass(x, dtype, scale)):
            self.underflow_mass[operand][i] += m

    def fraction(self, which: str, operand: str) -> float:
        """``saturated`` or ``underflow`` (counts), or ``underflow_mass`` (the L1 share) of ``operand``."""
        table = {"saturated": self.saturated, "underflow": self.underflow, "underflow_mass": self.underflow_mass}
        return _ratio(table[which][operand])

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.name, "scaling": "rowwise" if self.rowwise else "tensorwise",
                **{f"{k}_amax": self.amax[k] for k in _FP8_FORMATS},
                **{f"{k}_saturated_fraction": self.fraction("saturated", k) for k in _FP8_FORMATS},
                **{f"{k}_underflow_fraction": self.fraction("underflow", k) for k in _FP8_FORMATS},
                **{f"{k}_underflow_mass_fraction": self.fraction("underflow_mass", k) for k in _FP8_FORMATS},
                **{f"{k}_amax_zero": self.amax_zero[k] for k in _FP8_FORMATS}}
