"""One training configuration: typed frozen dataclasses, loaded from YAML or dicts.

Every field has a docstring (the string literal below it). Loading validates everything at
once: unknown keys, wrong types and out-of-range values are collected into one
:class:`ConfigError` that names each bad field by its dotted path and what is allowed.

Precedence: the defaults here < a YAML file < ``key=value`` overrides (values parsed with
``yaml.safe_load``, so ``train.clip_norm=null`` turns clipping off).

From Python: ``Config(precision={"mode": "bf16"}, train=TrainConfig(steps=50))`` takes a section
object or a mapping of its fields (validated like ``from_dict``); ``precision`` also takes a
plain string (``"bf16-mixed"``, see :func:`torchimpl.precision.plan.canonical_mode`), in a file too
(``precision: bf16-mixed``). :meth:`Config.from_kwargs` takes the common fields flat
(:data:`KEYWORDS`, the names PyTorch trainers use) plus dotted ``overrides``.

The ``precision``, ``optimizer`` and ``scaler`` sections are the config classes of
:mod:`torchimpl.config.sections` and :mod:`torchimpl.config.scale_policy`; their own
validation runs field by field so that every bad field is reported, not only the first.
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from torchimpl.config import safe_yaml
from torchimpl.config.embedded import is_task_name, with_task_defaults
from torchimpl.config.loading import (
    KEYWORDS,
    _build,
    _plain,
    _section_as_written,
    config_from_kwargs,
    overrides_applied,
    section_types,
)
from torchimpl.config.problems import ConfigError
from torchimpl.config.scale_policy import ScalerConfig
from torchimpl.config.sections import OptimizerConfig, PrecisionConfig

__all__ = [
    "KEYWORDS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "LoggingConfig",
    "ScheduleConfig",
    "TaskConfig",
    "TrainConfig",
    "apply_overrides",
    "load_config",
]


# Own sections check themselves with ``_problems() -> list[(field, message)]``; constructing
# one directly from Python with a bad value raises ConfigError the same way loading does.
class _Checked:
    def __post_init__(self) -> None:
        problems = self._problems()  # type: ignore[attr-defined]
        if problems:
            raise ConfigError(problems)


MAX_STEPS = 99_999_999
"""The most optimizer steps of a run: checkpoint names (``step-NNNNNNNN.ckpt``) hold 8 digits."""


def _int_at_least(name: str, value: Any, low: int) -> list[tuple[str, str]]:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return [(name, f"must be an integer >= {low}, got {value!r}")]
    return []


@dataclass(frozen=True)
class TaskConfig(_Checked):
    """Which model and data to train."""

    name: str = "lm"
    """``lm`` (a small transformer on a synthetic sequence task), ``mlp`` (a small MLP
    regression), or ``module:function`` naming a function that returns
    ``(model, train_data, val_data)``; the module is looked up in the working directory first,
    and every generator is seeded from ``train.seed`` before the function is called, so the
    model's initialisation is seeded."""

    size: Literal["tiny", "small"] = "small"
    """Size of the embedded task's model: ``tiny`` for smoke tests, ``small`` by default."""

    def _problems(self) -> list[tuple[str, str]]:
        name = self.name
        if not is_task_name(name):
            return [("name", f"must be 'lm', 'mlp' or 'module:function' (a module by its import name, such as "
                             f"'mytask:make' for mytask.py in the working directory; not a path), got {name!r}")]
        return []


@dataclass(frozen=True)
class ScheduleConfig(_Checked):
    """Learning-rate schedule, a function of the number of *applied* optimizer steps."""

    name: Literal["cosine", "constant"] = "cosine"
    """``cosine``: linear warmup then cosine decay to ``min_lr_ratio * lr``;
    ``constant``: linear warmup then ``lr``."""

    warmup_steps: int = 0
    """Applied steps of linear warmup from ``lr / warmup_steps`` up to ``lr``."""

    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay as a fraction of ``lr`` (0 to 1)."""

    decay_steps: int | None = None
    """Applied steps over which warmup plus decay run; ``null`` means ``train.steps``."""

    def _problems(self) -> list[tuple[str, str]]:
        out = []
        if self.name not in ("cosine", "constant"):
            out.append(("name", f"must be one of 'cosine', 'constant', got {self.name!r}"))
        out += _int_at_least("warmup_steps", self.warmup_steps, 0)
        ratio = self.min_lr_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            out.append(("min_lr_ratio", f"must be a number in [0, 1], got {ratio!r}"))
        if self.decay_steps is not None:
            out += _int_at_least("decay_steps", self.decay_steps, 1)
        return out


@dataclass(frozen=True)
class TrainConfig(_Checked):
    """The training loop."""

    steps: int = 200
    """Optimizer steps to attempt (skipped steps count: the run ends after this many attempts)."""

    microbatches: int = 1
    """Microbatches accumulated per optimizer step, at one constant loss scale."""

    batch_size: int = 32
    """Samples per microbatch (for the embedded tasks; a user's data brings its own)."""

    clip_norm: float | None = 1.0
    """Clip the unscaled gradients to this total L2 norm; ``null`` turns clipping off."""

    log_interval: int = 10
    """Read metrics from the device, log and call ``on_log`` every this many steps."""

    eval_interval: int = 0
    """Evaluate on the validation data every this many steps; 0 means at the end only."""

    seed: int = 0
    """Seed for model initialisation, data order and every random number generator."""

    compile: bool = False
    """Compile the model once with ``torch.compile``; autocast is entered around its calls."""

    sync_free: bool = False
    """With a fused optimizer, keep the skip decision and the schedule on the device: no host
    sync until a log point. Ignored (with a warning) when the optimizer is not fused."""

    on_nonfinite: Literal["skip", "stop"] = "skip"
    """On a non-finite loss or gradient: ``skip`` the step (the scaler backs off) or ``stop``
    the run and write a diagnosis report."""

    guard: bool = False
    """Install the non-finite guard that names the first module producing inf or NaN (one
    process only: refused with ``distributed`` other than ``none``)."""

    force_scaler: bool = False
    """Use a loss scaler even when the precision plan needs none (to exercise the skip logic
    on CPU, where an fp16 request resolves to fp32)."""

    trace_file: str | None = None
    """Write one JSON Lines step record per optimizer step to this file."""

    distributed: Literal["none", "ddp", "fsdp2"] = "none"
    """Multi-process training, launched with ``torchrun``: ``ddp`` (DistributedDataParallel,
    replicated parameters; accumulates a window under ``no_sync`` and all-reduces it once) or
    ``fsdp2`` (``fully_shard``, sharded parameters and sharded checkpoints); ``none`` for one
    process. Rank 0 alone logs, prints and writes the trace; a checkpoint written inside an
    accumulation window resumes only on the same number of ranks."""

    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype gradients cross the ranks in: ``fp32``, or ``bf16`` (half the bytes; each
    all-reduce rounds to bf16). Under ``fsdp2`` it is ``MixedPrecisionPolicy(reduce_dtype=...)``
    (the mean is taken after the bf16 sum); under ``ddp``, ``bf16`` registers torch's
    ``bf16_compress_hook`` (each rank divides in bf16 before the sum), which torch runs only on
    CUDA with NCCL >= 2.10: refused on the CPU. Refused without ``distributed``."""

    distributed_timeout_s: float = 300.0
    """Seconds any rank waits for the others (start-up, every collective) before failing."""

    threads: int | None = None
    """torch's CPU threads for the run (``torch.set_num_threads``, restored after it); ``null``
    keeps torch's own count (``OMP_NUM_THREADS``, else one per core). On a machine whose cores
    other work keeps busy, 1 can train a small model many times faster."""

    def _problems(self) -> list[tuple[str, str]]:
        out = _int_at_least("steps", self.steps, 1)
        if not out and self.steps > MAX_STEPS:
            out.append(("steps", f"must be at most {MAX_STEPS} (checkpoint names hold 8 digits), got {self.steps!r}"))
        out += _int_at_least("microbatches", self.microbatches, 1)
        out += _int_at_least("batch_size", self.batch_size, 1)
        out += _int_at_least("log_interval", self.log_interval, 1)
        out += _int_at_least("eval_interval", self.eval_interval, 0)
        out += _int_at_least("seed", self.seed, 0)
        if self.threads is not None:
            out += _int_at_least("threads", self.threads, 1)
        if isinstance(self.seed, int) and self.seed >= 2**32:
            out.append(("seed", f"must be below 2**32 (NumPy's seeds are 32-bit), got {self.seed!r}"))
        c = self.clip_norm
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < math.inf):
            out.append(("clip_norm", f"must be a finite number > 0 or null (no clipping), got {c!r}"))
        if self.on_nonfinite not in ("skip", "stop"):
            out.append(("on_nonfinite", f"must be one of 'skip', 'stop', got {self.on_nonfinite!r}"))
        if self.distributed not in ("none", "ddp", "fsdp2"):
            out.append(("distributed", f"must be one of 'none', 'ddp', 'fsdp2', got {self.distributed!r}"))
        if self.reduce_dtype not in ("fp32", "bf16"):
            out.append(("reduce_dtype", f"must be one of 'fp32', 'bf16', got {self.reduce_dtype!r}"))
        elif self.reduce_dtype != "fp32" and self.distributed == "none":
            out.append(("reduce_dtype", f"{self.reduce_dtype!r} sets the dtype of the gradient reduction across "
                                        "ranks; with distributed='none' there is none: leave it 'fp32', or set "
                                        "distributed to 'ddp' or 'fsdp2'"))
        t = self.distributed_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            out.append(("distributed_timeout_s", f"must be a finite number of seconds > 0, got {t!r}"))
        if self.guard is True and self.distributed != "none":
            # The guard raises inside one rank's forward; the other ranks would wait in the
            # window's gradient reduction for a backward that never comes.
            out.append(("guard", f"cannot be used with distributed={self.distributed!r} (a hit on one rank "
                                 "would stall the others); diagnose on one process with distributed=none, or "
                                 "rely on on_nonfinite, whose check is agreed by all ranks"))
        for name in ("compile", "sync_free", "guard", "force_scaler"):
            if not isinstance(getattr(self, name), bool):
                out.append((name, f"must be true or false, got {getattr(self, name)!r}"))
        return out


@dataclass(frozen=True)
class CheckpointConfig(_Checked):
    """Where and how often to save checkpoints."""

    folder: str | None = None
    """Folder for checkpoints; ``null`` turns checkpointing off."""

    interval: int = 0
    """Save every this many optimizer steps; 0 means only at the end of the run."""

    keep_last: int = 3
    """Keep the newest this many checkpoints and delete older ones."""

    def _problems(self) -> list[tuple[str, str]]:
        return _int_at_least("interval", self.interval, 0) + _int_at_least(
            "keep_last", self.keep_last, 1
        )


@dataclass(frozen=True)
class LoggingConfig(_Checked):
    """Where the run's metrics go and how progress is shown (free to change on a resume)."""

    dir: str | None = "auto"
    """The run folder for the metrics files: ``auto`` is ``checkpoint.folder`` when set, else a
    fresh ``ampspec-runs/version_N`` in the working directory (the next free N; the environment
    variable ``AMPSPEC_RUNS_DIR`` moves ``ampspec-runs``); a path; ``null`` writes no files."""

    csv: bool = True
    """Write ``metrics.csv`` in the run folder: one row per optimizer step."""

    tensorboard: bool | None = None
    """Write TensorBoard scalars in the run folder: ``null`` when the tensorboard package is
    installed, ``true`` always (refused at start when it is missing), ``false`` never."""

    progress: Literal["auto", "bar", "lines", "off"] | bool = "auto"
    """Progress on stderr: ``auto`` is a bar when stderr is a terminal, else a line every
    ``train.log_interval`` steps; ``bar``, ``lines`` or ``off`` force one. (YAML reads an
    unquoted ``off`` as false, which means ``off``; true means ``auto``.)"""

    precision_stats: int = 0
    """Every N optimizer steps, log each module's output dtype, amax, headroom in bits and
    subnormal fraction to ``precision_stats.csv`` (and TensorBoard) in the run folder
    (``torchimpl.train.precision_stats``); 0, the default, logs none (each measured step syncs)."""

    def __post_init__(self) -> None:
        if isinstance(self.progress, bool):
            object.__setattr__(self, "progress", "auto" if self.progress else "off")
        super().__post_init__()

    def _problems(self) -> list[tuple[str, str]]:
        out = []
        if self.dir is not None and (not isinstance(self.dir, str) or not self.dir):
            out.append(("dir", f"must be 'auto', a folder path or null (no files), got {self.dir!r}"))
        if not isinstance(self.csv, bool):
            out.append(("csv", f"must be true or false, got {self.csv!r}"))
        if self.tensorboard is not None and not isinstance(self.tensorboard, bool):
            out.append(("tensorboard", f"must be true, false or null (when installed), got {self.tensorboard!r}"))
        if self.tensorboard is True and self.dir is None:
            out.append(("tensorboard", "true needs a run folder, but logging.dir is null; set logging.dir "
                                       "(or 'auto'), or logging.tensorboard=false"))
        out += _int_at_least("precision_stats", self.precision_stats, 0)
        if self.dir is None and isinstance(self.precision_stats, int) and self.precision_stats > 0:
            # its file goes in the run folder: without one the statistics would vanish unwritten
            out.append(("precision_stats", (f"{self.precision_stats} needs a run folder, but logging.dir is null; "
                                            "set logging.dir (or 'auto'), or logging.precision_stats=0")))
        if self.progress not in ("auto", "bar", "lines", "off"):
            out.append(("progress", f"must be one of 'auto', 'bar', 'lines', 'off', got {self.progress!r}"))
        return out


def _across_sections(cfg: "Config") -> list[tuple[str, str]]:
    """Settings of different sections valid alone but not together, as ``(dotted field, message)``."""
    out: list[tuple[str, str]] = []
    mode, t = cfg.precision.mode, cfg.train
    if mode in ("bf16-true", "fp16-true") and t.distributed == "ddp":
        out.append(("train.distributed", f"precision.mode {mode!r} under ddp (replicas of 16-bit parameters) is not "
                                         "implemented; use train.distributed=fsdp2 with precision.master_weights=fp32 "
                                         "(fp32 shards, 16-bit compute copies), or mode bf16 (bf16-mixed) under ddp"))
    if mode in ("bf16-true", "fp16-true") and t.distributed == "fsdp2" and cfg.precision.master_weights != "fp32":
        out.append(("precision.master_weights", f"{cfg.precision.master_weights!r} with precision.mode {mode!r} cannot "
                                                "run under train.distributed=fsdp2, whose shards are fp32 with a 16-bit "
                                                "compute copy (MixedPrecisionPolicy(param_dtype=...)): set "
                                                "precision.master_weights=fp32, or train.distributed=none"))
    device = cfg.device.split(":")[0] if isinstance(cfg.device, str) else ""
    if t.distributed == "ddp" and t.reduce_dtype == "bf16" and device == "cpu":
        # DistributedDataParallel._check_comm_hook raises a TypeError for bf16_compress_hook
        # unless CUDA with NCCL >= 2.10 (or XPU): refuse before any process group exists.
        out.append(("train.reduce_dtype", "'bf16' under distributed='ddp' is torch's bf16_compress_hook, which "
                                          "torch runs only on CUDA with NCCL >= 2.10, not with gloo on the CPU "
                                          "(device='cpu'): use distributed='fsdp2' (its bf16 reduction runs on "
                                          "gloo) or reduce_dtype='fp32'"))
    if cfg.precision.master_weights != "none" and cfg.train.sync_free is True:
        # The fused kernel skips a step inside itself; the master copy's write-back runs on the
        # host and would not see that skip.
        out.append(("train.sync_free", f"precision.master_weights={cfg.precision.master_weights!r} writes the "
                                       "16-bit parameters back on the host after each applied step, which the "
                                       "sync-free mode's in-kernel skip does not tell it; set train.sync_free=false, "
                                       "or master_weights=none"))
    return out


@dataclass(frozen=True)
class Config:
    """A whole training run."""

    device: str = "auto"
    """``auto`` (CUDA, then MPS, then CPU), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``."""

    task: TaskConfig = field(default_factory=TaskConfig)
    """Model and data."""

    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Precision request (``mode``: auto, fp32, bf16, fp16, fp8, bf16-true, fp16-true (``16-true``);
    ``dtype`` for auto; ``fp8_recipe`` and ``fp8_skip_first_last`` for fp8, which needs
    ``pip install 'ampspec[fp8]'``; ``master_weights`` for the ``*-true`` modes)."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer (``name``, ``lr``, ``weight_decay``, ``betas``, ``fused``: null probes)."""

    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    """Dynamic loss scaler (used only when the precision plan needs one)."""

    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics files (CSV, TensorBoard) in the run folder, and the progress display."""

    def __post_init__(self) -> None:
        errors: list[tuple[str, str]] = []
        if not isinstance(self.device, str) or not self.device:
            errors.append(("device", f"must be a device string like 'auto', 'cpu', 'cuda:0', got {self.device!r}"))
        # A mapping (or precision's string) where a section belongs is what the user means:
        # convert it through from_dict's validation rather than fail later, at fit.
        for name, tp in section_types(type(self)).items():
            value = _section_as_written(name, getattr(self, name))
            if isinstance(value, tp):
                continue
            if not isinstance(value, Mapping):
                errors.append((name, f"must be a {tp.__name__} or a mapping of its fields, got {value!r}"))
                continue
            section = _build(tp, value, name, errors)
            if section is not None:
                object.__setattr__(self, name, section)
        if not errors:
            errors = _across_sections(self)
        if errors:
            raise ConfigError(errors)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (tuples become lists) that :meth:`from_dict` reads back equal."""
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Config:
        """Build and validate; raises :class:`ConfigError` naming every bad field."""
        errors: list[tuple[str, str]] = []
        result = _build(cls, data or {}, "", errors)
        if errors:
            raise ConfigError(errors)
        return result

    @classmethod
    def from_kwargs(cls, base: Config | None = None, /, **kwargs: Any) -> Config:
        """``base`` (default: the defaults) with the flat keywords of :data:`KEYWORDS` applied
        (``precision="bf16-mixed", max_steps=200, clip=None``), then ``overrides``: a mapping
        of dotted keys to values (``{"scaler.growth_interval": 100}``) or ``"key=value"``
        strings. One :class:`ConfigError` names every unknown keyword and every bad value."""
        return config_from_kwargs(cls, base, kwargs)


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``"dotted.key=value"`` applied (value parsed as YAML);
    ``precision=bf16-mixed`` sets ``precision.mode``."""
    return overrides_applied(Config, data, overrides)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    data: Mapping[str, Any] | None = None,
    *,
    task_defaults: bool = False,
) -> Config:
    """Defaults < ``path`` (YAML) or ``data`` < ``overrides``; raises :class:`ConfigError`.

    ``task_defaults``: lay the embedded task's own settings (``torchimpl.config.embedded``) under the
    file and the overrides when ``task.name`` is ``lm`` or ``mlp``, as ``ampspec train`` and
    ``ampspec compare`` do, which build that task. Off by default: a configuration loaded to
    train one's own model keeps the general defaults whatever ``task.name`` says."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = safe_yaml.load(safe_yaml.read_file(path), str(path))
        except OSError as exc:
            raise ConfigError([("", f"cannot read config file {str(path)!r}: {exc.strerror}")]) from None
        except safe_yaml.YamlError as exc:
            raise ConfigError([("", str(exc))]) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError([("", f"{path} must hold a mapping of sections, got {type(loaded).__name__}")])
        tree = loaded or {}
    if data is not None:
        tree = {**tree, **_plain(dict(data))}
    tree = apply_overrides(tree, overrides)
    return Config.from_dict(with_task_defaults(tree) if task_defaults else tree)
