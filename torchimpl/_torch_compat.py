"""Every private torch name torchimpl relies on, in one place, each with why it is needed.

torch promises nothing about names that start with an underscore, and they do move between
releases. torchimpl takes the private functions and classes from here, so a torch that moved
one fails at import with the name and the torch version instead of somewhere deep in a run.
Private attributes (GradScaler's state, ``nn.Module``'s hook dicts, the flag fused optimizers
set) cannot be imported; they are listed here with their reasons and ``missing_names`` looks
for each on a fresh object. ``tests/test_torch_compat.py`` asserts that nothing is missing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler

__all__ = [
    "OptState",
    "TorchDispatchMode",
    "_amp_foreach_non_finite_check_and_unscale_",
    "_amp_update_scale_",
    "_set_grad_enabled",
    "_foreach_mul_",
    "_foreach_norm",
    "_flatten_dense_tensors",
    "_foreach_copy_",
    "_foreach_sub",
    "_get_foreach_kernels_supported_devices",
    "_get_fused_kernels_supported_devices",
    "_group_tensors_by_device_and_dtype",
    "_refresh_per_optimizer_state",
    "missing_names",
    "scaled_mm",
    "tree_leaves",
]

# (module, name, why) for every private name imported below, in the order imported.
IMPORTED: list[tuple[str, str, str]] = []


class PrivateTorchNameError(ImportError):
    """A private torch name ampspec uses is not where this module expects it."""


def _private(module: str, name: str, why: str, *, required: bool = True) -> Any:
    """``module.name``, recorded in IMPORTED; a missing required one raises with the torch version."""
    IMPORTED.append((module, name, why))
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        if not required:
            return None
        raise PrivateTorchNameError(
            f"torch {torch.__version__} has no {module}.{name}, a private torch name ampspec needs "
            f"({why}); see torchimpl/_torch_compat.py. ({type(e).__name__}: {e})") from None


# --- GradScaler internals (torchimpl.train.scaler.DynamicLossScaler subclasses GradScaler) ---------

OptState = _private(
    "torch.amp.grad_scaler", "OptState",
    "the per-optimizer stage READY/UNSCALED/STEPPED that DynamicLossScaler.unscale_ and step keep "
    "as GradScaler does, so torch's own step() and update() accept the state they leave")
_refresh_per_optimizer_state = _private(
    "torch.amp.grad_scaler", "_refresh_per_optimizer_state",
    "the fresh per-optimizer record GradScaler.update resets to; DynamicLossScaler.update resets the same way")
_amp_foreach_non_finite_check_and_unscale_ = _private(
    "torch", "_amp_foreach_non_finite_check_and_unscale_",
    "GradScaler's unscale kernel (multiply by the float32 inverse scale, raise found_inf): the "
    "scaler's one-flag unscale_ and the clipping check without a scaler call it, to get torch's bits")
_amp_update_scale_ = _private(
    "torch", "_amp_update_scale_",
    "GradScaler.update's kernel; the 'torch' preset delegates to it and the other presets state "
    "its float64 backoff and growth multiplies (scaler.py rule 1), which the conformance suite compares")

# --- foreach kernels ------------------------------------------------------------------------

_foreach_mul_ = _private(
    "torch", "_foreach_mul_",
    "clip_grad_norm_'s multiply of each (device, dtype) group by the clip coefficient; "
    "torchimpl.train.clipping calls it so its bits are torch's")
_foreach_norm = _private(
    "torch", "_foreach_norm",
    "get_total_norm's per-tensor norms of a (device, dtype) group in one call; torchimpl.train.clipping "
    "makes the same calls once per step without get_total_norm's per-call grouping, so its bits are torch's")
_group_tensors_by_device_and_dtype = _private(
    "torch.utils._foreach_utils", "_group_tensors_by_device_and_dtype",
    "the order in which get_total_norm visits (device, dtype) groups (its C++ hash map's, not first-seen); "
    "torchimpl.train.clipping asks it once per run and stacks the groups' norms in that order")
_flatten_dense_tensors = _private(
    "torch._utils", "_flatten_dense_tensors",
    "the doctor's parameter statistics join every parameter's values flat in one call (C++'s "
    "contiguous().view(-1) and cat); torch.cat of reshaped tensors, its fallback, is the same values", required=False)
_foreach_copy_ = _private(
    "torch", "_foreach_copy_",
    "the doctor's shadow takes the mixed model's weights and optimizer state each step in one call; "
    "copy_ per tensor is the same copy at one call per tensor (doctor.shadow falls back to it)", required=False)
_foreach_sub = _private(
    "torch", "_foreach_sub",
    "the doctor's parameter statistics take every judged parameter's update (after minus before) "
    "in one call; a loop of subtractions gives the same bits at one call per tensor")
_get_foreach_kernels_supported_devices = _private(
    "torch.utils._foreach_utils", "_get_foreach_kernels_supported_devices",
    "whether torch's optimizers pick the foreach path by default on a device; optim.py "
    "falls back to ('cuda', 'xpu') when it is gone", required=False)
_get_fused_kernels_supported_devices = _private(
    "torch.utils._foreach_utils", "_get_fused_kernels_supported_devices",
    "the device types where torch has fused Adam, AdamW and SGD kernels (optim.py's registry rows); "
    "optim.py falls back to ('cpu', 'cuda', 'mps', 'xpu') when it is gone", required=False)

# --- autograd ---------------------------------------------------------------------------------------

_set_grad_enabled = _private(
    "torch._C", "_set_grad_enabled",
    "the step engine adds each microbatch's loss into the window's sum with grad mode off for one "
    "call: the public torch.no_grad or loss.detach() would cost a Python object or a tensor per microbatch")

# --- float8 (torchimpl.precision.fp8) --------------------------------------------------------------------

_private("torch", "_scaled_mm",
         "torchao's float8 matmul; torchimpl.precision.fp8 probes whether the CPU's takes rowwise scales (torch 2.11's "
         "refuses them) before a rowwise recipe trains", required=False)


def scaled_mm(*args: Any, **kwargs: Any) -> Any:
    """``torch._scaled_mm``, looked up at each call as torchao looks it up."""
    return torch._scaled_mm(*args, **kwargs)


# --- operator-level diagnostics (torchimpl.precision.diagnostics) --------------------------------------

TorchDispatchMode = _private(
    "torch.utils._python_dispatch", "TorchDispatchMode",
    "the first-non-finite-op scanner sees every aten op with its inputs and outputs; no public "
    "API gives that per op")
tree_leaves = _private(
    "torch.utils._pytree", "tree_leaves",
    "flattens an op's (args, kwargs) and outputs, including torch's own containers, to find the "
    "tensors (diagnostics' op scanner, the doctor's statistics)")


# --- Private attributes, checked on fresh objects by missing_names --------------------------

GRAD_SCALER_ATTRIBUTES: dict[str, str] = {
    "_enabled": "a disabled scaler passes every call through, as GradScaler does",
    "_scale": "the scale tensor: read by state_dict, written in place by the extended presets' update",
    "_growth_tracker": "the growth counter tensor, written beside the scale",
    "_init_scale": "where load_state_dict puts a loaded scale before the lazy tensor exists",
    "_init_growth_tracker": "the same for the growth counter",
    "_growth_factor": "the policy's factors are kept in GradScaler's own fields, which its update reads",
    "_backoff_factor": "as _growth_factor",
    "_growth_interval": "as _growth_factor",
    "_per_optimizer_states": "each optimizer's stage and found_inf records, read by the step and "
                             "the distributed trainer and the diagnostics",
}
GRAD_SCALER_METHODS: dict[str, str] = {
    "_lazy_init_scale_growth_tracker": "overridden to create the hysteresis counter with the scale: "
                                       "a rename in torch would silently skip the override",
    "_check_scale_growth_tracker": "the scale and counter, with torch's own error when they do not exist yet",
    "_found_inf_per_device": "the found_inf records step() reduces into its applied flag",
    "_get_growth_tracker": "the growth counter as a number (state_dict, reports)",
}
PER_OPTIMIZER_STATE_KEYS: dict[str, str] = {
    "stage": "the OptState of one optimizer in this iteration",
    "found_inf_per_device": "the found_inf tensors unscale_ recorded, per device",
}
MODULE_HOOK_DICTS: dict[str, str] = {
    "_forward_hooks": "NonFiniteGuard removes its own forward hooks from a copied model by key",
    "_forward_pre_hooks": "as _forward_hooks, for pre-hooks; fp32_modules looks there for its own "
                          "pre-hook before adding one, so an fp32 island is entered once",
    "_forward_hooks_with_kwargs": "the per-key flags torch keeps beside each forward hook, removed with it",
    "_forward_hooks_always_called": "as _forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs": "as _forward_hooks_with_kwargs, for pre-hooks",
    "_parameters": "the placement check skips nn.Module's own containers when it looks for stray tensors",
    "_buffers": "as _parameters",
    "_modules": "as _parameters",
}
FUSED_OPTIMIZER_FLAG = ("_step_supports_amp_scaling",
                        "set by fused optimizers: GradScaler hands them grad_scale and found_inf instead "
                        "of skipping on the host; the trainer and the scaler branch on it")


def _missing_attributes(obj: Any, names: dict[str, str], owner: str) -> list[str]:
    return [f"{owner}.{n}" for n in names if not hasattr(obj, n)]


def _attribute_checks() -> list[tuple[str, Callable[[], list[str]]]]:
    def scaler() -> list[str]:
        return (_missing_attributes(GradScaler("cpu"), GRAD_SCALER_ATTRIBUTES, "GradScaler")
                + _missing_attributes(GradScaler, GRAD_SCALER_METHODS, "GradScaler"))

    def per_optimizer_state() -> list[str]:
        state = _refresh_per_optimizer_state()
        return [f"GradScaler._per_optimizer_states[...][{k!r}]" for k in PER_OPTIMIZER_STATE_KEYS if k not in state]

    def module() -> list[str]:
        return _missing_attributes(torch.nn.Linear(1, 1), MODULE_HOOK_DICTS, "nn.Module")

    def fused() -> list[str]:
        p = torch.nn.Parameter(torch.zeros(1))
        ok = getattr(torch.optim.Adam([p], fused=True), FUSED_OPTIMIZER_FLAG[0], False) is True
        return [] if ok else [f"torch.optim.Adam(fused=True).{FUSED_OPTIMIZER_FLAG[0]}"]

    return [("GradScaler", scaler), ("per-optimizer state", per_optimizer_state),
            ("nn.Module", module), ("fused optimizers", fused)]


def missing_names() -> list[str]:
    """Every private name listed here that the installed torch does not have (empty when all are there)."""
    missing = []
    for module, name, _ in IMPORTED:
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{name}")
    for _, check in _attribute_checks():
        missing += check()
    return missing
