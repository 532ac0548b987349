"""torch's Adafactor where it departs from the published algorithm (Shazeer & Stern 2018), and
its keyed quirks: each a tested expectation with its reason (reference.optim.adafactor).

The step-by-step property of every registered optimizer (conformance/test_optimizers.py) covers
Adafactor's two paths; these pin the facts a reader of the paper would not expect.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conformance import expectations
from conformance.assertions import Where, assert_same
from conformance.bridge import to_numpy, to_torch
from reference import optim

ROW = optim.spec("Adafactor")


def _one_step(params: list[np.ndarray], grads: list[np.ndarray], device: str, foreach: bool = False,
              with_spec: bool = True, **cfg):
    """torch's parameters and states after one step, and the spec's (None without ``with_spec``)."""
    tp = [torch.nn.Parameter(to_torch(p, device)) for p in params]
    opt = torch.optim.Adafactor(tp, foreach=foreach, **cfg)
    for p, g in zip(tp, grads):
        p.grad = to_torch(g, device)
    opt.step()
    if not with_spec:
        return [to_numpy(p) for p in tp], [opt.state[p] for p in tp], None
    config = ROW.make_config(**cfg)
    state = tuple(ROW.init_state(p, config) for p in params)
    spec = ROW.step("foreach" if foreach else "for-loop", params, grads, state, config)
    return [to_numpy(p) for p in tp], [opt.state[p] for p in tp], spec


@pytest.mark.parametrize("foreach", [False, True])
def test_eps1_none_is_resolved_once_for_the_whole_call(device, foreach):
    """Rule 2 and 8: torch resolves ``eps1=None`` once per call and keeps it for every parameter.
    The for-loop takes the epsilon of the first parameter with a gradient: a float32 parameter
    after a float64 one gets float64's, so its gradient of 1e-9 is above the floor and its update
    is the gradient's sign (a step of lr). The foreach path takes the epsilon of the first dtype
    group torch forms, which is not the first parameter's (measured with torch 2.13: the float32
    group first here), so the float32 parameter is clamped by its own epsilon (a step about 8e-3
    times as large). The spec's for-loop follows; its foreach path refuses two dtypes with
    eps1=None."""
    p64, p32 = np.ones(4, np.float64), np.ones(4, np.float32)
    g64, g32 = np.full(4, 1e-9, np.float64), np.full(4, 1e-9, np.float32)
    got, _, _ = _one_step([p64, p32], [g64, g32], device, foreach=foreach, with_spec=False, lr=0.01)
    step32 = float(p32[0] - got[1][0])
    expected = 1e-9 / float(np.finfo(np.float32).eps) * 0.01 if foreach else 0.01
    assert step32 == pytest.approx(expected, rel=1e-3), (
        f"torch {torch.__version__} ({'foreach' if foreach else 'for-loop'}): the float32 step is {step32}, "
        f"the suite expects {expected}; check how this torch resolves eps1=None and update rule 2/8")
    config = ROW.make_config(lr=0.01)
    state = tuple(ROW.init_state(p, config) for p in (p64, p32))
    if foreach:
        with pytest.raises(ValueError, match="two dtypes"):
            ROW.step("foreach", [p64, p32], [g64, g32], state, config)
        return
    spec, _, _ = ROW.step("for-loop", [p64, p32], [g64, g32], state, config)
    assert float(p32[0] - spec[1][0]) == pytest.approx(0.01, rel=1e-4)


def test_the_row_statistic_is_a_squared_norm_over_n_and_eps1_is_not_added_to_the_squares(device):
    """Rule 5: torch's row mean is ``norm(g, dim=-1) ** 2 / n`` (a rounded root squared), not the
    paper's sum of squares plus eps1 (nor the mean of the squares, whose last bits differ): a
    zero row keeps a zero factor, and every factor is the spec's formula (bit for bit with exact
    kernels)."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal((16, 33)).astype(np.float32)
    g[3] = 0.0
    p = rng.standard_normal((16, 33)).astype(np.float32)
    _, states, (_, _, spec_state) = _one_step([p], [g], device, lr=0.01)
    row_var = to_numpy(states[0]["row_var"])
    assert row_var[3, 0] == 0.0, "a zero gradient row leaves its factor 0 (the paper's would be eps1)"
    norm = np.sqrt((g.astype(np.float64) ** 2).sum(-1, keepdims=True)).astype(np.float32)
    assert np.any((norm * norm) / np.float32(33) != (g * g).mean(-1, keepdims=True)), \
        "the two formulas agree on every row of this draw: it shows nothing"
    if expectations.exact_kernels(device):
        assert_same(row_var, spec_state[0].row_var, Where("Adafactor", step=0, field="row_var", repro="-k row_statistic"))


def test_lr_caps_the_relative_step_and_scales_the_weight_decay(device):
    """Rule 3 and 4: the paper fixes the relative step's cap at 0.01 and has no lr; torch's lr is
    the cap (``rho = min(lr, 1 / sqrt(t))``) and multiplies the decay, as AdamW's does."""
    p, g = np.full(8, 2.0, np.float32), np.full(8, 1.0, np.float32)
    small, _, _ = _one_step([p], [g], device, lr=0.01)
    large, _, _ = _one_step([p], [g], device, lr=0.5)
    assert float(p[0] - large[0][0]) == pytest.approx(50 * float(p[0] - small[0][0]), rel=1e-5)
    decayed, _, _ = _one_step([p], [np.zeros(8, np.float32)], device, lr=0.5, weight_decay=0.1, eps=(1e-3, 1e-3))
    assert decayed[0][0] == np.float32(2.0) * np.float32(1 - 0.5 * 0.1)


@pytest.mark.parametrize("foreach", [False, True])
def test_an_empty_parameter_raises_in_torch_and_is_refused_by_the_spec(device, foreach):
    """Rule 10, keyed in expectations.known_optimizer_failure: torch's RMS of an empty parameter
    is 0.0 / 0.0 in Python."""
    p = torch.nn.Parameter(torch.zeros(0, 3, device=device))
    opt = torch.optim.Adafactor([p], foreach=foreach)
    p.grad = torch.zeros(0, 3, device=device)
    with pytest.raises(ZeroDivisionError, match="division by zero"):
        opt.step()
    a = np.zeros((0, 3), np.float32)
    with pytest.raises(ValueError, match=r"params\[0\] is empty"):
        ROW.step("foreach" if foreach else "for-loop", [a], [a], (ROW.init_state(a, ROW.make_config()),),
                 ROW.make_config())
