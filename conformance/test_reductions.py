"""Property: `reference.reductions` adds in torch's CPU order (one thread, as the suite pins).

torch's sums (``torch.sum``, ``torch.mean``) over the last dimension and over another one, and
its L2 norms (over the whole tensor, the last dimension, another dimension), float32 and float64,
for lengths around the vector widths (4, 8, 16 lanes), the ILP factor of 4 and the cascade's
level step of 16 rows and its multiples. With exact kernels every result matches bit for bit.
On native kernels (measured on AVX512) the sums still do (their vectors are 32 bytes there
too); the norms contract their multiply-adds, so each norm of ``n`` elements is held to
``n / 2 + 1`` roundings per side (`reference.optim.adafactor`'s derivation): ``|a - b| <=
(n + 2) * u * |norm|``.

bfloat16 and float16 norms and means (rules 11-12) are exact on every capability (float32
accumulators of exact squares, one rounding to S). A random sum rarely lies close enough to an
S rounding boundary for the order of its float32 additions to show, so their cases are crafted:
the exact sum lies within a few float32 roundings of the boundary between two S values of the
result, and only the right order lands on torch's side of it. Mutants killed (measured): the
bfloat16 norm summed in order (no lanes) or with blocks of 8, the float16 norm with bfloat16's
lanes, the float32 sum rounded to S before the root, the mean summed in order.

Not reached here: the cascade's wider level steps (``ceil_log2(rows) // 4 > 4``, more than 2**19
lane vectors per output), which torch takes only on reductions of millions of elements.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance import expectations
from conformance.assertions import Where, assert_same
from conformance.bridge import to_numpy, to_torch
from reference import reductions

REPRO = "rerun this test with the @reproduce_failure blob printed above"
# Lane counts, the ILP factor, the level step and their products, each +-1.
EDGES = sorted({k + d for k in (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096) for d in (-1, 0, 1) if k + d > 0})


def lengths() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(EDGES), st.integers(1, 5000))


@st.composite
def reduction_case(draw) -> tuple[np.ndarray, int]:
    """An array of 1 to 3 dimensions, one of them long, and the dimension reduced."""
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    ndim = draw(st.integers(1, 3))
    long_dim = draw(st.integers(0, ndim - 1))
    shape = tuple(draw(lengths()) if i == long_dim else draw(st.sampled_from([1, 2, 3, 5, 8, 17, 33]))
                  for i in range(ndim))
    axis = draw(st.integers(-ndim, -1))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = np.exp(rng.uniform(-8, 8, shape)) if draw(st.booleans()) else 1.0
    return np.asarray(rng.standard_normal(shape) * scale, dtype=dtype), axis


def _norm_close(got: np.ndarray, want: np.ndarray, n: int, where: Where) -> None:
    u = float(np.finfo(want.dtype).eps) / 2
    bad = np.abs(got.astype(np.float64) - want) > (n + 2) * u * np.abs(want.astype(np.float64))
    assert not bad.any(), f"{where.header()}: {int(bad.sum())} norms beyond {n + 2} roundings\n{where.footer()}"


@given(case=reduction_case())
def test_sums_and_norms_follow_torchs_order(case, device):
    x, axis = case
    t = torch.from_numpy(x).to(device)
    exact = expectations.exact_kernels(device)
    where = Where("reductions", step=0, repro=REPRO)
    assert_same(torch.sum(t, dim=axis, keepdim=True).cpu().numpy(), reductions.sum_along(x, axis),
                where.at(f"sum over dim {axis} of {x.dtype}{list(x.shape)}"))
    assert_same(torch.mean(t, dim=axis, keepdim=True).cpu().numpy(), reductions.mean(x, axis),
                where.at(f"mean over dim {axis} of {x.dtype}{list(x.shape)}"))
    for dim, n in ((axis, x.shape[axis]), (None, x.size)):
        got = (torch.linalg.vector_norm(t, 2) if dim is None else torch.norm(t, dim=dim, keepdim=True)).cpu().numpy()
        want = reductions.norm2(x, dim)
        label = where.at(f"norm over {'all' if dim is None else f'dim {dim}'} of {x.dtype}{list(x.shape)}")
        if exact:
            assert_same(got, want, label)
        else:
            _norm_close(got, want, n, label)


def test_outer_sums_group_their_outputs_as_torch_does(device):
    """Rule 8's grouping of the outputs (whole groups of 4L by plain cascades, then L and the
    rest by row sums), on every width where the groups change, against torch's sum over dim -2."""
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        for n in (5, 17, 64, 129):
            for inner in (3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65):
                x = np.asarray(rng.standard_normal((2, n, inner)) * np.exp(rng.uniform(-8, 8, (2, n, inner))), dtype)
                got = torch.sum(torch.from_numpy(x).to(device), dim=-2, keepdim=True).cpu().numpy()
                assert_same(got, reductions.sum_along(x, -2),
                            Where("reductions", step=0, field=f"sum over dim -2 of {np.dtype(dtype)}[2, {n}, {inner}]",
                                  repro="python -m pytest conformance/test_reductions.py -k outer"))


BF16, F16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)


def _near_boundary(rng: np.random.Generator, dtype: np.dtype, n: int, power: int, target: float) -> np.ndarray:
    """``n`` S values in a random order whose exact sum of ``x ** power`` lies within a few float32
    roundings of ``target``: ``n - 4`` random ones spanning 2**12 in magnitude (so that float32
    partial sums round), then up to four corrections, each the largest S value not past what remains."""
    q = lambda v: float(np.asarray(v, np.float64).astype(dtype))  # noqa: E731  (RNE to S)
    budget = target * 0.98
    x = rng.uniform(0.5, 1.0, n - 4) * np.exp2(rng.integers(-12, 0, n - 4))
    x = np.array([q(v) for v in x * (budget / max(float(np.sum(x ** power)), 1e-300)) ** (1 / power)])
    rest, fixes = target - float(np.sum(x ** power)), []
    for _ in range(4):
        c = q(max(rest, 0.0) ** (1 / power))
        if c ** power > rest:
            c = float(np.nextafter(np.asarray(c, dtype), np.asarray(0, dtype)))
        fixes.append(max(c, 0.0))
        rest -= fixes[-1] ** power
    out = np.concatenate([x, fixes])
    rng.shuffle(out)
    return out.astype(dtype)


def _midpoint(rng: np.random.Generator, dtype: np.dtype) -> float:
    """A point halfway between two adjacent S values in [1, 2)."""
    a = float(np.asarray(rng.uniform(1, 1.9)).astype(dtype))
    return a + float(np.spacing(np.asarray(a, dtype)).astype(np.float64)) / 2


@given(dtype=st.sampled_from([BF16, F16]), n=st.sampled_from([5, 8, 15, 16, 17, 31, 32, 33, 100, 600, 2000]),
       rows=st.integers(1, 3), layout=st.sampled_from(["all", "last", "other", "trailing one"]),
       seed=st.integers(0, 2**32 - 1))
def test_16_bit_norms_follow_torchs_order(dtype, n, rows, layout, seed, device):
    """Rule 11: ``torch.linalg.vector_norm`` of bfloat16/float16 tensors, bit for bit on every
    capability, each row's sum of squares crafted to lie at an S rounding boundary of its root:
    over the whole tensor, the last dimension, another one (``(n, rows)`` over dim 0) and a
    dimension followed by one of length 1 (a contiguous run)."""
    if device != "cpu":
        pytest.skip("rule 11 states the CPU kernels")
    rng = np.random.default_rng(seed)
    x = np.stack([_near_boundary(rng, dtype, n, 2, _midpoint(rng, dtype) ** 2) for _ in range(rows)])
    axis = {"all": None, "last": -1, "other": 0, "trailing one": 1}[layout]
    x = {"all": x[0], "last": x, "other": np.ascontiguousarray(x.T), "trailing one": x[..., None]}[layout]
    t = to_torch(x)
    got = to_numpy(torch.linalg.vector_norm(t, 2) if axis is None else torch.norm(t, dim=axis, keepdim=True))
    assert_same(got, reductions.norm2_16(x, axis),
                Where("reductions", step=0, field=f"norm over {layout} of {dtype}{list(x.shape)}", repro=REPRO))


@given(dtype=st.sampled_from([BF16, F16]), n=st.sampled_from([8, 16, 32, 64, 128, 512, 2048]),
       rows=st.integers(1, 2), seed=st.integers(0, 2**32 - 1))
def test_16_bit_means_follow_torchs_order(dtype, n, rows, seed, device):
    """Rule 12: ``torch.mean`` over dim -2 of a bfloat16/float16 ``(rows, n, 1)`` tensor
    (Adafactor's mean of ``row_var``), bit for bit, each sum crafted to lie at ``n`` times an S
    rounding boundary (``n`` a power of two: the division is exact)."""
    if device != "cpu":
        pytest.skip("rule 12 states the CPU kernels")
    rng = np.random.default_rng(seed)
    x = np.stack([_near_boundary(rng, dtype, n, 1, _midpoint(rng, dtype) * n) for _ in range(rows)])[..., None]
    got = to_numpy(torch.mean(to_torch(x), dim=-2, keepdim=True))
    assert_same(got, reductions.mean_16(x, -2),
                Where("reductions", step=0, field=f"mean over dim -2 of {dtype}{list(x.shape)}", repro=REPRO))
