"""Property 2: the loss-scaler state machine, step by step, against `reference.scaling`.

Arbitrary sequences of steps: gradient trees of mixed shapes and dtypes with inf/NaN planted at
random places, configurations with non-power-of-two factors, intervals of 1, scales near the
float32 maximum and near zero, and one or two optimizers sharing a scaler. After every step the
scaled loss, each optimizer's unscaled gradients, found_inf and skip decision, and then the scale,
tracker (and hysteresis) must equal the spec's, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance import strategies
from conformance.assertions import Where, assert_equal, assert_same, assert_same_list
from conformance.bridge import to_numpy, to_torch, torch_dtype
from reference import scaling
from torchimpl.scaler import DynamicLossScaler, ScaleAtMinimumError, ScalerConfig

# Which production scaler, and the spec preset it must follow.
SCALERS = ["GradScaler", "torch", "megatron", "deepspeed"]
REPRO = "rerun this test with the @reproduce_failure blob printed above"


class CountingSGD(torch.optim.SGD):
    """SGD at lr 0 that records whether each step() call reached the optimizer."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.calls = 0

    def step(self, closure=None):  # noqa: D102 - torch's signature
        self.calls += 1
        return super().step(closure)


@st.composite
def scaler_case(draw, kind: str) -> dict:
    params = draw(strategies.scaler_params())
    if kind in ("megatron", "deepspeed"):
        # Their floor is 1.0: a valid configuration starts at or above it.
        params["init_scale"] = max(params["init_scale"], 1.0)
    n_opt = draw(st.integers(1, 2))
    specs = [
        [
            (tuple(draw(st.lists(st.integers(0, 7), max_size=2))), np.dtype(draw(st.sampled_from(strategies.GRAD_DTYPES))))
            for _ in range(draw(st.integers(1, 3)))
        ]
        for _ in range(n_opt)
    ]
    steps = draw(st.integers(1, 7))
    magnitude = draw(st.sampled_from([1e-30, 1e-6, 1.0, 1e6, 1e30]))
    grads = [
        [[draw(strategies.gradient(dt, shape, magnitude, plant_prob=0.25)) for shape, dt in opt] for opt in specs]
        for _ in range(steps)
    ]
    losses = draw(st.lists(st.floats(width=32, allow_nan=False), min_size=steps, max_size=steps))
    return dict(params=params, specs=specs, grads=grads, losses=losses)


def _make(kind: str, params: dict, device: str):
    if kind == "GradScaler":
        return torch.amp.GradScaler(device, **params), scaling.ScalerConfig(**params)
    prod = DynamicLossScaler(device, ScalerConfig(preset=kind, **params))
    return prod, scaling.ScalerConfig.preset(kind, **params)


def run_case(kind: str, case: dict, device: str) -> None:
    scaler, spec_cfg = _make(kind, case["params"], device)
    state = scaling.initial_state(spec_cfg)
    opts, params = [], []
    for opt_specs in case["specs"]:
        ps = [torch.zeros(shape, dtype=torch_dtype(dt), device=device, requires_grad=True) for shape, dt in opt_specs]
        params.append(ps)
        opts.append(CountingSGD(ps))

    for step, (step_grads, loss) in enumerate(zip(case["grads"], case["losses"])):
        where = Where(f"scaler[{kind}]", step=step, repro=REPRO)
        scaled = scaler.scale(torch.tensor(loss, dtype=torch.float32, device=device))
        assert_same(to_numpy(scaled), scaling.scale_loss(np.float32(loss), state), where.at("scaled loss"))

        found = []
        for i, (opt, ps, grads) in enumerate(zip(opts, params, step_grads)):
            for p, g in zip(ps, grads):
                p.grad = to_torch(g, device)
            scaler.unscale_(opt)
            spec_grads, spec_found = scaling.unscale_gradients(grads, state)
            assert_same_list([to_numpy(p.grad) for p in ps], spec_grads, where.at(f"optimizer {i} unscaled grads"))
            torch_found = float(sum(v.item() for v in scaler._found_inf_per_device(opt).values()))
            assert_equal(torch_found != 0.0, spec_found, where.at(f"optimizer {i} found_inf"))
            calls = opt.calls
            scaler.step(opt)
            assert_equal(opt.calls > calls, not spec_found, where.at(f"optimizer {i} applied"))
            found.append(spec_found)

        try:
            state = scaling.update_scale_multi(state, found, spec_cfg)
        except scaling.ScaleAtMinimumError:
            with pytest.raises(ScaleAtMinimumError):
                scaler.update()
            return
        scaler.update()
        assert_equal(float(np.float32(scaler.get_scale())), float(state.scale), where.at("scale"))
        assert_equal(scaler._get_growth_tracker(), int(state.growth_tracker), where.at("growth_tracker"))
        # With hysteresis 1 every overflow backs off whatever the counter says, and torch's own
        # update keeps no such counter: it is state only where it can change a decision.
        if isinstance(scaler, DynamicLossScaler) and spec_cfg.hysteresis > 1:
            assert_equal(scaler.get_hysteresis_left(), int(state.hysteresis_left), where.at("hysteresis_left"))


@pytest.mark.parametrize("kind", SCALERS)
@given(data=st.data())
def test_scaler_state_machine_matches_the_spec(kind, device, data):
    run_case(kind, data.draw(scaler_case(kind), label="case"), device)
