"""Mutation check of the float8 properties, in two catalogues, each mutant of which
conformance/test_fp8.py must catch.

    PYTHONPATH=. python -m conformance.fp8_mutations            # every mutant (a few minutes)
    PYTHONPATH=. python -m conformance.fp8_mutations no_saturation torchao_e8m0_bias_off_by_one
    PYTHONPATH=. python -m conformance.fp8_mutations --list

``MUTANTS``: plausible misreadings of the rules, applied to a copy of reference/fp8.py; the
properties, run against the unchanged torchao, must fail. Same machinery as
``conformance.mutations`` (an unmutated baseline first; an edit that no longer applies stops the
run).

``PRODUCTION_MUTANTS``: plausible bugs in the float8 code that runs in production, torchao
0.18.0's float8 and MX training and ``torchimpl/precision/fp8.py``, installed at runtime in the pytest
process (``-p conformance.fp8_mutations`` with ``AMPSPEC_FP8_MUTANT=<name>``) by
``conformance.torch_mutations``' machinery: an exact source edit of one function, which must
match exactly once. The unmutated file runs first and must pass; a mutant is killed when pytest
fails. Each is in one of three groups the properties cover: what torchimpl's MX layers use
and compute (``mx layer``), rule 12's dequantization and emulated matmul (``rule 12``), and
the row pairing of (batch, sequence, features) inputs (``3-d``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

from conformance import mutations
from conformance.mutations import ROOT, Mutant
from conformance.torch_mutations import Edit, TorchMutant, install

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
    Mutant("mx_exponent_bias_off_by_one", "MX dequantize reads the e8m0 byte with bias 126", SPEC,
           "np.minimum(byte, 254) - 127", "np.minimum(byte, 254) - 126", TESTS),
    Mutant("mx_recipe_floor", "the mxfp8 recipe stated with floor scales", SPEC,
           'MXRecipe("mxfp8", "float8_e4m3fn", 32, "rceil")', 'MXRecipe("mxfp8", "float8_e4m3fn", 32, "floor")', TESTS),
    Mutant("rows_flattened_sequence_major", "grad_weight flattens a 3-d input sequence-major (rows paired wrongly)", SPEC,
           "_operand(x2, r.input_for_grad_weight, 0, r.power_of_2)",
           "_operand(np.swapaxes(x, 0, -2).reshape(-1, x.shape[-1]), r.input_for_grad_weight, 0, r.power_of_2)", TESTS),
    Mutant("mx_rows_flattened_sequence_major", "MX grad_weight flattens a 3-d input sequence-major", SPEC,
           "    x2, go2 = x.reshape(-1, x.shape[-1]), go.reshape(-1, go.shape[-1])\n",
           "    x2, go2 = np.swapaxes(x, 0, -2).reshape(-1, x.shape[-1]), go.reshape(-1, go.shape[-1])\n", TESTS),
)

# ----------------------------------------------------------------------------- production mutants

ENV = "AMPSPEC_FP8_MUTANT"
PLUGIN = "conformance.fp8_mutations"
_MX_LINEAR = "torchao.prototype.moe_training.mxfp8_linear"
# In a 2-d tensor transpose(0, -2) is the identity; in a (batch, sequence, features) one it
# swaps batch and sequence, so the flattened rows come in another order.
_SEQUENCE_MAJOR = "transpose(0, -2).reshape(-1, input_hp_orig_shape[-1])"

PRODUCTION_MUTANTS = (
    TorchMutant("torchimpl_mx_floor", "mx layer: torchimpl builds its MX layers with floor scales, not rceil", TESTS,
                edits=(Edit("torchimpl.precision.fp8", "_convert_mx", "scale_calculation_mode=ScaleCalculationMode.RCEIL",
                            "scale_calculation_mode=ScaleCalculationMode.FLOOR"),)),
    TorchMutant("torchao_mx_grad_weight_floor", "mx layer: the grad_weight casts (dim1) use floor, whatever the layer's mode",
                TESTS, edits=(Edit("torchao.prototype.mx_formats.utils", "_to_mxfp8_dim1_kernel_wrapper",
                                   "            scale_calculation_mode,\n        )\n        a_data = a_data.t()",
                                   "            ScaleCalculationMode.FLOOR,\n        )\n        a_data = a_data.t()"),)),
    TorchMutant("torchao_mx_blocks_of_16", "mx layer: MXFP8Linear casts in blocks of 16", TESTS,
                edits=(Edit(_MX_LINEAR, "_to_mxfp8_then_scaled_mm", "    block_size = 32\n", "    block_size = 16\n"),)),
    TorchMutant("torchao_mx_grad_e5m2", "mx layer: MXFP8Linear casts grad_output to e5m2", TESTS,
                edits=(Edit(_MX_LINEAR, "_to_mxfp8_then_scaled_mm", "    grad_elem_dtype = torch.float8_e4m3fn\n",
                            "    grad_elem_dtype = torch.float8_e5m2\n"),)),
    TorchMutant("torchao_e8m0_bias_off_by_one", "rule 12: dequantize reads the e8m0 byte with bias 126 (matmuls 4x)", TESTS,
                edits=(Edit("torchao.prototype.mx_formats.mx_tensor", "get_fp_scale",
                            "s_offset = scale_e8m0.to(torch.int16) - E8M0_EXPONENT_BIAS",
                            "s_offset = scale_e8m0.to(torch.int16) - (E8M0_EXPONENT_BIAS - 1)"),)),
    TorchMutant("torchao_mx_nan_byte_ignored", "rule 12: dequantize treats the scale byte 0xff as 2^128, not NaN", TESTS,
                edits=(Edit("torchao.prototype.mx_formats.mx_tensor", "get_fp_scale",
                            'torch.where(scale_e8m0 != E8M0_EXPONENT_NAN_VAL, s_fp, float("nan"))', "s_fp"),)),
    TorchMutant("torchao_float8_rows_misaligned", "3-d: Float8Linear's grad_weight flattens the input sequence-major",
                TESTS, edits=(Edit("torchao.float8.float8_linear.matmul_with_hp_or_float8_args", "backward",
                                   "input_hp_reshaped = input_hp.reshape(-1, input_hp_orig_shape[-1])",
                                   f"input_hp_reshaped = input_hp.{_SEQUENCE_MAJOR}"),)),
    TorchMutant("torchao_mx_rows_misaligned", "3-d: MXFP8Linear's grad_weight flattens the input sequence-major", TESTS,
                edits=(Edit(f"{_MX_LINEAR}.mx_mm", "backward", "input_hp_r = input_hp.reshape(-1, input_hp_orig_shape[-1])",
                            f"input_hp_r = input_hp.{_SEQUENCE_MAJOR}"),)),
)


def production_mutant(name: str) -> TorchMutant:
    for m in PRODUCTION_MUTANTS:
        if m.name == name:
            return m
    raise KeyError(f"unknown float8 production mutant {name!r}; known: {[m.name for m in PRODUCTION_MUTANTS]}")


def pytest_configure(config: Any) -> None:
    """As a pytest plugin: install the production mutant named by ``AMPSPEC_FP8_MUTANT``."""
    name = os.environ.get(ENV)
    if name:
        os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
        config._ampspec_fp8_mutant_remove = install(production_mutant(name))


def _run_pytest(name: str | None, tests: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", AMPSPEC_HYPOTHESIS_PROFILE="ci", PYTHONDONTWRITEBYTECODE="1",
               TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop(ENV, None)
    plugin = []
    if name:
        env[ENV] = name
        plugin = ["-p", PLUGIN]
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *plugin, *tests],
                          cwd=ROOT, env=env, capture_output=True, text=True)


def run_production(chosen: list[TorchMutant]) -> int:
    """Run the production mutants ``chosen``; 0 when every one is killed."""
    for m in chosen:  # every edit must still apply before minutes are spent
        install(m)()
    t0 = time.perf_counter()
    tests = tuple(sorted({t for m in chosen for t in m.first}))
    proc = _run_pytest(None, tests)
    if proc.returncode != 0:
        print(f"baseline (no mutant) FAILS, so kills would mean nothing:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")
        return 1
    print(f"baseline passes: {mutations._last_line(proc.stdout)}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    killed = 0
    for m in chosen:
        t1 = time.perf_counter()
        proc = _run_pytest(m.name, m.first)
        dead = proc.returncode != 0
        killed += dead
        first = next((ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))), "")
        print(f"{m.name:32s} {'killed' if dead else 'SURVIVED'}  ({time.perf_counter() - t1:.0f} s)  {m.bug}\n"
              f"    {first or mutations._last_line(proc.stdout)}", flush=True)
    print(f"{killed} of {len(chosen)} production mutants killed in {time.perf_counter() - t0:.0f} s")
    return 0 if killed == len(chosen) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.fp8_mutations", description=__doc__.split("\n\n")[0])
    parser.add_argument("mutants", nargs="*", help="names of the mutants to run, of either catalogue (default: all)")
    parser.add_argument("--list", action="store_true", help="print both catalogues and exit")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:36s} [spec] {m.bug}")
        for m in PRODUCTION_MUTANTS:
            print(f"{m.name:36s} [production] {m.bug}")
        return 0
    spec_names = {m.name for m in MUTANTS}
    prod_names = {m.name for m in PRODUCTION_MUTANTS}
    unknown = sorted(set(args.mutants) - spec_names - prod_names)
    if unknown:
        print(f"unknown mutants {unknown}; see --list", file=sys.stderr)
        return 2
    spec = [n for n in args.mutants if n in spec_names]
    prod = [m for m in PRODUCTION_MUTANTS if not args.mutants or m.name in args.mutants]
    status = 0
    if spec or not args.mutants:
        status |= mutations.run(spec, MUTANTS)
    if prod:
        status |= run_production(prod)
    return status


if __name__ == "__main__":
    sys.exit(main())
