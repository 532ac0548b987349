"""reference.autocast: the autocast op policy table, its API and the facts users rely on."""

from __future__ import annotations

import itertools

import pytest

from reference.autocast import (
    AUTOCAST_DTYPES,
    CATEGORIES,
    DEVICE_TYPES,
    OPS,
    POLICY,
    SOURCES,
    category,
    output_dtype,
)

LOWS = AUTOCAST_DTYPES
ALL = list(itertools.product(OPS, DEVICE_TYPES, LOWS))


def test_every_device_classifies_every_op_once_with_a_known_category():
    assert set(POLICY) == set(DEVICE_TYPES) == set(SOURCES)
    for device_type in DEVICE_TYPES:
        assert set(POLICY[device_type]) == set(OPS), device_type
        unknown = {op: c for op, c in POLICY[device_type].items() if c not in CATEGORIES}
        assert not unknown, f"{device_type}: unknown categories {unknown}"


def test_the_table_is_read_only():
    with pytest.raises(TypeError):
        POLICY["cpu"]["softmax"] = "float32"  # type: ignore[index]
    with pytest.raises(TypeError):
        OPS["new_op"] = "x"  # type: ignore[index]


@pytest.mark.parametrize("op, device_type, low", ALL)
def test_output_follows_the_category(op, device_type, low):
    kind = category(op, device_type)
    from_fp32 = output_dtype(op, device_type, low, "float32")
    from_low = output_dtype(op, device_type, low, low)
    expected = {
        "lower": (low, low),
        "float32": ("float32", "float32"),
        "passthrough": ("float32", low),
        "promote": ("float32", low),
    }[kind]
    assert (from_fp32, from_low) == expected, f"{op} on {device_type} ({kind}) under {low}"


@pytest.mark.parametrize("device_type, low, given", list(itertools.product(DEVICE_TYPES, LOWS, ["float32", "low"])))
def test_matmuls_and_convolutions_lower_everywhere(device_type, low, given):
    given = low if given == "low" else given
    for op in ("linear", "matmul", "bmm", "addmm", "baddbmm", "conv2d", "scaled_dot_product_attention"):
        assert output_dtype(op, device_type, low, given) == low, op


@pytest.mark.parametrize("low", LOWS)
def test_cpu_softmax_layer_norm_and_sum_keep_the_low_dtype(low):
    for op in ("softmax", "log_softmax", "layer_norm", "sum"):
        assert output_dtype(op, "cpu", low, low) == low, op
        assert output_dtype(op, "cpu", low, "float32") == "float32", op


@pytest.mark.parametrize("low", LOWS)
def test_cuda_softmax_layer_norm_and_sum_run_in_float32(low):
    for op in ("softmax", "log_softmax", "layer_norm", "sum"):
        assert output_dtype(op, "cuda", low, low) == "float32", op


@pytest.mark.parametrize("device_type, low", list(itertools.product(DEVICE_TYPES, LOWS)))
def test_losses_and_prod_are_float32_on_both_devices(device_type, low):
    for op in ("cross_entropy", "nll_loss", "mse_loss", "binary_cross_entropy_with_logits", "prod"):
        assert output_dtype(op, device_type, low, low) == "float32", op


def test_cpu_and_cuda_differ_exactly_on_the_ops_cuda_runs_in_float32():
    differ = {op for op in OPS if POLICY["cpu"][op] != POLICY["cuda"][op]}
    assert differ == {"softmax", "log_softmax", "layer_norm", "group_norm", "sum", "vector_norm",
                      "logsumexp", "exp", "log", "pow"}
    assert all(POLICY["cpu"][op] == "passthrough" and POLICY["cuda"][op] == "float32" for op in differ)


def test_promote_takes_the_wider_of_input_and_autocast_dtype():
    assert output_dtype("cat", "cpu", "bfloat16", "float32") == "float32"
    assert output_dtype("cat", "cpu", "bfloat16", "bfloat16") == "bfloat16"
    assert output_dtype("add", "cuda", "float16", "float16") == "float16"


def test_dtype_aliases_are_accepted():
    assert output_dtype("softmax", "cpu", "bf16", "bf16") == "bfloat16"
    assert output_dtype("relu", "cpu", "fp16", "fp32") == "float32"
    assert output_dtype("linear", "cuda", "half", "fp32") == "float16"


def test_unknown_op_is_named():
    with pytest.raises(ValueError, match=r"op 'softmaxx' is not in the autocast table; known ops: linear"):
        output_dtype("softmaxx", "cpu", "bfloat16", "float32")


def test_unknown_device_type_is_named():
    with pytest.raises(ValueError, match=r"device_type must be one of cpu, cuda, got 'mps'"):
        output_dtype("linear", "mps", "bfloat16", "float32")
    with pytest.raises(ValueError, match=r"device_type .* got 'cuda:0'"):
        category("linear", "cuda:0")


@pytest.mark.parametrize("bad", ["float32", "float8_e4m3fn", "int8", ""])
def test_autocast_dtype_must_be_16_bit(bad):
    with pytest.raises(ValueError, match=rf"autocast_dtype must be one of bfloat16, float16 .*got {bad!r}"):
        output_dtype("linear", "cpu", bad, "float32")


@pytest.mark.parametrize("low, other", [("bfloat16", "float16"), ("float16", "bfloat16")])
def test_input_dtype_is_float32_or_the_autocast_dtype(low, other):
    # Mixing the two 16-bit dtypes is outside the table (rule 6): refused, not guessed.
    with pytest.raises(ValueError, match=rf"input_dtype must be one of float32, {low} .*got '{other}'"):
        output_dtype("relu", "cpu", low, other)
    with pytest.raises(ValueError, match=r"input_dtype .* got 'float64'"):
        output_dtype("relu", "cpu", low, "float64")
