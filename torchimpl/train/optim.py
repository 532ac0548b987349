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

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchimpl._torch_compat import _get_foreach_kernels_supported_devices, _get_fused_kernels_supported_devices
from torchimpl.config.problems import ConfigError
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


def _sgd_problems(config: "OptimizerConfig") -> list[tuple[str, str]]:
    if config.nesterov and config.momentum <= 0.0:
        return [("nesterov", f"Nesterov momentum needs momentum > 0, got momentum={config.momentum!r}; "
                             "set momentum (e.g. 0.9), or remove nesterov")]
    return []


def _sgd_kernel_skip_refused(group: dict[str, Any]) -> str | None:
    # torch's fused SGD creates its momentum buffers with empty_like before the kernel reads
    # found_inf: a first step skipped inside the kernel would leave them uninitialised.
    if group.get("momentum", 0) > 0:
        return ("fused SGD with momentum (torch leaves its momentum buffers uninitialised when the kernel skips "
                "the first step)")
    return None


REGISTRY: dict[str, TorchOptimizer] = {}


def register(row: TorchOptimizer) -> TorchOptimizer:
    """Add a row (its name must be new)."""
    if row.name in REGISTRY:
        raise ValueError(f"an optimizer named {row.name!r} is already registered")
    REGISTRY[row.name] = row
    return row


for _row in (
    TorchOptimizer("adamw", torch.optim.AdamW, ("betas", "eps", "amsgrad"), _FUSED_DEVICES),
    TorchOptimizer("adam", torch.optim.Adam, ("betas", "eps", "amsgrad"), _FUSED_DEVICES),
    TorchOptimizer("sgd", torch.optim.SGD, ("momentum", "dampening", "nesterov"), _FUSED_DEVICES, _sgd_problems,
                   _sgd_kernel_skip_refused),
    TorchOptimizer("adagrad", torch.optim.Adagrad, ("lr_decay", "initial_accumulator_value", "eps"),
                   frozenset({"cpu"})),
    TorchOptimizer("rmsprop", torch.optim.RMSprop, ("alpha", "eps", "momentum", "centered")),
    TorchOptimizer("adamax", torch.optim.Adamax, ("betas", "eps")),
    TorchOptimizer("adadelta", torch.optim.Adadelta, ("rho", "eps")),
    TorchOptimizer("nadam", torch.optim.NAdam, ("betas", "eps", "momentum_decay", "decoupled_weight_decay")),
    TorchOptimizer("radam", torch.optim.RAdam, ("betas", "eps", "decoupled_weight_decay")),
    # Adafactor's eps is a pair (eps1 or None, eps2), not the float the other rows share: the
    # trainer keeps torch's default (None, 1e-3). torch has no fused Adafactor.
    TorchOptimizer("adafactor", torch.optim.Adafactor, ("beta2_decay", "d")),
):
    register(_row)

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


_F32_MAX = 3.4028234663852886e38


def _finite_at_least(name: str, value: Any, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (float(value) >= low and float(value) != float("inf")):
        raise ValueError(f"{name} must be a finite number{'' if low == -math.inf else f' >= {low}'}, got {value!r}")


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer settings. ``name``: a registered optimizer (``REGISTRY``: adamw, adam, sgd, ...).
    ``lr`` and ``weight_decay`` apply to every optimizer; each other field only to the optimizers
    whose row lists it (``betas`` and ``eps`` to Adam(W), ``momentum`` and ``nesterov`` to SGD,
    ...), and a field set away from its default for another optimizer is an error naming it.
    Fields that default to ``None`` mean torch's default for the optimizer. ``fused`` is None
    (probe), True (attempt) or False."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0
    nesterov: bool = False
    fused: bool | None = None
    no_decay_bias_and_norm: bool = True
    amsgrad: bool | None = None
    dampening: float | None = None
    lr_decay: float | None = None
    initial_accumulator_value: float | None = None
    alpha: float | None = None
    centered: bool | None = None
    rho: float | None = None
    momentum_decay: float | None = None
    decoupled_weight_decay: bool | None = None
    beta2_decay: float | None = None
    d: float | None = None

    def __post_init__(self) -> None:
        if self.name not in REGISTRY:
            raise ValueError(
                f"optimizer name must be one of {', '.join(REGISTRY)}, got {self.name!r}"
            )
        _finite_at_least("lr", self.lr, float("-inf"))
        if not 0.0 < float(self.lr) <= _F32_MAX:  # 0 trains nothing; torch keeps rates in float32 tensors too
            raise ValueError(f"lr must be > 0 and within float32's range (at most {_F32_MAX:.4g}), got {self.lr!r}")
        _finite_at_least("weight_decay", self.weight_decay, 0.0)
        _finite_at_least("eps", self.eps, float("-inf"))
        if not 0.0 < float(self.eps) < math.inf:  # eps = 0 divides 0 by 0 where a gradient has been zero: NaN weights
            raise ValueError(f"eps must be a finite number > 0 (it keeps a zero second moment from dividing "
                             f"by zero), got {self.eps!r}")
        _finite_at_least("momentum", self.momentum, 0.0)
        if self.dampening is not None:
            _finite_at_least("dampening", self.dampening, float("-inf"))
        for name in _NONNEGATIVE:
            if getattr(self, name) is not None:
                _finite_at_least(name, getattr(self, name), 0.0)
        if self.rho is not None and not float(self.rho) <= 1.0:  # torch's Adadelta refuses it only at build
            raise ValueError(f"rho must be in [0, 1], got {self.rho!r}")
        if self.beta2_decay is not None:
            _finite_at_least("beta2_decay", self.beta2_decay, float("-inf"))
            if not float(self.beta2_decay) <= 0.0:
                raise ValueError(f"beta2_decay must be <= 0 (Adafactor's second moment weighs the new gradient by "
                                 f"step ** beta2_decay), got {self.beta2_decay!r}; torch's default is -0.8")
        if self.d is not None:
            _finite_at_least("d", self.d, 1.0)
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair of numbers in [0, 1), got {betas!r}")
        for i, b in enumerate(betas):
            _finite_at_least(f"betas[{i}]", b, 0.0)
            if not b < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {b!r}")
        # YAML gives lists; keep the frozen config hashable and comparable.
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        for name in ("nesterov", "no_decay_bias_and_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("fused", "amsgrad", "centered", "decoupled_weight_decay"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be None, True or False, got {getattr(self, name)!r}")
        problems = self._cross_field_problems()
        if problems:
            # A ConfigError names each field, so the loader reports these as they are instead of
            # retrying each field alone against the defaults (which would blame the default
            # optimizer name).
            raise ConfigError(problems)

    def _cross_field_problems(self) -> list[tuple[str, str]]:
        """Settings that are valid alone but not together, as ``(field, message)``: a setting of
        another optimizer away from its default, then the row's own checks."""
        row = REGISTRY[self.name]
        out = []
        for f in dataclasses.fields(self):
            if f.name in _COMMON or f.name in row.settings or getattr(self, f.name) == f.default:
                continue
            users = [r.name for r in REGISTRY.values() if f.name in r.settings]
            who = " and ".join(repr(u) for u in users)
            out.append((f.name, f"only the {who} optimizer{'s' if len(users) > 1 else ''} use{'' if len(users) > 1 else 's'} "
                                f"{f.name}, and this one is {self.name!r} (got {f.name}={getattr(self, f.name)!r}); "
                                f"remove {f.name}, or set the optimizer's name to {' or '.join(repr(u) for u in users)}"))
        return out + (row.check(self) if row.check else [])


# Optional settings that are finite numbers >= 0 when given.
_NONNEGATIVE = ("lr_decay", "initial_accumulator_value", "alpha", "rho", "momentum_decay")
# Fields every optimizer takes, or that choose how it is built rather than what it computes.
_COMMON = frozenset({"name", "lr", "weight_decay", "fused", "no_decay_bias_and_norm"})


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
