"""Dynamic loss scaling: the rules of torch.amp.GradScaler, bit for bit, plus the peers' policies.

The scale S is a float32 number, the growth tracker an int32 counter. Rules:

1. Scaling the loss multiplies it by S: a float32 loss gives f32(loss * S); the full dtype
   table (float16/bfloat16/float64 losses) is in `scale_loss`.
2. The inverse scale is inv = f32(1 / f64(S)), one correctly rounded float32 reciprocal.
3. found_inf is decided on the *scaled* gradients, before unscaling: any +inf, -inf or NaN in any
   gradient (16-bit gradients are first widened exactly to float32). Subnormals and +-0 are finite.
   An overflow caused by the unscale multiply itself (possible when S < 1) is not detected.
4. Unscaling multiplies by inv, never divides by S: float32 gives f32(g * inv), float64 gives
   g * f64(inv), float16/bfloat16 give low(f32(g) * inv). When inv == 1 the gradients come back
   bit for bit, NaN payloads included. Every gradient is unscaled, even when found_inf is set.
5. An overflow (found_inf != 0; NaN counts as found) resets the growth tracker to 0 and uses up
   one unit of hysteresis. The scale backs off only when no hysteresis is left:
   S = f32(f64(S) * backoff_factor), clamped up to min_scale when a floor is set. torch has no
   floor: S can reach 0, a fixed point.
6. With raise_at_min_scale (DeepSpeed), an overflow that would back off a scale already at
   min_scale raises ScaleAtMinimumError instead.
7. A clean step adds 1 to the growth tracker. When it reaches growth_interval the scale grows:
   S = f32(f64(S) * growth_factor), clamped down to max_scale when a ceiling is set, and kept only
   if finite; the tracker restarts at 0 whether or not the scale changed.
8. DeepSpeed counts differently (growth_since_overflow): it grows when the number of clean
   iterations since the last overflow, minus one, is a positive multiple of growth_interval. So
   the first growth after an overflow (or after the start) needs growth_interval + 1 clean steps,
   and later ones every growth_interval.
9. Hysteresis is refilled to `hysteresis` at every growth (Megatron, DeepSpeed), and also at every
   clean step when consecutive_hysteresis is set (DeepSpeed's option). So after `hysteresis`
   overflows within one growth window, every further overflow backs off at once.
10. Several optimizers sharing one scaler back off once per update: the found_inf of the update is
    the OR of theirs (`update_scale_multi`).

The defaults of ScalerConfig reproduce torch exactly; `ScalerConfig.preset` gives the Megatron-LM
and DeepSpeed policies. Arithmetic for every preset is torch's (factors applied in float64, one
rounding to float32); for the peers' factors (2 and 0.5) and scales >= 1 their own arithmetic
gives the same numbers. Known peer quirks the spec does not copy: Megatron grows without a
finiteness check (the two differ only once S reaches 2**127); Megatron lets its hysteresis counter
go negative and DeepSpeed holds it at 1 where this spec holds it at 0 (same backoff decisions).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "PRESETS",
    "RULES",
    "ScaleAtMinimumError",
    "ScalerConfig",
    "ScalerState",
    "back_off",
    "grow",
    "has_inf_or_nan",
    "hysteresis_after_clean",
    "hysteresis_after_overflow",
    "initial_state",
    "inverse_scale",
    "is_found",
    "scale_loss",
    "should_grow",
    "tracker_after_growth",
    "tracker_after_overflow",
    "unscale_gradients",
    "unscale_gradients_",
    "update_scale",
    "update_scale_multi",
]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_LOW = (np.dtype(np.float16), _BF16)
_GRAD_DTYPES = (np.dtype(np.float16), _BF16, np.dtype(np.float32), np.dtype(np.float64))


class ScaleAtMinimumError(RuntimeError):
    """An overflow arrived while the scale was already at min_scale (DeepSpeed's abort)."""


# ----------------------------------------------------------------------------- configuration

PRESETS: Mapping[str, Mapping[str, Any]] = types.MappingProxyType(
    {
        # torch.amp.GradScaler defaults.
        "torch": types.MappingProxyType({}),
        # Megatron-LM OptimizerConfig defaults for its fp16 DynamicGradScaler.
        "megatron": types.MappingProxyType(
            {
                "init_scale": 2.0**32,
                "growth_interval": 1000,
                "hysteresis": 2,
                "min_scale": 1.0,
            }
        ),
        # DeepSpeed fp16 block defaults (initial_scale_power=16, loss_scale_window=1000, ...).
        "deepspeed": types.MappingProxyType(
            {
                "init_scale": 2.0**16,
                "growth_interval": 1000,
                "hysteresis": 2,
                "min_scale": 1.0,
                "raise_at_min_scale": True,
                "consecutive_hysteresis": False,
                "growth_since_overflow": True,
            }
        ),
    }
)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class ScalerConfig:
    """Parameters of a dynamic loss-scale schedule; the defaults are torch.amp.GradScaler's.

    Validation is stricter than torch's (torch checks only the two factors, and only with
    assertions): init_scale must be finite and > 0 and stay so in float32; growth_factor finite
    and > 1; backoff_factor strictly between 0 and 1; growth_interval and hysteresis ints >= 1;
    min_scale and max_scale None or positive, finite and nonzero in float32, min <= max, and
    init_scale inside the bounds that are set. raise_at_min_scale needs a min_scale.
    growth_since_overflow selects DeepSpeed's growth count (rule 8).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None
    raise_at_min_scale: bool = False
    consecutive_hysteresis: bool = False
    growth_since_overflow: bool = False

    def __post_init__(self) -> None:
        def positive_f32(name: str, value: object) -> None:
            if not _is_real(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
            with np.errstate(over="ignore"):
                f = np.float32(value)
            if not np.isfinite(f) or f == 0:
                raise ValueError(f"{name} must be nonzero and finite in float32, got {value!r}")

        positive_f32("init_scale", self.init_scale)
        if not _is_real(self.growth_factor) or not math.isfinite(self.growth_factor) or self.growth_factor <= 1:
            raise ValueError(f"growth_factor must be a finite number > 1, got {self.growth_factor!r}")
        if not _is_real(self.backoff_factor) or not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be a number with 0 < backoff_factor < 1, got {self.backoff_factor!r}")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("min_scale", "max_scale"):
            value = getattr(self, name)
            if value is not None:
                positive_f32(name, value)
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ValueError(f"min_scale must be <= max_scale, got min_scale={self.min_scale!r}, max_scale={self.max_scale!r}")
        if self.min_scale is not None and self.init_scale < self.min_scale:
            raise ValueError(f"init_scale must be >= min_scale={self.min_scale!r}, got {self.init_scale!r}")
        if self.max_scale is not None and self.init_scale > self.max_scale:
            raise ValueError(f"init_scale must be <= max_scale={self.max_scale!r}, got {self.init_scale!r}")
        for name in ("raise_at_min_scale", "consecutive_hysteresis", "growth_since_overflow"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.raise_at_min_scale and self.min_scale is None:
            raise ValueError("raise_at_min_scale=True needs a min_scale, got min_scale=None")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ScalerConfig:
        """The named policy (`torch`, `megatron`, `deepspeed`), with fields overridden by keyword."""
        if name not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"overrides must be ScalerConfig fields {sorted(fields)}, got {unknown}")
        return cls(**{**PRESETS[name], **overrides})


@dataclass(frozen=True)
class ScalerState:
    """The scaler's state: float32 scale, int32 growth tracker, overflows left before a backoff.

    The fields are stored as np.float32 / np.int32 / int; a wider value passed in is converted
    (a float64 scale is rounded once to float32).
    """

    scale: np.float32
    growth_tracker: np.int32
    hysteresis_left: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", np.float32(self.scale))
        object.__setattr__(self, "growth_tracker", np.int32(int(self.growth_tracker)))
        object.__setattr__(self, "hysteresis_left", int(self.hysteresis_left))


def initial_state(config: ScalerConfig) -> ScalerState:
    """Start of training: scale f32(init_scale), tracker 0, the full hysteresis."""
    return ScalerState(np.float32(config.init_scale), np.int32(0), config.hysteresis)


# ----------------------------------------------------------------------------- scale / unscale


def inverse_scale(state: ScalerState) -> np.float32:
    """The inverse scale is inv = f32(1 / f64(S)), one correctly rounded float32 reciprocal.

    S = 0 gives +inf, S = inf gives 0, NaN gives NaN.
    """
    with np.errstate(divide="ignore", over="ignore"):  # a subnormal S has no finite float32 inverse
        return np.float32(np.float64(1.0) / np.float64(state.scale))


def scale_loss(loss: Any, state: ScalerState) -> np.ndarray:
    """Scaling the loss multiplies it by S, with torch's type promotion.

    float32 (any shape): f32(x * S). float16/bfloat16 with ndim >= 1: low(f32(x) * S), S not first
    rounded to the low dtype. float16/bfloat16 0-d: float32 result f32(f32(x) * S) (0-d with 0-d
    promotes). float64: x * f64(S). A Python number is taken as a float32 0-d value. Returns a new
    array; overflow gives inf, never an error.
    """
    if isinstance(loss, (bool, np.bool_)) or not isinstance(loss, (int, float, np.ndarray, np.generic)):
        raise ValueError(f"loss must be a float number or a float array, got {type(loss).__name__}")
    x = np.asarray(loss, dtype=np.float32) if isinstance(loss, (int, float)) else np.asarray(loss)
    if x.dtype not in _GRAD_DTYPES:
        raise ValueError(f"loss must have dtype float16, bfloat16, float32 or float64, got {x.dtype}")
    s = state.scale
    with np.errstate(over="ignore", invalid="ignore"):
        if x.dtype == np.float64:
            return np.asarray(x * np.float64(s))
        if x.dtype == np.float32:
            return np.asarray(x * s)
        wide = np.asarray(x.astype(np.float32) * s)
        return wide if x.ndim == 0 else wide.astype(x.dtype)


def _as_float_arrays(grads: Sequence[Any], in_place: bool = False) -> list[np.ndarray]:
    if isinstance(grads, np.ndarray) or not isinstance(grads, Iterable):
        raise ValueError(f"grads must be a list of arrays, got {type(grads).__name__}")
    out = []
    for i, g in enumerate(grads):
        if in_place and (not isinstance(g, np.ndarray) or not g.flags.writeable):
            raise ValueError(f"grads[{i}] must be a writeable NumPy array to be unscaled in place, got "
                             f"{type(g).__name__}; use unscale_gradients for unscaled copies")
        a = np.asarray(g)
        if a.dtype not in _GRAD_DTYPES:
            raise ValueError(f"grads[{i}] must have dtype float16, bfloat16, float32 or float64, got {a.dtype}")
        out.append(a)
    return out


def has_inf_or_nan(grads: Sequence[np.ndarray]) -> bool:
    """found_inf is True when any gradient holds +inf, -inf or NaN (looked at before unscaling).

    float16/bfloat16 values are widened exactly to float32 first (the same answer). Subnormals
    and +-0 are finite. An empty list and zero-size arrays hold nothing non-finite: False.
    Dtypes: float16, bfloat16, float32, float64; anything else is a ValueError naming the index.
    """
    return _any_non_finite(_as_float_arrays(grads))


def _any_non_finite(arrays: list[np.ndarray]) -> bool:
    for a in arrays:
        wide = a.astype(np.float32) if a.dtype in _LOW else a
        if not np.isfinite(wide).all():
            return True
    return False


def unscale_gradients(grads: Sequence[np.ndarray], state: ScalerState) -> tuple[list[np.ndarray], bool]:
    """Unscaling multiplies each gradient by inv, never divides by S; found_inf is taken first.

    float32: f32(g * inv); float64: g * f64(inv); float16/bfloat16: low(f32(g) * inv). When
    inv == 1 the gradients come back bit for bit (NaN payloads kept). All gradients are unscaled
    even when found_inf is True, as torch does. found_inf looks at the inputs only, so an overflow
    produced by the multiply (S < 1, inv > 1) is not detected; with S = 0, inv is inf, finite
    gradients become +-inf or NaN (0 * inf) and found_inf stays False. Returns new arrays of the
    input dtypes and shapes; the inputs are not modified. NaN bit patterns are not part of the
    rule when inv != 1 (torch's bfloat16 rounding writes a canonical NaN where ml_dtypes keeps the
    payload): compare NaN as a class.
    """
    arrays = _as_float_arrays(grads)
    found = _any_non_finite(arrays)
    inv = inverse_scale(state)
    if inv == np.float32(1.0):
        return [a.copy() for a in arrays], found
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        return [_unscale_into(a, inv, np.empty_like(a)) for a in arrays], found


def unscale_gradients_(grads: Sequence[np.ndarray], state: ScalerState) -> tuple[list[np.ndarray], bool]:
    """``unscale_gradients`` in place, as torch's ``_amp_foreach_non_finite_check_and_unscale_``:
    the same rules and bits (found_inf is taken on the scaled values before any is overwritten),
    but each array is overwritten with its unscaled values and the list holds those same arrays.
    For gradients the caller owns. ``grads`` must be writeable NumPy arrays (anything else is a
    ``ValueError``: a converted copy would be unscaled and lost).
    """
    arrays = _as_float_arrays(grads, in_place=True)
    found = _any_non_finite(arrays)
    inv = inverse_scale(state)
    if inv != np.float32(1.0):
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            for a in arrays:
                _unscale_into(a, inv, a)
    return arrays, found


def _unscale_into(a: np.ndarray, inv: np.float32, out: np.ndarray) -> np.ndarray:
    """Rule 4's multiply of one gradient by inv, written to ``out`` (may be ``a``)."""
    if a.dtype == np.float64:
        np.multiply(a, np.float64(inv), out=out)
    elif a.dtype == np.float32:
        np.multiply(a, inv, out=out)
    else:
        out[...] = (a.astype(np.float32) * inv).astype(a.dtype)
    return out


# ----------------------------------------------------------------------------- the update rules


def is_found(found_inf: Any) -> bool:
    """An update counts as an overflow when found_inf != 0; NaN counts as found (C++ truthiness).

    Takes a bool or a number (torch passes a float32 0.0/1.0, or a sum of several such flags).
    """
    if isinstance(found_inf, (bool, np.bool_)):
        return bool(found_inf)
    if _is_real(found_inf) or (isinstance(found_inf, np.ndarray) and found_inf.size == 1):
        v = float(np.asarray(found_inf).reshape(()))
        return v != 0.0 or math.isnan(v)
    raise ValueError(f"found_inf must be a bool or a number, got {found_inf!r}")


def tracker_after_overflow() -> int:
    """An overflow restarts the growth tracker at 0, in every preset (hysteresis or not)."""
    return 0


def hysteresis_after_overflow(hysteresis_left: int) -> int:
    """An overflow uses up one unit of hysteresis (never below 0); it backs off when none is left.

    With hysteresis=1 (torch) every overflow backs off. Megatron lets the counter go negative and
    DeepSpeed holds it at 1 instead; the backoff decisions are the same.
    """
    return max(hysteresis_left - 1, 0)


def back_off(scale: np.float32, config: ScalerConfig) -> np.float32:
    """Backoff: S = f32(f64(S) * backoff_factor), clamped up to min_scale; DeepSpeed raises at min.

    Without a floor (torch) the scale can underflow to subnormals and to 0, a fixed point; inf
    stays inf, NaN stays NaN. With raise_at_min_scale (DeepSpeed), backing off a scale already
    at min_scale raises ScaleAtMinimumError.
    """
    floor = None if config.min_scale is None else np.float32(config.min_scale)
    if config.raise_at_min_scale and floor is not None and scale <= floor:
        raise ScaleAtMinimumError(
            f"loss scale {float(scale)!r} is already at min_scale={config.min_scale!r} and the gradients "
            "overflowed again: it cannot back off further (every further step would be skipped)"
        )
    new = np.float32(np.float64(scale) * config.backoff_factor)
    if floor is not None and new < floor:
        new = floor
    return new


def should_grow(count: int, config: ScalerConfig) -> bool:
    """Growth is due when the clean-step count (this step included) reaches growth_interval.

    With growth_since_overflow (DeepSpeed) it is due at growth_interval + 1: DeepSpeed grows when
    (clean iterations since the last overflow) - 1 is a positive multiple of growth_interval; the
    count restarts at 1 after each growth (tracker_after_growth) so later growths come every
    growth_interval. Equality, not >=: a tracker already past the target (loaded from elsewhere)
    never grows, as in torch.
    """
    target = config.growth_interval + (1 if config.growth_since_overflow else 0)
    return count == target


def tracker_after_growth(config: ScalerConfig) -> int:
    """After a growth (applied or refused) the tracker restarts at 0; at 1 for DeepSpeed's count."""
    return 1 if config.growth_since_overflow else 0


def grow(scale: np.float32, config: ScalerConfig) -> np.float32:
    """Growth: S = f32(f64(S) * growth_factor), clamped down to max_scale, kept only if finite.

    The factor is applied in float64 and rounded once (not f32(S) * f32(factor)). A result that
    overflows to inf is refused and S is kept, but landing exactly on FLT_MAX is accepted. With
    a ceiling the result is min(grown, f32(max_scale)) (so an inf growth becomes the ceiling).
    """
    with np.errstate(over="ignore"):
        new = np.float32(np.float64(scale) * config.growth_factor)
    if config.max_scale is not None and new > np.float32(config.max_scale):
        new = np.float32(config.max_scale)
    return new if np.isfinite(new) else scale


def hysteresis_after_clean(hysteresis_left: int, config: ScalerConfig) -> int:
    """A clean step refills hysteresis only with consecutive_hysteresis; every growth refills it."""
    return config.hysteresis if config.consecutive_hysteresis else hysteresis_left


def update_scale(state: ScalerState, found_inf: Any, config: ScalerConfig) -> ScalerState:
    """One scale update (torch's `_amp_update_scale_` plus the extended policy).

    Overflow (is_found): tracker_after_overflow; hysteresis_after_overflow; back_off only when it reached 0.
    Clean: count = tracker + 1; if should_grow(count): grow, tracker_after_growth, hysteresis
    refilled; otherwise tracker = count and hysteresis_after_clean. The tracker is int32: an
    increment past 2**31 - 1 (undefined in torch, unreachable unless growth never triggers)
    raises OverflowError. Raises ScaleAtMinimumError from back_off.
    """
    if is_found(found_inf):
        left = hysteresis_after_overflow(state.hysteresis_left)
        scale = back_off(state.scale, config) if left == 0 else state.scale
        return ScalerState(scale, np.int32(tracker_after_overflow()), left)
    count = int(state.growth_tracker) + 1
    if should_grow(count, config):
        return ScalerState(grow(state.scale, config), np.int32(tracker_after_growth(config)), config.hysteresis)
    return ScalerState(state.scale, np.int32(count), hysteresis_after_clean(state.hysteresis_left, config))


def update_scale_multi(state: ScalerState, found_infs: Sequence[Any], config: ScalerConfig) -> ScalerState:
    """Several optimizers (or devices) sharing one scaler back off once per update.

    found_inf of the update is the OR of the per-optimizer flags (torch sums them, and any
    nonzero sum backs off once). An empty list is a ValueError: torch refuses an update with no
    recorded inf checks.
    """
    flags = list(found_infs)
    if not flags:
        raise ValueError("found_infs must hold at least one flag, got an empty sequence")
    return update_scale(state, any(is_found(f) for f in flags), config)


RULES = (
    scale_loss,
    inverse_scale,
    has_inf_or_nan,
    unscale_gradients,
    is_found,
    tracker_after_overflow,
    hysteresis_after_overflow,
    back_off,
    should_grow,
    grow,
    tracker_after_growth,
    hysteresis_after_clean,
    update_scale_multi,
)
"""The rule functions in the order a training step meets them (each docstring opens with its rule)."""
