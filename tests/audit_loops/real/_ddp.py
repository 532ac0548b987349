"""A world of several ranks on the CPU for the loops whose originals run under ``torchrun``.

``torchrun --nproc_per_node N train.py`` starts N copies of the script with ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE`` set, each joining one process group. Here the script's own
process is rank 0 (the one the audit instruments and reports on) and ranks 1.. are forked from
it before any model exists; the ranks join a ``gloo`` group through a file store in a fresh
folder. A forked rank runs the same training function and exits with its status; a rank that
failed fails the run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
from typing import Callable

import torch.distributed as dist


def _join(rank: int, world: int, store: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _rank(train: Callable[[int, int], None], rank: int, world: int, store: str) -> None:
    _join(rank, world, store)
    try:
        train(rank, world)
    finally:
        dist.destroy_process_group()


def launch(train: Callable[[int, int], None], world: int = 2) -> None:
    """``train(rank, world)`` on every rank: rank 0 here, the others in forked processes."""
    store = os.path.join(tempfile.mkdtemp(prefix="ampspec-ddp-"), "store")
    others = [mp.get_context("fork").Process(target=_rank, args=(train, r, world, store), daemon=True)
              for r in range(1, world)]
    for p in others:
        p.start()
    try:
        _rank(train, 0, world, store)
    except BaseException:
        for p in others:  # they would wait for rank 0 in their next collective
            p.terminate()
        raise
    finally:
        for p in others:
            p.join(timeout=120)
        shutil.rmtree(os.path.dirname(store), ignore_errors=True)
    failed = [r for r, p in enumerate(others, start=1) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"rank(s) {failed} of the process group failed (exit codes "
                           f"{[others[r - 1].exitcode for r in failed]})")
