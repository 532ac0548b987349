"""The per-step record of a training run, and its JSON Lines file.

One :class:`StepRecord` per optimizer step (applied or skipped), with exactly the fields the
specification's step contract names, so that a recorded run can be replayed by the reference
from its ``found_inf`` bits. Floats are Python floats (a non-finite ``grad_norm`` is written as
JSON's ``Infinity``/``NaN`` extension, which Python's ``json`` reads back).

The trace file (JSON Lines):

1. its first line is a header, ``{"ampspec_trace": 1, "use_scaler": ..., "scaler": {...},
   "settings": {...}}``: whether a loss scaler ran, its resolved policy (every field of
   ``torchimpl.train.scaler.ResolvedScalerConfig``, what ``ampspec replay`` needs) and the run's
   settings (microbatches, clip norm, precision mode, optimizer kind, versions). Traces written
   before the header existed start with a record, and still read;
2. then one line per step: the record's fields, then the metrics that are no part of the step
   contract (:data:`METRIC_KEYS`): ``loss``, the window's mean training loss, and ``val_loss``
   on the line of the step after which an evaluation ran. :func:`read_trace` returns the
   records alone, :func:`read_trace_metrics` the metrics and :func:`read_trace_header` the header.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

import torch

from torchimpl.safe_files import open_run_file, refuse_link, replace_text, writing

__all__ = ["FIELDS", "HEADER_KEY", "METRIC_KEYS", "PendingRecords", "StepRecord", "TraceWriter", "check_step_order",
           "read_numbered_trace", "read_trace", "read_trace_header", "read_trace_metrics", "write_trace"]


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step did."""

    step: int
    """0-based index of this optimizer step, counting skipped steps."""
    microbatches: int
    """Microbatches accumulated into this step (the last window of a run can be shorter)."""
    scale_before: float
    """Loss scale used for every microbatch of this step (1.0 without a scaler)."""
    found_inf: bool
    """Whether any gradient was inf or NaN, checked on the scaled gradients."""
    applied: bool
    """Whether the optimizer update was applied (``not found_inf``)."""
    grad_norm: float | None
    """Total L2 norm of the unscaled gradients before clipping; ``None`` when not clipping."""
    clip_coef: float | None
    """Factor the gradients were multiplied by (at most 1.0); ``None`` when not clipping."""
    scale_after: float
    """Loss scale after this step's update."""
    growth_tracker: int
    """Consecutive clean steps since the last scale change, after the update."""
    lr: float
    """Learning rate given to the optimizer for this step."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def _trusted(cls, values: Iterable[Any]) -> StepRecord:
        """A record from its fields' values in ``FIELDS`` order, already of their types (the flush's
        own): the frozen ``__init__``'s assignment per field, which costs more than the rest of
        reading a record, skipped."""
        record = object.__new__(cls)
        vars(record).update(zip(FIELDS, values))
        return record

    @classmethod
    def from_dict(cls, obj: dict) -> StepRecord:
        missing = [f for f in FIELDS if f not in obj]
        extra = [k for k in obj if k not in FIELDS]
        if missing or extra:
            raise ValueError(f"step record fields differ: missing {missing}, unexpected {extra}")
        return cls(**{name: _convert(name, obj[name]) for name in FIELDS})

    def same_as(self, other: StepRecord) -> bool:
        """Field-wise equality in which NaN equals NaN."""
        for name in FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
                continue
            if a != b:
                return False
        return True


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepRecord))
"""The record's field names, in order: the one list that the trace, the flush and the
conformance suite (against ``reference.step.StepRecord``) read."""

# How a value read from JSON or from the device becomes a field's type, by field name; floats
# are the default and None stays None where the field allows it.
HEADER_KEY = "ampspec_trace"
"""The key that marks a trace's header line; its value is the header's format (1)."""

METRIC_KEYS: tuple[str, ...] = ("loss", "val_loss")
"""Keys a trace line may carry after the record's fields: metrics, not the step contract."""

_TYPES = {"step": int, "microbatches": int, "found_inf": bool, "applied": bool, "growth_tracker": int}
_OPTIONAL = frozenset({"grad_norm", "clip_coef"})


def _convert(name: str, value: Any) -> Any:
    """``value`` as field ``name``'s type; ``ValueError`` naming the field when JSON gave another
    type (a string ``"no"`` is not false, a string ``"NaN"`` not a number)."""
    if value is None and name in _OPTIONAL:
        return None
    kind = _TYPES.get(name, float)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        what = {bool: "true or false", int: "an integer"}.get(kind, "a number")
        raise ValueError(f"field {name!r} must be {what}{' or null' if name in _OPTIONAL else ''}, got {value!r}")
    return kind(value)


class PendingRecords:
    """Step records not yet read from the device, read in one transfer at a log point.

    ``add`` takes every field by name (device tensors or host numbers) and the window's float32
    loss sum; ``applied`` may be ``None`` where only the device knows it (the kernel skipped on
    ``found_inf``), and is then ``not found_inf``. ``read`` returns the records and each step's
    mean loss, and empties the list.
    """

    def __init__(self) -> None:
        self._rows: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, loss_sum: Any, **values: Any) -> None:
        values["loss_sum"] = loss_sum
        self._rows.append(values)

    def read(self) -> tuple[list[StepRecord], list[float]]:
        rows, self._rows = self._rows, []
        if not rows:
            return [], []
        columns = _read_all(_columns(rows))
        # The mean loss of each window: its float32 sum over its size, one float32 division.
        losses = list(map(_mean_f32, columns.pop("loss_sum"), columns["microbatches"]))
        if columns.keys() != _FIELD_SET:
            raise TypeError(f"step record fields differ: missing {sorted(_FIELD_SET - columns.keys())}, "
                            f"unexpected {sorted(columns.keys() - _FIELD_SET)}")
        # Device values arrive as floats (or ints): the two fields of other types, by name.
        found = columns["found_inf"] = [bool(x) for x in columns["found_inf"]]
        columns["growth_tracker"] = [int(x) for x in columns["growth_tracker"]]
        columns["applied"] = [not f if a is None else a for a, f in zip(columns["applied"], found)]
        return [StepRecord._trusted(values) for values in zip(*[columns[name] for name in FIELDS])], losses


_FIELD_SET = frozenset(FIELDS)
_HOST_TYPES = frozenset({float, int, bool, type(None)})


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """``rows`` (each with the same keys) as one list of values per key, in the rows' order."""
    keys = tuple(rows[0])
    if all(map(keys.__eq__, map(tuple, rows))):  # one call site's keywords: one order, read in C
        return dict(zip(keys, map(list, zip(*[row.values() for row in rows]))))
    try:
        # Equal lengths and every key found: the same keys in other orders, read by name.
        if all(len(row) == len(keys) for row in rows):
            return {key: [row[key] for row in rows] for key in keys}
    except KeyError:
        pass
    raise TypeError(f"step records of one flush differ in their fields: {sorted(keys)} and "
                    f"{[sorted(row) for row in rows if sorted(row) != sorted(keys)][0]}")


def _read_all(columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``columns`` with every tensor replaced by its value as a Python number, in one transfer.

    Every tensor in ``columns`` is a 0-d record value on the run's device. They are stacked by
    dtype; several stacks are widened to float64 (exact for every dtype a record holds) and
    concatenated, so that one ``tolist`` reads them all. Other values pass through; so does a
    column without a tensor (most are host numbers), untouched.
    """
    tensor, host = torch.Tensor, _HOST_TYPES
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    at: dict[str, list[int]] = {}
    for key, column in columns.items():
        # Most columns hold host numbers only, told by their types' set (built in C); a column
        # with another type is scanned value by value. A host number is told by its exact type
        # first: isinstance(x, torch.Tensor) is slow for anything that is not a tensor (its
        # metaclass's instance check).
        if host.issuperset(map(type, column)):
            continue
        where = [i for i, v in enumerate(column) if type(v) not in host and isinstance(v, tensor)]
        if where:
            at[key] = where
            for i in where:
                by_dtype.setdefault(column[i].dtype, []).append(column[i])
    if not by_dtype:
        return columns
    if len(by_dtype) == 1:  # the common case: one dtype, read in the order collected
        (tensors,) = by_dtype.values()
        values = iter(torch.stack(tensors).tolist())
        out = dict(columns)
        for key, where in at.items():
            column = out[key] = list(columns[key])
            for i in where:
                column[i] = next(values)
        return out
    stacks = [torch.stack(ts) for ts in by_dtype.values()]
    flat = torch.cat([t.to(torch.float64) for t in stacks]).tolist()
    read, start = {}, 0
    for dtype, ts in by_dtype.items():
        read[dtype] = iter(flat[start:start + len(ts)])
        start += len(ts)
    out = dict(columns)
    for key, where in at.items():
        column = out[key] = list(columns[key])
        for i in where:
            column[i] = next(read[column[i].dtype])
    return out


_F32 = struct.Struct("f")


def _mean_f32(total: float, k: int) -> float:
    """``total / k`` as one float32 division, for a float32 ``total`` and an int ``k < 2**24``.

    Both are exact in float64, so the float64 quotient rounded to float32 is the correctly
    rounded float32 quotient: double rounding is innocuous for a division when the wider
    format has at least 2 * 24 + 2 significand bits (Figueroa, 1995), and float64 has 53.
    ``struct``'s "f" rounds to nearest even; inf and NaN pass through.
    """
    return _F32.unpack(_F32.pack(total / k))[0]


class TraceWriter:
    """Appends records to a JSON Lines file, one line per record, flushed after each write.

    ``header``: the mapping written as the file's first line (see the module docstring); a
    resumed file keeps the header it has. ``resume_at``: continue a trace whose run resumes
    before step ``resume_at``. The file keeps its header and its records of steps
    ``0 .. resume_at - 1`` and loses any later ones (written after the checkpoint by a run that
    was then killed), so that the trace of a resumed run equals the uninterrupted run's; a torn
    last line (a kill inside a write) goes too. The file is rewritten atomically. Without
    ``resume_at`` the file starts empty.
    """

    def __init__(self, path: str | Path, *, resume_at: int | None = None, header: dict[str, Any] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.kept = 0
        self.kept_header: dict[str, Any] | None = None
        """The header the resumed file already had (None for a fresh file or an old trace)."""
        if resume_at is not None:
            self.kept, self.kept_header = _truncate_trace(self.path, resume_at)
        self._file: IO[str] | None = open_run_file(self.path, "a" if resume_at is not None else "w",
                                                    what="trace file")
        if header is not None and self.kept_header is None and self.kept == 0:
            with writing(self.path, "trace file"):
                self._file.write(json.dumps({HEADER_KEY: 1, **header}) + "\n")
                self._file.flush()

    def write(self, records: Iterable[StepRecord], metrics: Iterable[dict[str, Any]] | None = None) -> None:
        """One line per record; ``metrics``, one mapping per record, adds its keys (of
        :data:`METRIC_KEYS`) to the record's line."""
        if self._file is None:
            raise ValueError(f"trace file {self.path} is closed")
        records = list(records)
        extras = list(metrics) if metrics is not None else [{}] * len(records)
        if len(extras) != len(records):
            raise ValueError(f"metrics: {len(extras)} mappings for {len(records)} records; give one per record")
        lines = []
        for record, extra in zip(records, extras):
            unknown = [k for k in extra if k not in METRIC_KEYS]
            if unknown:
                raise ValueError(f"metrics: unknown keys {unknown}; a trace line may add only {list(METRIC_KEYS)}")
            lines.append(json.dumps({**asdict(record), **extra}) + "\n")
        with writing(self.path, "trace file"):  # a torn line is cut on the resume
            self._file.write("".join(lines))
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_header(obj: Any) -> bool:
    return isinstance(obj, dict) and HEADER_KEY in obj


def _truncate_trace(path: Path, resume_at: int) -> tuple[int, dict[str, Any] | None]:
    """Keep the header and the leading records of ``path`` with ``step < resume_at``; how many
    records were kept, and the header (None when the file has none)."""
    if not path.exists() and not path.is_symlink():
        return 0, None
    refuse_link(path, "trace file")
    kept: list[str] = []
    header, records = None, 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f):
            try:
                obj = json.loads(line)
                if number == 0 and _is_header(obj):
                    header = obj
                    kept.append(line if line.endswith("\n") else line + "\n")
                    continue
                step = obj["step"]
            except (ValueError, KeyError, TypeError, RecursionError):
                break  # a torn line: nothing after it was written by a finished flush
            if not isinstance(step, int) or step >= resume_at or step != records:
                break
            kept.append(line if line.endswith("\n") else line + "\n")
            records += 1
    replace_text(path, "".join(kept), what="trace file")
    return records, header


def write_trace(path: str | Path, records: Iterable[StepRecord], header: dict[str, Any] | None = None) -> None:
    with TraceWriter(path, header=header) as w:
        w.write(records)


def _trace_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every step line of a trace (the header and blank lines
    skipped); a line that is not JSON raises ``ValueError`` naming its number."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{number}: not UTF-8 text (not a trace written by ampspec)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except RecursionError:
                raise ValueError(f"{path}:{number}: not a step record (nested too deeply)") from None
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a step record ({exc})") from None
            if number == 1 and _is_header(obj):
                continue
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{number}: not a step record (a JSON {type(obj).__name__})")
            yield number, obj


def read_trace(path: str | Path) -> list[StepRecord]:
    """Records of a JSON Lines trace, without the header and the metrics; a bad line raises
    ``ValueError`` naming its line number (and the field)."""
    return [record for _, record in read_numbered_trace(path)]


def read_numbered_trace(path: str | Path) -> list[tuple[int, StepRecord]]:
    """``(line number, record)`` for every step line of a trace (see :func:`read_trace`)."""
    out = []
    for number, obj in _trace_lines(path):
        try:
            out.append((number, StepRecord.from_dict({k: v for k, v in obj.items() if k not in METRIC_KEYS})))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path}:{number}: not a step record ({exc})") from None
    return out


def check_step_order(path: str | Path, numbered: list[tuple[int, StepRecord]]) -> None:
    """The records are steps ``first, first + 1, ...`` in order; ``ValueError`` naming the
    duplicate or the out-of-order step and its lines otherwise (a replay would report it as
    the specification's divergence)."""
    seen: dict[int, int] = {}
    for i, (number, record) in enumerate(numbered):
        if record.step in seen:
            raise ValueError(f"{path}:{number}: the trace has a duplicate step {record.step} (first on line "
                             f"{seen[record.step]}); it is not one run's trace: nothing was replayed")
        if i and record.step != numbered[i - 1][1].step + 1:
            prev_line, prev = numbered[i - 1]
            raise ValueError(f"{path}:{number}: the trace is out of order: step {record.step} follows step "
                             f"{prev.step} (line {prev_line}); nothing was replayed")
        seen[record.step] = number


def read_trace_metrics(path: str | Path) -> list[dict[str, Any]]:
    """One ``{"step", "loss", "val_loss"}`` per step line of a trace (``None`` for a metric the
    line lacks: ``val_loss`` without an evaluation, both in a trace written before they were)."""
    out = []
    for number, obj in _trace_lines(path):
        if not isinstance(obj.get("step"), int):
            raise ValueError(f"{path}:{number}: not a step record (no integer 'step')")
        out.append({"step": obj["step"], **{k: obj.get(k) for k in METRIC_KEYS}})
    return out


def read_trace_header(path: str | Path) -> dict[str, Any] | None:
    """The trace's header (see the module docstring), or ``None`` for a trace without one."""
    with open(path, "rb") as f:
        first = f.readline(1 << 20)
    try:
        obj = json.loads(first.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if not _is_header(obj):
        return None
    if obj[HEADER_KEY] != 1:
        raise ValueError(f"{path}: trace header format {obj[HEADER_KEY]!r} is newer than this ampspec reads (1); "
                         "upgrade ampspec")
    return obj
