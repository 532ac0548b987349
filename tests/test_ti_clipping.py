"""torchimpl.train.clipping: the total norm and the coefficient, bit for bit against torch's."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchimpl.train.clipping import clip_coefficient, foreach_total_norm, group_by_device_and_dtype

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _case(seed: int, missing: float = 0.0) -> list[nn.Parameter]:
    """Two to eight parameters of random dtypes, sizes and magnitudes, each with a gradient
    except for a ``missing`` share of them."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (), generator=g))
    params = []
    for i in torch.randint(0, len(DTYPES), (n,), generator=g).tolist():
        p = nn.Parameter(torch.zeros(int(torch.randint(1, 50, (), generator=g)), dtype=DTYPES[i]))
        scale = 10.0 ** int(torch.randint(-3, 4, (), generator=g))
        grad = (torch.randn(p.shape, generator=g, dtype=torch.float64) * scale).to(p.dtype)
        p.grad = None if float(torch.rand((), generator=g)) < missing else grad
        params.append(p)
    return params


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and (torch.equal(a, b) or bool(a.isnan() and b.isnan()))


def _first_seen_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The total with the groups' norms stacked in first-seen order (not torch's)."""
    norms = [n for g in group_by_device_and_dtype(params)
             for n in torch._foreach_norm([p.grad for p in g.params], 2.0)]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


@pytest.mark.parametrize("missing", [0.0, 0.3])
def test_the_total_norm_is_get_total_norms_bit_for_bit(missing):
    order_matters = 0
    for seed in range(200):
        params = _case(seed, missing)
        grads = [p.grad for p in params if p.grad is not None]
        norm = foreach_total_norm(group_by_device_and_dtype(params), params)
        assert norm is not None
        want = torch.nn.utils.get_total_norm(grads, 2.0)
        assert _same(norm(grads), want), (seed, [p.dtype for p in params], norm(grads), want)
        if missing == 0.0 and not _same(_first_seen_norm(params), want):
            order_matters += 1
    # The cases tell the orders apart: the groups stacked in first-seen order would fail.
    assert missing or order_matters >= 10, order_matters


def test_the_total_norm_of_one_group_and_of_no_gradient():
    params = [nn.Parameter(torch.zeros(5)) for _ in range(3)]
    norm = foreach_total_norm(group_by_device_and_dtype(params), params)
    assert _same(norm([]), torch.nn.utils.get_total_norm([]))
    params[0].grad, params[2].grad = torch.tensor([3.0, 4.0, 0, 0, 0]), torch.full((5,), math.inf)
    grads = [params[0].grad]
    assert _same(norm(grads), torch.tensor(5.0))
    grads.append(params[2].grad)
    assert _same(norm(grads), torch.nn.utils.get_total_norm(grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_coefficient_is_torchs_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(5)
    values = (torch.rand(2000, generator=g, dtype=torch.float64) * 40 - 20).exp2().tolist()
    values += [0.0, 1e-6, 1.0, 0.7, 2.0**-140, 1e30, math.inf, math.nan]
    for max_norm in (1.0, 0.5, 0.3, 7.0):
        for v in values:
            norm = torch.tensor(v, dtype=dtype)
            want = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's clip_grad_norm_
            got = clip_coefficient(norm, max_norm)
            assert _same(got, want), (dtype, max_norm, v, got, want)
            assert got is not norm and _same(norm, torch.tensor(v, dtype=dtype)), "the norm was changed"
