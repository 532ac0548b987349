"""torchimpl's configuration as the specification's: the one place that translates it.

This is the boundary between the two implementations, where the specification judges a
recorded run (``ampspec replay``) and where the conformance suite builds the spec's step for a
trainer's run. It is the only torchimpl module that uses ``reference``, imported inside its
functions so that importing torchimpl never imports the specification; the training path never
calls it. Only names and values cross here, never code: each side computes with its own.

Translations:

1. the scaler policy (``torchimpl.train.scaler.ResolvedScalerConfig``) becomes
   ``reference.scaling.ScalerConfig``: the spec's preset of the same name with every shared
   field taken from the policy (the spec-only fields, such as DeepSpeed's growth since the last
   overflow, come with the preset);
2. the optimizer (``torchimpl.train.optim.OptimizerConfig``) becomes the configuration of the spec's
   registry row named as its torch class (``reference.optim.spec``), from the same keyword
   arguments torchimpl's row gives torch;
3. the schedule (``torchimpl.config.schema.ScheduleConfig``) becomes ``reference.step.LRSchedule``,
   whose cosine spans ``schedule.decay_steps`` or else ``train.steps``;
4. ``optimizer.no_decay_bias_and_norm`` (rule 4 of ``torchimpl.train.optim``) becomes two
   ``ParamGroup``: parameters of 2 or more dimensions, and the others with ``weight_decay=0``;
5. everything else of the step (clip norm, optimizer kind, sync-free mode, whether a scaler
   runs) is passed through as the trainer resolved it;
6. the doctor's note on a CPU run (``autocast_device_note``): the aten operations it saw run on
   16-bit inputs, looked up in the autocast op policy (``reference.autocast``), name those that
   CPU autocast passes through but CUDA autocast runs in float32.
7. A run with ``precision.mode`` bf16-true or fp16-true has no ``StepConfig``: ``reference.step``
   steps float32 weights, and such a run's update is ``reference.master_weights``' (per
   ``precision.master_weights``), which this bridge does not translate yet. ``step_config``
   refuses it (``NotImplementedError`` naming the mode) rather than let a comparison report a
   false divergence; the loss-scale replay (``ampspec replay``) judges its trace like any other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence
from torchimpl.train import optim as train_optim  # REGISTRY looked up when called (a new row counts)

__all__ = ["autocast_device_note", "optimizer_config", "param_groups", "scaler_config", "schedule", "step_config"]


def scaler_config(policy: Any) -> Any:
    """Rule 1: ``reference.scaling.ScalerConfig`` for a resolved scaler policy (the spec's
    default configuration for ``None``: no scaler, whose scale the spec fixes at 1)."""
    # the specification, only when the bridge is used: importing torchimpl never imports reference
    from reference.scaling import ScalerConfig

    if policy is None:
        return ScalerConfig()
    shared = {f.name for f in dataclasses.fields(ScalerConfig)} & {f.name for f in dataclasses.fields(policy)}
    return ScalerConfig.preset(policy.preset, **{n: getattr(policy, n) for n in sorted(shared - {"preset"})})


def optimizer_config(o: Any) -> Any:
    """Rule 2: the spec's optimizer configuration for a ``torchimpl.train.optim.OptimizerConfig``: the
    spec's row of the same torch class, given the keyword arguments torchimpl gives torch."""
    # the specification, only when the bridge is used: importing torchimpl never imports reference
    from reference import optim

    row = train_optim.REGISTRY[o.name]
    return optim.spec(row.cls.__name__).make_config(**row.kwargs(o))


def schedule(config: Any) -> Any:
    """Rule 3: the spec's ``LRSchedule`` for a run's ``Config``."""
    # the specification, only when the bridge is used: importing torchimpl never imports reference
    from reference.step import LRSchedule

    s, o = config.schedule, config.optimizer
    total = s.decay_steps if s.decay_steps is not None else config.train.steps
    return LRSchedule(base_lr=o.lr, kind=s.name, warmup_steps=s.warmup_steps, total_steps=total,
                      min_lr_ratio=s.min_lr_ratio)


def param_groups(o: Any, param_ndims: Sequence[int]) -> Any:
    """Rule 4: the spec's parameter groups for the trained parameters' numbers of dimensions
    (in the trainer's parameter order); ``None`` for one group of all."""
    # the specification, only when the bridge is used: importing torchimpl never imports reference
    from reference.step import ParamGroup

    if not o.no_decay_bias_and_norm:
        return None
    decay = tuple(i for i, n in enumerate(param_ndims) if n >= 2)
    no_decay = tuple(i for i, n in enumerate(param_ndims) if n < 2)
    return ParamGroup(decay), ParamGroup(no_decay, {"weight_decay": 0.0})


def step_config(config: Any, *, scaler_policy: Any, optimizer_kind: str, sync_free: bool,
                param_ndims: Sequence[int], **extra: Any) -> Any:
    """``reference.step.StepConfig`` for a run: its ``Config``, the policy of the scaler it runs
    (``None`` without one), the optimizer kind and sync mode it resolved, and its trained
    parameters' numbers of dimensions. ``extra`` goes to ``StepConfig`` as is (``sqrt``)."""
    mode = config.precision.mode
    if mode in ("bf16-true", "fp16-true"):  # rule 7
        raise NotImplementedError(
            f"precision.mode {mode!r} (master_weights={config.precision.master_weights!r}): reference.step states "
            "the step over float32 weights; this run's update is reference.master_weights', which the spec bridge "
            "does not translate yet, so no step-by-step agreement is reported for it (ampspec replay still judges "
            "its loss-scale history)")
    # the specification, only when the bridge is used: importing torchimpl never imports reference
    from reference.step import StepConfig

    return StepConfig(optimizer=optimizer_config(config.optimizer), schedule=schedule(config),
                      scaler=scaler_config(scaler_policy), use_scaler=scaler_policy is not None,
                      clip_norm=config.train.clip_norm, optimizer_kind=optimizer_kind, sync_free=sync_free,
                      param_groups=param_groups(config.optimizer, param_ndims), **extra)


# Rule 6: aten operation names (overload packets) -> the autocast table's op names.
_ATEN_TO_POLICY = {"_softmax": "softmax", "softmax": "softmax", "_log_softmax": "log_softmax",
                   "log_softmax": "log_softmax", "native_layer_norm": "layer_norm", "native_group_norm": "group_norm",
                   "sum": "sum", "linalg_vector_norm": "vector_norm", "logsumexp": "logsumexp", "exp": "exp",
                   "log": "log", "pow": "pow", "prod": "prod"}


def autocast_device_note(low_ops: dict[str, set[str]], dtype: str) -> str | None:
    """Rule 6: the note for ops (aten name -> modules they ran in) seen on 16-bit inputs on a CPU."""
    # the specification, only when the bridge is used: importing torchimpl never imports reference
    from reference.autocast import category

    differ: dict[str, set[str]] = {}
    for aten, where in low_ops.items():
        op = _ATEN_TO_POLICY.get(aten)
        if op and category(op, "cpu") != category(op, "cuda") and category(op, "cuda") == "float32":
            differ.setdefault(op, set()).update(w or "<root>" for w in where)
    if not differ:
        return None
    listed = "; ".join(f"{op} (in {', '.join(sorted(w)[:4])})" for op, w in sorted(differ.items()))
    return (f"CPU autocast ran these ops in {dtype}, which CUDA autocast runs in float32 (the op-policy table, "
            f"reference/autocast.py rule 7): {listed}; verdicts that come from them may not appear on CUDA")
