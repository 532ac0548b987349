"""The multi-rank context the trainer calls (rules 1-3, 5, 6, 9, 10 of ``torchimpl.distributed``):
the process group, the configuration check, the skip decision, the norm, checkpoints."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from torchimpl.distributed.data import rank_seed, shard_data
from torchimpl.distributed.model import MODES, wrap_model
from torchimpl.config.problems import ConfigError
from torchimpl.distributed.reduction import ReductionSettings, reduction_problems
from torchimpl.run.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

__all__ = ["DistributedContext", "DistributedError", "config_differences", "init_distributed", "launch_rank"]

log = logging.getLogger("torchimpl.distributed")


class DistributedError(RuntimeError):
    """A multi-rank run cannot continue: a rank died or hangs, or the ranks disagree."""



def launch_rank() -> int:
    """This process's rank as ``torchrun`` sets it (``RANK``); 0 when not launched by torchrun."""
    return int(os.environ.get("RANK", "0"))


def config_differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the fields whose values differ between two nested config dicts."""
    out = []
    for key in sorted(set(a) | set(b)):
        name = f"{prefix}.{key}" if prefix else str(key)
        x, y = a.get(key), b.get(key)
        if isinstance(x, Mapping) and isinstance(y, Mapping):
            out += config_differences(x, y, name)
        elif x != y:
            out.append(name)
    return out


def _fingerprint(config: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def init_distributed(mode: str = "ddp", *, device: torch.device | None = None,
                     timeout_s: float = 300.0, reduction: ReductionSettings | None = None) -> DistributedContext:
    """Rule 1: join (or create) the process group for ``mode`` and return the context.

    Rule 11: ``reduction`` (default fp32) is checked against the device first; a setting torch
    cannot run raises :class:`ConfigError` naming the field, before any process group exists.
    """
    if mode not in MODES:
        raise ValueError(f"train.distributed must be one of {MODES}, got {mode!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    device = device or torch.device("cpu")
    reduction = reduction or ReductionSettings()
    problems = reduction_problems(mode, reduction, device)
    if problems:
        raise ConfigError(problems)
    if mode == "none":
        return DistributedContext("none", 0, 1, 0, device, owns_group=False, timeout_s=timeout_s, reduction=reduction)
    if not dist.is_available():
        raise DistributedError("torch.distributed is not available in this build of PyTorch")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=_timeout(timeout_s))
        else:
            log.info("no torchrun environment: a single-rank %s group", backend)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=_timeout(timeout_s))
        owns = True
    ctx = DistributedContext(mode, dist.get_rank(), dist.get_world_size(), local_rank, device, owns_group=owns,
                             timeout_s=timeout_s, reduction=reduction)
    log.info("gradient reduction: %s", reduction.describe(mode))
    if ctx.rank != 0:
        # Rule 9: only rank 0 reports progress; warnings and errors still show on every rank.
        logging.getLogger("torchimpl").setLevel(logging.WARNING)
    return ctx


class DistributedContext:
    """What the trainer needs to run on ``world_size`` ranks (identity hooks for ``none``)."""

    def __init__(self, mode: str, rank: int, world_size: int, local_rank: int, device: torch.device, *,
                 owns_group: bool, timeout_s: float, reduction: ReductionSettings | None = None):
        self.mode, self.rank, self.world_size, self.local_rank = mode, rank, world_size, local_rank
        self.device, self.owns_group, self.timeout_s = device, owns_group, timeout_s
        self.reduction = reduction or ReductionSettings()
        self._ddp: nn.Module | None = None
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.mode == "fsdp2"

    def _collective(self, what: str, fn: Callable[[], Any]) -> Any:
        from torch.distributed.checkpoint.api import CheckpointException  # loaded when used (slow to import)

        try:
            return fn()
        except DistributedError:
            raise
        except CheckpointException as exc:  # a BaseException: it would pass an ``except Exception``
            # Its text holds every failed rank's traceback; the last line is the cause.
            lines = [line for line in str(exc).splitlines() if line.strip()]
            cause = lines[-1].strip() if lines else type(exc).__name__
            raise CheckpointError(f"rank {self.rank}/{self.world_size}: {what} failed: {cause}") from None
        except RuntimeError as exc:
            raise DistributedError(
                f"rank {self.rank}/{self.world_size}: {what} failed within the {self.timeout_s:g} s timeout "
                f"(train.distributed_timeout_s); another rank probably died or hangs: {exc}"
            ) from exc

    def barrier(self, what: str = "barrier") -> None:
        """A barrier that names the ranks that did not arrive (gloo) within the timeout."""
        if not self.enabled or self.world_size == 1:
            return
        if dist.get_backend() == "gloo":
            self._collective(what, lambda: dist.monitored_barrier(timeout=_timeout(self.timeout_s),
                                                                  wait_all_ranks=True))
        else:
            self._collective(what, dist.barrier)

    def check_config(self, config: Mapping[str, Any]) -> None:
        """Rule 3: every rank must run the same configuration."""
        if not self.enabled or self.world_size == 1:
            return
        # The barrier first: it names the ranks that never arrived, within this run's timeout
        # (the group's own timeout may be longer when the group was created by someone else).
        self.barrier("the start-up barrier")
        mine = (_fingerprint(config), dict(config))
        gathered: list[Any] = [None] * self.world_size
        self._collective("the configuration check at start",
                         lambda: dist.all_gather_object(gathered, mine))
        ref_hash, ref_cfg = gathered[0]
        bad = [r for r, (h, _) in enumerate(gathered) if h != ref_hash]
        if bad:
            fields = sorted({f for r in bad for f in config_differences(ref_cfg, gathered[r][1])})
            raise DistributedError(
                f"the configuration differs across ranks: ranks {bad} differ from rank 0 in {fields}"
            )

    def place(self, device: torch.device) -> torch.device:
        """Rule 1: each rank's own CUDA device; other devices unchanged."""
        if self.enabled and device.type == "cuda":
            return self.device
        return device

    def seed(self, seed: int) -> None:
        """Rule 8: reseed this rank's generators (rank 0 and non-distributed runs: unchanged)."""
        if self.rank == 0:
            return

        s = rank_seed(seed, self.rank)
        random.seed(s)
        np.random.seed(s % 2**32)
        torch.manual_seed(s)

    def shard_data(self, data: Any, seed: int = 0) -> Any:
        return shard_data(data, self.rank, self.world_size, seed) if self.enabled else data

    def wrap_model(self, model: nn.Module, plan: Any = None) -> tuple[nn.Module, nn.Module]:
        if not self.enabled:
            return model, model
        module, forward = self._collective("wrapping the model", lambda: wrap_model(model, self.mode, plan, self.device,
                                                                                self.reduction))
        self._ddp = forward if self.mode == "ddp" else None
        return module, forward

    def accumulate(self, is_last: bool) -> ContextManager[Any]:
        """Rule 10: the context of one microbatch's forward; ``is_last`` for the window's last one.

        DDP decides in the forward whether the following backward reduces, so entering the
        context around the forward alone is enough. Identity for none and FSDP2.
        """
        if self._ddp is not None and not is_last:
            return self._ddp.no_sync()
        return contextlib.nullcontext()

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        """Every rank's ``obj`` (picklable, CPU tensors) as a list on rank 0; None on the others."""
        if not self.enabled:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        self._collective(what, lambda: dist.gather_object(obj, out, dst=0))
        return out

    def agree(self, found_inf: torch.Tensor, scaler: Any, loss_acc: torch.Tensor) -> torch.Tensor:
        """Rule 5: the rank-consistent found_inf (0.0 or 1.0); ``loss_acc`` becomes the rank mean.

        One all-reduce of a two-element device tensor; no host read. The reduced flag replaces
        the scaler's per-device records, so ``update`` backs off on every rank or on none.
        """
        if not self.enabled:
            return found_inf
        buf = torch.stack([found_inf.detach().reshape(()).to(torch.float32),
                           loss_acc.detach().reshape(()).to(torch.float32)])
        self._collective("the found_inf all-reduce", lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True)
                         .wait(timeout=_timeout(self.timeout_s)))
        # A flag of exactly 1.0: fused optimizers skip only on found_inf == 1.0.
        found = (buf[0] != 0).to(torch.float32)
        loss_acc.copy_(buf[1] / self.world_size)
        if scaler is not None:
            for state in scaler._per_optimizer_states.values():
                for fi in state["found_inf_per_device"].values():
                    fi.copy_(found.to(fi.device).reshape(fi.shape))
        return found

    def total_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Rule 6: the global L2 norm of the gradients, a plain tensor equal on every rank."""
        norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
        full = getattr(norm, "full_tensor", None)
        return full() if callable(full) else norm

    # ------------------------------------------------------------ checkpoints (rule 9)

    def save_checkpoint(self, contents: dict[str, Any], path: Path) -> Path:
        """Write ``contents`` (as the trainer builds them) for this run's mode; call on every rank."""
        if not self.enabled:
            return save_checkpoint(contents, path)
        acc = contents.get("accumulation")
        local = None
        if acc is not None:
            # FSDP2's gradients are sharded DTensors: they go through torch.distributed.checkpoint.
            local = {"loss": acc["loss"].cpu()}
            if not self.sharded:
                local["grads"] = [None if g is None else g.cpu() for g in acc["grads"]]
        per_rank = self.gather((contents["rng"], local), "gathering generator states and accumulators")
        contents = dict(contents, accumulation=None)
        if per_rank is not None:
            contents["rng_per_rank"] = [rng for rng, _ in per_rank]
            contents["accumulation_per_rank"] = None if acc is None else [a for _, a in per_rank]
        path = Path(path)
        if not self.sharded:
            written = path
            if self.is_main:
                written = save_checkpoint(contents, path)
            self.barrier("the checkpoint barrier")
            return written
        grads = None if acc is None else acc["grads"]
        return self._save_sharded(contents, grads, path)

    def _save_sharded(self, contents: dict[str, Any], grads: list[Any] | None, path: Path) -> Path:
        import torch.distributed.checkpoint as dcp  # loaded when used (slow to import)

        final = path.with_suffix(".dcp")
        holder: list[Any] = [None]
        if self.is_main:
            final.parent.mkdir(parents=True, exist_ok=True)
            holder[0] = tempfile.mkdtemp(prefix=".tmp-" + final.name + "-", dir=final.parent)
        self._collective("sharing the checkpoint folder", lambda: dist.broadcast_object_list(holder, src=0))
        tmp = Path(holder[0])
        # The trainer's unsharded views are replaced by the sharded state dicts.
        contents.pop("model")
        contents.pop("optimizer")
        state = self._sharded_state(with_optimizer=bool(self._optimizer.state))
        contents["optimizer_state_saved"] = "optimizer" in state
        if grads is not None:
            # The window's reduced, sharded gradients so far, keyed by position in the trainer's
            # parameter list; meta records which parameters had one.
            state["accumulation"] = {str(i): g for i, g in enumerate(grads) if g is not None}
            contents["accumulation_grads"] = [g is not None for g in grads]
        self._collective("writing the sharded checkpoint", lambda: dcp.save(state, checkpoint_id=str(tmp)))
        if self.is_main:
            save_checkpoint(contents, tmp / "meta.ckpt")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        self.barrier("the checkpoint barrier")
        return final

    def _sharded_state(self, with_optimizer: bool) -> dict[str, Any]:
        """The sharded model (and optimizer) state dicts that torch.distributed.checkpoint reads or writes.

        An optimizer with no state yet (before its first applied step, or SGD without momentum)
        is left out: ``get_state_dict`` would first create the state with a zero-learning-rate
        step, and the live run would keep it (Adam's step count would then start at 1).
        """
        # torch.distributed's parts load only for the multi-process run or checkpoint that uses them
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not with_optimizer:
            return {"model": get_model_state_dict(self._model)}
        model_sd, optim_sd = get_state_dict(self._model, self._optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The trained module and its optimizer (FSDP2 checkpoints read them directly)."""
        self._model, self._optimizer = model, optimizer

    def _trained_params(self) -> list[nn.Parameter]:
        # The trainer's parameter list (its checkpoint's accumulated gradients follow this order).
        return [p for p in self._model.parameters() if p.requires_grad]

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Read a checkpoint for resuming on this rank: its own generator states and accumulators,
        and for FSDP2 the sharded model and optimizer (and accumulated gradients) loaded in place,
        resharded if the world size changed (at a window boundary only)."""
        path = Path(path)
        if path.is_dir():
            if path.suffix != ".dcp" and not (path / "meta.ckpt").exists():  # a folder given by mistake
                raise CheckpointError(f"{path} is a folder, not a checkpoint: give a checkpoint file (step-*.ckpt), "
                                      "or resume='latest' (--resume) with checkpoint.folder set to that folder")
            if not self.sharded:
                raise CheckpointError(f"{path} is a sharded (FSDP2) checkpoint; resume it with train.distributed=fsdp2")
            import torch.distributed.checkpoint as dcp  # loaded when used (slow to import)
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

            contents = load_checkpoint(path / "meta.ckpt", map_location="cpu")
            self._check_window_world(contents, path)
            state = self._sharded_state(with_optimizer=contents.get("optimizer_state_saved", True))
            present = contents.get("accumulation_grads")
            if present is not None:
                params = self._trained_params()
                state["accumulation"] = {str(i): torch.zeros_like(p) for i, p in enumerate(params) if present[i]}
            self._collective("reading the sharded checkpoint", lambda: dcp.load(state, checkpoint_id=str(path)))
            if "optimizer" in state:
                set_state_dict(self._model, self._optimizer, model_state_dict=state["model"],
                               optim_state_dict=state["optimizer"])
            else:
                set_model_state_dict(self._model, state["model"])
            # The trainer's restore then reloads these, a no-op.
            contents["model"] = self._model.state_dict()
            contents["optimizer"] = self._optimizer.state_dict()
            if present is not None:
                grads = [state["accumulation"].get(str(i)) for i in range(len(present))]
                contents["accumulation_per_rank"][self.rank]["grads"] = grads
        else:
            if self.sharded:
                raise ValueError(f"{path} is a single-file checkpoint; resume it with train.distributed none or ddp")
            contents = load_checkpoint(path, map_location="cpu")
            self._check_window_world(contents, path)
        per_acc = contents.get("accumulation_per_rank")
        if per_acc is not None:
            contents["accumulation"] = per_acc[self.rank]
        per_rank = contents.get("rng_per_rank")
        if per_rank and len(per_rank) == self.world_size:
            contents["rng"] = per_rank[self.rank]
        elif per_rank and self.rank != 0:
            log.warning("checkpoint from %d ranks resumed on %d: rank %d's generators start from rank 0's",
                        len(per_rank), self.world_size, self.rank)
        return contents

    def _check_window_world(self, contents: dict[str, Any], path: Path) -> None:
        """A checkpoint from inside an accumulation window resumes only on the ranks that wrote it."""
        per_acc = contents.get("accumulation_per_rank")
        writers = len(per_acc) if per_acc is not None else 1 if contents.get("accumulation") is not None else None
        if writers is not None and writers != self.world_size:
            trainer = contents.get("trainer", {})
            raise CheckpointError(
                f"{path} was written inside an accumulation window (step {trainer.get('step')}, "
                f"{trainer.get('window_done')} of {trainer.get('window_size')} microbatches) by "
                f"{writers} rank(s); its partial gradients belong to those ranks' data shards, so it "
                f"cannot resume on {self.world_size}: resume it on {writers} rank(s), or from a "
                "checkpoint written at a window boundary (checkpoint.interval saves between steps)"
            )

    def close(self) -> None:
        """Destroy the process group if this context created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False
