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
- training: `Trainer` (the run's cadence; the step itself is `torchimpl.step`'s engine, the
  checkpoint contents `torchimpl.run_state`), `Callback`, `RunSummary`, `TrainState`,
  `default_loss_fn`, step records and checkpoints (`ResumeError` for a refused resume);
- diagnostics: `NonFiniteGuard`, `check_placement`, `diagnose_nonfinite`; before a failure,
  `inspect_precision` (``ampspec doctor --task``: verdicts and fixes, a `PrecisionReport`);
- the trained weights: `load_weights` (a checkpoint's model ``state_dict``).
"""

# The distribution's version (pyproject.toml), for a checkout that is not installed.
__version__ = "0.1.0"

from torchimpl.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from torchimpl.config import (
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
from torchimpl.device import resolve_device
from torchimpl.export import load_weights
from torchimpl.diagnostics import (
    DiagnosisReport,
    NonFiniteError,
    NonFiniteGuard,
    check_placement,
    diagnose_nonfinite,
)
from torchimpl.doctor import inspect_precision
from torchimpl.doctor_report import PrecisionReport
from torchimpl.optim import (
    BuiltOptimizer,
    FusedOptimizerWarning,
    OptimizerConfig,
    build_optimizer,
    supports_fused_adamw,
)
from torchimpl.precision import (
    PrecisionConfig,
    PrecisionDowngradeWarning,
    PrecisionPlan,
    autocast_context,
    canonical_mode,
    configure_reduced_precision_reduction,
    configure_tf32,
    fp32_island,
    resolve_precision,
    upcast,
)
from torchimpl.records import StepRecord, read_trace
from torchimpl.run_state import ResumeError, TrainState
from torchimpl.scaler import DynamicLossScaler, ScaleAtMinimumError, ScalerConfig, make_grad_scaler
from torchimpl.trainer import Callback, RunSummary, StopTraining, Trainer, default_loss_fn

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
