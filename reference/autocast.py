"""The autocast op policy as data: which dtype an operation's output has under autocast.

Rules:

1. Under ``torch.autocast(device_type, dtype=low)`` with ``low`` in bfloat16 or float16, every
   operation in ``OPS`` falls in one of four categories, per device type (``POLICY``):
   ``lower``, ``float32``, ``passthrough`` or ``promote``.
2. ``lower``: autocast casts the floating inputs to ``low`` and runs the op there; the output is
   ``low`` whatever the input dtype (matmuls, convolutions, attention).
3. ``float32``: autocast casts the floating inputs to float32; the output is float32 whatever the
   input dtype (ops that overflow or lose too much in 16 bits: losses, and on CUDA also
   exponentials, reductions and normalizations). An explicit ``dtype=`` argument (``softmax(x, -1,
   dtype=...)``, ``sum(dtype=...)``) wins over this; the table covers calls without one.
4. ``passthrough``: autocast leaves the op alone; the output has the input's dtype. Parameters of
   the op (normalization weights, biases, running statistics) are float32, as a model's parameters
   are under autocast, and the mixed-dtype kernels return the activation's dtype.
5. ``promote``: ops of several floating operands. One operand has the input dtype, the other the
   autocast dtype (a float32 residual stream meeting an autocast output); the output is the wider:
   float32 unless both are ``low``. Autocast's promote list (``cat``, ``stack`` on CPU;
   ``addcmul`` on CUDA) and ordinary type promotion (``add``, ``mul``) give the same dtype, so the
   table does not tell them apart.
6. The input dtype is float32 or the autocast dtype. Mixing the two 16-bit dtypes is outside the
   table: on CPU, ``cat`` and ``stack`` of a bfloat16 and a float16 tensor under autocast raise.
7. CPU and CUDA differ. CPU's float32 list holds the losses and ``prod``; ``softmax``,
   ``log_softmax``, ``layer_norm``, ``group_norm``, ``sum``, ``vector_norm``, ``logsumexp``,
   ``exp``, ``log`` and ``pow`` pass through there, so they keep a 16-bit input's dtype, while
   CUDA runs them in float32. ``lower`` and ``promote`` agree on both; bfloat16 and float16 follow
   the same table on each device.
8. Provenance (``SOURCES``): the CPU table was measured with torch 2.13 (CPU build) for bfloat16
   and float16 autocast and both input dtypes. The CUDA table is taken from PyTorch's documented
   lists ("CUDA Ops that can autocast to float16 / float32 / promote", and the op lists of
   ``aten/src/ATen/autocast_mode.h`` for ``scaled_dot_product_attention``, ``logsumexp`` and
   ``linalg_vector_norm``, which the documentation page does not list); it is checked on a GPU by
   the conformance suite.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from reference import formats

DEVICE_TYPES = ("cpu", "cuda")
AUTOCAST_DTYPES = ("bfloat16", "float16")
CATEGORIES = ("lower", "float32", "passthrough", "promote")

# Each op with the call it stands for and which operands carry the input dtype; tensors not named
# as carrying it are float32 parameters or integer indices/targets.
OPS: Mapping[str, str] = MappingProxyType({
    "linear": "F.linear(x, weight, bias): x",
    "matmul": "torch.matmul(a, b): a and b",
    "mm": "torch.mm(a, b): a and b",
    "bmm": "torch.bmm(a, b): a and b",
    "addmm": "torch.addmm(c, a, b): c, a and b",
    "baddbmm": "torch.baddbmm(c, a, b): c, a and b",
    "conv1d": "F.conv1d(x, weight, bias): x",
    "conv2d": "F.conv2d(x, weight, bias): x",
    "scaled_dot_product_attention": "F.scaled_dot_product_attention(q, k, v): q, k and v",
    "softmax": "torch.softmax(x, dim=-1): x",
    "log_softmax": "F.log_softmax(x, dim=-1): x",
    "layer_norm": "F.layer_norm(x, shape, weight, bias): x",
    "group_norm": "F.group_norm(x, groups, weight, bias): x",
    "batch_norm": "F.batch_norm(x, running_mean, running_var, weight, bias, training=True): x",
    "sum": "x.sum(): x",
    "mean": "x.mean(): x",
    "prod": "x.prod(): x",
    "vector_norm": "torch.linalg.vector_norm(x): x",
    "logsumexp": "torch.logsumexp(x, dim=-1): x",
    "exp": "torch.exp(x): x",
    "log": "torch.log(x): x",
    "pow": "torch.pow(x, 2): x",
    "relu": "F.relu(x): x",
    "gelu": "F.gelu(x): x",
    "tanh": "torch.tanh(x): x",
    "dropout": "F.dropout(x, p, training=True): x",
    "embedding": "F.embedding(indices, table): the table",
    "cross_entropy": "F.cross_entropy(logits, int64 target): logits",
    "nll_loss": "F.nll_loss(log_probs, int64 target): log_probs",
    "mse_loss": "F.mse_loss(x, target): x and target",
    "binary_cross_entropy_with_logits": "F.binary_cross_entropy_with_logits(x, target): x and target",
    "cat": "torch.cat([x, y]): x; y has the autocast dtype",
    "stack": "torch.stack([x, y]): x; y has the autocast dtype",
    "add": "x + y: x; y has the autocast dtype",
    "mul": "x * y: x; y has the autocast dtype",
    "addcmul": "torch.addcmul(x, y, z): x and z; y has the autocast dtype",
})

_LOWER = ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d",
          "scaled_dot_product_attention")
_PROMOTE = ("cat", "stack", "add", "mul", "addcmul")
_LOSSES = ("cross_entropy", "nll_loss", "mse_loss", "binary_cross_entropy_with_logits")
# Ops CPU autocast passes through but CUDA autocast runs in float32 (rule 7).
_FLOAT32_ON_CUDA_ONLY = ("softmax", "log_softmax", "layer_norm", "group_norm", "sum",
                         "vector_norm", "logsumexp", "exp", "log", "pow")
_PASSTHROUGH_EVERYWHERE = ("batch_norm", "mean", "relu", "gelu", "tanh", "dropout", "embedding")


def _by_op(groups: Mapping[str, tuple[str, ...]]) -> Mapping[str, str]:
    return MappingProxyType({op: category for category, ops in groups.items() for op in ops})


POLICY: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "cpu": _by_op({
        "lower": _LOWER,
        "float32": _LOSSES + ("prod",),
        "passthrough": _FLOAT32_ON_CUDA_ONLY + _PASSTHROUGH_EVERYWHERE,
        "promote": _PROMOTE,
    }),
    "cuda": _by_op({
        "lower": _LOWER,
        "float32": _LOSSES + ("prod",) + _FLOAT32_ON_CUDA_ONLY,
        "passthrough": _PASSTHROUGH_EVERYWHERE,
        "promote": _PROMOTE,
    }),
})

SOURCES: Mapping[str, str] = MappingProxyType({
    "cpu": "measured with torch 2.13 (CPU build), bfloat16 and float16 autocast, float32 and 16-bit inputs",
    "cuda": "from PyTorch's documented autocast op lists (and aten/src/ATen/autocast_mode.h), "
            "checked on a GPU by the conformance suite",
})


def _dtype_name(value: str, argument: str, allowed: tuple[str, ...]) -> str:
    try:
        name = formats.get_format(value).name
    except ValueError:
        name = None
    if name not in allowed:
        raise ValueError(f"{argument} must be one of {', '.join(allowed)} (or an alias), got {value!r}")
    return name


def category(op: str, device_type: str) -> str:
    """The category (``lower``, ``float32``, ``passthrough``, ``promote``) of ``op`` on ``device_type``.

    Unknown ops or device types raise ValueError naming them and listing the known ones.
    """
    if device_type not in POLICY:
        raise ValueError(f"device_type must be one of {', '.join(DEVICE_TYPES)}, got {device_type!r}")
    if op not in OPS:
        raise ValueError(f"op {op!r} is not in the autocast table; known ops: {', '.join(OPS)}")
    return POLICY[device_type][op]


def output_dtype(op: str, device_type: str, autocast_dtype: str, input_dtype: str) -> str:
    """The dtype name of ``op``'s output under ``torch.autocast(device_type, dtype=autocast_dtype)``.

    ``autocast_dtype`` is bfloat16 or float16; ``input_dtype`` is float32 or ``autocast_dtype``
    (aliases such as ``bf16``, ``fp16``, ``fp32`` are accepted). Which operands carry the input
    dtype is stated per op in ``OPS``. Returns ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    """
    kind = category(op, device_type)
    low = _dtype_name(autocast_dtype, "autocast_dtype", AUTOCAST_DTYPES)
    given = _dtype_name(input_dtype, "input_dtype", ("float32", low))
    if kind == "lower":
        return low
    if kind == "float32":
        return "float32"
    # passthrough keeps the input's dtype; promote takes the wider of input and autocast dtype,
    # which with the input restricted to float32 or low is the input's dtype as well.
    return given
