"""ampspec's production PyTorch package. It never imports ``reference`` (``spec_bridge``, the
CLI's boundary with the specification, does so only when ``replay`` calls it).

- device and precision: `resolve_device`, `PrecisionConfig`, `resolve_precision`,
  `autocast_context`, `configure_tf32`, `fp32_island`, `upcast`;
- loss scaling: `ScalerConfig`, `DynamicLossScaler`, `make_grad_scaler`;
- optimizers: `OptimizerConfig`, `build_optimizer`, `supports_fused_adamw`;
- training: `Config`, `load_config`, `Trainer` (the run's cadence; the step itself is
  `torchimpl.step`'s engine, the checkpoint contents `torchimpl.run_state`), `Callback`,
  `RunSummary`, step records and checkpoints;
- diagnostics: `NonFiniteGuard`, `check_placement`, `diagnose_nonfinite`;
- the trained weights: `load_weights` (a checkpoint's model ``state_dict``).
"""

# The distribution's version (pyproject.toml), for a checkout that is not installed.
__version__ = "0.1.0"

from torchimpl.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from torchimpl.config import Config, ConfigError, load_config
from torchimpl.device import resolve_device
from torchimpl.export import load_weights
from torchimpl.diagnostics import (
    DiagnosisReport,
    NonFiniteError,
    NonFiniteGuard,
    check_placement,
    diagnose_nonfinite,
)
from torchimpl.optim import BuiltOptimizer, OptimizerConfig, build_optimizer, supports_fused_adamw
from torchimpl.precision import (
    PrecisionConfig,
    PrecisionDowngradeWarning,
    PrecisionPlan,
    autocast_context,
    configure_reduced_precision_reduction,
    configure_tf32,
    fp32_island,
    resolve_precision,
    upcast,
)
from torchimpl.records import StepRecord, read_trace
from torchimpl.scaler import DynamicLossScaler, ScaleAtMinimumError, ScalerConfig, make_grad_scaler
from torchimpl.trainer import Callback, RunSummary, StopTraining, Trainer

__all__ = [
    "BuiltOptimizer",
    "Callback",
    "CheckpointError",
    "Config",
    "ConfigError",
    "DiagnosisReport",
    "DynamicLossScaler",
    "NonFiniteError",
    "NonFiniteGuard",
    "OptimizerConfig",
    "PrecisionConfig",
    "PrecisionDowngradeWarning",
    "PrecisionPlan",
    "RunSummary",
    "ScaleAtMinimumError",
    "ScalerConfig",
    "StepRecord",
    "StopTraining",
    "Trainer",
    "autocast_context",
    "build_optimizer",
    "check_placement",
    "configure_reduced_precision_reduction",
    "configure_tf32",
    "diagnose_nonfinite",
    "fp32_island",
    "latest_checkpoint",
    "load_checkpoint",
    "load_weights",
    "make_grad_scaler",
    "read_trace",
    "resolve_device",
    "resolve_precision",
    "save_checkpoint",
    "supports_fused_adamw",
    "upcast",
]
