"""Building the optimizer for a model that is already on its device.

Rules:
1. ``build_optimizer`` moves nothing: every trainable parameter must already be on ``device``,
   else ``ValueError`` naming the first misplaced parameter (call ``model.to(device)`` first).
2. ``fused=False`` disables the fused kernel; ``fused=True`` attempts it on the model's real
   parameters and, if torch refuses, warns (``FusedOptimizerWarning``) and falls back;
   ``fused=None`` uses the fused kernel on CUDA when constructing it with the model's real
   parameters succeeds, and torch's default implementation elsewhere (see
   ``supports_fused_adamw`` for why not on the CPU).
3. The non-fused implementation is chosen explicitly as torch's default would be: ``foreach`` on
   devices with foreach kernels by default (CUDA, XPU, ...), the ``for-loop`` elsewhere (the CPU),
   so the returned ``kind`` is the implementation that actually runs.
4. With ``no_decay_bias_and_norm`` the parameters split into two groups in model order: those
   with ``ndim >= 2`` (weights of linear, conv and embedding layers) decay, those with
   ``ndim < 2`` (biases, norm scales and shifts) get ``weight_decay=0``. Empty groups are omitted.
   Parameters with ``requires_grad=False`` are not given to the optimizer.
5. A user's own optimizer (``adopt_optimizer``) is any ``torch.optim.Optimizer`` over the
   model's parameters, or a function ``params -> Optimizer`` called with them once the model is
   on its device (needed where the parameters are replaced: FSDP2 shards them). Every tensor it
   holds must be a trainable parameter of the model, on the device: one it holds but the model
   does not would get scaled gradients that are never unscaled or checked. Its kind is read from
   its parameter groups (``fused``, ``foreach``), as torch decides it: ``foreach=None`` is the
   foreach path where torch's default would pick it, the for-loop elsewhere.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchimpl._torch_compat import _get_foreach_kernels_supported_devices, _get_fused_kernels_supported_devices
from torchimpl.config import sections
from torchimpl.config.sections import OptimizerConfig
from torchimpl.precision.device import same_device
from torchimpl.run.checkpoint import qualified_name

__all__ = [
    "OPTIMIZERS",
    "REGISTRY",
    "TorchOptimizer",
    "kernel_skip_refusal",
    "register",
    "row_for",
    "OptimizerConfig",
    "BuiltOptimizer",
    "FusedOptimizerWarning",
    "supports_fused_adamw",
    "adopt_optimizer",
    "build_optimizer",
    "qualified_name",
    "parameter_groups",
]

# Device types with torch's fused kernels for Adam, AdamW and SGD (torch's own list where it has one).
_FUSED_DEVICES = frozenset(_get_fused_kernels_supported_devices() if _get_fused_kernels_supported_devices
                           else ("cpu", "cuda", "mps", "xpu"))


@dataclass(frozen=True)
class TorchOptimizer:
    """One registry row: the name a configuration gives (``optimizer.name``), torch's class, the
    ``OptimizerConfig`` fields it takes besides ``lr`` and ``weight_decay`` (named as torch's
    keyword arguments), and the device types where torch has a fused kernel for it.
    ``check(config)`` returns ``(field, message)`` for settings valid alone but not together."""

    name: str
    cls: type[torch.optim.Optimizer]
    settings: tuple[str, ...] = ()
    fused_devices: frozenset[str] = frozenset()
    check: Any = None
    kernel_skip_refused: Any = None
    """``(param_group) -> str | None``: why a kernel that skips by itself (the sync-free mode)
    cannot run this group, or None."""

    def kwargs(self, config: "OptimizerConfig") -> dict[str, Any]:
        """torch's keyword arguments for ``config``: a setting left at ``None`` is torch's default."""
        out: dict[str, Any] = {"lr": config.lr, "weight_decay": config.weight_decay}
        for name in self.settings:
            value = getattr(config, name)
            if value is not None:
                out[name] = value
        return out


REGISTRY: dict[str, TorchOptimizer] = {}


def register(row: TorchOptimizer) -> TorchOptimizer:
    """Add a row (its name must be new); ``optimizer.name`` accepts it from then on."""
    if row.name in REGISTRY:
        raise ValueError(f"an optimizer named {row.name!r} is already registered")
    REGISTRY[row.name] = row
    sections.OPTIMIZER_ROWS[row.name] = row  # the configuration accepts its name and settings
    return row


def _resolve(row: sections.OptimizerRow) -> TorchOptimizer:
    """A built-in optimizer's row (``config.sections.OPTIMIZER_ROWS``, torch-free) for torch: its
    class looked up in ``torch.optim``, ``fused_devices`` None read as torch's own list."""
    fused = _FUSED_DEVICES if row.fused_devices is None else row.fused_devices
    return TorchOptimizer(row.name, getattr(torch.optim, row.torch_class), row.settings, fused, row.check,
                          row.kernel_skip_refused)


for _row in tuple(sections.OPTIMIZER_ROWS.values()):
    register(_resolve(_row))

OPTIMIZERS = tuple(REGISTRY)
"""The names ``optimizer.name`` accepts, in the registry's order."""


def row_for(optimizer: torch.optim.Optimizer) -> TorchOptimizer | None:
    """The registry row of a torch optimizer: the first class of its ``__mro__`` that a row
    names (a subclass of AdamW is AdamW's), None for another optimizer."""
    by_class = {row.cls: row for row in REGISTRY.values()}
    return next((by_class[c] for c in type(optimizer).__mro__ if c in by_class), None)


def kernel_skip_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the sync-free mode (the kernel skips by itself) cannot drive ``optimizer``, or None."""
    row = row_for(optimizer)
    if row is None or row.kernel_skip_refused is None:
        return None
    return next((why for g in optimizer.param_groups if (why := row.kernel_skip_refused(g))), None)

# Raised by torch optimizers that refuse ``fused=True`` for a device, dtype or option.
_FUSED_ERRORS = (TypeError, RuntimeError, ValueError)


class FusedOptimizerWarning(UserWarning):
    """``fused=True`` was requested but torch refused it; a non-fused optimizer was built."""


@dataclass(frozen=True)
class BuiltOptimizer:
    """The optimizer, the implementation that runs (``"fused"``, ``"foreach"`` or
    ``"for-loop"``), and ``reason``: why that implementation, for the run summary."""

    optimizer: torch.optim.Optimizer
    kind: str
    reason: str


def supports_fused_adamw(device: str | torch.device) -> bool:
    """Whether ``torch.optim.AdamW(..., fused=True)`` can be built on ``device``.

    Probes by constructing (not stepping) a fused AdamW on a one-element float32 parameter on
    the device, catching ``TypeError``, ``RuntimeError`` and ``ValueError``; an unavailable CUDA
    device gives False without touching CUDA. The probe runs on every device type, so on the CPU
    it answers True in torch 2.13, where fused AdamW has a CPU kernel: this function reports what
    works. Whether to *use* it is ``build_optimizer``'s policy: ``fused=None`` takes the fused
    kernel only on CUDA, because on the CPU it is not bit-identical to the for-loop path (a few
    ulp), which is torch's CPU default and the path the reference implementation tracks bit for
    bit; ``fused=True`` uses it on the CPU too.

    A pass here does not guarantee the real model's parameters are accepted (dtype, sharding):
    ``build_optimizer`` probes again with those.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return False
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            return False
    try:
        param = nn.Parameter(torch.zeros(1, device=dev))
        torch.optim.AdamW([param], lr=1e-3, fused=True)
    except _FUSED_ERRORS:
        return False
    return True


def parameter_groups(model: nn.Module, config: OptimizerConfig) -> list[dict[str, Any]]:
    """The optimizer's parameter groups per rule 4 (trainable parameters only)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not config.no_decay_bias_and_norm:
        return [{"params": params, "weight_decay": config.weight_decay}] if params else []
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": config.weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _foreach_by_default(device: torch.device) -> bool:
    if _get_foreach_kernels_supported_devices is None:  # gone from torch: its long-standing list
        return device.type in ("cuda", "xpu")
    return device.type in _get_foreach_kernels_supported_devices()


def _construct(
    config: OptimizerConfig, groups: list[dict[str, Any]], impl: dict[str, bool]
) -> torch.optim.Optimizer:
    row = REGISTRY[config.name]
    return row.cls(groups, **row.kwargs(config), **impl)


def build_optimizer(
    model: nn.Module, config: OptimizerConfig, device: str | torch.device
) -> BuiltOptimizer:
    """Build the configured optimizer over ``model``'s trainable parameters (rules 1-4)."""
    if not isinstance(config, OptimizerConfig):
        raise ValueError(f"config must be an OptimizerConfig, got {type(config).__name__}")
    dev = torch.device(device)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model has no trainable parameters (none with requires_grad=True)")
    for name, p in named:
        if not same_device(p.device, dev):
            raise ValueError(
                f"parameter {name!r} is on {p.device}, but build_optimizer was given device "
                f"{dev}; call model.to(device) before build_optimizer (it moves nothing)"
            )
    groups = parameter_groups(model, config)
    foreach = _foreach_by_default(dev)
    plain_kind = "foreach" if foreach else "for-loop"

    has_fused = dev.type in REGISTRY[config.name].fused_devices
    attempt = has_fused and (config.fused is True or (config.fused is None and dev.type == "cuda"))
    if config.fused is True and not has_fused:
        reason = (f"torch has no fused {config.name} kernel on {dev.type}; using the {plain_kind} implementation "
                  "(set optimizer.fused to null or false)")
        warnings.warn(reason, FusedOptimizerWarning, stacklevel=2)
    elif attempt:
        try:
            opt = _construct(config, groups, {"fused": True})
        except _FUSED_ERRORS as exc:
            reason = (
                f"fused {config.name} was refused by torch on {dev} for this model's parameters "
                f"({type(exc).__name__}: {exc}); using the {plain_kind} implementation"
            )
            if config.fused is True:
                warnings.warn(reason, FusedOptimizerWarning, stacklevel=2)
        else:
            how = "requested" if config.fused else "probed on the model's parameters"
            return BuiltOptimizer(opt, "fused", f"fused {config.name} ({how}) on {dev}")
    elif config.fused is False:
        reason = f"fused disabled by the config; {plain_kind} {config.name} on {dev}"
    else:
        reason = (
            f"fused=None on {dev.type}: torch's default {plain_kind} {config.name} "
            "(bit-exact with the reference; set fused=True to use a fused kernel here)"
        )
    opt = _construct(config, groups, {"foreach": foreach})
    return BuiltOptimizer(opt, plain_kind, reason)


def adopt_optimizer(model: nn.Module, optimizer: Any, device: str | torch.device) -> BuiltOptimizer:
    """Rule 5: the user's optimizer (or ``optimizer(params)``) checked against ``model``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer or a function params -> Optimizer, got "
                             f"{type(optimizer).__name__}")
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise ValueError(f"the optimizer function returned a {type(built).__name__}, not a torch.optim.Optimizer")
        optimizer = built
    dev = torch.device(device)
    mine = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) not in mine:
                raise ValueError(
                    f"the optimizer's param_groups[{i}]['params'][{j}] (shape {list(p.shape)}) is not a trainable "
                    "parameter of the model: build the optimizer on model.parameters() (and after any change to "
                    "them), or pass a function params -> Optimizer")
            if not same_device(p.device, dev):
                raise ValueError(f"parameter {mine[id(p)]!r} is on {p.device}, the run on {dev}")
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 and not same_device(value.device, dev):
                raise ValueError(f"the optimizer's state {key!r} of parameter {mine.get(id(p), '?')!r} is on "
                                 f"{value.device}, the run on {dev}: build the optimizer after model.to(device), "
                                 "or pass a function params -> Optimizer")
    kind = _kind_of(optimizer, dev)
    return BuiltOptimizer(optimizer, kind, f"your {qualified_name(optimizer)} ({kind})")


def _kind_of(optimizer: torch.optim.Optimizer, device: torch.device) -> str:
    groups = optimizer.param_groups
    if any(g.get("fused") for g in groups):
        return "fused"
    if any(g.get("foreach") for g in groups):
        return "foreach"
    if all("foreach" in g for g in groups) and _foreach_by_default(device) and device.type != "cpu":
        return "foreach"  # foreach=None: torch's default takes the foreach path here
    return "for-loop"
