"""A run folder belongs to one run: what ``ampspec train`` checks before it trains.

1. A fresh run (no ``--resume``) is refused when its folders hold another run's files: a
   checkpoint or a diagnosis report in ``checkpoint.folder``, ``metrics.csv``,
   ``precision_stats.csv`` or TensorBoard events in the run folder (``logging.dir``), a non-empty ``train.trace_file``. The message
   names the folder, the files, and the choices: ``--resume``, another folder, or ``--overwrite``
   (which removes those files first, so the folder never mixes two runs).
2. ``--resume`` continues the run in the folder: its files are its own. Without a checkpoint (a
   run killed before its first save) it starts afresh, with a warning, as a resume of that run.
3. ``train.trace_file`` naming an existing file that is not a trace (the configuration file, a
   checkpoint, anything else) is refused whatever the options: ampspec overwrites only its own files.
   So is a trace named as another of the run's files would be (``metrics.csv`` in the run
   folder, a checkpoint's name in the checkpoint folder), even before that file exists.
4. ``ampspec compare --out`` follows rule 1: a folder holding another comparison's report,
   plot or traces is refused unless ``--overwrite`` (which removes the old report and plot first,
   so an interrupted comparison never leaves the old report beside the new traces).
5. Nothing is changed by a refusal.
6. ``Trainer.fit`` applies rules 1-3 itself, under the run's locks (``torchimpl.run.lock``),
   so a run started from Python cannot overwrite another either: ``resume=`` (a checkpoint or
   ``"latest"``) continues the run in the folder, ``overwrite=True`` replaces it, and the
   messages name those arguments instead of the command line's options.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

from torchimpl.run.checkpoint import is_checkpoint_name, list_checkpoints
from torchimpl.run.lock import LOCK_NAME, fixed_log_folder, run_locks
from torchimpl.safe_files import refuse_link

PRECISION_STATS = "precision_stats.csv"
"""``logging.precision_stats``' file in the run folder (``torchimpl.train.precision_stats.FILE_NAME``)."""

__all__ = ["RunFolderError", "check_trace_target", "claim_compare_folder", "claim_run_folder", "claimed_run",
           "fixed_log_folder", "other_run_files"]


class RunFolderError(ValueError):
    """A folder that holds another run's files (rules 1-3)."""


def other_run_files(config: Any) -> tuple[list[Path], list[Path]]:
    """Rule 1: (checkpoints, the other run files) already in this run's folders."""
    ckpts: list[Path] = []
    others: list[Path] = []
    folder = config.checkpoint.folder
    if folder is not None and Path(folder).is_dir():
        ckpts = list_checkpoints(folder)
        others += sorted(Path(folder).glob("nonfinite-step*.json"))
    logs = fixed_log_folder(config)
    if logs is not None and logs.is_dir():
        others += [p for p in [logs / "metrics.csv", logs / PRECISION_STATS] if p.is_file()]
        others += sorted(logs.glob("events.out.tfevents.*"))
    trace = config.train.trace_file
    if trace is not None and Path(trace).is_file() and Path(trace).stat().st_size > 0:
        others.append(Path(trace))
    return ckpts, sorted(set(others))


def _is_trace(path: Path) -> bool:
    with open(path, "rb") as f:
        first = f.readline(1 << 16)
    try:
        obj = json.loads(first.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and ("ampspec_trace" in obj or "step" in obj)


def _own_name(config: Any, path: Path) -> str | None:
    """What ``path`` is among the run's other files by its name in its folders, or None."""
    where, name = path.resolve().parent, path.name
    ckpt, logs = config.checkpoint.folder, fixed_log_folder(config)
    in_ckpt = ckpt is not None and where == Path(ckpt).resolve()
    if in_ckpt and (is_checkpoint_name(name) or name.startswith((".tmp-", "nonfinite-step")) or name == LOCK_NAME):
        return "checkpoint.folder's checkpoints, reports and lock"
    in_logs = logs is not None and where == logs.resolve()
    if in_logs and (name in ("metrics.csv", PRECISION_STATS, LOCK_NAME) or name.startswith("events.out.tfevents.")):
        return "logging.dir's metrics files"
    return None


def check_trace_target(config: Any) -> None:
    """Rule 3, and the trace never takes the name of another of the run's files."""
    trace = config.train.trace_file
    if trace is None:
        return
    path = Path(trace)
    refuse_link(path, "train.trace_file:")
    if path.is_file() and path.stat().st_size > 0 and not _is_trace(path):
        raise RunFolderError(f"train.trace_file: {trace} exists and is not a trace (its first line is not a trace "
                             "header or step record); ampspec overwrites only its own files: choose another path")
    own = _own_name(config, path)
    if own is not None:
        raise RunFolderError(f"train.trace_file: {trace} is a name the run keeps for {own}; the two would write "
                             f"over each other: choose another name, such as {path.with_name('trace.jsonl')}")


def _listing(paths: list[Path]) -> str:
    names = [str(p) for p in paths[:4]]
    return ", ".join(names) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


_SPELLING = {"cli": ("--resume", "--overwrite", "--overwrite"),
             "api": ("fit(..., resume='latest')", "fit(..., overwrite=True)", "overwrite=True")}


def claim_run_folder(config: Any, *, resume: bool, overwrite: bool, caller: str = "cli") -> list[Path]:
    """Rules 1-3 before a run; with ``overwrite``, the other run's files removed (returned).
    ``caller`` (``cli`` or ``api``) chooses how the messages name the choices (rule 6)."""
    resume_how, overwrite_how, removed_how = _SPELLING[caller]
    check_trace_target(config)
    logs = fixed_log_folder(config)
    if logs is not None:
        refuse_link(logs / "metrics.csv", "metrics file")
        refuse_link(logs / PRECISION_STATS, "precision statistics file")
    ckpts, others = other_run_files(config)
    found = ckpts + others
    if resume or not found:
        return []
    where = config.checkpoint.folder or fixed_log_folder(config) or Path(config.train.trace_file).parent
    if not overwrite:
        raise RunFolderError(f"{where} holds another run's files ({_listing(found)}); a fresh run would "
                             f"overwrite them: continue that run with {resume_how}, "
                             "train into another folder (checkpoint.folder=..., logging.dir=..., "
                             f"train.trace_file=...), or pass {overwrite_how} to replace that run")
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    warnings.warn(f"{removed_how}: removed the previous run's files from {where}: {_listing(found)}", stacklevel=2)
    return found


def claimed_run(config: Any, *, resume: bool, overwrite: bool, is_main: bool) -> contextlib.ExitStack:
    """Rule 6 for ``Trainer.fit``: the run's locks taken and its folders claimed (by the main
    process alone), in a stack whose closing releases the locks."""
    if not is_main:
        return contextlib.ExitStack()
    locks = run_locks(config)
    try:
        claim_run_folder(config, resume=resume, overwrite=overwrite, caller="api")
    except BaseException:
        locks.close()
        raise
    return locks


def claim_compare_folder(out: str | Path, *, overwrite: bool) -> list[Path]:
    """Rule 4 before ``compare`` runs; with ``overwrite``, the old report and plot removed (returned)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} exists and is not a folder; choose another --out")
    found = sorted(p for pattern in ("report.json", "compare.png", "trace-*.jsonl") for p in out.glob(pattern))
    if not found:
        return []
    if not overwrite:
        raise RunFolderError(f"--out {out} holds another comparison ({_listing(found)}); choose another --out "
                             "folder, or pass --overwrite to replace it")
    removed = [p for p in found if p.name in ("report.json", "compare.png")]
    for path in removed:
        path.unlink()
    return removed
