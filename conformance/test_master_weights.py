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
Adam, AdamW, RMSprop and Adagrad, the fused paths of Adam and AdamW, the for-loop paths of
Adamax, Adadelta, NAdam and RAdam), bit for bit in the exact mode. Mutants killed there
(measured): the in-place foreach multiply without its scalar rounded to S (3 of the 8
SGD/Adam/AdamW pairs fail), the fused path computed op by op (2 fail), a fused result rounded
through float16 first (1 fails), Adagrad's foreach in-place scaling of the gradient by a float32
``-clr`` (1 fails), RMSprop's foreach momentum multiply by a float32 scalar (1 fails), RMSprop's
``eps`` added in float32 instead of rounded to S (2 fail), Adadelta's ``delta / std * d``
rounded once instead of twice (1 fails), NAdam's denominator in the foreach order (1 fails); the
foreach SGD fallback while a buffer is missing, Adamax's ``eps`` rounded to S and RAdam's
reciprocal have explicit cases below.
"""

from __future__ import annotations

import dataclasses

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

REPRO = "rerun this test with the @reproduce_failure blob printed above"
CASES = [(option, name, impl) for option in ("fp32", "kahan", "stochastic")
         for name, row in optim.SPECS.items() if name in strategies.OPTIMIZER_CASES for impl in row.steps]
CASES += [("none", name, impl) for name, impls in lowprec.COVERED.items() for impl in impls]


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


def run_case(option: str, name: str, impl: str, case: dict, device: str) -> None:
    row, ocase = optim.spec(name), strategies.OPTIMIZER_CASES[name]
    cfg = row.make_config(**case["config"])
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
        if not exact_mode:
            if option == "fp32":
                for i, p in enumerate(params):
                    assert_same(to_numpy(p), formats.cast(to_numpy(mw.masters[i]), storage), where.at(f"weight[{i}]"))
            continue
        states, exact = ref.master_step(option, row, impl, states, grads, cfg, bits=bits, sqrt=sqrt)
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


def test_radam_divides_a_scalar_by_a_tensor_as_reciprocal_then_product(device):
    """``reference.lowprec`` rule 12: RAdam's rectified ``bc2**0.5 / (sqrt(v) + eps)`` is torch's
    ``x.reciprocal() * scalar``, two roundings to S. Visible only where the update is not small
    beside the weight, so the weights start at zero with lr 1, and betas (0.9, 0.9) rectify from
    step 6 on (a drawn trajectory rarely gets there). Mutant killed: one rounded division."""
    rng = np.random.default_rng(1)
    for storage in mw_strategies.storage_formats("none"):
        grads = [[rng.standard_normal(100).astype(storage)] for _ in range(8)]
        case = dict(config=dict(lr=1.0, betas=(0.9, 0.9)), storage=storage, params=[np.zeros(100, storage)],
                    grads=grads, seed=0, boundary=None)
        run_case("none", "RAdam", "for-loop", case, device)
