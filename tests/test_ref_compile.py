"""reference.compile: the rules for compiled code, keyed by torch version, and the derived bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from reference import compile as rc
from reference import optim


def test_rules_are_keyed_by_major_minor_and_an_unmeasured_version_is_refused():
    assert rc.compile_rules("2.13.0+cpu") is rc.compile_rules("2.13")
    with pytest.raises(ValueError, match="not measured on torch 2.9.*measured: 2.13"):
        rc.compile_rules("2.9.1")


def test_every_registry_optimizer_has_a_rule_and_nothing_else_does():
    rules = rc.compile_rules("2.13").steps
    assert set(rules) == set(optim.SPECS)
    for name, rule in rules.items():
        assert rule.bitwise <= {"for-loop", "foreach"}, name
        assert rule.why, name
    with pytest.raises(KeyError, match="no compile rule for optimizer 'Lion'"):
        rc.compiled_step_rule("Lion", "2.13")


def test_sgd_has_no_scalar_term_and_its_bound_is_the_native_one():
    cfg = optim.spec("SGD").make_config(lr=0.1, momentum=0.9)
    assert rc.scalar_relative_error("SGD", cfg, 3) == {}
    assert rc.compiled_step_ulp("SGD", "param", 16, cfg, 3) == 16


def test_adam_scalar_term_follows_the_cancellation_of_one_minus_beta_power():
    """1 - beta2^t with beta2 = 0.999 keeps float32's absolute error of beta2^t, so its relative
    error is about (t |dbeta| + 2 ULP) / (1 - beta2^t): largest at t = 1, shrinking with t."""
    cfg = optim.spec("Adam").make_config(lr=1e-3)
    r = [rc.scalar_relative_error("Adam", cfg, t)["param"] for t in (1, 2, 10, 1000)]
    assert r == sorted(r, reverse=True)
    b2 = 0.999
    d = abs(float(np.float32(b2)) - b2)
    floor = 0.5 * (d + 2 * rc.U32 * b2) / (1 - b2)  # sqrt halves bc2's relative error
    assert floor <= r[0] <= 2 * floor + 1e-5


def test_adagrad_without_lr_decay_has_only_the_lr_rounding():
    cfg = optim.spec("Adagrad").make_config(lr=0.01)
    r = rc.scalar_relative_error("Adagrad", cfg, 7)["param"]
    lr_rel = abs(float(np.float32(0.01)) - 0.01) / 0.01
    assert lr_rel <= r <= lr_rel + 4 * rc.U32


def test_radam_near_the_rectification_threshold_is_undetermined():
    cfg = optim.spec("RAdam").make_config()
    # beta2 = 0.999: rho_t crosses 5 between t = 5 and t = 6; far from it the bound is finite.
    assert math.isfinite(rc.compiled_step_ulp("RAdam", "param", 30, cfg, 4))
    assert math.isfinite(rc.compiled_step_ulp("RAdam", "param", 30, cfg, 40))
    undetermined = [t for t in range(1, 12) if math.isinf(rc.compiled_step_ulp("RAdam", "param", 30, cfg, t))]
    assert undetermined == [5]


def test_the_scalar_chain_bounds_a_real_float32_evaluation():
    """The running bound covers NumPy's float32 evaluation of the same chain (powf, then 1 - x)."""
    for b in (0.9, 0.99, 0.999, 0.9999, 0.95):
        for t in (1, 2, 3, 17, 500):
            exact = 1 - b**t
            f32 = float(np.float32(1) - np.power(np.float32(b), np.float32(t)))
            bound = (1 - rc._pow(b, t)).e
            assert abs(f32 - exact) <= bound, (b, t)


def test_the_envelope_of_dropped_roundings():
    out = np.array([1.0, 3.0, -0.5])
    z, dz = np.array([0.75, 0.75, 0.75]), np.array([2.0, 0.0, 1.0])
    env = rc.dropped_rounding_envelope(out, [(z, dz)], "bfloat16", 3)
    ulp_out = np.array([2.0**-7, 2.0**-6, 2.0**-8])
    expected = 2 * ulp_out + 6 * rc.U32 * np.abs(out) + dz * 2.0**-8 / 2
    np.testing.assert_allclose(env, expected, rtol=0, atol=0)
    # float16 spacing near zero is the subnormal step 2^-24, not smaller.
    assert rc._ulp(np.array([1e-9]), "float16")[0] == 2.0**-24


def test_compiled_step_ulp_adds_the_ceiling_of_the_scalar_term():
    cfg = optim.spec("Adamax").make_config(lr=2e-3)
    r = rc.scalar_relative_error("Adamax", cfg, 4)["param"]
    assert rc.compiled_step_ulp("Adamax", "param", 22, cfg, 4) == 22 + math.ceil(r / rc.U32)
    assert rc.compiled_step_ulp("Adamax", "exp_avg", 10, cfg, 4) == 10


def test_graph_counts_follow_the_rule():
    sgd = optim.spec("SGD")
    assert rc.expected_graphs("SGD", sgd.make_config(lr=0.1, momentum=0.9), 5, "2.13") == 2
    assert rc.expected_graphs("SGD", sgd.make_config(lr=0.1, momentum=0.9), 1, "2.13") == 1
    assert rc.expected_graphs("SGD", sgd.make_config(lr=0.1), 5, "2.13") == 1
    assert rc.expected_graphs("Adam", optim.spec("Adam").make_config(), 0, "2.13") == 0
    assert rc.expected_graphs("Adam", optim.spec("Adam").make_config(), 9, "2.13") == 1
    with pytest.raises(ValueError, match="no graph count for Adafactor"):
        rc.expected_graphs("Adafactor", optim.spec("Adafactor").make_config(), 9, "2.13")
    assert rc.compiled_step_rule("Adafactor", "2.13").eager


def test_matmul_envelope_adds_the_propagated_difference_and_the_roundings():
    a = np.array([[1.0, -2.0]])
    db = np.array([[0.5], [0.25]])
    b = np.array([[1.0], [1.0]])
    out = np.array([[3.0]])
    env = rc.matmul_envelope(a, db, b, out, "bfloat16")
    assert env[0, 0] == 1.0 + 2 * 2 * rc.U32 * 3.0 + 2 * 2.0**-6
