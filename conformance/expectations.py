"""Known, explained differences between torch and the specification, keyed by torch version.

A difference listed here is expected and tested as such; anything else is a failure. When torch
changes behaviour the keyed expectation fails loudly with the version, so the change is noticed
rather than absorbed.

Every version-keyed fact is measured, never assumed: ``bench/torch_matrix.py`` installs each torch
release, probes every fact (``python -m conformance.expectations``) and runs both suites; the
versions it measured are the keys of ``MEASURED``, and every table below has exactly those keys
(a unit test checks it). On a torch version that is not measured the suite does not skip: it
expects the newest measured version's facts and says so (an ``UnmeasuredTorchVersion`` warning
and a line in the report header), so a new release shows its differences on the first run.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

TORCH_VERSION = ".".join(torch.__version__.split("+")[0].split(".")[:2])

# Where each version's facts were measured: bench/torch_matrix.py on this project's CPU machine
# (PyPI's Linux wheels, which carry CUDA, run on the CPU; 2.13.0 is the CPU-only build). The table
# with every fact per version is bench/results/torch_matrix.md.
MEASURED: dict[str, str] = {
    "2.11": "torch 2.11.0+cu130, PyPI's Linux wheel, on the CPU, 2026-12-03",
    "2.12": "torch 2.12.1+cu130, PyPI's Linux wheel, on the CPU, 2026-12-03",
    "2.13": "torch 2.13.0+cpu, the CPU build, 2026-12-03",
    "2.14": "torch 2.14.1+cu130, PyPI's Linux wheel, on the CPU, 2026-12-03",
}

_T = TypeVar("_T")


class UnmeasuredTorchVersion(UserWarning):
    """The installed torch is not a measured version: the newest measured version's facts are expected."""


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


NEWEST_MEASURED = max(MEASURED, key=_version_key)


def version_status(version: str | None = None) -> str:
    """One line for the report header: is ``version`` (the installed torch's by default) measured,
    and what the suite expects if not."""
    version = version or TORCH_VERSION
    measured = ", ".join(sorted(MEASURED, key=_version_key))
    if version in MEASURED:
        return f"torch {version}: keyed facts measured ({MEASURED[version]}; measured versions {measured})"
    return (f"torch {version} is NOT measured (measured: {measured}): the suite expects torch "
            f"{NEWEST_MEASURED}'s keyed facts; a failure may be a change in torch, see bench/torch_matrix.py")


def keyed(table: Mapping[str, _T], fact: str, version: str | None = None) -> _T:
    """``table``'s value for torch ``version`` (the installed one by default); for a version not
    measured, the newest measured version's value, with an ``UnmeasuredTorchVersion`` warning
    that says so (never a skip)."""
    version = version or TORCH_VERSION
    if version in table:
        return table[version]
    newest = max(table, key=_version_key)
    warnings.warn(UnmeasuredTorchVersion(
        f"torch {version} is not measured for '{fact}': expecting torch {newest}'s {table[newest]!r} "
        "(conformance/expectations.py; measure it with bench/torch_matrix.py)"), stacklevel=2)
    return table[newest]


def keyed_device(device: str) -> bool:
    """Are the version-keyed tables measurements of ``device``? Only the CPU's are; on another
    device each fact is probed and the suite follows the probe (the keyed-fact tests skip there)."""
    return device == "cpu"


# float32/float16/bfloat16 -> float8_e4m3fn on overflow and ±inf, on the CPU. The rule is the
# spec's (reference.formats.torch_cpu_e4m3fn_saturates, rule 9): NaN up to 2.12, ±448 from 2.13,
# when torch's CPU conversion started to saturate (pytorch/pytorch#178817, April 2026). This
# table is what was measured; the test checks the probe, this table and the spec's rule agree.
# Measured beyond the probe on 2.11, 2.12 and 2.14 (float32 within 70,000 ULPs of ±464 as long and
# one-element tensors, every float16 and bfloat16 pattern; 2.11 with the AVX512 and default
# kernels, 2.12 with AVX512, AVX2 and default, 2.14 with AVX512): up to 2.12 exactly rule 4, i.e.
# ml_dtypes' bits (464, the tie, goes to even 448; anything above it, 480 included, and ±inf to
# NaN 0x7f/0xff); from 2.13 exactly rule 5 (±448).
E4M3FN_SATURATES_ON_CPU: dict[str, bool] = {"2.11": False, "2.12": False, "2.13": True, "2.14": True}


def probe_e4m3fn_saturates(device: str) -> bool:
    """What the installed torch does on ``device``: does 1e6 -> float8_e4m3fn give 448?"""
    x = torch.tensor([1e6, float("inf")], device=device).to(torch.float8_e4m3fn).float().cpu()
    return bool(torch.equal(x, torch.tensor([448.0, 448.0])))


def e4m3fn_saturates(device: str) -> bool:
    """The saturation behaviour the suite expects on ``device`` with the installed torch."""
    if device == "cpu":
        return keyed(E4M3FN_SATURATES_ON_CPU, "float32 -> float8_e4m3fn saturates on the CPU")
    # CUDA picks an intrinsic or the C++ path by toolkit and architecture: probed, not assumed.
    return probe_e4m3fn_saturates(device)


# Autocast op policy (reference.autocast.POLICY): the torch versions, per device type, whose output
# dtypes were compared op by op against the table and matched (conformance/test_autocast.py in
# bench/torch_matrix.py's run of each version, bench/results/torch_matrix.md); the CUDA table
# follows PyTorch's documented lists and has not yet been run on a GPU. No version-dependent
# difference is known; one found later is keyed here by version, not absorbed.
AUTOCAST_POLICY_CONFIRMED: dict[str, tuple[str, ...]] = {"cpu": ("2.11", "2.12", "2.13", "2.14"), "cuda": ()}


def autocast_policy_provenance(device: str) -> str:
    """One line for failure messages: which torch versions confirmed the table on ``device``."""
    confirmed = AUTOCAST_POLICY_CONFIRMED.get(device, ())
    if not confirmed:
        return f"the {device} table has not been confirmed on any torch version yet"
    return f"the {device} table was confirmed on torch {', '.join(confirmed)}"


# --- Exactness of norms and optimizer steps ------------------------------------------------------

EXACT_MODE_ENV = "AMPSPEC_EXACT_MODE"
"""Set (to "1") in the environment of the exact-mode rerun, so that it does not start another."""


def exact_kernels(device: str) -> bool:
    """Does torch round every operation separately on ``device`` (no fused multiply-add)?

    True only on CPU with the scalar ATen kernels (``ATEN_CPU_CAPABILITY=default``, reported as
    ``DEFAULT``): there the spec's ``torch_cpu`` norms, its optimizer steps and the fused Adam
    kernel are expected to match bit for bit. The AVX2/AVX512 kernels contract some
    multiply-adds and CUDA's compiler contracts them by default, so elsewhere the ULP bounds
    below apply.
    """
    import torch as _torch

    return device == "cpu" and _torch.backends.cpu.get_cpu_capability() == "DEFAULT"


# Norms on native CPU kernels, in ULPs of the norm's own dtype, for one stage fed the spec's
# inputs (a per-tensor norm from the gradient; a total from the spec's per-tensor norms). Only
# the scalar tail (< 8 elements per tensor; the whole total stage for < 8 tensors) differs: it
# is compiled with some fused multiply-adds, each dropping one rounding of a square (at most
# 1/2 ULP of that square, hence <= 2^-24 relative of the sum of squares) and the square root
# halves the relative error of the sum, so the norm moves by about 1 ULP at most before its own
# rounding, which can add 1. Measured: <= 1 ULP (per-tensor and total, 1,000 random pipelines
# when the bound was set, 12,000 here). A 2-ULP difference in float32 becomes at most 1 ULP after
# the final rounding to float16/bfloat16. Not valid where float32 squares are subnormal: there
# one dropped rounding is a sizeable part of the sum (strategies.CLIP_MAGNITUDES avoids it).
NORM_ULP = 2

# Optimizer steps on native kernels (CPU AVX2/AVX512, CUDA), one step from the same state,
# measured in ULPs of the absolute-value evaluation x_abs of each field: the same formula with
# every operand replaced by its magnitude and every subtraction by an addition (see
# conformance/test_optimizers.py). Running error analysis bounds each implementation's error by
# k * u * x_abs, k = roundings on the longest path from an input to the field, u = 2^-24, and
# u * x_abs < ulp(x_abs); two implementations that only differ in which multiply-adds are fused
# differ by at most 2 * k ULP of x_abs (a faithful, not correctly rounded, square root counts
# as 2 roundings: its error is < 1 ULP).
# Each optimizer's bounds, with the derivation of each, are its spec row's ``native_ulp``
# (reference/optim/<name>.py, at the row): this suite keeps no table of its own.


def cuda_norm_rtol(n: int) -> float:
    """Relative tolerance for an L2 norm of ``n`` elements computed on CUDA against the spec.

    CUDA reduces in a tree (per-thread serial runs, then warp and block folds); the spec sums
    each of 8 lanes serially over n/8 terms. Recursive summation of nonnegative terms has a
    relative error of at most (terms - 1) * u, u = 2^-24: the spec's at most n/8 + 8, CUDA's at
    most about log2(n) + its serial run (bounded by the same n/8 for the sizes here); the
    square root halves the relative difference of the sums, and each side's final rounding adds
    u. Hence (n/8 + 8 + log2(n + 1)) * u / 2 + 2u per side, doubled for the difference of two
    such results.
    """
    import math as _math

    return 2.0 * ((n / 8 + 8 + _math.log2(n + 1)) / 2 + 2) * 2.0**-24


# clip_grad_value_ with no gradient at all raises in torch (its foreach grouping refuses an
# empty list: "Expected !nested_tensorlist[0].empty() to be true"); the spec returns an empty
# list. Measured on CPU for the versions keyed; other devices are probed.
CLIP_GRAD_VALUE_RAISES_WITHOUT_GRADS: dict[str, bool] = {"2.11": True, "2.12": True, "2.13": True, "2.14": True}


def clip_grad_value_raises_without_grads(device: str) -> bool:
    """Does torch's clip_grad_value_ raise for parameters without gradients on ``device``?"""
    if device == "cpu":
        return keyed(CLIP_GRAD_VALUE_RAISES_WITHOUT_GRADS, "clip_grad_value_ without gradients raises")
    return probe_clip_grad_value_raises_without_grads(device)


# torch's L2 norm of a ONE-element tensor is |x|, never squared: linalg_vector_norm_out (ATen's
# LinearAlgebra.cpp, code shared by all devices) returns abs() when every reduced dimension has
# size 1. The spec models it (reference.clipping rule 1) and test_clipping compares it exactly.
# clip_grad_norm_ / get_total_norm take their per-tensor norms from torch._foreach_norm instead.
# On CPU that loops over linalg.vector_norm: the same |x| [measured, both kernel modes, float16,
# bfloat16, float32, float64]. CUDA's fused multi-tensor norm kernel (ForeachReduceOp.cu) sums
# squares with no one-element case [read in the source, not measured]: there a one-element
# gradient whose square under- or overflows (float32 [1e30]) gets a different per-tensor norm
# inside clipping than linalg.vector_norm gives. Measured on CPU for the versions keyed; other
# devices are probed.
CLIP_ONE_ELEMENT_L2_NORM_IS_ABS: dict[str, bool] = {"2.11": True, "2.12": True, "2.13": True, "2.14": True}


def clip_one_element_l2_norm_is_abs(device: str) -> bool:
    """Does torch's clipping path (get_total_norm) give |x| for a one-element gradient on ``device``?"""
    if device == "cpu":
        return keyed(CLIP_ONE_ELEMENT_L2_NORM_IS_ABS, "the clipping path's one-element L2 norm is |x|")
    return probe_clip_one_element_l2_norm_is_abs(device)


def probe_clip_one_element_l2_norm_is_abs(device: str) -> bool:
    """What the installed torch does: is get_total_norm of float32 [1e30] 1e30 (not inf)?"""
    x = torch.tensor([1e30], device=device)
    return bool(torch.equal(torch.nn.utils.get_total_norm([x], 2.0).cpu(), x.abs()[0].cpu()))


# The clip multiply of a 16-bit gradient by a wider coefficient (a float32 total norm: the
# model mixes bfloat16/float16 gradients with float32 ones). On CPU, mul_ takes the 0-d float32
# coefficient as a CPU scalar in float32 op math [measured, both kernel modes]. On CUDA,
# _foreach_mul_ falls back to mul_ per tensor on a dtype mismatch (ForeachBinaryOpScalarTensor.cu),
# and mul_ casts a 0-d device tensor to the gradient's dtype before multiplying (Loops.cuh,
# opmath_symmetric_gpu_kernel_with_scalars) [read in the source, not measured]: the spec's
# coef_in_grad_dtype rule. Measured on CPU for the versions keyed; a device without keys is probed.
CLIP_COEF_IN_GRAD_DTYPE: dict[str, dict[str, bool]] = {
    "cpu": {"2.11": False, "2.12": False, "2.13": False, "2.14": False},
}


def clip_coef_in_grad_dtype(device: str) -> bool:
    """Does torch's clip multiply round the coefficient to a 16-bit gradient's dtype on ``device``?"""
    known = CLIP_COEF_IN_GRAD_DTYPE.get(device)
    if known:
        return keyed(known, f"the clip multiply rounds the coefficient to the gradient's dtype on {device}")
    return probe_clip_coef_in_grad_dtype(device)


def probe_clip_coef_in_grad_dtype(device: str) -> bool:
    """What the installed torch does: bfloat16 255 times float32 1/255 is 1.0 in float32 op math,
    255/256 when 1/255 is first rounded to bfloat16 (2**-8)."""
    g = torch.tensor([255.0], dtype=torch.bfloat16, device=device)
    torch._foreach_mul_([g], torch.tensor(1 / 255, dtype=torch.float32, device=device))
    return float(g.item()) != 1.0


# Fused SGD with momentum fails when, in one step, a parameter gets its FIRST gradient while
# another one already has a momentum buffer (a parameter whose gradient was None earlier):
# _fused_sgd passes the None buffer on ("TypeError: expected Tensor as element 1 in argument 2,
# but got NoneType"). The for-loop and foreach paths, and the spec, start that buffer as a copy
# of the gradient. Measured on CPU for the versions keyed; other devices are probed.
FUSED_SGD_FAILS_ON_LATE_FIRST_GRADIENT: dict[str, bool] = {"2.11": True, "2.12": True, "2.13": True, "2.14": True}


def fused_sgd_fails_on_late_first_gradient(device: str) -> bool:
    """Does fused SGD with momentum raise TypeError when a parameter's first gradient comes late?"""
    if device == "cpu":
        return keyed(FUSED_SGD_FAILS_ON_LATE_FIRST_GRADIENT, "fused SGD fails on a late first gradient")
    return probe_fused_sgd_fails_on_late_first_gradient(device)


def known_optimizer_failure(name: str, impl: str, config: Any, grads: list, state: tuple,
                            device: str) -> tuple[type, str] | None:
    """The exception torch raises for this step, where a keyed fact says it does (and the spec,
    which computes it, differs): ``(type, message pattern)``, else None."""
    if name == "SGD" and impl == "fused" and config.momentum != 0 and fused_sgd_fails_on_late_first_gradient(device):
        with_grad = [s for g, s in zip(grads, state) if g is not None]
        if any(s.momentum_buffer is None for s in with_grad) and any(s.momentum_buffer is not None for s in with_grad):
            return TypeError, "got NoneType"
    if name == "Adafactor" and any(g is not None and g.size == 0 for g in grads):
        # reference.optim.adafactor rule 10: the RMS of an empty parameter is 0.0 / 0.0 in Python.
        return ZeroDivisionError, "division by zero"
    return None


def probe_fused_sgd_fails_on_late_first_gradient(device: str) -> bool:
    """What the installed torch does, on two parameters whose gradients start one step apart."""
    a, b = (torch.nn.Parameter(torch.ones(2, device=device)) for _ in range(2))
    opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9, fused=True)
    a.grad = torch.ones(2, device=device)
    opt.step()
    b.grad = torch.ones(2, device=device)
    try:
        opt.step()
    except TypeError:
        return True
    return False


# Fused SGD with momentum whose kernel skips a FIRST step (found_inf == 1.0, as in the trainer's
# sync-free mode): _fused_sgd creates the momentum buffers with empty_like before the kernel reads
# the flag, and SGD.step stores them, so the next applied step treats uninitialised memory as
# the buffer instead of starting it as a copy of the gradient (the spec, and the for-loop path
# that a host skip never calls, have no buffer until a step applies). reference.step refuses
# sync_free for SGD with momentum and the trainer keeps the host skip there. Measured on CPU for
# the versions keyed; other devices are probed.
FUSED_SGD_SKIPPED_FIRST_STEP_STORES_A_BUFFER: dict[str, bool] = {
    "2.11": True, "2.12": True, "2.13": True, "2.14": True,
}


def fused_sgd_skipped_first_step_stores_a_buffer(device: str) -> bool:
    """Does fused SGD with momentum store a momentum buffer on a first step its kernel skips?"""
    if device == "cpu":
        return keyed(FUSED_SGD_SKIPPED_FIRST_STEP_STORES_A_BUFFER, "fused SGD stores a buffer on a skipped first step")
    return probe_fused_sgd_skipped_first_step_stores_a_buffer(device)


def probe_fused_sgd_skipped_first_step_stores_a_buffer(device: str) -> bool:
    """What the installed torch does: one skipped first step, then is there a momentum buffer?"""
    p = torch.nn.Parameter(torch.ones(4, device=device))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
    p.grad = torch.full((4,), float("inf"), device=device)
    opt.grad_scale, opt.found_inf = None, torch.ones((), device=device)
    opt.step()
    return opt.state.get(p, {}).get("momentum_buffer") is not None


# torch._scaled_mm on the CPU with rowwise scales (an (M, 1) and a (1, N) scale), which torchao's
# rowwise recipes call. torch 2.11 refuses it: "(scale_a.numel() == 1 && scale_b.numel() == 1)
# INTERNAL ASSERT FAILED at aten/src/ATen/native/Blas.cpp:249 ... Now _scaled_mm only supports
# per-tensor scaling for CPU backend"; from 2.12 it computes them, and the rowwise conformance
# properties pass [measured: bench/torch_matrix.py, 2026-12-03]. Where it is keyed False the
# rowwise properties check for that refusal instead of comparing results.
ROWWISE_SCALED_MM_ON_CPU: dict[str, bool] = {"2.11": False, "2.12": True, "2.13": True, "2.14": True}
ROWWISE_REFUSAL = "only supports per-tensor scaling for CPU backend"


def rowwise_scaled_mm_on_cpu() -> bool:
    """Does the installed torch's CPU _scaled_mm take rowwise scales (torchao's rowwise recipes)?"""
    return keyed(ROWWISE_SCALED_MM_ON_CPU, "torch._scaled_mm takes rowwise scales on the CPU")


def probe_rowwise_scaled_mm_on_cpu() -> bool:
    """What the installed torch does: a 2x16 by 16x2 float8 matmul with rowwise scales on the CPU."""
    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    b = torch.ones(2, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        if ROWWISE_REFUSAL in str(e):
            return False
        raise
    return True


# --- Scaled float8 training through torchao --------------------------------------------------
# reference.fp8 states torchao's float8 recipes rule by rule. Some of what it states are torchao
# internals that change between releases (the amax epsilon, the float64 scale division, the
# float32-log2 power of two, the bfloat16 output of rowwise matmuls, which autocast its
# Float8Linear follows). They were measured on the versions keyed here; test_fp8 probes them
# on the installed torchao and reports any other version or any difference, never trusting it.
TORCHAO_KEYED: dict[str, dict[str, object]] = {
    "0.18.0": {
        "amax_eps": 1e-12,
        "scale_division": "float64",
        "power_of_2": "float32 log2",
        "rowwise_float32_output": "via bfloat16",
        # Float8Linear.forward casts its input only under CUDA autocast (torch.is_autocast_enabled()
        # with no device type): under CPU autocast rowwise_with_gw_hp's high-precision grad_weight
        # multiplies a bfloat16 grad_output by the float32 saved input and raises.
        "casts_input_under_cpu_autocast": False,
    },
}


def torchao_version() -> str | None:
    """The installed torchao's version, or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return None


def torchao_provenance() -> str:
    """One line for failure messages and the report header: which torchao, and is it keyed."""
    version = torchao_version()
    if version is None:
        return "torchao not installed"
    keyed = "keyed" if version in TORCHAO_KEYED else f"NOT keyed (keyed: {', '.join(TORCHAO_KEYED)})"
    return f"torchao {version}, {keyed} in conformance/expectations.py"


# amax just above 448 / 2^8 (float32 0x3fe00001): its scale is 2 ULPs below 2^8, where float32
# log2 rounds to 8; and a float64 amax whose float32 rounding changes the float32 quotient.
_POW2_AMAX = float.fromhex("0x1.c00002p+0")
_F64_AMAX = float.fromhex("0x1.d0327a782cde5p+0")


def probe_torchao_internals() -> dict[str, object]:
    """What the installed torchao does, for each keyed internal (CPU, float32 unless noted)."""
    import torchao.float8.float8_ops as ops
    import torchao.float8.float8_utils as utils
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    e4 = torch.float8_e4m3fn
    f64_scale = utils.tensor_to_scale(torch.tensor([_F64_AMAX], dtype=torch.float64), e4).item()
    pow2 = utils.amax_to_scale(torch.tensor(_POW2_AMAX), e4, round_scales_to_power_of_2=True).item()
    # 1 + 2^-9 survives float32 and rounds to 1 in bfloat16.
    a = torch.tensor([[1.0, 0.125]]).to(e4)
    b = torch.tensor([[1.0], [2.0**-6]]).to(e4).t().contiguous().t()
    one = torch.ones(1, 1)
    rowwise = ops.addmm_float8_unwrapped(a, one, b, one, torch.float32, use_fast_accum=True).item()
    layer = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(16, 16)),
                                       config=Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"))
    x = torch.randn(16, 16, requires_grad=True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()
        casts = True
    except RuntimeError:
        casts = False
    return {
        "amax_eps": utils.EPS,
        "scale_division": "float64" if f64_scale == float(torch.tensor(448 / _F64_AMAX, dtype=torch.float32)) else "float32",
        "power_of_2": {256.0: "float32 log2", 128.0: "exact floor"}.get(pow2, f"other ({pow2})"),
        "rowwise_float32_output": "via bfloat16" if rowwise == 1.0 else "float32",
        "casts_input_under_cpu_autocast": casts,
    }


# --- Every keyed fact, measured on the installed torch (bench/torch_matrix.py records these) ----

# float32 values at and beyond e4m3fn's largest finite 448: 464 is the tie between 448 and the
# first pattern past it (0x7f, NaN), 480 that pattern's own value.
E4M3FN_OVERFLOW_PROBES = (464.0, 465.0, 480.0, 1e6, float("inf"), float("-inf"), -464.0)


def probe_e4m3fn_cpu_bits() -> dict[str, str]:
    """The float8_e4m3fn bits torch's CPU cast gives for each of E4M3FN_OVERFLOW_PROBES."""
    bits = torch.tensor(E4M3FN_OVERFLOW_PROBES).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    return {repr(v): f"0x{b:02x}" for v, b in zip(E4M3FN_OVERFLOW_PROBES, bits)}


def probe_clip_grad_value_raises_without_grads(device: str) -> bool:
    """What the installed torch does: does clip_grad_value_ raise for a parameter list with no gradient?"""
    param = torch.nn.Parameter(torch.zeros(3, device=device))
    try:
        torch.nn.utils.clip_grad_value_([param], 1.0)
    except RuntimeError:
        return True
    return False


def measure_facts(device: str = "cpu") -> dict[str, object]:
    """Every version-keyed fact as the installed torch (and torchao, if any) shows it on ``device``."""
    facts: dict[str, object] = {
        "e4m3fn_saturates": probe_e4m3fn_saturates(device),
        "clip_grad_value_raises_without_grads": probe_clip_grad_value_raises_without_grads(device),
        "clip_coef_in_grad_dtype": probe_clip_coef_in_grad_dtype(device),
        "clip_one_element_l2_norm_is_abs": probe_clip_one_element_l2_norm_is_abs(device),
        "fused_sgd_fails_on_late_first_gradient": probe_fused_sgd_fails_on_late_first_gradient(device),
        "fused_sgd_skipped_first_step_stores_a_buffer": probe_fused_sgd_skipped_first_step_stores_a_buffer(device),
    }
    if device == "cpu":
        facts["rowwise_scaled_mm"] = probe_rowwise_scaled_mm_on_cpu()
    if device == "cpu":
        facts["e4m3fn_cpu_bits"] = probe_e4m3fn_cpu_bits()
    if torchao_version() is not None:
        facts["torchao"] = {"version": torchao_version(), **probe_torchao_internals()}
    return facts


if __name__ == "__main__":
    import json
    import sys

    json.dump({"torch": torch.__version__, "facts": measure_facts(sys.argv[1] if len(sys.argv) > 1 else "cpu")},
              sys.stdout, indent=1)
    print()
