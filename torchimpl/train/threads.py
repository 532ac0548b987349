"""torch's CPU thread count against the machine's cores and load, for ``ampspec doctor`` and
the warning of ``ampspec train`` and ``ampspec compare``; ``train.threads`` for a run.

torch starts one intra-op thread per core it sees. When other work already keeps those cores
busy, or torch sees more cores than the process may use, its threads wait for each other at
every operation, and a small model trains many times slower than with one thread. The advice
names the two ways to set the count: ``OMP_NUM_THREADS`` before the process starts, or
``torch.set_num_threads(n)`` at its top.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["ThreadSituation", "busy_warning", "current", "report_lines", "run_threads"]


@dataclass(frozen=True)
class ThreadSituation:
    threads: int
    """``torch.get_num_threads()``."""
    cores: int
    """Cores this process may run on (its CPU affinity), else ``os.cpu_count()``."""
    load: float | None
    """The 1-minute load average (``None`` where the platform has none)."""
    omp_env: str | None
    """``OMP_NUM_THREADS`` as set in the environment."""


def current() -> ThreadSituation:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return ThreadSituation(torch.get_num_threads(), cores, load, os.environ.get("OMP_NUM_THREADS"))


def report_lines(s: ThreadSituation) -> list[str]:
    """The doctor's lines: the figures, then advice when the thread count does not fit."""
    load = "unknown" if s.load is None else f"{s.load:.2f}"
    env = f"OMP_NUM_THREADS={s.omp_env}" if s.omp_env is not None else "OMP_NUM_THREADS unset"
    lines = [f"threads: torch uses {s.threads} on {s.cores} usable cores; load average (1 min) {load}; {env}"]
    if s.threads > s.cores:
        lines.append(f"  more threads than cores: set OMP_NUM_THREADS={s.cores} (or torch.set_num_threads({s.cores}))")
    elif _busy(s) is not None:
        free, others = _busy(s)
        lines.append(f"  the cores are busy (load {s.load:.1f} on {s.cores} cores, about {others:.1f} of it other "
                     f"work): torch's {s.threads} "
                     f"threads will wait for each other; for a small model set OMP_NUM_THREADS={free} before "
                     f"starting (or torch.set_num_threads({free})), and compare the ms/step")
    return lines


def _busy(s: ThreadSituation) -> tuple[int, float] | None:
    """The doctor's rule: (the threads that fit, the load of other work) when other work and
    torch's threads together want more than the cores, else None. The process measuring counts
    about 1 in the load; the rest is other work."""
    others = None if s.load is None else max(s.load - 1.0, 0.0)
    if others is None or others + s.threads <= s.cores or s.threads <= 1:
        return None
    return max(int(s.cores - others), 1), others


def busy_warning(s: ThreadSituation, command: str, threads_setting: int | None) -> str | None:
    """The one warning ``train`` and ``compare`` give when torch runs at its default thread
    count (no ``OMP_NUM_THREADS``, no ``train.threads``) on cores that other work keeps busy,
    where a small model trains many times slower; None otherwise."""
    if s.omp_env is not None or threads_setting is not None or _busy(s) is None:
        return None
    free, others = _busy(s)
    fix = f"set OMP_NUM_THREADS={free} before starting"
    if command == "train":
        fix = f"pass --set train.threads={free} (or {fix})"
    return (f"the cores are busy (load {s.load:.1f} on {s.cores} cores, about {others:.1f} of it other work) and "
            f"torch runs {s.threads} threads, its default: they will wait for each other and a small model can "
            f"train many times slower; {fix}")


@contextlib.contextmanager
def run_threads(threads: int | None) -> Iterator[None]:
    """``train.threads``: torch's intra-op thread count for the run (``torch.set_num_threads``),
    the previous count restored after it; None leaves torch's own."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
