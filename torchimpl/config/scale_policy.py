"""The loss scale's policy: the presets, a configuration resolved against them, its checks.

``DynamicLossScaler`` (``torchimpl.train.scaler``, the torch mechanics) is a
``torch.amp.GradScaler`` with seven presets:

1. ``torch``: exactly ``torch.amp.GradScaler``. The update is torch's own kernel
   (``torch._amp_update_scale_``): on an overflow ``scale = f32(f64(scale) * backoff_factor)``
   and the growth tracker resets; after ``growth_interval`` consecutive clean steps
   ``scale = f32(f64(scale) * growth_factor)`` if that is finite, and the tracker resets
   either way. No floor: the scale can underflow to 0.
2. ``megatron`` (Megatron-LM ``DynamicGradScaler``): initial scale 2**32, interval 1000,
   hysteresis 2, ``min_scale`` 1.0. An overflow decrements the hysteresis counter and backs
   off only when it reaches 0; the counter is refilled only when the scale grows. The backed
   off scale is clamped to ``min_scale``; at the floor, overflowing steps keep being skipped.
3. ``deepspeed`` (DeepSpeed ``DynamicLossScaler``): initial scale 2**16, interval 1000,
   hysteresis 2, ``min_scale`` 1.0, and an overflow that would back off a scale already at
   ``min_scale`` raises ``ScaleAtMinimumError``. Growth follows DeepSpeed's counter: the
   scale grows on the clean step that follows ``growth_interval`` clean steps since the last
   overflow, then every ``growth_interval`` clean steps. Hysteresis is refilled at growth, or
   at every clean step with ``consecutive_hysteresis``.

4. ``deepspeed_fp16`` (DeepSpeed's non-ZeRO ``FP16_Optimizer``, whose ``_update_scale`` has no
   hysteresis and no raise at the floor): ``deepspeed`` with ``hysteresis=1`` and
   ``raise_at_min_scale=False``. (``deepspeed`` is the ``DynamicLossScaler`` of ZeRO stages 1-3.)
5. ``apex`` (NVIDIA apex amp's ``LossScaler``): torch's policy with a window of 2000, no floor
   and a ceiling of 2**24.
6. ``jmp`` (jmp's ``DynamicLossScale``): initial scale 2**15 (its README's), period 2000,
   factor 2, a floor of 1.0 that clamps (``max(min_loss_scale, scale / factor)``), growth kept
   only if finite.
7. ``static``: a fixed scale (``dynamic=False``): no growth, no backoff, the tracker stays.
   Overflowing steps are skipped (``skip_on_overflow=True``), as DeepSpeed's and Megatron's
   static scales do; ``skip_on_overflow=False`` is apex's static scale, which steps anyway
   (then ``step`` needs a non-fused optimizer). jmp leaves skipping to the caller; torch has no
   static scale.

Where the peers themselves differ from these presets (their arithmetic is Python or float64
where ampspec's is torch's float32 state): DeepSpeed's scale is a Python float that grows past
float32's range (2**128 and beyond) where ampspec refuses a growth to inf and stays at 2**127;
Megatron grows without a finiteness check; the hysteresis counters of Megatron (negative) and
DeepSpeed (held at 1) bottom out differently from ampspec's 0, with the same decisions.

This module imports no torch: a configuration is checked (``ampspec config``, ``ampspec
replay``'s bridge) before any tensor exists.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = [
    "PRESETS",
    "ResolvedScalerConfig",
    "ScaleAtMinimumError",
    "ScalerConfig",
    "with_fields",
]

_INT32_MAX = 2**31 - 1


class ScaleAtMinimumError(RuntimeError):
    """Gradients overflowed while the loss scale was already at ``min_scale``.

    Raised by ``DynamicLossScaler.update`` when ``raise_at_min_scale`` is on (the ``deepspeed``
    preset); the scaler's state is left as it was before that ``update``.
    """

    def __init__(self, scale: float, min_scale: float) -> None:
        self.scale = scale
        self.min_scale = min_scale
        super().__init__(
            f"gradients overflowed with the loss scale already at its minimum "
            f"(scale={scale!r}, min_scale={min_scale!r}): it cannot be decreased any further. "
            f"The model produces non-finite gradients even at the smallest allowed scale; "
            f"look for the non-finite value itself (e.g. rerun the step in fp32) or lower "
            f"min_scale."
        )


@dataclass(frozen=True)
class ResolvedScalerConfig:
    """A scaler configuration with every value concrete (no ``None`` meaning "the preset's").

    ``min_scale`` / ``max_scale`` of ``None`` mean no floor / no ceiling.
    """

    preset: str
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float | None
    max_scale: float | None
    raise_at_min_scale: bool
    consecutive_hysteresis: bool
    enabled: bool = True
    dynamic: bool = True
    skip_on_overflow: bool = True

    @property
    def is_plain_torch(self) -> bool:
        """True when the update is exactly torch's kernel (no extension is active)."""
        return (
            self.preset == "torch"
            and self.hysteresis == 1
            and self.min_scale is None
            and self.max_scale is None
            and not self.raise_at_min_scale
            and self.dynamic
            and self.skip_on_overflow
        )

    @property
    def growth_since_overflow(self) -> bool:
        """DeepSpeed's growth count (clean steps since the last overflow), for its presets."""
        return self.preset in _SINCE_OVERFLOW_PRESETS


PRESETS: Mapping[str, ResolvedScalerConfig] = MappingProxyType(
    {
        "torch": ResolvedScalerConfig(
            preset="torch",
            init_scale=2.0**16,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=2000,
            hysteresis=1,
            min_scale=None,
            max_scale=None,
            raise_at_min_scale=False,
            consecutive_hysteresis=False,
        ),
        "megatron": ResolvedScalerConfig(
            preset="megatron",
            init_scale=2.0**32,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=1000,
            hysteresis=2,
            min_scale=1.0,
            max_scale=None,
            raise_at_min_scale=False,
            consecutive_hysteresis=False,
        ),
        "deepspeed": ResolvedScalerConfig(
            preset="deepspeed",
            init_scale=2.0**16,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=1000,
            hysteresis=2,
            min_scale=1.0,
            max_scale=None,
            raise_at_min_scale=True,
            consecutive_hysteresis=False,
        ),
        "deepspeed_fp16": ResolvedScalerConfig(
            preset="deepspeed_fp16",
            init_scale=2.0**16,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=1000,
            hysteresis=1,
            min_scale=1.0,
            max_scale=None,
            raise_at_min_scale=False,
            consecutive_hysteresis=False,
        ),
        "apex": ResolvedScalerConfig(
            preset="apex",
            init_scale=2.0**16,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=2000,
            hysteresis=1,
            min_scale=None,
            max_scale=2.0**24,
            raise_at_min_scale=False,
            consecutive_hysteresis=False,
        ),
        "jmp": ResolvedScalerConfig(
            preset="jmp",
            init_scale=2.0**15,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=2000,
            hysteresis=1,
            min_scale=1.0,
            max_scale=None,
            raise_at_min_scale=False,
            consecutive_hysteresis=False,
        ),
        "static": ResolvedScalerConfig(
            preset="static",
            init_scale=2.0**16,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=2000,
            hysteresis=1,
            min_scale=None,
            max_scale=None,
            raise_at_min_scale=False,
            consecutive_hysteresis=False,
            dynamic=False,
        ),
    }
)

# Presets that count growth as DeepSpeed does (clean steps since the last overflow).
_SINCE_OVERFLOW_PRESETS = ("deepspeed", "deepspeed_fp16")


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _f32(x: float) -> float:
    """``x`` rounded to float32 (nearest even), as a Python float, without touching torch."""
    try:
        return struct.unpack("<f", struct.pack("<f", float(x)))[0]
    except OverflowError:  # rounds past FLT_MAX
        return math.copysign(math.inf, x)


def _positive_f32_problem(name: str, x: object) -> str | None:
    """Why ``x`` is not a positive number that stays finite and non-zero in float32."""
    if not _is_real(x):
        return f"{name} must be a real number, got {x!r}"
    v = float(x)
    if not (math.isfinite(v) and v > 0):
        return f"{name} must be finite and > 0, got {v!r}"
    r = _f32(v)
    if not math.isfinite(r) or r == 0.0:
        return f"{name} must be within float32's range (it is stored as float32), got {v!r}"
    return None


def _config_problems(c: ResolvedScalerConfig) -> list[str]:
    """Every problem with a resolved configuration, one message per field."""
    problems: list[str] = []
    if not isinstance(c.preset, str) or c.preset not in PRESETS:
        problems.append(f"preset must be one of {sorted(PRESETS)}, got {c.preset!r}")
    p = _positive_f32_problem("init_scale", c.init_scale)
    if p:
        problems.append(p)
    if not _is_real(c.growth_factor):
        problems.append(f"growth_factor must be a real number, got {c.growth_factor!r}")
    elif not (math.isfinite(c.growth_factor) and c.growth_factor > 1):
        problems.append(f"growth_factor must be finite and > 1, got {c.growth_factor!r}")
    if not _is_real(c.backoff_factor):
        problems.append(f"backoff_factor must be a real number, got {c.backoff_factor!r}")
    elif not (0 < c.backoff_factor < 1):
        problems.append(f"backoff_factor must be > 0 and < 1, got {c.backoff_factor!r}")
    if not _is_int(c.growth_interval) or not 1 <= c.growth_interval <= _INT32_MAX:
        problems.append(
            f"growth_interval must be an int >= 1 (and < 2**31), got {c.growth_interval!r}"
        )
    if not _is_int(c.hysteresis) or not 1 <= c.hysteresis <= _INT32_MAX:
        problems.append(f"hysteresis must be an int >= 1 (and < 2**31), got {c.hysteresis!r}")
    problems += _bounds_problems(c)
    if not isinstance(c.raise_at_min_scale, bool):
        problems.append(f"raise_at_min_scale must be a bool, got {c.raise_at_min_scale!r}")
    elif c.raise_at_min_scale and c.min_scale is None:
        problems.append("raise_at_min_scale=True needs a min_scale (got min_scale=None)")
    if not isinstance(c.consecutive_hysteresis, bool):
        problems.append(
            f"consecutive_hysteresis must be a bool, got {c.consecutive_hysteresis!r}"
        )
    for name in ("enabled", "dynamic", "skip_on_overflow"):
        if not isinstance(getattr(c, name), bool):
            problems.append(f"{name} must be a bool, got {getattr(c, name)!r}")
    return problems


def _bounds_problems(c: ResolvedScalerConfig) -> list[str]:
    """The floor and the ceiling: each a positive float32, in order, around ``init_scale``."""
    problems: list[str] = []
    bounds_ok = True
    for name, v in (("min_scale", c.min_scale), ("max_scale", c.max_scale)):
        if v is not None:
            p = _positive_f32_problem(name, v)
            if p:
                problems.append(p + " (or None)")
                bounds_ok = False
    if bounds_ok:
        lo = None if c.min_scale is None else _f32(c.min_scale)
        hi = None if c.max_scale is None else _f32(c.max_scale)
        if lo is not None and hi is not None and lo > hi:
            problems.append(
                f"min_scale must be <= max_scale, got min_scale={c.min_scale!r}, "
                f"max_scale={c.max_scale!r}"
            )
        elif _positive_f32_problem("init_scale", c.init_scale) is None:
            s = _f32(c.init_scale)
            if lo is not None and s < lo:
                problems.append(
                    f"init_scale must be >= min_scale, got init_scale={c.init_scale!r}, "
                    f"min_scale={c.min_scale!r}"
                )
            if hi is not None and s > hi:
                problems.append(
                    f"init_scale must be <= max_scale, got init_scale={c.init_scale!r}, "
                    f"max_scale={c.max_scale!r}"
                )
    return problems


def with_fields(policy: ResolvedScalerConfig, named: Mapping[str, Any]) -> ResolvedScalerConfig:
    """``policy`` with the ``named`` fields changed and every other field as it was (``ampspec
    replay --set`` on a recorded policy). Naming another ``preset`` takes that preset's values
    for the fields not named. Raises ``ValueError`` naming every bad value."""
    unknown = sorted(set(named) - {f.name for f in dataclasses.fields(ResolvedScalerConfig)})
    if unknown:
        raise ValueError(f"scaler: unknown field(s) {unknown}")
    base = policy
    preset = named.get("preset", policy.preset)
    if preset != policy.preset and preset in PRESETS:
        base = PRESETS[preset]
    changed = dataclasses.replace(base, **named)
    problems = _config_problems(changed)
    if problems:
        raise ValueError("invalid scaler policy: " + "; ".join(problems))
    return changed


@dataclass(frozen=True)
class ScalerConfig:
    """Loss-scaler settings: a preset plus overrides.

    Every field left ``None`` takes the preset's value (``PRESETS[preset]``); an explicit value
    overrides it. ``min_scale`` / ``max_scale`` are compared and clamped as float32 values.
    Validated on construction: every problem is reported in one ``ValueError``.
    """

    init_scale: float | None = None
    growth_factor: float | None = None
    backoff_factor: float | None = None
    growth_interval: int | None = None
    preset: str = "torch"
    hysteresis: int | None = None
    min_scale: float | None = None
    max_scale: float | None = None
    raise_at_min_scale: bool | None = None
    enabled: bool = True
    consecutive_hysteresis: bool | None = None
    dynamic: bool | None = None
    skip_on_overflow: bool | None = None

    def __post_init__(self) -> None:
        problems = _config_problems(self._resolve())
        if problems:
            raise ValueError("invalid ScalerConfig: " + "; ".join(problems))

    def _resolve(self) -> ResolvedScalerConfig:
        # An unknown preset still resolves (over torch's values, keeping the bad name) so
        # that one error can report it together with every other problem.
        known = isinstance(self.preset, str) and self.preset in PRESETS
        base = PRESETS[self.preset] if known else PRESETS["torch"]
        overrides = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
        return dataclasses.replace(base, **overrides)

    def resolved(self) -> ResolvedScalerConfig:
        """The configuration with the preset's values filled in."""
        return self._resolve()
