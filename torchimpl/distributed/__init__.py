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
   ``MixedPrecisionPolicy`` that keeps fp32 parameters (rule 11 sets its parameter and reduce
   dtypes; by default the parameters' own dtype and fp32): autocast picks the compute dtype per
   operation exactly as on one device.
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
11. The gradient reduction (``train.reduce_dtype``, `reduction`): ``fp32`` reduces in float32
   (DDP's own averaging; FSDP2 with ``reduce_dtype=float32``); ``bf16`` is FSDP2's
   ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` or DDP's ``bf16_compress_hook``. A
   combination torch cannot run (the bf16 hook without CUDA and NCCL >= 2.10) is refused before
   the process group is used, naming the field. FSDP2's parameter dtype comes from the precision
   mode (`reduction_settings`): parameters held in bf16 with an fp32 master copy are
   ``param_dtype=torch.bfloat16`` over fp32 shards. ``reference.grad_reduction`` states what
   each reduction rounds.

Holds: the context (``context``), the data shards and seeds (``data``), the wrapped model
(``model``), the reduction settings (``reduction``).

May import: ``run`` (checkpoint files) and ``config`` (its errors). Imported by ``train``.
"""

from __future__ import annotations

from torchimpl.distributed.context import (
    DistributedContext,
    DistributedError,
    config_differences,
    init_distributed,
    launch_rank,
)
from torchimpl.distributed.data import ShardedData, rank_seed, shard_data
from torchimpl.distributed.model import MODES, wrap_model
from torchimpl.distributed.reduction import ReductionSettings, reduction_problems, reduction_settings

__all__ = [
    "MODES",
    "DistributedContext",
    "DistributedError",
    "ReductionSettings",
    "ShardedData",
    "config_differences",
    "reduction_settings",
    "init_distributed",
    "launch_rank",
    "rank_seed",
    "reduction_problems",
    "shard_data",
    "wrap_model",
]
