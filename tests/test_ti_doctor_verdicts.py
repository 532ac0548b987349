"""ampspec doctor's verdicts follow the numbers (issue classes 1-3): never healthy on a sick model
(inside the module, degraded), the loss scale run as the user's run would (transient overflow is
the scaler's job), flushes weighed by their mass, advice checked; the healthy catalogue of
architectures gets no error and no warning in bf16 and fp16."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from torchimpl import inspect_precision
from torchimpl.doctor.kinds import MASS_NEGLIGIBLE, SCALE_USEFUL_LOG2, SQNR_FLOOR_DB, sqnr_floor_db
from torchimpl.precision.fp8 import torchao_available

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doctor_models.healthy import CI, HEALTHY  # noqa: E402
from doctor_models.models import CATALOGUE  # noqa: E402


def _doctor(name: str, **extra):
    case = CATALOGUE[name]
    model, train, _ = case.make()
    return inspect_precision(model, train, precision=case.precision, steps=case.steps, **{**case.options, **extra})


def _runslow(config) -> bool:
    return bool(config.getoption("--runslow", default=False)) or os.environ.get("AMPSPEC_RUNSLOW") == "1"


# ---------------------------------------------------------------- class 1: never healthy on a sick model


def test_the_sqnr_floors_follow_from_the_formats():
    # one rounding to p significant bits: 10 log10(3 4^p) dB; 30 dB allowed for accumulation
    assert SQNR_FLOOR_DB == {"float16": 41.0, "bfloat16": 22.9}
    assert sqnr_floor_db("float16", "fp8") == 10.0 and sqnr_floor_db("float32", "fp16") is None


def test_a_hand_written_rmsnorm_that_squares_past_fp16_is_found_inside_the_module():
    report = _doctor("rmsnorm_overflow")
    [v] = report.verdicts
    assert (v.kind, v.module, v.severity) == ("inner-overflow", "norm", "error")
    assert "aten.mul" in v.numbers["op"] and "aten.rsqrt" in v.numbers["absorbed_by"], v.message
    assert v.numbers["sqnr_db"] < SQNR_FLOOR_DB["float16"]
    assert "precision.fp32_modules: ['norm']" in v.fix and "x.float().pow(2)" in v.fix
    assert v.numbers["fix_cures"] is True and "the verdict is gone" in v.fix
    assert not report.healthy and "healthy" not in report.text().splitlines()[2]


def test_a_hand_written_layernorm_of_a_subnormal_variance_is_fp16_normalization():
    [v] = _doctor("layernorm_tiny_variance").verdicts
    assert (v.kind, v.module) == ("fp16-normalization", "norm")
    assert "aten.sqrt" in v.numbers["op"] and v.numbers["fix_cures"] is True


class _Quantize(nn.Module):
    """Rounds its input to multiples of 0.5 in the low dtype only (an fp32 shadow passes it through):
    the signal collapses with no overflow, no unsafe op and no normalisation to blame."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return x
        return x + ((x * 2).round() / 2 - x).detach()


class _Collapsing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.q = _Quantize()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.q(self.fc(x))).float(), y)


def test_a_collapse_with_no_cause_found_is_degraded_at_the_module_where_it_starts():
    torch.manual_seed(0)
    batches = [(torch.randn(16, 8) * 0.3, torch.zeros(16, 1)) for _ in range(3)]
    report = inspect_precision(_Collapsing(), batches, precision="bf16", steps=3)
    [v] = report.verdicts
    assert (v.kind, v.module, v.severity) == ("degraded", "q", "warning")
    assert "cause not located" in v.message and v.numbers["sqnr_db"] < SQNR_FLOOR_DB["bfloat16"]


# ---------------------------------------------------------------- class 2: the scaler's job


def test_the_diagnosis_runs_the_dynamic_scale_and_transient_overflow_is_a_note():
    for name in ("readme_model", "small_mlp"):
        report = _doctor(name)
        assert report.verdicts == [], report.text()
    report = _doctor("readme_model")
    scales = report.to_dict()["loss_scales"]
    assert scales[0] == 2.0**16 and min(scales) < 2.0**16  # it backed off, as GradScaler does
    assert any("the scaler's job" in n or "warm-up" in n for n in report.notes), report.notes


def test_the_scale_grows_after_the_interval():
    report = _doctor("small_mlp", growth_interval=2)
    scales = report.to_dict()["loss_scales"]
    assert any(b == 2 * a for a, b in zip(scales, scales[1:])), scales


def test_overflow_the_scale_cannot_cure_is_a_verdict_at_the_module():
    report = _doctor("gradient_overflow")
    [v] = report.verdicts
    assert (v.kind, v.module) == ("gradient-overflow", "length")
    assert "the scale is not the cause" in v.message and v.numbers["steps"]


# ---------------------------------------------------------------- class 3: weigh what flushes; advice within reason


def test_a_flush_of_negligible_mass_is_a_note_not_a_verdict():
    if not torchao_available():
        pytest.skip("float8 models need torchao: pip install 'ampspec[fp8]'")
    report = _doctor("fp8_negligible_flush")
    assert report.verdicts == [], report.text()
    [note] = [n for n in report.notes if "negligible" in n]
    assert "grad_output" in note and "2^-20" in note
    fp8 = report.fp8_layers[0]
    assert fp8.fraction("underflow", "grad_output") > 0.3 > fp8.fraction("underflow_mass", "grad_output") * 1e6
    assert MASS_NEGLIGIBLE == 2.0**-20


def test_scale_advice_beyond_reason_names_the_loss_term_and_is_checked():
    [v] = _doctor("aux_head").verdicts
    assert (v.kind, v.module) == ("gradient-underflow", "aux")
    assert v.numbers["advice"] == "loss-term" and "raise init_scale" not in v.fix
    assert "loss term that reaches 'aux'" in v.fix and "weight" in v.fix
    assert v.numbers["fix_cures"] is True


def test_scale_advice_stays_within_the_useful_range():
    [v] = _doctor("gradient_underflow").verdicts
    low = v.numbers["init_scale_log2"]
    assert v.numbers["advice"] == "init_scale" and SCALE_USEFUL_LOG2[0] <= low <= SCALE_USEFUL_LOG2[1]
    assert f"raise init_scale to >= 2^{low}" in v.fix


def test_growth_through_every_block_names_the_architecture_change_not_an_island():
    [v] = _doctor("residual_growth").verdicts
    assert (v.kind, v.module) == ("forward-overflow", "blocks.5.fc")
    assert v.numbers["growing_blocks"][0] == "blocks.0" and "pre-norm" in v.fix and "fp32_modules" not in v.fix
    assert "fix_cures" not in v.numbers  # an architecture change is not rerun


# ---------------------------------------------------------------- the healthy catalogue


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(HEALTHY))
def test_the_healthy_catalogue_gets_no_error_and_no_warning(name, precision, request):
    if name not in CI and not _runslow(request.config):
        pytest.skip("the rest of the healthy catalogue: opt in with --runslow or AMPSPEC_RUNSLOW=1")
    model, train, _ = HEALTHY[name]()
    report = inspect_precision(model, train, precision=precision, steps=3)
    assert report.verdicts == [], report.text()
    assert report.healthy and "no verdict: healthy" in report.text()


def test_precision_all_reports_fp8_that_does_not_apply_as_a_note(monkeypatch, capsys):
    if not torchao_available():
        pytest.skip("fp8 needs torchao: pip install 'ampspec[fp8]'")
    from torchimpl.cli.app import main

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    code = main(["doctor", "--task", "doctor_models.models:readme_model", "--precision", "all", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "note: fp8 does not apply to this model, left out: precision.mode 'fp8' found no linear layer" in out
    assert "precision bf16" in out and "precision fp16" in out and "precision fp8" not in out
    code = main(["doctor", "--task", "doctor_models.models:readme_model", "--precision", "fp8", "--steps", "1"])
    assert code == 2 and "found no linear layer" in capsys.readouterr().err  # asked for by name: an error


def test_the_scan_inside_a_module_sees_only_its_ops_and_leaves_the_buffers():
    from doctor_models.models import HandRMSNorm

    from torchimpl.doctor.inner import scan_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 8), HandRMSNorm())
    with torch.no_grad():
        model[1].weight.mul_(1000.0)  # a float16 output of std ~300 under autocast
    x = torch.randn(16, 8) + 3
    before = model[0].running_mean.clone()

    def forward():
        with torch.autocast("cpu", dtype=torch.float16):
            model(x)

    found = scan_module(model, "2", forward)
    assert found.overflow is not None and "aten.mul" in found.overflow[0]
    assert found.absorbed is not None and "aten.rsqrt" in found.absorbed[0]
    assert torch.equal(model[0].running_mean, before)  # the rerun's batch statistics are undone
    clean = scan_module(model, "0", forward)  # the BatchNorm alone did nothing wrong
    assert not clean.found
