"""The run folder and the metrics files in it: ``metrics.csv`` and TensorBoard scalars.

1. **The run folder** (:func:`planned_folder`, :func:`open_run_folder`), from ``logging.dir``:
   ``auto`` is ``checkpoint.folder`` when set (a resumed run continues its files), else a fresh
   ``ampspec-runs/version_N`` in the working directory, N the next free number as in
   Lightning's ``lightning_logs/version_N`` (``AMPSPEC_RUNS_DIR`` names another parent); a path
   is used as given; ``null`` writes no files. Only rank 0 writes.
2. **metrics.csv** (:class:`CsvMetrics`): the columns :data:`COLUMNS`, one row per optimizer
   step (applied or skipped), written at each log point: ``step`` is the record's 0-based index
   (as in the trace), ``loss`` the window's mean training loss, ``val_loss`` the validation loss
   on the row of the step after which an evaluation ran (empty elsewhere), ``lr`` the rate given
   to the optimizer, ``scale`` the loss scale after the step's update, ``grad_norm`` the total
   norm before clipping (empty without clipping), ``skipped`` 1 when that step was skipped, else
   0. Floats are written so that they read back exactly (``inf``/``nan`` for non-finite ones).
   On a resume the file is cut back to the checkpoint's step, as the trace is, so that a
   resumed run's file equals the uninterrupted run's.
3. **TensorBoard** (:class:`TensorBoardMetrics`): the same values as scalars ``loss``,
   ``val_loss``, ``lr``, ``scale`` and ``grad_norm`` at global step ``step``, through
   ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package:
   ``pip install 'ampspec[tensorboard]'``); a resume purges the events from its step on.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Iterable, Protocol

from torchimpl.run.records import StepRecord
from torchimpl.safe_files import open_run_file, refuse_link, replace_text, writing

__all__ = ["COLUMNS", "CsvMetrics", "MetricsSink", "RUNS_ENV", "TensorBoardMetrics", "check_tensorboard", "open_metrics",
           "open_run_folder", "planned_folder", "read_metrics", "rows_for", "runs_root", "tensorboard_available",
           "wants_files"]

COLUMNS: tuple[str, ...] = ("step", "loss", "val_loss", "lr", "scale", "grad_norm", "skipped")
"""metrics.csv's columns, in order (rule 2)."""

RUNS_ENV = "AMPSPEC_RUNS_DIR"
"""Environment variable naming the parent of the ``version_N`` folders (default ``ampspec-runs``)."""

CSV_NAME = "metrics.csv"
_TB_SCALARS = ("loss", "val_loss", "lr", "scale", "grad_norm")
_INSTALL = "pip install 'ampspec[tensorboard]'"


# ---------------------------------------------------------------- 1. the run folder


def runs_root() -> Path:
    """The parent of fresh ``version_N`` folders."""
    return Path(os.environ.get(RUNS_ENV) or "ampspec-runs")


def planned_folder(config: Any) -> tuple[Path | None, str]:
    """The folder the run's files go in, or the one a fresh ``version_N`` will be made in, and
    the field it comes from (for error messages): ``(None, ...)`` when no files are written."""
    d = config.logging.dir
    if d is None:
        return None, "logging.dir"
    if d != "auto":
        return Path(d), "logging.dir"
    if config.checkpoint.folder is not None:
        return Path(config.checkpoint.folder), "checkpoint.folder (logging.dir: auto)"
    return runs_root(), f"logging.dir: auto ({RUNS_ENV} or ./ampspec-runs)"


def _fresh_version(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name[8:]) for p in root.glob("version_*") if p.name[8:].isdigit()]
    n = max(taken, default=-1) + 1
    while True:  # another run may take the same number between the listing and the mkdir
        folder = root / f"version_{n}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            n += 1


def open_run_folder(config: Any) -> Path | None:
    """Rule 1: the run folder, created (a fresh ``version_N`` under ``auto`` without a
    checkpoint folder); None when ``logging.dir`` is null or no metrics file is wanted."""
    folder, _ = planned_folder(config)
    if folder is None or not wants_files(config):
        return None
    if config.logging.dir == "auto" and config.checkpoint.folder is None:
        return _fresh_version(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def wants_files(config: Any) -> bool:
    """Whether the run writes anything in its run folder (``precision_stats.csv`` counts)."""
    lg = config.logging
    return (lg.csv or lg.tensorboard is True or (lg.tensorboard is None and tensorboard_available())
            or bool(lg.precision_stats))


# ---------------------------------------------------------------- rows


def rows_for(records: Iterable[StepRecord], losses: Iterable[float], val_loss: float | None = None) -> list[dict]:
    """One row of :data:`COLUMNS` per record; ``val_loss`` goes on the last row."""
    rows = [{"step": r.step, "loss": loss, "val_loss": None, "lr": r.lr, "scale": r.scale_after,
             "grad_norm": r.grad_norm, "skipped": 0 if r.applied else 1} for r, loss in zip(records, losses)]
    if rows and val_loss is not None:
        rows[-1]["val_loss"] = val_loss
    return rows


class MetricsSink(Protocol):
    """Where rows go: written at each log point, closed when the run ends."""

    def write(self, rows: list[dict]) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- 2. metrics.csv


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)  # repr round-trips a float


class CsvMetrics:
    """Rule 2: ``metrics.csv`` in ``folder``; ``resume_at`` continues a resumed run's file."""

    def __init__(self, folder: str | Path, *, resume_at: int | None = None):
        self.path = Path(folder) / CSV_NAME
        self.kept = _truncate_csv(self.path, resume_at) if resume_at is not None else 0
        fresh = resume_at is None or not self.path.exists() or self.path.stat().st_size == 0
        self._file: Any = open_run_file(self.path, "w" if fresh else "a", what="metrics file")
        if fresh:
            self._file.write(",".join(COLUMNS) + "\n")
            self._file.flush()

    def write(self, rows: list[dict]) -> None:
        if self._file is None:
            raise ValueError(f"metrics file {self.path} is closed")
        with writing(self.path, "metrics file"):
            self._file.write("".join(",".join(_cell(row[c]) for c in COLUMNS) + "\n" for row in rows))
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _truncate_csv(path: Path, resume_at: int) -> int:
    """Keep the column line and the leading rows with ``step < resume_at``; how many rows were
    kept. A file with other columns, or none, starts afresh (0 rows)."""
    if not path.exists() and not path.is_symlink():
        return 0
    refuse_link(path, "metrics file")
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept: list[str] = []
    if lines and lines[0].rstrip("\n") == ",".join(COLUMNS):
        kept.append(lines[0])
        for line in lines[1:]:
            if not line.endswith("\n"):
                break  # a torn last line
            step = line.split(",", 1)[0]
            if not step.isdigit() or int(step) >= resume_at or int(step) != len(kept) - 1:
                break
            kept.append(line)
    replace_text(path, "".join(kept), what="metrics file")
    return max(len(kept) - 1, 0)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.csv``, typed: ints for ``step`` and ``skipped``, floats or None."""
    out = []
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            out.append({c: (int(v) if c in ("step", "skipped") else float(v)) if v != "" else None
                        for c, v in row.items()})
    return out


# ---------------------------------------------------------------- 3. TensorBoard


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` imports (it needs the tensorboard package)."""
    return _summary_writer_class() is not None


def _summary_writer_class() -> Any:
    try:
        # optional dependency: only with logging.tensorboard
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


def check_tensorboard(config: Any) -> None:
    """``logging.tensorboard: true`` without the package: ``ValueError`` naming the install."""
    if config.logging.tensorboard is True and config.logging.dir is not None and not tensorboard_available():
        raise ValueError(f"logging.tensorboard: true, but the tensorboard package is not installed; "
                         f"{_INSTALL}, or set logging.tensorboard=null (TensorBoard only when installed)")


class TensorBoardMetrics:
    """Rule 3: scalars through ``SummaryWriter`` in ``folder``; ``purge_step`` (a resume's step)
    hides the events a killed run wrote from that step on."""

    def __init__(self, folder: str | Path, *, purge_step: int | None = None):
        writer_class = _summary_writer_class()
        if writer_class is None:
            raise ValueError(f"TensorBoard logging needs the tensorboard package: {_INSTALL}")
        self.folder = Path(folder)
        self._writer: Any = writer_class(log_dir=str(self.folder), purge_step=purge_step)

    def write(self, rows: list[dict]) -> None:
        if self._writer is None:
            raise ValueError(f"TensorBoard writer for {self.folder} is closed")
        for row in rows:
            for name in _TB_SCALARS:
                if row[name] is not None:
                    self._writer.add_scalar(name, row[name], global_step=row["step"])
        self._writer.flush()  # a killed run still shows up to its last log point

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def open_metrics(config: Any, folder: Path | None, *, resume_at: int | None) -> list[MetricsSink]:
    """The sinks ``config.logging`` asks for in ``folder`` (none when it is None)."""
    if folder is None:
        return []
    lg, sinks = config.logging, []
    if lg.csv:
        sinks.append(CsvMetrics(folder, resume_at=resume_at))
    if lg.tensorboard is True or (lg.tensorboard is None and tensorboard_available()):
        sinks.append(TensorBoardMetrics(folder, purge_step=resume_at))
    return sinks
