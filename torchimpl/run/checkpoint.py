"""Checkpoint files: atomic, checksummed, loaded with ``weights_only=True``.

File layout: one ASCII header line ``AMPSPEC-CHECKPOINT 1 <sha256 hex> <payload bytes>\\n``
followed by the payload, the bytes of ``torch.save(contents)``. Rules:

1. Writing goes to a temporary file in the destination folder, which is flushed, fsynced,
   renamed over the destination with ``os.replace`` and the folder fsynced: a crash leaves
   either the old file or the new one, never a partial one under the final name.
2. Reading checks the length and the SHA-256 of the payload before unpickling: truncation
   and bit flips are reported as :class:`CheckpointError`, not as an unpickling failure.
3. The payload is loaded with ``torch.load(weights_only=True)``: only tensors and plain
   Python containers and scalars. RNG states are stored as tensors and lists for that reason.
4. Files are named ``step-<8 digits>[-mb<3 digits>].ckpt`` (the optimizer step, and the
   microbatch for a save inside an accumulation window), so names sort by training time;
   :func:`latest_checkpoint` returns the newest one that verifies, skipping bad ones.
5. A sharded (FSDP2) checkpoint is a folder ``step-<8 digits>.dcp`` written by
   ``torch.distributed.checkpoint`` with this module's ``meta.ckpt`` file inside; it is
   written under a temporary name and renamed when complete (see ``torchimpl.distributed``), so
   it verifies when its ``meta.ckpt`` and ``.metadata`` do.
6. A save never replaces a file that is not a checkpoint (a path named by mistake: the
   configuration, a notes file): ``ValueError`` naming it, and nothing written. A damaged
   checkpoint may be replaced: a file under a checkpoint's name (rule 4), or any file starting
   with this format's header or cut inside it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchimpl.safe_files import writing

__all__ = [
    "qualified_name",
    "CheckpointError",
    "capture_rng_state",
    "checkpoint_name",
    "is_checkpoint_name",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "remove_stale_temporaries",
    "restore_rng_state",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

_MAGIC = b"AMPSPEC-CHECKPOINT"
_VERSION = 1
_NAME = re.compile(r"^step-(\d{8})(?:-mb(\d{3}))?\.(?:ckpt|dcp)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with the reason."""


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint's file or folder name (rule 4)."""
    return _NAME.match(name) is not None


def checkpoint_name(step: int, microbatch: int = 0) -> str:
    """``step-00000012.ckpt``, or ``step-00000012-mb002.ckpt`` inside an accumulation window."""
    for name, value, top in (("step", step, 10**8), ("microbatch", microbatch, 1000)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < top:
            raise ValueError(f"checkpoint name: the trainer's {name} must be an integer in [0, {top}), got "
                             f"{value!r} (was trainer.state.{'step' if name == 'step' else 'window_done'} "
                             "changed by a callback?)")
    return f"step-{step:08d}" + (f"-mb{microbatch:03d}" if microbatch else "") + ".ckpt"


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles (Windows): rename is the best we get
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _refuse_foreign(path: Path) -> None:
    """Rule 6: ``path`` may be replaced only when it is missing or a checkpoint (even a damaged one)."""
    if path.is_symlink() or not path.exists() or (is_checkpoint_name(path.name) and path.is_file()):
        # os.replace replaces a link itself, never its target; a file under a checkpoint's name
        # is the run's own, however damaged (a resume passed over it)
        return
    if path.is_dir():
        raise ValueError(f"checkpoint {path} is a folder; give a file path such as {path / 'model.ckpt'}")
    with open(path, "rb") as f:
        head = f.read(len(_MAGIC))
    if head != _MAGIC[:len(head)]:  # an empty file or a header torn short is still a checkpoint's
        raise ValueError(f"checkpoint {path} exists and is not an ampspec checkpoint; ampspec overwrites only its "
                         "own files: choose another path, or move that file away")


def save_checkpoint(contents: dict[str, Any], path: str | Path) -> Path:
    """Write ``contents`` to ``path`` atomically (rule 1) with a checksummed header (rule 2),
    never over a file that is not a checkpoint (rule 6)."""
    path = Path(path)
    _refuse_foreign(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(contents, buf)
    payload = buf.getvalue()
    header = b"%s %d %s %d\n" % (_MAGIC, _VERSION, hashlib.sha256(payload).hexdigest().encode(), len(payload))

    with writing(path, "checkpoint"):  # a full disk names the file and the fix
        fd, tmp = tempfile.mkstemp(prefix=".tmp-" + path.name + "-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    _fsync_dir(path.parent)
    return path


def _read_payload(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from None
    newline = data.find(b"\n", 0, 200)
    parts = data[:newline].split(b" ") if newline > 0 else []
    if len(parts) != 4 or parts[0] != _MAGIC:
        raise CheckpointError(f"{path} is not an ampspec checkpoint (no header)")
    if parts[1] != str(_VERSION).encode():
        raise CheckpointError(f"{path} has checkpoint format {parts[1].decode(errors='replace')}, this version reads {_VERSION}")
    digest, length = parts[2].decode(errors="replace"), int(parts[3]) if parts[3].isdigit() else -1
    payload = data[newline + 1:]
    if len(payload) != length:
        raise CheckpointError(f"{path} is truncated or padded: payload is {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path} is corrupted: SHA-256 of the payload does not match the header")
    return payload


def verify_checkpoint(path: str | Path) -> None:
    """Raise :class:`CheckpointError` unless the file's header, length and checksum are right."""
    path = Path(path)
    if path.is_dir():
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"{path} is not a complete sharded checkpoint (no .metadata)")
        path = path / "meta.ckpt"
    _read_payload(path)


def load_checkpoint(path: str | Path, map_location: str | torch.device | None = "cpu") -> dict[str, Any]:
    """Verify (rule 2) and load (rule 3); raises :class:`CheckpointError` with the reason."""
    path = Path(path)
    payload = _read_payload(path)
    try:
        contents = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as exc:  # the unpickler's errors have no common base class
        raise CheckpointError(f"{path} could not be loaded with weights_only=True: {exc}") from None
    if not isinstance(contents, dict) or "format" not in contents:
        raise CheckpointError(f"{path} does not hold an ampspec training checkpoint")
    return contents


def check_loadable(state: Any, what: str) -> None:
    """Rule 3, checked before a run trains: ``state`` reads back with ``weights_only=True``
    (a user's optimizer or scheduler state holding other objects would make every checkpoint
    of the run unreadable); ``ValueError`` naming ``what`` and the fix."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as exc:  # the unpickler's errors have no common base class
        first = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{what}'s state_dict() holds objects that a checkpoint cannot load safely "
                         f"(torch.load(weights_only=True): {first}); keep only tensors, numbers, strings and "
                         "containers of them in its state (e.g. a LambdaLR with plain functions)") from None


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoint files in ``folder``, oldest first (by step, then microbatch)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _NAME.match(p.name)
        if m:
            found.append(((int(m.group(1)), int(m.group(2) or 0)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest checkpoint in ``folder`` that verifies; bad newer ones are logged and skipped."""
    for path in reversed(list_checkpoints(folder)):
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            log.warning("skipping bad checkpoint: %s", exc)
            continue
        return path
    return None


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Delete what a write that never finished left in ``folder`` (rule 1's temporary files and
    rule 5's temporary folders, named ``.tmp-step-...``). Call only while no write is under way
    there: at the start of a run, or after this run's own write has been renamed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.iterdir() if p.name.startswith(".tmp-step-")]
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if stale:
        log.info("removed %d temporary file(s) left by interrupted checkpoint writes in %s", len(stale), folder)
    return stale


def prune_checkpoints(folder: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints, and stale temporary files."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    remove_stale_temporaries(folder)
    paths = list_checkpoints(folder)
    removed = paths[:-keep_last]
    for p in removed:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return removed


# ---------------------------------------------------------------- random number generators


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA generator states as tensors and plain types."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`; CUDA states are restored when CUDA is present."""
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal.tolist()), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            log.warning(
                "checkpoint holds %d CUDA generator states, this machine has %d devices; restoring the common ones",
                len(cuda), torch.cuda.device_count(),
            )
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def qualified_name(obj: Any) -> str:
    """``module.Class`` of an optimizer or a scheduler: what a checkpoint records of a user's."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
