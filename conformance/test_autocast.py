"""Property 7: the autocast op policy, torch against `reference.autocast`.

Every op of the table runs under ``torch.autocast(device, dtype)`` for bfloat16 and float16, from
a float32 input and from an input already in the autocast dtype, on small tensors; the output
dtype must be the table's. A torch release that moves an op between autocast's lists fails here
with the op, the device, the dtypes and the torch version, instead of silently changing which
precision a model computes in.
"""

from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from conformance.assertions import Where, assert_equal
from conformance.expectations import autocast_policy_provenance
from reference.autocast import AUTOCAST_DTYPES, OPS, SOURCES, category, output_dtype


class _Inputs:
    """Small tensors on one device: activations in the input dtype, parameters in float32."""

    def __init__(self, device: str, given: torch.dtype, low: torch.dtype) -> None:
        self._gen = torch.Generator().manual_seed(0)
        self._device, self._given, self._low = device, given, low

    def _randn(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=self._gen).to(device=self._device, dtype=dtype)

    def x(self, *shape: int) -> torch.Tensor:
        """An operand that carries the input dtype."""
        return self._randn(shape, self._given)

    def low(self, *shape: int) -> torch.Tensor:
        """An operand in the autocast dtype, as an earlier autocast op would produce."""
        return self._randn(shape, self._low)

    def param(self, *shape: int) -> torch.Tensor:
        return self._randn(shape, torch.float32)

    def positive(self, *shape: int) -> torch.Tensor:
        return self.x(*shape).abs() + 1

    def labels(self, *values: int) -> torch.Tensor:
        return torch.tensor(values, device=self._device)


# The calls OPS describes, operand for operand.
CALLS: dict[str, Callable[[_Inputs], torch.Tensor]] = {
    "linear": lambda t: F.linear(t.x(2, 4), t.param(3, 4), t.param(3)),
    "matmul": lambda t: torch.matmul(t.x(2, 4), t.x(4, 3)),
    "mm": lambda t: torch.mm(t.x(2, 4), t.x(4, 3)),
    "bmm": lambda t: torch.bmm(t.x(2, 2, 4), t.x(2, 4, 3)),
    "addmm": lambda t: torch.addmm(t.x(2, 3), t.x(2, 4), t.x(4, 3)),
    "baddbmm": lambda t: torch.baddbmm(t.x(2, 2, 3), t.x(2, 2, 4), t.x(2, 4, 3)),
    "conv1d": lambda t: F.conv1d(t.x(1, 2, 5), t.param(3, 2, 3), t.param(3)),
    "conv2d": lambda t: F.conv2d(t.x(1, 2, 5, 5), t.param(3, 2, 3, 3), t.param(3)),
    "scaled_dot_product_attention": lambda t: F.scaled_dot_product_attention(
        t.x(1, 2, 4, 8), t.x(1, 2, 4, 8), t.x(1, 2, 4, 8)),
    "softmax": lambda t: torch.softmax(t.x(2, 4), dim=-1),
    "log_softmax": lambda t: F.log_softmax(t.x(2, 4), dim=-1),
    "layer_norm": lambda t: F.layer_norm(t.x(2, 4), (4,), t.param(4), t.param(4)),
    "group_norm": lambda t: F.group_norm(t.x(2, 4, 3), 2, t.param(4), t.param(4)),
    "batch_norm": lambda t: F.batch_norm(
        t.x(2, 4, 3), t.param(4), t.param(4).abs(), t.param(4), t.param(4), training=True),
    "sum": lambda t: t.x(2, 4).sum(),
    "mean": lambda t: t.x(2, 4).mean(),
    "prod": lambda t: t.x(2, 4).prod(),
    "vector_norm": lambda t: torch.linalg.vector_norm(t.x(2, 4)),
    "logsumexp": lambda t: torch.logsumexp(t.x(2, 4), dim=-1),
    "exp": lambda t: torch.exp(t.x(2, 4)),
    "log": lambda t: torch.log(t.positive(2, 4)),
    "pow": lambda t: torch.pow(t.x(2, 4), 2),
    "relu": lambda t: F.relu(t.x(2, 4)),
    "gelu": lambda t: F.gelu(t.x(2, 4)),
    "tanh": lambda t: torch.tanh(t.x(2, 4)),
    "dropout": lambda t: F.dropout(t.x(2, 4), 0.5, training=True),
    "embedding": lambda t: F.embedding(t.labels(0, 2), t.x(3, 4)),
    "cross_entropy": lambda t: F.cross_entropy(t.x(2, 4), t.labels(0, 3)),
    "nll_loss": lambda t: F.nll_loss(t.x(2, 4), t.labels(0, 3)),
    "mse_loss": lambda t: F.mse_loss(t.x(2, 4), t.x(2, 4)),
    "binary_cross_entropy_with_logits": lambda t: F.binary_cross_entropy_with_logits(
        t.x(2, 4), torch.sigmoid(t.x(2, 4))),
    "cat": lambda t: torch.cat([t.x(2, 4), t.low(2, 4)]),
    "stack": lambda t: torch.stack([t.x(2, 4), t.low(2, 4)]),
    "add": lambda t: t.x(2, 4) + t.low(2, 4),
    "mul": lambda t: t.x(2, 4) * t.low(2, 4),
    "addcmul": lambda t: torch.addcmul(t.x(2, 4), t.low(2, 4), t.x(2, 4)),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def test_the_suite_calls_exactly_the_ops_of_the_table():
    assert_equal(sorted(CALLS), sorted(OPS), Where("autocast policy", field="ops called by the suite"))


@pytest.mark.parametrize("given", ["float32", "low"], ids=["from_float32", "from_low"])
@pytest.mark.parametrize("low", AUTOCAST_DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_output_dtype_matches_the_table(request, device, op, low, given):
    given_name = low if given == "low" else given
    expected = output_dtype(op, device, low, given_name)
    where = Where(
        f"autocast policy on torch {torch.__version__} ({autocast_policy_provenance(device)}; "
        f"table {SOURCES[device]}). If torch changed the policy on purpose, move the op in "
        f"reference/autocast.py POLICY and record the version in conformance/expectations.py",
        field=f"{device} autocast({low}) {op} from {given_name} input, category "
              f"{category(op, device)}: output dtype",
        repro=f"pytest '{request.node.nodeid}'",
    )
    inputs = _Inputs(device, _DTYPES[given_name], _DTYPES[low])
    with warnings.catch_warnings():
        # A device that cannot autocast to this dtype warns and disables autocast: fail instead.
        warnings.filterwarnings("error", message=".*autocast")
        with torch.autocast(device, dtype=_DTYPES[low]):
            assert_equal(torch.is_autocast_enabled(device), True, where.at("autocast enabled"))
            out = CALLS[op](inputs)
    assert_equal(_name(out.dtype), expected, where)
