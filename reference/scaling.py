"""Dynamic loss scaling: the rules of torch.amp.GradScaler, bit for bit, plus the peers' policies.

The scale S is a float32 number, the growth tracker an int32 counter. Rules:

1. Scaling the loss multiplies it by S: a float32 loss gives f32(loss * S); the full dtype
   table (float16/bfloat16/float64 losses) is in `scale_loss`. A 0-d loss promotes with the 0-d
   scale: a 0-d float16/bfloat16 loss gives a float32 product. torch's GradScaler.scale refuses
   a Python number (ValueError); the spec reads one as a float32 0-d loss for its own step.
2. The inverse scale is inv = f32(1 / f64(S)), one correctly rounded float32 reciprocal.
3. found_inf is decided on the *scaled* gradients, before unscaling: any +inf, -inf or NaN in any
   gradient (16-bit gradients are first widened exactly to float32). Subnormals and +-0 are finite.
   An overflow caused by the unscale multiply itself (possible when S < 1) is not detected.
   torch's kernel writes 1.0 into its float32 flag on a find and otherwise leaves it as it was:
   it never adds to it and never clears it, so several checks sharing a flag OR together.
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

11. A static loss scale (``dynamic=False``) never grows and never backs off; the tracker stays
    where it is. Whether an overflowing step is skipped is ``skip_on_overflow`` (`step_applies`):
    every dynamic policy skips; DeepSpeed's and Megatron's static scales skip too, apex's static
    scale does not (its ``update_scale`` skips only when dynamic), jmp leaves the choice to the
    caller's ``select_tree``. torch has no static scale (``enabled=False`` means no scaling).
12. The call sequence (`unscale_stage`, `step_stage`, `check_update`), as torch.amp.GradScaler
    checks it, with its exception types and messages: each optimizer goes READY -> UNSCALED ->
    STEPPED between two updates. unscale_, step and update before the first scale() raise
    AssertionError; a second unscale_, or one after step, raises RuntimeError, as does a second
    step and step(closure=...) (checked before anything else); unscale_ refuses float16
    gradients (ValueError, before any gradient is touched); step of an optimizer with no
    gradient unscales (the stage becomes UNSCALED) and then raises AssertionError; update
    without any recorded inf check raises AssertionError. update(), with or without new_scale,
    sends every optimizer back to READY.
13. Saving and loading (`state_dict`, `load_state_dict`): torch saves five entries, the scale
    as a Python float, the factors, the interval and the tracker. Before the first scale() the
    scale is kept as given, unrounded (``pending_scale``); the first scale() rounds it to
    float32. load_state_dict assigns every entry without validation: the tracker is taken as
    it is, even at or past growth_interval, after which the scale never grows (rule 7's
    equality) and the tracker keeps counting. Pickling a scaler between iterations saves the
    same state (and refuses while an optimizer is UNSCALED or STEPPED).
14. update(new_scale) (`set_scale`) sets S = f32(new_scale) and leaves the tracker and the
    hysteresis alone.

The defaults of ScalerConfig reproduce torch exactly; `ScalerConfig.preset` gives the peers'
policies (`PRESETS`). Arithmetic for every preset is torch's (factors applied in float64, one
rounding to float32); for the peers' factors (2 and 0.5) and scales >= 1 their own arithmetic
gives the same numbers. What each preset is, and where the peer differs:

- ``megatron``: Megatron-LM's DynamicGradScaler (fp16). It grows without a finiteness check (the
  two differ only once S reaches 2**127) and lets its hysteresis counter go negative where this
  spec holds it at 0 (same backoff decisions).
- ``deepspeed``: DeepSpeed's ``DynamicLossScaler``, the one its ZeRO optimizers (stages 1-3)
  use: hysteresis 2, floor 1 with a raise at the floor, the since-overflow growth count of rule
  8. It holds its hysteresis at 1 where the spec holds 0 (same decisions), and its scale is a
  Python float: it keeps growing past float32's range (2**128 and beyond) where the spec, like
  torch, refuses a growth to inf and stays at 2**127.
- ``deepspeed_fp16``: DeepSpeed's non-ZeRO fp16 optimizers (``FP16_Optimizer``), whose own
  ``_update_scale`` has no hysteresis and no raise at the floor: the ``deepspeed`` policy with
  ``hysteresis=1, raise_at_min_scale=False`` (initial scale 2**16 and window 1000 as its fp16
  config block gives them). Its checkpoint keeps the scale and the iteration counters, no
  hysteresis.
- ``apex``: NVIDIA apex amp's ``LossScaler`` (its last release): torch's policy with a window of
  2000, factor 2, no floor by default (``min_loss_scale=None``) and a ceiling of 2**24
  (``max_loss_scale``).
- ``jmp``: jmp's ``DynamicLossScale``: period 2000, factor 2, a floor of 1.0 by default
  (``min_loss_scale``: a backoff is ``max(min, S / factor)``, never a raise), growth kept only if
  finite in the scale's dtype; the counter restarts after each growth, as torch's tracker does.
  The spec's initial scale is jmp's documented 2**15 (jmp itself takes the caller's).
- ``static``: a fixed scale (rule 11), skipping overflowing steps as DeepSpeed and Megatron do;
  ``skip_on_overflow=False`` is apex's static scale.
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
    "READY",
    "STATE_DICT_KEYS",
    "STEPPED",
    "UNSCALED",
    "NoInfChecksError",
    "OptimizerStage",
    "check_update",
    "load_state_dict",
    "set_scale",
    "state_dict",
    "step_applies",
    "step_stage",
    "unscale_stage",
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
        # DeepSpeed's non-ZeRO FP16_Optimizer._update_scale: no hysteresis, no raise at the floor.
        "deepspeed_fp16": types.MappingProxyType(
            {
                "init_scale": 2.0**16,
                "growth_interval": 1000,
                "min_scale": 1.0,
                "growth_since_overflow": True,
            }
        ),
        # apex.amp.scaler.LossScaler: window 2000, no floor, ceiling 2**24.
        "apex": types.MappingProxyType({"init_scale": 2.0**16, "growth_interval": 2000, "max_scale": 2.0**24}),
        # jmp.DynamicLossScale: period 2000, factor 2, min_loss_scale 1.0; README's 2**15 start.
        "jmp": types.MappingProxyType({"init_scale": 2.0**15, "growth_interval": 2000, "min_scale": 1.0}),
        # A fixed scale that skips overflowing steps (DeepSpeed's and Megatron's static scales).
        "static": types.MappingProxyType({"dynamic": False}),
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
    growth_since_overflow selects DeepSpeed's growth count (rule 8); dynamic=False is a static
    scale and skip_on_overflow whether an overflowing step is skipped (rule 11).
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
    dynamic: bool = True
    skip_on_overflow: bool = True

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
        for name in ("raise_at_min_scale", "consecutive_hysteresis", "growth_since_overflow", "dynamic",
                     "skip_on_overflow"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.raise_at_min_scale and self.min_scale is None:
            raise ValueError("raise_at_min_scale=True needs a min_scale, got min_scale=None")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ScalerConfig:
        """The named policy (one of `PRESETS`), with fields overridden by keyword."""
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
    raises OverflowError. Raises ScaleAtMinimumError from back_off. A static scale (rule 11)
    comes back unchanged.
    """
    if not config.dynamic:
        return state
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


# ----------------------------------------------------------------------------- skipping, the call sequence


def step_applies(found_inf: Any, config: ScalerConfig) -> bool:
    """An overflowing step is skipped unless the policy says otherwise (rule 11).

    Every dynamic policy skips; ``skip_on_overflow=False`` (apex's static scale) applies the
    step whatever the gradients hold.
    """
    return not is_found(found_inf) or not config.skip_on_overflow


READY, UNSCALED, STEPPED = "ready", "unscaled", "stepped"
"""The stages of one optimizer between two updates (torch's ``OptState``)."""

_NOT_SCALED = ("Attempted {} but _scale is None.  This may indicate your script did not use "
               "scaler.scale(loss or outputs) earlier in the iteration.")


@dataclass(frozen=True)
class OptimizerStage:
    """One optimizer's place in the call sequence: its stage and whether its unscale recorded an
    inf check (it records none when the optimizer has no gradient)."""

    stage: str = READY
    inf_checks: bool = False


def unscale_stage(stage: OptimizerStage, *, scaled: bool, grad_dtypes: Sequence[Any]) -> OptimizerStage:
    """``unscale_`` in the call sequence (rule 12): the stage after it, or torch's exception.

    ``scaled``: scale() was called since the scaler was made (or loaded); ``grad_dtypes``: the
    dtypes of the optimizer's gradients that are not None. Checked in torch's order: not scaled
    (AssertionError), already UNSCALED or STEPPED (RuntimeError), a float16 gradient
    (ValueError, nothing unscaled).
    """
    if not scaled:
        raise AssertionError(_NOT_SCALED.format("unscale_"))
    if stage.stage == UNSCALED:
        raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
    if stage.stage == STEPPED:
        raise RuntimeError("unscale_() is being called after step().")
    if any(np.dtype(d) == np.float16 for d in grad_dtypes):
        raise ValueError("Attempting to unscale FP16 gradients.")
    return OptimizerStage(UNSCALED, bool(len(grad_dtypes)))


def step_stage(stage: OptimizerStage, *, scaled: bool, grad_dtypes: Sequence[Any], closure: bool = False
               ) -> tuple[OptimizerStage, OptimizerStage]:
    """``step`` of a plain (not fused) optimizer in the call sequence (rule 12).

    Returns ``(after_unscale, after_step)``: the stage once step's own unscale (from READY) is
    done, and the stage after the step. Raises torch's exception instead, in torch's order:
    ``closure`` (RuntimeError), not scaled (AssertionError), already STEPPED (RuntimeError),
    unscale_'s own checks, then no inf check recorded (AssertionError; the stage is then
    ``after_unscale``, as torch leaves it).
    """
    if closure:
        raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
    if not scaled:
        raise AssertionError(_NOT_SCALED.format("step"))
    if stage.stage == STEPPED:
        raise RuntimeError("step() has already been called since the last update().")
    unscaled = unscale_stage(stage, scaled=True, grad_dtypes=grad_dtypes) if stage.stage == READY else stage
    if not unscaled.inf_checks:
        raise NoInfChecksError(unscaled)
    return unscaled, OptimizerStage(STEPPED, True)


class NoInfChecksError(AssertionError):
    """step() of an optimizer that recorded no inf check; ``stage`` is where torch leaves it."""

    def __init__(self, stage: OptimizerStage) -> None:
        super().__init__("No inf checks were recorded for this optimizer.")
        self.stage = stage


def check_update(stages: Sequence[OptimizerStage], *, scaled: bool, new_scale: bool = False) -> None:
    """``update`` in the call sequence (rule 12): torch's exception, or None when it may run.

    Not scaled: AssertionError. Without ``new_scale``, at least one optimizer must have recorded
    an inf check since the last update (AssertionError). Afterwards every optimizer is READY.
    """
    if not scaled:
        raise AssertionError(_NOT_SCALED.format("update"))
    if not new_scale and not any(s.inf_checks for s in stages):
        raise AssertionError("No inf checks were recorded prior to update.")


# ----------------------------------------------------------------------------- saving, loading, new_scale

STATE_DICT_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
"""The entries of torch's GradScaler.state_dict, in its order."""


def state_dict(state: ScalerState, config: ScalerConfig, *, pending_scale: float | None = None) -> dict[str, Any]:
    """What torch's ``state_dict`` saves (rule 13): the scale as a Python float, the factors,
    the interval and the tracker as an int.

    ``pending_scale``: before the first scale() torch holds the scale as it was given or loaded,
    unrounded, and saves that value instead of ``state.scale``.
    """
    scale = float(pending_scale) if pending_scale is not None else float(state.scale)
    return {"scale": scale, "growth_factor": config.growth_factor, "backoff_factor": config.backoff_factor,
            "growth_interval": config.growth_interval, "_growth_tracker": int(state.growth_tracker)}


def load_state_dict(saved: Mapping[str, Any], config: ScalerConfig) -> tuple[ScalerConfig, ScalerState, float]:
    """``load_state_dict`` (rule 13): the configuration with the saved factors and interval, the
    state (scale rounded to float32, as the first scale() will round it; the tracker as saved,
    even at or past growth_interval; the full hysteresis), and the pending unrounded scale.

    The factors are validated as ``ScalerConfig`` validates them (torch accepts anything).
    """
    missing = [k for k in STATE_DICT_KEYS if k not in saved]
    if missing:
        raise KeyError(f"saved scaler state lacks {missing}")
    loaded = dataclasses.replace(config, growth_factor=saved["growth_factor"], backoff_factor=saved["backoff_factor"],
                                 growth_interval=saved["growth_interval"])
    with np.errstate(over="ignore"):
        state = ScalerState(np.float32(saved["scale"]), np.int32(int(saved["_growth_tracker"])), loaded.hysteresis)
    return loaded, state, float(saved["scale"])


def set_scale(state: ScalerState, new_scale: Any) -> ScalerState:
    """``update(new_scale)`` (rule 14): S = f32(new_scale); tracker and hysteresis unchanged."""
    with np.errstate(over="ignore"):
        return ScalerState(np.float32(np.asarray(new_scale, dtype=np.float64).reshape(())), state.growth_tracker,
                           state.hysteresis_left)


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
    step_applies,
    unscale_stage,
    step_stage,
    check_update,
    state_dict,
    load_state_dict,
    set_scale,
)
"""The rule functions in the order a training step meets them (each docstring opens with its rule)."""
