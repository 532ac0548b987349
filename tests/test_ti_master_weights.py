"""torchimpl.train.master_weights: each option on values known by hand, checkpoints, refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from torchimpl.train.master_weights import OPTIONS, MasterWeights, stochastic_round_bf16

BF16 = torch.bfloat16


def bits16(t: torch.Tensor) -> list[int]:
    return (t.detach().view(torch.int16).to(torch.int32) & 0xFFFF).reshape(-1).tolist()


def sgd(values, lr: float, option: str, dtype=BF16, **kw):
    p = torch.nn.Parameter(torch.tensor(values, dtype=dtype))
    return p, MasterWeights(torch.optim.SGD([p], lr=lr, **kw), option)


def test_stochastic_rounding_matches_the_hand_values():
    x = torch.tensor([1 + 2**-8, 1 + 2**-8, -(1 + 2**-8), 1.0, 3.4028234663852886e38])
    out = stochastic_round_bf16(x, torch.tensor([0x7FFF, 0x8000, 0, 0, 0], dtype=torch.int32))
    assert bits16(out) == [0x3F81, 0x3F80, 0xBF81, 0x3F80, 0x7F80]


def test_fp32_master_accumulates_what_the_bf16_weight_cannot_show():
    p, mw = sgd([1.0], 2**-10, "fp32")
    for k in range(1, 5):
        p.grad = torch.ones_like(p)
        mw.step()
        assert mw.masters[0].item() == 1 - k * 2**-10
        if k == 1:
            assert mw.lost_counts() == [(1, 1)] and mw.lost_fraction() == 1.0
    assert p.item() == 1 - 2**-8 and p.dtype is BF16


def test_kahan_keeps_the_rounding_error_and_pays_it_back():
    p, mw = sgd([1.0], 2**-9, "kahan")
    seen = []
    for _ in range(3):
        p.grad = -torch.ones_like(p)  # an update of +2^-9 each step
        mw.step()
        seen.append((p.item(), mw.compensation[0].item()))
    assert seen == [(1.0, 2**-9), (1.0, 2**-8), (1 + 2**-7, -(2**-9))]


def test_stochastic_step_rounds_by_the_bits_given():
    p, mw = sgd([1.0], 2**-10, "stochastic")
    p.grad = torch.ones_like(p)
    mw.step(bits=[torch.tensor([0xBFFF], dtype=torch.int32)])  # q = 0x3F7FC000: away from zero, to 1
    assert p.item() == 1.0 and mw.lost_counts() == [(1, 1)]
    p.grad = torch.ones_like(p)
    mw.step(bits=[torch.tensor([0xC000], dtype=torch.int32)])  # truncated
    assert p.item() == 1 - 2**-8


def test_stochastic_bits_come_from_the_generator_in_parameter_order():
    a, b = (torch.nn.Parameter(torch.ones(3, dtype=BF16)) for _ in range(2))
    mw = MasterWeights(torch.optim.SGD([a, b], lr=1e-3), "stochastic", generator=torch.Generator().manual_seed(7))
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    mw.step()
    g = torch.Generator().manual_seed(7)
    want = [torch.randint(0, 1 << 16, (3,), dtype=torch.int32, generator=g) for _ in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(mw.last_bits, want))


def test_state_is_stored_as_torch_keeps_it_for_the_parameter_dtype_but_fp32_keeps_float32():
    for option, dtype in (("none", BF16), ("fp32", torch.float32), ("kahan", BF16), ("stochastic", BF16)):
        p = torch.nn.Parameter(torch.ones(4, dtype=BF16))
        opt = torch.optim.NAdam([p], lr=1e-3)
        mw = MasterWeights(opt, option)
        p.grad = torch.ones_like(p)
        mw.step()
        state = opt.state[p]
        assert state["exp_avg"].dtype is dtype and state["exp_avg_sq"].dtype is dtype, option
        assert state["step"].dtype is torch.float32 and state["mu_product"].dtype is torch.float32, option
        assert p.dtype is BF16 and p.grad.dtype is BF16


@pytest.mark.parametrize("option", OPTIONS)
def test_resume_is_bit_for_bit(option):
    torch.manual_seed(0)

    def build(values):
        ps = [torch.nn.Parameter(v.clone()) for v in values]
        opt = torch.optim.AdamW(ps, lr=1e-3, foreach=True)
        return ps, MasterWeights(opt, option, generator=torch.Generator().manual_seed(3))

    values = [torch.randn(5, dtype=BF16), torch.randn((), dtype=BF16), torch.randn(0, dtype=BF16)]
    grads = [[torch.randn_like(v) for v in values] for _ in range(4)]
    ps, mw = build(values)
    for k in range(2):
        for p, g in zip(ps, grads[k]):
            p.grad = g.clone()
        mw.step()
    saved = copy.deepcopy(mw.state_dict())
    qs, other = build([p.detach() for p in ps])
    other.load_state_dict(saved)
    for k in (2, 3):
        for p, q, g in zip(ps, qs, grads[k]):
            p.grad, q.grad = g.clone(), g.clone()
        mw.step()
        other.step()
    for p, q in zip(ps, qs):
        assert bits16(p) == bits16(q)
    for p, q in zip(ps, qs):
        for key, value in mw.optimizer.state[p].items():
            assert value.dtype == other.optimizer.state[q][key].dtype and torch.equal(value, other.optimizer.state[q][key])


def test_a_checkpoint_of_another_option_or_dtype_is_refused():
    p, fp32 = sgd([1.0], 0.1, "fp32")
    _, kahan = sgd([1.0], 0.1, "kahan")
    with pytest.raises(ValueError, match="master_weights='kahan' but this run uses 'fp32'"):
        fp32.load_state_dict(kahan.state_dict())
    _, half = sgd([1.0], 0.1, "fp32", dtype=torch.float16)
    with pytest.raises(ValueError, match="stored in bfloat16 but this run's are float16"):
        half.load_state_dict(fp32.state_dict())


def test_bytes_held_are_measured_from_the_tensors():
    for option, expected in (("none", 6), ("fp32", 14), ("kahan", 8), ("stochastic", 6)):
        p = torch.nn.Parameter(torch.ones(64, 64, dtype=BF16))
        mw = MasterWeights(torch.optim.AdamW([p]), option)
        p.grad = torch.ones_like(p)
        mw.step()
        assert mw.bytes_per_parameter() == expected + 4 / 4096, option  # + the float32 step counter


def test_none_measures_lost_updates_only_when_asked_and_leaves_the_step_unchanged():
    torch.manual_seed(0)
    w, g = torch.randn(256, dtype=BF16), torch.randn(256, dtype=BF16)
    out = []
    for measure in (False, True):
        p = torch.nn.Parameter(w.clone())
        mw = MasterWeights(torch.optim.AdamW([p], lr=1e-5), "none")
        p.grad = g.clone()
        mw.step(measure_lost=measure)
        out.append((bits16(p), mw.optimizer.state[p]["exp_avg"].clone(), mw.lost_counts()))
    assert out[0][0] == out[1][0] and torch.equal(out[0][1], out[1][1])
    assert out[0][2] == [None]
    lost, counted = out[1][2][0]
    assert counted == 256 and lost > 200  # lr 1e-5 against weights of order 1: nearly all lost


@pytest.mark.parametrize("option", ["fp32", "kahan", "stochastic"])
def test_an_unmeasured_step_of_any_option_steps_as_a_measured_one_and_counts_nothing(option):
    torch.manual_seed(1)
    w, g = torch.randn(64, dtype=BF16), torch.randn(64, dtype=BF16)
    bits = [torch.randint(0, 1 << 16, (64,), dtype=torch.int32)]
    out = []
    for measure in (False, True):
        p = torch.nn.Parameter(w.clone())
        mw = MasterWeights(torch.optim.AdamW([p], lr=1e-3), option)
        p.grad = g.clone()
        mw.step(bits=bits if option == "stochastic" else None, measure_lost=measure)
        out.append((bits16(p), mw.lost_counts()))
    assert out[0][0] == out[1][0]
    assert out[0][1] == [None] and out[1][1][0] is not None


def test_bad_parameters_and_options_are_refused():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="parameter 0 .* is torch.float32"):
        MasterWeights(torch.optim.SGD([p], lr=0.1), "fp32")
    with pytest.raises(ValueError, match="one of none, fp32, kahan, stochastic"):
        sgd([1.0], 0.1, "fp64")
    with pytest.raises(ValueError, match="stochastic rounds to bfloat16 only"):
        sgd([1.0], 0.1, "stochastic", dtype=torch.float16)
    q, mw = sgd([1.0], 0.1, "stochastic")
    q.grad = torch.ones_like(q)
    with pytest.raises(ValueError, match="bits\\[0\\] must be an int32 tensor"):
        mw.step(bits=[torch.zeros(1, dtype=torch.int64)])
    assert q.item() == 1.0 and not mw.optimizer.state  # refused before anything changed
