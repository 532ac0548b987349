"""Conformance of the multi-rank step: the trainer on a 2-rank gloo group against reference.distributed.

Two worker processes join one gloo group on 127.0.0.1 once per module and stay up; Hypothesis
draws each case here in the parent, sends it to both workers, which run ``Trainer.fit`` on it
(DDP or FSDP2) and send back what every step left behind. Each rank's data is its own scaled
gradient ``f32(G_r * scale)`` (the model's loss is ``sum(p * G_r)``), so the reference receives
exactly the gradients backward produced. Inf and NaN are planted on a random subset of ranks and
at random points: in ``G_r`` (before the gradient reduction) and in the gradients after
backward (after the reduction, from a callback). Properties, per step and per rank:

1. every rank makes the reference's skip decision (the OR over ranks) and ends the step with
   the reference's scale and growth tracker;
2. parameters are identical across ranks (DDP) and equal the reference bit for bit (DDP and
   FSDP2, whose shards are put back together here);
3. rank 0's gradient norm equals the reference's (NaN as a class).

Every wait is bounded; the workers are joined with a timeout and terminated if they linger.
"""

from __future__ import annotations

import datetime
import math
import os
import queue
import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference import optim, scaling, step
from reference.distributed import ddp_average, ddp_step, fsdp_step, shard_rows

WORLD = 2
SHAPES = ((3, 2), (3,))
WAIT_S = 90.0


# ---------------------------------------------------------------- the workers


def _worker(rank: int, port: int, inbox, outbox) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        while True:
            try:
                case = inbox.get(timeout=WAIT_S)
            except queue.Empty:
                return
            if case is None:
                return
            try:
                outbox.put((rank, _run_case(rank, case)))
            except Exception as exc:  # reported to the parent, which fails the example
                outbox.put((rank, {"error": repr(exc)}))
    finally:
        dist.destroy_process_group()


def _run_case(rank: int, case: dict) -> dict:
    import torch
    from torch import nn

    from torchimpl.config import load_config
    from torchimpl.trainer import Callback, Trainer

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

        def on_after_backward(self, trainer, state):
            for where, r, i, flat, value in case["after"]:
                if where == state.step and r == rank:
                    g = trainer.params[i].grad
                    local = g.to_local() if hasattr(g, "to_local") else g
                    if local.numel():
                        local.view(-1)[flat % local.numel()] = value
            self.shards.append([_local(p.grad).numpy().copy() for p in trainer.params])

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
        f"train.steps={len(case['grads'])}", "train.log_interval=1000", "optimizer.name=sgd",
        f"optimizer.lr={case['lr']}", "optimizer.weight_decay=0.0", "schedule.name=constant",
        f"scaler.init_scale={case['init_scale']}", f"scaler.growth_interval={case['growth_interval']}",
        f"train.clip_norm={'null' if case['clip'] is None else case['clip']}", "train.distributed_timeout_s=60",
    ])
    # Batch s * W + r is rank r's data at step s (the trainer gives rank r every W-th batch).
    data = [[torch.from_numpy(g) for g in case["grads"][s][r]] for s in range(len(case["grads"]))
            for r in range(WORLD)]
    probe = Probe()
    Trainer(cfg, [probe]).fit(Planted(case["init"]), data, loss_fn=lambda m, b: m(b))
    return {"steps": probe.steps, "shards": probe.shards}


@pytest.fixture(scope="module")
def group():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inboxes = [ctx.Queue() for _ in range(WORLD)]
    outbox = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, inboxes[r], outbox), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()

    def run(case: dict) -> list[dict]:
        for box in inboxes:
            box.put(case)
        got = {}
        for _ in range(WORLD):
            try:
                r, res = outbox.get(timeout=WAIT_S)
            except queue.Empty:
                pytest.fail(f"a worker did not answer within {WAIT_S:g} s (alive: {[p.is_alive() for p in procs]})")
            got[r] = res
        for r in range(WORLD):
            assert "error" not in got[r], f"rank {r} raised: {got[r]['error']}"
        return [got[r] for r in range(WORLD)]

    try:
        yield run
    finally:
        for box in inboxes:
            box.put(None)
        for p in procs:
            p.join(timeout=20)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


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
    grads = [[[draw(_values(int(np.prod(s)))).reshape(s) for s in SHAPES] for _ in range(WORLD)]
             for _ in range(steps)]
    # Before the reduction: in the rank's own data, hence in its gradient before DDP's all-reduce
    # or FSDP2's reduce-scatter.
    for s, r, i, flat, value in draw(_plants(steps)):
        grads[s][r][i].reshape(-1)[flat % grads[s][r][i].size] = value
    after = draw(_plants(steps))
    init = [draw(_values(int(np.prod(s)))).reshape(s) for s in SHAPES]
    return {
        "mode": mode, "grads": grads, "after": after, "init": init,
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
    """Finite values, zeros and infinities bit for bit; NaN as a class (DESIGN section 4)."""
    na, nb = np.isnan(a), np.isnan(b)
    return bool((na == nb).all()) and a[~na].tobytes() == b[~nb].tobytes()


def _check(case: dict, results: list[dict]) -> None:
    cfg = _step_config(case)
    state = step.init_train_state(case["init"], cfg)
    for s, per_rank in enumerate(case["grads"]):
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = [[(g * state.scaler.scale).astype(np.float32) for g in grads] for grads in per_rank]
        if case["mode"] == "ddp":
            reduced = ddp_average(scaled)
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
            res = ddp_step(state, scaled, cfg, after_reduction=held)
        else:
            shards = [results[r]["shards"][s] for r in range(WORLD)]
            res = fsdp_step(state, shards, cfg)
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
            "grads": [[[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(WORLD)]]}
    results = group(case)
    for i, shape in enumerate(SHAPES):
        want = [sh.shape for sh in shard_rows(np.zeros(shape, np.float32), WORLD)]
        got = [results[r]["shards"][0][i].shape for r in range(WORLD)]
        assert got == want, f"parameter {i}: shard shapes {got} != spec {want}"
