"""reference.optim: torch's for-loop SGD/Adam/AdamW and fused Adam under a GradScaler."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from reference import optim
from reference.optim import (
    AdamConfig,
    AdamParamState,
    SGDConfig,
    SGDParamState,
    adam_step,
    adamw_config,
    fused_adam_step,
    init_state,
    sgd_step,
)

F32 = np.float32


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    width = {4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    same_layout = a.dtype == b.dtype and a.shape == b.shape
    return same_layout and np.array_equal(a.view(width), b.view(width))


def arr(*values) -> np.ndarray:
    return np.array(values, F32)


# --- SGD ----------------------------------------------------------------------------------


def test_sgd_plain_step_is_p_plus_minus_lr_times_grad():
    cfg = SGDConfig(lr=0.1)
    (p,), (s,) = sgd_step([arr(1.0, -2.0)], [arr(0.5, 3.0)], init_state([arr(1.0, -2.0)], cfg), cfg)
    expected = arr(1.0, -2.0) + F32(-0.1) * arr(0.5, 3.0)
    assert same_bits(p, expected), p
    assert s == SGDParamState(momentum_buffer=None), "no buffer is created without momentum"


def test_sgd_momentum_buffer_starts_as_the_gradient_and_ignores_dampening_once():
    cfg = SGDConfig(lr=0.5, momentum=0.9, dampening=0.5)
    p0, g1, g2 = arr(1.0), arr(2.0), arr(4.0)
    params, state = sgd_step([p0], [g1], init_state([p0], cfg), cfg)
    assert same_bits(state[0].momentum_buffer, g1), "first buffer is a copy of the gradient"
    assert same_bits(params[0], p0 + F32(-0.5) * g1)
    params, state = sgd_step(params, [g2], state, cfg)
    buf = g1 * F32(0.9) + F32(0.5) * g2  # (1 - dampening) applies from the second step on
    assert same_bits(state[0].momentum_buffer, buf)
    assert float(state[0].momentum_buffer[0]) == pytest.approx(3.8)


def test_sgd_nesterov_looks_ahead_along_the_buffer():
    cfg = SGDConfig(lr=1.0, momentum=0.5, nesterov=True)
    (p,), _ = sgd_step([arr(0.0)], [arr(2.0)], init_state([arr(0.0)], cfg), cfg)
    # d = g + momentum * buf = 2 + 0.5 * 2 = 3
    assert p[0] == F32(-3.0)


def test_sgd_weight_decay_adds_decay_times_param_to_the_gradient():
    cfg = SGDConfig(lr=0.1, weight_decay=0.01)
    (p,), _ = sgd_step([arr(3.0)], [arr(1.0)], init_state([arr(3.0)], cfg), cfg)
    d = arr(1.0) + F32(0.01) * arr(3.0)
    assert same_bits(p, arr(3.0) + F32(-0.1) * d)


def test_sgd_maximize_is_minimizing_the_negated_gradient():
    p0, g = arr(1.0, 2.0), arr(0.3, -0.7)
    up = SGDConfig(lr=0.1, momentum=0.9, weight_decay=0.1, maximize=True)
    down = dataclasses.replace(up, maximize=False)
    a, sa = sgd_step([p0], [g], init_state([p0], up), up)
    b, sb = sgd_step([p0], [-g], init_state([p0], down), down)
    assert same_bits(a[0], b[0]) and same_bits(sa[0].momentum_buffer, sb[0].momentum_buffer)


def test_lr_argument_overrides_the_config_for_schedules():
    cfg = SGDConfig(lr=0.1)
    (p,), _ = sgd_step([arr(1.0)], [arr(1.0)], init_state([arr(1.0)], cfg), cfg, lr=0.0)
    assert p[0] == F32(1.0)
    with pytest.raises(ValueError, match="lr"):
        sgd_step([arr(1.0)], [arr(1.0)], init_state([arr(1.0)], cfg), cfg, lr=-1.0)


# --- Adam / AdamW -------------------------------------------------------------------------


def test_adam_first_step_by_hand():
    cfg = AdamConfig(lr=0.01)
    p0, g = arr(0.5, -1.0), arr(0.2, -3.0)
    (p,), (s,) = adam_step([p0], [g], init_state([p0], cfg), cfg)
    m = F32(0.0) + F32(0.1) * (g - F32(0.0))  # lerp with weight 0.1 < 0.5
    v = F32(0.0) * F32(0.999) + (F32(1 - 0.999) * g) * g
    bc1, bc2 = 1 - 0.9, 1 - 0.999
    denom = np.sqrt(v) / F32(bc2**0.5) + F32(1e-8)
    expected = p0 + (F32(-0.01 / bc1) * m) / denom
    assert s.step == F32(1.0) and s.step.dtype == np.float32
    assert same_bits(s.exp_avg, m) and same_bits(s.exp_avg_sq, v)
    assert same_bits(p, expected), (p, expected)
    # Bias correction makes the first step about lr * sign(g).
    np.testing.assert_allclose(p, p0 - 0.01 * np.sign(g), rtol=1e-5)


def test_adam_lerp_switches_formula_for_large_weights():
    cfg = AdamConfig(lr=0.0, betas=(0.2, 0.999))  # weight 1 - beta1 = 0.8 >= 0.5
    p0, g = arr(0.0), arr(0.3)
    state = (AdamParamState(F32(0.0), arr(0.7), arr(0.0)),)
    _, (s,) = adam_step([p0], [g], state, cfg)
    w = F32(0.8)
    assert same_bits(s.exp_avg, g - (g - arr(0.7)) * (F32(1.0) - w))


def test_adamw_decays_the_parameter_itself_adam_decays_the_gradient():
    p0, zero = arr(2.0), arr(0.0)
    w = adamw_config(lr=0.1, weight_decay=0.5)
    assert w.decoupled_weight_decay and adamw_config().weight_decay == 0.01
    (p,), (s,) = adam_step([p0], [zero], init_state([p0], w), w)
    # Zero gradient: the moments stay 0, 0 / (0 + eps) = 0, only the decay moves the param.
    assert same_bits(p, p0 * F32(1 - 0.1 * 0.5)) and s.exp_avg[0] == 0.0
    a = AdamConfig(lr=0.1, weight_decay=0.5)
    (q,), (t,) = adam_step([p0], [zero], init_state([p0], a), a)
    assert t.exp_avg[0] == F32(0.1) * (F32(0.5) * p0[0]), "Adam's decay enters the moments"
    assert q[0] < F32(2.0) - F32(0.09)


def test_amsgrad_normalises_by_the_running_maximum():
    cfg = AdamConfig(lr=0.1, amsgrad=True)
    p0 = arr(0.0)
    params, state = adam_step([p0], [arr(10.0)], init_state([p0], cfg), cfg)
    big = state[0].exp_avg_sq.copy()
    params, state = adam_step(params, [arr(0.0)], state, cfg)
    assert state[0].exp_avg_sq[0] < big[0]
    assert same_bits(state[0].max_exp_avg_sq, big), "the max keeps the larger second moment"
    assert init_state([p0], AdamConfig())[0].max_exp_avg_sq is None


def test_adam_maximize_is_minimizing_the_negated_gradient():
    p0, g = arr(1.0, -1.0), arr(0.25, 4.0)
    up = AdamConfig(lr=0.05, weight_decay=0.1, maximize=True)
    down = dataclasses.replace(up, maximize=False)
    a, sa = adam_step([p0], [g], init_state([p0], up), up)
    b, sb = adam_step([p0], [-g], init_state([p0], down), down)
    assert same_bits(a[0], b[0]) and same_bits(sa[0].exp_avg, sb[0].exp_avg)


def test_step_counter_is_float32_and_saturates_at_2_pow_24():
    cfg = AdamConfig()
    state = (AdamParamState(F32(2.0**24), arr(0.0), arr(0.0)),)
    _, (s,) = adam_step([arr(1.0)], [arr(1.0)], state, cfg)
    assert s.step == F32(2.0**24), "float32 step + 1 rounds back to 2**24"


def test_missing_gradient_leaves_param_and_state_untouched():
    cfg = AdamConfig()
    params = [arr(1.0), arr(2.0)]
    state = init_state(params, cfg)
    new, new_state = adam_step(params, [None, arr(1.0)], state, cfg)
    assert same_bits(new[0], params[0]) and new_state[0] is state[0]
    assert new_state[1].step == F32(1.0)


def test_zero_size_params_count_steps():
    cfg = adamw_config()
    p = np.zeros((0, 4), F32)
    (q,), (s,) = adam_step([p], [p], init_state([p], cfg), cfg)
    assert q.shape == (0, 4) and s.step == F32(1.0)
    sgd = SGDConfig(lr=0.1, momentum=0.9)
    (q,), (t,) = sgd_step([p], [p], init_state([p], sgd), sgd)
    assert q.shape == (0, 4) and t.momentum_buffer.shape == (0, 4)


def test_inputs_are_not_modified_and_states_are_read_only():
    cfg = AdamConfig(lr=0.1)
    p, g = arr(1.0, 2.0), arr(0.5, 0.5)
    pc, gc = p.copy(), g.copy()
    _, (s,) = adam_step([p], [g], init_state([p], cfg), cfg)
    assert same_bits(p, pc) and same_bits(g, gc)
    with pytest.raises(ValueError):
        s.exp_avg[0] = 1.0


_OPTIONS = {
    "SGD": [{"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
            {"momentum": 0.9, "dampening": 0.5, "weight_decay": 0.1, "maximize": True}, {"maximize": True}],
    "Adam": [{"amsgrad": True, "weight_decay": 0.1, "maximize": True}],
    "AdamW": [{"amsgrad": True, "maximize": True}],
}
_ALL_ROWS = [(name, impl, options) for name, row in optim.SPECS.items() for impl in row.steps
             for options in [{}] + _OPTIONS.get(name, [])]


@pytest.mark.parametrize(("name", "impl", "options"), _ALL_ROWS, ids=lambda v: str(v) if v else "defaults")
def test_every_step_leaves_its_inputs_alone_and_returns_arrays_of_its_own(name, impl, options):
    """The steps compute into preallocated arrays: none of them may be an input, the state's are
    read-only, and a returned parameter shares memory with nothing it came from or went into."""
    row = optim.spec(name)
    cfg = row.make_config(**options)
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        for shape in ((), (3, 4)):
            params = [rng.standard_normal(shape).astype(dtype) for _ in range(2)]
            state = tuple(row.init_state(x, cfg) for x in params)
            scale = {"grad_scale": 1024.0} if impl in row.kernel_scaled else {}
            for _ in range(2):  # the second step starts from a state with every buffer
                grads = [rng.standard_normal(shape).astype(dtype) for _ in params]
                inputs = [*params, *grads, *(v for st in state for v in vars(st).values() if isinstance(v, np.ndarray))]
                copies = [x.copy() for x in inputs]
                new_params, _, new_state = row.step(impl, params, grads, state, cfg, **scale)
                assert all(same_bits(x, c) for x, c in zip(inputs, copies)), f"{name} {impl} {options} wrote an input"
                kept = [v for st in new_state for v in vars(st).values() if isinstance(v, np.ndarray)]
                assert all(not v.flags.writeable for v in kept), f"{name} {impl} {options}: a writeable state array"
                for q in new_params:
                    assert np.asarray(q).dtype == dtype and np.shape(q) == shape
                    assert not any(np.shares_memory(q, x) for x in inputs + kept if x is not q), \
                        f"{name} {impl} {options}: a new parameter shares memory with an input or the state"
                params, state = new_params, new_state


def test_custom_square_root_is_used_by_the_for_loop_path():
    cfg = AdamConfig(lr=0.1)
    p, g = arr(1.0, 2.0, 3.0), arr(0.5, -0.25, 2.0)
    state = init_state([p], cfg)
    plain, _ = adam_step([p], [g], state, cfg)
    same, _ = adam_step([p], [g], state, cfg, sqrt=np.sqrt)
    assert same_bits(plain[0], same[0])
    doubled, _ = adam_step([p], [g], state, cfg, sqrt=lambda a: np.sqrt(a) * F32(2.0))
    # A root twice as large halves the first step (about lr / 2 instead of lr).
    np.testing.assert_allclose(doubled[0] - p, (plain[0] - p) / 2, rtol=1e-5)


# --- fused Adam under a GradScaler --------------------------------------------------------


def test_fused_skip_on_found_inf_keeps_params_moments_and_scaled_grads():
    cfg = adamw_config(lr=0.1)
    p = arr(1.0, -1.0)
    scaled = arr(1024.0, np.inf)
    state0 = init_state([p], cfg)
    params, grads, state = fused_adam_step(
        [p], [scaled], state0, cfg, grad_scale=1024.0, found_inf=1.0
    )
    assert same_bits(params[0], p), "a skipped step must not move the params"
    assert same_bits(grads[0], scaled), "grads stay scaled on a skipped step"
    # The lazily created state exists, at step 0, exactly as init_state makes it.
    assert state[0].step == F32(0.0)
    assert same_bits(state[0].exp_avg, state0[0].exp_avg)
    assert same_bits(state[0].exp_avg_sq, state0[0].exp_avg_sq)


def test_fused_unscales_by_true_division_and_stores_the_result():
    cfg = adamw_config(lr=0.1)
    g = np.random.default_rng(0).standard_normal(64).astype(F32) * F32(1000.0)
    p = np.ones(64, F32)
    _, (out,), (s,) = fused_adam_step([p], [g], init_state([p], cfg), cfg, grad_scale=1000.0)
    assert same_bits(out, g / F32(1000.0)), "fused unscale is a true division"
    reciprocal = g * F32(1.0 / F32(1000.0))
    assert not same_bits(out, reciprocal), "example should show division != multiply by 1/S"
    assert s.step == F32(1.0)


def test_fused_skips_only_when_found_inf_is_exactly_one():
    cfg = AdamConfig(lr=0.1)
    p, g = arr(1.0), arr(2.0)
    for flag, step in ((2.0, -1.0), (0.5, 0.5)):
        params, _, state = fused_adam_step([p], [g], init_state([p], cfg), cfg, found_inf=flag)
        assert params[0] != p[0], f"found_inf={flag} must not skip"
        assert state[0].step == F32(step), f"step is incremented then decremented by {flag}"


def test_fused_without_scale_matches_the_for_loop_on_the_same_grads():
    cfg = AdamConfig(lr=0.01, weight_decay=0.1, amsgrad=True)
    rng = np.random.default_rng(1)
    p = rng.standard_normal(40).astype(F32)
    a_params, a_state, f_params, f_state = [p], init_state([p], cfg), [p], init_state([p], cfg)
    for _ in range(5):
        g = rng.standard_normal(40).astype(F32)
        a_params, a_state = adam_step(a_params, [g], a_state, cfg)
        f_params, _, f_state = fused_adam_step(f_params, [g], f_state, cfg)
    assert same_bits(a_params[0], f_params[0])
    assert same_bits(a_state[0].max_exp_avg_sq, f_state[0].max_exp_avg_sq)


def test_fused_missing_gradient_is_skipped():
    cfg = AdamConfig()
    params, grads, state = fused_adam_step([arr(1.0)], [None], init_state([arr(1.0)], cfg), cfg)
    assert grads == [None] and state[0].step == F32(0.0) and params[0][0] == F32(1.0)


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SGDConfig(lr=-0.1), "lr"),
        (lambda: SGDConfig(lr=float("nan")), "lr"),
        (lambda: SGDConfig(lr=0.1, momentum=-0.5), "momentum"),
        (lambda: SGDConfig(lr=0.1, weight_decay=-1.0), "weight_decay"),
        (lambda: SGDConfig(lr=0.1, nesterov=True), "nesterov"),
        (lambda: SGDConfig(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "nesterov"),
        (lambda: AdamConfig(lr=-1e-3), "lr"),
        (lambda: AdamConfig(betas=(1.0, 0.999)), r"betas\[0\]"),
        (lambda: AdamConfig(betas=(0.9, -0.1)), r"betas\[1\]"),
        (lambda: AdamConfig(betas=(0.9, 0.99, 0.9)), "betas"),
        (lambda: AdamConfig(eps=-1e-8), "eps"),
        (lambda: AdamConfig(weight_decay=-0.1), "weight_decay"),
        (lambda: adamw_config(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_bad_hyperparameters_raise_value_error_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_step_inputs_raise_value_error():
    sgd, adam = SGDConfig(lr=0.1), AdamConfig()
    p = arr(1.0, 2.0)
    with pytest.raises(ValueError, match="same length"):
        sgd_step([p], [p, p], init_state([p], sgd), sgd)
    with pytest.raises(ValueError, match="float32 or float64"):
        init_state([p.astype(np.float16)], sgd)
    with pytest.raises(ValueError, match=r"grads\[0\]"):
        adam_step([p], [arr(1.0)], init_state([p], adam), adam)
    with pytest.raises(ValueError, match=r"grads\[0\]"):
        adam_step([p], [p.astype(np.float64)], init_state([p], adam), adam)
    with pytest.raises(ValueError, match="SGDConfig"):
        sgd_step([p], [p], init_state([p], adam), adam)
    with pytest.raises(ValueError, match=r"state\[0\]"):
        adam_step([p], [p], init_state([p], sgd), adam)
    with pytest.raises(ValueError, match="config"):
        init_state([p], object())


# --- the registry ---------------------------------------------------------------------------

from reference import optim as _optim  # noqa: E402


def test_every_row_states_torchs_defaults_and_refuses_unknown_hyperparameters():
    assert _optim.spec("AdamW").hyperparameters()["weight_decay"] == 1e-2
    assert _optim.spec("Adam").hyperparameters()["weight_decay"] == 0.0
    assert _optim.spec("Adagrad").hyperparameters()["eps"] == 1e-10
    assert _optim.spec("Adadelta").hyperparameters()["lr"] == 1.0
    with pytest.raises(ValueError, match="RMSprop has no hyperparameter betas; its hyperparameters: lr, alpha"):
        _optim.spec("RMSprop").make_config(betas=(0.9, 0.99))
    with pytest.raises(KeyError, match="'Lion' is not in the specification; registered: SGD, Adam"):
        _optim.spec("Lion")
    with pytest.raises(ValueError, match="is not the configuration of a registered optimizer"):
        _optim.spec_for(object())


def test_a_row_refuses_an_implementation_or_a_scaler_argument_it_does_not_have():
    row, cfg = _optim.spec("RMSprop"), _optim.RMSpropConfig()
    p = [arr(1.0)]
    with pytest.raises(ValueError, match="RMSprop has no 'fused' implementation"):
        row.step("fused", p, p, (row.init_state(p[0], cfg),), cfg)
    with pytest.raises(ValueError, match="takes no grad_scale/found_inf"):
        row.step("for-loop", p, p, (row.init_state(p[0], cfg),), cfg, found_inf=1.0)


def test_fused_adagrad_skips_inside_its_kernel_and_keeps_its_counter():
    """reference.optim.adagrad rule 5: found_inf == 1.0 leaves everything, the gradients still
    scaled; an applied step divides them by the scale and stores them back."""
    row, cfg = _optim.spec("Adagrad"), _optim.AdagradConfig(lr=0.1)
    p, g = arr(1.0, 2.0), arr(3000.0, -6000.0)
    state = (row.init_state(p, cfg),)
    params, grads, new = row.step("fused", [p], [g], state, cfg, grad_scale=1000.0, found_inf=1.0)
    assert same_bits(params[0], p) and same_bits(grads[0], g) and new[0].step == F32(0.0)
    params, grads, new = row.step("fused", [p], [g], state, cfg, grad_scale=1000.0, found_inf=0.0)
    assert same_bits(grads[0], g / F32(1000.0)) and new[0].step == F32(1.0)
    expected, _, _ = row.step("for-loop", [p], [g / F32(1000.0)], state, cfg)
    assert same_bits(params[0], expected[0]), "the applied kernel step is the for-loop step of the unscaled gradient"


def test_nadam_mu_product_is_a_float32_running_product():
    """reference.optim.nadam rule 3: f32(mu_product * f32(mu)), not a float64 product."""
    row, cfg = _optim.spec("NAdam"), _optim.NAdamConfig()
    state = (row.init_state(arr(1.0), cfg),)
    for t in (1, 2, 3):
        _, _, state = row.step("for-loop", [arr(1.0)], [arr(0.5)], state, cfg)
    mus = [0.9 * (1 - 0.5 * 0.96 ** (t * 4e-3)) for t in (1, 2, 3)]
    expected = F32(1.0)
    for mu in mus:
        expected = F32(expected * F32(mu))
    assert state[0].mu_product == expected and isinstance(state[0].mu_product, np.float32)


NOT_NATIVE_EXACT = [(name, impl) for name, row in optim.SPECS.items() for impl in row.steps
                    if impl not in row.native_exact]


@pytest.mark.parametrize(("name", "impl"), NOT_NATIVE_EXACT, ids=[f"{n}-{i}" for n, i in NOT_NATIVE_EXACT])
def test_a_native_step_is_refused_where_the_spec_does_not_model_it(name, impl):
    """``row.step(..., native=True)`` (reference.optim._common rule 7) on an implementation not in
    the row's ``native_exact`` (fused Adam, every SGD path, ...) is a ValueError naming the row,
    the implementation and the ones it has."""
    row = optim.spec(name)
    cfg = row.make_config()
    p = np.ones((3, 3), F32)
    expected = ", ".join(sorted(row.native_exact)) or "none"
    with pytest.raises(ValueError, match=rf"^{name}'s {impl} path on native kernels is not modelled bit for bit "
                                         rf"\(native_exact: {expected}\)$"):
        row.step(impl, [p], [p], (row.init_state(p, cfg),), cfg, native=True)


@pytest.mark.parametrize("name", [n for n, row in optim.SPECS.items() if row.native_exact])
def test_a_native_step_is_refused_on_float64_parameters(name):
    """Rule 7 states float32: float64 parameters with ``native=True`` are a ValueError naming the
    parameter and its dtype, on every ``native_exact`` path; float32 ones beside them step."""
    row = optim.spec(name)
    cfg = row.make_config()
    p32, p64 = np.ones(4, F32), np.ones(4, np.float64)
    for impl in sorted(row.native_exact):
        with pytest.raises(ValueError, match=r"params\[1\] is float64: the native kernels' fusions are stated for "
                                             r"float32 only"):
            row.step(impl, [p32, p64], [p32, p64], (row.init_state(p32, cfg), row.init_state(p64, cfg)), cfg,
                     native=True)
        new_p, _, _ = row.step(impl, [p32], [p32], (row.init_state(p32, cfg),), cfg, native=True)
        assert new_p[0].dtype == F32 and not np.array_equal(new_p[0], p32)
