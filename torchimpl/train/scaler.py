"""Dynamic loss scaling on top of ``torch.amp.GradScaler``: the torch mechanics of the policy
that ``torchimpl.config.scale_policy`` states (the seven presets, a resolved configuration).

Every preset value can be overridden; any configuration other than plain ``torch`` (a floor,
a ceiling, hysteresis > 1, raising, a static scale) uses the tensor implementation of the same arithmetic:
products in float64 on the device, one rounding to float32; a backoff is clamped up to
``min_scale``, a growth clamped down to ``max_scale`` and then kept only if finite (so without a
ceiling a growth past float32's range is refused, with one it lands on the ceiling).
On MPS, which has no float64, the products are float32 (``scale * f32(factor)``), which can
differ from the float64 rule in the last bit for factors other than powers of two.

State: the scale (float32), the growth tracker (int32) and the hysteresis counter (int32) are
0-d tensors on the scale's device (the device of the first tensor passed to ``scale()``).

Host syncs (device-to-host reads), per optimizer step:

- ``scale``, ``unscale_``, ``update``, ``found_inf_tensor``, ``last_step_applied``,
  ``state_tensors``: none,
  except that ``update`` reads one flag when ``raise_at_min_scale`` is on (it must know on
  the host whether an overflow hit the floor in order to raise).
- ``step``: one with a plain optimizer (torch's own skip decision), none with an optimizer
  that handles the scale itself (``_step_supports_amp_scaling``, e.g. fused AdamW).
- ``get_scale``, ``get_hysteresis_left``, ``_get_growth_tracker``: one each; ``state_dict``:
  one in all.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import defaultdict
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler

from torchimpl._torch_compat import OptState, _amp_foreach_non_finite_check_and_unscale_, _refresh_per_optimizer_state
from torchimpl.config.scale_policy import (
    PRESETS,
    ResolvedScalerConfig,
    ScaleAtMinimumError,
    ScalerConfig,
    _config_problems,
    _f32,
    _is_int,
    with_fields,
)

__all__ = [
    "PRESETS",
    "DynamicLossScaler",
    "ResolvedScalerConfig",
    "ScaleAtMinimumError",
    "ScalerConfig",
    "make_grad_scaler",
    "with_fields",
]

_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_EXTRA_KEYS = (
    "preset",
    "hysteresis",
    "hysteresis_left",
    "min_scale",
    "max_scale",
    "raise_at_min_scale",
    "consecutive_hysteresis",
)
# Extension keys added later: a state saved without them loads with these values.
_OPTIONAL_KEYS = MappingProxyType({"dynamic": True, "skip_on_overflow": True})


class DynamicLossScaler(GradScaler):
    """``torch.amp.GradScaler`` with presets, hysteresis, a floor and a ceiling.

    Use it exactly like ``GradScaler``. Differences:

    - ``step(optimizer)`` returns a 0-d bool tensor on the scale's device, True when the
      optimizer's update was applied (``found_inf == 0``), instead of the optimizer's return
      value; reading it on the host is a sync that ``step`` itself does not make.
    - ``found_inf_tensor()`` gives the iteration's combined found_inf without a sync, and
      ``state_tensors()`` the live scale and growth tracker.
    - ``unscale_(optimizer, found_inf)`` writes the check's flag into a tensor of the
      caller's (torch allocates one and copies it per device).
    - ``state_dict`` holds the whole policy and state; ``load_state_dict`` validates
      everything and changes nothing when it rejects.
    """

    allow_fp16_grads = False  # True for fp16-true (make_grad_scaler): fp16 gradients unscaled in place

    def __init__(self, device: str = "cuda", config: ScalerConfig | None = None) -> None:
        if config is None:
            config = ScalerConfig()
        if not isinstance(config, ScalerConfig):
            raise ValueError(f"config must be a ScalerConfig or None, got {type(config).__name__}")
        policy = config.resolved()
        super().__init__(
            device,
            init_scale=policy.init_scale,
            growth_factor=policy.growth_factor,
            backoff_factor=policy.backoff_factor,
            growth_interval=policy.growth_interval,
            enabled=policy.enabled,
        )
        self._policy = policy
        self._init_hysteresis_left = policy.hysteresis
        self._hysteresis_tracker: torch.Tensor | None = None
        self._last_applied: torch.Tensor | None = None

    # --- configuration -------------------------------------------------------------------

    @property
    def policy(self) -> ResolvedScalerConfig:
        """The policy in force (after any ``load_state_dict`` or setter)."""
        return self._policy

    def _set_policy(self, policy: ResolvedScalerConfig) -> None:
        problems = _config_problems(policy)
        if problems:
            raise ValueError("invalid scaler setting: " + "; ".join(problems))
        self._policy = policy
        self._growth_factor = policy.growth_factor
        self._backoff_factor = policy.backoff_factor
        self._growth_interval = policy.growth_interval

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (validated, unlike torch's setter)."""
        self._set_policy(dataclasses.replace(self._policy, growth_factor=new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (validated, unlike torch's setter)."""
        self._set_policy(dataclasses.replace(self._policy, backoff_factor=new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (validated, unlike torch's setter)."""
        self._set_policy(dataclasses.replace(self._policy, growth_interval=new_interval))

    # --- state ---------------------------------------------------------------------------

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full(
            (), self._init_hysteresis_left, dtype=torch.int32, device=dev
        )

    def get_hysteresis_left(self) -> int:
        """Overflows still absorbed before the next backoff, counting the next one (a sync)."""
        if not self._enabled:
            return 0
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_left
        return int(self._hysteresis_tracker.item())

    def state_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The live scale (0-d float32) and growth tracker (0-d int32) on the scale's device.

        No host sync. ``update()`` (and ``load_state_dict``) change them in place, so clone one
        to keep its current value. Valid once the scale exists (after the first ``scale()``).
        """
        if not self._enabled:
            raise RuntimeError("state_tensors(): this scaler is disabled and holds no scale")
        return self._check_scale_growth_tracker("state_tensors")

    def found_inf_tensor(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The current iteration's combined found_inf: 0-d float32 on the scale's device.

        The sum over every optimizer and device recorded since the last ``update()`` (non-zero
        means an overflow); no host sync. Valid after ``unscale_``/``step`` and before
        ``update``. A disabled scaler checks nothing and returns 0. With ``out`` (a 0-d
        float32 tensor), the sum is written into it and ``out`` is returned: no new tensor.
        """
        if not self._enabled:
            zero = torch.zeros((), dtype=torch.float32)
            return zero if out is None else out.copy_(zero)
        scale, _ = self._check_scale_growth_tracker("found_inf_tensor")
        found = [fi for state in self._per_optimizer_states.values() for fi in state["found_inf_per_device"].values()]
        if not found:
            raise RuntimeError(
                "found_inf_tensor() needs an unscale_() or step() since the last update(): "
                "no inf checks were recorded in this iteration."
            )
        if out is not None:
            out.copy_(found[0])
            for fi in found[1:]:
                out.add_(fi.to(device=out.device, non_blocking=True))
            return out
        found = [fi.to(device=scale.device, non_blocking=True) for fi in found]
        # Out of place: torch's update() adds into the first record, so never alias it.
        combined = found[0].clone()
        for fi in found[1:]:
            combined = combined + fi
        return combined

    def unscale_(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None = None) -> None:
        """``GradScaler.unscale_``; with ``found_inf``, the check's flag is written into it.

        ``found_inf`` is a 0-d float32 tensor on the scale's device, zero on entry: the
        inf/NaN check sets it to 1.0 when a gradient holds inf or NaN, and it becomes this
        optimizer's record for ``update`` and ``found_inf_tensor``. No tensor is allocated
        for the flag, and none is copied. The gradients are unscaled by the same kernel with
        the same ``1 / scale`` (a float64 reciprocal rounded to float32), so their bits are
        torch's. Gradients on another device than ``found_inf`` take torch's path, after
        which the combined flag is copied into ``found_inf``.
        """
        if found_inf is None or not self._enabled:
            super().unscale_(optimizer)
            if found_inf is not None:
                self.found_inf_tensor(out=found_inf)
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        if found_inf.shape != () or found_inf.dtype != torch.float32 or found_inf.device != scale.device:
            raise ValueError(
                f"unscale_(found_inf=...) takes a 0-d float32 tensor on {scale.device}, got shape "
                f"{tuple(found_inf.shape)}, {found_inf.dtype} on {found_inf.device}"
            )
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        device = scale.device  # read once: each read makes a new torch.device
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.device != device or grad.is_sparse:
                    super().unscale_(optimizer)  # torch's path: per-device flags, sparse values
                    self.found_inf_tensor(out=found_inf)
                    return
                if grad.dtype == torch.float16 and not self.allow_fp16_grads:  # fp16-true: make_grad_scaler
                    raise ValueError("Attempting to unscale FP16 gradients.")
                by_dtype.setdefault(grad.dtype, []).append(grad)
        inv_scale = scale.double().reciprocal().float()
        with torch.no_grad():
            for grads in by_dtype.values():
                _amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.UNSCALED

    def last_step_applied(self) -> torch.Tensor | None:
        """The value the most recent ``step()`` returned (``None`` before any step)."""
        return self._last_applied

    # --- the iteration -------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``GradScaler.step``, returning whether the update was applied.

        Returns a 0-d bool tensor on the scale's device: ``found_inf == 0`` for this
        optimizer, computed without a host sync. (A plain optimizer still costs torch's own
        sync for the skip decision; a fused one costs none.) The optimizer's own return value
        is discarded. A disabled scaler always steps and returns a CPU ``True``.
        """
        if not self._enabled:
            optimizer.step(*args, **kwargs)
            applied = torch.ones((), dtype=torch.bool)
        elif not self._policy.skip_on_overflow:
            self._step_whatever_the_gradients(optimizer, *args, **kwargs)
            applied = torch.ones((), dtype=torch.bool, device=self._check_scale_growth_tracker("step")[0].device)
        else:
            super().step(optimizer, *args, **kwargs)
            scale = self._scale
            assert scale is not None  # super().step checked it
            found = [
                fi.to(device=scale.device, non_blocking=True)
                for fi in self._found_inf_per_device(optimizer).values()
            ]
            if found:
                total = found[0]
                for fi in found[1:]:
                    total = total + fi
                applied = total == 0
            else:
                # Only an optimizer taking the deprecated ``grad_scaler`` keyword can get
                # here: it ran its own step and recorded no check, so nothing was skipped.
                applied = torch.ones((), dtype=torch.bool, device=scale.device)
        self._last_applied = applied
        return applied

    def _step_whatever_the_gradients(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        """``skip_on_overflow=False`` (apex's static scale): unscale as torch's step would, with
        torch's checks in torch's order, then step even when a gradient is inf or NaN."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ValueError("skip_on_overflow=False needs an optimizer that does not skip inside its own kernel "
                             f"({type(optimizer).__name__} with fused=True does); use fused=False")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from this iteration's found_inf (see the module docstring).

        With the plain ``torch`` policy, or with ``new_scale`` given, this is
        ``GradScaler.update`` (``new_scale`` leaves the trackers alone and is not clamped).
        Raises ``ScaleAtMinimumError`` (state unchanged) when ``raise_at_min_scale`` is on and
        an overflow must back off a scale that is already ``min_scale``.
        """
        if not self._enabled:
            return
        if new_scale is not None or self._policy.is_plain_torch:
            if new_scale is None:
                self._protect_first_record()
            super().update(new_scale)
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        hyst = self._hysteresis_tracker
        assert hyst is not None  # created together with the scale
        found_infs = [
            fi.to(device=scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for fi in state["found_inf_per_device"].values()
        ]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        combined = found_infs[0]
        for fi in found_infs[1:]:
            combined = combined + fi

        new_scale_t, new_tracker, new_hyst, floor_hit = self._policy_update(
            scale, tracker, hyst, combined
        )
        if floor_hit is not None and bool(floor_hit):  # the one documented sync
            min_scale = _f32(self._policy.min_scale)
            raise ScaleAtMinimumError(min_scale, self._policy.min_scale)
        scale.copy_(new_scale_t)
        tracker.copy_(new_tracker)
        hyst.copy_(new_hyst)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def _protect_first_record(self) -> None:
        """With several found_inf records, torch's ``update`` adds the others into the first
        in place; that record may be a caller's tensor (``unscale_(found_inf=...)``), so it
        is replaced by a copy first."""
        records = [(state["found_inf_per_device"], device)
                   for state in self._per_optimizer_states.values() for device in state["found_inf_per_device"]]
        if len(records) > 1:
            first, device = records[0]
            first[device] = first[device].clone()

    def _policy_update(
        self,
        scale: torch.Tensor,
        tracker: torch.Tensor,
        hyst: torch.Tensor,
        found_inf: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """New (scale, tracker, hysteresis) and the raise-at-floor flag, all on the device."""
        p = self._policy
        if not p.dynamic:
            return scale, tracker, hyst, None  # a static scale: nothing moves
        # NaN != 0 is true: a NaN found_inf counts as an overflow, as in torch's kernel.
        found = found_inf != 0
        if scale.device.type == "mps":
            wide = scale  # no float64 on MPS: float32 products (see the module docstring)
        else:
            wide = scale.double()
        backed = (wide * p.backoff_factor).to(torch.float32)
        if p.min_scale is not None:
            backed = backed.clamp(min=_f32(p.min_scale))
        grown = (wide * p.growth_factor).to(torch.float32)
        if p.max_scale is not None:
            # Before the finite check: a growth past float32's range lands on the ceiling.
            grown = grown.clamp(max=_f32(p.max_scale))
        grow_ok = torch.isfinite(grown)

        hyst_dec = (hyst - 1).clamp(min=0)
        backoff_now = found & (hyst_dec == 0)
        if p.growth_since_overflow:
            # The tracker counts clean steps since the last overflow, kept in 1..interval
            # once positive: DeepSpeed grows when that count is a positive multiple of the
            # interval, i.e. on the clean step after it.
            grow = ~found & (tracker == p.growth_interval)
            clean_tracker = torch.where(grow, torch.ones_like(tracker), tracker + 1)
        else:
            bumped = tracker + 1
            grow = ~found & (bumped == p.growth_interval)
            clean_tracker = torch.where(grow, torch.zeros_like(tracker), bumped)

        full = torch.full_like(hyst, p.hysteresis)
        clean_hyst = full if p.consecutive_hysteresis else torch.where(grow, full, hyst)

        new_scale = torch.where(
            backoff_now, backed, torch.where(grow & grow_ok, grown, scale)
        )
        new_tracker = torch.where(found, torch.zeros_like(tracker), clean_tracker)
        new_hyst = torch.where(found, hyst_dec, clean_hyst)
        floor_hit = None
        if p.raise_at_min_scale:
            floor_hit = backoff_now & (scale <= _f32(p.min_scale))
        return new_scale, new_tracker, new_hyst, floor_hit

    # --- checkpointing -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The complete state as Python scalars (saves with ``weights_only=True``).

        torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus ``preset``, ``hysteresis``,
        ``hysteresis_left``, ``min_scale``, ``max_scale``, ``raise_at_min_scale``,
        ``consecutive_hysteresis``, and ``dynamic`` / ``skip_on_overflow`` when they are not
        True. One host sync. A disabled scaler returns ``{}``.

        ``_growth_tracker`` counts consecutive clean steps as in torch; with the ``deepspeed``
        preset it counts clean steps since the last overflow, kept in 1..growth_interval
        once positive. ``hysteresis_left`` is how many overflows, counting the next one,
        it takes to back off (0 and 1 both mean the next overflow backs off).
        """
        if not self._enabled:
            return {}
        if self._scale is None:
            scale: float = self._init_scale
            tracker = int(self._init_growth_tracker)
            hyst_left = int(self._init_hysteresis_left)
        else:
            assert self._growth_tracker is not None and self._hysteresis_tracker is not None
            # One device-to-host copy for all three; float64 holds each value exactly.
            values = torch.stack(
                [
                    self._scale.double(),
                    self._growth_tracker.double(),
                    self._hysteresis_tracker.double(),
                ]
            ).tolist()
            scale, tracker, hyst_left = values[0], int(values[1]), int(values[2])
        p = self._policy
        return {
            "scale": scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": tracker,
            "preset": p.preset,
            "hysteresis": p.hysteresis,
            "hysteresis_left": hyst_left,
            "min_scale": p.min_scale,
            "max_scale": p.max_scale,
            "raise_at_min_scale": p.raise_at_min_scale,
            "consecutive_hysteresis": p.consecutive_hysteresis,
            # Saved only when they are not the default, so that states saved before static
            # scales existed and states saved now compare equal.
            **{k: getattr(p, k) for k, default in _OPTIONAL_KEYS.items() if getattr(p, k) != default},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from ``state_dict()`` or from a plain ``GradScaler`` (five keys).

        Everything is validated before anything is assigned; on any problem a ``ValueError``
        lists all of them and the scaler is unchanged. Rules: exactly torch's five keys, or
        those plus all the extension keys; ``scale`` finite and > 0 in float32 (0 is refused:
        it is the collapsed state in which torch steps with non-finite gradients) and within
        [min_scale, max_scale]; factors as in ``ScalerConfig``; ``_growth_tracker`` an int
        >= 0 and below ``growth_interval`` (at most ``growth_interval`` for ``deepspeed``);
        ``hysteresis_left`` an int in [0, hysteresis]. A plain torch state keeps this
        scaler's extension settings and refills the hysteresis. The loaded policy replaces
        the current one. A disabled scaler ignores the call, as torch's does.
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, Mapping):
            raise ValueError(
                f"state_dict must be a mapping, got {type(state_dict).__name__}"
            )
        keys = set(state_dict)
        if not keys:
            raise ValueError(
                "The source state dict is empty, possibly because it was saved from a "
                "disabled scaler."
            )
        plain_torch = keys == set(_TORCH_KEYS)
        if not plain_torch:
            key_problems = _key_problems(keys)
            if key_problems:
                raise ValueError("invalid scaler state_dict: " + "; ".join(key_problems))
        sd = dict(state_dict)
        policy, hyst_left = self._loaded_policy(sd, plain_torch)
        tracker = sd["_growth_tracker"]
        # init_scale is where the loaded scale lands, so the config rules check "scale".
        problems = [p.replace("init_scale", "scale") for p in _config_problems(policy)]
        problems += _counter_problems(policy, tracker, hyst_left)
        if problems:
            raise ValueError("invalid scaler state_dict: " + "; ".join(problems))

        # Validated: assign everything.
        self._policy = policy
        self._growth_factor = policy.growth_factor
        self._backoff_factor = policy.backoff_factor
        self._growth_interval = policy.growth_interval
        self._init_scale = sd["scale"]
        self._init_growth_tracker = int(tracker)
        self._init_hysteresis_left = int(hyst_left)
        if self._scale is not None:
            assert self._growth_tracker is not None and self._hysteresis_tracker is not None
            self._scale.fill_(float(sd["scale"]))
            self._growth_tracker.fill_(int(tracker))
            self._hysteresis_tracker.fill_(int(hyst_left))

    def _loaded_policy(self, sd: dict[str, Any], plain_torch: bool) -> tuple[ResolvedScalerConfig, Any]:
        """The policy and hysteresis left that ``sd`` describes (not validated yet). A plain
        torch state keeps this scaler's extension settings and refills the hysteresis."""
        if plain_torch:
            policy = dataclasses.replace(
                self._policy, init_scale=sd["scale"], growth_factor=sd["growth_factor"],
                backoff_factor=sd["backoff_factor"], growth_interval=sd["growth_interval"],
            )
            return policy, policy.hysteresis
        policy = ResolvedScalerConfig(
            preset=sd["preset"], init_scale=sd["scale"], growth_factor=sd["growth_factor"],
            backoff_factor=sd["backoff_factor"], growth_interval=sd["growth_interval"],
            hysteresis=sd["hysteresis"], min_scale=sd["min_scale"], max_scale=sd["max_scale"],
            raise_at_min_scale=sd["raise_at_min_scale"], consecutive_hysteresis=sd["consecutive_hysteresis"],
            enabled=self._policy.enabled,
            **{k: sd.get(k, default) for k, default in _OPTIONAL_KEYS.items()},
        )
        return policy, sd["hysteresis_left"]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_hysteresis_left"] = self.get_hysteresis_left()
            state["_hysteresis_tracker"] = None
        state["_last_applied"] = None
        return state


def _key_problems(keys: set[str]) -> list[str]:
    """What is wrong with the keys of a state that is not torch's plain five."""
    full = set(_TORCH_KEYS) | set(_EXTRA_KEYS)
    missing, unknown = sorted(full - keys), sorted(keys - full - set(_OPTIONAL_KEYS))
    return ([f"missing keys {missing}"] if missing else []) + ([f"unknown keys {unknown}"] if unknown else [])


def _counter_problems(policy: ResolvedScalerConfig, tracker: Any, hyst_left: Any) -> list[str]:
    """What is wrong with a loaded growth tracker and hysteresis count under ``policy``."""
    problems = []
    interval = policy.growth_interval
    if not _is_int(tracker) or tracker < 0:
        problems.append(f"_growth_tracker must be an int >= 0, got {tracker!r}")
    elif _is_int(interval) and interval >= 1:
        limit = interval if policy.growth_since_overflow else interval - 1
        if tracker > limit:
            problems.append(
                f"_growth_tracker must be <= {limit} with growth_interval={interval} "
                f"and preset {policy.preset!r}, got {tracker!r}"
            )
    hysteresis = policy.hysteresis
    if not _is_int(hyst_left) or hyst_left < 0:
        problems.append(f"hysteresis_left must be an int >= 0, got {hyst_left!r}")
    elif _is_int(hysteresis) and hyst_left > hysteresis:
        problems.append(f"hysteresis_left must be <= hysteresis ({hysteresis!r}), got {hyst_left!r}")
    return problems


def make_grad_scaler(
    plan: Any, config: ScalerConfig | None = None, *, force: bool = False
) -> DynamicLossScaler | None:
    """A loss scaler for a precision plan, or ``None`` when the plan needs none.

    ``plan`` needs ``use_scaler`` and ``device_type`` (a ``torchimpl.precision.plan.PrecisionPlan``).
    A scaler is made only for fp16 on CUDA (``plan.use_scaler`` and device type ``"cuda"``) and
    for fp16-true wherever it runs;
    ``force=True`` makes one on the plan's device type whatever the plan says (CPU fp16
    experiments, tests). ``config.enabled=False`` turns loss scaling off whatever the plan and
    ``force`` say (``None``, with a warning when the plan needs a scaler: fp16 gradients
    below 2**-24 then flush to zero).
    """
    missing = [a for a in ("use_scaler", "device_type") if not hasattr(plan, a)]
    if missing:
        raise ValueError(
            f"plan must have use_scaler and device_type (a PrecisionPlan), "
            f"{type(plan).__name__} lacks {missing}"
        )
    # fp16-true runs fp16 wherever it resolves (nothing is downgraded), so it needs its scaler there.
    needed = force or (plan.use_scaler and (plan.device_type == "cuda" or plan.mode == "fp16-true"))
    if config is not None and not config.enabled:
        if needed:
            warnings.warn("scaler.enabled is false: this run takes fp16 steps without loss scaling, so "
                          "gradients below 2**-24 flush to zero; remove scaler.enabled=false to scale",
                          stacklevel=2)
        return None
    if not needed:
        return None
    scaler = DynamicLossScaler(plan.device_type, config)
    # Parameters held in fp16 have fp16 gradients, unscaled in place (rounded to fp16 again).
    scaler.allow_fp16_grads = getattr(plan, "mode", None) == "fp16-true"
    return scaler
