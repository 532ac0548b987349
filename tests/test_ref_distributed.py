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


# ---------------------------------------------------------------- gradient reductions (reference.grad_reduction)

from reference import grad_reduction as gr  # noqa: E402

BF16 = gr.WIRE_DTYPES["bf16"]


def _f(*v) -> np.ndarray:
    return np.array(v, dtype=F32)


def test_two_rank_sum_rounds_once_to_the_wire_dtype():
    # bf16 keeps 8 significant bits: 1 + 2^-8 is the tie between 1 and 1 + 2^-7 (even: 1);
    # 1 + 3 * 2^-9 is past it (1 + 2^-7); float32 keeps both exactly.
    a, b = _f(1.0, 1.0), _f(2.0**-8, 3 * 2.0**-9)
    assert gr.gloo_sum([a, b], "bf16").astype(F32).tolist() == [1.0, 1.0078125]
    assert gr.gloo_sum([a, b], "fp32").tolist() == [1.00390625, 1.005859375]
    assert gr.gloo_sum([b, a], "bf16").tobytes() == gr.gloo_sum([a, b], "bf16").tobytes()


def test_gloo_sum_refuses_an_unfixed_order():
    with pytest.raises(ValueError, match="no order of additions for 3 ranks"):
        gr.gloo_sum([_f(1.0)] * 3, "bf16")


def test_ddp_compress_hook_divides_in_the_wire_dtype_before_the_sum():
    # bf16: 1/2 = 0.5 and 2^-8 / 2 = 2^-9, half an ULP of 0.5: the tie rounds to 0.5; float32
    # DDP keeps 0.5 + 2^-9.
    g0, g1 = _f(1.0), _f(2.0**-8)
    assert gr.reduce([g0, g1], gr.ddp_compress_hook("bf16", 2)).tolist() == [0.5]
    assert gr.reduce([g0, g1], gr.ddp_default(2)).tolist() == [0.501953125]
    assert gr.reduce([g0, g1], gr.ddp_default(2)).tobytes() == ddp_average([[g0], [g1]])[0].tobytes()
    # fp16: the smallest subnormal 2^-24 halves to the tie 2^-25, which rounds to 0 on each rank
    # (pre-division); 65504 halves to 32752 and the sum stays finite.
    tiny, big = _f(2.0**-24, 65504.0), _f(2.0**-24, 65504.0)
    assert gr.reduce([tiny, big], gr.ddp_compress_hook("fp16", 2)).tolist() == [0.0, 65504.0]


def test_avg_divides_the_rounded_sum():
    # Rule 4: the fp16 sum 131008 overflows before the division (float32 arithmetic gives 65504);
    # 2^-24 + 2^-24 = 2^-23 halves back to 2^-24 (a pre-division would give 0).
    red = gr.Reduction("fp16", 2, post=2.0, op="avg")  # all_reduce(op=AVG) of fp16 tensors on gloo
    x = _f(65504.0, 2.0**-24)
    assert gr.reduce([x, x], red).tolist() == [np.inf, 2.0**-24]
    # bf16 AVG: 1 + 2^-8 ties to 1, then 0.5.
    avg = gr.fsdp2_reduction("bf16", 2)
    assert avg.op == "avg" and gr.reduce([_f(1.0), _f(2.0**-8)], avg).tolist() == [0.5]


def test_fsdp2_fp16_splits_the_division_as_torch_does():
    assert gr.fsdp2_divide_factors("fp16", 2) == (2.0, 1.0, "sum")
    assert gr.fsdp2_divide_factors("fp16", 4) == (2.0, 2.0, "sum")
    assert gr.fsdp2_divide_factors("fp16", 8) == (4.0, 2.0, "sum")
    assert gr.fsdp2_divide_factors("fp16", 6) == (4.0, 1.5, "sum")  # 6 % 4 != 0 stops the doubling
    assert gr.fsdp2_divide_factors("bf16", 2) == (None, None, "avg")
    assert gr.fsdp2_divide_factors("fp32", 1) == (None, None, "sum")
    assert gr.fsdp2_divide_factors("fp32", 4, factor=4) == (None, None, "avg")
    assert gr.fsdp2_divide_factors("fp32", 4, factor=8) == (None, None, "premul_sum")
    assert gr.fsdp2_divide_factors("bf16", 4, force_sum=True) == (None, 4.0, "sum")
    # fp16 at 2 ranks: pre-division by 2, the same arithmetic as DDP's fp16 hook.
    red = gr.fsdp2_reduction("fp16", 2)
    assert red.pre == ("div", 2.0) and red.post == 1.0
    x = _f(2.0**-24, 65504.0, 3.0)
    assert gr.reduce([x, x], red).tobytes() == gr.reduce([x, x], gr.ddp_compress_hook("fp16", 2)).tobytes()


def test_premul_sum_is_not_on_gloo():
    red = gr.fsdp2_reduction("fp32", 2, factor=4.0)
    assert red.op == "premul_sum" and not red.runs_on_gloo
    # 1/4 in the wire dtype, times each rank's value, then the sum.
    assert gr.reduce([_f(1.0), _f(3.0)], red).tolist() == [1.0]
    assert gr.fsdp2_reduction("fp32", 2).runs_on_gloo


def test_wire_cast_rounds_first():
    # Rule 1a: an fp32 gradient below half the smallest fp16 subnormal is 0 on the wire; one past
    # 65519.99 (max plus half a spacing) is inf.
    red = gr.ddp_compress_hook("fp16", 2)
    g = _f(1e-8, 70000.0)
    assert gr.reduce([g, g], red).tolist() == [0.0, np.inf]


def test_three_ranks_have_one_result_per_order_and_an_envelope():
    # 1 + 2^-8 + 2^-8 in bf16: (1 + 2^-8) ties to 1, so adding 1 first loses both; the two small
    # ones first give 2^-7 exactly, then 1 + 2^-7.
    vals = [_f(1.0), _f(2.0**-8), _f(2.0**-8)]
    got = sorted({float(v) for v in gr.sum_candidates(vals, "bf16").astype(F32).ravel()})
    assert got == [1.0, 1.0078125]
    # Envelope: two roundings, B = (1 + 2^-7)(1 + 2^-8) rounds up to 1.015625, ULP 2^-7: 2^-7.
    # The worst order (result 1.0) is exactly that far from 1 + 2^-7.
    assert gr.sum_envelope(vals, "bf16").tolist() == [2.0**-7]
    red = gr.Reduction("bf16", 3, op="sum")
    assert sorted(set(gr.reduce_candidates(vals, red).ravel().tolist())) == [1.0, 1.0078125]


def test_every_order_lies_inside_the_envelope():
    rng = np.random.default_rng(3)
    for wire in ("fp32", "bf16", "fp16"):
        for w in (3, 4, 5):
            vals = [(rng.standard_normal(400) * np.exp2(rng.integers(-8, 8, 400))).astype(F32) for _ in range(w)]
            wired = [gr.to_wire(v, wire).astype(np.float64) for v in vals]
            exact = np.sum(np.stack(wired), axis=0)  # float64 is exact here (W <= 5, 24-bit inputs, 16 binades)
            err = np.abs(gr.sum_candidates(vals, wire).astype(np.float64) - exact).max(axis=0)
            env = gr.sum_envelope(vals, wire)
            assert (err <= env).all(), f"{wire} W={w}: error {err[err > env][:3]} beyond {env[err > env][:3]}"
            # The envelope is not loose: some order comes within a factor 4 of it somewhere.
            assert (err > env / 4).any()


def test_reduction_refuses_bad_input():
    with pytest.raises(ValueError, match="wire must be one of"):
        gr.Reduction("fp8", 2)
    with pytest.raises(ValueError, match="from 3 ranks for a reduction over 2"):
        gr.reduce([_f(1.0)] * 3, gr.ddp_default(2))
    with pytest.raises(ValueError, match="compress hooks send bf16 or fp16"):
        gr.ddp_compress_hook("fp32", 2)
    with pytest.raises(ValueError, match="differ in shape"):
        gr.reduce([_f(1.0), _f(1.0, 2.0)], gr.ddp_default(2))
