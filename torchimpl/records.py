"""The per-step record of a training run, and its JSON Lines file.

One :class:`StepRecord` per optimizer step (applied or skipped), with exactly the fields the
specification's step contract names, so that a recorded run can be replayed by the reference
from its ``found_inf`` bits. Floats are Python floats (a non-finite ``grad_norm`` is written as
JSON's ``Infinity``/``NaN`` extension, which Python's ``json`` reads back).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Iterable

__all__ = ["FIELDS", "StepRecord", "TraceWriter", "read_trace", "write_trace"]


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
        return cls(
            step=int(obj["step"]),
            microbatches=int(obj["microbatches"]),
            scale_before=float(obj["scale_before"]),
            found_inf=bool(obj["found_inf"]),
            applied=bool(obj["applied"]),
            grad_norm=None if obj["grad_norm"] is None else float(obj["grad_norm"]),
            clip_coef=None if obj["clip_coef"] is None else float(obj["clip_coef"]),
            scale_after=float(obj["scale_after"]),
            growth_tracker=int(obj["growth_tracker"]),
            lr=float(obj["lr"]),
        )

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


class TraceWriter:
    """Appends records to a JSON Lines file, one line per record, flushed after each write."""

    def __init__(self, path: str | Path, *, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a" if append else "w", encoding="utf-8")

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
