"""Property: `reference.reductions` adds in torch's CPU order (one thread, as the suite pins).

torch's sums (``torch.sum``, ``torch.mean``) over the last dimension and over another one, and
its L2 norms (over the whole tensor, the last dimension, another dimension), float32 and float64,
for lengths around the vector widths (4, 8, 16 lanes), the ILP factor of 4 and the cascade's
level step of 16 rows and its multiples. With exact kernels every result matches bit for bit.
On native kernels (measured on AVX512) the sums still do (their vectors are 32 bytes there
too); the norms contract their multiply-adds, so each norm of ``n`` elements is held to
``n / 2 + 1`` roundings per side (`reference.optim.adafactor`'s derivation): ``|a - b| <=
(n + 2) * u * |norm|``.

Not reached here: the cascade's wider level steps (``ceil_log2(rows) // 4 > 4``, more than 2**19
lane vectors per output), which torch takes only on reductions of millions of elements.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance import expectations
from conformance.assertions import Where, assert_same
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
