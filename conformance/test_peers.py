"""The loss-scaler presets against the real peers (opt-in: ``AMPSPEC_PEERS=1``; the ``peers`` extra).

Each peer's own update code is driven with the same random overflow trace as the spec's preset
(``reference.scaling.PRESETS``), and after every step the scale and the counters must agree.
The peers are imported only inside these tests and only when ``AMPSPEC_PEERS=1``, so the
normal suite never pays for DeepSpeed's or JAX's import; a peer that is not installed is
skipped with the reason. Where a peer differs by design (DeepSpeed's Python-float scale grows
past float32's range), the difference is its own test.

- ``deepspeed``: ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` (ZeRO stages 1-3).
- ``deepspeed_fp16``: ``FP16_Optimizer._update_scale`` (non-ZeRO fp16), called on an object
  holding its ``LossScaleConfig``: its own method on its own state, without an accelerator.
- ``megatron``: ``megatron.core.optimizer.grad_scaler.DynamicGradScaler.update``; its
  constructor puts the state on CUDA, so the same attributes are set on CPU tensors.
- ``jmp``: ``jmp.DynamicLossScale.adjust`` (JAX on CPU).
- ``apex``: ``apex.amp.scaler.LossScaler.update_scale`` (NVIDIA apex, not on PyPI).
- ``static``: DeepSpeed's static ``LossScaler``, Megatron's ``ConstantGradScaler`` and jmp's
  ``StaticLossScale`` never change the scale; apex's static scale does not skip.
"""

from __future__ import annotations

import math
import os
import types
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.assertions import Where, assert_equal
from reference import scaling

pytestmark = pytest.mark.skipif(not os.environ.get("AMPSPEC_PEERS"),
                                reason="peer checks are opt-in: AMPSPEC_PEERS=1 pytest conformance/test_peers.py "
                                       "(install the peers extra)")
REPRO = "rerun with AMPSPEC_PEERS=1 and the @reproduce_failure blob printed above"
STEPS = 300  # per trace; about 100,000 steps over the ci profile's examples and the presets


@st.composite
def trace(draw, min_scale: float = 1.0, max_init: float = 2.0**40) -> dict:
    """An overflow trace and a schedule short enough that the scale grows, backs off and
    reaches its floor within it; initial scales kept where the peers' float64 arithmetic and
    the spec's float32 agree (growth below 2**127)."""
    interval = draw(st.integers(1, 8))
    p = draw(st.sampled_from([0.02, 0.1, 0.3, 0.6]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    init = 2.0 ** draw(st.integers(int(math.log2(min_scale)), int(math.log2(max_init))))
    # Where the peers leave float32's range (growth past 2**127) _check ends the comparison.
    return dict(interval=interval, init=init, overflows=[bool(b) for b in rng.random(STEPS) < p])


def _spec(preset: str, **overrides):
    cfg = scaling.ScalerConfig.preset(preset, **overrides)
    return cfg, scaling.initial_state(cfg)


FLT_MAX = float(np.finfo(np.float32).max)


def _check(where: Where, step: int, scale: float, spec: scaling.ScalerState) -> bool:
    """Compare one step; False once the peer's scale has left float32's range, the stated
    difference (DeepSpeed's Python float and Megatron's unchecked growth go past 2**127, where
    the spec refuses a growth to inf): then the spec must hold the scale it could not grow, and
    the trace ends."""
    if float(scale) > FLT_MAX:
        assert_equal(float(spec.scale) * 2 > FLT_MAX, True, where.at("scale kept below float32's max", step))
        return False
    assert_equal(float(np.float32(scale)), float(spec.scale), where.at("scale", step))
    return True


@given(case=trace())
@settings(deadline=None)
def test_deepspeed_zero_loss_scaler_matches_the_deepspeed_preset(case):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler", reason="DeepSpeed is not installed")
    peer = loss_scaler.DynamicLossScaler(init_scale=case["init"], scale_window=case["interval"], min_scale=1.0,
                                         delayed_shift=2, consecutive_hysteresis=False)
    cfg, state = _spec("deepspeed", init_scale=case["init"], growth_interval=case["interval"])
    where = Where("deepspeed DynamicLossScaler", repro=REPRO)
    with mock.patch.object(loss_scaler.dist, "get_rank", return_value=0):  # it only picks who logs
        _run_deepspeed_zero(peer, cfg, state, case, where)


def _run_deepspeed_zero(peer, cfg, state, case, where) -> None:
    for step, overflow in enumerate(case["overflows"]):
        try:
            state = scaling.update_scale(state, overflow, cfg)
        except scaling.ScaleAtMinimumError:
            with pytest.raises(Exception, match="Current loss scale already at minimum"):
                peer.update_scale(overflow)
            return
        peer.update_scale(overflow)
        if not _check(where, step, peer.cur_scale, state):
            return


@given(case=trace())
@settings(deadline=None)
def test_deepspeed_fp16_optimizer_update_matches_the_deepspeed_fp16_preset(case):
    fused = pytest.importorskip("deepspeed.runtime.fp16.fused_optimizer", reason="DeepSpeed is not installed")
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler", reason="DeepSpeed is not installed")
    import torch

    config = loss_scaler.LossScaleConfig(torch.float16, True, 1.0, {"init_scale": case["init"],
                                                                  "scale_window": case["interval"], "min_scale": 1.0})
    peer = types.SimpleNamespace(loss_scale_config=config, verbose=False)
    cfg, state = _spec("deepspeed_fp16", init_scale=case["init"], growth_interval=case["interval"])
    where = Where("deepspeed FP16_Optimizer._update_scale", repro=REPRO)
    for step, overflow in enumerate(case["overflows"]):
        fused.FP16_Optimizer._update_scale(peer, overflow)
        state = scaling.update_scale(state, overflow, cfg)
        if not _check(where, step, config.cur_scale, state):
            return


@given(case=trace())
@settings(deadline=None)
def test_megatron_grad_scaler_matches_the_megatron_preset(case):
    grad_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler", reason="megatron-core is not installed")
    import torch

    peer = object.__new__(grad_scaler.DynamicGradScaler)  # its __init__ allocates on CUDA
    peer._scale = torch.tensor([case["init"]], dtype=torch.float)
    peer.min_scale = torch.tensor([1.0], dtype=torch.float)
    peer.growth_factor = torch.tensor([2.0], dtype=torch.float)
    peer.backoff_factor = torch.tensor([0.5], dtype=torch.float)
    peer.growth_interval, peer.hysteresis = case["interval"], 2
    peer._growth_tracker, peer._hysteresis_tracker = 0, 2
    cfg, state = _spec("megatron", init_scale=case["init"], growth_interval=case["interval"])
    where = Where("megatron DynamicGradScaler", repro=REPRO)
    for step, overflow in enumerate(case["overflows"]):
        peer.update(overflow)
        state = scaling.update_scale(state, overflow, cfg)
        if not _check(where, step, float(peer._scale.item()), state):
            return
        assert_equal(peer._growth_tracker, int(state.growth_tracker), where.at("growth_tracker", step))


@given(case=trace())
@settings(deadline=None)
def test_jmp_dynamic_loss_scale_matches_the_jmp_preset(case):
    jmp = pytest.importorskip("jmp", reason="jmp (and JAX) is not installed")
    import jax.numpy as jnp

    peer = jmp.DynamicLossScale(loss_scale=jnp.float32(case["init"]), counter=jnp.int32(0), period=case["interval"],
                                factor=2)  # min_loss_scale: its default, 1.0
    cfg, state = _spec("jmp", init_scale=case["init"], growth_interval=case["interval"])
    where = Where("jmp DynamicLossScale", repro=REPRO)
    for step, overflow in enumerate(case["overflows"][:100]):  # JAX dispatch is slow per step
        peer = peer.adjust(jnp.bool_(not overflow))
        state = scaling.update_scale(state, overflow, cfg)
        _check(where, step, float(peer.loss_scale), state)
        assert_equal(int(peer.counter), int(state.growth_tracker), where.at("counter", step))


def test_jmp_growth_past_float32_is_refused_as_in_the_spec():
    jmp = pytest.importorskip("jmp", reason="jmp (and JAX) is not installed")
    import jax.numpy as jnp

    peer = jmp.DynamicLossScale(loss_scale=jnp.float32(2.0**127), counter=jnp.int32(0), period=1, factor=2)
    cfg, state = _spec("jmp", init_scale=2.0**127, growth_interval=1)
    peer, state = peer.adjust(jnp.bool_(True)), scaling.update_scale(state, False, cfg)
    assert float(peer.loss_scale) == float(state.scale) == 2.0**127 and int(peer.counter) == int(state.growth_tracker)


def test_deepspeed_grows_past_float32_where_the_spec_stops_at_2_127():
    """The stated difference: DeepSpeed's scale is a Python float."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler", reason="DeepSpeed is not installed")
    peer = loss_scaler.DynamicLossScaler(init_scale=2.0**127, scale_window=1, min_scale=1.0, delayed_shift=2,
                                         consecutive_hysteresis=False)  # clean steps only: no logging
    cfg, state = _spec("deepspeed", init_scale=2.0**127, growth_interval=1)
    for _ in range(2):  # DeepSpeed's first growth needs interval + 1 clean steps
        peer.update_scale(False)
        state = scaling.update_scale(state, False, cfg)
    assert peer.cur_scale == 2.0**128 and float(state.scale) == 2.0**127


def test_apex_loss_scaler_matches_the_apex_preset():
    amp_scaler = pytest.importorskip("apex.amp.scaler", reason="NVIDIA apex is not installed (it is not on PyPI; "
                                     "the PyPI package named apex is unrelated)")
    rng = np.random.default_rng(0)
    for interval in (1, 3, 7):
        peer = amp_scaler.LossScaler("dynamic", init_scale=2.0**20, scale_window=interval)
        cfg, state = _spec("apex", init_scale=2.0**20, growth_interval=interval)
        where = Where("apex LossScaler", field=f"scale_window={interval}", repro=REPRO)
        for step, overflow in enumerate(rng.random(STEPS) < 0.1):
            peer._has_overflow = bool(overflow)
            assert_equal(peer.update_scale(), bool(overflow), where.at("should_skip", step))
            state = scaling.update_scale(state, bool(overflow), cfg)
            _check(where, step, peer.loss_scale(), state)
    static = amp_scaler.LossScaler(128.0)
    static._has_overflow = True
    assert static.update_scale() is False and static.loss_scale() == 128.0  # apex's static scale never skips
    assert scaling.step_applies(True, scaling.ScalerConfig.preset("static", skip_on_overflow=False))


def test_static_scales_of_the_peers_never_move():
    cfg, state = _spec("static", init_scale=512.0)
    checked = []
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler

        ds = LossScaler(scale=512.0)
        for overflow in (True, False, True):
            ds.update_scale(overflow)
        assert ds.cur_scale == 512.0
        checked.append("deepspeed")
    except ImportError:
        pass
    try:
        from megatron.core.optimizer.grad_scaler import ConstantGradScaler

        mg = object.__new__(ConstantGradScaler)
        import torch

        mg._scale = torch.tensor([512.0])
        for overflow in (True, False):
            mg.update(overflow)
        assert float(mg.scale.item()) == 512.0
        checked.append("megatron")
    except ImportError:
        pass
    try:
        import jax.numpy as jnp
        import jmp

        js = jmp.StaticLossScale(jnp.float32(512.0))
        assert float(js.adjust(jnp.bool_(False)).loss_scale) == 512.0
        checked.append("jmp")
    except ImportError:
        pass
    for overflow in (True, False, True):
        state = scaling.update_scale(state, overflow, cfg)
    assert float(state.scale) == 512.0 and not scaling.step_applies(True, cfg)
    if not checked:
        pytest.skip("none of DeepSpeed, megatron-core, jmp is installed")
