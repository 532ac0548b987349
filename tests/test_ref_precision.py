"""reference.precision: the device/precision table of the design, row by row."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from reference.precision import DEVICE_TYPES, DTYPES, MODES, TABLE, Resolution, resolve_precision

FP32 = ("fp32", "float32", False, False)
BF16 = ("bf16", "bfloat16", False, True)
FP16 = ("fp16", "float16", True, True)

# (device, mode, dtype, bf16_supported) -> (mode, dtype, use_scaler, autocast, downgraded?)
CASES = [
    ("cuda", "auto", "bf16", True, BF16, False),
    ("cuda", "auto", "bf16", False, FP16, True),
    ("cuda", "auto", "fp16", True, FP16, False),
    ("cuda", "auto", "fp16", False, FP16, False),
    ("cuda", "fp32", "bf16", True, FP32, False),
    ("cuda", "fp32", "bf16", False, FP32, False),
    ("cuda", "bf16", "bf16", True, BF16, False),
    ("cuda", "bf16", "fp16", True, BF16, False),  # dtype ignored outside auto
    ("cuda", "bf16", "bf16", False, FP32, True),
    ("cuda", "fp16", "bf16", True, FP16, False),
    ("cuda", "fp16", "bf16", False, FP16, False),
    ("cpu", "auto", "bf16", True, FP32, False),
    ("cpu", "auto", "fp16", True, FP32, False),
    ("cpu", "fp32", "bf16", True, FP32, False),
    ("cpu", "fp16", "bf16", True, FP32, True),
    ("cpu", "bf16", "bf16", True, BF16, False),
    ("cpu", "bf16", "bf16", False, BF16, False),  # bf16_supported is a CUDA question
    ("mps", "auto", "bf16", True, FP32, False),
    ("mps", "auto", "fp16", True, FP32, False),
    ("mps", "fp32", "bf16", True, FP32, False),
    ("mps", "bf16", "bf16", True, FP32, True),
    ("mps", "fp16", "bf16", True, FP32, True),
]


@pytest.mark.parametrize("device, mode, dtype, supported, expected, downgraded", CASES)
def test_design_table(device, mode, dtype, supported, expected, downgraded):
    got = resolve_precision(device, mode, dtype, bf16_supported=supported)
    assert (got.mode, got.dtype, got.use_scaler, got.autocast_enabled) == expected, (
        f"{device}/{mode}/{dtype}/bf16_supported={supported}: got {got}"
    )
    expected_reason = "a reason" if downgraded else "no reason"
    assert (got.reason is not None) == downgraded, f"expected {expected_reason}: {got}"


def test_table_is_complete_and_unambiguous():
    for device, mode, dtype, supported in itertools.product(DEVICE_TYPES, MODES, DTYPES, (True, False)):
        matching = [
            row for row in TABLE
            if row.device_type == device and row.mode == mode
            and row.dtype in (None, dtype) and row.bf16_supported in (None, supported)
        ]
        assert len(matching) == 1, f"{device}/{mode}/{dtype}/{supported}: {len(matching)} rows match"


def test_table_invariants():
    for row in TABLE:
        r = row.resolution
        assert r.mode != "auto" and r.mode in MODES
        assert r.use_scaler == (r.mode == "fp16"), f"a scaler goes with fp16 only: {row}"
        assert r.autocast_enabled == (r.mode != "fp32"), row
        assert r.dtype == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[r.mode]
        if row.mode != "auto" and r.mode != row.mode:
            assert r.reason, f"a downgrade without a reason: {row}"
        if row.dtype is not None:
            assert row.mode == "auto", f"dtype is consulted only for auto: {row}"
        if row.bf16_supported is not None:
            assert row.device_type == "cuda", f"bf16 support is consulted only on CUDA: {row}"


@pytest.mark.parametrize(
    "args, words",
    [
        (("cpu", "fp16"), ["fp16", "CPU", "fp32"]),
        (("cuda", "bf16", "bf16", False), ["bf16", "does not support bfloat16", "fp32"]),
        (("cuda", "auto", "bf16", False), ["bf16", "does not support bfloat16", "fp16", "loss scaler"]),
        (("mps", "bf16"), ["bf16", "MPS", "fp32"]),
        (("mps", "fp16"), ["fp16", "MPS", "fp32"]),
    ],
)
def test_reasons_name_what_was_asked_and_given(args, words):
    reason = resolve_precision(*args).reason
    for word in words:
        assert word in reason, f"{args}: reason {reason!r} does not mention {word!r}"


def test_defaults_are_auto_bf16_supported():
    assert resolve_precision("cuda", "auto") == Resolution("bf16", "bfloat16", False, True, None)


def test_results_and_rows_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolve_precision("cpu", "auto").mode = "bf16"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        TABLE[0].mode = "fp16"  # type: ignore[misc]
    assert isinstance(TABLE, tuple)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"device_type": "xpu", "mode": "auto"}, "device_type must be one of cuda, cpu, mps, got 'xpu'"),
        ({"device_type": "CUDA", "mode": "auto"}, "device_type must be one of"),
        ({"device_type": "cuda:0", "mode": "auto"}, "device_type must be one of"),
        ({"device_type": "cpu", "mode": "fp8"},
         "mode must be one of auto, fp32, bf16, fp16, got 'fp8'"),
        ({"device_type": "cpu", "mode": "bfloat16"}, "mode must be one of"),
        ({"device_type": "cpu", "mode": "auto", "dtype": "fp32"},
         "dtype must be one of bf16, fp16, got 'fp32'"),
        ({"device_type": "cpu", "mode": "fp32", "dtype": "float16"}, "dtype must be one of"),
        ({"device_type": "cuda", "mode": "bf16", "bf16_supported": 1},
         "bf16_supported must be a bool, got 1"),
        ({"device_type": "cpu", "mode": "bf16", "bf16_supported": None}, "bf16_supported must be a bool"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        resolve_precision(**kwargs)
