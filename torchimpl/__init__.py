"""ampspec's production PyTorch package. It never imports ``reference`` (``spec_bridge``, the
CLI's boundary with the specification, does so only when ``replay`` calls it).

Train a model: ``Trainer(precision="bf16-mixed", max_steps=200).fit(model, train_data, val_data)``.

- configuration: `Config` (whole run; `Config.from_kwargs`, `Config.from_dict`), its sections
  `TaskConfig`, `PrecisionConfig`, `OptimizerConfig`, `ScalerConfig`, `ScheduleConfig`,
  `TrainConfig`, `CheckpointConfig`, `LoggingConfig`; `load_config`, `apply_overrides`, `ConfigError`;
- device and precision: `resolve_device`, `resolve_precision` (precision spellings:
  `canonical_mode`), `autocast_context`, `configure_tf32`, `fp32_island`, `upcast`;
- loss scaling: `DynamicLossScaler`, `make_grad_scaler`;
- optimizers: `build_optimizer`, `supports_fused_adamw`, `FusedOptimizerWarning`;
- training: `Trainer` (the run's cadence; the step itself is `torchimpl.train.step`'s engine, the
  checkpoint contents `torchimpl.run.state`), `Callback`, `RunSummary`, `TrainState`,
  `default_loss_fn`, step records and checkpoints (`ResumeError` for a refused resume);
- diagnostics: `NonFiniteGuard`, `check_placement`, `diagnose_nonfinite`; before a failure,
  `inspect_precision` (``ampspec doctor --task``: verdicts and fixes, a `PrecisionReport`);
- the trained weights: `load_weights` (a checkpoint's model ``state_dict``).
"""

# The distribution's version (pyproject.toml), for a checkout that is not installed.
__version__ = "0.1.0"

import importlib
from typing import TYPE_CHECKING, Any

# Each public name and the module that defines it. Imported on first use (PEP 562), so that
# ``import torchimpl.cli`` (the ``ampspec`` command) can answer --help without importing torch.
_EXPORTS = {
    "BuiltOptimizer": "train.optim",
    "Callback": "train.trainer",
    "CheckpointConfig": "config.schema",
    "CheckpointError": "run.checkpoint",
    "Config": "config.schema",
    "ConfigError": "config.schema",
    "DiagnosisReport": "precision.diagnostics",
    "DynamicLossScaler": "train.scaler",
    "FusedOptimizerWarning": "train.optim",
    "LoggingConfig": "config.schema",
    "NonFiniteError": "precision.guard",
    "NonFiniteGuard": "precision.guard",
    "OptimizerConfig": "config.sections",
    "PrecisionConfig": "config.sections",
    "PrecisionDowngradeWarning": "precision.plan",
    "PrecisionPlan": "precision.plan",
    "PrecisionReport": "doctor.report",
    "ResumeError": "run.state",
    "RunSummary": "train.trainer",
    "ScaleAtMinimumError": "train.scaler",
    "ScalerConfig": "config.scale_policy",
    "ScheduleConfig": "config.schema",
    "StepRecord": "run.records",
    "StopTraining": "train.trainer",
    "TaskConfig": "config.schema",
    "TrainConfig": "config.schema",
    "TrainState": "run.state",
    "Trainer": "train.trainer",
    "apply_overrides": "config.schema",
    "autocast_context": "precision.plan",
    "build_optimizer": "train.optim",
    "canonical_mode": "config.sections",
    "check_placement": "precision.guard",
    "configure_reduced_precision_reduction": "precision.plan",
    "configure_tf32": "precision.plan",
    "default_loss_fn": "train.loss_protocol",
    "diagnose_nonfinite": "precision.diagnostics",
    "fp32_island": "precision.plan",
    "inspect_precision": "doctor.inspect",
    "latest_checkpoint": "run.checkpoint",
    "load_checkpoint": "run.checkpoint",
    "load_config": "config.schema",
    "load_weights": "cli.export",
    "make_grad_scaler": "train.scaler",
    "read_trace": "run.records",
    "resolve_device": "precision.device",
    "resolve_precision": "precision.plan",
    "save_checkpoint": "run.checkpoint",
    "supports_fused_adamw": "train.optim",
    "upcast": "precision.plan",
}

__all__ = [
    "BuiltOptimizer",
    "Callback",
    "CheckpointConfig",
    "CheckpointError",
    "Config",
    "ConfigError",
    "DiagnosisReport",
    "DynamicLossScaler",
    "FusedOptimizerWarning",
    "LoggingConfig",
    "NonFiniteError",
    "NonFiniteGuard",
    "OptimizerConfig",
    "PrecisionConfig",
    "PrecisionDowngradeWarning",
    "PrecisionPlan",
    "PrecisionReport",
    "ResumeError",
    "RunSummary",
    "ScaleAtMinimumError",
    "ScalerConfig",
    "ScheduleConfig",
    "StepRecord",
    "StopTraining",
    "TaskConfig",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "apply_overrides",
    "autocast_context",
    "build_optimizer",
    "canonical_mode",
    "check_placement",
    "configure_reduced_precision_reduction",
    "configure_tf32",
    "default_loss_fn",
    "diagnose_nonfinite",
    "fp32_island",
    "inspect_precision",
    "latest_checkpoint",
    "load_checkpoint",
    "load_config",
    "load_weights",
    "make_grad_scaler",
    "read_trace",
    "resolve_device",
    "resolve_precision",
    "save_checkpoint",
    "supports_fused_adamw",
    "upcast",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        # A submodule by attribute (``torchimpl.train.trainer`` after ``import torchimpl``), as when
        # this file imported them all.
        try:
            return importlib.import_module(f"torchimpl.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"torchimpl.{name}":
                raise
        raise AttributeError(f"module 'torchimpl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"torchimpl.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from torchimpl.run.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
    from torchimpl.config.schema import (
        CheckpointConfig,
        Config,
        ConfigError,
        LoggingConfig,
        ScheduleConfig,
        TaskConfig,
        TrainConfig,
        apply_overrides,
        load_config,
    )
    from torchimpl.precision.device import resolve_device
    from torchimpl.doctor.inspect import inspect_precision
    from torchimpl.doctor.report import PrecisionReport
    from torchimpl.cli.export import load_weights
    from torchimpl.precision.diagnostics import DiagnosisReport, diagnose_nonfinite
    from torchimpl.precision.guard import NonFiniteError, NonFiniteGuard, check_placement
    from torchimpl.train.optim import (
        BuiltOptimizer,
        FusedOptimizerWarning,
        build_optimizer,
        supports_fused_adamw,
    )
    from torchimpl.config.sections import OptimizerConfig, PrecisionConfig, canonical_mode
    from torchimpl.precision.plan import (
        PrecisionDowngradeWarning,
        PrecisionPlan,
        autocast_context,
        configure_reduced_precision_reduction,
        configure_tf32,
        fp32_island,
        resolve_precision,
        upcast,
    )
    from torchimpl.run.records import StepRecord, read_trace
    from torchimpl.run.state import ResumeError, TrainState
    from torchimpl.config.scale_policy import ScalerConfig
    from torchimpl.train.scaler import DynamicLossScaler, ScaleAtMinimumError, make_grad_scaler
    from torchimpl.train.trainer import Callback, RunSummary, StopTraining, Trainer, default_loss_fn
