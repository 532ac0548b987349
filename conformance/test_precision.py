"""Property 6: precision resolution, every combination, torchimpl against `reference.precision`.

Device availability and bf16 support are mocked, so every row is exercised on any machine. The
mode, dtype, scaler and autocast decisions must match exactly, and a downgrade must be reported
(a reason and one warning) exactly when the spec reports one.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from conformance.assertions import Where, assert_equal
from reference import precision as spec
from torchimpl.precision import plan as prod

CASES = list(itertools.product(spec.DEVICE_TYPES, spec.MODES, spec.DTYPES, [True, False, "probe error"]))


@pytest.mark.parametrize("device_type, mode, dtype, bf16", CASES)
def test_resolution_matches_the_spec(monkeypatch, device_type, mode, dtype, bf16):
    def probe(*args, **kwargs):
        if bf16 == "probe error":
            raise RuntimeError("simulated driver error")
        return bf16

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", probe)
    where = Where("precision", field="", repro=f"pytest conformance/test_precision.py -k '{device_type}-{mode}-{dtype}-{bf16}'")
    expected = spec.resolve_precision(device_type, mode, dtype, bf16_supported=(bf16 is True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = prod.resolve_precision(prod.PrecisionConfig(mode=mode, dtype=dtype), torch.device(device_type))
    downgrade_warnings = [w for w in caught if issubclass(w.category, prod.PrecisionDowngradeWarning)]
    assert_equal(plan.mode, expected.mode, where.at("mode"))
    assert_equal(str(plan.dtype).removeprefix("torch."), expected.dtype, where.at("dtype"))
    assert_equal(plan.use_scaler, expected.use_scaler, where.at("use_scaler"))
    assert_equal(plan.autocast_enabled, expected.autocast_enabled, where.at("autocast_enabled"))
    assert_equal(plan.device_type, device_type, where.at("device_type"))
    assert_equal(plan.reason is not None, expected.reason is not None, where.at("reason given"))
    assert_equal(len(downgrade_warnings), int(expected.reason is not None), where.at("downgrade warnings"))
