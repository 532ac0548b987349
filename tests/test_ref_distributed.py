from __future__ import annotations

import numpy as np
import pytest

from reference import clipping, optim, scaling, step
from reference.distributed import (
    ddp_average,
    ddp_step,
    ddp_window,
    found_inf_across_ranks,
    fsdp_step,
    shard_rows,
    sharded_total_norm,
)

F32 = np.float32
TINY = F32(2.0**-149)


def _cfg(clip=None, scaler=None):
    return step.StepConfig(optimizer=optim.SGDConfig(lr=0.1), scaler=scaler or scaling.ScalerConfig(init_scale=4.0),
                           clip_norm=clip)


def _grads(seed, shapes=((5, 3), (4,))):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(F32) for s in shapes]


def test_ddp_average_divides_each_rank_before_the_sum():
    # Pre-division: the smallest subnormal halves to 0 on both ranks (a post-division would keep
    # it), and two near-max values stay finite (a post-division would overflow first).
    a = np.array([TINY, 3e38, 2.0**-148], dtype=F32)
    b = np.array([TINY, 3e38, 0.0], dtype=F32)
    out = ddp_average([[a], [b]])[0]
    assert out.tolist() == [0.0, np.float32(3e38), float(TINY)], f"averaged {out.tolist()}"
    assert out.dtype == np.float32


def test_ddp_average_spreads_inf_and_nan_to_every_rank():
    a = np.array([np.inf, 1.0], dtype=F32)
    b = np.array([1.0, np.nan], dtype=F32)
    out = ddp_average([[a], [b]])[0]
    assert np.isinf(out[0]) and np.isnan(out[1])


def test_ddp_average_on_one_rank_is_the_identity():
    g = _grads(1)
    for got, want in zip(ddp_average([g]), g):
        assert got.tobytes() == want.tobytes()


def test_ddp_window_reduces_the_local_sums_once():
    rng = np.random.default_rng(7)
    per_rank = [[rng.standard_normal(4).astype(F32) for _ in range(3)] for _ in range(2)]
    want = ddp_average([[step.accumulate_gradients([[g] for g in mbs])[0]] for mbs in per_rank])[0]
    got = ddp_window([[[g] for g in mbs] for mbs in per_rank])[0]
    assert got.tobytes() == want.tobytes()
    # The smallest subnormal on both ranks in both microbatches: a reduction per microbatch
    # halves it to 0 each time (ties to even); the window's local sum 2 * TINY halves to TINY on
    # each rank, and the ranks' halves add up to 2 * TINY.
    tiny = [[np.array([TINY], F32)], [np.array([TINY], F32)]]
    per_microbatch = ddp_average([tiny[0], tiny[0]])[0] + ddp_average([tiny[1], tiny[1]])[0]
    assert per_microbatch.tolist() == [0.0]
    assert ddp_window([tiny, tiny])[0].tolist() == [float(F32(2 * TINY))]


def test_found_inf_is_an_or_over_ranks():
    clean, bad = _grads(2), _grads(2)
    bad[1][2] = np.nan
    assert found_inf_across_ranks([clean, bad]) and found_inf_across_ranks([bad, clean])
    assert not found_inf_across_ranks([clean, clean])


@pytest.mark.parametrize("rows,world,want", [(7, 2, [4, 3]), (1, 2, [1, 0]), (6, 4, [2, 2, 2, 0]), (5, 1, [5])])
def test_shard_rows_follows_torch_chunk(rows, world, want):
    shards = shard_rows(np.arange(rows * 3, dtype=F32).reshape(rows, 3), world)
    assert [s.shape[0] for s in shards] == want
    assert np.concatenate(shards).tolist() == np.arange(rows * 3, dtype=F32).reshape(rows, 3).tolist()


def test_shard_rows_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        shard_rows(np.zeros(3, F32), 0)


def test_sharded_norm_on_one_rank_is_the_one_device_norm():
    # sqrt(f32(n * n)) == n for every float32 n whose square neither overflows nor underflows.
    g = _grads(3, ((33, 5), (17,), (1,)))
    assert sharded_total_norm([g]) == clipping.total_norm(g)


def test_sharded_norm_is_the_global_norm_within_a_few_ulp():
    g = _grads(4, ((33, 5), (17,)))
    shards = [[shard_rows(x, 2)[r] for x in g] for r in range(2)]
    got = sharded_total_norm(shards)
    exact = clipping.total_norm(g, order="exact")
    # Three float32 roundings per parameter (shard norm, its square, the sum) on top of the
    # one-device order's own drift: measured well within 4 ULP on arrays this small.
    assert abs(int(got.view(np.int32)) - int(np.float32(exact).view(np.int32))) <= 4, (got, exact)


def test_sharded_norm_propagates_inf_and_nan():
    g = _grads(5)
    shards = [[shard_rows(x, 2)[r] for x in g] for r in range(2)]
    shards[1][0] = shards[1][0].copy()
    shards[1][0][0, 0] = np.inf
    assert np.isinf(sharded_total_norm(shards))
    shards[0][1] = shards[0][1].copy()
    shards[0][1][0] = np.nan
    assert np.isnan(sharded_total_norm(shards))


def test_ddp_step_with_equal_ranks_is_the_one_device_step():
    g = _grads(6)
    cfg = _cfg(clip=0.5)
    st = step.init_train_state([np.ones(s.shape, F32) for s in g], cfg)
    scaled = [(x * st.scaler.scale).astype(F32) for x in g]
    one = step.train_step(st, scaled, cfg)
    two = ddp_step(st, [scaled, scaled], cfg)
    assert two.record == one.record
    for a, b in zip(two.state.params, one.state.params):
        assert a.tobytes() == b.tobytes()


def test_ddp_step_inf_after_the_reduction_on_one_rank_skips_every_rank():
    g = _grads(7)
    cfg = _cfg(clip=1.0)
    st = step.init_train_state([np.ones(s.shape, F32) for s in g], cfg)
    poisoned = [x.copy() for x in ddp_average([g, g])]
    poisoned[0][1, 1] = np.inf
    res = ddp_step(st, [g, g], cfg, after_reduction=[None, poisoned])
    assert res.record.found_inf and not res.record.applied
    assert res.state.scaler.scale == F32(2.0), f"scale after one overflow: {res.state.scaler.scale}"
    for a, b in zip(res.state.params, st.params):
        assert a.tobytes() == b.tobytes(), "a skipped step changed the parameters"


def test_ddp_step_refuses_finite_replicas_that_differ():
    g = _grads(8)
    cfg = _cfg()
    st = step.init_train_state([np.ones(s.shape, F32) for s in g], cfg)
    other = [x + 1 for x in ddp_average([g, g])]
    with pytest.raises(ValueError, match="rank 1's finite gradients differ"):
        ddp_step(st, [g, g], cfg, after_reduction=[None, other])


def test_fsdp_step_without_clipping_equals_the_one_device_step():
    g = _grads(9, ((7, 3), (5,)))
    cfg = _cfg(scaler=scaling.ScalerConfig(init_scale=8.0, growth_interval=1))
    st = step.init_train_state([np.ones(s.shape, F32) for s in g], cfg)
    scaled = [(x * st.scaler.scale).astype(F32) for x in g]
    shards = [[shard_rows(x, 2)[r] for x in scaled] for r in range(2)]
    one = step.train_step(st, scaled, cfg)
    two = fsdp_step(st, shards, cfg)
    assert two.record == one.record
    for a, b in zip(two.state.params, one.state.params):
        assert a.tobytes() == b.tobytes()


def test_fsdp_step_inf_in_one_shard_skips_and_backs_off_once():
    g = _grads(10, ((7, 3), (5,)))
    cfg = _cfg(clip=1.0)
    st = step.init_train_state([np.ones(s.shape, F32) for s in g], cfg)
    shards = [[shard_rows(x, 2)[r].copy() for x in g] for r in range(2)]
    shards[1][1][0] = np.nan
    res = fsdp_step(st, shards, cfg)
    assert res.record.found_inf and res.state.scaler.scale == F32(2.0)
    assert np.isnan(res.record.grad_norm)
    for a, b in zip(res.state.params, st.params):
        assert a.tobytes() == b.tobytes()


def test_fsdp_step_checks_shard_shapes():
    g = _grads(11, ((7, 3),))
    cfg = _cfg()
    st = step.init_train_state([np.ones((7, 3), F32)], cfg)
    with pytest.raises(ValueError, match=r"shard shapes must be \[\(4, 3\), \(3, 3\)\]"):
        fsdp_step(st, [[g[0][:3]], [g[0][3:]]], cfg)
