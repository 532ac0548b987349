"""``precision.mode: bf16-true / 16-true`` and ``precision.master_weights``: what the configuration
accepts, what it refuses (naming the field and the fix), and the plan it resolves to."""

from __future__ import annotations

import pytest
import torch

from torchimpl.config.schema import Config, ConfigError, load_config
from torchimpl.config.sections import MASTER_WEIGHTS
from torchimpl.precision.plan import PrecisionConfig, PrecisionDowngradeWarning, resolve_precision


def refusal(overrides: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    return info.value.errors


@pytest.mark.parametrize("mw", MASTER_WEIGHTS)
def test_bf16_true_takes_every_master_weight_option(mw):
    cfg = load_config(overrides=["precision.mode=bf16-true", f"precision.master_weights={mw}"])
    assert cfg.precision.mode == "bf16-true" and cfg.precision.master_weights == mw
    assert Config.from_dict(cfg.to_dict()) == cfg  # round trip through the file format


def test_lightning_spellings_resolve_and_note_what_they_mean():
    cfg = PrecisionConfig("16-true", master_weights="fp32")
    assert cfg.mode == "fp16-true" and "Lightning" in cfg.spelling_note and "fp16" in cfg.spelling_note
    assert PrecisionConfig("BF16-True").mode == "bf16-true"
    assert PrecisionConfig().master_weights == "none"  # Lightning's bf16-true: no master copy


@pytest.mark.parametrize("mode", ["bf16-true", "16-true"])
def test_true_plans_hold_parameters_in_16_bits_without_autocast(mode):
    plan = resolve_precision(PrecisionConfig(mode, master_weights="fp32"), "cpu")
    dtype = torch.bfloat16 if mode == "bf16-true" else torch.float16
    assert (plan.param_dtype, plan.dtype, plan.autocast_enabled) == (dtype, dtype, False)
    assert plan.use_scaler is (mode == "16-true") and plan.master_weights == "fp32"
    assert not plan.is_mixed_precision


def test_mixed_plans_keep_float32_parameters():
    for mode in ("fp32", "bf16", "auto"):
        plan = resolve_precision(PrecisionConfig(mode), "cpu")
        assert plan.param_dtype == torch.float32 and plan.master_weights == "none"


def test_true_modes_downgrade_where_16_bit_parameters_do_not_run():
    with pytest.warns(PrecisionDowngradeWarning, match="'bf16-true' was requested.*running in fp32"):
        plan = resolve_precision(PrecisionConfig("bf16-true"), "meta")
    assert plan.mode == "fp32" and plan.param_dtype == torch.float32


@pytest.mark.parametrize("mode", ["bf16", "bf16-mixed", "fp32", "auto", "16-mixed", "fp8"])
def test_master_weights_outside_a_true_mode_is_refused(mode):
    (field, message), = refusal([f"precision.mode={mode}", "precision.master_weights=fp32"])
    assert field == "precision.master_weights"
    assert "applies to precision.mode bf16-true or 16-true" in message and "remove master_weights" in message


@pytest.mark.parametrize("overrides, field, words", [
    (["precision.mode=16-true"], "precision.master_weights", "set master_weights to fp32 or kahan"),
    (["precision.mode=16-true", "precision.master_weights=stochastic"], "precision.master_weights",
     "under 16-true use fp32"),
    (["precision.mode=bf16-true", "precision.fp8_recipe=rowwise"], "precision.fp8_recipe", "set mode fp8"),
    (["precision.mode=bf16-true", "precision.fp8_skip_first_last=false"], "precision.fp8_skip_first_last",
     "set mode fp8"),
    (["precision.mode=bf16-true", "precision.fp32_modules=[head]"], "precision.fp32_modules", "remove fp32_modules"),
    (["precision.mode=bf16-true", "train.distributed=ddp"], "train.distributed",
     "use train.distributed=fsdp2 with precision.master_weights=fp32"),
    (["precision.mode=bf16-true", "train.distributed=fsdp2"], "precision.master_weights",
     "set precision.master_weights=fp32, or train.distributed=none"),
    (["precision.mode=bf16-true", "precision.master_weights=kahan", "train.distributed=fsdp2"],
     "precision.master_weights", "shards are fp32 with a 16-bit compute copy"),
    (["precision.mode=bf16-true", "precision.master_weights=kahan", "train.sync_free=true"], "train.sync_free",
     "set train.sync_free=false"),
    (["precision.mode=bf16-true", "precision.master_weights=fp32", "train.sync_free=true"], "train.sync_free",
     "or master_weights=none"),
    (["precision.mode=bf16-true", "precision.master_weights=fp3"], "precision.master_weights",
     "did you mean 'fp32'?"),
])
def test_combinations_that_cannot_run_are_refused_naming_the_field(overrides, field, words):
    errors = refusal(overrides)
    assert [f for f, _ in errors] == [field]
    assert words in errors[0][1]


def test_fsdp2_takes_the_fp32_master_option():
    # torchimpl.distributed rule 11: FSDP2's MixedPrecisionPolicy(param_dtype=...) over fp32 shards.
    for mode in ("bf16-true", "16-true"):
        cfg = load_config(overrides=[f"precision.mode={mode}", "precision.master_weights=fp32",
                                     "train.distributed=fsdp2", "train.reduce_dtype=bf16"])
        assert (cfg.train.distributed, cfg.precision.master_weights) == ("fsdp2", "fp32")


def test_fused_is_accepted_with_every_option():
    for mw in MASTER_WEIGHTS:
        cfg = load_config(overrides=["precision.mode=bf16-true", f"precision.master_weights={mw}",
                                     "optimizer.fused=true"])
        assert cfg.optimizer.fused is True
