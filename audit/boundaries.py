"""What happened to the gradients between two stages of the replay, when torch's input to a stage
is not what the specification's previous stage gave.

The replay feeds every stage torch's own input (it re-synchronises), so a difference is measured
once, at the boundary where it arose, and never cascades. At a boundary the difference is one of:

- ``unscale``: every changed gradient is the expected one divided by the loss scale (by its
  float32 inverse, as ``unscale_`` does, or by a true division): an unscale by hand on top of the
  scaler's own. Certain: an error (``unscale-twice``).
- ``scale``: every changed gradient is the expected one multiplied by the loss scale: the
  gradients were scaled twice. Certain: an error (``scale-twice``).
- ``numeric``: every changed element is within ``NUMERIC_ULP`` ULPs: the previous stage computed
  differently from the specification (no user edit is that small). ``replay-divergence``.
- ``edit``: anything else: the loop's own code changed the gradients (per-parameter clipping,
  adaptive clipping, masking); stated with the ratio of the norms, ``info``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from audit.compare import _compare, ulp_distance
from reference import scaling

__all__ = ["Change", "Boundary", "LostUpdates", "measure", "NUMERIC_ULP"]

# Far above any bound of a stage (the largest is 30 ULPs of x_abs), far below any edit a loop makes.
NUMERIC_ULP = 256


@dataclass
class Change:
    """A boundary's difference: its ``kind``, the parameters it touched, the ratio of the norms
    (torch's input over the spec's output, over every gradient of the stage), and the first
    changed element described with its two values."""

    kind: str
    changed: list[int] = field(default_factory=list)
    ratio: float = 1.0
    detail: str = ""
    expected: Any = None
    got: Any = None
    worst: float = 0.0  # the largest ULP distance among the gradients that agree


@dataclass(frozen=True)
class Boundary:
    """One boundary with a difference, as the numeric checks read it (`audit.checks_numbers`): the
    step, the call site, the stage before (``prev``) and the stage entered (``into``), the
    `Change`, how many gradients changed (``count``), the loss scale, and whether the gradients
    were unscaled by then (or no scaler scaled them)."""

    step: int
    where: str
    prev: str
    into: str
    change: Change
    count: str
    scale: Any
    after_unscale: bool

    @property
    def between(self) -> str:
        return f"between {self.prev} and {self.into}"

    @property
    def divergence(self) -> bool:
        """A difference of a few ULPs after a stage the spec computed: that stage computed
        otherwise (recorded as a divergence, ``replay-divergence``). After backward, which the
        spec does not compute, no rounding explains it: the loop's own edit."""
        return self.change.kind == "numeric" and self.prev != "backward"


@dataclass(frozen=True)
class LostUpdates:
    """One parameter's lost updates over one window of replayed steps (`audit.lost`), as
    ``update-lost-to-rounding`` reads it: ``lost`` of ``counted`` elements' updates
    (`reference.health.applied_lost_count`, summed over the window's steps) kept the stored bits
    unchanged. ``steps``: the window's replayed steps (the finding is made at the last, at its
    call site ``where``); ``sampled``: how the replay's sample took the parameter ("K of M
    elements"), None when it took every element; ``run_lost``/``run_counted``: the same over
    every replayed step of the run."""

    step: int
    where: str
    optimizer: str
    parameter: str
    dtype: str
    shape: tuple[int, ...]
    lost: int
    counted: int
    steps: tuple[int, ...]
    sampled: str | None
    run_lost: int
    run_counted: int

    @property
    def fraction(self) -> float:
        return self.lost / self.counted if self.counted else 0.0


def measure(pairs: list[tuple[int, np.ndarray, np.ndarray]], bound: int, scale: Any) -> Change | None:
    """``pairs`` (parameter index, torch's input, the spec's expectation) of one boundary; None
    when they agree at ``bound``. ``scale``: the loss scale (float32), None without a scaler."""
    changed, worst, first = [], 0.0, None
    for i, got, exp in pairs:
        c = _compare(got, exp, bound)
        if c.problem is None:
            worst = max(worst, c.worst)
            continue
        changed.append((i, got, exp))
        first = first or (i, c)
    if not changed:
        return Change("none", worst=worst) if pairs else None
    i0, c0 = first
    kind = _kind(changed, scale)
    return Change(kind, [i for i, _, _ in changed], _norm_ratio(pairs), f"parameter {i0}: {c0.problem}",
                  c0.expected, c0.got, worst)


def _kind(changed: list[tuple[int, np.ndarray, np.ndarray]], scale: Any) -> str:
    if scale is not None and float(scale) not in (0.0, 1.0) and math.isfinite(float(scale)):
        if all(_is_unscale(g, e, scale) for _, g, e in changed):
            return "unscale"
        if all(_is_rescale(g, e, scale) for _, g, e in changed):
            return "scale"
    if all(ulp_distance(g, e) <= NUMERIC_ULP for _, g, e in changed):
        return "numeric"
    return "edit"


def _is_unscale(got: np.ndarray, once: np.ndarray, scale: Any) -> bool:
    """``got`` is ``once`` unscaled again: by the scaler's rule, or by a division by the scale."""
    twice, _ = scaling.unscale_gradients([once], scaling.ScalerState(np.float32(scale), 0, 1))
    if _compare(got, twice[0], 0).problem is None:
        return True
    with np.errstate(all="ignore"):
        wide = once.astype(np.float64) / np.float64(scale) if once.dtype == np.float64 else \
            (once.astype(np.float32) / np.float32(scale)).astype(once.dtype)
    return _compare(got, np.asarray(wide, once.dtype), 0).problem is None


def _is_rescale(got: np.ndarray, once: np.ndarray, scale: Any) -> bool:
    """``got`` is ``once`` multiplied by the scale (in its dtype, or through float32)."""
    with np.errstate(all="ignore"):
        if once.dtype == np.float64:
            times = once * np.float64(scale)
        else:
            times = (once.astype(np.float32) * np.float32(scale)).astype(once.dtype)
    return _compare(got, np.asarray(times, once.dtype), 0).problem is None


def _norm_ratio(pairs: list[tuple[int, np.ndarray, np.ndarray]]) -> float:
    """||torch's input|| / ||the spec's output|| over every gradient of the boundary (float64)."""
    with np.errstate(all="ignore"):
        num = sum(float(np.sum(np.square(np.asarray(g, np.float64)))) for _, g, _ in pairs)
        den = sum(float(np.sum(np.square(np.asarray(e, np.float64)))) for _, _, e in pairs)
    if den == 0.0:
        return math.inf if num > 0 else 1.0
    return math.sqrt(num / den)
