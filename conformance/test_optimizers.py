"""Property 4: every registered optimizer, step by step, against `reference.optim`.

One property per optimizer and implementation (``reference.optim.SPECS``: each row's for-loop,
foreach and fused paths), each drawing float32 or float64 parameters (0-d among them), gradients
that are sometimes None, and the optimizer's options (``strategies.OPTIMIZER_CASES``). Every step
runs under a real ``torch.amp.GradScaler`` or without one: a fused kernel that unscales and
skips by itself (``kernel_scaled``) gets the scaler's scale and found_inf, any other path is
skipped by ``scaler.step`` when a gradient is not finite. Before every step the spec is given
torch's parameters and state, and after it every field must agree: the parameter, every state
field torch keeps (by name), and, under a scaler, the gradients left behind.

A tensor lr (reference.optim rule 11, reference.optim._lr) has its own property per path where
torch takes one (``strategies.OPTIMIZER_CASES[...].tensor_lr``), drawn the same way with float32
and float64 rates; where torch refuses one (foreach Adam(W)) the spec refuses it with torch's
message, and float32 0-d parameters meeting a float64 rate are checked on the paths that promote.

Why from torch's state each step: with exact kernels the two trajectories are then equal by
induction, so nothing is lost; with native kernels the per-step difference stays what one step
makes, which is what the bounds derive, instead of compounding (a chaotic trajectory would make
any fixed bound either wrong or toothless).

The for-loop and foreach paths take torch's own square root for that path (``Tensor.sqrt``,
``torch._foreach_sqrt``): on x86 builds torch hands it to MKL's vector math, which is faithful but
not correctly rounded (reference.optim rule 9). The fused kernels' roots are correctly rounded.

Exactness (``expectations.exact_kernels``): bit for bit with exact kernels, every field. On
native kernels the step counters, the skip and the unscaled gradients are still bit for bit
(counting and one correctly rounded operation); parameters and state are within the bounds of
the spec row's ``native_ulp``, measured in ULPs of ``x_abs``, the field's formula evaluated on
magnitudes (each spec row's ``magnitudes``): a plain ULP distance explodes where a result
cancels to near zero although the operands were large. Where the spec models the native kernels
(a row's ``native_exact``: Adam and AdamW, for-loop and foreach, float32), a property of its own
holds ``row.step(..., native=True)`` to torch bit for bit, every field, on this machine's
AVX2/AVX512 kernels and again in a subprocess under ``ATEN_CPU_CAPABILITY=avx2``; on the scalar
kernels it is skipped with the capability named (the exact properties cover those).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from conformance import expectations, strategies
from conformance.assertions import Where, assert_equal, assert_same
from conformance.bridge import to_numpy, to_torch
from reference import optim, scaling
from reference import step as ref_step
from reference.optim._common import NATIVE_KERNELS

ROOT = Path(__file__).resolve().parent.parent

CASES = [(name, impl) for name, row in optim.SPECS.items() for impl in row.steps]
REPRO = "rerun this test with the @reproduce_failure blob printed above"
# Loss scales: powers of two, and others where a true division differs from a multiplication by
# the reciprocal.
SCALES = [1.0, 1024.0, 65536.0, 1000.0, 3.0, 12345.678]
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def assert_within(actual: np.ndarray, expected: np.ndarray, x_abs: np.ndarray, max_ulp: int, where: Where,
                  undetermined: np.ndarray | None = None) -> None:
    """|torch - spec| <= max_ulp ULPs of x_abs, elementwise; NaN as a class, infinities exact;
    elements the spec row marks ``undetermined`` on native kernels are not compared."""
    unit_dtype = np.float64 if np.asarray(actual).dtype == np.float64 else np.float32  # ULPs of the field's dtype
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    a_nan, e_nan = np.isnan(a), np.isnan(e)
    finite = np.isfinite(a) & np.isfinite(e)
    with np.errstate(invalid="ignore", over="ignore"):
        unit = np.maximum(np.spacing(np.abs(np.asarray(x_abs, np.float64)).astype(unit_dtype)).astype(np.float64),
                          float(np.finfo(unit_dtype).smallest_subnormal))
        dist = np.where(finite, np.abs(a - e) / unit, 0.0)
    bad = np.where(a_nan | e_nan, a_nan != e_nan, np.where(finite, dist > max_ulp, a != e))
    if undetermined is not None and np.any(undetermined):
        event("native kernels: a centered difference within its rounding error of 0 (not compared)")
        bad = bad & ~np.broadcast_to(undetermined, bad.shape)
    if bad.any():
        lines = [f"{where.header()}: {int(bad.sum())} of {a.size} elements differ by more than {max_ulp} ULP of x_abs:"]
        for ix in np.argwhere(bad)[:5]:
            i = tuple(int(k) for k in ix)
            lines.append(f"  index {i}: torch {a[i]!r} ({np.float32(a[i]).view(np.uint32):#010x}), spec {e[i]!r} "
                         f"({np.float32(e[i]).view(np.uint32):#010x}), x_abs {float(np.asarray(x_abs)[i]):.6g}, "
                         f"{dist[i]:.2f} ULP of x_abs")
        raise AssertionError("\n".join(lines + [where.footer()]))


def compare(actual, expected, x_abs, bound: int, where: Where, exact: bool, undetermined=None) -> None:
    if exact:
        assert_same(actual, expected, where)
    else:
        assert_within(actual, expected, x_abs, bound, where, undetermined)


def _torch_sqrt(impl: str, device: str):
    if impl == "foreach":
        return lambda a: to_numpy(torch._foreach_sqrt([to_torch(a, device)])[0])
    return lambda a: to_numpy(torch.sqrt(to_torch(a, device)))


def _torch_state(opt, p) -> dict:
    return {k: to_numpy(v) if isinstance(v, torch.Tensor) else v for k, v in opt.state.get(p, {}).items()}


def _flags(impl: str) -> dict:
    return {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]


def run_optimizer_case(name: str, impl: str, config: dict, trajectory: dict, scale: float | None, device: str,
                       lr_dtype: np.dtype | None = None, separate_unscale: bool = False, native: bool = False) -> None:
    """``scale``: the GradScaler's initial scale, None for no scaler. ``lr_dtype``: give torch
    the learning rate as a 0-d tensor of that dtype (a tensor lr) and the spec the same value as
    a 0-d array (reference.optim rule 11). ``separate_unscale``: a kernel-scaled optimizer's
    gradients are unscaled by ``scaler.unscale_`` before ``scaler.step``, so the kernel must not
    unscale them again (``grad_scale=None`` in the spec). ``native``: the spec steps as the native
    kernels compute (``row.step(..., native=True)``) and every field must agree bit for bit."""
    row, case = optim.spec(name), strategies.OPTIMIZER_CASES[name]
    spec_cfg = row.make_config(**config)
    exact = native or expectations.exact_kernels(device)
    bounds = case.ulp if case.ulp is not None else dict(row.native_ulp)
    kernel = impl in row.kernel_scaled
    params = [torch.nn.Parameter(to_torch(p, device)) for p in trajectory["params"]]
    spec_lr = None
    if lr_dtype is not None:
        spec_lr = np.asarray(config["lr"], dtype=lr_dtype)
        config = dict(config, lr=to_torch(spec_lr, device))
    opt = case.torch_class(params, **config, **_flags(impl))
    scaler = None if scale is None else torch.amp.GradScaler(device, init_scale=scale, growth_interval=2)
    sqrt = None if impl == "fused" else _torch_sqrt(impl, device)

    for step, grads in enumerate(trajectory["grads"]):
        where = Where(f"{name}[{impl}]", step=step, repro=REPRO)
        before = [to_numpy(p) for p in params]
        state = tuple(row.state_from(_torch_state(opt, p), b, spec_cfg) for p, b in zip(params, before))
        for p, g in zip(params, grads):
            p.grad = None if g is None else to_torch(g, device)
        known = expectations.known_optimizer_failure(name, impl, spec_cfg, grads, state, device)
        if known is not None:
            with pytest.raises(known[0], match=known[1]):
                opt.step()
            event(f"{name}[{impl}]: keyed expectation {known[0].__name__}")
            return
        with np.errstate(invalid="ignore"):
            skipped = scaler is not None and any(g is not None and not np.isfinite(g).all() for g in grads)
        grad_scale = None
        if scaler is not None:
            scaler.scale(torch.ones((), device=device))  # the loss, as every iteration scales it
            scale_now = np.float32(scaler.get_scale())
            if kernel and not separate_unscale:
                grad_scale = scale_now
            else:
                scaler.unscale_(opt)
                present = [g for g in grads if g is not None]
                unscaled = iter(scaling.unscale_gradients(present, scaling.ScalerState(scale_now, 0, 1))[0])
                grads = [None if g is None else next(unscaled) for g in grads]
        if skipped and not kernel:
            spec_params, spec_grads, spec_state = [np.array(b, copy=True) for b in before], grads, state
        else:
            spec_params, spec_grads, spec_state = row.step(
                impl, before, grads, state, spec_cfg, lr=spec_lr, sqrt=sqrt, grad_scale=grad_scale if kernel else None,
                found_inf=(1.0 if skipped else 0.0) if kernel else 0.0, native=native)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        _compare_step(row, spec_cfg, opt, params, before, state, spec_params, spec_grads, spec_state, bounds,
                      exact, skipped, scaler is not None, where)


def _compare_step(row, cfg, opt, params, before, old_state, spec_params, spec_grads, spec_state, bounds, exact: bool,
                  skipped: bool, scaled: bool, where: Where) -> None:
    same = exact or skipped
    for i, (p, old, new, g) in enumerate(zip(params, old_state, spec_state, spec_grads)):
        if g is None:
            assert_same(to_numpy(p), spec_params[i], where.at(f"params[{i}] (no grad)"))
            continue
        if scaled:
            # One correctly rounded multiply or division (or nothing, on a skipped step): exact anywhere.
            assert_same(to_numpy(p.grad), g, where.at(f"grads[{i}] after the step"))
        x_abs = row.magnitudes(cfg, before[i], g, old, new) if not same else {}
        undetermined = x_abs.get("undetermined")
        torch_state = _torch_state(opt, p)
        if not torch_state and skipped:
            # A first step GradScaler skipped: torch creates its state lazily inside step(),
            # which never ran; the spec's is the state init_state gives, the same starting point.
            assert_same(to_numpy(p), spec_params[i], where.at(f"params[{i}] (skipped first step)"))
            continue
        for f in dataclasses.fields(new):
            value, got = getattr(new, f.name), torch_state.get(f.name)
            assert_equal(got is None, value is None, where.at(f"{f.name}[{i}] exists"))
            if value is None:
                continue
            if isinstance(value, np.floating):  # a counter or a running product: exact anywhere
                assert_same(value.dtype.type(np.asarray(got).reshape(())), value, where.at(f"{f.name}[{i}]"))
            else:
                compare(got, value, x_abs.get(f.name), bounds[f.name], where.at(f"{f.name}[{i}]"), same, undetermined)
        compare(to_numpy(p), spec_params[i], x_abs.get("param"), bounds["param"], where.at(f"params[{i}]"), same,
                undetermined)


@pytest.mark.parametrize(("name", "impl"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
@given(data=st.data())
def test_optimizer_steps_match_the_spec(name, impl, device, data):
    row, case = optim.spec(name), strategies.OPTIMIZER_CASES[name]
    config = data.draw(case.config(), label="config")
    kernel = impl in row.kernel_scaled
    use_scaler = kernel or data.draw(st.booleans(), label="GradScaler")
    # A configuration the kernel cannot skip safely (fused SGD with momentum) never sees a skip.
    plant = use_scaler and not (kernel and row.kernel_skip_refused(row.make_config(**config)))
    trajectory = data.draw(strategies.optimizer_trajectory(plant_nonfinite=plant, zero_d=True, dtypes=DTYPES,
                                                           min_ndim=case.min_ndim, steps=case.steps),
                           label="trajectory")
    scale = data.draw(st.sampled_from(SCALES), label="init_scale") if use_scaler else None
    separate = kernel and data.draw(st.booleans(), label="separate unscale_")
    run_optimizer_case(name, impl, config, trajectory, scale, device, separate_unscale=separate)


NATIVE_CASES = [(name, impl) for name, row in optim.SPECS.items() for impl in sorted(row.native_exact)]
NATIVE_RERUN_ENV = "AMPSPEC_NATIVE_AVX2_RERUN"


def _native_capability(device: str) -> str:
    """The CPU capability the native-kernel properties run on; a skip naming it where the spec
    states no native kernels there (the scalar kernels are the exact properties' above)."""
    if device != "cpu":
        pytest.skip(f"reference.optim._common rule 7 states the CPU's native kernels, not {device}'s")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in NATIVE_KERNELS:
        pytest.skip(f"CPU capability {capability}: no native kernels here (rule 7 states {', '.join(NATIVE_KERNELS)}); "
                    "the exact properties above cover these scalar kernels")
    return capability


@pytest.mark.parametrize(("name", "impl"), NATIVE_CASES, ids=[f"{n}-{i}" for n, i in NATIVE_CASES])
@given(data=st.data())
def test_native_float32_steps_are_bit_for_bit(name, impl, device, data):
    """reference.optim._common rule 7: every path of a row's ``native_exact`` (Adam and AdamW,
    for-loop and foreach) on the machine's native kernels (AVX2, AVX512), float32 parameters (0-d
    among them), the drawn options of ``strategies.OPTIMIZER_CASES`` (amsgrad, maximize, weight
    decay, betas), under a GradScaler (skipped steps included) or without: ``row.step(...,
    native=True)`` equals torch bit for bit, the parameters and every state field. Mutants killed
    (``conformance.mutations``): ``lerp_fused`` and ``addcmul_fused`` rounding their product;
    ``fma32`` without its fix-up survives here (a drawn case rarely lands a float64 sum on a
    float32 rounding boundary) and is killed by ``conformance/test_fused_kernels.py``."""
    event(f"kernels {_native_capability(device)}")
    config = data.draw(strategies.OPTIMIZER_CASES[name].config(), label="config")
    use_scaler = data.draw(st.booleans(), label="GradScaler")
    trajectory = data.draw(strategies.optimizer_trajectory(plant_nonfinite=use_scaler, zero_d=True,
                                                           dtypes=(np.dtype(np.float32),)), label="trajectory")
    scale = data.draw(st.sampled_from(SCALES), label="init_scale") if use_scaler else None
    run_optimizer_case(name, impl, config, trajectory, scale, device, native=True)


@pytest.mark.skipif(bool(os.environ.get(NATIVE_RERUN_ENV) or os.environ.get(expectations.EXACT_MODE_ENV)),
                    reason="a rerun (AVX2 or exact mode): the first run starts the AVX2 one")
def test_native_float32_steps_are_bit_for_bit_on_avx2_kernels(device):
    """Rule 7 on AVX2: the property above again in a subprocess with ``ATEN_CPU_CAPABILITY=avx2``
    (an AVX512 machine runs its own kernels in this process, the exact-mode rerun the scalar ones)."""
    if device != "cpu":
        pytest.skip(f"reference.optim._common rule 7 states the CPU's native kernels, not {device}'s")
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this machine has no AVX2 kernels to run")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", **{NATIVE_RERUN_ENV: "1"})
    env["AMPSPEC_THREADS"] = str(torch.get_num_threads())
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    test = f"{Path('conformance') / 'test_optimizers.py'}::test_native_float32_steps_are_bit_for_bit"
    result = subprocess.run([sys.executable, "-m", "pytest", test, "-q", "--tb=short", "-p", "no:cacheprovider",
                             "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True)
    output = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0 and " passed" in output and "skipped" not in output, (
        f"rule 7's property failed with ATEN_CPU_CAPABILITY=avx2 (exit code {result.returncode}); rerun: "
        f"ATEN_CPU_CAPABILITY=avx2 {NATIVE_RERUN_ENV}=1 python -m pytest {test}\n--- output (tail) ---\n{output}")


def test_fused_sgd_skipped_first_step_is_the_keyed_expectation(device):
    """torch's fused SGD keeps an uninitialised buffer after a skipped first step: a keyed fact,
    and the reason the spec refuses the sync-free mode for SGD with momentum."""
    probed = expectations.probe_fused_sgd_skipped_first_step_stores_a_buffer(device)
    expected = expectations.fused_sgd_skipped_first_step_stores_a_buffer(device)
    assert probed == expected, (
        f"torch {torch.__version__} on {device}: fused SGD stores a momentum buffer on a skipped first step="
        f"{probed}, the suite expects {expected}; update conformance/expectations.py after checking the change"
    )
    # The spec: a skipped step creates no buffer, and sync_free with momentum is refused.
    cfg = optim.SGDConfig(lr=0.1, momentum=0.9)
    assert optim.init_state([np.ones(4, np.float32)], cfg)[0].momentum_buffer is None
    with pytest.raises(ValueError, match="SGD with momentum"):
        ref_step.StepConfig(optimizer=cfg, optimizer_kind="fused", sync_free=True)


def test_fused_sgd_late_first_gradient_is_the_keyed_expectation(device):
    """torch's fused SGD raising on a parameter whose first gradient comes late is a keyed fact
    (the optimizer properties expect that TypeError where it is keyed True)."""
    probed = expectations.probe_fused_sgd_fails_on_late_first_gradient(device)
    if not expectations.keyed_device(device):
        pytest.skip(f"no {device} measurement is keyed: the optimizer properties follow the probe ({probed})")
    expected = expectations.fused_sgd_fails_on_late_first_gradient(device)
    assert probed == expected, (
        f"torch {torch.__version__} on {device}: fused SGD raises on a late first gradient={probed}, the "
        f"suite expects {expected}; update conformance/expectations.py after checking the change")


TENSOR_LR_CASES = [(n, i) for n, c in strategies.OPTIMIZER_CASES.items() for i in c.tensor_lr]
# The implementations torch refuses a tensor lr (every spec implementation not in its row's tensor_lr).
TENSOR_LR_REFUSED = [(n, i) for n, row in optim.SPECS.items() for i in row.steps if n in strategies.OPTIMIZER_CASES
                     and i not in strategies.OPTIMIZER_CASES[n].tensor_lr + strategies.OPTIMIZER_CASES[n].tensor_lr_gap]
# The paths where torch takes one and the spec does not model it yet (a stated gap).
TENSOR_LR_GAPS = [(n, i) for n, c in strategies.OPTIMIZER_CASES.items() for i in c.tensor_lr_gap]
TENSOR_LR_DTYPES = [np.dtype(np.float32), np.dtype(np.float64)]
# (parameter dtype, lr dtype), the mixed pairs first and twice as often as the others: a float32
# 0-d parameter meets a float64 rate promoted; a float32 rate rounds what a Python float does not.
F32, F64 = TENSOR_LR_DTYPES
TENSOR_LR_PAIRS = [(F32, F64), (F64, F32), (F32, F64), (F32, F32), (F64, F32), (F64, F64)]


@pytest.mark.parametrize(("name", "impl"), TENSOR_LR_CASES, ids=[f"{n}-{i}" for n, i in TENSOR_LR_CASES])
@given(data=st.data())
def test_tensor_lrs_and_zero_d_parameters_match_the_spec(name, impl, device, data):
    """reference.optim rule 11 and reference.optim._lr: a learning rate given as a float32 or
    float64 tensor, on every path where torch takes one, with float32 or float64 parameters (0-d
    among the others, where two 0-d tensors promote), gradients that are sometimes None, under a
    GradScaler (non-finite gradients, so skipped steps, included) or without. Each optimizer's
    docstring says where the tensor is read as its value and where it computes as a tensor."""
    row, case = optim.spec(name), strategies.OPTIMIZER_CASES[name]
    config = data.draw(case.config(), label="config")
    kernel = impl in row.kernel_scaled
    use_scaler = kernel or data.draw(st.booleans(), label="GradScaler")
    plant = use_scaler and not (kernel and row.kernel_skip_refused(row.make_config(**config)))
    dtype, lr_dtype = data.draw(st.sampled_from(TENSOR_LR_PAIRS), label="param dtype, lr dtype")
    trajectory = data.draw(strategies.optimizer_trajectory(plant_nonfinite=plant, zero_d=True, dtypes=(dtype,),
                                                           min_ndim=case.min_ndim, steps=case.steps,
                                                           zero_d_first=case.min_ndim == 0),
                           label="trajectory")
    # Rates whose float32 and float64 quotients by the bias corrections part (not powers of two).
    config["lr"] = data.draw(st.one_of(st.sampled_from([0.37, 3e-4, 0.1, 0.013]), st.floats(1e-4, 0.5)), label="lr")
    scale = data.draw(st.sampled_from(SCALES), label="init_scale") if use_scaler else None
    separate = kernel and data.draw(st.booleans(), label="separate unscale_")
    run_optimizer_case(name, impl, config, trajectory, scale, device, lr_dtype=lr_dtype, separate_unscale=separate)


@pytest.mark.parametrize(("name", "impl"), TENSOR_LR_REFUSED, ids=[f"{n}-{i}" for n, i in TENSOR_LR_REFUSED])
@pytest.mark.parametrize("lr_dtype", TENSOR_LR_DTYPES, ids=str)
def test_a_tensor_lr_is_refused_where_torch_refuses_it(name, impl, lr_dtype, device):
    """Where a path is not in its conformance row's ``tensor_lr``, torch refuses a tensor lr (a
    ValueError; for foreach Adam(W): not supported for capturable=False and foreach=True) and the
    spec's row refuses it with the same message. A torch that starts taking one fails here: the
    path then belongs in ``tensor_lr``, with its rule in the spec."""
    row, case = optim.spec(name), strategies.OPTIMIZER_CASES[name]
    lr = np.asarray(0.01, lr_dtype)
    param = torch.nn.Parameter(to_torch(np.ones(3, np.float32), device))
    with pytest.raises(ValueError) as torch_refusal:
        opt = case.torch_class([param], lr=to_torch(lr, device), **_flags(impl))
        param.grad = torch.ones_like(param)
        opt.step()
    cfg = row.make_config()
    p0 = np.ones(3, np.float32)
    with pytest.raises(ValueError) as spec_refusal:
        row.step(impl, [p0], [np.ones(3, np.float32)], (row.init_state(p0, cfg),), cfg, lr=lr)
    assert str(spec_refusal.value) == str(torch_refusal.value), (
        f"{name}[{impl}] with a {lr_dtype} tensor lr: torch says {torch_refusal.value!s}, the spec says "
        f"{spec_refusal.value!s}")


@pytest.mark.parametrize("name", ["NAdam", "RAdam"])
def test_the_for_loop_and_foreach_paths_differ_as_the_spec_says(name, device):
    """torch's for-loop and foreach NAdam and RAdam compute the same formula rounded differently
    (reference.optim.nadam rule 5, reference.optim.radam rule 5): a tested expectation. From the
    same start, the two torch paths part in the last bits, and so do the spec's two functions;
    with exact kernels each path equals its spec bit for bit."""
    row, rng = optim.spec(name), np.random.default_rng(0)
    cfg = dict(lr=0.01, weight_decay=0.0)
    p0 = rng.standard_normal(4096).astype(np.float32)
    grads = [rng.standard_normal(4096).astype(np.float32) for _ in range(8)]
    out = {}
    for impl in ("for-loop", "foreach"):
        p = torch.nn.Parameter(to_torch(p0, device))
        opt = getattr(torch.optim, name)([p], **cfg, **_flags(impl))
        spec_p, spec_s = [p0], (row.init_state(p0, row.make_config(**cfg)),)
        for g in grads:
            p.grad = to_torch(g, device)
            opt.step()
            spec_p, _, spec_s = row.step(impl, spec_p, [g], spec_s, row.make_config(**cfg), sqrt=_torch_sqrt(impl, device))
        out[impl] = (to_numpy(p), spec_p[0])
        if expectations.exact_kernels(device):
            assert_same(out[impl][0], out[impl][1], Where(f"{name}[{impl}]", field="params after 8 steps"))
    assert not np.array_equal(out["for-loop"][0], out["foreach"][0]), f"torch's two {name} paths now agree"
    assert not np.array_equal(out["for-loop"][1], out["foreach"][1]), f"the spec's two {name} paths agree"


@pytest.mark.parametrize(("name", "impl"), TENSOR_LR_GAPS, ids=[f"{n}-{i}" for n, i in TENSOR_LR_GAPS])
def test_a_tensor_lr_the_spec_does_not_model_is_refused_by_it_and_taken_by_torch(name, impl, device):
    """A stated gap (``tensor_lr_gap``): torch steps with a tensor lr there and the spec refuses
    one, saying it is not modelled. A spec that starts modelling it, or a torch that starts
    refusing it, fails here: the path then moves to ``tensor_lr``, or to the refused ones."""
    row, case = optim.spec(name), strategies.OPTIMIZER_CASES[name]
    shape = (3,) * max(case.min_ndim, 1)
    param = torch.nn.Parameter(to_torch(np.ones(shape, np.float32), device))
    opt = case.torch_class([param], lr=to_torch(np.asarray(0.01, np.float32), device), **_flags(impl))
    param.grad = torch.ones_like(param)
    opt.step()
    cfg, p0 = row.make_config(), np.ones(shape, np.float32)
    with pytest.raises(ValueError, match="tensor lr is not modelled"):
        row.step(impl, [p0], [np.ones(shape, np.float32)], (row.init_state(p0, cfg),), cfg,
                 lr=np.asarray(0.01, np.float32))


# Where a tensor lr's dtype shows only on a float32 0-d parameter meeting a float64 rate (two 0-d
# tensors promote): the paths whose rule computes in the common dtype (reference.optim._lr rule 3).
PROMOTING = [("Adagrad", "foreach", {}), ("Adagrad", "foreach", {"maximize": True}),
             ("NAdam", "for-loop", {"weight_decay": 0.5, "decoupled_weight_decay": True}),
             ("NAdam", "foreach", {"weight_decay": 0.5, "decoupled_weight_decay": True}),
             ("RAdam", "for-loop", {}), ("RAdam", "foreach", {})]  # rectified from step 6


@pytest.mark.parametrize(("name", "impl", "cfg"), PROMOTING, ids=[f"{n}-{i}" + "".join(f"-{k}" for k in sorted(c)) for n, i, c in PROMOTING])
def test_a_zero_d_parameter_meets_a_float64_tensor_lr_promoted(name, impl, cfg, device):
    """Float32 0-d parameters and a float64 tensor lr that a schedule changes every step, 10
    steps: torch's parameters differ from those Python floats of the same values give (the
    promotion is real), and with exact kernels equal the spec's bit for bit (Adagrad's foreach
    multiplies out of place without maximize or weight decay and in place with them; NAdam's
    decay factor; RAdam's product chains and its foreach step sizes)."""
    row, rng = optim.spec(name), np.random.default_rng(7)
    spec_cfg = row.make_config(**cfg)
    # Small parameters and large rates: the update is not lost in the parameter's rounding.
    p0 = [np.float32(rng.standard_normal() * 1e-2).reshape(()) for _ in range(128)]
    grads = [[np.float32(rng.standard_normal()).reshape(()) for _ in p0] for _ in range(10)]
    lrs = [np.asarray(r, np.float64) for r in rng.uniform(0.05, 0.5, len(grads))]
    finals = {}
    for kind in ("tensor", "float"):
        params = [torch.nn.Parameter(to_torch(p, device)) for p in p0]
        opt = getattr(torch.optim, name)(params, lr=to_torch(lrs[0], device) if kind == "tensor" else 0.1, **cfg,
                                         **_flags(impl))
        for g, lr in zip(grads, lrs):
            opt.param_groups[0]["lr"] = to_torch(lr, device) if kind == "tensor" else float(lr)
            for p, gi in zip(params, g):
                p.grad = to_torch(gi, device)
            opt.step()
        finals[kind] = np.stack([to_numpy(p) for p in params])
    assert not np.array_equal(finals["tensor"], finals["float"]), \
        f"{name}[{impl}]: a float64 tensor lr no longer changes a float32 0-d parameter's bits"
    if expectations.exact_kernels(device):
        spec_p, state = list(p0), tuple(row.init_state(p, spec_cfg) for p in p0)
        for g, lr in zip(grads, lrs):
            spec_p, _, state = row.step(impl, spec_p, g, state, spec_cfg, lr=lr, sqrt=_torch_sqrt(impl, device))
        assert_same(finals["tensor"], np.stack([np.asarray(p) for p in spec_p]),
                    Where(f"{name}[{impl}]", field="128 float32 0-d params after 10 steps, float64 tensor lrs"))
