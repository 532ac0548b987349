"""One training configuration: typed frozen dataclasses, loaded from YAML or dicts.

Every field has a docstring (the string literal below it). Loading validates everything at
once: unknown keys, wrong types and out-of-range values are collected into one
:class:`ConfigError` that names each bad field by its dotted path and what is allowed.

Precedence: the defaults here < a YAML file < ``key=value`` overrides (values parsed with
``yaml.safe_load``, so ``train.clip_norm=null`` turns clipping off).

From Python: ``Config(precision={"mode": "bf16"}, train=TrainConfig(steps=50))`` takes a section
object or a mapping of its fields (validated like ``from_dict``); ``precision`` also takes a
plain string (``"bf16-mixed"``, see :func:`torchimpl.precision.canonical_mode`), in a file too
(``precision: bf16-mixed``). :meth:`Config.from_kwargs` takes the common fields flat
(:data:`KEYWORDS`, the names PyTorch trainers use) plus dotted ``overrides``.

The ``precision``, ``optimizer`` and ``scaler`` sections are the config classes of
:mod:`torchimpl.precision`, :mod:`torchimpl.optim` and :mod:`torchimpl.scaler`; their own
validation runs field by field so that every bad field is reported, not only the first.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from torchimpl import safe_yaml
from torchimpl.embedded import is_task_name, with_task_defaults
from torchimpl.errors import ProblemList
from torchimpl.optim import OptimizerConfig
from torchimpl.precision import PrecisionConfig
from torchimpl.scaler import ScalerConfig

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


class ConfigError(ProblemList):
    """A configuration with one or more bad fields; ``errors`` lists ``(dotted_path, message)``.
    Several are written one per line (the command line prints them so, ``torchimpl.errors``)."""

    def __init__(self, errors: Sequence[tuple[str, str]]):
        self.errors = list(errors)
        lines = [f"{path}: {msg}" if path else msg for path, msg in self.errors]
        if len(lines) == 1:
            text = f"invalid configuration: {lines[0]}"
        else:
            text = "invalid configuration (%d errors):\n  %s" % (len(lines), "\n  ".join(lines))
        super().__init__(text)


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
    (``torchimpl.precision_stats``); 0, the default, logs none (each measured step syncs)."""

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


@dataclass(frozen=True)
class Config:
    """A whole training run."""

    device: str = "auto"
    """``auto`` (CUDA, then MPS, then CPU), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``."""

    task: TaskConfig = field(default_factory=TaskConfig)
    """Model and data."""

    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Precision request (``mode``: auto, fp32, bf16, fp16, fp8; ``dtype`` for auto;
    ``fp8_recipe`` and ``fp8_skip_first_last`` for fp8, which needs ``pip install 'ampspec[fp8]'``)."""

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
        for name, tp in _section_types().items():
            value = _section_as_written(name, getattr(self, name))
            if isinstance(value, tp):
                continue
            if not isinstance(value, Mapping):
                errors.append((name, f"must be a {tp.__name__} or a mapping of its fields, got {value!r}"))
                continue
            section = _build(tp, value, name, errors)
            if section is not None:
                object.__setattr__(self, name, section)
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
        return _from_kwargs(base, kwargs)


@functools.cache
def _section_types() -> dict[str, type]:
    return {name: tp for name, tp in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(tp)}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- generic typed building


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0])}"
        return f"a list of {len(args)} values ({', '.join(_describe(a) for a in args)})"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


_NO = object()


def _coerce(tp: Any, value: Any) -> Any:
    """``value`` converted to type ``tp``, or ``_NO`` when it does not fit."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if tp is type(None):
        return None if value is None else _NO
    if origin is Literal:
        return value if any(value == a and type(value) is type(a) for a in typing.get_args(tp)) else _NO
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            out = _coerce(arg, value)
            if out is not _NO:
                return out
        return _NO
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return _NO
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_coerce(args[0], v) for v in value]
        elif len(args) == len(value):
            items = [_coerce(a, v) for a, v in zip(args, value)]
        else:
            return _NO
        return _NO if any(i is _NO for i in items) else tuple(items)
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads ``3e-4`` without a dot as a string; accept it as a number.
            try:
                return float(value)
            except ValueError:
                return _NO
        return _NO
    if tp is str:
        return value if isinstance(value, str) else _NO
    if isinstance(tp, type):
        return value if isinstance(value, tp) else _NO
    return value


def _section_as_written(path: str, value: Any) -> Any:
    """The one place a section may be written as one value: ``precision: bf16-mixed`` (a file,
    ``Config(precision=...)``, ``--set precision=...``, ``Trainer(precision=...)``) is
    ``precision: {mode: bf16-mixed}``; :class:`PrecisionConfig` reads the spelling (its rule 8).
    Anything else comes back as it is."""
    if path == "precision" and not isinstance(value, (Mapping, PrecisionConfig)):
        return {"mode": value}
    return value


def _wrong_type(tp: Any, value: Any) -> str:
    hint = ""
    if value is False and _coerce(tp, "no") is not _NO:
        hint = " (YAML reads an unquoted no as false: write 'no' in quotes)"
    return f"must be {_describe(tp)}, got {value!r}{hint}"


def _build(cls: type, data: Any, prefix: str, errors: list[tuple[str, str]]) -> Any:
    where = "configuration"
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        errors.append((prefix, f"must be a mapping of keys to values, got {data!r}") if prefix else
                      ("", f"{where} must be a mapping of keys to values, got {data!r}"))
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(
                (_join(prefix, str(key)), f"unknown key{hint}; allowed: {', '.join(fields)}")
            )
    kwargs: dict[str, Any] = {}
    start = len(errors)
    for name in fields:
        if name not in data:
            continue
        tp, value, path = hints[name], data[name], _join(prefix, name)
        if dataclasses.is_dataclass(tp):
            sub = _build(tp, _section_as_written(path, value), path, errors)
            if sub is not None:
                kwargs[name] = sub
            continue
        out = _coerce(tp, value)
        if out is _NO:
            errors.append((path, _wrong_type(tp, value)))
        else:
            kwargs[name] = out
    # Construct with the well-typed values even after an error, so that range errors in
    # the other fields are reported in the same go.
    result = _construct(cls, kwargs, prefix, errors)
    if len(errors) > start or any(k not in fields for k in data):
        return None
    return result


def _construct(cls: type, kwargs: dict[str, Any], prefix: str, errors: list[tuple[str, str]]) -> Any:
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        errors.extend((_join(prefix, p), m) for p, m in exc.errors)
        return None
    except (ValueError, TypeError) as exc:
        first = str(exc)  # the name bound by ``as`` is cleared when the handler ends
    # A section validated by its own class raises on its first bad field: try each field
    # alone against the defaults so that every bad one is named.
    found = False
    for name, value in kwargs.items():
        if dataclasses.is_dataclass(value):
            continue
        try:
            cls(**{name: value})
        except (ValueError, TypeError) as exc:
            found = True
            errors.append((_join(prefix, name), _strip_name(str(exc), name)))
    if not found:
        errors.append((prefix, first))
    return None


def _strip_name(message: str, name: str) -> str:
    # "invalid ScalerConfig: growth_factor must be > 1, got 0.5" reads "scaler.growth_factor:
    # must be > 1, got 0.5": the path already names the section and the field.
    message = message.removeprefix("invalid ScalerConfig: ")
    return message[len(name):].lstrip(" :") if message.startswith(name + " ") else message


# ---------------------------------------------------------------- files and overrides


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree[a][b]... = value`` for ``dotted`` ``"a.b..."``; a section on the way that holds
    a value other than a mapping is an error (never silently replaced)."""
    parts = dotted.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif dataclasses.is_dataclass(child) and not isinstance(child, type):
            child = node[part] = _plain(dataclasses.asdict(child))
        elif not isinstance(child, dict):
            section = ".".join(parts[:depth + 1])
            raise ConfigError([(section, f"must be a mapping of keys to values, got {child!r} "
                                         f"(write {section}: {{{parts[depth + 1]}: ...}})")])
        node = child
    node[parts[-1]] = value


def _parse_overrides(overrides: Sequence[str], bad: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    """``"dotted.key=value"`` strings as ``(key, value)`` pairs, values parsed as YAML."""
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not p for p in key.split(".")):
            bad.append((item, "an override must look like section.key=value, e.g. train.steps=100"))
            continue
        try:
            pairs.append((key, safe_yaml.load(raw, f"the value of {key}") if raw.strip() else ""))
        except safe_yaml.YamlError as exc:
            bad.append((key, f"value {raw!r} is refused: {exc}"))
    return pairs


def _dotted_pairs(key: str, value: Any) -> list[tuple[str, Any]]:
    """A section written as one value sets its fields one by one, so that ``precision=16-mixed``
    keeps the section's other fields; any other value sets ``key`` itself."""
    written = _section_as_written(key, value)
    if written is value:
        return [(key, value)]
    return [(_join(key, name), v) for name, v in written.items()]


def _apply_dotted(tree: dict[str, Any], pairs: Sequence[tuple[str, Any]], bad: list[tuple[str, str]]) -> None:
    """Set each ``(dotted key, value)`` in ``tree``; problems are added to ``bad``."""
    for name in _section_types():
        # So that a dotted key can go inside it: ``precision: bf16-mixed``, ``precision.dtype=fp16``.
        if name in tree:
            tree[name] = _section_as_written(name, tree[name])
    for key, value in pairs:
        try:
            for dotted, v in _dotted_pairs(key, value):
                _set_dotted(tree, dotted, v)
        except ConfigError as exc:  # a section that is not a mapping: named once, not once per key set in it
            bad.extend(e for e in exc.errors if e[0] not in {path for path, _ in bad})


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``"dotted.key=value"`` applied (value parsed as YAML);
    ``precision=bf16-mixed`` sets ``precision.mode``."""
    tree = _plain(dict(data))
    bad: list[tuple[str, str]] = []
    _apply_dotted(tree, _parse_overrides(overrides, bad), bad)
    if bad:
        raise ConfigError(bad)
    return tree


# ---------------------------------------------------------------- keyword construction

KEYWORDS: dict[str, str] = {
    "precision": "precision",
    "max_steps": "train.steps",
    "steps": "train.steps",
    "accumulate": "train.microbatches",
    "accumulate_grad_batches": "train.microbatches",
    "clip": "train.clip_norm",
    "gradient_clip_val": "train.clip_norm",
    "lr": "optimizer.lr",
    "optimizer": "optimizer.name",
    "schedule": "schedule.name",
    "warmup_steps": "schedule.warmup_steps",
    "seed": "train.seed",
    "device": "device",
    "log_interval": "train.log_interval",
    "eval_interval": "train.eval_interval",
    "checkpoint_dir": "checkpoint.folder",
    "checkpoint_interval": "checkpoint.interval",
    "trace_file": "train.trace_file",
}
"""The flat keywords of :meth:`Config.from_kwargs` (and ``Trainer(**kw)``) and the field each
sets; ``max_steps``, ``accumulate_grad_batches`` and ``gradient_clip_val`` are Lightning's names."""

# Keywords that take a name only: an object belongs to Trainer.fit.
_NAME_ONLY = {
    "optimizer": ("an optimizer name ('adamw', 'adam', 'sgd')",
                  "a built torch.optim.Optimizer goes to Trainer.fit(..., optimizer=...)"),
    "schedule": ("a schedule name ('cosine', 'constant')",
                 "a torch learning-rate scheduler goes to Trainer.fit(..., scheduler=...)"),
}


def _not_a_config(value: Any) -> str:
    if hasattr(value, "forward") and hasattr(value, "parameters"):  # a model passed first by mistake
        return (f"got a model ({type(value).__name__}): the model goes to fit(model, train_data, val_data); "
                "the first argument is a torchimpl.Config, or leave it out and pass keywords")
    return (f"must be a torchimpl.Config, got {type(value).__name__}; build one with "
            "torchimpl.load_config('run.yaml') or Config.from_dict({...}), or pass keywords instead: "
            "Trainer(precision='bf16-mixed', max_steps=200)")


def _unknown_keyword(key: str) -> str:
    fields = [path for path in _flatten_paths(Config().to_dict()) if path.rsplit(".", 1)[-1] == key]
    if fields:
        return (f"not a keyword; set {' or '.join(fields)} with overrides={{{fields[0]!r}: ...}}")
    close = difflib.get_close_matches(key, [*KEYWORDS, "overrides"], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"unknown keyword{hint}; keywords: {', '.join(KEYWORDS)}, and overrides (dotted keys, "
            "e.g. overrides={'scaler.growth_interval': 100})")


def _flatten_paths(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        path = _join(prefix, key)
        out += _flatten_paths(value, path) if isinstance(value, Mapping) else [path]
    return out


def _keyword_pairs(kwargs: Mapping[str, Any], bad: list[tuple[str, str]]) -> list[tuple[str, Any, str]]:
    """``(dotted key, value, keyword)`` for each flat keyword; unknown ones are added to ``bad``."""
    out = []
    for key, value in kwargs.items():
        if key not in KEYWORDS:
            bad.append((key, _unknown_keyword(key)))
        elif key in _NAME_ONLY and not isinstance(value, str):
            what, fix = _NAME_ONLY[key]
            bad.append((key, f"takes {what}, got {type(value).__name__}; {fix}"))
        elif key == "precision" and isinstance(value, Mapping):
            out += [(f"precision.{k}", v, key) for k, v in value.items()]
        else:
            out += [(dotted, v, key) for dotted, v in _dotted_pairs(KEYWORDS[key], value)]
    return out


def _override_pairs(overrides: Any, bad: list[tuple[str, str]]) -> list[tuple[str, Any, str]]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        pairs = []
        for key, value in overrides.items():
            if not isinstance(key, str) or not key or any(not p for p in key.split(".")):
                bad.append(("overrides", f"keys must be dotted field names like 'train.steps', got {key!r}"))
            else:
                pairs.append((key, value))
    elif isinstance(overrides, Sequence) and not isinstance(overrides, str) and all(
            isinstance(o, str) for o in overrides):
        pairs = _parse_overrides(overrides, bad)
    else:
        bad.append(("overrides", "must be a mapping of dotted keys to values, e.g. {'scaler.growth_interval': "
                                 f"100}}, or a list of 'key=value' strings; got {overrides!r}"))
        return []
    return [(key, value, "overrides") for key, value in pairs]


def _from_kwargs(base: Config | None, kwargs: dict[str, Any]) -> Config:
    if base is not None and not isinstance(base, Config):
        raise ConfigError([("config", _not_a_config(base))])
    if not kwargs:
        return base if base is not None else Config()
    bad: list[tuple[str, str]] = []
    overrides = kwargs.pop("overrides", None)
    pairs = _keyword_pairs(kwargs, bad) + _override_pairs(overrides, bad)
    by_key: dict[str, str] = {}
    unique = []
    for key, value, source in pairs:
        if key in by_key:
            bad.append((source, f"sets {key}, which {by_key[key]} also sets; give it once"))
            continue
        by_key[key] = source
        unique.append((key, value))
    # The base's own section objects: a section no key goes into is kept as it is (a dotted key
    # opens its section into a mapping, see _set_dotted).
    tree = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)} if base is not None else {}
    _apply_dotted(tree, unique, bad)
    try:
        result = Config.from_dict(tree)
    except ConfigError as exc:
        # Name a bad value by the keyword it was given as: "max_steps (train.steps): ...".
        named = {key: source for key, source in by_key.items() if source != "overrides"}
        bad += [(f"{named[p]} ({p})" if p in named and named[p] != p else p, m) for p, m in exc.errors]
        raise ConfigError(bad) from None
    if bad:
        raise ConfigError(bad)
    return result


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    data: Mapping[str, Any] | None = None,
    *,
    task_defaults: bool = False,
) -> Config:
    """Defaults < ``path`` (YAML) or ``data`` < ``overrides``; raises :class:`ConfigError`.

    ``task_defaults``: lay the embedded task's own settings (``torchimpl.embedded``) under the
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
