"""The multi-rank training step: replicated data parallelism (DDP) and sharded parameters (FSDP2).

``W`` ranks share one loss scale. The conformance boundary is, as for one device, what backward
produces on each rank: its own scaled gradients (DDP), or the gradient shards each rank holds
after FSDP2's reduce-scatter. Rules:

1. DDP averages while reducing (`reference.grad_reduction` states every wire dtype and hook): each rank multiplies its gradient by ``f32(1 / W)`` in float32
   (one rounding, *before* the sum), and the products are added in float32 in rank order. So a
   subnormal can vanish in the pre-division, and two finite halves never overflow the sum. For
   two ranks the order of the addition does not matter (float addition is commutative); with
   more, gloo and NCCL choose their own ring order, and the spec pins no bits beyond two ranks.
   An inf or NaN on any rank reaches every rank through the sum.
2. Gradients can still change on one rank after the reduction (a hook, a callback, a bug). The
   spec takes each rank's post-reduction gradients as given and never assumes the replicas agree.
3. ``found_inf`` is checked by every rank on its own scaled gradients (or shards), and on them
   unscaled (`reference.step` rule 2), by `reference.scaling.has_inf_or_nan`, and combined by
   logical OR over the ranks, once per step, before the step decision; it is also set when the
   window's loss averaged over the ranks is not finite (``loss_finite``). Every rank skips, or none
   does. A scale the update collapses ends the run (`reference.step` rule 5).
4. Global norm, DDP: every rank takes `reference.clipping.total_norm` of its unscaled gradients.
   They are the reduced, replicated gradients, so the norm is the one-device norm of the average,
   the same on every rank whenever the step is applied (rule 2 changes only skipped steps).
5. Global norm, FSDP2 (torch's ``_NormPartial`` over DTensor shards, measured on torch 2.13):
   per parameter ``i``, rank ``r`` computes the norm of its own shard ``n[r][i]``
   (`reference.clipping.tensor_norm`, torch_cpu order); the parameter's global norm is
   ``f32(sqrt(s))`` where ``s`` adds ``f32(n[r][i] * n[r][i])`` in float32 in rank order (an
   all-reduce SUM of squared partial norms); the total is `reference.clipping.total_norm` of the
   vector of these global per-parameter norms, which every rank evaluates on the same values. It
   is not the norm of the concatenated gradient: each shard's sum of squares is rounded to a
   norm and squared again, which can move the result by an ULP. A rank holding no rows of a
   parameter contributes 0.
6. FSDP2 shards every parameter along dim 0 like ``torch.chunk``: ``ceil(n / W)`` rows per rank,
   the last ranks getting fewer (possibly none) (`shard_rows`).
7. The clip coefficient follows `reference.clipping` from the global total; each rank multiplies
   its own gradients or shards by it. The optimizer runs on every rank only if the combined
   ``found_inf`` is false; its update is elementwise, so updating shards equals updating the
   whole parameter.
8. One scale update per step from the combined ``found_inf`` (`reference.scaling.update_scale`):
   every rank ends the step with the same scale and growth tracker.
9. Accumulation over a window of ``k`` microbatches, DDP: each rank sums its own microbatch
   gradients locally, as autograd accumulates ``.grad`` (`reference.step.accumulate_gradients`),
   and rule 1 reduces the window's sum once, after the last backward (DDP's ``no_sync`` for all
   but the last microbatch). This is not the result of reducing every microbatch: the
   pre-division and the cross-rank sum round once per window, so a gradient that a per-microbatch
   reduction would flush to zero can survive (`ddp_window`). FSDP2 reduce-scatters every
   microbatch; its step starts from the shards each rank holds after the window (rule 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reference import clipping, scaling
from reference.step import (
    ScaleCollapsedError,
    StepConfig,
    StepRecord,
    TrainState,
    accumulate_gradients,
    optimizer_step,
    scale_collapsed,
)

__all__ = [
    "DistributedStepResult",
    "ddp_average",
    "ddp_step",
    "ddp_window",
    "found_inf_across_ranks",
    "fsdp_step",
    "shard_rows",
    "sharded_total_norm",
]


@dataclass(frozen=True)
class DistributedStepResult:
    """One multi-rank step: the shared new state, its record, and what each rank's optimizer saw.

    ``rank_grads[r]`` are rank ``r``'s unscaled, clipped gradients (DDP: whole tensors; FSDP2:
    its shards), even on a skipped step.
    """

    state: TrainState
    record: StepRecord
    rank_grads: tuple[tuple[np.ndarray, ...], ...]


def _check_ranks(per_rank: Sequence[Sequence[np.ndarray]], name: str) -> list[list[np.ndarray]]:
    ranks = [list(g) for g in per_rank]
    if not ranks:
        raise ValueError(f"{name} must hold one list of gradients per rank, got no ranks")
    n = len(ranks[0])
    for r, grads in enumerate(ranks):
        if len(grads) != n:
            raise ValueError(f"{name}: rank {r} has {len(grads)} gradients, rank 0 has {n}")
    return ranks


def ddp_average(per_rank_grads: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """Rule 1: the gradients every DDP rank holds after backward.

    ``per_rank_grads[r][i]``: float32 gradient ``i`` of rank ``r`` (all ranks the same shapes).
    Returns ``sum_r f32(g[r][i] * f32(1 / W))`` summed in float32 in rank order; new arrays.
    """
    ranks = _check_ranks(per_rank_grads, "per_rank_grads")
    world = len(ranks)
    inv = np.float32(1.0 / world)
    out = []
    for i in range(len(ranks[0])):
        shapes = {np.shape(g[i]) for g in ranks}
        if len(shapes) != 1:
            raise ValueError(f"gradient {i} has different shapes on different ranks: {sorted(shapes)}")
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            total = np.asarray(ranks[0][i], dtype=np.float32) * inv
            for grads in ranks[1:]:
                total = total + np.asarray(grads[i], dtype=np.float32) * inv
        out.append(total.astype(np.float32))
    return out


def ddp_window(per_rank_microbatch_grads: Sequence[Sequence[Sequence[np.ndarray]]]) -> list[np.ndarray]:
    """Rule 9: the gradients every DDP rank holds after the last backward of an accumulation window.

    ``per_rank_microbatch_grads[r][m][i]``: float32 gradient ``i`` that rank ``r``'s backward of
    microbatch ``m`` produced. Each rank's microbatches are summed locally, then reduced once
    (`ddp_average`).
    """
    if not per_rank_microbatch_grads:
        raise ValueError("per_rank_microbatch_grads must hold one list of microbatches per rank, got no ranks")
    return ddp_average([accumulate_gradients(mbs) for mbs in per_rank_microbatch_grads])


def found_inf_across_ranks(per_rank_grads: Sequence[Sequence[np.ndarray]]) -> bool:
    """Rule 3: True when any rank holds an inf or NaN in any of its (scaled) gradients."""
    ranks = _check_ranks(per_rank_grads, "per_rank_grads")
    return any(scaling.has_inf_or_nan(grads) for grads in ranks)


def shard_rows(array: np.ndarray, world_size: int) -> list[np.ndarray]:
    """Rule 6: the dim-0 shards of ``array`` on ``world_size`` ranks, as FSDP2 lays them out.

    ``ceil(rows / W)`` rows per rank in rank order; the last ranks may get fewer or none (an
    empty array with the remaining dimensions). A 0-d array is treated as one row.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    a = np.asarray(array)
    if a.ndim == 0:
        a = a.reshape(1)
    per = -(-a.shape[0] // world_size) if a.shape[0] else 0
    return [a[min(r * per, a.shape[0]): min((r + 1) * per, a.shape[0])] for r in range(world_size)]


def sharded_total_norm(per_rank_shards: Sequence[Sequence[np.ndarray]], norm_type: float = 2.0) -> np.float32:
    """Rule 5: the global L2 norm FSDP2's ``clip_grad_norm_`` computes over float32 shards.

    ``per_rank_shards[r][i]`` is rank ``r``'s shard of (unscaled) gradient ``i``. NaN and inf
    propagate as in `reference.clipping`. Only ``norm_type=2`` is modelled: torch reduces inf
    norms with a max, whose order does not matter, and other orders are not pinned down.
    """
    if norm_type != 2.0:
        raise ValueError(f"norm_type must be 2.0 (the modelled FSDP2 reduction), got {norm_type!r}")
    ranks = _check_ranks(per_rank_shards, "per_rank_shards")
    per_param = []
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(len(ranks[0])):
            s = np.float32(0.0)
            for r, shards in enumerate(ranks):
                shard = np.asarray(shards[i])
                if shard.dtype != np.float32:
                    raise ValueError(f"rank {r} gradient {i}: dtype must be float32, got {shard.dtype}")
                n = clipping.tensor_norm(shard, 2.0) if shard.size else np.float32(0.0)
                s = np.float32(s + np.float32(n * n))
            per_param.append(np.float32(np.sqrt(s)))
    if not per_param:
        return np.float32(0.0)
    return np.float32(clipping.total_norm([np.array(per_param, dtype=np.float32)], 2.0))


def _unscale(grads: list[np.ndarray], state: scaling.ScalerState, use_scaler: bool) -> list[np.ndarray]:
    if not use_scaler:
        return [np.array(g, copy=True) for g in grads]
    return scaling.unscale_gradients(grads, state)[0]


def _finish(
    state: TrainState,
    config: StepConfig,
    found: bool,
    full_grads: list[np.ndarray],
    rank_grads: list[list[np.ndarray]],
    grad_norm: float | None,
    clip_coef: float | None,
    microbatches: int,
) -> DistributedStepResult:
    lr = config.lr_at(state.applied_steps)
    params, opt_state = state.params, state.opt_state
    if not found:
        params, _, opt_state = optimizer_step(params, full_grads, opt_state, config, lr)
    new_scaler = scaling.update_scale(state.scaler, found, config.scaler) if config.use_scaler else state.scaler
    if scale_collapsed(new_scaler.scale):
        raise ScaleCollapsedError(state.step, float(new_scaler.scale))
    record = StepRecord(
        step=state.step, microbatches=microbatches, scale_before=float(state.scaler.scale), found_inf=found,
        applied=not found, grad_norm=grad_norm, clip_coef=clip_coef, scale_after=float(new_scaler.scale),
        growth_tracker=int(new_scaler.growth_tracker), lr=float(lr),
    )
    new_state = TrainState(params=tuple(params), opt_state=opt_state, scaler=new_scaler, step=state.step + 1,
                           applied_steps=state.applied_steps + int(not found))
    return DistributedStepResult(new_state, record, tuple(tuple(g) for g in rank_grads))


def _check_config(config: StepConfig) -> None:
    if config.optimizer_kind != "for-loop":
        raise ValueError(f"optimizer_kind must be 'for-loop' for a multi-rank step, got {config.optimizer_kind!r}")
    if config.clip_norm is not None and config.norm_type != 2.0:
        raise ValueError(f"norm_type must be 2.0 for a multi-rank step, got {config.norm_type!r}")


def ddp_step(
    state: TrainState,
    per_rank_scaled_grads: Sequence[Sequence[np.ndarray]],
    config: StepConfig,
    *,
    after_reduction: Sequence[Sequence[np.ndarray] | None] | None = None,
    microbatches: int = 1,
    loss_finite: bool = True,
) -> DistributedStepResult:
    """One DDP step (rules 1-4, 7-9) from each rank's own scaled float32 gradients.

    ``per_rank_scaled_grads[r]`` is what rank ``r`` holds before the reduction: its window's
    microbatch gradients summed locally (rule 9; the gradient itself when ``microbatches`` is 1).

    ``after_reduction[r]``, when given and not None, replaces rank ``r``'s reduced gradients (a
    change made after DDP's all-reduce, rule 2). If the combined ``found_inf`` is false, the
    ranks' gradients must be equal (replicas that apply different finite gradients drift apart,
    which the spec refuses to model): ValueError otherwise.
    """
    _check_config(config)
    ranks = _check_ranks(per_rank_scaled_grads, "per_rank_scaled_grads")
    if len(ranks[0]) != len(state.params):
        raise ValueError(f"got {len(ranks[0])} gradients per rank for {len(state.params)} parameters")
    reduced = ddp_average(ranks)
    held = [list(reduced) for _ in ranks]
    if after_reduction is not None:
        if len(after_reduction) != len(ranks):
            raise ValueError(f"after_reduction must have one entry per rank ({len(ranks)}), got {len(after_reduction)}")
        for r, grads in enumerate(after_reduction):
            if grads is not None:
                held[r] = [np.asarray(g, dtype=np.float32) for g in grads]
    found = found_inf_across_ranks(held)
    unscaled = [_unscale(g, state.scaler, config.use_scaler) for g in held]
    if not found:
        for r in range(1, len(held)):
            if any(a.tobytes() != b.tobytes() for a, b in zip(held[0], held[r])):
                raise ValueError(f"rank {r}'s finite gradients differ from rank 0's after the reduction")
    found = found or not loss_finite or found_inf_across_ranks(unscaled)  # rule 3
    grad_norm = clip_coef = None
    if config.clip_norm is not None:
        results = [clipping.clip_grad_norm(g, config.clip_norm, 2.0, order=config.clip_order) for g in unscaled]
        unscaled = [list(res.grads) for res in results]
        grad_norm, clip_coef = float(results[0].total_norm), float(results[0].clip_coef)
    return _finish(state, config, found, unscaled[0], unscaled, grad_norm, clip_coef, microbatches)


def fsdp_step(
    state: TrainState,
    per_rank_scaled_shards: Sequence[Sequence[np.ndarray]],
    config: StepConfig,
    *,
    microbatches: int = 1,
    loss_finite: bool = True,
) -> DistributedStepResult:
    """One FSDP2 step (rules 3, 5-8) from each rank's reduced, scaled float32 gradient shards.

    ``per_rank_scaled_shards[r][i]`` is rank ``r``'s dim-0 shard of gradient ``i`` (rule 6
    shapes), as it holds it after the reduce-scatter and after any later change (rule 2).
    """
    _check_config(config)
    ranks = _check_ranks(per_rank_scaled_shards, "per_rank_scaled_shards")
    world = len(ranks)
    if len(ranks[0]) != len(state.params):
        raise ValueError(f"got {len(ranks[0])} shards per rank for {len(state.params)} parameters")
    for i, p in enumerate(state.params):
        want = [s.shape for s in shard_rows(p, world)]
        got = [np.shape(ranks[r][i]) for r in range(world)]
        if want != got:
            raise ValueError(f"parameter {i} of shape {p.shape}: shard shapes must be {want}, got {got}")
    found = found_inf_across_ranks(ranks)
    unscaled = [_unscale([np.asarray(g, dtype=np.float32) for g in shards], state.scaler, config.use_scaler)
                for shards in ranks]
    found = found or not loss_finite or found_inf_across_ranks(unscaled)  # rule 3
    grad_norm = clip_coef = None
    if config.clip_norm is not None:
        total = sharded_total_norm(unscaled)
        # reference.clipping's rules 4 and 5 (reciprocal, multiply, clamp) on the global total.
        coef = clipping._coefficient(np.float32(total), float(config.clip_norm))
        with np.errstate(over="ignore", invalid="ignore"):
            unscaled = [[(g * coef).astype(np.float32) for g in shards] for shards in unscaled]
        grad_norm, clip_coef = float(total), float(coef)
    full = [np.concatenate([unscaled[r][i] for r in range(world)]).reshape(p.shape)
            for i, p in enumerate(state.params)]
    return _finish(state, config, found, full, unscaled, grad_norm, clip_coef, microbatches)

