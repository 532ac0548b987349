"""Property 3: gradient clipping, torch against `reference.clipping` (order ``"torch_cpu"``).

``clip_grad_norm_`` is checked stage by stage, each stage fed the spec's output of the stage
before, so that a difference is pinned to the stage that made it and cannot be amplified
downstream:

1. per-tensor norms: ``torch.linalg.vector_norm`` of each gradient against ``tensor_norm``;
2. the total from the spec's per-tensor norms: ``torch.nn.utils.get_total_norm`` over one-element
   tensors holding them (a one-element norm is the element itself, rule 1, so torch stacks
   exactly the spec's norms, in its own dtype-group order) against ``total_norm``;
3. coefficient and clipped gradients from the spec's total: torch's coefficient, computed as
   ``_clip_grads_with_norm_`` computes it, and ``torch.nn.utils.clip_grads_with_norm_`` against
   ``clip_grad_norm``'s ``clip_coef`` and gradients.

Then the call users make, ``clip_grad_norm_``, end to end: total, coefficient and gradients.

Exactness (``expectations.exact_kernels``): with exact kernels everything is bit for bit. On
native CPU kernels stages 1-2 are within ``NORM_ULP`` and stage 3 is still bit for bit (a
reciprocal, a multiply, a clamp and one multiply per element are correctly rounded everywhere);
end to end is then bit for bit for the inf norm only. An end-to-end ULP bound for L2 does not
exist: a 1-ULP float32 per-tensor norm moves a float64 total (any float64 gradient present) by
about 2^29 float64 ULPs, and a float32 norm one ULP off can round to a different float16 or
bfloat16 norm, 2^13 or 2^16 float32 ULPs away. On CUDA the reductions use another order: norms
within ``cuda_norm_rtol``; stage 3 is expected bit for bit, with the coefficient rounded to a
16-bit gradient's dtype where ``expectations.clip_coef_in_grad_dtype`` says torch does so.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from conformance import expectations, strategies
from conformance.assertions import Where, assert_equal, assert_same, assert_same_list
from conformance.bridge import to_numpy, to_torch
from reference import clipping

REPRO = "rerun this test with the @reproduce_failure blob printed above"


def square_is_normal(x: np.floating) -> bool:
    """Is ``x * x``, in ``x``'s op math (float32, or float64 for float64), zero or a finite
    normal number? Only then is ``sqrt(x * x) == |x|`` whether or not a kernel squares."""
    op = np.float64 if np.asarray(x).dtype == np.float64 else np.float32
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        sq = op(x) * op(x)
    return bool(sq == 0 or (np.isfinite(sq) and sq >= np.finfo(op).tiny))


def _params(grads: list[np.ndarray], device: str) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        t = to_torch(g, device)
        p = torch.nn.Parameter(torch.zeros_like(t))
        p.grad = t
        params.append(p)
    return params


def torch_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The coefficient exactly as torch's ``_clip_grads_with_norm_`` computes it (clip_grad.py)."""
    clip_coef = max_norm / (total + 1e-6)
    return torch.clamp(clip_coef, max=1.0)


def _scalar(x) -> np.ndarray:
    return np.asarray(x).reshape(())


def _float64_ordinal(x: np.ndarray) -> int:
    bits = int(np.asarray(x, np.float64).reshape(1).view(np.int64)[0])
    return bits if bits >= 0 else -(bits & 0x7FFFFFFFFFFFFFFF)


def _assert_float64_ulp(actual: np.ndarray, expected: np.ndarray, where: Where, max_ulp: int) -> None:
    """A float64 scalar within ``max_ulp`` representable values (the shared assertions measure
    ULPs for the formats of ``reference.formats`` only); NaN as a class, inf must match."""
    a, e = np.float64(actual), np.float64(expected)
    if np.isnan(a) or np.isnan(e) or not (np.isfinite(a) and np.isfinite(e)):
        ok = (np.isnan(a) and np.isnan(e)) or a == e
    else:
        ok = abs(_float64_ordinal(a) - _float64_ordinal(e)) <= max_ulp
    if not ok:
        raise AssertionError(f"{where.header()}: torch {a!r} ({a.view(np.uint64):#018x}), spec {e!r} "
                             f"({e.view(np.uint64):#018x}), more than {max_ulp} ULP apart\n{where.footer()}")


def assert_norm(actual: np.ndarray, expected: np.ndarray, where: Where, device: str, n: int) -> None:
    """A norm from torch against the spec's, with the tolerance of ``device``'s kernels."""
    if expectations.exact_kernels(device):
        assert_same(actual, expected, where)
    elif device == "cpu":
        if np.asarray(expected).dtype == np.float64:
            _assert_float64_ulp(actual, expected, where, expectations.NORM_ULP)
        else:
            assert_same(actual, expected, where, max_ulp=expectations.NORM_ULP)
    else:
        a, e = np.float64(actual), np.float64(expected)
        # Plus one step of the norm's own dtype (eps * |e| >= its ULP at e): the final rounding
        # to that dtype may go the other way.
        eps = float(ml_dtypes.finfo(np.asarray(expected).dtype).eps)
        tol = (expectations.cuda_norm_rtol(n) + eps) * abs(e)
        if not ((np.isnan(a) and np.isnan(e)) or a == e or abs(a - e) <= tol):
            raise AssertionError(f"{where.header()}: torch {a!r}, spec {e!r}, |diff| {abs(a - e):.3g} > "
                                 f"tolerance {tol:.3g} (cuda_norm_rtol({n}) + eps)\n{where.footer()}")


def run_clip_case(case: dict, device: str) -> None:
    grads, p, max_norm = case["grads"], case["norm_type"], case["max_norm"]
    where = Where(f"clip_grad_norm_[norm_type={p}]", repro=REPRO)
    if p == math.inf and any(g.size == 0 for g in grads):
        # max has no identity: both refuse a zero-size gradient under the inf norm.
        with pytest.raises(RuntimeError, match="infinity norm on an empty tensor"):
            torch.nn.utils.clip_grad_norm_(_params(grads, device), max_norm, p)
        with pytest.raises(ValueError, match="zero-size"):
            clipping.clip_grad_norm(grads, max_norm, p)
        return
    threads = torch.get_num_threads()
    spec = clipping.clip_grad_norm(grads, max_norm, p, num_threads=threads,
                                   coef_in_grad_dtype=expectations.clip_coef_in_grad_dtype(device))
    spec_norms = [clipping.tensor_norm(g, p, num_threads=threads) for g in grads]

    # Stage 1: per-tensor norms (a one-element gradient's is |x| on both sides, rule 1).
    for i, (g, sn) in enumerate(zip(grads, spec_norms)):
        tn = to_numpy(torch.linalg.vector_norm(to_torch(g, device), p))
        assert_norm(tn, _scalar(sn), where.at(f"norm of grads[{i}] ({g.dtype}, {g.size} elements)"), device, g.size)
    if p == 2.0 and not expectations.clip_one_element_l2_norm_is_abs(device) and any(
            not square_is_normal(x) for x in [*spec_norms, *(g.reshape(-1)[0] for g in grads if g.size == 1)]):
        # The keyed difference of this device's clipping path (expectations): it squares
        # one-element tensors, so every later stage would only restate it.
        event("clipping path squares a one-element norm that under/overflows: keyed, stages 2-4 not compared")
        return

    # Stage 2: the total from the spec's per-tensor norms. torch's one-element norm is the
    # element itself, so it stacks exactly the spec's norms.
    singles = [np.asarray([sn]) for sn in spec_norms]
    total_from_spec = to_numpy(torch.nn.utils.get_total_norm([to_torch(s, device) for s in singles], p))
    assert_norm(total_from_spec, _scalar(spec.total_norm), where.at("total norm from the spec's per-tensor norms"),
                device, len(grads))

    # Stage 3: coefficient and clipped gradients from the spec's total.
    spec_total = to_torch(_scalar(spec.total_norm), device)
    assert_same(to_numpy(torch_coefficient(spec_total, max_norm)), _scalar(spec.clip_coef),
                where.at("coefficient from the spec's total"))
    params = _params(grads, device)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, spec_total)
    assert_same_list([to_numpy(q.grad) for q in params], list(spec.grads),
                     where.at("clipped grads from the spec's total"))

    # End to end, as users call it.
    if expectations.exact_kernels(device) or p == math.inf:
        params = _params(grads, device)
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, p)
        assert_same(to_numpy(total), _scalar(spec.total_norm), where.at("total norm"))
        assert_same(to_numpy(torch_coefficient(total, max_norm)), _scalar(spec.clip_coef), where.at("coefficient"))
        assert_same_list([to_numpy(q.grad) for q in params], list(spec.grads), where.at("clipped grads"))


@given(data=st.data())
def test_clip_grad_norm_matches_the_spec(device, data):
    run_clip_case(data.draw(strategies.clip_case(), label="case"), device)


@pytest.mark.parametrize("seed", range(2))
def test_clip_grad_norm_matches_the_spec_on_long_gradients(device, seed):
    """Gradients long enough for the spec's chunked, side-by-side lane sums (up to 40000 rows,
    lengths that end inside chunks, tails of 1 to 15), with values whose squares overflow,
    underflow or are subnormal planted, checked stage by stage as the drawn cases are."""
    rng = np.random.default_rng(seed)
    grads = []
    for i, n in enumerate([320_005, 131_072, 65_543, 40_000, 16_391, 2_049, 9, 1]):
        values = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3)
        values[rng.integers(0, n, 2)] = rng.choice([1e20, 1e-20, 1e-40, 0.0])
        dtype = (np.float32, ml_dtypes.bfloat16, np.float64)[i % 3] if i < 6 else np.float32
        grads.append(values.astype(np.float32).astype(dtype))
    run_clip_case(dict(grads=grads, norm_type=2.0, max_norm=1.0), device)


@given(data=st.data())
def test_clip_grads_with_norm_matches_the_spec_bit_for_bit(device, data):
    """``clip_grads_with_norm_`` from a total the caller computed: coefficient and gradients bit
    for bit on every kernel (no reduction: a reciprocal, a multiply, a clamp, one multiply per
    element, each correctly rounded)."""
    case = data.draw(strategies.given_total_clip_case(), label="case")
    grads, max_norm, total = case["grads"], case["max_norm"], case["total_norm"]
    where = Where(f"clip_grads_with_norm_[total={total!r} {total.dtype}, max_norm={max_norm!r}]", repro=REPRO)
    spec = clipping.clip_grads_with_norm(grads, max_norm, total,
                                         coef_in_grad_dtype=expectations.clip_coef_in_grad_dtype(device))
    t_total = to_torch(np.asarray(total), device)
    assert_same(to_numpy(torch_coefficient(t_total, max_norm)), _scalar(spec.clip_coef), where.at("coefficient"))
    params = _params(grads, device)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, t_total)
    assert_same_list([to_numpy(q.grad) for q in params], list(spec.grads), where.at("clipped grads"))


@given(data=st.data())
def test_clip_grad_value_matches_the_spec_bit_for_bit(device, data):
    """Clamping is exact on every kernel: NaN stays NaN, +-inf becomes +-clip_value."""
    case = data.draw(strategies.clip_value_case(), label="case")
    grads, v = case["grads"], case["clip_value"]
    where = Where(f"clip_grad_value_[{v!r}]", field="clipped grads", repro=REPRO)
    params = _params(grads, device)
    try:
        expected = clipping.clip_grad_value(grads, v)
    except ValueError as spec_error:
        # A clip value beyond a gradient dtype's range: torch refuses to convert it.
        with pytest.raises(RuntimeError, match="without overflow"):
            torch.nn.utils.clip_grad_value_(params, v)
        assert "largest finite" in str(spec_error)
        return
    torch.nn.utils.clip_grad_value_(params, v)
    assert_same_list([to_numpy(q.grad) for q in params], expected, where)


def test_clip_grad_value_without_gradients_is_the_keyed_expectation(device):
    """The spec clips an empty list to an empty list; torch's behaviour is a keyed fact."""
    assert clipping.clip_grad_value([], 1.0) == []
    raised = expectations.probe_clip_grad_value_raises_without_grads(device)
    if not expectations.keyed_device(device):
        pytest.skip(f"no {device} measurement is keyed: the other tests follow the probe ({raised})")
    expected = expectations.clip_grad_value_raises_without_grads(device)
    assert raised == expected, (f"torch {torch.__version__} on {device}: clip_grad_value_ without grads raises="
                                f"{raised}, the suite expects {expected}; update "
                                "expectations.CLIP_GRAD_VALUE_RAISES_WITHOUT_GRADS after checking the change")


# Values whose squares overflow, are subnormal or underflow in float32 or float64, and the
# non-finite ones: where a kernel that squares would part from |x|.
ONE_ELEMENT_VALUES = (1e30, -1e30, 3e38, 1e-20, 1e-30, -1e-31, 2.0**-126, 2.0**-140, 2.0**-149, 1e200, -1e-200,
                      5e-324, 65504.0, 6e-8, 1.5, 0.0, -0.0, math.inf, -math.inf, math.nan)


def _one_element(value: float, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """``value`` in ``dtype`` as torch converts it: float64 -> 16-bit goes through float32."""
    with np.errstate(over="ignore", under="ignore"):
        x = np.asarray(value, np.float64) if dtype == np.float64 else np.asarray(value, np.float64).astype(np.float32)
        return x.astype(dtype).reshape(shape)


def check_one_element(g: np.ndarray, device: str) -> None:
    """torch's norms of a one-element gradient are |x| and so are the spec's, bit for bit
    (NaN as a class); clipping it agrees end to end where this device's clipping path takes |x|."""
    where = Where("one-element norm", field=f"{g.dtype} {g.shape} {g.reshape(-1)[0]!r}", repro=REPRO)
    with np.errstate(invalid="ignore"):
        absolute = np.abs(g.astype(np.float64)).astype(g.dtype).reshape(())
    for p in (2.0, math.inf):
        spec = _scalar(clipping.tensor_norm(g, p))
        assert_same(spec, absolute, where.at(f"the spec's norm_type={p} norm is |x|"))
        assert_same(to_numpy(torch.linalg.vector_norm(to_torch(g, device), p)), spec,
                    where.at(f"torch.linalg.vector_norm, norm_type={p}"))
    params = _params([g], device)
    total = to_numpy(torch.nn.utils.clip_grad_norm_(params, 1.0, 2.0))
    spec = clipping.clip_grad_norm([g], 1.0, 2.0)
    if expectations.clip_one_element_l2_norm_is_abs(device):
        assert_same(total, _scalar(spec.total_norm), where.at("clip_grad_norm_ total"))
        assert_same_list([to_numpy(params[0].grad)], list(spec.grads), where.at("clip_grad_norm_ grads"))
    else:
        # The keyed difference: the clipping path squares, as the spec's norm of [x, 0] does.
        squared = _scalar(clipping.tensor_norm(np.append(g.reshape(-1), np.zeros(1, g.dtype)), 2.0))
        assert_norm(total, squared, where.at("clip_grad_norm_ total (keyed: squares)"), device, 2)


@pytest.mark.parametrize("shape", [(1,), (), (1, 1)])
@pytest.mark.parametrize("dtype", strategies.CLIP_DTYPES, ids=str)
def test_one_element_norm_is_abs_in_torch_and_the_spec(device, dtype, shape):
    for value in ONE_ELEMENT_VALUES:
        check_one_element(_one_element(value, dtype, shape), device)


# Each dtype with the unsigned integer type of its width: drawn bits, viewed as the dtype.
BIT_PATTERNS = [(np.dtype(np.float16), np.uint16), (np.dtype(ml_dtypes.bfloat16), np.uint16),
                (np.dtype(np.float32), np.uint32), (np.dtype(np.float64), np.uint64)]


@pytest.mark.parametrize("dtype, bits_type", BIT_PATTERNS, ids=[str(d) for d, _ in BIT_PATTERNS])
@given(data=st.data())
def test_one_element_norm_is_abs_for_any_bits(device, dtype, bits_type, data):
    bits = data.draw(st.integers(0, int(np.iinfo(bits_type).max)), label="bits")
    check_one_element(np.array([bits], bits_type).view(dtype), device)


def test_clip_coef_in_grad_dtype_is_the_keyed_expectation(device):
    """Whether torch's clip multiply rounds the coefficient to a 16-bit gradient's dtype is a keyed fact."""
    probed = expectations.probe_clip_coef_in_grad_dtype(device)
    if not expectations.keyed_device(device):
        pytest.skip(f"no {device} measurement is keyed: the other tests follow the probe ({probed})")
    expected = expectations.clip_coef_in_grad_dtype(device)
    assert probed == expected, (
        f"torch {torch.__version__} on {device}: bfloat16 255 * float32 1/255 rounds the coefficient = {probed}, "
        f"the suite expects {expected}; update conformance/expectations.py after checking the change")


def test_clip_one_element_norm_is_the_keyed_expectation(device):
    """Whether torch's clipping path takes |x| for a one-element gradient is a keyed fact."""
    probed = expectations.probe_clip_one_element_l2_norm_is_abs(device)
    if not expectations.keyed_device(device):
        pytest.skip(f"no {device} measurement is keyed: the other tests follow the probe ({probed})")
    expected = expectations.clip_one_element_l2_norm_is_abs(device)
    assert probed == expected, (
        f"torch {torch.__version__} on {device}: get_total_norm of [1e30] is |x|={probed}, the suite "
        f"expects {expected}; update conformance/expectations.py after checking the change")


@given(data=st.data())
def test_zero_d_gradients_clip_as_specified(device, data):
    """Rule 10: a 0-d gradient of any dtype beside float64 gradients (a float64 coefficient) is
    multiplied in float64 and rounded once; stage by stage as the other cases, so on every
    kernel the clipped gradients from the spec's total must match bit for bit."""
    run_clip_case(data.draw(strategies.zero_d_clip_case(), label="case"), device)


@given(data=st.data())
def test_clipping_that_triggers_matches_the_spec(device, data):
    """Thresholds below the gradients' norm, by a fraction that is not a power of two, so that
    the coefficient's rounding (a reciprocal then a multiply, rule 4) reaches every gradient."""
    run_clip_case(data.draw(strategies.clipping_clip_case(), label="case"), device)


@given(data=st.data())
def test_error_if_nonfinite_raises_as_specified(device, data):
    """Rule 6's error_if_nonfinite=True: torch raises RuntimeError with the spec's message
    exactly when the spec's total norm is NaN or inf, and then leaves every gradient alone."""
    case = data.draw(strategies.clip_case(), label="case")
    grads, p, max_norm = case["grads"], case["norm_type"], case["max_norm"]
    if p == math.inf and any(g.size == 0 for g in grads):
        return  # refused for another reason (test_clip_grad_norm_matches_the_spec)
    where = Where(f"clip_grad_norm_[error_if_nonfinite, norm_type={p}]", repro=REPRO)
    params = _params(grads, device)
    try:
        clipping.clip_grad_norm(grads, max_norm, p, error_if_nonfinite=True, num_threads=torch.get_num_threads())
        spec_error = None
    except RuntimeError as e:
        spec_error = str(e)
    try:
        torch.nn.utils.clip_grad_norm_(params, max_norm, p, error_if_nonfinite=True)
        torch_error = None
    except RuntimeError as e:
        torch_error = str(e)
    assert_equal(torch_error, spec_error, where.at("error"))
    if spec_error is not None:
        assert_same_list([to_numpy(q.grad) for q in params], grads, where.at("grads after the refusal"))
