"""Multi-process training on PyTorch's own engines: DDP and FSDP2, launched with ``torchrun``.

The trainer calls the hooks of one :class:`DistributedContext`; with ``train.distributed: none``
every hook is the identity and nothing here touches ``torch.distributed``. Rules:

1. One process per rank, started by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``MASTER_ADDR``, ``MASTER_PORT``). gloo on CPU, NCCL on CUDA (each rank on ``cuda:LOCAL_RANK``).
   Without those variables a single-rank group is created in-process (to load a sharded
   checkpoint for evaluation, or to test). An existing process group is reused, not destroyed.
2. Every collective is bounded by ``train.distributed_timeout_s``: a rank that dies or hangs
   makes the others fail with :class:`DistributedError` naming the operation, not wait forever.
3. At start the ranks compare their configurations; a difference raises
   :class:`DistributedError` naming the ranks and the fields.
4. The model starts from rank 0's parameters on every rank. DDP replicates it; FSDP2
   (``fully_shard``) shards every called child with parameters, then the root, with a
   ``MixedPrecisionPolicy`` that keeps fp32 parameters and fp32 gradient reduction: autocast
   picks the compute dtype per operation exactly as on one device.
5. The skip decision: after ``unscale_``, the found_inf flag and the window's loss are summed over
   ranks in one all-reduce of a device tensor (no host read), and the reduced flag is written
   back into the scaler's per-device records before the step decision and ``update``. Every
   rank skips, or none does, even when an inf appears after the gradient reduction; every rank
   sees the same mean loss, so a stop on a non-finite loss is rank-consistent too.
6. The gradient norm is global: DDP's gradients are replicated, so the local norm is the global
   one; FSDP2's norm over DTensor shards is reduced by torch (a ``Replicate`` DTensor, made a plain
   tensor here). Identical on every rank.
7. Data: rank ``r`` of ``W`` takes batches ``r, r + W, r + 2W, ...`` of each epoch, and every rank
   the same number of them (``len(data) // W``), so all ranks run the same windows. A
   ``DataLoader`` with a ``DistributedSampler`` is used as it is.
8. Random streams: rank 0 keeps ``train.seed`` (a one-rank run equals a non-distributed one);
   rank ``r`` seeds ``seed + r * 1_000_003``. Checkpoints keep every rank's generator states.
9. Rank 0 alone logs at INFO, writes the trace, the progress bar and the non-finite diagnosis
   (one file holding every rank's diagnosis of its own batch). Checkpoints: DDP (and none) write
   the usual single file from rank 0; FSDP2 writes a ``step-NNNNNNNN.dcp`` folder with
   ``torch.distributed.checkpoint`` (model, optimizer and, inside an accumulation window, the
   sharded accumulated gradients) plus ``meta.ckpt`` (the rest), first under a temporary name,
   then renamed by rank 0 once every rank has finished. Every rank's generator states and, inside
   a window, its own loss accumulator (and DDP's local gradient sums) are gathered into rank 0's
   file (for DDP that is world size x the model's gradients in rank 0's memory while it writes).
   A checkpoint written inside a window resumes only on as many ranks as wrote it (the partial
   sums belong to those ranks' data shards); at a window boundary any world size loads it. An
   optimizer without state yet (before its first applied step) is left out of an FSDP2
   checkpoint: ``get_state_dict`` would create the state with a zero-learning-rate step.
10. Gradient accumulation: DDP runs every microbatch of a window but the last under
   ``no_sync()``, so each rank sums its microbatch gradients locally and DDP all-reduces the
   window's sum once, in the last backward (one gradient all-reduce per window, not one per
   microbatch). FSDP2 reduce-scatters every microbatch into its sharded gradients (gradient
   memory stays sharded).
"""

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

from torchimpl.run.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

__all__ = [
    "MODES",
    "DistributedContext",
    "DistributedError",
    "ShardedData",
    "config_differences",
    "init_distributed",
    "launch_rank",
    "rank_seed",
    "shard_data",
    "wrap_model",
]

log = logging.getLogger(__name__)

MODES = ("none", "ddp", "fsdp2")
_SEED_STRIDE = 1_000_003


class DistributedError(RuntimeError):
    """A multi-rank run cannot continue: a rank died or hangs, or the ranks disagree."""


def rank_seed(seed: int, rank: int) -> int:
    """Rule 8: the seed of rank ``rank``'s generators (rank 0 keeps ``seed``)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return (seed + rank * _SEED_STRIDE) % (2**63)


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


# ---------------------------------------------------------------- data (rule 7)


class ShardedData:
    """Rank ``rank``'s share of a re-iterable of batches: every ``world_size``-th batch.

    Positional sources (with ``iter_from(epoch, index)`` or ``batch(epoch, index)``, or a
    sequence) give ``iter_from`` too, so a resume starts mid-epoch without replaying. Other
    iterables are iterated with the global generator seeded from ``(seed, epoch)`` identically
    on every rank, so a shuffling ``DataLoader`` gives all ranks the same order to share.
    """

    def __init__(self, base: Any, rank: int, world_size: int, seed: int = 0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        self.base, self.rank, self.world_size, self.seed = base, rank, world_size, seed
        self.epoch = 0
        try:
            total = len(base)
        except TypeError:
            total = None
        if total is not None and total < world_size:
            raise ValueError(f"train_data has {total} batches per epoch, fewer than the {world_size} ranks")
        self._per_rank = None if total is None else total // world_size
        self.positional = hasattr(base, "iter_from") or hasattr(base, "batch") or isinstance(base, Sequence)

    def __len__(self) -> int:
        if self._per_rank is None:
            raise TypeError("the underlying data has no length")
        return self._per_rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for target in (self.base, getattr(self.base, "sampler", None), getattr(self.base, "batch_sampler", None)):
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)

    def _indices(self, index: int) -> range:
        stop = None if self._per_rank is None else self._per_rank * self.world_size
        return range(self.rank + index * self.world_size, stop if stop is not None else 2**62, self.world_size)

    def iter_from(self, epoch: int, index: int) -> Iterator[Any]:
        if not self.positional:
            raise TypeError("iter_from needs a positional source (iter_from, batch, or a sequence)")
        self.epoch = epoch
        wanted = self._indices(index)
        base = self.base
        if hasattr(base, "batch"):
            return (base.batch(epoch, i) for i in wanted)
        if isinstance(base, Sequence) and not hasattr(base, "iter_from"):
            return (base[i] for i in wanted)
        return self._take(base.iter_from(epoch, index * self.world_size))

    def __iter__(self) -> Iterator[Any]:
        if self.positional:
            return self.iter_from(self.epoch, 0)
        return self._iterate_shared_order()

    def _iterate_shared_order(self) -> Iterator[Any]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rank_seed(self.seed, 0) * 7919 + self.epoch)
            it = iter(self.base)
            # A sampler draws its seed lazily, at the first batch: draw it under the shared seed.
            first = next(it, _END)
        return self._take(it if first is _END else itertools.chain([first], it))

    def _take(self, source: Iterator[Any]) -> Iterator[Any]:
        # Whole groups of W batches only: an incomplete last group is dropped on every rank, so
        # all ranks run the same number of windows even when the length is unknown.
        for group in zip(*[iter(source)] * self.world_size):
            yield group[self.rank]


_END = object()


def shard_data(data: Any, rank: int, world_size: int, seed: int = 0) -> Any:
    """Rule 7: ``data`` as rank ``rank`` sees it (unchanged on one rank or with a DistributedSampler)."""
    if world_size == 1:
        return data
    sampler = getattr(data, "sampler", None)
    if isinstance(sampler, torch.utils.data.distributed.DistributedSampler):
        return data
    return ShardedData(data, rank, world_size, seed)


# ---------------------------------------------------------------- model (rule 4)


def _broadcast_from_rank0(model: nn.Module) -> None:
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(t.data, src=0)


def wrap_model(model: nn.Module, mode: str, plan: Any = None, device: torch.device | None = None) -> tuple[nn.Module, nn.Module]:
    """Rule 4: ``(module, forward_module)`` for ``mode``, on an initialised process group.

    ``module`` owns the parameters (state dicts, the optimizer); ``forward_module`` is what the
    forward pass calls (the DDP wrapper; for FSDP2 the sharded module itself). ``plan`` is the
    precision plan: with FSDP2 the parameters and the gradient reduction stay float32 and the
    plan's autocast chooses the compute dtype per operation.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return model, model
    device = device or next(model.parameters()).device
    _broadcast_from_rank0(model)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel  # loaded when used (slow to import)

        ids = [device.index] if device.type == "cuda" and device.index is not None else None
        return model, DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh  # loaded when used (slow to import)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # fp32 parameters and reduction: numerics as on one device, autocast does the casting.
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    for unit in _shard_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, model


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules FSDP2 shards on their own: the root's children that forward calls.

    Containers are never called (their parameters are read directly), so a ``ModuleList`` or
    ``ModuleDict`` contributes its elements and a ``ParameterList``/``ParameterDict`` stays with
    the root, whose own unit covers every parameter not in a child unit.
    """
    units = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += [c for c in child.children() if _has_params(c)]
        elif not isinstance(child, (nn.ParameterList, nn.ParameterDict)) and _has_params(child):
            units.append(child)
    return units


# ---------------------------------------------------------------- the context


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def init_distributed(mode: str = "ddp", *, device: torch.device | None = None,
                     timeout_s: float = 300.0) -> DistributedContext:
    """Rule 1: join (or create) the process group for ``mode`` and return the context."""
    if mode not in MODES:
        raise ValueError(f"train.distributed must be one of {MODES}, got {mode!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    device = device or torch.device("cpu")
    if mode == "none":
        return DistributedContext("none", 0, 1, 0, device, owns_group=False, timeout_s=timeout_s)
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
                             timeout_s=timeout_s)
    if ctx.rank != 0:
        # Rule 9: only rank 0 reports progress; warnings and errors still show on every rank.
        logging.getLogger("torchimpl").setLevel(logging.WARNING)
    return ctx


class DistributedContext:
    """What the trainer needs to run on ``world_size`` ranks (identity hooks for ``none``)."""

    def __init__(self, mode: str, rank: int, world_size: int, local_rank: int, device: torch.device, *,
                 owns_group: bool, timeout_s: float):
        self.mode, self.rank, self.world_size, self.local_rank = mode, rank, world_size, local_rank
        self.device, self.owns_group, self.timeout_s = device, owns_group, timeout_s
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
        module, forward = self._collective("wrapping the model", lambda: wrap_model(model, self.mode, plan, self.device))
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
