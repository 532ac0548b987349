"""Property 1: casts between number formats, torch against `reference.formats`.

Every finite result matches bit for bit; NaN matches as a class. The only difference, float8_e4m3fn
saturation on overflow, is an explicit expectation (`conformance.expectations`), and float8_e8m0fnu
is compared with the spec's torch encoding (sign ignored, zero -> 2^-127), which it documents.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given

from conformance import expectations, strategies
from conformance.assertions import Where, assert_same
from conformance.bridge import to_numpy, to_torch, torch_dtype
from reference import formats

SOURCES = ["float16", "bfloat16"]
TARGETS = [name for name in ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                             "float8_e5m2fnuz", "float8_e8m0fnu") if name in formats.FORMATS]


def _all_16_bit(dtype_name: str) -> np.ndarray:
    return np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.dtype(getattr(ml_dtypes, dtype_name, dtype_name)))


def spec_cast(x: np.ndarray, target: str, device: str) -> np.ndarray:
    """The spec's cast configured as torch's conversion is documented to behave."""
    saturate = target == "float8_e4m3fn" and expectations.e4m3fn_saturates(device)
    return formats.cast(x, target, saturate=saturate, torch_e8m0=(target == "float8_e8m0fnu"))


def torch_cast(x: np.ndarray, target: str, device: str) -> np.ndarray:
    target_dtype = torch_dtype(formats.get_format(target).dtype)
    return to_numpy(to_torch(x, device).to(target_dtype))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", SOURCES)
def test_every_16_bit_pattern_casts_as_specified(source, target, device):
    x = _all_16_bit(source)
    where = Where("casts", field=f"{source} -> {target}",
                  repro=f"pytest conformance/test_casts.py -k '{source} and {target} and {device}'")
    assert_same(torch_cast(x, target, device), spec_cast(x, target, device), where)


@pytest.mark.parametrize("target", TARGETS)
@given(x=strategies.float32_neighbourhoods())
def test_float32_neighbourhoods_cast_as_specified(target, device, x):
    where = Where("casts", field=f"float32 -> {target}", repro="rerun with the @reproduce_failure blob printed above")
    assert_same(torch_cast(x, target, device), spec_cast(x, target, device), where)


def test_e4m3fn_saturation_is_the_keyed_expectation(device):
    """torch's saturation on overflow is a version-keyed fact, not an assumption."""
    probed = expectations.probe_e4m3fn_saturates(device)
    expected = expectations.e4m3fn_saturates(device)
    assert probed == expected, (
        f"torch {torch.__version__} on {device}: float32 -> float8_e4m3fn saturates={probed}, "
        f"the suite expects {expected}; update conformance/expectations.py after checking the change"
    )
    if expectations.keyed_device(device):
        version = expectations.TORCH_VERSION if expectations.TORCH_VERSION in expectations.MEASURED \
            else expectations.NEWEST_MEASURED
        assert formats.torch_cpu_e4m3fn_saturates(version) == expected, (
            f"reference.formats rule 9 says torch {version}'s CPU cast saturates="
            f"{formats.torch_cpu_e4m3fn_saturates(version)}, torch {torch.__version__} does {probed}")
    # At and past the threshold: 464 (the tie between 448 and the NaN pattern), 465, 480 and ±inf.
    x = np.array(expectations.E4M3FN_OVERFLOW_PROBES, np.float32)
    assert_same(torch_cast(x, "float8_e4m3fn", device), spec_cast(x, "float8_e4m3fn", device),
                Where("casts", field="float32 -> float8_e4m3fn at the overflow threshold",
                      repro=f"pytest conformance/test_casts.py -k 'keyed and {device}'"))
    # The spec names both behaviours; the non-saturating one is ml_dtypes'.
    x = np.array([1e6, np.inf, -np.inf, 464.0, 465.0], np.float32)
    assert np.isnan(formats.cast(x, "float8_e4m3fn", saturate=False)[[0, 1, 2, 4]].astype(np.float32)).all()
    assert (formats.cast(x, "float8_e4m3fn", saturate=True).astype(np.float32) == [448, 448, -448, 448, 448]).all()


def test_float64_goes_through_float32_in_both():
    # (1 + 2^-4)(1 + 2^-40): float32 rounds to the e4m3fn tie 1.0625, which goes to even (1.0).
    x = np.array([(1 + 2.0**-4) * (1 + 2.0**-40), 2.98023223877e-08], np.float64)
    t = torch.from_numpy(x)
    assert t.to(torch.float8_e4m3fn).float()[0].item() == float(formats.cast(x[:1], "float8_e4m3fn")[0]) == 1.0
    assert t.to(torch.float16)[1].item() == float(formats.cast(x[1:], "float16")[0]) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("target", ["bfloat16"])
def test_every_float32_pattern_casts_as_specified(target, device):
    where = Where("casts", field=f"float32 -> {target} (exhaustive)")
    chunk = 2**24
    for start in range(0, 2**32, chunk):
        x = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
        assert_same(torch_cast(x, target, device), spec_cast(x, target, device), where.at(f"{where.field} from 0x{start:08x}"))
