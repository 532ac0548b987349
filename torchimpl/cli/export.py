"""Getting the weights out: a trained model's plain ``state_dict`` from a checkpoint.

A checkpoint (``torchimpl.run.checkpoint``) starts with its own header line and holds the whole
run (optimizer, scaler, generators, data position), so ``torch.load`` cannot read it directly.

1. :func:`load_weights` returns the model's ``state_dict`` (parameter name -> tensor, on the
   CPU) from a checkpoint file (``.ckpt``), a sharded FSDP2 checkpoint folder (``.dcp``), a
   checkpoint folder (its newest checkpoint that verifies), or a file written by rule 2.
2. :func:`export_weights` writes that ``state_dict`` as ``OUT.pt`` (``torch.save``, readable
   with ``torch.load(weights_only=True)``) or ``OUT.safetensors`` (needs the ``safetensors``
   package). An existing ``OUT`` is refused unless ``force``; the file is written to a
   temporary name in ``OUT``'s folder and renamed, so ``OUT`` is never left half written.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchimpl.run.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, verify_checkpoint
from torchimpl.run.state import model_problems

__all__ = ["ExportResult", "export_weights", "load_weights"]

_SUFFIXES = (".pt", ".safetensors")
_SAFETENSORS_HINT = "pip install 'ampspec[safetensors]'"


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_weights` wrote."""

    path: Path
    source: Path
    tensors: int
    bytes: int


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` from a checkpoint or an exported file (rule 1), on the CPU.

    ``model.load_state_dict(load_weights("ckpt/step-00000200.ckpt"))`` restores the trained model.
    """
    source = _resolve_source(Path(path))
    if source.is_dir():
        return _load_sharded(source)
    if source.suffix in (".pt", ".safetensors"):
        try:
            if source.suffix == ".pt":
                return _as_state_dict(torch.load(source, map_location="cpu", weights_only=True), source)
            return _safetensors(source, "reading").load_file(str(source), device="cpu")
        except (CheckpointError, ImportError):
            raise
        except Exception as exc:  # the unpicklers' errors have no common base class
            raise CheckpointError(f"{source} was refused by the safe loader (not a state_dict written by torch.save "
                                  f"or safetensors, or it holds objects other than tensors): "
                                  f"{' '.join(str(exc).split())[:200]}") from None
    contents = load_checkpoint(source, map_location="cpu")
    problems = model_problems(contents.get("model"), contents.get("model_signature"))
    if problems:
        raise CheckpointError(f"{source} is malformed: {'; '.join(problems)}; nothing was exported")
    return _as_state_dict(contents["model"], source)


def export_weights(checkpoint: str | Path, out: str | Path, *, force: bool = False) -> ExportResult:
    """Write the model's ``state_dict`` from ``checkpoint`` to ``out`` (rule 2)."""
    out = Path(out)
    if out.suffix not in _SUFFIXES:
        raise ValueError(f"output {out}: unknown format {out.suffix or '(no suffix)'!r}; name it "
                         "OUT.pt (torch.save) or OUT.safetensors (safetensors)")
    writer = _write_safetensors if out.suffix == ".safetensors" else _write_torch
    if out.suffix == ".safetensors":
        _safetensors(out, "writing")  # before reading a large checkpoint
    _refuse_overwrite(out, force)
    source = _resolve_source(Path(checkpoint))
    weights = load_weights(source)
    _atomic_write(out, weights, writer, force)
    size = sum(t.numel() * t.element_size() for t in weights.values())
    return ExportResult(out, source, len(weights), size)


def _resolve_source(path: Path) -> Path:
    """The file or sharded folder to read: a checkpoint folder resolves to its newest good checkpoint."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_dir() and not (path / ".metadata").exists() and path.suffix != ".dcp":
        newest = latest_checkpoint(path)
        if newest is None:
            found = "no checkpoints" if not list_checkpoints(path) else "no checkpoint that verifies"
            raise CheckpointError(f"{path} is a folder with {found} (expected step-NNNNNNNN.ckpt files)")
        return newest
    return path


def _load_sharded(folder: Path) -> dict[str, torch.Tensor]:
    """An FSDP2 ``.dcp`` folder, gathered into full tensors in this one process."""
    verify_checkpoint(folder)
    # torch.distributed's parts load only for the multi-process run or checkpoint that uses them
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    # dcp_to_torch_save reads without a process group; it gathers every shard into one file.
    with tempfile.TemporaryDirectory(prefix=".ampspec-export-") as tmp, warnings.catch_warnings():
        # One process reading every shard is the intent here, not a missing process group.
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        full = Path(tmp) / "full.pt"
        # On a damaged folder torch logs each failed metadata read with its traceback on the root
        # logger before raising; the error below says it in one line.
        logging.disable(logging.WARNING)
        try:
            dcp_to_torch_save(str(folder), str(full))
            state = torch.load(full, map_location="cpu", weights_only=True)
        except (Exception, CheckpointException) as exc:  # its readers raise anything on a damaged folder
            # A CheckpointException (a BaseException) carries each rank's traceback as text: its last line says why.
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise CheckpointError(f"{folder} is a damaged sharded checkpoint ({lines[-1][:200] if lines else type(exc).__name__})"
                                  ) from None
        finally:
            logging.disable(logging.NOTSET)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{folder} holds no model state (not an ampspec sharded checkpoint)")
    return _as_state_dict(state["model"], folder)


def _as_state_dict(obj: Any, source: Path) -> dict[str, torch.Tensor]:
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise CheckpointError(f"{source} does not hold a state_dict (a mapping of names to tensors)")
    return dict(obj)


def _safetensors(path: Path, verb: str) -> Any:
    try:
        # optional dependency: only for a .safetensors output
        import safetensors.torch
    except ImportError:
        raise ImportError(f"{verb} {path} needs the safetensors package: {_SAFETENSORS_HINT} "
                          "(or name the output OUT.pt)") from None
    return safetensors.torch


def _refuse_overwrite(out: Path, force: bool) -> None:
    """An existing ``OUT`` is kept unless ``force``, and so is a symbolic link there, even one
    whose target is gone (``exists()`` is false for it): ``--force`` replaces the link itself."""
    if out.is_symlink() and not force:
        raise FileExistsError(f"output {out} is a symbolic link (to {os.readlink(out)}); choose another name, "
                              "or pass --force to replace the link (its target is left as it is)")
    if out.exists() and not force:
        raise FileExistsError(f"output {out} exists; choose another name, or pass --force to overwrite it")
    if out.is_dir():
        raise IsADirectoryError(f"output {out} is a folder; name a file OUT.pt or OUT.safetensors")


def _write_torch(weights: dict[str, torch.Tensor], path: Path) -> None:
    torch.save(weights, path)


def _write_safetensors(weights: dict[str, torch.Tensor], path: Path) -> None:
    # safetensors refuses tensors that share storage (tied weights) and non-contiguous ones:
    # each name gets its own contiguous copy; loading gives back equal tensors.
    seen: set[int] = set()
    plain = {}
    for name, t in weights.items():
        ptr = t.untyped_storage().data_ptr()
        plain[name] = t.detach().clone().contiguous() if ptr in seen else t.detach().contiguous()
        seen.add(ptr)
    _safetensors(path, "writing").save_file(plain, str(path))


def _atomic_write(out: Path, weights: dict[str, torch.Tensor], writer: Any, force: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + out.name + "-", dir=out.parent)
    os.close(fd)
    try:
        writer(weights, Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        _refuse_overwrite(out, force)  # again: another process may have written it meanwhile
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
