"""Mutation check of the float8 properties: deliberate float8 bugs in a copy of reference/fp8.py,
each of which conformance/test_fp8.py must catch against torchao.

    PYTHONPATH=. python -m conformance.fp8_mutations            # every mutant (a few minutes)
    PYTHONPATH=. python -m conformance.fp8_mutations no_saturation

The float8 arithmetic that runs in production is torchao's; the spec states it. A property is
only as strong as the wrong statements it refuses, so each mutant here is a plausible misreading
of a rule, applied to the spec, and the property run against the unchanged torchao must fail.
Same machinery as ``conformance.mutations`` (an unmutated baseline first; an edit that no
longer applies stops the run).
"""

from __future__ import annotations

import sys

from conformance import mutations
from conformance.mutations import Mutant

SPEC = "reference/fp8.py"
TESTS = ("conformance/test_fp8.py",)

MUTANTS = (
    Mutant("float32_scale_division", "divide fp8_max by the float32-rounded amax (a float32 division)", SPEC,
           "        m = np.asarray(a, dtype=np.float64)\n", "        m = np.asarray(a, dtype=np.float32).astype(np.float64)\n",
           TESTS),
    Mutant("exact_power_of_2", "round scales down to the exact power of two, not by float32 log2", SPEC,
           "        return np.exp2(np.floor(_log2_f32(s)).astype(np.float64)).astype(np.float32)\n",
           "        return exact_power_of_2_floor(s)\n", TESTS),
    Mutant("no_saturation", "cast to float8 without clamping first (overflow to NaN/inf)", SPEC,
           "    return formats.cast(scaled, f, saturate=True)\n", "    return formats.cast(scaled, f, saturate=False)\n", TESTS),
    Mutant("no_epsilon", "no 1e-12 floor on amax", SPEC,
           "np.maximum(m, AMAX_EPS)", "m", TESTS),
    Mutant("nan_ignoring_amax", "amax ignores NaN (nanmax)", SPEC,
           "        m = np.max(np.abs(wide), axis=axis, keepdims=axis is not None)\n",
           "        m = np.nanmax(np.abs(wide), axis=axis, keepdims=axis is not None)\n", TESTS),
    Mutant("prescale_divides", "pre-scale by dividing by s instead of multiplying by f32(1/s)", SPEC,
           "        return np.ascontiguousarray((q.data.astype(np.float32) * inv).astype(np.float32))\n",
           "        return np.ascontiguousarray((q.data.astype(np.float32) / np.asarray(q.scale, np.float32)).astype(np.float32))\n",
           TESTS),
    Mutant("rowwise_in_float32", "rowwise matmuls straight into float32, no bfloat16 step", SPEC,
           "    mm_dtype = _BF16 if rowwise and out_dtype in (_F32, _F16) else out_dtype\n",
           "    mm_dtype = out_dtype\n", TESTS),
    Mutant("no_post_scale", "rowwise backward matmuls scaled inside the GEMM, not after it in bfloat16", SPEC,
           "    if rowwise and not fast_accum:\n", "    if False:\n", TESTS),
    Mutant("bias_before_rounding", "add the bias in float32 before rounding to the output dtype", SPEC,
           "    y = _matmul(a, b, x.dtype, r.fast_accum_output, gemm)\n    if bias is not None:\n"
           "        with np.errstate(over=\"ignore\"):\n"
           "            y = _out_cast(y.astype(np.float32) + _out_cast(bias, x.dtype).astype(np.float32), x.dtype)\n",
           "    y = _matmul(a, b, np.float32, r.fast_accum_output, gemm)\n    if bias is not None:\n"
           "        y = (y + np.asarray(bias, np.float32)).astype(np.float32)\n    y = _out_cast(y, x.dtype)\n", TESTS),
    Mutant("weight_rows_for_grad_input", "cast the weight per output feature for grad_input too", SPEC,
           "                         _operand(w.T, r.weight_for_grad_input, -1, r.power_of_2).T)\n",
           "                         _operand(w.T, r.weight_for_grad_input, 0, r.power_of_2).T)\n", TESTS),
    Mutant("mx_ceil_always", "MX ceil adds one even when the mantissa is zero", SPEC,
           "        e = e + ((u & 0x7FFFFF) > 0)\n", "        e = e + 1\n", TESTS),
    Mutant("mx_rceil_no_special_zero", "MX rceil multiplies by 2^127 at the bottom of the e8m0 range", SPEC,
           "np.where(biased == 0, np.float32(1), pow2)", "pow2", TESTS),
)


def main(argv: list[str] | None = None) -> int:
    return mutations.cli("python -m conformance.fp8_mutations", __doc__, MUTANTS, argv)


if __name__ == "__main__":
    sys.exit(main())
