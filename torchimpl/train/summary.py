"""The run summary: what one ``Trainer.fit`` did (``RunSummary``), for people and ``report.json``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["RunSummary"]


@dataclass
class RunSummary:
    """What a ``fit`` did, for people and for ``report.json``: read it as attributes
    (``summary.final_train_loss``), as a plain dict (:meth:`to_dict`, what ``ampspec train``
    prints as JSON) or by key (``summary["final_train_loss"]``, the same keys)."""

    device: str
    precision_mode: str
    autocast_dtype: str | None
    use_scaler: bool
    downgrades: list[str]
    optimizer_kind: str
    optimizer_reason: str | None
    sync_free: bool
    compiled: bool
    steps: int
    steps_applied: int
    steps_skipped: int
    final_scale: float | None
    time_per_step_s: float
    samples_per_s: float
    peak_memory_bytes: int | None
    final_train_loss: float | None
    final_val_loss: float | None
    best_val_loss: float | None
    stopped: str | None = None
    last_checkpoint: str | None = None
    diagnosis_report: str | None = None
    outcome: str = "completed"
    """How the run ended (``torchimpl.run.lifecycle``): completed, stopped, failed, no_progress,
    interrupted:SIGINT or interrupted:SIGTERM."""
    fp8: dict[str, Any] | None = None
    """With ``precision.mode: fp8``: the recipe, what runs where, the converted layers and those
    kept in high precision with the reason for each."""
    precision_note: str | None = None
    """What the precision's spelling means when it was given as another library writes it
    (``'16-mixed' (Lightning) means fp16 autocast ... with a dynamic loss scaler``)."""
    log_dir: str | None = None
    """The run folder holding the metrics files (``logging.dir``), or None when none was written."""
    metrics_file: str | None = None
    """The run's ``metrics.csv`` (``torchimpl.run.metrics``), or None without one."""
    fp32_modules: list[str] = dataclasses.field(default_factory=list)
    """The modules run in fp32 islands (``precision.fp32_modules``)."""
    master_weights: str | None = None
    """With ``precision.mode`` bf16-true or fp16-true: ``precision.master_weights``; else None."""
    lost_update_fraction: float | None = None
    """With a ``*-true`` mode: of the updates counted (``reference.health`` rule 12), the fraction
    lost to rounding (the stored value did not change although the exact update was non-zero);
    None when none was counted or the parameters are float32."""
    lost_updates: dict[str, Any] | None = None
    """With a ``*-true`` mode: the counts behind ``lost_update_fraction`` (lost, counted, the steps
    measured, the warning's threshold; ``torchimpl.train.true_precision``)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values, valid JSON: a non-finite number becomes None."""
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in dataclasses.asdict(self).items()}

    def __getitem__(self, key: str) -> Any:
        """``to_dict()[key]``; an unknown key is a KeyError naming the keys there are."""
        values = self.to_dict()
        if key not in values:
            raise KeyError(f"RunSummary has no key {key!r}; keys: {', '.join(values)}")
        return values[key]
