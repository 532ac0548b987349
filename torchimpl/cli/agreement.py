"""When a precision's loss curve agrees with fp32's: the band ``ampspec compare`` judges by.

Both curves are smoothed with a moving average over ``window`` steps. At step i the band
around fp32's smoothed loss ``s_i`` has the half-width

    max(rel_tol * |s_i|, noise_k * noise_i / sqrt(window))

where ``noise_i`` is fp32's own step-to-step noise over the same window: the mean of
``|loss_j - loss_(j-1)|`` over fp32's raw training losses of the ``window`` steps ending at i.
Divided by ``sqrt(window)`` it is the noise a ``window``-step average keeps. A run agrees when
its smoothed loss stays inside the band at every step.

Why this shape: the relative part keeps the band meaningful as the loss nears zero (an
absolute band sized from the starting loss says nothing there), and the noise part keeps it
from being tighter than what fp32's own average moves by from batch to batch on a noisy
stretch (the MLP task's dropout). The relative part is wide (50 %) because a precision's
rounding shifts *when* a curve drops: on the embedded transformer bf16 passes its steep drop
about 15 steps before fp32, and at step 171 its average is 40 % below fp32's (200 steps, seed
0, CPU). A stalled or diverged run, or one that levels off at twice fp32's loss, is outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Band", "moving_average", "step_noise"]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def step_noise(values: Sequence[float], window: int) -> list[float]:
    """At each step, the mean ``|v_j - v_(j-1)|`` over the ``window`` steps ending there (0 at
    the first step, which has no predecessor)."""
    diffs = [0.0] + [abs(b - a) for a, b in zip(values, values[1:])]
    out, acc = [], 0.0
    for i, d in enumerate(diffs):
        acc += d
        if i >= window:
            acc -= diffs[i - window]
        n = min(i, window)  # step 0's entry is no difference
        out.append(acc / n if n else 0.0)
    return out


@dataclass(frozen=True)
class Band:
    """The agreement rule's parameters (see the module docstring)."""

    window: int = 20
    rel_tol: float = 0.5
    noise_k: float = 3.0

    def half_widths(self, fp32: Sequence[float]) -> list[float]:
        """The band's half-width at each step, from fp32's raw training losses."""
        smooth = moving_average(fp32, self.window)
        noise = step_noise(fp32, self.window)
        scale = self.noise_k / math.sqrt(self.window)
        return [max(self.rel_tol * abs(s), scale * n) for s, n in zip(smooth, noise)]

    def gaps(self, fp32: Sequence[float], run: Sequence[float]) -> list[float]:
        """``|run's moving average - fp32's|`` at each step both have."""
        return [abs(a - b) for a, b in zip(moving_average(run, self.window), moving_average(fp32, self.window))]

    def agrees(self, fp32: Sequence[float], run: Sequence[float]) -> bool:
        """Every smoothed point of ``run`` inside the band (a non-finite gap never is)."""
        return all(math.isfinite(g) and g <= h for g, h in zip(self.gaps(fp32, run), self.half_widths(fp32)))

    def rule(self) -> str:
        """The rule in one sentence, for the table's footer, the report and the plot."""
        return (f"{self.window}-step moving averages within {self.rel_tol:.0%} of fp32's, or within "
                f"{self.noise_k:g}x the noise of fp32's average where that is larger (the mean |change| of "
                f"fp32's training loss from one step to the next over the same {self.window} steps, "
                f"divided by sqrt({self.window}))")
