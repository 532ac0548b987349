"""Master weights: ``torchimpl.train.master_weights`` against ``reference.master_weights``, step by step.

One property per option, drawing the registered optimizer and implementation
(``reference.optim.SPECS``: each row's for-loop, foreach and fused paths; the sweep with one
property per option, optimizer and implementation runs with ``--runslow``), with parameters stored in bfloat16 or float16,
0-d and empty ones among them, gradients sometimes None, and steps whose gradients hold inf or
NaN: the step engine skips those (nothing is called), and every weight, master, compensation
buffer, state and the generator must then be left as they were. On an applied step both sides
take the same gradients; the stochastic option's bits are the ones production drew from its
generator, which must equal a replay of that generator over the applied steps only, or, in
some cases, explicit bits at the rounding threshold (the low 16 bits of the float32 result, one
below, one above), where a draw from the generator would hit it with probability 2^-16. After each
step every field must agree: the stored weight, the master (``fp32``), the compensation buffer
(``kahan``), each optimizer state field torch keeps (by name, in its dtype), and the lost-update
count of every parameter (``reference.health`` rule 12).

Exactness (``expectations.exact_kernels``): with torch's scalar kernels the two trajectories are
equal bit for bit, every field, from the same start (no resynchronisation), so nothing a step
does is lost. On native kernels torch's float32 optimizer step differs from the spec's by the
ULPs ``conformance/test_optimizers.py`` bounds; there this property checks what the option adds
and is exact anywhere: the weight is the RNE cast of torch's own master (``fp32``), a skipped
step changes nothing, and the bits replay the generator. The exact-mode rerun
(``conformance/test_exact_mode.py``) runs the whole comparison.

The ``none`` option (torch's kernels on the low-precision tensors themselves) is compared where
``reference.lowprec`` models it (``lowprec.COVERED``: the for-loop and foreach paths of SGD,
Adam, AdamW, RMSprop, Adagrad, Adamax, Adadelta, NAdam, RAdam and Adafactor, the fused paths of
Adam, AdamW, Adagrad and SGD; fused SGD with momentum is refused by the spec, which a drawn case
checks, and so is an empty Adafactor parameter with a gradient, where torch raises
ZeroDivisionError), bit for bit in the exact mode. Mutants killed there
(measured): the in-place foreach multiply without its scalar rounded to S (3 of the 8
SGD/Adam/AdamW pairs fail), the fused path computed op by op (2 fail), a fused result rounded
through float16 first (1 fails), Adagrad's foreach in-place scaling of the gradient by a float32
``-clr`` (1 fails), RMSprop's foreach momentum multiply by a float32 scalar (1 fails), RMSprop's
``eps`` added in float32 instead of rounded to S (2 fail), Adadelta's ``delta / std * d``
rounded once instead of twice (1 fails), NAdam's denominator in the foreach order (1 fails); the
foreach multiply by a float32 scalar in Adamax's ``exp_inf`` (2 fail), Adadelta's ``square_avg``
(2 fail) or ``acc_delta`` (1 fails) or the decoupled weight decay of NAdam and RAdam (3 fail),
the foreach NAdam denominator in the for-loop order (2 fail), the foreach RAdam update computed as
the for-loop one (2 fail); the foreach SGD fallback while a buffer is missing, Adamax's ``eps``
rounded to S and RAdam's reciprocal (for-loop: one rounded division; foreach: the quotient left
unrounded before it, or its scalar rounded to S) have explicit cases below, and so do
Adafactor's (rsqrt rounded once, the foreach update or weight decay by a float32 scalar, the
outer product and its division rounded once, the row statistic rounded once: 1 or 2 of its 2
pairs fail each).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from conformance import expectations, mw_strategies, strategies
from conformance.assertions import Where, assert_equal, assert_same
from conformance.bridge import to_numpy, to_torch
from reference import formats, health, lowprec, optim
from reference import master_weights as ref
from torchimpl.train.master_weights import MasterWeights

ROOT = Path(__file__).resolve().parent.parent
REPRO = "rerun this test with the @reproduce_failure blob printed above"
CASES = [(option, name, impl) for option in ("fp32", "kahan", "stochastic")
         for name, row in optim.SPECS.items() if name in strategies.OPTIMIZER_CASES for impl in row.steps]
CASES += [("none", name, impl) for name, impls in lowprec.COVERED.items() for impl in impls]
# reference.optim.adafactor rule 10: the spec's refusal of an empty parameter with a gradient.
EMPTY_REFUSED = r"params\[\d+\] is empty \(shape \([0-9, ]*\)\): torch's Adafactor .* raises ZeroDivisionError"


def _flags(impl: str) -> dict:
    return {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]


def _torch_sqrt(impl: str):
    """torch's own float32 square root for the path (reference.optim rule 9); None: the fused one."""
    if impl == "fused":
        return None
    if impl == "foreach":
        return lambda a: to_numpy(torch._foreach_sqrt([to_torch(a)])[0])
    return lambda a: to_numpy(torch.sqrt(to_torch(a)))


def _finite(grads: list) -> bool:
    with np.errstate(invalid="ignore"):
        return all(g is None or np.isfinite(g.astype(np.float32)).all() for g in grads)


def _compare(mw: MasterWeights, states: tuple, exact_mode: bool, where: Where) -> None:
    """Every field of every parameter: torch's against the spec's."""
    for i, (p, s) in enumerate(zip(mw.params, states)):
        assert_same(to_numpy(p), s.weight, where.at(f"weight[{i}]"))
        if mw.masters is not None and exact_mode:
            assert_same(to_numpy(mw.masters[i]), s.master, where.at(f"master[{i}]"))
        if mw.compensation is not None and exact_mode:
            assert_same(to_numpy(mw.compensation[i]), s.compensation, where.at(f"compensation[{i}]"))
        if not exact_mode:
            continue
        torch_state = mw.optimizer.state.get(p, {})
        for f in dataclasses.fields(s.opt):
            value, got = getattr(s.opt, f.name), torch_state.get(f.name)
            if not torch_state:  # torch creates its state at a parameter's first gradient
                continue
            assert_equal(got is None, value is None, where.at(f"{f.name}[{i}] exists"))
            if value is None:
                continue
            if isinstance(value, np.floating):
                assert_same(to_numpy(got).reshape(()), np.asarray(value), where.at(f"{f.name}[{i}]"))
            else:
                got = to_numpy(got)
                assert_same(got, value, where.at(f"{f.name}[{i}]"))


def _boundary_bits(row, impl: str, states: tuple, grads: list, cfg, sqrt, offset: int, device: str) -> list:
    """Explicit bits at the stochastic rounding's threshold: the low 16 bits of the spec's float32
    result plus ``offset``, clamped into [0, 2**16)."""
    q, _, _ = ref.float32_step(row, impl, [s.weight for s in states], grads, [s.opt for s in states], cfg, sqrt=sqrt)
    out = []
    for qi, g in zip(q, grads):
        if g is None:
            out.append(None)
            continue
        low = (np.asarray(qi, np.float32).view(np.uint32) & 0xFFFF).astype(np.int64) + offset
        out.append(to_torch(np.clip(low, 0, 0xFFFF).astype(np.float64), device).to(torch.int32))
    return out


def _snapshot(mw: MasterWeights) -> dict[str, np.ndarray]:
    """Every tensor the option holds, by name, as NumPy arrays (bits kept)."""
    out = {}
    for i, p in enumerate(mw.params):
        out[f"weight[{i}]"] = to_numpy(p)
        if mw.masters is not None:
            out[f"master[{i}]"] = to_numpy(mw.masters[i])
        if mw.compensation is not None:
            out[f"compensation[{i}]"] = to_numpy(mw.compensation[i])
        for key, value in mw.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{key}[{i}]"] = to_numpy(value)
    if mw.generator is not None:
        out["generator"] = bytes(mw.generator.get_state().numpy())
    return out


def _refused_by_the_spec(name: str, impl: str, cfg, case: dict) -> bool:
    """A configuration ``reference.lowprec`` refuses (rule 15: fused SGD with momentum): its step
    raises NotImplementedError naming the pair and the setting, and there is nothing to compare."""
    why = lowprec.refused(name, impl, cfg)
    if why is None:
        return False
    row, storage = optim.spec(name), case["storage"].name
    opts = [ref.init_master_state("none", p, row, cfg, storage).opt for p in case["params"]]
    with pytest.raises(NotImplementedError, match=rf"{name} \({impl}\) on low-precision parameters with momentum"):
        lowprec.step(row, impl, case["params"], case["grads"][0], opts, cfg)
    event(f"none:{name}[{impl}]: refused by the spec")
    return True


def run_case(option: str, name: str, impl: str, case: dict, device: str) -> None:
    row, ocase = optim.spec(name), strategies.OPTIMIZER_CASES[name]
    cfg = row.make_config(**case["config"])
    if option == "none" and _refused_by_the_spec(name, impl, cfg, case):
        return
    exact_mode = expectations.exact_kernels(device)
    storage = case["storage"].name
    params = [torch.nn.Parameter(to_torch(p, device)) for p in case["params"]]
    opt = ocase.torch_class(params, **case["config"], **_flags(impl))
    mw = MasterWeights(opt, option, generator=torch.Generator(device=device).manual_seed(case["seed"]))
    replay = torch.Generator(device=device).manual_seed(case["seed"])
    states = tuple(ref.init_master_state(option, p, row, cfg, storage) for p in case["params"])
    sqrt = _torch_sqrt(impl)
    kept = _snapshot(mw)
    for step, grads in enumerate(case["grads"]):
        where = Where(f"{option}:{name}[{impl}] {storage}", step=step, repro=REPRO)
        for p, g in zip(params, grads):
            p.grad = None if g is None else to_torch(g, device)
        if not _finite(grads):  # the engine's check found inf/NaN: nothing is called
            event("a skipped step")
            held = _snapshot(mw)
            assert_equal(sorted(held), sorted(kept), where.at("tensors held across a skipped step"))
            for key, value in held.items():
                if isinstance(value, bytes):  # the generator's state: no bits were drawn
                    assert_equal(value == kept[key], True, where.at(f"{key} (skipped step)"))
                else:
                    assert_same(value, kept[key], where.at(f"{key} (skipped step)"))
            if exact_mode:
                _compare(mw, states, exact_mode, where.at("skipped"))
            continue
        known = expectations.known_optimizer_failure(
            name, impl, cfg, grads, tuple(ref.state_in(s.opt, None) for s in states), device)
        if known is not None:
            with pytest.raises(known[0], match=known[1]):
                mw.step(measure_lost=True)
            if known[0] is ZeroDivisionError:  # an empty Adafactor parameter: the spec refuses it by name
                with pytest.raises(ValueError, match=EMPTY_REFUSED):
                    ref.master_step(option, row, impl, states, grads, cfg, sqrt=sqrt)
            event(f"{name}[{impl}]: keyed expectation {known[0].__name__}")
            return
        before = [to_numpy(p) for p in params]
        explicit = None
        if option == "stochastic" and case["boundary"] is not None and exact_mode:
            explicit = _boundary_bits(row, impl, states, grads, cfg, sqrt, case["boundary"], device)
            event("stochastic: bits at the rounding boundary")
        mw.step(measure_lost=True, bits=explicit)
        kept = _snapshot(mw)
        bits = None
        if explicit is not None:
            bits = [None if b is None else to_numpy(b.to(torch.float64)).astype(np.int64) for b in explicit]
        elif option == "stochastic":
            want = [None if g is None else torch.randint(0, 1 << 16, tuple(g.shape), dtype=torch.int32, device=device,
                                                         generator=replay) for g in grads]
            for i, (a, b) in enumerate(zip(mw.last_bits, want)):
                assert_equal(a is None, b is None, where.at(f"bits[{i}] drawn"))
                if a is not None:
                    assert_equal(torch.equal(a, b), True, where.at(f"bits[{i}] replay the generator"))
            bits = [None if b is None else to_numpy(b.to(torch.float64)).astype(np.int64) for b in mw.last_bits]
        # The spec's states advance on every kernel: which parameters hold a buffer keys the
        # expectations above (a late first gradient), even where the values are not compared.
        states, exact = ref.master_step(option, row, impl, states, grads, cfg, bits=bits, sqrt=sqrt)
        if not exact_mode:
            if option == "fp32":
                for i, p in enumerate(params):
                    assert_same(to_numpy(p), formats.cast(to_numpy(mw.masters[i]), storage), where.at(f"weight[{i}]"))
            continue
        _compare(mw, states, exact_mode, where)
        for i, (b, s, e, got) in enumerate(zip(before, states, exact, mw.lost_counts())):
            if e is None:
                assert_equal(got, None, where.at(f"lost[{i}] (no gradient)"))
                continue
            assert_equal(got, health.applied_lost_count(b, s.weight, e), where.at(f"lost[{i}]"))


@given(case=mw_strategies.lerp_at_one_case())
def test_lerp_at_weight_one_keeps_torchs_signs_of_zero(case):
    """Rule 4 of ``reference.optim._common`` (float32, float64) and of ``reference.lowprec``
    (bfloat16, float16) at ``w = 1`` (Adam's ``1 - beta1`` with beta1 = 0): every element bit
    for bit against torch's CPU ``lerp``, the vectorized head's ``y + (w - 1) * (y - x)`` and the
    scalar tail's ``y - (y - x) * (1 - w)``, which differ in the sign of a zero. Exact on every
    CPU capability (the results are ``y`` or a zero, no rounding a fused multiply-add changes).
    Mutant killed: rule 4 without the vectorized head (the scalar formula everywhere)."""
    from reference.optim._common import lerp

    x, y = case["x"], case["y"]
    got = to_numpy(to_torch(x).lerp(to_torch(y), 1.0))
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as torch gives
        spec = lowprec.lerp(x, y, 1.0) if x.dtype.itemsize == 2 else lerp(x, y, 1.0)
        assert_same(got, np.asarray(spec, x.dtype),
                    Where(f"lerp(x, y, 1.0) {x.dtype} shape {x.shape}", step=0, repro=REPRO).at("result"))


OPTIONS = sorted({option for option, _, _ in CASES})


@pytest.mark.parametrize("option", OPTIONS)
@given(data=st.data())
def test_master_weight_steps_match_the_spec(option, device, data):
    """Each option, over every registered optimizer and implementation (drawn)."""
    _, name, impl = data.draw(st.sampled_from([c for c in CASES if c[0] == option]), label="optimizer")
    case = data.draw(mw_strategies.master_case(name, option), label="case")
    run_case(option, name, impl, case, device)


@pytest.mark.slow
@pytest.mark.parametrize(("option", "name", "impl"), CASES, ids=[f"{o}-{n}-{i}" for o, n, i in CASES])
@given(data=st.data())
def test_master_weight_steps_match_the_spec_for_each_optimizer(option, name, impl, device, data):
    """The whole sweep: one property per option, optimizer and implementation (--runslow)."""
    case = data.draw(mw_strategies.master_case(name, option), label="case")
    run_case(option, name, impl, case, device)


@pytest.mark.parametrize("option", ["fp32", "kahan", "stochastic"])
@given(data=st.data())
def test_fused_sgd_fails_as_keyed_when_a_first_gradient_comes_late(option, device, data):
    """``expectations.FUSED_SGD_FAILS_ON_LATE_FIRST_GRADIENT``: a parameter whose first gradient
    comes a step after another's makes torch's fused SGD with momentum raise TypeError (it passes
    the missing buffer on); the case expects it on every kernel level, so the spec's states,
    which key it, advance on native kernels too, where their values are not compared. Mutant
    killed: the states advanced on the exact kernels only (the TypeError escapes on AVX512)."""
    storage = mw_strategies.BF16
    g = np.array(1.25e-07, storage)
    case = dict(config=dict(lr=1.0, momentum=0.5, nesterov=True), storage=storage,
                params=[np.array(1.25e-4, storage)] * 2, grads=[[g, None], [g, g]], seed=0, boundary=None)
    run_case(option, "SGD", "fused", case, device)


def test_foreach_sgd_multiplies_as_the_per_tensor_kernel_while_a_buffer_is_missing(device):
    """``reference.lowprec`` rule 7, the case a drawn trajectory rarely reaches: a parameter
    without a gradient at the first step has no momentum buffer at the second, so torch's
    foreach SGD falls back to ``buf.mul_(momentum)`` (float32 scalar) for the others; from the
    third step on every buffer exists and ``_foreach_mul_`` rounds the momentum to S. Mutant
    killed: the foreach rounding at every step (the fallback ignored)."""
    rng = np.random.default_rng(3)
    for storage in mw_strategies.storage_formats("none"):
        params = [rng.standard_normal(40).astype(storage) for _ in range(2)]
        grads = [[rng.standard_normal(40).astype(storage), None]]
        grads += [[rng.standard_normal(40).astype(storage) for _ in range(2)] for _ in range(2)]
        case = dict(config=dict(lr=0.1, momentum=0.7), storage=storage, params=params, grads=grads, seed=0,
                    boundary=None)
        run_case("none", "SGD", "foreach", case, device)


def test_adamax_adds_eps_rounded_to_the_storage_format(device):
    """``reference.lowprec`` rules 1 and 11: Adamax's ``|d| + eps`` rounds ``eps`` to bfloat16 first.
    With eps = 0.001 (bf16 0.00099945...) and |d| = 0.000881195068359375 the sum is a tie that RNE
    takes down, where a float32 eps would round it up: a drawn eps is rarely comparable to |d|.
    Mutant killed: eps added in float32."""
    bf16 = mw_strategies.BF16
    g = np.array([0.000881195068359375, -0.000881195068359375, 0.5, 0.0], np.float32).astype(bf16)
    case = dict(config=dict(lr=0.01, eps=0.001), storage=bf16, params=[np.ones(4, bf16)], grads=[[g], [g]], seed=0,
                boundary=None)
    run_case("none", "Adamax", "for-loop", case, device)


@pytest.mark.parametrize("impl", ["for-loop", "foreach"])
def test_radam_divides_a_scalar_by_a_tensor_as_reciprocal_then_product(impl, device):
    """``reference.lowprec`` rules 12 and 14: RAdam's rectified ``bc2**0.5 / (sqrt(v) + eps)`` is
    torch's ``x.reciprocal() * scalar``, two roundings to S; the foreach path's
    ``1 / ((sqrt(v) + eps) / s)`` rounds the quotient, then its reciprocal. Visible only where the
    update is not small beside the weight, so the weights start at zero with lr 1, and betas
    (0.9, 0.9) rectify from step 6 on (a drawn trajectory rarely gets there). Mutants killed: one
    rounded division (for-loop); the quotient left unrounded before the reciprocal, and the
    foreach division's scalar rounded to S (foreach)."""
    rng = np.random.default_rng(1)
    for storage in mw_strategies.storage_formats("none"):
        grads = [[rng.standard_normal(100).astype(storage)] for _ in range(8)]
        case = dict(config=dict(lr=1.0, betas=(0.9, 0.9)), storage=storage, params=[np.zeros(100, storage)],
                    grads=grads, seed=0, boundary=None)
        run_case("none", "RAdam", impl, case, device)


NATIVE_PAIRS = [(name, impl) for name, impls in lowprec.COVERED.items() for impl in impls]


def _torch_state(spec_state, torch_state: dict):
    """The spec's state with torch's own values (bits kept): the next step starts where torch is."""
    out = {}
    for f in dataclasses.fields(spec_state):
        got = torch_state.get(f.name)
        if isinstance(got, torch.Tensor):
            value = to_numpy(got)
            out[f.name] = value.reshape(()).astype(np.float32)[()] if isinstance(getattr(spec_state, f.name),
                                                                               np.floating) else value
    return dataclasses.replace(spec_state, **out)


def _assert_within_storage_ulps(got, want, x_abs, ulps: int, where: Where) -> None:
    """|torch - spec| <= ``ulps`` ULPs of the 16-bit format at ``x_abs`` (`reference.lowprec`
    rule 13), NaN as a class; 0 ULPs: bit for bit."""
    if ulps == 0:
        assert_same(got, want, where)
        return
    a, e = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        unit = np.maximum(np.spacing(np.abs(np.asarray(x_abs, np.float64)).astype(got.dtype)).astype(np.float64),
                          float(np.finfo(got.dtype).smallest_subnormal))
        dist = np.where(np.isfinite(a) & np.isfinite(e), np.abs(a - e) / unit, np.where(a == e, 0.0, np.inf))
    bad = np.where(np.isnan(a) | np.isnan(e), np.isnan(a) != np.isnan(e), dist > ulps)
    assert not bad.any(), (f"{where.header()}: {int(bad.sum())} elements beyond {ulps} ULPs of {got.dtype} at x_abs; "
                           f"first at {int(np.argmax(bad.reshape(-1)))}: torch {a.reshape(-1)[np.argmax(bad)]!r}, spec "
                           f"{e.reshape(-1)[np.argmax(bad)]!r}\n{where.footer()}")


def run_native_case(name: str, impl: str, case: dict, kernels: str) -> None:
    """Each step of torch's ``name`` (``impl``) on 16-bit parameters against `reference.lowprec`
    on ``kernels``, from torch's own weights and state before the step."""
    row, ocase = optim.spec(name), strategies.OPTIMIZER_CASES[name]
    cfg = row.make_config(**case["config"])
    if _refused_by_the_spec(name, impl, cfg, case):
        return
    storage = case["storage"].name
    params = [torch.nn.Parameter(to_torch(p)) for p in case["params"]]
    opt = ocase.torch_class(params, **case["config"], **_flags(impl))
    opts = [ref.init_master_state("none", p, row, cfg, storage).opt for p in case["params"]]
    ulps = lowprec.bound(name, impl, kernels)
    for step, grads in enumerate(case["grads"]):
        if not _finite(grads):
            continue  # the engine calls nothing (test_master_weight_steps_match_the_spec checks it)
        where = Where(f"none:{name}[{impl}] {storage} on {kernels} kernels", step=step, repro=REPRO)
        weights = [to_numpy(p.detach()) for p in params]
        opts = [_torch_state(s, opt.state.get(p, {})) for s, p in zip(opts, params)]
        for p, g in zip(params, grads):
            p.grad = None if g is None else to_torch(g)
        known = expectations.known_optimizer_failure(name, impl, cfg, grads, tuple(opts), "cpu")
        if known is not None:  # an empty Adafactor parameter: torch's ZeroDivisionError, the spec's refusal
            with pytest.raises(known[0], match=known[1]):
                opt.step()
            with pytest.raises(ValueError, match=EMPTY_REFUSED):
                lowprec.step(row, impl, weights, grads, opts, cfg, kernels=kernels)
            event(f"{name}[{impl}]: keyed expectation {known[0].__name__}")
            return
        opt.step()
        new_w, new_s = lowprec.step(row, impl, weights, grads, opts, cfg, kernels=kernels)
        for i, p in enumerate(params):
            mags = {} if ulps == 0 or grads[i] is None else row.magnitudes(cfg, weights[i], grads[i], opts[i], new_s[i])
            _assert_within_storage_ulps(to_numpy(p.detach()), new_w[i], mags.get("param"), ulps,
                                        where.at(f"weight[{i}]"))
            for f in dataclasses.fields(new_s[i]):
                value, got = getattr(new_s[i], f.name), opt.state.get(p, {}).get(f.name)
                if isinstance(value, np.ndarray) and isinstance(got, torch.Tensor):
                    _assert_within_storage_ulps(to_numpy(got), value, mags.get(f.name), ulps,
                                                where.at(f"{f.name}[{i}]"))


@pytest.mark.parametrize("name,impl", NATIVE_PAIRS)
@given(data=st.data())
def test_none_steps_match_the_spec_on_this_machines_kernels(name, impl, device, data):
    """``reference.lowprec`` rule 13: on the machine's own CPU kernels (AVX2 and AVX512: fused
    multiply-adds in ``lerp`` and ``addcmul``, ``add``'s 64-byte blocks rounded once; rerun under
    ``ATEN_CPU_CAPABILITY=avx2`` below) the for-loop and foreach
    steps of every covered optimizer on bfloat16/float16 parameters are bit for bit, the fused ones
    within ``FUSED_NATIVE_ULPS`` ULPs of S at the row's magnitudes; a capability the
    specification does not state is refused by name. Mutants killed: ``add`` rounding its
    product on native kernels (SGD, Adam's weight decay); ``addcmul``/``lerp`` unfused (Adam's
    moments); the fused bound set to 0."""
    if device != "cpu":
        pytest.skip("rule 13 states the CPU kernels")
    kernels = torch.backends.cpu.get_cpu_capability()
    case = data.draw(mw_strategies.master_case(name, "none"), label="case")
    if kernels not in lowprec.KERNELS:
        with pytest.raises(NotImplementedError, match=kernels):
            lowprec.bound(name, impl, kernels)
        return
    event(f"kernels {kernels}")
    run_native_case(name, impl, case, kernels)


def _native_kernels(device: str) -> str:
    """The capability rule 13 is checked on: the machine's own (CPU only)."""
    if device != "cpu":
        pytest.skip("rule 13 states the CPU kernels")
    return torch.backends.cpu.get_cpu_capability()


@pytest.mark.parametrize("storage", ["bfloat16", "float16"])
def test_fused_adamw_on_native_kernels_is_within_its_bound(storage, device):
    """``reference.lowprec`` rule 13, the fused path: seeds where torch's AVX2/AVX512 fused AdamW
    stores one moment one ULP of S from the spec's (its float32 kernel's contracted
    multiply-adds; a drawn case rarely meets one), within ``FUSED_NATIVE_ULPS``; on the scalar
    kernels bit for bit. Mutant killed: the fused bound set to 0."""
    kernels = _native_kernels(device)
    if kernels not in lowprec.KERNELS:
        pytest.skip(f"{kernels}: not stated by rule 13 (refused, see the property above)")
    dtype = mw_strategies.BF16 if storage == "bfloat16" else mw_strategies.F16
    rng = np.random.default_rng({"bfloat16": 0, "float16": 2}[storage])
    params = [rng.standard_normal(4096).astype(dtype)]
    grads = [[rng.standard_normal(4096).astype(dtype)] for _ in range(2)]
    case = dict(config=dict(lr=0.05, weight_decay=0.01), storage=dtype, params=params, grads=grads)
    run_native_case("AdamW", "fused", case, kernels)
    if kernels in ("AVX2", "AVX512"):  # the measured difference the bound admits (the same kernel on both)
        row, cfg = optim.spec("AdamW"), optim.spec("AdamW").make_config(lr=0.05, weight_decay=0.01)
        param = torch.nn.Parameter(to_torch(params[0]))
        opt = torch.optim.AdamW([param], fused=True, lr=0.05, weight_decay=0.01)
        w, s = [params[0]], [ref.init_master_state("none", params[0], row, cfg, storage).opt]
        for (g,) in grads:
            param.grad = to_torch(g)
            opt.step()
            w, s = lowprec.step(row, "fused", w, [g], list(s), cfg, kernels=kernels)
        differ = int((to_numpy(opt.state[param]["exp_avg"]).view(np.uint16) != s[0].exp_avg.view(np.uint16)).sum())
        assert differ == 1, f"fused AdamW {storage}: {differ} exp_avg elements differ from the spec (measured: 1)"


@given(case=st.fixed_dictionaries({
    "dtype": st.sampled_from([mw_strategies.BF16, mw_strategies.F16]),
    "n": st.sampled_from([0, 1, 7, 8, 15, 16, 31, 32, 33, 64, 100, 1000, 4096]),
    "seed": st.integers(0, 2**16), "scalar": st.sampled_from([0.1, 0.001, 0.3, 0.7, 0.999, -0.37, 1.0])}))
def test_native_lerp_addcmul_and_add_round_as_rule_13_says(case, device):
    """``reference.lowprec`` rule 13, operation by operation, on the machine's kernels: ``lerp``
    and ``addcmul`` fused (every element), ``add`` with ``alpha`` rounded once in its leading
    whole vectors and per operation in its tail; thousands of elements make the rare elements
    where a fused multiply-add rounds otherwise to S likely. Mutants killed: ``lerp`` or
    ``addcmul`` unfused, ``add``'s product rounded in the head."""
    kernels = _native_kernels(device)
    if kernels not in lowprec.KERNELS:
        pytest.skip(f"{kernels}: not stated by rule 13 (refused, see the property above)")
    block, rng = lowprec.KERNELS[kernels], np.random.default_rng(case["seed"])
    if block is None:  # the scalar kernels: rules 2-4, every operation rounded as they say
        ops = (lowprec.lerp, lowprec.addcmul, lowprec.add)
    else:
        ops = tuple(functools.partial(f, block=block)
                    for f in (lowprec.lerp_native, lowprec.addcmul_native, lowprec.add_native))
    s = case["scalar"]
    for n in (case["n"], 8192):  # the drawn size (head and tail), and enough elements to meet the rare ones
        x, y, z = (rng.standard_normal(n).astype(case["dtype"]) for _ in range(3))
        where = Where(f"rule 13 on {kernels}, {case['dtype']} n={n} scalar={s}", step=0, repro=REPRO)
        tx, ty, tz = to_torch(x), to_torch(y), to_torch(z)
        assert_same(to_numpy(tx.lerp(ty, s)), ops[0](x, y, s), where.at("lerp"))
        assert_same(to_numpy(tx.addcmul(ty, tz, value=s)), ops[1](x, y, z, s), where.at("addcmul"))
        assert_same(to_numpy(tx.add(ty, alpha=s)), ops[2](x, y, s), where.at("add"))


FUSED_16_CONFIGS = {"SGD": dict(lr=0.37, weight_decay=0.3), "Adagrad": dict(lr=0.37, weight_decay=0.3, eps=1e-3)}


@pytest.mark.parametrize("name", ["SGD", "Adagrad"])
@pytest.mark.parametrize("storage", ["bfloat16", "float16"])
def test_fused_sgd_and_adagrad_on_16_bit_parameters_round_as_rule_15_says(name, storage, device):
    """``reference.lowprec`` rule 15 on the machine's kernels, bit for bit: sizes around the
    kernels' 32-byte vectors (0-d, 0, 1, 15, 16, 17, 31, 33, 100: the vector loop, whose fused SGD
    never stores its weights, and the scalar tail), then 4,000 tails of 15 elements and a
    65,551-element parameter, enough elements to meet the rare ones where a multiply-add fused or
    not rounds otherwise to S (measured on AVX512: tens of the tails' elements, a few of the large
    body's). Mutants killed: the body's weights updated as the tail's; every multiply-add fused on
    the scalar kernels; none fused on AVX512; Adagrad's body taking float32 hyperparameters."""
    kernels = _native_kernels(device)
    if kernels not in lowprec.KERNELS:
        pytest.skip(f"{kernels}: not stated by rule 13 (refused, see the property above)")
    dtype = mw_strategies.BF16 if storage == "bfloat16" else mw_strategies.F16
    rng = np.random.default_rng(11)
    for shapes in ([(), (0,), (1,), (15,), (16,), (17,), (31,), (33,), (100,)], [(15,)] * 4000, [(65551,)]):
        params = [rng.standard_normal(s).astype(np.float32).astype(dtype) for s in shapes]
        grads = [[rng.standard_normal(s).astype(np.float32).astype(dtype) for s in shapes] for _ in range(3)]
        case = dict(config=FUSED_16_CONFIGS[name], storage=dtype, params=params, grads=grads)
        run_native_case(name, "fused", case, kernels)


def test_fused_sgd_with_momentum_on_16_bit_parameters_is_refused_naming_the_setting():
    """``reference.lowprec`` rule 15: fused SGD with momentum reads its 16-bit buffer as float32
    words, past the buffer's end: the spec refuses it, naming the pair, the setting and the fixes."""
    row = optim.spec("SGD")
    cfg = row.make_config(lr=0.1, momentum=0.9)
    w = np.ones(20, mw_strategies.BF16)
    with pytest.raises(NotImplementedError, match=r"SGD \(fused\) on low-precision parameters with momentum 0\.9: "
                                                  r".*float32 words.*use momentum=0, foreach=True or float32"):
        lowprec.step(row, "fused", [w], [w], [ref.init_master_state("none", w, row, cfg, "bfloat16").opt], cfg)
    assert lowprec.refused("SGD", "fused", row.make_config(lr=0.1)) is None
    assert lowprec.refused("SGD", "foreach", cfg) is None


AVX2_RERUN_ENV = "AMPSPEC_AVX2_RERUN"
AVX2_TESTS = ("test_none_steps_match_the_spec_on_this_machines_kernels or "
              "test_fused_adamw_on_native_kernels_is_within_its_bound or "
              "test_native_lerp_addcmul_and_add_round_as_rule_13_says or "
              "test_fused_sgd_and_adagrad_on_16_bit_parameters_round_as_rule_15_says")


@pytest.mark.skipif(bool(os.environ.get(AVX2_RERUN_ENV) or os.environ.get(expectations.EXACT_MODE_ENV)),
                    reason="a rerun (AVX2 or exact mode): the first run starts the AVX2 one")
def test_none_steps_match_the_spec_on_avx2_kernels(device):
    """``reference.lowprec`` rule 13 on AVX2: the native-kernel properties above again, in a
    subprocess with ``ATEN_CPU_CAPABILITY=avx2`` (an AVX512 machine runs its own kernels in this
    process, the exact-mode rerun the scalar ones): 64-byte blocks, as AVX512. Mutant killed:
    AVX2's block set to its 32-byte vector (sizes 16 to 31 put in ``add``'s head)."""
    if device != "cpu":
        pytest.skip("rule 13 states the CPU kernels")
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this machine has no AVX2 kernels to run")
    env = dict(os.environ)
    env.update(ATEN_CPU_CAPABILITY="avx2", OMP_NUM_THREADS="1", **{AVX2_RERUN_ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "AVX2", f"ATEN_CPU_CAPABILITY=avx2 selected {probe.stdout.strip()!r}"
    test = str(Path("conformance") / "test_master_weights.py")
    result = subprocess.run([sys.executable, "-m", "pytest", test, "-q", "--tb=short", "-p", "no:cacheprovider",
                             "--device", "cpu", "-k", AVX2_TESTS], cwd=ROOT, env=env, capture_output=True, text=True)
    output = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0 and " passed" in output and "skipped" not in output, (
        f"rule 13's properties failed with ATEN_CPU_CAPABILITY=avx2 (exit code {result.returncode}); rerun: "
        f"ATEN_CPU_CAPABILITY=avx2 {AVX2_RERUN_ENV}=1 python -m pytest {test} -k '{AVX2_TESTS}'\n"
        f"--- output (tail) ---\n{output}")


@pytest.mark.parametrize("impl", ["for-loop", "foreach"])
def test_adafactor_on_16_bit_parameters_factors_matrices_and_3d_tensors(impl, device):
    """``reference.lowprec`` rule 16 on shapes the drawn property does not reach: a 3-d tensor
    (factored over its last two dimensions, per leading index), a matrix of 40 columns (its row
    norms take bfloat16's 16-element blocks and a tail, ``reference.reductions`` rule 11), a column
    and a row (a dimension of 1 on either side), a vector and a 0-d tensor; weight decay, maximize
    and an explicit ``eps1``, bit for bit in the exact mode and, step by step from torch's state,
    on the machine's kernels (rule 13: rsqrt's native head). Mutants killed: rsqrt rounded once
    (``conformance.mutations``: ``lowprec_adafactor_rsqrt_rounds_once``), the foreach update
    multiplied by a float32 scalar, the outer product and the division rounded once, the row
    statistic rounded once, the foreach weight decay by a float32 scalar."""
    rng = np.random.default_rng(5)
    shapes = [(2, 17, 40), (33, 40), (9, 1), (1, 9), (100,), ()]
    for storage in mw_strategies.storage_formats("none"):
        for config in (dict(lr=0.05, weight_decay=0.1, maximize=True), dict(lr=0.3, eps=(1e-3, 1e-3), d=1.5)):
            params = [rng.standard_normal(s).astype(storage) for s in shapes]
            grads = [[rng.standard_normal(s).astype(storage) for s in shapes] for _ in range(4)]
            case = dict(config=config, storage=storage, params=params, grads=grads, seed=0, boundary=None)
            run_case("none", "Adafactor", impl, case, device)
            if device == "cpu" and torch.backends.cpu.get_cpu_capability() in lowprec.KERNELS:  # rule 13 too
                run_native_case("Adafactor", impl, case, torch.backends.cpu.get_cpu_capability())
