"""The loss scale's part of the verdicts: skipped steps sorted into the scaler's job and the
model's problem, and the gradient underflow weighed by the mass it loses.

Rules (on ``torchimpl.doctor.inspect.Observations``; the diagnosis ran torch's dynamic policy):

1. The scaler's job: a skipped step whose loss scale was above what its gradients fit: the
   shadow's gradients of that step (the 16-bit layers' output gradients and their parameters'
   gradients) times the scale pass the format's max (``step_high``: the largest exponent that
   fits). Backing off is the remedy, and the dynamic scaler applied it. The leading ones are
   the warm-up (the scale coming down from ``init_scale``); later ones are data whose gradients
   were larger than the earlier batches'. Both are a note with the steps they cost.
2. Without a scaler nothing is the scaler's job.
3. Every other skipped step overflowed at a scale its gradients fit: the scale is not the
   cause, and backing off does not help. With no located cause in the forward
   (``FORWARD_CAUSES``), it is a ``gradient-overflow`` verdict at the module in whose backward
   the gradient first became non-finite on the first such step; with one, a note that the
   skips follow from it.
4. Gradient underflow at the scale each step ran: a layer whose gradient entries underflow in
   more than ``1 - keep`` of its non-zero ones is a ``gradient-underflow`` verdict when they
   carry at least ``MASS_NEGLIGIBLE`` of its L1 mass (the layer losing the most mass), a note
   otherwise.
5. The advice is checked before it is printed. Within the scaler's useful range
   (``SCALE_USEFUL_LOG2``) and below the largest scale that does not overflow (rule 10's
   high), it is ``init_scale``. Otherwise no scale is reasonable: the gradient reaching that
   layer is too small for the rest of the model's, so the advice names the loss term that
   reaches it (its weight), the layer in fp32, or bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchimpl.doctor.kinds import MASS_NEGLIGIBLE, SCALE_USEFUL_LOG2, Verdict, island

__all__ = ["FORWARD_CAUSES", "Skips", "classify_skips", "gradient_verdicts", "overflow_verdict", "skip_notes"]

FORWARD_CAUSES = ("forward-overflow", "inner-overflow", "unsafe-math", "fp16-normalization")
"""Verdicts that explain non-finite gradients by what the forward did."""


@dataclass(frozen=True)
class Skips:
    """Rules 1-3: the skipped steps by why."""

    warmup: tuple[int, ...]
    absorbed: tuple[int, ...]
    unexpected: tuple[int, ...]


def _log2(x: float) -> str:
    """A scale as a power of two where it is one."""
    m, e = math.frexp(x)
    return f"2^{e - 1}" if x > 0 and m == 0.5 else f"{x:g}"


def classify_skips(obs: Any) -> Skips:
    """Rules 1-3."""
    skipped = sorted(obs.skipped)
    if not obs.use_scaler:
        return Skips((), (), tuple(skipped))
    scaled = [k for k in skipped if obs.step_high.get(k) is not None and obs.scales[k] > 2.0 ** obs.step_high[k]]
    lead = []
    for k in range(obs.steps):
        if k not in scaled:
            break
        lead.append(k)
    later = [k for k in scaled if k not in lead]
    return Skips(tuple(lead), tuple(later), tuple(k for k in skipped if k not in scaled))


def skip_notes(obs: Any, skips: Skips) -> list[str]:
    """Rule 1's notes: what the scaler's own skips cost."""
    out = []
    if skips.warmup:
        first, last = obs.scales[skips.warmup[0]], obs.scales[skips.warmup[-1]] / 2
        settled = "" if len(skips.warmup) < obs.steps else " (it had not settled: rerun with more --steps, or " \
            f"--init-scale {_log2(last)})"
        out.append(f"the loss scale backed off from {_log2(first)} to {_log2(last)} on the first "
                   f"{len(skips.warmup)} of {obs.steps} steps (skipped, as a dynamic scaler's warm-up does){settled}")
    if skips.absorbed:
        steps = ", ".join(str(k) for k in skips.absorbed)
        out.append(f"{len(skips.absorbed)} later step(s) ({steps}) had gradients too large for the scale and were "
                   "skipped, the scale backing off each time: the scaler's job, no verdict")
    return out


def overflow_verdict(obs: Any, skips: Skips) -> Verdict | None:
    """Rule 3's verdict."""
    if not skips.unexpected:
        return None
    first = skips.unexpected[0]
    module = obs.overflow_module.get(first) or None
    where = f": the gradient first becomes non-finite in the backward of {module!r}" if module else ""
    scale = obs.scales[first]
    what = ("at a loss scale their gradients fit (the shadow's gradients times the scale stay within the "
            "format: the scale is not the cause, backing off does not help)") if obs.use_scaler else \
        "(no loss scaler)"
    fix = ("keep that module in fp32 (" + island(module) + "), or use bf16 (float32's range)") if module else \
        "use bf16 (float32's range), or find the op with torchimpl.diagnose_nonfinite"
    return Verdict("gradient-overflow", module,
                   f"{len(skips.unexpected)} of {obs.steps} steps had non-finite gradients {what} (first at step "
                   f"{first}, scale {scale:g}){where}", fix,
                   {"steps": list(skips.unexpected), "scale": scale, "warmup_steps": list(skips.warmup)})


def _underflow_advice(obs: Any, worst: Any) -> tuple[str, dict[str, Any]]:
    """Rule 5: the scale advice, checked, or the loss term / module that needs it."""
    low_layers = [s for s in obs.layers.values() if s.low_precision and s.grad_flushed[1]]
    highs = [s.scale_high for s in low_layers if s.scale_high is not None]
    high = min(highs) if highs else None
    lows = [s.scale_low for s in low_layers if s.scale_low is not None]
    low = max(lows) if lows else None
    others = [s.scale_low for s in low_layers if s is not worst and s.scale_low is not None]
    numbers = {"init_scale": obs.scale, "scale_range_log2": [low, high], "useful_scale_log2": list(SCALE_USEFUL_LOG2)}
    useful_lo, useful_hi = SCALE_USEFUL_LOG2
    if low is not None and (high is None or low <= high) and useful_lo <= low <= useful_hi:
        ranged = f" (2^{low} .. 2^{high} keeps {obs.keep:.1%} of the gradients representable without overflow)" \
            if high is not None else ""
        return f"raise init_scale to >= 2^{low}{ranged}", {**numbers, "advice": "init_scale", "init_scale_log2": low}
    limit = (f"beyond the 2^{high} the rest of the model's gradients allow without overflow" if high is not None
             and low is not None and low > high else f"beyond the scaler's useful range (2^{useful_lo} .. "
             f"2^{useful_hi})")
    gap = f" ({low - max(others)} binades below the rest's)" if others and low is not None and low > max(others) else ""
    return (f"no loss scale is reasonable here: the gradient reaching {worst.name!r} needs 2^{low}, {limit}{gap}. "
            f"The loss term that reaches {worst.name!r} is weighted too small for fp16: raise its weight (an "
            f"auxiliary loss's coefficient) into range, or keep that head in fp32 ({island(worst.name)}), or use "
            "bf16", {**numbers, "advice": "loss-term", "module": worst.name})


def gradient_verdicts(obs: Any) -> tuple[list[Verdict], list[str]]:
    """Rule 4 (and 5's advice): the underflow verdict or note."""
    if not obs.use_scaler:
        return [], []
    lossy = [s for s in obs.layers.values() if s.low_precision and s.grad_flushed[1]
             and s.grad_underflow_at_scale > 1 - obs.keep]
    if not lossy:
        return [], []
    worst = max(lossy, key=lambda s: (s.grad_underflow_mass_at_scale, s.grad_underflow_at_scale))
    mass = worst.grad_underflow_mass_at_scale
    if mass < MASS_NEGLIGIBLE:
        return [], [f"{worst.grad_underflow_at_scale:.2%} of the non-zero gradient entries reaching {worst.name!r} "
                    f"underflow at the loss scale, but they carry {mass:.2g} of its L1 mass (below "
                    "2^-20): negligible, no verdict"]
    fix, numbers = _underflow_advice(obs, worst)
    return [Verdict("gradient-underflow", worst.name,
                    f"{worst.grad_underflow_at_scale:.2%} of the non-zero gradient entries reaching {worst.name!r} "
                    f"underflow to zero at loss scale {obs.scales[-1] if obs.scales else obs.scale:g}, "
                    f"{mass:.2g} of its L1 mass", fix,
                    {**numbers, "grad_underflow_at_scale_fraction": worst.grad_underflow_at_scale,
                     "grad_underflow_mass_at_scale_fraction": mass,
                     "grad_underflow_fraction": worst.grad_underflow, "grad_amax": worst.grad_amax})], []
