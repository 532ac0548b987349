"""The training-step contract: one optimizer step over k microbatches, and its record.

The conformance boundary is the scaled gradients that backward produces: autograd is not
re-implemented here. Everything downstream of it is, in this order and no other:

1. Zero the gradients; for each of the k microbatches, run the forward pass under autocast,
   divide the loss by k, multiply it by the scale, and backward. Gradients accumulate at a
   constant scale, by float32 addition in microbatch order (`accumulate_gradients`). A short
   last window divides by its real size, not by the configured k.
2. Unscale once and record ``found_inf`` (`reference.scaling.unscale_gradients`). Without a
   loss scaler the scale is fixed at 1 and ``found_inf`` is the plain inf/NaN check.
   ``found_inf`` is also set when an **unscaled** gradient holds inf or NaN (`found_inf_after_unscale`)
   and when the window's loss is not finite: a step never applies non-finite values. torch's
   GradScaler checks only the scaled gradients, so it applies the overflow of a finite scaled
   gradient unscaled by the inverse of a scale below 1, and the NaN of ``0 * inf`` under a
   collapsed scale; this is where the step contract is stricter than torch.
3. Clip the **unscaled** gradients at the unchanged threshold (never ``max_norm * scale``).
4. Run the optimizer step only if ``found_inf`` is false. Each parameter group (`ParamGroup`)
   steps its parameters with its own hyperparameters. A fused optimizer that skips inside its
   kernel (``StepConfig.unscale == "kernel"``, ``StepConfig.sync_free``) is called on every
   step with the ``found_inf`` flag instead, and leaves parameters and moments unchanged when
   it is set (`reference.optim` rule 8).
5. Update the scale (`reference.scaling.update_scale`). A scale that the update leaves
   collapsed (`scale_collapsed`: its float32 inverse is not finite, so no later step can unscale)
   ends the run: the step raises `ScaleCollapsedError`.
6. Advance the learning-rate schedule and the applied-step counter only if the step was applied:
   the schedule is a function of the number of *applied* steps, so a skipped step never moves it.
   The rate is a float64 value, or float32 in the sync-free mode (`StepConfig.lr_at`).

Each step yields a `StepRecord` whose fields are exactly those the trainer writes as JSON Lines.
`replay` recomputes a recorded scale history from its ``found_inf`` bits alone and names the
first step whose scale or tracker differs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from reference import clipping, optim, scaling

__all__ = [
    "ScaleCollapsedError",
    "LRSchedule",
    "ParamGroup",
    "StepConfig",
    "StepRecord",
    "TrainState",
    "StepResult",
    "ReplayResult",
    "accumulate_gradients",
    "found_inf_after_unscale",
    "scale_collapsed",
    "scaled_microbatch_loss",
    "init_train_state",
    "optimizer_step",
    "train_step",
    "replay",
]

_SCHEDULE_KINDS = ("constant", "cosine", "step")
_UNSCALE = ("scaler", "kernel")


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a pure function of the number of applied optimizer steps.

    ``lr_at(n)`` for ``n`` applied steps so far, in Python (float64) arithmetic:

    1. warmup: while ``n < warmup_steps``, ``base_lr * (n + 1) / warmup_steps``;
    2. ``constant``: ``base_lr`` afterwards;
    3. ``cosine``: with ``p = clamp((n - warmup_steps) / max(1, total_steps - warmup_steps), 0, 1)``
       and ``r = min_lr_ratio``, ``base_lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)``: it decays
       from exactly ``base_lr`` at ``p = 0`` to ``base_lr * r``. The float64 expression is part
       of the rule (an equal expression in real arithmetic can differ in the last bits);
    4. ``step``: torch's ``StepLR``, the schedule a user's own scheduler brings, in its chained
       form: the rate starts at ``base_lr`` and is multiplied by ``gamma`` (one float64 multiply)
       at every ``n`` that is a multiple of ``step_size``; so after ``n`` applied steps it is
       ``base_lr`` times ``gamma``, ``n // step_size`` times, in that order (not ``gamma ** k``,
       which rounds differently). No warmup.
    """

    base_lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    step_size: int = 1
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if not (isinstance(self.base_lr, (int, float)) and math.isfinite(self.base_lr) and self.base_lr >= 0):
            raise ValueError(f"base_lr must be a finite number >= 0, got {self.base_lr!r}")
        if self.kind not in _SCHEDULE_KINDS:
            raise ValueError(f"kind must be one of {_SCHEDULE_KINDS}, got {self.kind!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.kind == "cosine" and (
            isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int) or self.total_steps < 1
        ):
            raise ValueError(f"total_steps must be an int >= 1 for a cosine schedule, got {self.total_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.kind == "step":
            if isinstance(self.step_size, bool) or not isinstance(self.step_size, int) or self.step_size < 1:
                raise ValueError(f"step_size must be an int >= 1, got {self.step_size!r}")
            if self.warmup_steps:
                raise ValueError("a step schedule has no warmup (torch's StepLR): warmup_steps must be 0")

    def lr_at(self, applied_steps: int) -> float:
        """The learning rate for the next step, after ``applied_steps`` applied steps."""
        n = applied_steps
        if n < self.warmup_steps:
            return self.base_lr * (n + 1) / self.warmup_steps
        if self.kind == "constant":
            return float(self.base_lr)
        if self.kind == "step":
            lr = float(self.base_lr)
            for _ in range(n // self.step_size):
                lr = lr * self.gamma
            return lr
        assert self.total_steps is not None
        span = max(1, self.total_steps - self.warmup_steps)
        p = min(1.0, max(0.0, (n - self.warmup_steps) / span))
        r = self.min_lr_ratio
        return self.base_lr * (r + (1.0 - r) * (1.0 + math.cos(math.pi * p)) / 2.0)


@dataclass(frozen=True)
class ParamGroup:
    """One optimizer parameter group: which parameters, and the hyperparameters it overrides.

    ``params`` are indices into the step's parameter list. ``options`` override fields of the
    step's optimizer configuration for these parameters, as the keys of a torch parameter group
    override the optimizer's defaults (``{"weight_decay": 0.0}`` for biases and norm weights).
    The learning rate is one per step (the schedule's, or ``optimizer.lr``) and shared by every
    group, as the trainer's schedule sets it, so ``lr`` is not an option. ``options`` may be
    given as a mapping; it is kept as sorted ``(name, value)`` pairs.
    """

    params: tuple[int, ...]
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        idx = tuple(self.params)
        for i in idx:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
                raise ValueError(f"ParamGroup.params must be parameter indices (ints >= 0), got {i!r}")
        if len(set(idx)) != len(idx):
            raise ValueError(f"ParamGroup.params lists a parameter twice: {idx}")
        object.__setattr__(self, "params", tuple(int(i) for i in idx))
        opts = dict(self.options)
        if "lr" in opts:
            raise ValueError("ParamGroup.options cannot set 'lr': every group uses the step's learning rate "
                             "(StepConfig.schedule or optimizer.lr)")
        object.__setattr__(self, "options", tuple(sorted(opts.items())))

    def config_for(self, defaults: Any) -> Any:
        """``defaults`` (an SGDConfig or AdamConfig) with this group's options applied."""
        names = [f.name for f in fields(defaults)]
        unknown = [k for k, _ in self.options if k not in names]
        if unknown:
            raise ValueError(f"ParamGroup.options {unknown} are not fields of {type(defaults).__name__}; "
                             f"valid names: {[n for n in names if n != 'lr']}")
        return replace(defaults, **dict(self.options))


@dataclass(frozen=True)
class StepConfig:
    """Everything one step needs besides state and gradients.

    ``use_scaler`` false means no loss scaling (bf16 and fp32): the scale is fixed at 1.

    ``optimizer`` is the configuration of every parameter, or, with ``param_groups``, the
    defaults that each group's options override. ``param_groups`` None is one group of all
    parameters; otherwise the groups must cover every parameter exactly once.

    ``optimizer`` is the configuration of a registered optimizer (`reference.optim.SPECS`);
    ``optimizer_kind`` is the implementation its row's step runs: ``"for-loop"`` (torch's CPU
    default), ``"foreach"`` or ``"fused"``, as far as the row has it.

    ``unscale``: who removes the loss scale. ``"scaler"`` (rule 2 of the module: a multiply by
    the float32 inverse, before clipping) for every kind; ``"kernel"`` only for a kind the row
    lists as ``kernel_scaled`` (the fused kernels of SGD, Adam, AdamW, Adagrad), with a scaler
    and without clipping, as ``GradScaler.step`` drives a fused optimizer that was not unscaled
    first: the kernel divides by the scale (a true division), is called on every step and skips
    by itself.

    ``sync_free`` (kernel-scaled kinds only) models the trainer's mode without host syncs: the
    optimizer is called on every step with the ``found_inf`` flag and skips inside its kernel,
    and the learning rate lives in a float32 device tensor: the schedule's float64 rate is
    rounded once to float32 (``lr_at``), the kernel reads that value back exactly (as a double),
    and the record carries it. A configuration the row's ``kernel_skip_refused`` names is
    refused in both kernel modes: torch's fused SGD with momentum creates its buffers with
    ``empty_like`` before the kernel checks the flag, so a skipped first step leaves them
    uninitialised (measured on torch 2.13).

    ``sqrt`` replaces the for-loop Adam's square root (`reference.optim.adam_step`): torch's
    CPU square root is not correctly rounded, so a bit-level comparison injects torch's own.
    The fused kernel's root is correctly rounded and is never replaced.
    """

    optimizer: Any
    schedule: LRSchedule | None = None
    scaler: scaling.ScalerConfig = field(default_factory=scaling.ScalerConfig)
    use_scaler: bool = True
    clip_norm: float | None = None
    norm_type: float = 2.0
    clip_order: str = "torch_cpu"
    optimizer_kind: str = "for-loop"
    sqrt: Callable[[np.ndarray], np.ndarray] | None = field(default=None, compare=False)
    param_groups: tuple[ParamGroup, ...] | None = None
    unscale: str = "scaler"
    sync_free: bool = False

    def __post_init__(self) -> None:
        row = optim.spec_for(self.optimizer)  # ValueError for a configuration of no registered optimizer
        if self.clip_norm is not None and not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"clip_norm must be None or a finite number > 0, got {self.clip_norm!r}")
        if self.optimizer_kind not in optim.IMPLEMENTATIONS:
            raise ValueError(f"optimizer_kind must be one of {optim.IMPLEMENTATIONS}, got {self.optimizer_kind!r}")
        if self.optimizer_kind not in row.steps:
            raise ValueError(f"{row.name} has no {self.optimizer_kind!r} implementation in the specification "
                             f"({', '.join(row.steps)})")
        if self.param_groups is not None:
            groups = tuple(self.param_groups)
            if not groups or not all(isinstance(g, ParamGroup) for g in groups):
                raise ValueError("param_groups must be None or a non-empty sequence of ParamGroup")
            seen: dict[int, int] = {}
            for gi, g in enumerate(groups):
                g.config_for(self.optimizer)  # options must name fields of the optimizer's config
                for i in g.params:
                    if i in seen:
                        raise ValueError(f"parameter {i} is in param_groups {seen[i]} and {gi}; each belongs to one group")
                    seen[i] = gi
            object.__setattr__(self, "param_groups", groups)
        if self.unscale not in _UNSCALE:
            raise ValueError(f"unscale must be one of {_UNSCALE}, got {self.unscale!r}")
        kernel_scaled = self.optimizer_kind in row.kernel_scaled
        if self.unscale == "kernel" and not (kernel_scaled and self.use_scaler and self.clip_norm is None):
            raise ValueError(f"unscale 'kernel' needs an optimizer_kind whose kernel unscales ({row.name}: "
                             f"{', '.join(sorted(row.kernel_scaled)) or 'none'}), use_scaler=True and "
                             "clip_norm=None (clipping needs the gradients unscaled by the scaler first)")
        if not isinstance(self.sync_free, bool):
            raise ValueError(f"sync_free must be a bool, got {self.sync_free!r}")
        if self.sync_free and not kernel_scaled:
            kinds = " or ".join(repr(k) for k in sorted(row.kernel_scaled)) or "that none of its paths has"
            raise ValueError(f"sync_free needs optimizer_kind {kinds}: only a kernel takes the skip flag ({row.name})")
        if self.kernel_skips:
            for c in self._group_configs():
                why = row.kernel_skip_refused(c)
                if why:
                    mode = "sync_free" if self.sync_free else "unscale 'kernel'"
                    raise ValueError(f"{mode} is refused for {why}")

    def _group_configs(self) -> list[Any]:
        if self.param_groups is None:
            return [self.optimizer]
        return [g.config_for(self.optimizer) for g in self.param_groups]

    def groups(self, n_params: int) -> list[tuple[tuple[int, ...], Any]]:
        """``(parameter indices, optimizer config)`` per group, for ``n_params`` parameters.

        Raises ValueError when the groups do not cover ``0 .. n_params - 1`` exactly once.
        """
        if self.param_groups is None:
            return [(tuple(range(n_params)), self.optimizer)]
        covered = sorted(i for g in self.param_groups for i in g.params)
        if covered != list(range(n_params)):
            missing = sorted(set(range(n_params)) - set(covered))
            extra = sorted(set(covered) - set(range(n_params)))
            raise ValueError(f"param_groups must cover the {n_params} parameters exactly once: "
                             f"missing {missing}, out of range {extra}")
        return [(g.params, g.config_for(self.optimizer)) for g in self.param_groups]

    @property
    def kernel_skips(self) -> bool:
        """Whether the optimizer is called on every step and skips inside its kernel."""
        return self.unscale == "kernel" or self.sync_free

    def lr_at(self, applied_steps: int) -> float:
        """The rate the next step uses: the schedule's (or ``optimizer.lr``), float32 when ``sync_free``."""
        rate = float(self.optimizer.lr) if self.schedule is None else self.schedule.lr_at(applied_steps)
        return float(np.float32(rate)) if self.sync_free else rate


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step, as the trainer writes it (one JSON object per line).

    ``grad_norm`` is the unscaled norm before clipping, and with ``clip_coef`` is None when
    clipping is off. ``lr`` is the rate the step used (or would have used, when skipped).
    """

    step: int
    microbatches: int
    scale_before: float
    found_inf: bool
    applied: bool
    grad_norm: float | None
    clip_coef: float | None
    scale_after: float
    growth_tracker: int
    lr: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StepRecord":
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"step record is missing fields {missing}; a record has {names}")
        return cls(**{n: d[n] for n in names})


@dataclass(frozen=True)
class TrainState:
    """Parameters, optimizer state, scaler state and the two counters.

    ``step`` counts every optimizer step taken (applied or skipped); ``applied_steps`` only
    applied ones, which is what the learning-rate schedule reads.
    """

    params: tuple[np.ndarray, ...]
    opt_state: Any
    scaler: scaling.ScalerState
    step: int = 0
    applied_steps: int = 0


@dataclass(frozen=True)
class StepResult:
    state: TrainState
    record: StepRecord
    grads: tuple[np.ndarray, ...]
    """The gradients as the optimizer saw them: unscaled and clipped (fused: as the kernel left them)."""


def init_train_state(params: Sequence[np.ndarray], config: StepConfig) -> TrainState:
    """Fresh state: float32 copies of the parameters, empty optimizer state (each parameter's
    by its group's configuration), initial scale."""
    ps = tuple(np.array(p, dtype=np.float32, copy=True) for p in params)
    scaler_state = scaling.initial_state(config.scaler) if config.use_scaler else _unit_scale()
    opt_state: list[Any] = [None] * len(ps)
    for idx, cfg in config.groups(len(ps)):
        for i, s in zip(idx, optim.init_state([ps[i] for i in idx], cfg)):
            opt_state[i] = s
    return TrainState(params=ps, opt_state=tuple(opt_state), scaler=scaler_state)


def _unit_scale() -> scaling.ScalerState:
    return scaling.ScalerState(scale=np.float32(1.0), growth_tracker=np.int32(0), hysteresis_left=1)


def scaled_microbatch_loss(loss: float | np.ndarray, microbatches: int, state: scaling.ScalerState) -> np.float32:
    """The value backward starts from: ``f32(f32(loss) / k) * scale``, in float32.

    ``microbatches`` is the real size of this accumulation window (a short last window divides
    by its own size).
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    per_mb = np.float32(np.float32(loss) / np.float32(microbatches))
    return np.float32(scaling.scale_loss(per_mb, state))


def accumulate_gradients(microbatch_grads: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """Sum per-microbatch gradients as autograd accumulates ``.grad``.

    Rule: the first microbatch's gradient is taken as is; each later one is added in float32
    (one rounding per addition), in microbatch order. Low-precision gradients (bf16/fp16) add
    in float32 and round to their dtype each time, as an in-place ``grad += g`` does.
    """
    if not microbatch_grads:
        raise ValueError("microbatch_grads is empty: a step needs at least one microbatch")
    n = len(microbatch_grads[0])
    for i, mb in enumerate(microbatch_grads):
        if len(mb) != n:
            raise ValueError(f"microbatch {i} has {len(mb)} gradients, microbatch 0 has {n}")
    total = [np.array(g, copy=True) for g in microbatch_grads[0]]
    for mb in microbatch_grads[1:]:
        for j, g in enumerate(mb):
            if g.shape != total[j].shape:
                raise ValueError(f"gradient {j}: shape {g.shape} differs from {total[j].shape}")
            wide = total[j].astype(np.float32) + np.asarray(g).astype(np.float32)
            total[j] = wide.astype(total[j].dtype)
    return total


class ScaleCollapsedError(RuntimeError):
    """The loss scale collapsed (rule 5): its float32 inverse is not finite."""

    def __init__(self, step: int, scale: float):
        super().__init__(f"step {step}: the loss scale collapsed to {scale!r} (its float32 inverse is not "
                         "finite, so no gradient can be unscaled); the run cannot continue")
        self.step, self.scale = step, scale


def scale_collapsed(scale: float | np.floating) -> bool:
    """Rule 5: a scale is collapsed when it is not a positive number, or when ``f32(1 / f64(scale))``
    is not finite (0, NaN, or below about ``2**-128``): unscaling would multiply every gradient by
    inf."""
    if not scale > 0:
        return True
    with np.errstate(over="ignore"):
        return not bool(np.isfinite(np.float32(np.float64(1.0) / np.float64(scale))))


def found_inf_after_unscale(found_on_scaled: bool, unscaled: Sequence[np.ndarray], loss_finite: bool = True) -> bool:
    """Rule 2's ``found_inf``: the scaled gradients' check, or a non-finite unscaled gradient,
    or a non-finite window loss."""
    return bool(found_on_scaled) or not loss_finite or scaling.has_inf_or_nan(list(unscaled))


def train_step(
    state: TrainState,
    scaled_grads: Sequence[np.ndarray],
    config: StepConfig,
    microbatches: int = 1,
    *,
    loss_finite: bool = True,
) -> StepResult:
    """One optimizer step from the accumulated scaled gradients (rules 2-6 of the module).

    ``scaled_grads`` are the gradients after the last backward of the window, one per
    parameter, at ``state.scaler.scale``; ``loss_finite`` whether the window's float32 loss sum
    is finite. Returns the new state, the step's record and the gradients the optimizer saw.
    The inputs are not modified. Raises `ScaleCollapsedError` when the update collapses the
    scale (rule 5).
    """
    if len(scaled_grads) != len(state.params):
        raise ValueError(f"got {len(scaled_grads)} gradients for {len(state.params)} parameters")
    for i, (p, g) in enumerate(zip(state.params, scaled_grads)):
        if np.shape(g) != p.shape:
            raise ValueError(f"gradient {i} has shape {np.shape(g)}, parameter {i} has {p.shape}")
    lr = config.lr_at(state.applied_steps)
    grad_norm = clip_coef = None
    if config.unscale == "kernel":
        # The fused kernel checks, divides by the scale (true division) and skips by itself.
        found_inf = scaling.has_inf_or_nan(list(scaled_grads)) or not loss_finite
        grads = list(scaled_grads)
    else:
        if config.use_scaler:
            grads, found_inf = scaling.unscale_gradients(list(scaled_grads), state.scaler)
        else:
            grads = [np.array(g, copy=True) for g in scaled_grads]
            found_inf = scaling.has_inf_or_nan(grads)
        found_inf = found_inf_after_unscale(found_inf, grads, loss_finite)
        if config.clip_norm is not None:
            clipped = clipping.clip_grad_norm_(grads, config.clip_norm, config.norm_type, order=config.clip_order)
            grads, grad_norm, clip_coef = list(clipped.grads), float(clipped.total_norm), float(clipped.clip_coef)
    params, opt_state = state.params, state.opt_state
    if config.kernel_skips or not found_inf:
        params, grads, opt_state = optimizer_step(
            params, grads, opt_state, config, lr, found_inf=bool(found_inf),
            grad_scale=state.scaler.scale if config.unscale == "kernel" else None,
        )

    new_scaler = scaling.update_scale(state.scaler, found_inf, config.scaler) if config.use_scaler else state.scaler
    if scale_collapsed(new_scaler.scale):
        raise ScaleCollapsedError(state.step, float(new_scaler.scale))
    applied = not found_inf
    record = StepRecord(
        step=state.step,
        microbatches=microbatches,
        scale_before=float(state.scaler.scale),
        found_inf=bool(found_inf),
        applied=applied,
        grad_norm=grad_norm,
        clip_coef=clip_coef,
        scale_after=float(new_scaler.scale),
        growth_tracker=int(new_scaler.growth_tracker),
        lr=float(lr),
    )
    new_state = TrainState(
        params=tuple(params),
        opt_state=opt_state,
        scaler=new_scaler,
        step=state.step + 1,
        applied_steps=state.applied_steps + int(applied),
    )
    return StepResult(state=new_state, record=record, grads=tuple(grads))


def optimizer_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray],
    opt_state: Sequence[Any],
    config: StepConfig,
    lr: float,
    *,
    found_inf: bool = False,
    grad_scale: np.float32 | None = None,
) -> tuple[tuple[np.ndarray, ...], list[np.ndarray], tuple[Any, ...]]:
    """Rule 4: the optimizer call, group by group, each with its own configuration, through its
    registry row (`reference.optim.spec_for`).

    Every group gets the same ``lr``. Non-fused kinds take ``config.sqrt``. A kind the row lists
    as ``kernel_scaled`` gets ``grad_scale`` and ``found_inf`` and decides the skip itself; any
    other is not called when ``found_inf`` is set (``GradScaler.step`` skips the call). Returns
    the parameters, the gradients as the kernel leaves them, and the optimizer state, in
    parameter order.
    """
    new_params, new_grads, new_state = list(params), list(grads), list(opt_state)
    impl = config.optimizer_kind
    for idx, cfg in config.groups(len(params)):
        row = optim.spec_for(cfg)
        kernel = impl in row.kernel_scaled
        if found_inf and not kernel:
            continue  # GradScaler.step does not call the optimizer
        p, g, s = row.step(impl, [params[i] for i in idx], [grads[i] for i in idx], [opt_state[i] for i in idx], cfg,
                           lr=lr, sqrt=None if impl == "fused" else config.sqrt,
                           grad_scale=grad_scale if kernel else None, found_inf=float(found_inf) if kernel else 0.0)
        for j, i in enumerate(idx):
            new_params[i], new_grads[i], new_state[i] = p[j], g[j], s[j]
    return tuple(new_params), new_grads, tuple(new_state)


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of `replay`: the first divergent step (None when the trace agrees) and why."""

    first_divergence: int | None
    field: str | None = None
    recorded: Any = None
    replayed: Any = None
    steps_checked: int = 0

    @property
    def ok(self) -> bool:
        return self.first_divergence is None

    def describe(self) -> str:
        if self.ok:
            return f"all {self.steps_checked} steps agree with the specification"
        return (
            f"step {self.first_divergence}: {self.field} recorded {self.recorded!r}, "
            f"the specification gives {self.replayed!r}"
        )


def replay(
    records: Iterable[StepRecord | Mapping[str, Any]],
    config: scaling.ScalerConfig,
    start: scaling.ScalerState | None = None,
) -> ReplayResult:
    """Recompute a recorded scale history from its ``found_inf`` bits alone.

    Rules checked per step, in order: ``scale_before`` equals the replayed scale; ``applied``
    is ``not found_inf``; ``scale_after`` and ``growth_tracker`` equal the replayed update.
    The replay starts from ``start``, or from the configuration's initial state when the trace
    begins at step 0. A trace that begins later (the tail of a resumed run) without ``start``
    cannot know the tracker before its first record: that record is trusted and becomes the
    start state, and checking begins with the next one.
    """
    state = start
    checked = 0
    for raw in records:
        rec = raw if isinstance(raw, StepRecord) else StepRecord.from_dict(raw)
        if state is None:
            state = scaling.initial_state(config)
            if rec.step != 0:
                state = replace(
                    state, scale=np.float32(rec.scale_after), growth_tracker=np.int32(rec.growth_tracker)
                )
                continue
        if np.float32(rec.scale_before) != state.scale:
            return ReplayResult(rec.step, "scale_before", rec.scale_before, float(state.scale), checked)
        if bool(rec.applied) == bool(rec.found_inf):
            return ReplayResult(rec.step, "applied", rec.applied, not rec.found_inf, checked)
        state = scaling.update_scale(state, bool(rec.found_inf), config)
        if np.float32(rec.scale_after) != state.scale:
            return ReplayResult(rec.step, "scale_after", rec.scale_after, float(state.scale), checked)
        if int(rec.growth_tracker) != int(state.growth_tracker):
            return ReplayResult(rec.step, "growth_tracker", rec.growth_tracker, int(state.growth_tracker), checked)
        checked += 1
    return ReplayResult(None, steps_checked=checked)
