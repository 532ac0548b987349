"""The numeric replay in a process of its own, fed through shared memory (Linux).

Why: the replay is NumPy arithmetic driven from Python. On a thread of the training process its
Python holds the interpreter lock between array loops, and the training waits for it; in a
worker process it runs on another core and the training only pays for copying its arrays.

How:

- The worker is forked when the audit starts (`ReplayProcess`), before the audited program has
  built a model, started threads or touched a GPU: the safest moment to fork, and the worker
  inherits the already imported specification at no cost. It ignores SIGINT (an interrupt is
  the program's to handle: the audit still collects what was replayed), runs torch on one
  thread (the replay calls torch's own square root, ``reference.optim`` rule 9) and exits when
  the audit finishes or the pipe to the program closes.
- The recorder copies each tensor straight into a *slab*: an anonymous shared-memory file
  (``memfd_create``) that both processes map. Its descriptor passes to the worker over the
  pipe, so no file is left behind whatever happens to either process, and its space is
  reserved when it is made (``posix_fallocate``): a memory limit is an error there, which
  sends the copies back to ordinary arrays, never a SIGBUS in the training.
- A step's arrays pickle as their places in the slabs (`SlabArray`): the job sent for a step is
  a few kilobytes, and the worker reads the arrays in place, read-only.
- A slab returns to the pool when the worker reports done the job that read it; at most
  ``jobs`` jobs are outstanding (the training waits when the replay falls behind), which bounds
  the memory. Step data that is never sent gives its slabs back when it is garbage.
"""

from __future__ import annotations

import ctypes
import gc
import math
import mmap
import multiprocessing as mp
import os
import pickle
import signal
import sys
import traceback
import warnings
import weakref
from multiprocessing import process as mp_process
from multiprocessing import reduction
from typing import TYPE_CHECKING, Any, Callable

import ml_dtypes
import numpy as np
import torch

from audit import _torch_compat  # noqa: F401  (checks the private torch names the audit uses)

if TYPE_CHECKING:  # the replay imports this module: its type only
    from audit.replay import Replayer

__all__ = ["available", "ReplayProcess", "SlabArray"]

_ALIGN = 64
_MIN_SLAB = 1 << 20
_NUMPY = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
          torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
          torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32), torch.int16: np.dtype(np.int16),
          torch.int8: np.dtype(np.int8), torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_)}


def available() -> bool:
    """Whether this platform has what the worker needs: fork, memfd_create, posix_fallocate."""
    return (sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(os, "posix_fallocate")
            and "fork" in mp.get_all_start_methods())


# ---------------------------------------------------------------------------------- arrays in slabs


class SlabArray(np.ndarray):
    """An array whose memory lies in a slab: it pickles as ``(slab, offset, dtype, shape)``.

    Only the array the pool made carries its place; views and results of arithmetic on it are
    ordinary arrays to pickle.
    """

    place: tuple | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self.place = None

    def __reduce_ex__(self, protocol: int) -> Any:
        if self.place is None:
            return np.asarray(self).__reduce_ex__(protocol)
        return (_attach, self.place)


_WORKER_SLABS: dict[int, mmap.mmap] = {}  # in the worker process only: the slabs it has mapped
# In the worker only: its views, by place. A slab comes back filled at the same places every step,
# so a step's hundred-odd arrays are found here instead of made (a few microseconds each). A view
# is a window on the slab, whatever step filled it: sharing one across steps changes nothing.
_WORKER_VIEWS: dict[tuple[int, int, np.dtype, tuple[int, ...]], np.ndarray] = {}
_VIEWS_KEPT = 1 << 14


def _attach(slab: int, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The worker's read-only view of an array in a slab."""
    key = (slab, offset, dtype, shape)
    a = _WORKER_VIEWS.get(key)
    if a is not None:
        return a
    n = math.prod(shape)
    if n == 0:
        return np.empty(shape, dtype)
    a = np.frombuffer(_WORKER_SLABS[slab], dtype=dtype, count=n, offset=offset).reshape(shape)
    a.flags.writeable = False
    if len(_WORKER_VIEWS) >= _VIEWS_KEPT:  # a program whose layouts keep changing: keep it bounded
        _WORKER_VIEWS.clear()
    _WORKER_VIEWS[key] = a
    return a


def _map(slab: int, mapping: mmap.mmap) -> None:
    """In the worker: ``mapping`` is slab ``slab`` from now on (no view of another mapping kept under its number)."""
    _forget_views(slab)
    _WORKER_SLABS[slab] = mapping


def _drop(slab: int) -> None:
    """In the worker: unmap slab ``slab``, its kept views first (a view exports the mapping's
    buffer, which a close refuses; an array of a finished job still held keeps it mapped)."""
    _forget_views(slab)
    m = _WORKER_SLABS.pop(slab, None)
    if m is not None:
        try:
            m.close()
        except BufferError:
            pass


def _forget_views(slab: int) -> None:
    """Drop the kept views of ``slab``."""
    for key in [k for k in _WORKER_VIEWS if k[0] == slab]:
        del _WORKER_VIEWS[key]


class _Slab:
    def __init__(self, ident: int, size: int) -> None:
        self.id = ident
        self.size = size
        self.used = 0
        self.placed: dict[tuple[int, tuple], _Placed] = {}  # (offset, layout key) -> its views here
        self.fd = os.memfd_create(f"ampspec-audit-{ident}", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(self.fd, 0, size)  # no memory: an OSError now, not a SIGBUS at a write
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        self.placed.clear()  # its views export the mapping's buffer
        try:
            self.map.close()
        except BufferError:  # an array still refers to it: the mapping goes with that array
            pass
        os.close(self.fd)


class _Layout:
    """Where each of a list of tensors goes in a block of a slab: those of one dtype back to back
    (in ``order``), each dtype's run aligned; ``refused`` when one cannot be copied there (not on
    the CPU, or a dtype NumPy cannot hold)."""

    __slots__ = ("order", "places", "nbytes", "refused")

    def __init__(self) -> None:
        self.order: list[int] = []  # the tensors' indices, grouped by dtype
        self.places: list[tuple[int, np.dtype, torch.dtype, tuple[int, ...]]] = []  # per index: byte offset, ...
        self.nbytes = 0
        self.refused = False

    @classmethod
    def of(cls, key: tuple) -> _Layout:
        layout = cls()
        if any(dt not in _NUMPY or not cpu for dt, _, cpu in key):
            layout.refused = True
            return layout
        groups: dict[torch.dtype, list[int]] = {}
        for k, (dt, _, _) in enumerate(key):
            groups.setdefault(dt, []).append(k)
        places: dict[int, tuple] = {}
        at = 0
        for dt, ks in groups.items():
            itemsize = _NUMPY[dt].itemsize
            start = at
            for k in ks:
                shape = tuple(key[k][1])
                places[k] = (at, _NUMPY[dt], dt, shape)
                at += math.prod(shape) * itemsize
            at = start + -(-max(at - start, 1) // _ALIGN) * _ALIGN
            layout.order += ks
        layout.places = [places[k] for k in range(len(key))]
        layout.nbytes = at
        return layout


class _Placed:
    """A layout's views at one offset of one slab: torch tensors to copy into (in the layout's
    order) and the `SlabArray` each tensor's copy is read as."""

    __slots__ = ("views", "arrays")

    @classmethod
    def at(cls, layout: _Layout, slab: _Slab, offset: int) -> _Placed:
        placed = cls()
        placed.arrays = []
        for at, dtype, _, shape in layout.places:
            # A view of one np.frombuffer array over the whole mapping: it holds the mapping's
            # buffer, so that the slab cannot be unmapped while the array lives.
            n = math.prod(shape)
            out = np.frombuffer(slab.map, dtype=dtype, count=n, offset=offset + at).reshape(shape).view(SlabArray)
            out.place = (slab.id, offset + at, dtype, shape)
            placed.arrays.append(out)
        views = []
        for k in layout.order:
            _, dtype, dt, shape = layout.places[k]
            arr = placed.arrays[k]
            if dt == torch.bfloat16:  # NumPy has no bfloat16: the bits travel as int16
                views.append(torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16))
            else:
                views.append(torch.from_numpy(arr.view(np.ndarray)))
        placed.views = views
        return placed


# ---------------------------------------------------------------------------------- the program's side


class ReplayProcess:
    """The worker process, its pipe and its pool of slabs (in the audited program).

    ``copy(tensors, owner)``: `SlabArray` copies of the tensors, in a slab of the step data
    ``owner``; None where shared memory cannot be used (the caller copies as usual).
    ``submit(method, args, owner, on_done)``: the replayer's ``method(*args)`` runs in the worker,
    on copies of its arguments; ``on_done(result)`` is applied here when it is done.
    ``make_replayer``: builds the worker's replayer (after the fork, in the worker).
    ``finish()``: every job done; returns ``(state, error)``: the worker replayer's
    ``export_state()`` (None if it never answered) and its failure's text (None if none).
    """

    def __init__(self, jobs: int, make_replayer: Callable[[], Replayer]) -> None:
        self._jobs = jobs
        here, there = mp.Pipe(duplex=True)
        for stream in (sys.stdout, sys.stderr):  # else the worker would write out its copy of what waits
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        # The program's garbage is collected here, and what lives is frozen across the fork, so
        # that the worker never collects (and never runs the finalizers of) the program's objects:
        # autograd graphs of an earlier training, freed in a forked child, can crash it.
        gc.collect()
        gc.freeze()
        try:
            with warnings.catch_warnings():
                # Python 3.12+ warns on fork in a process with threads; the worker runs only the replay.
                warnings.simplefilter("ignore", DeprecationWarning)
                self._proc = mp.get_context("fork").Process(target=_serve, args=(there, here, make_replayer), daemon=True,
                                                            name="ampspec-audit-replay")
                self._proc.start()
        finally:
            gc.unfreeze()
        there.close()
        self._conn = here
        self._free: list[_Slab] = []
        self._open: dict[int, list[Any]] = {}  # id(owner) -> [slabs, finalizer, bytes used]
        self._inflight: dict[int, tuple[list[_Slab], Callable[[Any], None] | None]] = {}
        self._next_job = 0
        self._next_slab = 0
        self._hint = _MIN_SLAB
        self._sized = False  # whether a step has shown how much its copies take
        self._no_memory = False
        self._abandoned: list[int] = []
        self._layouts: dict[tuple, _Layout] = {}
        self.unsent: dict[str, int] = {}  # jobs that could not be sent, by reason (counted as not replayed)
        self.error: str | None = None
        self._result: tuple[Any, str | None] | None = None

    # ------------------------------------------------------------------ copies

    def copy(self, tensors: list[torch.Tensor], owner: Any) -> list[SlabArray] | None:
        """`SlabArray` copies of ``tensors`` (bit for bit) in a slab of ``owner``: those of one dtype
        back to back, written by one ``_foreach_copy_`` (a loop in C++, not one Python call per
        tensor); None when one of them cannot go there (another device or dtype, or no shared
        memory).

        A training loop copies the same tensors' kinds at the same places every step, and a
        slab comes back from the pool to be filled at the same offsets: the layout of a list of
        (dtype, shape, device) and the slab's views for a layout at an offset are made once and
        kept (`_Layout`, `_Placed`), so that a step's copies cost one kernel loop and a lookup."""
        if self._no_memory or self._result is not None:
            return None
        self._reclaim()
        key = tuple([(t.dtype, t.shape, t.is_cpu) for t in tensors])
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _Layout.of(key)
        if layout.refused:
            return None
        try:
            slab, offset = self._reserve(owner, layout.nbytes)
        except OSError:
            self._no_memory = True  # shared memory is exhausted or refused: ordinary copies from now on
            return None
        placed = slab.placed.get((offset, key))
        if placed is None:
            placed = slab.placed[offset, key] = _Placed.at(layout, slab, offset)
        with torch.no_grad():  # the parameters' copies need no autograd node
            torch._foreach_copy_(placed.views, [tensors[k] for k in layout.order])
        return list(placed.arrays)

    def expect(self, nbytes: int) -> None:
        """A step's copies will take about ``nbytes``: its first slab is made that large (until a
        step has shown its real size), instead of growing from a small one."""
        if not self._sized:
            self._hint = max(self._hint, -(-nbytes // _ALIGN) * _ALIGN)

    def _reserve(self, owner: Any, nbytes: int) -> tuple[_Slab, int]:
        """``nbytes`` (a multiple of the alignment) in a slab of ``owner``: the slab and the offset."""
        key = id(owner)
        entry = self._open.get(key)
        if entry is None:
            entry = self._open[key] = [[], weakref.finalize(owner, self._abandon, key), 0]
        slabs = entry[0]
        slab = slabs[-1] if slabs and slabs[-1].size - slabs[-1].used >= nbytes else None
        if slab is None:
            # A step's first slab is as large as the largest step so far; a step that outgrows it
            # gets one twice its size so far.
            slab = self._take(max(nbytes, self._hint if not slabs else 2 * entry[2]))
            slabs.append(slab)
        offset = slab.used
        slab.used += nbytes
        entry[2] += nbytes
        return slab, offset

    def _take(self, size: int) -> _Slab:
        fits = [s for s in self._free if s.size >= size]
        if fits:
            # The smallest that fits, and of those the last given back: its memory is the likeliest
            # to be still in a cache.
            smallest = min(s.size for s in fits)
            slab = next(s for s in reversed(fits) if s.size == smallest)
            self._free.remove(slab)
            return slab
        slab = _Slab(self._next_slab, size)
        self._next_slab += 1
        try:
            self._conn.send(("slab", slab.id, slab.size))
            reduction.send_handle(self._conn, slab.fd, self._proc.pid)
        except OSError:
            slab.close()
            raise
        return slab

    def _release(self, slabs: list[_Slab]) -> None:
        for s in slabs:
            s.used = 0
            self._free.append(s)
        while len(self._free) > self._jobs + 2:  # more free slabs than a full queue needs
            s = min(self._free, key=lambda x: x.size)
            self._free.remove(s)
            self._send(("drop", s.id))
            s.close()

    def _abandon(self, key: int) -> None:
        # A finalizer may run at any allocation, inside this pool's own bookkeeping: the slabs
        # are given back at the next copy or submit instead.
        self._abandoned.append(key)

    def _reclaim(self) -> None:
        while self._abandoned:
            entry = self._open.pop(self._abandoned.pop(), None)
            if entry is not None:
                self._release(entry[0])

    # ------------------------------------------------------------------ jobs

    def submit(self, method: str, args: tuple, owner: Any = None, on_done: Callable[[Any], None] | None = None) -> None:
        self._reclaim()
        entry = self._open.pop(id(owner), None) if owner is not None else None
        slabs: list[_Slab] = []
        if entry is not None:
            entry[1].detach()
            slabs = entry[0]
            self._hint = entry[2] if not self._sized else max(self._hint, entry[2])
            self._sized = True
        self._receive(block=False)
        while self.error is None and len(self._inflight) >= self._jobs:
            self._receive(block=True)
        if self.error is not None:  # the worker failed or ended: nothing more is replayed
            self._release(slabs)
            return
        try:
            payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # something of the program's in the step (a parameter group's own entry)
            self._release(slabs)
            reason = f"the step's data could not be sent to the replay process ({type(exc).__name__}: {exc})"
            self.unsent[reason] = self.unsent.get(reason, 0) + 1
            if on_done is not None and method == "_step":
                on_done((f"not replayed: {reason}", None))
            return
        job = self._next_job
        self._next_job += 1
        self._inflight[job] = (slabs, on_done)
        self._send(("job", job, payload))

    def _send(self, msg: tuple) -> None:
        if self.error is not None:
            return
        try:
            self._conn.send(msg)
        except OSError:
            self._lost()

    def _receive(self, block: bool) -> None:
        """Handle what the worker sent; with ``block``, wait for at least one message."""
        try:
            while self._conn.poll(None if block else 0):
                block = False
                msg = self._conn.recv()
                if msg[0] == "done":
                    slabs, on_done = self._inflight.pop(msg[1])
                    self._release(slabs)
                    if msg[2] is not None and on_done is not None:
                        on_done(msg[2])
                elif msg[0] == "final":
                    self._result = (msg[1], msg[2])
                    return
        except (EOFError, OSError):
            self._lost()

    def forget_in_child(self) -> None:
        """In a process forked from the audited program: this worker is the parent's. Nothing more
        goes to it from here, and multiprocessing must not join or terminate it at this process's
        exit (it would assert 'can only join a child process')."""
        mp_process._children.discard(self._proc)  # the registry multiprocessing joins at exit
        self._result = (None, "a forked process of the audited program")
        self._no_memory = True
        try:
            self._conn.close()  # this process's copy of the descriptor; the parent's stays open
        except OSError:
            pass

    def _lost(self) -> None:
        if self.error is None:
            self._proc.join(timeout=5)
            self.error = f"the replay process ended unexpectedly (exit code {self._proc.exitcode})"
        for slabs, _ in self._inflight.values():
            self._release(slabs)
        self._inflight.clear()

    def finish(self) -> tuple[Any, str | None]:
        if self._result is None:
            self._send(("finish",))
            while self._result is None and self.error is None:
                self._receive(block=True)
            if self._result is None:
                self._result = (None, self.error)
            self._conn.close()
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
            for entry in list(self._open.values()):
                entry[1].detach()
                self._release(entry[0])
            self._open.clear()
            for s in self._free:
                s.close()
            self._free.clear()
        return self._result


# ---------------------------------------------------------------------------------- the worker


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_HEAP_KEPT = 1 << 30


def _keep_freed_memory() -> None:
    """In the worker (glibc only): keep freed memory in the heap instead of handing it back.

    Why: the replay's NumPy temporaries are as large as a parameter and freed at once; by default
    glibc maps each of them afresh or trims the heap after it, and every page of the next one is
    a page fault, which can cost more than the arithmetic. The worker's own memory, bounded by
    one step's arrays; the program's process is left alone."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest: arrays up to 32 MiB come from the heap
        libc.mallopt(_M_TRIM_THRESHOLD, _HEAP_KEPT)
    except (OSError, AttributeError):  # another C library: its defaults
        pass


def _serve(conn: Any, other_end: Any, make_replayer: Callable[[], Replayer]) -> None:
    """The worker's loop: map the slabs, run the jobs in order on ``make_replayer()`` (the
    replay's, handed over at the fork: this module stays below `audit.replay`), report."""
    other_end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    _keep_freed_memory()
    # Numbered by this worker's pool: whatever the forked program held under these names is not ours.
    _WORKER_SLABS.clear()
    _WORKER_VIEWS.clear()
    replayer = make_replayer()
    error: str | None = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the program ended without finishing the audit: nobody to report to
        kind = msg[0]
        if kind == "slab":
            fd = reduction.recv_handle(conn)
            _map(msg[1], mmap.mmap(fd, msg[2]))
            os.close(fd)
        elif kind == "drop":
            _drop(msg[1])
        elif kind == "job":
            result = None
            if error is None:
                try:
                    method, args = pickle.loads(msg[2])
                    result = getattr(replayer, method)(*args)
                    del args
                except BaseException as exc:  # the replay's own failure: reported at the end
                    error = f"{exc!r} (in the replay process)\n" + "".join(
                        traceback.format_exception(type(exc), exc, exc.__traceback__))
            conn.send(("done", msg[1], result))
        elif kind == "finish":
            conn.send(("final", replayer.export_state(), error))
            return
