"""Property 2: the loss-scaler state machine, step by step, against `reference.scaling`.

Arbitrary sequences of steps: gradient trees of mixed shapes and dtypes with inf/NaN planted at
random places, configurations with non-power-of-two factors, intervals of 1, scales near the
float32 maximum and near zero, and one or two optimizers sharing a scaler. After every step the
scaled loss, each optimizer's unscaled gradients, found_inf and skip decision, and then the scale,
tracker (and hysteresis) must equal the spec's, bit for bit.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance import strategies
from conformance.assertions import Where, assert_equal, assert_same, assert_same_list
from conformance.bridge import to_numpy, to_torch, torch_dtype
from reference import scaling
from torchimpl.train.scaler import DynamicLossScaler, ScaleAtMinimumError, ScalerConfig

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


# --- The rounding, the kernels, the call sequence and the lifecycle -------------------------------

PRESET_NAMES = sorted(scaling.PRESETS)


def _make_scaler(kind: str, params: dict, device: str):
    """A production scaler of ``kind`` ("GradScaler" or a preset name) and the spec's config."""
    if kind == "GradScaler":
        return torch.amp.GradScaler(device, **params), scaling.ScalerConfig(**params)
    if scaling.PRESETS[kind].get("min_scale") is not None:
        params = dict(params, init_scale=max(params["init_scale"], scaling.PRESETS[kind]["min_scale"]))
    if scaling.PRESETS[kind].get("max_scale") is not None:
        params = dict(params, init_scale=min(params["init_scale"], scaling.PRESETS[kind]["max_scale"]))
    return DynamicLossScaler(device, ScalerConfig(preset=kind, **params)), scaling.ScalerConfig.preset(kind, **params)


@pytest.mark.parametrize("kind", ["GradScaler", "deepspeed"])
@given(data=st.data())
def test_scaled_losses_of_every_dtype_and_shape_match_the_spec(kind, device, data):
    """Rule 1 with torch's type promotion: a 0-d 16-bit loss gives a float32 product, a 16-bit
    loss with dimensions stays 16-bit with S not rounded first, float64 gives x * f64(S); a
    Python number is refused by torch (the spec's float32 reading is its own)."""
    case = data.draw(strategies.loss_case(), label="case")
    scaler, cfg = _make_scaler(kind, dict(init_scale=case["scale"]), device)
    loss = case["loss"]
    where = Where(f"scale[{kind}]", field=f"scaled {loss.dtype} loss of shape {loss.shape}", repro=REPRO)
    expected = scaling.scale_loss(loss, scaling.initial_state(cfg))
    assert_same(to_numpy(scaler.scale(to_torch(loss, device))), np.asarray(expected), where)
    with pytest.raises(ValueError, match="outputs must be a Tensor"):
        scaler.scale(1.5)


@given(case=strategies.update_kernel_case())
def test_the_update_kernel_matches_the_spec(device, case):
    """torch._amp_update_scale_ against rules 5 and 7 for any float32 scale (0, subnormal, inf,
    NaN included), trackers at and past the interval (loaded ones never grow), every found_inf
    value (NaN and negatives count as found), factors applied in float64 and rounded once."""
    scale_t = torch.tensor(case["scale"], dtype=torch.float32, device=device)
    tracker_t = torch.tensor(case["tracker"], dtype=torch.int32, device=device)
    found_t = torch.tensor(case["found_inf"], dtype=torch.float32, device=device)
    torch._amp_update_scale_(scale_t, tracker_t, found_t, case["growth_factor"], case["backoff_factor"],
                             case["growth_interval"])
    cfg = scaling.ScalerConfig(growth_factor=case["growth_factor"], backoff_factor=case["backoff_factor"],
                               growth_interval=case["growth_interval"])
    with np.errstate(all="ignore"):
        state = scaling.update_scale(scaling.ScalerState(case["scale"], case["tracker"], 1), np.float32(case["found_inf"]),
                                     cfg)
    where = Where("_amp_update_scale_", repro=f"{REPRO}; case={case!r}")
    assert_same(to_numpy(scale_t), np.asarray(state.scale), where.at("scale"))
    assert_equal(int(tracker_t.item()), int(state.growth_tracker), where.at("growth_tracker"))


@given(case=strategies.unscale_kernel_case())
def test_the_unscale_kernel_matches_the_spec(device, case):
    """torch._amp_foreach_non_finite_check_and_unscale_ against rules 2-4 on gradients of every
    dtype: the check looks at the scaled values (an overflow the multiply causes is not flagged),
    every gradient is unscaled, and the flag is set to exactly 1.0 on a find and otherwise left
    as it was (never added to, never cleared)."""
    grads = case["grads"]
    state = scaling.ScalerState(case["scale"], 0, 1)
    tensors = [to_torch(g, device) for g in grads]
    found_t = torch.tensor(case["found_inf"], dtype=torch.float32, device=device)
    inv_t = torch.tensor(scaling.inverse_scale(state), dtype=torch.float32, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_t, inv_t)
    expected, found = scaling.unscale_gradients(grads, state)
    where = Where("_amp_foreach_non_finite_check_and_unscale_", field="unscaled grads", repro=REPRO)
    assert_same_list([to_numpy(t) for t in tensors], expected, where)
    assert_same(to_numpy(found_t), np.asarray(np.float32(1.0 if found else case["found_inf"])), where.at("found_inf"))


class _Seq:
    """The production side of the call-sequence property: two SGD optimizers at lr 0."""

    def __init__(self, scaler, device: str) -> None:
        self.scaler, self.device = scaler, device
        self.params = [[torch.nn.Parameter(torch.zeros(3, device=device)),
                        torch.nn.Parameter(torch.zeros(2, device=device)),
                        torch.nn.Parameter(torch.zeros(2, dtype=torch.float16, device=device))] for _ in range(2)]
        self.opts = [CountingSGD(ps) for ps in self.params]

    def set_grads(self, i: int, pattern: str) -> list[np.dtype]:
        p0, p1, p2 = self.params[i]
        p0.grad = None if pattern == "none" else torch.ones(3, device=self.device)
        p1.grad = {"inf": torch.tensor([1.0, float("inf")], device=self.device), "none": None}.get(
            pattern, torch.ones(2, device=self.device))
        p2.grad = torch.ones(2, dtype=torch.float16, device=self.device) if pattern == "fp16" else None
        return [np.dtype(bridge_dtype(p.grad.dtype)) for p in (p0, p1, p2) if p.grad is not None]


def bridge_dtype(dtype: torch.dtype) -> np.dtype:
    from conformance.bridge import numpy_dtype

    return numpy_dtype(dtype)


def _outcome(fn):
    """("ok", value) or (exception type name, message) for a call."""
    try:
        return ("ok", fn())
    except (AssertionError, RuntimeError, ValueError) as e:
        return (type(e).__name__, str(e))


@pytest.mark.parametrize("kind", ["GradScaler", "torch", "megatron", "static"])
@given(data=st.data())
def test_the_call_sequence_matches_the_spec(kind, device, data):
    """Rule 12: any order of scale/unscale_/step/update calls on a scaler shared by two
    optimizers raises what the spec says torch raises (type and message), and the ones that
    run skip, apply and update the scale as the spec says."""
    calls = data.draw(strategies.call_sequence(), label="calls")
    scaler, cfg = _make_scaler(kind, dict(init_scale=3.0 * 2.0**10, growth_interval=2), device)
    seq = _Seq(scaler, device)
    state, scaled = scaling.initial_state(cfg), False
    stages = [scaling.OptimizerStage(), scaling.OptimizerStage()]
    dtypes = [seq.set_grads(0, "finite"), seq.set_grads(1, "finite")]
    found = [False, False]
    for n, call in enumerate(calls):
        where = Where(f"call sequence[{kind}]", step=n, field=repr(call), repro=f"{REPRO}; calls={calls!r}")
        name = call[0]
        if name == "grads":
            dtypes[call[1]] = seq.set_grads(call[1], call[2])
            continue
        if name == "scale":
            scaler.scale(torch.ones((), device=device))
            scaled = True
            continue
        if name in ("unscale_", "step", "step_closure"):
            i = call[1]
            opt = seq.opts[i]
            spec_grads = [to_numpy(p.grad) for p in seq.params[i] if p.grad is not None]
            try:
                if name == "unscale_":
                    expected_stage = scaling.unscale_stage(stages[i], scaled=scaled, grad_dtypes=dtypes[i])
                else:
                    _, expected_stage = scaling.step_stage(stages[i], scaled=scaled, grad_dtypes=dtypes[i],
                                                           closure=name == "step_closure")
                spec = ("ok", None)
            except scaling.NoInfChecksError as e:
                spec, expected_stage = (type(e).__mro__[1].__name__, str(e)), e.stage
            except (AssertionError, RuntimeError, ValueError) as e:
                spec, expected_stage = (type(e).__name__, str(e)), stages[i]
            calls_before = opt.calls
            unscaling = stages[i].stage == scaling.READY and expected_stage.stage != scaling.READY
            if name == "unscale_":
                got = _outcome(lambda: scaler.unscale_(opt))
            elif name == "step":
                got = _outcome(lambda: scaler.step(opt))
            else:
                got = _outcome(lambda: scaler.step(opt, closure=lambda: None))
            assert_equal(got[0], spec[0], where.at("outcome"))
            if spec[0] != "ok":
                assert_equal(got[1], spec[1], where.at("message"))
            if unscaling:
                found[i] = scaling.has_inf_or_nan(spec_grads)
            if name != "unscale_" and spec[0] == "ok":
                assert_equal(opt.calls > calls_before, scaling.step_applies(found[i], cfg), where.at("applied"))
            stages[i] = expected_stage
            continue
        new_scale = call[1] if name == "update_new_scale" else None
        try:
            scaling.check_update(stages, scaled=scaled, new_scale=new_scale is not None)
            spec = ("ok", None)
        except AssertionError as e:
            spec = (type(e).__name__, str(e))
        got = _outcome(lambda: scaler.update(new_scale))
        assert_equal(got[0], spec[0], where.at("outcome"))
        if spec[0] != "ok":
            assert_equal(got[1], spec[1], where.at("message"))
            continue
        if new_scale is not None:
            state = scaling.set_scale(state, new_scale)
        else:
            flags = [f for f, s in zip(found, stages) if s.inf_checks]
            state = scaling.update_scale_multi(state, flags, cfg)
        stages, found = [scaling.OptimizerStage(), scaling.OptimizerStage()], [False, False]
        assert_same(np.asarray(np.float32(scaler.get_scale())), np.asarray(state.scale), where.at("scale"))
        assert_equal(scaler._get_growth_tracker(), int(state.growth_tracker), where.at("growth_tracker"))


def _iteration(scaler, opt, param, overflow: bool, device: str) -> None:
    scaler.scale(torch.ones((), device=device))
    param.grad = torch.tensor([1.0, 2.0, float("inf") if overflow else 3.0], device=device)
    scaler.step(opt)
    scaler.update()


def _assert_saved(saved: dict, expected: dict, where: Where) -> None:
    assert_equal(sorted(k for k in expected if k in saved), sorted(expected), where.at("state_dict keys"))
    for key, value in expected.items():
        assert_equal(saved[key], value, where.at(f"state_dict[{key!r}]"))


@given(data=st.data())
def test_grad_scaler_lifecycle_matches_the_spec(device, data):
    """Rule 13 for torch's own GradScaler: after any history of clean and overflowing
    iterations, loads (into a fresh scaler made with other settings, or into the one in use;
    sometimes with an unrounded scale or a tracker at or past the interval), pickling and
    update(new_scale), state_dict equals the spec's state (the scale unrounded until the first
    scale()), and the loaded scaler continues the spec's schedule exactly."""
    params = data.draw(strategies.rounding_scaler_params(), label="params")
    events = data.draw(strategies.lifecycle(), label="events")
    scaler, cfg = torch.amp.GradScaler(device, **params), scaling.ScalerConfig(**params)
    state, pending, scaled = scaling.initial_state(cfg), float(params["init_scale"]), False
    param = torch.nn.Parameter(torch.zeros(3, device=device))
    opt = CountingSGD([param])
    for k, event in enumerate(events):
        where = Where("GradScaler lifecycle", step=k, field=repr(event), repro=f"{REPRO}; events={events!r}")
        kind = event[0]
        if kind in ("clean", "overflow"):
            _iteration(scaler, opt, param, kind == "overflow", device)
            state, pending, scaled = scaling.update_scale(state, kind == "overflow", cfg), None, True
        elif kind in ("load_fresh", "load_used"):
            saved = scaler.state_dict()
            if len(event) > 1 and event[1] is not None:
                saved["scale"] = event[1]
            if len(event) > 1 and event[2] is not None:
                saved["_growth_tracker"] = event[2]
            if kind == "load_fresh":
                scaler, scaled = torch.amp.GradScaler(device), False  # torch's defaults, not the saved ones
            scaler.load_state_dict(saved)
            cfg, state, loaded_scale = scaling.load_state_dict(saved, cfg)
            pending = None if scaled else loaded_scale
        elif kind == "pickle":
            scaler = pickle.loads(pickle.dumps(scaler))
            pending, scaled = float(state.scale) if pending is None else pending, False
        elif kind == "new_scale" and scaled:
            scaler.update(torch.tensor(event[1], dtype=torch.float64, device=device) if event[2] else float(event[1]))
            state = scaling.set_scale(state, event[1])
        _assert_saved(scaler.state_dict(), scaling.state_dict(state, cfg, pending_scale=pending), where)


@pytest.mark.parametrize("preset", PRESET_NAMES)
@given(data=st.data())
def test_dynamic_loss_scaler_lifecycle_matches_the_spec(preset, device, data):
    """Rule 13 for every DynamicLossScaler preset: state_dict after any history (scale, factors,
    interval, tracker, hysteresis left, bounds) equals the spec's, and a fresh scaler (made
    with the torch preset) that loads it, or an unpickled one, continues the spec's schedule."""
    params = data.draw(strategies.rounding_scaler_params(), label="params")
    events = data.draw(strategies.lifecycle(tamper=False), label="events")
    scaler, cfg = _make_scaler(preset, params, device)
    state, pending, scaled = scaling.initial_state(cfg), float(scaler.state_dict()["scale"]), False
    param = torch.nn.Parameter(torch.zeros(3, device=device))
    opt = CountingSGD([param])
    for k, event in enumerate(events):
        where = Where(f"DynamicLossScaler[{preset}] lifecycle", step=k, field=repr(event),
                      repro=f"{REPRO}; events={events!r}")
        kind = event[0]
        if kind in ("clean", "overflow"):
            try:
                new_state = scaling.update_scale(state, kind == "overflow", cfg)
            except scaling.ScaleAtMinimumError:
                with pytest.raises(ScaleAtMinimumError):
                    _iteration(scaler, opt, param, True, device)
                return
            _iteration(scaler, opt, param, kind == "overflow", device)
            state, pending, scaled = new_state, None, True
        elif kind in ("load_fresh", "load_used"):
            saved = scaler.state_dict()
            target = DynamicLossScaler(device) if kind == "load_fresh" else scaler
            if not (np.isfinite(state.scale) and state.scale > 0):
                with pytest.raises(ValueError, match="scale"):  # its own stricter rule: no collapsed scale
                    target.load_state_dict(saved)
                continue
            target.load_state_dict(saved)
            scaler, scaled = target, scaled and kind == "load_used"
            _, loaded, loaded_scale = scaling.load_state_dict(saved, cfg)
            state = scaling.ScalerState(loaded.scale, loaded.growth_tracker, saved["hysteresis_left"])
            pending = None if scaled else loaded_scale
        elif kind == "pickle":
            scaler = pickle.loads(pickle.dumps(scaler))
            pending, scaled = float(state.scale) if pending is None else pending, False
        elif kind == "new_scale" and scaled:
            # update(new_scale) is not clamped; a value outside the bounds would only make the
            # next load refuse it (its documented rule), so keep inside them.
            value = min(max(float(event[1]), cfg.min_scale or 0.0), cfg.max_scale or math.inf)
            scaler.update(value)
            state = scaling.set_scale(state, value)
        saved = scaler.state_dict()
        expected = scaling.state_dict(state, cfg, pending_scale=pending)
        expected.update(preset=preset, hysteresis=cfg.hysteresis, min_scale=cfg.min_scale, max_scale=cfg.max_scale)
        if cfg.hysteresis > 1:  # with 1, every overflow backs off: the counter decides nothing
            expected["hysteresis_left"] = state.hysteresis_left
        _assert_saved(saved, expected, where)
