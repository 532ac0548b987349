"""Conformance of the multi-rank step: the trainer on a 2-rank gloo group against reference.distributed.

Two worker processes join one gloo group on 127.0.0.1 once per module and stay up
(`conformance.multiproc`); Hypothesis draws each case here in the parent, sends it to both
workers, which run ``Trainer.fit`` on it (DDP or FSDP2, 1 to 3 microbatches per step) and send
back what every step left behind. Each rank's microbatch data is a gradient ``G`` (the model's
loss is ``sum(p * G)``), so backward gives exactly ``f32(G * f32(scale / k))`` and the reference
receives the gradients backward produced. Inf and NaN are planted on a random subset of ranks and
at random points: in ``G`` (before the gradient reduction) and in the gradients after backward
(after the reduction, from a callback). Properties, per step and per rank:

0. DDP's gradients after the window equal the reference's local sums reduced once (rule 9 of
   reference.distributed: ``no_sync`` accumulation), bit for bit;

1. every rank makes the reference's skip decision (the OR over ranks) and ends the step with
   the reference's scale and growth tracker;
2. parameters are identical across ranks (DDP) and equal the reference bit for bit (DDP and
   FSDP2, whose shards are put back together here);
3. rank 0's gradient norm equals the reference's (NaN as a class).

"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance.multiproc import rank_group
from reference import optim, scaling, step
from reference.distributed import ddp_step, ddp_window, fsdp_step, shard_rows

WORLD = 2
SHAPES = ((3, 2), (3,))
WAIT_S = 90.0


# ---------------------------------------------------------------- the ranks


def _run_case(rank: int, case: dict) -> dict:
    import torch
    from torch import nn

    from torchimpl.config.schema import load_config
    from torchimpl.train.trainer import Callback, Trainer

    class Planted(nn.Module):
        def __init__(self, init):
            super().__init__()
            self.ps = nn.ParameterList([nn.Parameter(torch.from_numpy(a.copy())) for a in init])

        def forward(self, g):
            return sum((p * gi).sum() for p, gi in zip(self.ps, g))

    class Probe(Callback):
        def __init__(self):
            self.steps = []
            self.shards = []
            self.losses = []

        def on_after_backward(self, trainer, state):
            for where, r, i, flat, value in case["after"]:
                if where == state.step and r == rank:
                    g = trainer.params[i].grad
                    local = g.to_local() if hasattr(g, "to_local") else g
                    if local.numel():
                        local.view(-1)[flat % local.numel()] = value
            self.shards.append([_local(p.grad).numpy().copy() for p in trainer.params])
            self.losses.append(float(trainer.engine.loss_acc))  # this rank's float32 window sum

        def on_step_end(self, trainer, state):
            sc = trainer.scaler
            norm = trainer.grad_norm
            self.steps.append({
                "found": float(trainer.found_inf), "scale": float(sc._scale), "tracker": int(sc._growth_tracker),
                "params": [_local(p.detach()).numpy().copy() for p in trainer.params],
                "norm": None if norm is None else float(norm),
            })

    def _local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    cfg = load_config(overrides=[
        f"train.distributed={case['mode']}", "device=cpu", "precision.mode=fp32", "train.force_scaler=true",
        f"train.steps={len(case['grads'])}", f"train.microbatches={case['microbatches']}", "train.log_interval=1000", "optimizer.name=sgd",
        f"optimizer.lr={case['lr']}", "optimizer.weight_decay=0.0", "schedule.name=constant",
        f"scaler.init_scale={case['init_scale']}", f"scaler.growth_interval={case['growth_interval']}",
        f"train.clip_norm={'null' if case['clip'] is None else case['clip']}", "train.distributed_timeout_s=60",
        f"train.reduce_dtype={case.get('reduce_dtype', 'fp32')}",
    ])
    # Batch (s * k + m) * W + r is rank r's microbatch m of step s (rank r gets every W-th batch).
    k = case["microbatches"]
    data = [[torch.from_numpy(g) for g in case["grads"][s][r][m]] for s in range(len(case["grads"]))
            for m in range(k) for r in range(WORLD)]
    probe = Probe()
    Trainer(cfg, [probe]).fit(Planted(case["init"]), data, loss_fn=lambda m, b: m(b))
    return {"steps": probe.steps, "shards": probe.shards, "losses": probe.losses}


def _dispatch(rank: int, job: dict):
    """One group serves every job of this module: the trainer's cases and the reductions'."""
    kind = job.get("kind", "trainer")
    if kind == "trainer":
        return _run_case(rank, job)
    return _REDUCTION_JOBS[kind](rank, job)


@pytest.fixture(scope="module")
def ranks():
    with rank_group(_dispatch, WORLD, wait_s=WAIT_S) as run:
        yield run


@pytest.fixture(scope="module")
def group(ranks):
    return lambda case: ranks(case, check=True)


# ---------------------------------------------------------------- the cases


def _values(n: int):
    # Mostly ordinary values; a rare huge one overflows once scaled, a rare tiny one is subnormal.
    finite = st.floats(-4.0, 4.0, width=32)
    rare = st.sampled_from([3e38, -3e38, 1e-40, 0.0, -0.0])
    return st.lists(st.one_of(*([finite] * 15), rare), min_size=n, max_size=n).map(
        lambda v: np.array(v, dtype=np.float32))


def _plants(steps: int):
    """Where to plant a non-finite value: (step, rank, parameter, flat index, value)."""
    return st.lists(st.tuples(st.integers(0, steps - 1), st.integers(0, WORLD - 1), st.integers(0, len(SHAPES) - 1),
                              st.integers(0, 5), st.sampled_from([np.inf, -np.inf, np.nan])), max_size=2)


@st.composite
def cases(draw, mode: str):
    steps = draw(st.integers(1, 3))
    k = draw(st.sampled_from([1, 2, 3]))
    # grads[step][rank][microbatch][parameter]
    grads = [[[[draw(_values(int(np.prod(s)))).reshape(s) for s in SHAPES] for _ in range(k)]
              for _ in range(WORLD)] for _ in range(steps)]
    # Before the reduction: in the rank's own data, hence in its gradient before DDP's all-reduce
    # or FSDP2's reduce-scatter.
    for s, r, i, flat, value in draw(_plants(steps)):
        g = grads[s][r][draw(st.integers(0, k - 1))][i]
        g.reshape(-1)[flat % g.size] = value
    after = draw(_plants(steps))
    init = [draw(_values(int(np.prod(s)))).reshape(s) for s in SHAPES]
    return {
        "mode": mode, "grads": grads, "microbatches": k, "after": after, "init": init,
        "lr": draw(st.sampled_from([0.5, 0.125, 0.1])),
        "init_scale": draw(st.sampled_from([1.0, 2.0**10, 2.0**16])),
        "growth_interval": draw(st.integers(1, 3)),
        "clip": draw(st.sampled_from([None, 1.0, 0.25])),
    }


def _step_config(case: dict) -> step.StepConfig:
    return step.StepConfig(
        optimizer=optim.SGDConfig(lr=case["lr"]),
        scaler=scaling.ScalerConfig(init_scale=case["init_scale"], growth_interval=case["growth_interval"]),
        clip_norm=case["clip"],
    )


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (math.isnan(a) and math.isnan(b)) or np.float32(a).tobytes() == np.float32(b).tobytes()


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Finite values, zeros and infinities bit for bit; NaN as a class (assertions.py rule 2)."""
    na, nb = np.isnan(a), np.isnan(b)
    return bool((na == nb).all()) and a[~na].tobytes() == b[~nb].tobytes()


def _check(case: dict, results: list[dict]) -> None:
    cfg = _step_config(case)
    state = step.init_train_state(case["init"], cfg)
    k = case["microbatches"]
    for s, per_rank in enumerate(case["grads"]):
        # What backward gives rank r for microbatch m: the loss sum(p * G) divided by k, times the
        # scale, has the gradient f32(G * f32(scale / k)) (the boundary: autograd is not modelled).
        per_mb = np.float32(state.scaler.scale / np.float32(k))
        with np.errstate(over="ignore", invalid="ignore"):
            # The ranks' window loss sums (recorded by each rank) all-reduced in float32.
            loss_finite = bool(np.isfinite(np.float32(results[0]["losses"][s]) + np.float32(results[1]["losses"][s])))
            scaled = [[[(g * per_mb).astype(np.float32) for g in mb] for mb in mbs] for mbs in per_rank]
            # Rule 9: each rank sums its window locally; DDP reduces the sum once.
            local = [step.accumulate_gradients(mbs) for mbs in scaled]
            reduced = ddp_window(scaled)
        if case["mode"] == "ddp":
            held = [None] * WORLD
            for r in range(WORLD):
                got = results[r]["shards"][s]
                want = [g.copy() for g in reduced]
                for where, pr, i, flat, value in case["after"]:
                    if where == s and pr == r:
                        want[i].reshape(-1)[flat % want[i].size] = value
                # DDP's reduction itself: rule 1 of reference.distributed, bit for bit.
                for i, (a, b) in enumerate(zip(got, want)):
                    assert _bits_equal(a, b), (
                        f"step {s} rank {r} gradient {i} after DDP's reduction: {a.ravel()} != spec {b.ravel()}")
                held[r] = want
            res = ddp_step(state, local, cfg, after_reduction=held, microbatches=k, loss_finite=loss_finite)
        else:
            shards = [results[r]["shards"][s] for r in range(WORLD)]
            res = fsdp_step(state, shards, cfg, microbatches=k, loss_finite=loss_finite)
        state = res.state
        for r in range(WORLD):
            got = results[r]["steps"][s]
            where = f"{case['mode']} step {s} rank {r}"
            assert bool(got["found"]) == res.record.found_inf, f"{where}: found_inf {got['found']} != spec {res.record.found_inf}"
            assert np.float32(got["scale"]) == state.scaler.scale, f"{where}: scale {got['scale']} != spec {state.scaler.scale}"
            assert got["tracker"] == int(state.scaler.growth_tracker), f"{where}: tracker {got['tracker']} != spec"
            if case["mode"] == "ddp":
                params = got["params"]
            else:
                params = [np.concatenate([results[q]["steps"][s]["params"][i] for q in range(WORLD)]).reshape(p.shape)
                          for i, p in enumerate(state.params)]
            for i, (a, b) in enumerate(zip(params, state.params)):
                assert _bits_equal(a, b), f"{where}: parameter {i} {a.ravel()} != spec {b.ravel()}"
        if case["clip"] is not None:
            assert _same(results[0]["steps"][s]["norm"], res.record.grad_norm), (
                f"{case['mode']} step {s}: grad_norm {results[0]['steps'][s]['norm']} != spec {res.record.grad_norm}")


_SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                            HealthCheck.too_slow])


@_SETTINGS
@given(case=cases("ddp"))
def test_ddp_ranks_skip_together_and_match_the_reference(group, case):
    _check(case, group(case))


@_SETTINGS
@given(case=cases("fsdp2"))
def test_fsdp2_ranks_skip_together_and_match_the_reference(group, case):
    _check(case, group(case))


def test_fsdp2_shards_follow_the_spec_layout(group):
    rng = np.random.default_rng(0)
    case = {"mode": "fsdp2", "after": [], "lr": 0.5, "init_scale": 1.0, "growth_interval": 2, "clip": 1.0,
            "init": [rng.standard_normal(s).astype(np.float32) for s in SHAPES],
            "microbatches": 1,
            "grads": [[[[rng.standard_normal(s).astype(np.float32) for s in SHAPES]] for _ in range(WORLD)]]}
    results = group(case)
    for i, shape in enumerate(SHAPES):
        want = [sh.shape for sh in shard_rows(np.zeros(shape, np.float32), WORLD)]
        got = [results[r]["shards"][0][i].shape for r in range(WORLD)]
        assert got == want, f"parameter {i}: shard shapes {got} != spec {want}"


# ---------------------------------------------------------------- gradient reductions (reference.grad_reduction)
#
# Properties, each on the 2-rank gloo group against reference.grad_reduction, bit for bit (NaN as
# a class):
#
# 4. all_reduce and reduce_scatter_tensor, SUM and AVG, in fp32, bf16 and fp16 (rules 2, 4);
# 5. DDP's bf16/fp16 compress hooks, called on a bucket and (fp16) registered on a DDP module
#    (rule 7; DDP refuses the bf16 hook on gloo);
# 6. FSDP2's reduce-scatter for every reduce dtype, parameter dtype and divide placement (rule 8);
#    a factor other than the world size asks gloo for PREMUL_SUM, which it refuses (rule 5);
# 7. one process holding bf16 parameters with an fp32 master copy equals FSDP2 with
#    ``param_dtype=bf16`` on 2 ranks fed the same data (derivation at the test), sharded by hand
#    or by the trainer's ``torchimpl.distributed.wrap_model``;
# 8-10 below: the trainer's bf16 reduction, the trainer's bf16-true under FSDP2, three ranks.

from conformance.reduction_jobs import JOBS as _REDUCTION_JOBS  # noqa: E402
from conformance.reduction_jobs import fp32_master_run, trainer_bf16_true  # noqa: E402
from reference import grad_reduction as gr  # noqa: E402

# Values that tell the placements apart: the fp16 max and its halves, subnormals and the ties
# just below them in fp16 and bf16, bf16's tie at 1 + 2^-8; ordinary values; rarely inf and NaN.
_EDGES = [65504.0, 32768.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-133, 2.0**-134, 3 * 2.0**-134, 1.0,
          2.0**-8, 3 * 2.0**-9, 3e38, -65504.0, -(2.0**-24), 0.0, -0.0]


def _nudged(v: float) -> float:
    """Just past an edge in float32: a value whose cast to the wire dtype rounds (down) first."""
    return float(np.float32(v) * np.float32(1 + 2.0**-20)) if np.isfinite(v) and abs(v) < 1e38 else v


def _wire_values(n: int):
    ordinary = st.floats(-8.0, 8.0, width=32)
    edge = st.sampled_from(_EDGES) | st.sampled_from(_EDGES).map(_nudged)
    rare = st.sampled_from([np.inf, -np.inf, np.nan])
    return st.lists(st.one_of(ordinary, ordinary, edge, edge, rare), min_size=n, max_size=n).map(
        lambda v: np.array(v, dtype=np.float32))


@st.composite
def _paired(draw, n: int) -> list[np.ndarray]:
    """Both ranks' values; at some positions rank 1 repeats rank 0's value, since a doubled
    subnormal or near-max value is what tells a division before the sum from one after it."""
    x0, x1 = draw(_wire_values(n)), draw(_wire_values(n))
    same = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    x1[same] = x0[same]
    return [x0, x1]


def _per_rank(n: int):
    return _paired(n)


def _expect_equal(got: np.ndarray, want: np.ndarray, what: str, repro: str) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != spec {want.shape}"
    bad = ~(np.isnan(got) & np.isnan(want)) & (got.view(np.uint32) != want.view(np.uint32))
    assert not bad.any(), (
        f"{what}: elements {np.flatnonzero(bad)[:4].tolist()}: torch {got.ravel()[bad.ravel()][:4].tolist()} "
        f"!= spec {want.ravel()[bad.ravel()][:4].tolist()}\n  reproduce: {repro}")


_REDUCE = settings(max_examples=12, deadline=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
_REDUCE_SLOW = settings(_REDUCE, max_examples=200)


def _check_collective(group, wire: str, op: str, scatter: bool, x: list[np.ndarray]) -> None:
    got = group({"kind": "collective", "wire": wire, "op": op, "scatter": scatter, "x": x})
    red = gr.Reduction(wire, WORLD, post=float(WORLD) if op == "avg" else None, op=op)
    want = gr.reduce(x, red)
    for r in range(WORLD):
        w = np.split(want, WORLD)[r] if scatter else want
        _expect_equal(got[r][0], w, f"gloo {'reduce_scatter' if scatter else 'all_reduce'} {op} in {wire}, rank {r}",
                      f"reduce({[a.tolist() for a in x]}, Reduction({wire!r}, 2, post={red.post}, op={op!r}))")


_collective_args = dict(wire=st.sampled_from(["fp32", "bf16", "fp16"]), op=st.sampled_from(["sum", "avg"]),
                        scatter=st.booleans(), x=_per_rank(8))


@_REDUCE
@given(**_collective_args)
def test_gloo_collectives_round_as_the_spec_says(group, wire, op, scatter, x):
    _check_collective(group, wire, op, scatter, x)


@pytest.mark.slow
@_REDUCE_SLOW
@given(**_collective_args)
def test_gloo_collectives_round_as_the_spec_says_sweep(group, wire, op, scatter, x):
    _check_collective(group, wire, op, scatter, x)


def _check_hook(group, wire: str, via_ddp: bool, x: list[np.ndarray]) -> None:
    got = group({"kind": "hook", "wire": wire, "via_ddp": via_ddp, "x": x})
    want = gr.reduce(x, gr.ddp_compress_hook(wire, WORLD))
    for r in range(WORLD):
        _expect_equal(got[r][0], want, f"{wire}_compress_hook ({'DDP' if via_ddp else 'called'}), rank {r}",
                      f"reduce({[a.tolist() for a in x]}, ddp_compress_hook({wire!r}, 2))")


_hook_args = dict(wire_ddp=st.sampled_from([("bf16", False), ("fp16", False), ("fp16", True)]), x=_per_rank(6))


@_REDUCE
@given(**_hook_args)
def test_ddp_compress_hooks_divide_in_the_wire_dtype_before_the_sum(group, wire_ddp, x):
    _check_hook(group, *wire_ddp, x)


@pytest.mark.slow
@_REDUCE_SLOW
@given(**_hook_args)
def test_ddp_compress_hooks_divide_in_the_wire_dtype_before_the_sum_sweep(group, wire_ddp, x):
    _check_hook(group, *wire_ddp, x)


def _check_fsdp(group, reduce: str | None, param: str | None, placement: str, grads: list[list[np.ndarray]]) -> None:
    factor = float(WORLD) if placement == "factor=W" else None
    force = placement == "force_sum"
    got = group({"kind": "fsdp", "reduce": reduce, "param": param, "factor": factor, "force_sum": force, "G": grads})
    # The gradient enters in the parameter dtype; None reduces in it (torch resets a reduce
    # dtype equal to the parameter dtype to None).
    wire = reduce or param or "fp32"
    red = gr.fsdp2_reduction(wire, WORLD, factor, force)
    for i in range(len(SHAPES)):
        local = [gr.to_wire(grads[r][i], param or "fp32") for r in range(WORLD)]
        want = shard_rows(gr.reduce(local, red), WORLD)
        for r in range(WORLD):
            _expect_equal(got[r][i], want[r],
                          f"FSDP2 reduce_dtype={reduce} param_dtype={param} {placement}: parameter {i}, rank {r}",
                          f"fsdp2_reduction({wire!r}, 2, {factor}, {force}) of {[g[i].tolist() for g in grads]}")


def _split_params(per_rank: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Each rank's flat values as one gradient per parameter of SHAPES."""
    cuts = np.cumsum([int(np.prod(s)) for s in SHAPES])[:-1]
    return [[part.reshape(s) for part, s in zip(np.split(x, cuts), SHAPES)] for x in per_rank]


_fsdp_args = dict(reduce=st.sampled_from(["fp32", "bf16", "fp16", None]), param=st.sampled_from([None, "bf16"]),
                  placement=st.sampled_from(["default", "factor=W", "force_sum"]),
                  grads=_paired(sum(int(np.prod(s)) for s in SHAPES)).map(_split_params))


@_REDUCE
@given(**_fsdp_args)
def test_fsdp2_reduce_scatter_divides_where_the_spec_says(group, reduce, param, placement, grads):
    _check_fsdp(group, reduce, param, placement, grads)


@pytest.mark.slow
@_REDUCE_SLOW
@given(**_fsdp_args)
def test_fsdp2_reduce_scatter_divides_where_the_spec_says_sweep(group, reduce, param, placement, grads):
    _check_fsdp(group, reduce, param, placement, grads)


def test_a_divide_factor_other_than_the_world_size_needs_premul_sum_which_gloo_refuses(ranks):
    assert not gr.fsdp2_reduction("fp32", WORLD, factor=4.0).runs_on_gloo
    grads = [[np.ones(s, np.float32) for s in SHAPES] for _ in range(WORLD)]
    results = ranks({"kind": "fsdp", "reduce": "fp32", "param": None, "factor": 4.0,
                                     "force_sum": False, "G": grads})
    for r, res in enumerate(results):
        assert isinstance(res, dict) and "PREMUL_SUM" in res["error"], f"rank {r}: expected gloo's refusal, got {res}"


# Property 7. Both ranks get the same batch, so each computes the same bf16 gradient g from the
# same bf16 parameters (FSDP2 all-gathers bf16(master shard), the cast one process makes of its
# master). Reduced in fp32: f32(g) + f32(g) is exact (a doubling) and AVG halves it exactly;
# reduced in bf16: bf16(g + g) = 2g exactly and the halving is exact; so every rank's shard holds
# f32(g), the gradient the one-process master takes. AdamW is elementwise, so stepping fp32
# shards equals stepping the whole fp32 master: equal bit for bit (barring an overflow of 2g).
# With different data per rank the one-process run would need the mean over the joined batch,
# whose bf16 backward rounds differently: no equality is claimed there.

_master_args = dict(seed=st.integers(0, 2**16), lr=st.sampled_from([1e-3, 1e-2, 0.1]),
                    reduce=st.sampled_from(["fp32", "bf16"]), steps=st.integers(1, 3),
                    via=st.sampled_from(["torch", "torchimpl"]))


def _check_master(group, seed: int, lr: float, reduce: str, steps: int, via: str) -> None:
    job = {"kind": "fsdp_bf16_params", "param": "bf16", "reduce": reduce, "seed": seed, "lr": lr, "steps": steps,
           "via": via}
    got = group(job)
    want = fp32_master_run(job)
    for r in range(WORLD):
        for i, (a, b) in enumerate(zip(got[r], want)):
            _expect_equal(a, b, f"FSDP2 param_dtype=bf16 reduce_dtype={reduce}, rank {r}, parameter {i} after {steps} steps",
                          f"conformance.reduction_jobs.fp32_master_run({job})")


@settings(_REDUCE, max_examples=6)
@given(**_master_args)
def test_bf16_params_with_an_fp32_master_equal_fsdp2_param_dtype_bf16(group, seed, lr, reduce, steps, via):
    _check_master(group, seed, lr, reduce, steps, via)


@pytest.mark.slow
@settings(_REDUCE, max_examples=40)
@given(**_master_args)
def test_bf16_params_with_an_fp32_master_equal_fsdp2_param_dtype_bf16_sweep(group, seed, lr, reduce, steps, via):
    _check_master(group, seed, lr, reduce, steps, via)


# 8. The trainer's ``train.reduce_dtype=bf16`` under FSDP2 reduces as rule 8 of
#    reference.grad_reduction says (bf16 AVG of each rank's float32 gradient): the shards each rank
#    holds after backward, one microbatch, scale 1 (the gradient is G itself).

def _check_trainer_bf16_reduction(group, grads: list[list[np.ndarray]], init: list[np.ndarray]) -> None:
    case = {"mode": "fsdp2", "reduce_dtype": "bf16", "after": [], "lr": 0.5, "init_scale": 1.0, "growth_interval": 2,
            "clip": None, "init": init, "microbatches": 1, "grads": [[[g] for g in grads]]}
    results = group(case)
    red = gr.fsdp2_reduction("bf16", WORLD)
    for i in range(len(SHAPES)):
        want = shard_rows(gr.reduce([grads[r][i] for r in range(WORLD)], red), WORLD)
        for r in range(WORLD):
            _expect_equal(results[r]["shards"][0][i], want[r], f"trainer fsdp2 reduce_dtype=bf16: parameter {i}, rank {r}",
                          f"fsdp2_reduction('bf16', 2) of {[g[i].tolist() for g in grads]}")


_trainer_args = dict(grads=_paired(sum(int(np.prod(s)) for s in SHAPES)).map(_split_params),
                     init=st.just([np.zeros(s, np.float32) for s in SHAPES]))


@settings(_REDUCE, max_examples=4)
@given(**_trainer_args)
def test_trainer_reduce_dtype_bf16_is_fsdp2s_bf16_average(group, grads, init):
    _check_trainer_bf16_reduction(group, grads, init)


# 9. The trainer: ``precision.mode=bf16-true`` with ``master_weights=fp32`` in one process equals
#    the same configuration under ``train.distributed=fsdp2`` (MixedPrecisionPolicy(param_dtype=
#    bf16) over fp32 shards, rule 11 of torchimpl.distributed) on 2 ranks given the same batches:
#    the fp32 masters bit for bit after every run (the derivation of property 7).

_trainer_true_args = dict(seed=st.integers(0, 2**16), lr=st.sampled_from([1e-3, 1e-2]),
                          reduce=st.sampled_from(["fp32", "bf16"]), steps=st.integers(1, 3))


def _check_trainer_true(group, seed: int, lr: float, reduce: str, steps: int) -> None:
    job = {"kind": "trainer_bf16_true", "seed": seed, "lr": lr, "reduce": reduce, "steps": steps}
    got = group({**job, "distributed": "fsdp2"})
    want = trainer_bf16_true(0, {**job, "distributed": "none", "reduce": "fp32"})
    for r in range(WORLD):
        for i, (a, b) in enumerate(zip(got[r], want)):
            _expect_equal(a, b, f"trainer fsdp2 bf16-true reduce_dtype={reduce}, rank {r}, parameter {i}",
                          f"conformance.reduction_jobs.trainer_bf16_true(0, {job})")


@settings(_REDUCE, max_examples=1)  # two trainer runs a case: one in CI, more with --runslow
@given(**_trainer_true_args)
def test_trainer_bf16_true_fp32_master_equals_fsdp2_on_two_ranks(group, seed, lr, reduce, steps):
    _check_trainer_true(group, seed, lr, reduce, steps)


@pytest.mark.slow
@settings(_REDUCE, max_examples=10)
@given(**_trainer_true_args)
def test_trainer_bf16_true_fp32_master_equals_fsdp2_on_two_ranks_sweep(group, seed, lr, reduce, steps):
    _check_trainer_true(group, seed, lr, reduce, steps)


# 10. Three ranks (--runslow): gloo fixes no order of additions (rule 3), so each element of an
#     all-reduce must be one of the results of the 3! orders, and every rank gets the same bits.

@pytest.fixture(scope="module")
def three_ranks():
    with rank_group(_dispatch, 3, wait_s=WAIT_S) as run:
        yield lambda job: run(job, check=True)


@pytest.mark.slow
@_REDUCE_SLOW
@given(wire=st.sampled_from(["fp32", "bf16", "fp16"]), op=st.sampled_from(["sum", "avg"]),
       x=st.lists(_wire_values(48), min_size=3, max_size=3))
def test_three_rank_sums_are_one_of_the_orders(three_ranks, wire, op, x):
    got = three_ranks({"kind": "collective", "wire": wire, "op": op, "x": x})
    red = gr.Reduction(wire, 3, post=3.0 if op == "avg" else None, op=op)
    rows = gr.reduce_candidates(x, red)
    ok = ((rows.view(np.uint32) == got[0][0].view(np.uint32)) | (np.isnan(rows) & np.isnan(got[0][0]))).any(axis=0)
    assert ok.all(), (f"3-rank {op} in {wire}: elements {np.flatnonzero(~ok)[:4].tolist()} are no order's result: "
                      f"{got[0][0][~ok][:4].tolist()}\n  reproduce: reduce_candidates({[a.tolist() for a in x]}, {red})")
    for r in (1, 2):
        _expect_equal(got[r][0], got[0][0], f"3-rank {op} in {wire}: rank {r} against rank 0", "the same job")
