"""A group of spawned ranks on one gloo process group, kept up while a test module runs.

The multi-rank tests (``conformance/test_distributed.py``, ``tests/test_ti_distributed.py``)
share it: starting processes and importing torch costs seconds, so one group serves many jobs.
``with rank_group(handler) as run:`` spawns ``world`` processes that join a gloo group on
127.0.0.1 and wait for payloads; ``run(payload)`` sends the payload to every rank, each calls
``handler(rank, payload)`` (a module-level function, so that it can be pickled), and returns the
results in rank order. An exception in a handler comes back as ``{"error": "Type: message",
"traceback": ...}`` (or fails the test with ``run(payload, check=True)``).

Every wait is bounded: a rank that does not answer within ``wait_s`` fails the test naming it;
idle workers exit after ``wait_s``; on exit the workers are asked to stop, joined with a
timeout, then terminated and, if need be, killed. No process outlives the block.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Iterator

import pytest

__all__ = ["rank_group"]

Handler = Callable[[int, Any], Any]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, handler: Handler, wait_s: float, timeout_s: float,
           inbox: Any, outbox: Any) -> None:
    import torch
    import torch.distributed as dist

    # The variables torchrun sets, so code under test sees a launched rank.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        while True:
            try:
                payload = inbox.get(timeout=wait_s)
            except queue.Empty:
                return
            if payload is None:
                return
            seq, payload = payload
            try:
                outbox.put((seq, rank, handler(rank, payload)))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # reported to the parent (torch's CheckpointException is one)
                where = traceback.format_exc(limit=-3)
                outbox.put((seq, rank, {"error": f"{type(exc).__name__}: {exc}", "traceback": where}))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def rank_group(handler: Handler, world: int = 2, *, wait_s: float = 90.0,
               timeout_s: float = 60.0) -> Iterator[Callable[..., list[Any]]]:
    """Spawn ``world`` ranks serving ``handler``; yield ``run(payload, check=False)``.

    ``wait_s`` bounds every wait for an answer (and a worker's idle wait); ``timeout_s`` is the
    process group's own collective timeout.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    inboxes = [ctx.Queue() for _ in range(world)]
    outbox = ctx.Queue()
    procs = [ctx.Process(target=_serve, args=(r, world, port, handler, wait_s, timeout_s, inboxes[r], outbox),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()

    sent = [0]

    def run(payload: Any, check: bool = False) -> list[Any]:
        # Numbered, so that a late answer to a run that already failed is not taken for this one's.
        sent[0] += 1
        seq = sent[0]
        for box in inboxes:
            box.put((seq, payload))
        got: dict[int, Any] = {}
        deadline = time.monotonic() + wait_s
        while len(got) < world:
            try:
                answer_seq, r, res = outbox.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(world)) - set(got))
                dead = [r for r in missing if not procs[r].is_alive()]
                if dead:  # a dead rank never answers: fail now, not after wait_s
                    pytest.fail(f"ranks {dead} exited (exit codes {[procs[r].exitcode for r in dead]}) "
                                "without answering; their stderr is in the captured output")
                if time.monotonic() > deadline:
                    pytest.fail(f"ranks {missing} did not answer within {wait_s:g} s "
                                f"(alive: {[p.is_alive() for p in procs]})")
                continue
            if answer_seq == seq:
                got[r] = res
        results = [got[r] for r in range(world)]
        if check:
            for r, res in enumerate(results):
                assert not (isinstance(res, dict) and "error" in res), (
                    f"rank {r} raised: {res['error']}\n{res['traceback']}")
        return results

    try:
        yield run
    finally:
        for box in inboxes:
            box.put(None)
        for p in procs:
            p.join(timeout=20)
        for stop in ("terminate", "kill"):
            for p in procs:
                if p.is_alive():
                    getattr(p, stop)()
                    p.join(timeout=5)
