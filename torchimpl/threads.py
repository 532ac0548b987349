"""torch's CPU thread count against the machine's cores and load, for ``ampspec doctor``.

torch starts one intra-op thread per core it sees. When other work already keeps those cores
busy, or torch sees more cores than the process may use, its threads wait for each other at
every operation, and a small model trains many times slower than with one thread. The advice
names the two ways to set the count: ``OMP_NUM_THREADS`` before the process starts, or
``torch.set_num_threads(n)`` at its top.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ThreadSituation", "current", "report_lines"]


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
    import torch

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
    # The doctor's own process counts about 1 in the load; the rest is other work.
    others = None if s.load is None else max(s.load - 1.0, 0.0)
    if s.threads > s.cores:
        lines.append(f"  more threads than cores: set OMP_NUM_THREADS={s.cores} (or torch.set_num_threads({s.cores}))")
    elif others is not None and others + s.threads > s.cores and s.threads > 1:
        free = max(int(s.cores - others), 1)
        lines.append(f"  the cores are busy (load {s.load:.1f} on {s.cores} cores, about {others:.1f} of it other "
                     f"work): torch's {s.threads} "
                     f"threads will wait for each other; for a small model set OMP_NUM_THREADS={free} before "
                     f"starting (or torch.set_num_threads({free})), and compare the ms/step")
    return lines
