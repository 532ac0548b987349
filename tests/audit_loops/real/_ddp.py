"""A world of several ranks on the CPU for the loops whose originals run under ``torchrun``.

``torchrun --nproc_per_node N train.py ARGS`` starts N copies of ``python train.py ARGS`` with
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` set, each joining one process group. `launch` does
the same from inside the script: started without ``RANK`` (as ``ampspec audit`` runs it), the
script's own process is rank 0, the one the audit instruments and reports on, and it starts
ranks 1.. as plain ``python`` processes of the same script and arguments with ``RANK`` set
(not audited: their report would be their own). The ranks join a ``gloo`` group through a
file store in a fresh folder. A rank that fails fails the run; when rank 0 fails, the others
are ended, as torchrun ends them.

(New processes rather than forks of rank 0: a process that has compiled with inductor holds
threads and compile workers that a fork would inherit half-copied.)
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch.distributed as dist

_STORE = "AMPSPEC_REAL_DDP_STORE"


def _run_rank(train: Callable[[int, int], None], rank: int, world: int, store: str) -> None:
    # A rank that never comes fails the run in two minutes, not torch's default thirty.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        train(rank, world)
    finally:
        dist.destroy_process_group()


def launch(train: Callable[[int, int], None], world: int = 2) -> None:
    """``train(rank, world)`` on every rank: here rank 0 (or the rank ``RANK`` names), the others
    in new processes of this script."""
    if "RANK" in os.environ and _STORE in os.environ:  # a rank this function started
        _run_rank(train, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ[_STORE])
        return
    folder = tempfile.mkdtemp(prefix="ampspec-ddp-")
    store = os.path.join(folder, "store")
    others = []
    try:
        for r in range(1, world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), **{_STORE: store})
            others.append(subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]], env=env))
        _run_rank(train, 0, world, store)
    except BaseException:
        for p in others:  # they would wait for rank 0 in their next collective
            p.kill()
        raise
    finally:
        codes = [p.wait(timeout=300) for p in others]
        shutil.rmtree(folder, ignore_errors=True)
    failed = {r: c for r, c in enumerate(codes, start=1) if c != 0}
    if failed:
        raise RuntimeError(f"rank(s) {sorted(failed)} of the process group failed (exit codes {failed})")
