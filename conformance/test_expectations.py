"""The version-keyed facts: every table covers exactly the measured versions, an unmeasured torch
runs with the newest measured facts and says so, and the spec's e4m3fn rule is the keyed one."""

from __future__ import annotations

import warnings

import pytest

from conformance import expectations
from reference import formats

TABLES = {
    "E4M3FN_SATURATES_ON_CPU": expectations.E4M3FN_SATURATES_ON_CPU,
    "CLIP_GRAD_VALUE_RAISES_WITHOUT_GRADS": expectations.CLIP_GRAD_VALUE_RAISES_WITHOUT_GRADS,
    "CLIP_ONE_ELEMENT_L2_NORM_IS_ABS": expectations.CLIP_ONE_ELEMENT_L2_NORM_IS_ABS,
    "CLIP_COEF_IN_GRAD_DTYPE['cpu']": expectations.CLIP_COEF_IN_GRAD_DTYPE["cpu"],
    "FUSED_SGD_FAILS_ON_LATE_FIRST_GRADIENT": expectations.FUSED_SGD_FAILS_ON_LATE_FIRST_GRADIENT,
    "FUSED_SGD_SKIPPED_FIRST_STEP_STORES_A_BUFFER": expectations.FUSED_SGD_SKIPPED_FIRST_STEP_STORES_A_BUFFER,
    "AUTOCAST_POLICY_CONFIRMED['cpu']": dict.fromkeys(expectations.AUTOCAST_POLICY_CONFIRMED["cpu"]),
}


@pytest.mark.parametrize("name", TABLES)
def test_every_keyed_table_covers_exactly_the_measured_versions(name):
    assert sorted(TABLES[name]) == sorted(expectations.MEASURED), (
        f"{name} is keyed for {sorted(TABLES[name])}, measured versions are {sorted(expectations.MEASURED)}: "
        "a version is added with every fact measured on it (bench/torch_matrix.py)")


def test_an_unmeasured_version_expects_the_newest_measured_fact_and_warns():
    newest = expectations.NEWEST_MEASURED
    table = expectations.E4M3FN_SATURATES_ON_CPU
    with pytest.warns(expectations.UnmeasuredTorchVersion, match=rf"torch 9\.1 is not measured .*torch {newest}"):
        assert expectations.keyed(table, "e4m3fn", version="9.1") is table[newest]
    assert "9.1 is NOT measured" in expectations.version_status("9.1")


def test_a_measured_version_gets_its_own_fact_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for version, value in expectations.E4M3FN_SATURATES_ON_CPU.items():
            assert expectations.keyed(expectations.E4M3FN_SATURATES_ON_CPU, "e4m3fn", version=version) is value
            assert "keyed facts measured" in expectations.version_status(version)


def test_the_suite_on_an_unmeasured_torch_warns_instead_of_skipping(monkeypatch):
    """What a torch release newer than every key sees: the keyed accessors answer, and warn."""
    monkeypatch.setattr(expectations, "TORCH_VERSION", "9.1")
    with pytest.warns(expectations.UnmeasuredTorchVersion) as record:
        expectations.e4m3fn_saturates("cpu")
        expectations.clip_grad_value_raises_without_grads("cpu")
        expectations.clip_one_element_l2_norm_is_abs("cpu")
        expectations.clip_coef_in_grad_dtype("cpu")
        expectations.fused_sgd_fails_on_late_first_gradient("cpu")
        expectations.fused_sgd_skipped_first_step_stores_a_buffer("cpu")
    assert len(record) == 6 and all("torch 9.1 is not measured" in str(w.message) for w in record)


@pytest.mark.parametrize("version", sorted(expectations.E4M3FN_SATURATES_ON_CPU))
def test_the_spec_e4m3fn_rule_is_the_keyed_one(version):
    assert formats.torch_cpu_e4m3fn_saturates(version) == expectations.E4M3FN_SATURATES_ON_CPU[version], (
        f"reference.formats rule 9 and conformance/expectations.py disagree for torch {version}")
