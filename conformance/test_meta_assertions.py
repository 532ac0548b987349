"""The comparison helpers themselves: a suite whose assertions cannot fail proves nothing."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from conformance.assertions import Where, assert_equal, assert_same, assert_same_list
from conformance.bridge import to_numpy, to_torch

W = Where("meta", step=3, field="grads", repro="pytest conformance/test_meta_assertions.py")


def test_one_ulp_fails_with_step_field_bits_ulps_and_reproduction():
    a = np.array([1.0, 2.0], np.float32)
    b = a.copy()
    b[1] = np.nextafter(b[1], np.float32(3))
    with pytest.raises(AssertionError) as info:
        assert_same(a, b, W)
    msg = str(info.value)
    for part in ("meta step 3", "'grads'", "1 of 2", "0x40000000", "0x40000001", "1 ULP apart", "reproduce: pytest"):
        assert part in msg, f"{part!r} missing from:\n{msg}"
    assert_same(a, b, W, max_ulp=1)


def test_nan_is_a_class_and_signed_zeros_differ():
    nan_a = np.array([0x7FC0, 0xFFFF], np.uint16).view(ml_dtypes.bfloat16)
    nan_b = np.array([0x7FC1, 0x7FC0], np.uint16).view(ml_dtypes.bfloat16)
    assert_same(nan_a, nan_b, W)
    with pytest.raises(AssertionError):
        assert_same(np.array([0.0], np.float32), np.array([-0.0], np.float32), W)
    with pytest.raises(AssertionError):
        assert_same(np.array([np.nan], np.float32), np.array([1.0], np.float32), W, max_ulp=10**9)


def test_dtype_shape_and_length_mismatches_fail():
    with pytest.raises(AssertionError, match="dtype"):
        assert_same(np.zeros(2, np.float32), np.zeros(2, np.float64), W)
    with pytest.raises(AssertionError, match="shape"):
        assert_same(np.zeros(2, np.float32), np.zeros(3, np.float32), W)
    with pytest.raises(AssertionError, match="2 tensors"):
        assert_same_list([np.zeros(1, np.float32)] * 2, [np.zeros(1, np.float32)], W)


def test_plain_values_compare_floats_by_bits():
    assert_equal(1.0, 1.0, W)
    assert_equal(float("nan"), float("nan"), W)
    with pytest.raises(AssertionError, match="torch 0.0, spec -0.0"):
        assert_equal(0.0, -0.0, W)
    with pytest.raises(AssertionError):
        assert_equal(True, False, W)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_bridge_round_trips_every_bit(dtype):
    width = np.dtype(dtype).itemsize
    raw = np.random.default_rng(0).integers(0, 2 ** (8 * width), 4096, dtype=np.uint64, endpoint=False)
    x = raw.astype(f"uint{8 * width}").view(dtype)
    t = to_torch(x)
    assert t.dtype == {np.float32: torch.float32, np.float64: torch.float64, np.float16: torch.float16,
                       ml_dtypes.bfloat16: torch.bfloat16, ml_dtypes.float8_e4m3fn: torch.float8_e4m3fn}[dtype]
    back = to_numpy(t)
    assert back.dtype == x.dtype and (back.view(f"uint{8 * width}") == x.view(f"uint{8 * width}")).all()
