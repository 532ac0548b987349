"""The per-step record of a training run, and its JSON Lines file.

One :class:`StepRecord` per optimizer step (applied or skipped), with exactly the fields the
specification's step contract names, so that a recorded run can be replayed by the reference
from its ``found_inf`` bits. Floats are Python floats (a non-finite ``grad_norm`` is written as
JSON's ``Infinity``/``NaN`` extension, which Python's ``json`` reads back).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any, Iterable

import torch

__all__ = ["FIELDS", "PendingRecords", "StepRecord", "TraceWriter", "read_trace", "write_trace"]


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
_TYPES = {"step": int, "microbatches": int, "found_inf": bool, "applied": bool, "growth_tracker": int}
_OPTIONAL = frozenset({"grad_norm", "clip_coef"})


def _convert(name: str, value: Any) -> Any:
    if value is None and name in _OPTIONAL:
        return None
    return _TYPES.get(name, float)(value)


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
        rows, self._rows = _read_all(self._rows), []
        records, losses = [], []
        for row in rows:
            # The mean loss of the window: its float32 sum over its size, one float32 division.
            losses.append(_mean_f32(row.pop("loss_sum"), row["microbatches"]))
            # Device values arrive as floats (or ints): the two fields of other types, by name.
            found = row["found_inf"] = bool(row["found_inf"])
            row["growth_tracker"] = int(row["growth_tracker"])
            if row["applied"] is None:
                row["applied"] = not found
            records.append(StepRecord(**row))
        return records, losses


def _read_all(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with every tensor replaced by its value as a Python number, in one transfer.

    Every tensor in ``rows`` is a 0-d record value on the run's device. They are stacked by
    dtype; several stacks are widened to float64 (exact for every dtype a record holds) and
    concatenated, so that one ``tolist`` reads them all. Other values pass through.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for row in rows:
        for v in row.values():
            if isinstance(v, torch.Tensor):
                by_dtype.setdefault(v.dtype, []).append(v)
    if not by_dtype:
        return [dict(row) for row in rows]
    stacks = [torch.stack(ts) for ts in by_dtype.values()]
    flat = (stacks[0] if len(stacks) == 1 else torch.cat([t.to(torch.float64) for t in stacks])).tolist()
    read, start = {}, 0
    for dtype, ts in by_dtype.items():
        read[dtype] = iter(flat[start:start + len(ts)])
        start += len(ts)
    return [{k: next(read[v.dtype]) if isinstance(v, torch.Tensor) else v for k, v in row.items()} for row in rows]


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

    ``resume_at``: continue a trace whose run resumes before step ``resume_at``. The file keeps
    its records of steps ``0 .. resume_at - 1`` and loses any later ones (written after the
    checkpoint by a run that was then killed), so that the trace of a resumed run equals the
    uninterrupted run's; a torn last line (a kill inside a write) goes too. The file is
    rewritten atomically. Without ``resume_at`` the file starts empty.
    """

    def __init__(self, path: str | Path, *, resume_at: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.kept = 0
        if resume_at is not None:
            self.kept = _truncate_trace(self.path, resume_at)
        self._file: IO[str] | None = open(self.path, "a" if resume_at is not None else "w", encoding="utf-8")

    def write(self, records: Iterable[StepRecord]) -> None:
        if self._file is None:
            raise ValueError(f"trace file {self.path} is closed")
        for record in records:
            self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _truncate_trace(path: Path, resume_at: int) -> int:
    """Keep the leading records of ``path`` with ``step < resume_at``; how many were kept."""
    if not path.exists():
        return 0
    kept: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                break  # a torn line: nothing after it was written by a finished flush
            if not isinstance(step, int) or step >= resume_at or step != len(kept):
                break
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return len(kept)


def write_trace(path: str | Path, records: Iterable[StepRecord]) -> None:
    with TraceWriter(path) as w:
        w.write(records)


def read_trace(path: str | Path) -> list[StepRecord]:
    """Records of a JSON Lines trace; a bad line raises ``ValueError`` naming its line number."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(StepRecord.from_dict(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: not a step record ({exc})") from None
    return out
