"""``torchimpl.doctor.batch``: a step's statistics in few passes equal the per-tensor rules bit for bit.

Each test builds pairs the doctor meets (16-bit mixed tensors beside float32 shadows, transposed
layouts, zeros, values that flush, overflow or are non-finite, exact powers of two, subnormal
gradients, shapes that differ, empty tensors) and compares every number of ``forward_batch``,
``backward_batch``, ``param_batch`` and ``grad_batch`` with ``stats.forward_numbers``,
``stats.backward_numbers`` and ``torchimpl.precision.health`` on the same tensors: equality, no
tolerance (the batched sums run over the same values in the same order).
"""

from __future__ import annotations

import math

import pytest
import torch

from torchimpl.doctor import batch
from torchimpl.doctor.stats import backward_numbers, forward_numbers
from torchimpl.precision import health

LOW = (torch.float16, torch.bfloat16)


def _same(a: object, b: object) -> bool:
    """Equality that holds NaN equal to NaN and tells -0.0 from 0.0 (the report would)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _assert_same(got: object, want: object, what: str) -> None:
    for field in want.__dataclass_fields__:  # type: ignore[attr-defined]
        g, w = getattr(got, field), getattr(want, field)
        assert _same(g, w), f"{what}: field {field!r}: batched {g!r}, per tensor {w!r}"


def _shadow(g: torch.Generator, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    """A float32 tensor of one of the kinds the doctor meets."""
    x = torch.randn(shape, generator=g)
    if kind == "relu":
        x = x.clamp_min(0)
    elif kind == "tiny":  # flushes in float16, some of it at a loss scale too
        x = x * 1e-7
    elif kind == "huge":  # one value just past float16's max (65504, rounding up from 65520)
        x = x * 1e4
        x.view(-1)[1] = 7e4
    elif kind == "powers":  # exact powers of two, where rule 10's low steps
        x = torch.sign(x) * torch.exp2(torch.randint(-30, 10, shape, generator=g).float())
    elif kind == "subnormal":  # float32 subnormals: the scale range's exact path
        x = x * 1e-40
    elif kind == "nonfinite":
        x.view(-1)[0] = math.inf
        x.view(-1)[-1] = math.nan
    elif kind == "zeros":
        x = torch.zeros(shape)
    return x


KINDS = ("normal", "relu", "tiny", "huge", "powers", "subnormal", "nonfinite", "zeros")


SHAPES = [(4, 6, 8), (8, 16, 256)]
"""A small tensor and one of a module output's size, where torch's float64 sums run vectorised
and in blocks: the order the batched sums must keep."""


def _pairs(seed: int, transpose: bool, shape: tuple[int, ...] = SHAPES[0]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for kind in KINDS:
        s = _shadow(g, shape, kind)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            m = s.to(dtype)
            if kind == "normal":  # the mixed run differs from the shadow by more than its rounding
                m = (s + 0.01 * torch.randn(s.shape, generator=g)).to(dtype)
            if kind == "huge":  # a mixed run that saturates: finite, while the shadow is past the max
                m = s.clamp(-6e4, 6e4).to(dtype)
            out.append((m.transpose(0, 1), s.transpose(0, 1)) if transpose else (m, s))
            # transposed: a module that returns a view (attention with batch_first)
    out.append((torch.ones(3, dtype=torch.float16), torch.ones(4)))  # shapes that differ
    out.append((torch.ones(0, 5, dtype=torch.float16), torch.ones(0, 5)))  # empty
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_forward_batch_equals_the_per_tensor_numbers(seed: int, transpose: bool, shape: tuple[int, ...]) -> None:
    pairs = _pairs(seed, transpose, shape)
    for j, (got, (m, s)) in enumerate(zip(batch.forward_batch(pairs), pairs)):
        _assert_same(got, forward_numbers(m, s), f"pair {j} ({m.dtype}, {KINDS[j // 3] if j < 3 * len(KINDS) else 'odd'})")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [1.0, 2.0**16, 2.0**-3])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_backward_batch_equals_the_per_tensor_numbers(seed: int, transpose: bool, scale: float,
                                                      shape: tuple[int, ...]) -> None:
    pairs = [((s * scale).to(m.dtype), s) for m, s in _pairs(seed, transpose, shape)]
    for keep in (0.999, 0.5, 1.0):
        got = batch.backward_batch(pairs, scale, keep)
        for j, (n, (m, s)) in enumerate(zip(got, pairs)):
            _assert_same(n, backward_numbers(m, s, scale, keep), f"pair {j} ({m.dtype}), scale {scale}, keep {keep}")


def test_one_scratch_serves_every_pair_and_step_of_a_run() -> None:
    """The run's buffers (``batch.Scratch``), reused by pairs of every size and dtype and by the
    forward and backward statistics of step after step, give the per-tensor numbers: a step of
    module-sized pairs, then one of small pairs (reading the start of each buffer, the rest
    holding the earlier step's values), then module-sized again."""
    scratch, keyed = batch.Scratch(), 0
    for step, shape in enumerate((SHAPES[1], SHAPES[0], SHAPES[1])):
        pairs = _pairs(10 + step, False, shape)
        keyed = max(keyed, sum(s.numel() for m, s in pairs if m.dtype in LOW and s.dtype == torch.float32))
        for j, (got, (m, s)) in enumerate(zip(batch.forward_batch(pairs, scratch), pairs)):
            _assert_same(got, forward_numbers(m, s), f"step {step}, output pair {j} ({m.dtype})")
        grads = [((s * 2.0**12).to(m.dtype), s) for m, s in pairs]
        for j, (got, (m, s)) in enumerate(zip(batch.backward_batch(grads, 2.0**12, 0.999, scratch), grads)):
            _assert_same(got, backward_numbers(m, s, 2.0**12, 0.999), f"step {step}, gradient pair {j} ({m.dtype})")
    sizes = {key: buf.numel() for key, buf in scratch._buffers.items()}
    keys = sizes.pop(("keys", torch.float32, torch.device("cpu")))  # a step's 16-bit gradients' |g| together
    assert sizes and max(sizes.values()) == math.prod(SHAPES[1]) and keys == keyed, (sizes, keys)  # grown once


def test_a_buffer_view_is_made_once_per_size_and_follows_the_buffer_when_it_grows() -> None:
    """``Scratch.get``'s views: the same view for the same (use, size, dtype, device); after the
    buffer grows, the views of every size are views of the new buffer (the statistics write into
    them, and the old buffer is freed)."""
    scratch, cpu = batch.Scratch(), torch.device("cpu")
    small = scratch.get("r", 3, torch.float64, cpu)
    assert scratch.get("r", 3, torch.float64, cpu) is small
    assert scratch.get("r", 3, torch.float32, cpu) is not small and scratch.get("d", 3, torch.float64, cpu) is not small
    big = scratch.get("r", 10, torch.float64, cpu)
    again = scratch.get("r", 3, torch.float64, cpu)
    assert again.numel() == 3 and again.data_ptr() == big.data_ptr() == scratch._buffers["r", torch.float64, cpu].data_ptr()
    again.fill_(7.0)
    assert big[:3].tolist() == [7.0] * 3


def test_the_scale_range_key_at_every_binade_edge() -> None:
    """Rule 5's key against ``health.scale_range`` where ``low`` steps: for each needed-th
    largest value at 2^k, just below and just above it."""
    for dtype in LOW:
        for k in range(-125, 20, 7):
            edge = math.ldexp(1.0, k)
            for t in (edge, math.nextafter(edge, 0), math.nextafter(edge, math.inf)):
                g = torch.tensor([t] * 3 + [2.0 * t] * 997, dtype=torch.float32)
                g = g[torch.randperm(g.numel(), generator=torch.Generator().manual_seed(k))]
                m = (g * 8).to(dtype)
                (got,) = batch.backward_batch([(m, g)], 8.0, 0.999)
                assert got.scale_range == health.scale_range(g, dtype, 0.999), f"{dtype}, needed-th largest {t!r}"


@pytest.mark.parametrize("n", [32999, 1000])
def test_the_needed_count_is_the_float64_ceiling_of_keep_n(n: int) -> None:
    """Rule 5's needed = ceil(keep n) as ``health.scale_range`` computes it, in float64: for 32999
    non-zero entries at keep 0.999 a float32 product gives 32966, float64 32967. The needed-th
    smallest entries are tiny, the next one 1.0: a count off by one moves ``low`` by 10."""
    needed = math.ceil(0.999 * n)
    g = torch.ones(n)
    g[:n - needed + 1] = 2.0**-10
    g = g[torch.randperm(n, generator=torch.Generator().manual_seed(n))].reshape(1, n)
    for dtype in LOW:
        (got,) = batch.backward_batch([(g.to(dtype), g)], 1.0, 0.999)
        assert got.scale_range == health.scale_range(g, dtype, 0.999) == \
            health.ScaleRange(health.scale_range(torch.tensor([2.0**-10]), dtype).low, got.scale_range.high)


def test_param_batch_equals_applied_lost_count() -> None:
    g = torch.Generator().manual_seed(0)
    stored = [torch.randn(5, 7, generator=g).to(d) for d in (torch.bfloat16, torch.float32, torch.float16)]
    update = [torch.randn(5, 7, generator=g) * 1e-4 for _ in stored]
    update[1][0, 0] = math.inf  # a non-finite exact update: counted out, tensor by tensor
    update[2][1] = 0.0
    after = [(b.float() + u).to(b.dtype) for b, u in zip(stored, update)]
    after[0].view(-1)[3] = -after[0].view(-1)[3] if after[0].view(-1)[3] == 0 else after[0].view(-1)[3]
    got = batch.param_batch(stored, after, update)
    assert got == [health.applied_lost_count(b, a, u) for b, a, u in zip(stored, after, update)]
    signed_zero = [torch.tensor([0.0, 1.0])], [torch.tensor([-0.0, 1.0])], [torch.tensor([1e-3, 1e-3])]
    assert batch.param_batch(*signed_zero) == [health.applied_lost_count(*(t[0] for t in signed_zero))] == [(1, 2)]


def test_grad_batch_equals_flushed_count_and_says_whether_finite() -> None:
    g = torch.Generator().manual_seed(1)
    shadow = [torch.randn(6, 4, generator=g) * 1e-6, torch.randn(3, generator=g), torch.randn(2, 2, generator=g)]
    mixed = [s.to(torch.float16).float() for s in shadow]
    finite, counts = batch.grad_batch(mixed, [shadow[0], None, shadow[2]])
    assert finite and counts == [health.flushed_count(shadow[0], mixed[0]), None, health.flushed_count(shadow[2], mixed[2])]
    mixed[1][0] = math.inf  # a gradient without a shadow twin still decides whether the step is finite
    mixed[2][0, 0] = math.nan
    finite, counts = batch.grad_batch(mixed, [shadow[0], None, shadow[2]])
    assert not finite and counts[2] == health.flushed_count(shadow[2], mixed[2])


@pytest.mark.parametrize("empty_at", [0, 2, 4])
def test_parameter_counts_with_empty_parameters_anywhere(empty_at: int) -> None:
    """``grad_batch`` and ``param_batch`` count each parameter's segment of the joined tensors
    (on a CPU in one sum per joined tensor): an empty parameter first, between others or last
    counts nothing and shifts no other parameter's counts."""
    g = torch.Generator().manual_seed(empty_at)
    shadow = [torch.randn(n, generator=g) * 1e-6 for n in (7, 300, 5, 64)]
    shadow.insert(empty_at, torch.ones(0))
    mixed = [s.to(torch.bfloat16).float() for s in shadow]
    finite, counts = batch.grad_batch(mixed, shadow)
    assert finite and counts == [health.flushed_count(s, m) for s, m in zip(shadow, mixed)]
    stored = [s.to(torch.bfloat16) for s in shadow]
    update = [s * 1e-3 for s in shadow]
    after = [(b.float() + u).to(torch.bfloat16) for b, u in zip(stored, update)]
    assert batch.param_batch(stored, after, update) == [health.applied_lost_count(*t) for t in zip(stored, after, update)]


@pytest.mark.parametrize("torchs", [True, False])
def test_joined_tensors_are_each_flat_in_logical_order(torchs: bool, monkeypatch) -> None:
    """``_flat_cat`` (torch's flatten_dense_tensors, or its fallback): transposed, 0-dim, empty
    and parameter (requires_grad) tensors, flat in logical order, joined, no graph."""
    if not torchs:
        monkeypatch.setattr(batch, "_flatten_dense_tensors", None)
    ts = [torch.randn(3, 4).t(), torch.tensor(2.5), torch.ones(0, 3), torch.nn.Parameter(torch.randn(2, 2))]
    got = batch._flat_cat(ts)
    assert not got.requires_grad and torch.equal(got, torch.cat([t.detach().reshape(-1) for t in ts]))
    assert torch.equal(batch._flat_cat(ts[:1]), ts[0].reshape(-1))
