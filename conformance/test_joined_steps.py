"""`OptimizerSpec.step_joined`: a row's parameters laid end to end step as they do one by one.

A row's ``position_free(config)`` says that no rule of its step reads an element's place in its
tensor; the audit's replay then steps runs of a group's small tensors as one flat parameter each
(one call a run instead of one a tensor). The property holds that to the per-parameter step, bit for bit, over
every implementation of every row that declares it, float32 and float64 (0-d parameters among
them), native and scalar kernels' rules. torch is not needed here: the optimizer properties hold
the per-parameter step to torch, so the joined one equals torch wherever this one holds.

The second test shows why the predicate is needed at all: at ``beta1 = 0`` Adam's lerp takes its
weight-1 form in the vectorized head (rule 4), ``y + (w - 1)(y - x)`` where the scalar tail takes
``y - (y - x)(1 - w)``: a gradient of -0 against a negative first moment gives +0 in the one and
-0 in the other, so joining, which moves elements of one tensor's tail into the next one's head,
changes their bits. The property's trajectories (``strategies.joined_trajectory``) carry such
signed zeros, and tensors whose sizes leave tails, for the same reason.

The third: a 0-d parameter is never laid into a run, since with a float64 tensor lr its
arithmetic is not a 1-element tensor's (rule 11).

Mutants killed (``conformance.mutations``): Adam's ``position_free`` ignoring rule 4 (by the property
and by the second test); a 0-d parameter joined (by the third).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from conformance import strategies
from conformance.assertions import Where, assert_equal, assert_same
from reference import optim
from reference.optim import _registry as registry

REPRO = "rerun this test with the @reproduce_failure blob printed above"
JOINED = [(n, i) for n, row in optim.SPECS.items() if row.position_free is not None
          and n in strategies.OPTIMIZER_CASES for i in row.steps]
FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _assert_states(joined: tuple, separate: tuple, where: Where) -> None:
    for i, (a, b) in enumerate(zip(joined, separate, strict=True)):
        for name in type(b).__dataclass_fields__:
            x, y = getattr(a, name), getattr(b, name)
            if y is None or x is None:
                assert_equal(x is None, y is None, where.at(f"state[{i}].{name} present"))
            else:
                assert_same(np.asarray(x), np.asarray(y), where.at(f"state[{i}].{name}"))


@pytest.mark.parametrize(("name", "impl"), JOINED, ids=[f"{n}-{i}" for n, i in JOINED])
@given(data=st.data())
def test_a_joined_step_is_the_steps_one_by_one(name, impl, data):
    """Each step of a drawn trajectory: ``step_joined`` gives the per-parameter step's parameters
    and states bit for bit, whether it steps the group as one run or cuts it into runs
    (``JOINED_RUN_ELEMENTS`` and ``JOINED_SMALL`` drawn small), with a Python or a tensor lr
    (where torch takes one), and gives one exactly where it may (``position_free``, two or more
    parameters, every one with a gradient, their states at one step count)."""
    row = optim.spec(name)
    cfg = row.make_config(**data.draw(strategies.OPTIMIZER_CASES[name].config(), label="config"))
    trajectory = data.draw(strategies.joined_trajectory(FLOATS), label="trajectory")
    params = trajectory["params"]
    native = (impl in row.native_exact and params[0].dtype == np.float32
              and data.draw(st.booleans(), label="native"))
    # The runs step_joined steps at once: the whole group, or cut at parameters (as a group of
    # millions of elements is).
    run = data.draw(st.sampled_from([registry.JOINED_RUN_ELEMENTS, 1, 7, 40]), label="JOINED_RUN_ELEMENTS")
    small = data.draw(st.sampled_from([registry.JOINED_SMALL, 2, 30]), label="JOINED_SMALL")
    kwargs = {"native": True} if native else {}
    if impl in strategies.OPTIMIZER_CASES[name].tensor_lr:  # rule 11: a 0-d parameter promotes with it
        lr_dtype = data.draw(st.sampled_from([None, np.float32, np.float64]), label="tensor lr dtype")
        if lr_dtype is not None:
            kwargs["lr"] = np.asarray(cfg.lr, lr_dtype)
    state = tuple(row.init_state(p, cfg) for p in params)
    for step, grads in enumerate(trajectory["grads"]):
        where = Where(f"{name}[{impl}]{' native' if native else ''} joined", step=step, repro=REPRO)
        new_params, _, new_state = row.step(impl, params, grads, state, cfg, **kwargs)
        saved = registry.JOINED_RUN_ELEMENTS, registry.JOINED_SMALL
        registry.JOINED_RUN_ELEMENTS, registry.JOINED_SMALL = run, small
        try:
            joined = row.step_joined(impl, params, grads, state, cfg, **kwargs)
        finally:
            registry.JOINED_RUN_ELEMENTS, registry.JOINED_SMALL = saved
        scalars = {tuple(np.asarray(v).tobytes() for v in vars(t).values() if isinstance(v, np.floating))
                   for t in state}
        allowed = (row.position_free(cfg) and len(params) > 1 and all(g is not None for g in grads)
                   and len(scalars) == 1)
        assert_equal(joined is not None, allowed, where.at("joined step given"))
        if joined is not None:
            event(f"joined, beta1 {getattr(cfg, 'betas', (None,))[0]}")
            for i, (a, b) in enumerate(zip(joined[0], new_params, strict=True)):
                assert_same(a, b, where.at(f"param[{i}]"))
            _assert_states(joined[2], new_state, where)
        params, state = new_params, new_state


def test_adam_at_beta1_zero_reads_places():
    """Rule 4 at ``beta1 = 0``: a gradient of -0 against a negative first moment gives a first
    moment of +0 in the vectorized head and -0 in the scalar tail; laid end to end, the second
    tensor's tail elements move into the head and change sign, so Adam's ``position_free`` must
    say False there."""
    row = optim.spec("Adam")
    cfg = row.make_config(betas=(0.0, 0.999))
    assert not row.position_free(cfg)
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(20).astype(np.float32) for _ in range(2)]
    negative = [-np.abs(rng.standard_normal(20)).astype(np.float32) for _ in range(2)]
    state = tuple(row.init_state(p, cfg) for p in params)
    state = row.step("for-loop", params, negative, state, cfg)[2]  # first moments below zero
    grads = [np.full(20, -0.0, np.float32) for _ in range(2)]
    separate = row.step("for-loop", params, grads, state, cfg)[2]
    flat = row.init_state(np.concatenate(params), cfg)
    flat = type(flat)(step=state[0].step, exp_avg=np.concatenate([s.exp_avg for s in state]),
                      exp_avg_sq=np.concatenate([s.exp_avg_sq for s in state]))
    laid = row.step("for-loop", [np.concatenate(params)], [np.concatenate(grads)], (flat,), cfg)[2][0]
    split = np.split(laid.exp_avg, [20])
    differ = sum(int((a.view(np.uint32) != s.exp_avg.view(np.uint32)).sum()) for a, s in zip(split, separate))
    assert differ > 0, "laid end to end, beta1 = 0 gave the same first moments: rule 4's head would not matter"
    assert row.step_joined("for-loop", params, grads, state, cfg) is None


def test_a_zero_d_parameter_is_never_joined():
    """Rule 11: with a float64 tensor lr, AdamW decays a float32 0-d parameter in float64 (two 0-d
    tensors promote) and a 1-element tensor in float32, so a 0-d parameter laid into a run would
    step to other bits; `step_joined` steps it alone, bit for bit with `step`."""
    row = optim.spec("AdamW")
    cfg = row.make_config(lr=0.1, weight_decay=0.01)
    lr = np.asarray(0.1, np.float64)
    p0, g0 = np.asarray(np.float32(0.64042264)), np.asarray(np.float32(0.5))
    as_0d = row.step("for-loop", [p0], [g0], (row.init_state(p0, cfg),), cfg, lr=lr)[0][0]
    p1, g1 = p0.reshape(1), g0.reshape(1)
    as_1 = row.step("for-loop", [p1], [g1], (row.init_state(p1, cfg),), cfg, lr=lr)[0][0]
    assert as_0d.tobytes() != as_1.tobytes(), "the 0-d and 1-element steps agree: rule 11's promotion would not matter"
    params = [p0, np.full(3, 0.25, np.float32), np.full(2, -1.5, np.float32)]
    grads = [g0, np.full(3, 0.5, np.float32), np.full(2, 0.125, np.float32)]
    state = tuple(row.init_state(p, cfg) for p in params)
    separate = row.step("for-loop", params, grads, state, cfg, lr=lr)[0]
    joined = row.step_joined("for-loop", params, grads, state, cfg, lr=lr)[0]
    for i, (a, b) in enumerate(zip(joined, separate, strict=True)):
        assert_same(a, b, Where("AdamW[for-loop] joined, tensor lr", field=f"param[{i}]", repro="this test"))
