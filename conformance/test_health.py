"""The doctor's statistics (torchimpl.precision.health) against the specification (reference.health).

Counts, maxima and fractions match exactly (same integers, same division); the headroom is the
same float64 formula on the same amax; SQNR is within the bound of rule 8 (two float64 sums
in different orders); the masses within rule 15's bound. The last property drives the doctor
itself with generated models: it never says healthy against its own numbers. Mutants that these
properties kill (of torchimpl.precision.health, and of the doctor's verdicts):
``conformance/health_mutations.py``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import event, given, settings

from conformance import doctor_strategies as D
from conformance import strategies as S
from conformance.bridge import to_torch, torch_dtype
from reference import health as spec
from torchimpl.precision import health as ti

REPRO = "pytest conformance/test_health.py -k {name}"


def _msg(name: str, field: str, torch_value, spec_value, case: dict) -> str:
    shown = {k: (v.tolist() if isinstance(v, np.ndarray) and v.size <= 16 else getattr(v, "shape", v))
             for k, v in case.items()}
    return (f"{name}, field {field!r}: torch {torch_value!r} vs spec {spec_value!r} on {shown}; "
            f"reproduce: {REPRO.format(name=name)}")


@given(S.health_values())
def test_amax_and_headroom(case):
    x = case["x"]
    got, want = ti.amax(to_torch(x)), spec.amax(x)
    assert got == want or (math.isnan(got) and math.isnan(want)), _msg("amax", "amax", got, want, case)
    dtype = torch_dtype(case["fmt"])
    h_got, h_want = ti.headroom_bits(got, dtype), spec.headroom_bits(want, case["fmt"])
    assert h_got == h_want or (math.isnan(h_got) and math.isnan(h_want)), _msg("amax", "headroom", h_got, h_want, case)


@given(S.health_values())
def test_overflow_count(case):
    got = ti.overflow_count(to_torch(case["x"]), torch_dtype(case["fmt"]), case["scale"])
    want = spec.overflow_count(case["x"], case["fmt"], case["scale"])
    assert got == want, _msg("overflow", "overflow_count", got, want, case)


@given(S.health_values())
def test_underflow_count(case):
    got = ti.underflow_count(to_torch(case["x"]), torch_dtype(case["fmt"]), case["scale"])
    want = spec.underflow_count(case["x"], case["fmt"], case["scale"])
    assert got == want, _msg("underflow", "underflow_count", got, want, case)


@given(S.shadow_pair())
def test_flushed_count(case):
    got = ti.flushed_count(to_torch(case["reference"]), to_torch(case["observed"]))
    want = spec.flushed_count(case["reference"], case["observed"])
    assert got == want, _msg("flushed", "flushed_count", got, want, case)


@given(S.shadow_pair())
def test_nonfinite_and_subnormal_fractions(case):
    y = case["observed"].astype(np.float32)
    from reference.formats import cast

    low = cast(y, case["fmt"])
    t = to_torch(low)
    assert ti.nonfinite_fraction(t) == spec.nonfinite_fraction(low), _msg("fractions", "nonfinite", None, None, case)
    got, want = ti.subnormal_fraction(t, t.dtype), spec.subnormal_fraction(low, case["fmt"])
    assert got == want, _msg("fractions", "subnormal_fraction", got, want, case)


@given(S.shadow_pair())
def test_sqnr_within_the_bound_of_rule_8(case):
    r, o = case["reference"], case["observed"]
    got, want = ti.sqnr_db(to_torch(r), to_torch(o)), spec.sqnr_db(r, o)
    if math.isinf(want) or math.isnan(want):
        assert got == want or (math.isnan(got) and math.isnan(want)), _msg("sqnr", "sqnr_db", got, want, case)
        return
    bound = spec.sqnr_bound_db(r.size, want)
    assert abs(got - want) <= bound, _msg("sqnr", f"sqnr_db (bound {bound:.3g} dB)", got, want, case)


@given(S.weight_update())
def test_lost_update_count(case):
    got = ti.lost_update_count(to_torch(case["weight"]), to_torch(case["update"]))
    want = spec.lost_update_count(case["weight"], case["update"], case["fmt"])
    assert got == want, _msg("lost_updates", "lost_update_count", got, want, case)


@given(S.gradient_magnitudes())
def test_scale_range(case):
    got = ti.scale_range(to_torch(case["grad"]), torch_dtype(case["fmt"]), case["keep"])
    want = spec.scale_range(case["grad"], case["fmt"], case["keep"])
    assert (got.low, got.high, got.works) == (want.low, want.high, want.works), \
        _msg("scale_range", "low, high", (got.low, got.high), (want.low, want.high), case)


@given(S.weight_update())
def test_applied_lost_count(case):
    """Rule 12: the stored weight after one rounding of ``weight + update`` into its format."""
    w, u = case["weight"], case["update"]
    with np.errstate(all="ignore"):
        after = (w.astype(np.float64) + np.asarray(u, dtype=np.float64)).astype(w.dtype)
    got = ti.applied_lost_count(to_torch(w), to_torch(after), to_torch(u))
    want = spec.applied_lost_count(w, after, u)
    assert got == want, _msg("applied_lost", "applied_lost_count", got, want, case)


def _mass_close(got: tuple[float, float], want: tuple[float, float], n: int) -> bool:
    """Rule 15 of the spec: each sum within (n - 1) 2^-53 relative; zero exactly when nothing counts."""
    rel = max(n - 1, 1) * 2.0**-53
    return all((g == w) if w == 0 else abs(g - w) <= w * rel for g, w in zip(got, want))


@given(S.health_values())
def test_underflow_mass(case):
    x = case["x"]
    got = ti.underflow_mass(to_torch(x), torch_dtype(case["fmt"]), case["scale"])
    want = spec.underflow_mass(x, case["fmt"], case["scale"])
    assert _mass_close(got, want, x.size), _msg("underflow_mass", "(lost, total)", got, want, case)


@given(S.shadow_pair())
def test_flushed_mass(case):
    r, o = case["reference"], case["observed"]
    got = ti.flushed_mass(to_torch(r), to_torch(o))
    want = spec.flushed_mass(r, o)
    assert _mass_close(got, want, r.size), _msg("flushed_mass", "(lost, total)", got, want, case)


# ---------------------------------------------------------------- the doctor's verdict on generated models


def _diagnose(case: D.DoctorCase):
    # the doctor imports torchimpl's whole inspection; only these two properties need it
    from torchimpl import inspect_precision

    model, batches = case.make()
    report = inspect_precision(model, batches, precision=case.precision, steps=case.steps,
                               init_scale=case.init_scale, verify_fix=False)
    return report, f"reproduce: {case.reproduce()}, inspect_precision(model, batches, precision, steps, init_scale)"


@settings(max_examples=25)
@given(D.doctor_cases(faults=("poison", "none")))
def test_the_doctor_never_says_healthy_with_a_skip_the_scale_did_not_cause(case):
    """Never healthy when a step was skipped for a reason other than the scale: a planted poison
    (known by construction) on a step run at a scale of 2^8 or less, where these networks'
    gradients fit; and a model with no planted fault is never blamed for the scaler's warm-up."""
    report, repro = _diagnose(case)
    for k in case.poison_steps:
        if case.precision == "bf16" or report.loss_scales[k] <= 2.0**8:
            event(f"a poisoned step judged ({case.precision})")
            assert k in report.skipped_steps, f"step {k}, field 'skipped_steps': {report.skipped_steps}; {repro}"
            assert not report.healthy, f"step {k}, field 'healthy': True with a poisoned step skipped; {repro}"
    if not case.poison_steps:
        blamed = [v.kind for v in report.verdicts if v.kind == "gradient-overflow"]
        assert not blamed, f"field 'verdicts': {blamed} on a model with no fault (skipped {report.skipped_steps}); {repro}"


@settings(max_examples=25)
@given(D.doctor_cases())
def test_the_doctor_never_says_healthy_below_the_sqnr_floor(case):
    """Never healthy when a 16-bit layer's SQNR against the shadow is below its format's floor."""
    report, repro = _diagnose(case)
    for layer in report.layers:
        floor = report.sqnr_floor_db.get(layer.dtype)
        if floor is not None and layer.sqnr_db < floor:
            event("a layer below its SQNR floor")
            assert not report.healthy, (f"step {layer.sqnr_step}, field 'healthy': True with {layer.name!r} at "
                                        f"{layer.sqnr_db:.1f} dB, below the {layer.dtype} floor {floor} dB; {repro}")
