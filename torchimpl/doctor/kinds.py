"""The doctor's vocabulary: verdict kinds ranked by harm, their severities, and the thresholds
that decide between a verdict, a note and health (``torchimpl.doctor.verdicts`` applies them).

Thresholds, each stated once:

1. ``SQNR_FLOOR_DB``: the lowest SQNR (against the fp32 shadow) a 16-bit module output may have
   in a healthy model: one rounding to a format of p significant bits gives 10 log10(3 2^(2p))
   dB (a relative error uniform within half an ULP), 71.0 dB for float16 (p = 11) and 52.9 dB
   for bfloat16 (p = 8); ``SQNR_ALLOWANCE_DB`` (30 dB, a noise power 1000 times one rounding's)
   is allowed for the error that layers accumulate. Below the floor the signal has collapsed.
   In an fp8 run every layer is held to ``FP8_SQNR_FLOOR_DB`` (10 dB, noise a tenth of the
   signal's power): one rounding to float8_e4m3fn (p = 4) gives only 28.9 dB.
2. ``FLUSH_FRACTION``: a module whose output flushes more than 1 % of the shadow's non-zero
   values, and with them more of its L1 mass than the noise its SQNR floor allows
   (10^(-floor / 20): 0.9 % for float16, 7.2 % for bfloat16), is not healthy; less is a note.
3. ``MASS_NEGLIGIBLE``: a flush (forward, gradient at the loss scale, a float8 operand) that
   carries less than 2^-20 (about 1e-6) of the tensor's L1 mass (``reference/health.py`` rules
   13-14) is a note, never a verdict: what it loses is 2^9 times smaller than float16's own
   rounding of the values kept (a relative 2^-11), so it cannot change the sums it enters. A
   flush of many values that carry a share above it (an fp8 operand whose outlier channels set
   the scale, a gradient the scale is too small for) is judged.
4. ``SCALE_USEFUL_LOG2``: the loss scales a scaler is useful at, 2^0 .. 2^24 (apex's ceiling;
   torch starts at 2^16). Advice to scale beyond it names the loss term or module instead.
5. ``FP8_SATURATION``, ``FP8_UNDERFLOW``, ``UPDATE_UNDERFLOW``: as the verdicts' rules say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["FLUSH_FRACTION", "FP8_SATURATION", "FP8_SQNR_FLOOR_DB", "flush_noise", "sqnr_floor_db", "FP8_UNDERFLOW", "KINDS", "MASS_NEGLIGIBLE", "SCALE_USEFUL_LOG2",
           "SEVERITY", "SQNR_ALLOWANCE_DB", "SQNR_FLOOR_DB", "UPDATE_UNDERFLOW", "Verdict", "rank"]

KINDS: tuple[str, ...] = (
    "not-precision", "forward-overflow", "inner-overflow", "gradient-overflow", "unsafe-math", "fp16-normalization",
    "gradient-underflow", "fp8-saturation", "fp8-underflow", "update-underflow", "loss-in-low-precision",
    "degraded",
)
SEVERITY = {"not-precision": "error", "forward-overflow": "error", "inner-overflow": "error",
            "gradient-overflow": "error", "unsafe-math": "error", "fp16-normalization": "warning",
            "gradient-underflow": "warning", "fp8-saturation": "warning", "fp8-underflow": "warning",
            "update-underflow": "warning", "loss-in-low-precision": "warning", "degraded": "warning"}


def _one_rounding_db(significant_bits: int) -> float:
    return 10.0 * math.log10(3.0 * 4.0**significant_bits)


SQNR_ALLOWANCE_DB = 30.0
SQNR_FLOOR_DB = {"float16": round(_one_rounding_db(11) - SQNR_ALLOWANCE_DB, 1),
                 "bfloat16": round(_one_rounding_db(8) - SQNR_ALLOWANCE_DB, 1)}
"""Rule 1: 41.0 dB for float16, 22.9 dB for bfloat16."""
FP8_SQNR_FLOOR_DB = 10.0
FLUSH_FRACTION = 0.01
MASS_NEGLIGIBLE = 2.0**-20
SCALE_USEFUL_LOG2 = (0, 24)
FP8_SATURATION = 0.0
"""Any saturated value of a float8 operand is a verdict (torchao's dynamic scales never saturate)."""
FP8_UNDERFLOW = 0.01
"""More than 1 % of a float8 operand's non-zero values flushed to zero (and a share of its mass)."""
UPDATE_UNDERFLOW = 0.5
"""At least half of a 16-bit parameter's updates round away."""


@dataclass(frozen=True)
class Verdict:
    """One finding: ``kind`` from ``KINDS``, the ``module`` (qualified name, or None for the model
    as a whole), ``severity`` (error or warning), what was seen, the numbers, and the fix."""

    kind: str
    module: str | None
    message: str
    fix: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown verdict kind {self.kind!r}; kinds: {', '.join(KINDS)}")

    @property
    def severity(self) -> str:
        return SEVERITY[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "module": self.module, "severity": self.severity, "message": self.message,
                "fix": self.fix, "numbers": self.numbers}


def rank(verdicts: Iterable[Verdict]) -> list[Verdict]:
    """Rule order: by kind's rank, then by module name (None first)."""
    return sorted(verdicts, key=lambda v: (KINDS.index(v.kind), v.module or ""))


def island(name: str) -> str:
    """The setting that runs ``name`` in an fp32 island."""
    return f"precision.fp32_modules: [{name!r}]"


def sqnr_floor_db(dtype: str, precision: str) -> float | None:
    """Rule 1: the SQNR floor of a layer whose output is ``dtype`` in a ``precision`` run (None: not judged)."""
    if dtype not in SQNR_FLOOR_DB:
        return None
    return FP8_SQNR_FLOOR_DB if precision == "fp8" else SQNR_FLOOR_DB[dtype]


def flush_noise(floor_db: float) -> float:
    """Rule 2: the share of L1 mass a flush may take within the noise the SQNR floor allows."""
    return 10.0 ** (-floor_db / 20.0)
