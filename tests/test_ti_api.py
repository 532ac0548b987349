"""The Python API: precision spellings, keyword construction, validation at construction, exports."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import torchimpl
from torchimpl.config.schema import KEYWORDS, Config, ConfigError, TrainConfig, load_config
from torchimpl.precision.plan import PrecisionConfig, resolve_precision
from torchimpl.run.state import config_changes
from torchimpl.train.trainer import Callback, Trainer


def paths(info: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return [p for p, _ in info.value.errors]


# ---------------------------------------------------------------- precision spellings

SPELLED = [
    ("32-true", "fp32", "Lightning"), ("32", "fp32", "Lightning"), (32, "fp32", "Lightning"),
    ("bf16-mixed", "bf16", "Lightning"), ("16-mixed", "fp16", "Lightning"), ("16", "fp16", "Lightning"),
    (16, "fp16", "Lightning"), ("no", "fp32", "Accelerate"), ("BF16-Mixed", "bf16", "Lightning"),
]


@pytest.mark.parametrize("spelling, mode, library", SPELLED)
def test_each_spelling_maps_to_its_mode_with_a_note(spelling, mode, library, caplog):
    with caplog.at_level(logging.INFO, logger="torchimpl.precision.plan"):
        cfg = PrecisionConfig(mode=spelling)
    assert cfg.mode == mode and cfg == PrecisionConfig(mode=mode)
    note = cfg.spelling_note
    assert note.startswith(f"{spelling!r} ({library}) means") and note.endswith(f"precision mode {mode!r}")
    assert note in caplog.text, "the mapping is logged at INFO"


def test_the_note_says_what_the_spelling_means():
    assert PrecisionConfig("16-mixed").spelling_note == (
        "'16-mixed' (Lightning) means fp16 autocast over float32 weights with a dynamic loss scaler: "
        "precision mode 'fp16'")
    assert "without a loss scaler" in PrecisionConfig("bf16-mixed").spelling_note


@pytest.mark.parametrize("mode", ["auto", "fp32", "bf16", "fp16", "fp8"])
def test_canonical_modes_and_accelerates_names_carry_no_note(mode):
    cfg = PrecisionConfig(mode)
    assert cfg.mode == mode and cfg.spelling_note is None


def test_the_plan_carries_the_note():
    plan = resolve_precision(PrecisionConfig("bf16-mixed"), "cpu")
    assert plan.mode == "bf16" and "Lightning" in plan.spelling_note
    assert resolve_precision(PrecisionConfig("bf16"), "cpu").spelling_note is None


@pytest.mark.parametrize("spelling, why, instead", [
    ("64-true", "no float64 mode", "use '32-true'"),
    (64, "no float64 mode", "use '32-true'"),
    ("transformer-engine", "not NVIDIA Transformer Engine", "use mode 'fp8'"),
    ("transformer-engine-float16", "not NVIDIA Transformer Engine", "use mode 'fp8'"),
])
def test_refused_spellings_explain_why_and_what_to_use(spelling, why, instead):
    with pytest.raises(ValueError) as info:
        PrecisionConfig(spelling)
    text = str(info.value)
    assert f"precision {spelling!r} is not supported" in text and why in text and instead in text
    with pytest.raises(ConfigError) as info:
        Config(precision=spelling)
    assert paths(info) == ["precision.mode"]


def test_an_unknown_spelling_lists_the_accepted_ones_with_a_did_you_mean():
    with pytest.raises(ValueError) as info:
        PrecisionConfig("bf16-mixd")
    text = str(info.value)
    assert "did you mean 'bf16-mixed'?" in text
    assert "auto, fp32, bf16, fp16, fp8, bf16-true, fp16-true" in text
    assert "32-true, 32, bf16-mixed, 16-mixed, 16, 16-true, no" in text


def test_an_unquoted_yaml_no_is_explained(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("precision: {mode: no}\n")
    with pytest.raises(ConfigError, match="write 'no' in quotes") as info:
        load_config(f)
    assert paths(info) == ["precision.mode"]
    f.write_text("precision: {mode: 'no'}\n")
    assert load_config(f).precision.mode == "fp32"


def test_precision_as_one_string_in_a_file_and_in_an_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("precision: bf16-mixed\n")
    assert load_config(f).precision == PrecisionConfig("bf16")
    assert load_config(f, ["precision.dtype=fp16"]).precision == PrecisionConfig("bf16", dtype="fp16")
    f.write_text("precision: 16\n")
    assert load_config(f).precision.mode == "fp16"
    # A whole-section override sets the mode and keeps the section's other fields.
    f.write_text("precision: {mode: bf16, fp8_recipe: rowwise}\n")
    assert load_config(f, ["precision=16-mixed"]).precision == PrecisionConfig("fp16", fp8_recipe="rowwise")


def test_a_spelled_precision_round_trips_and_compares_equal_on_resume():
    spelled, canonical = Config(precision="bf16-mixed"), Config(precision="bf16")
    assert spelled == canonical and spelled.to_dict() == canonical.to_dict()
    assert spelled.to_dict()["precision"]["mode"] == "bf16"
    assert Config.from_dict(spelled.to_dict()) == spelled
    assert config_changes(spelled.to_dict(), canonical.to_dict(), mid_window=False) == ([], [])
    refused, _ = config_changes(spelled.to_dict(), Config(precision="16-mixed").to_dict(), mid_window=False)
    assert refused == ["precision.mode: 'bf16' (checkpoint) -> 'fp16' (now)"]


# ---------------------------------------------------------------- sections from Python


def test_a_mapping_where_a_section_belongs_is_converted_and_validated():
    assert Config(precision={"mode": "bf16"}).precision == PrecisionConfig("bf16")
    assert Config(train={"steps": 7}).train == TrainConfig(steps=7)
    assert Config(precision="bf16-mixed").precision.spelling_note is not None
    with pytest.raises(ConfigError) as info:
        Config(precision={"mode": "bf16x"})
    assert paths(info) == ["precision.mode"] and "did you mean 'bf16'?" in str(info.value)


def test_every_bad_section_is_named_at_construction():
    with pytest.raises(ConfigError) as info:
        Config(device="", train=5, schedule={"name": "linear"}, checkpoint={"keep_lst": 2})
    assert sorted(paths(info)) == ["checkpoint.keep_lst", "device", "schedule.name", "train"]
    assert "train: must be a TrainConfig or a mapping of its fields, got 5" in str(info.value)


# ---------------------------------------------------------------- keyword construction

MAPPED = [
    ("max_steps", 7, lambda c: c.train.steps, 7),
    ("steps", 7, lambda c: c.train.steps, 7),
    ("accumulate", 3, lambda c: c.train.microbatches, 3),
    ("accumulate_grad_batches", 3, lambda c: c.train.microbatches, 3),
    ("clip", 0.5, lambda c: c.train.clip_norm, 0.5),
    ("gradient_clip_val", 0.5, lambda c: c.train.clip_norm, 0.5),
    ("clip", None, lambda c: c.train.clip_norm, None),
    ("lr", 3e-4, lambda c: c.optimizer.lr, 3e-4),
    ("optimizer", "sgd", lambda c: c.optimizer.name, "sgd"),
    ("schedule", "constant", lambda c: c.schedule.name, "constant"),
    ("warmup_steps", 5, lambda c: c.schedule.warmup_steps, 5),
    ("seed", 4, lambda c: c.train.seed, 4),
    ("device", "cpu", lambda c: c.device, "cpu"),
    ("log_interval", 2, lambda c: c.train.log_interval, 2),
    ("eval_interval", 9, lambda c: c.train.eval_interval, 9),
    ("checkpoint_dir", "ckpts", lambda c: c.checkpoint.folder, "ckpts"),
    ("checkpoint_interval", 50, lambda c: c.checkpoint.interval, 50),
    ("trace_file", "t.jsonl", lambda c: c.train.trace_file, "t.jsonl"),
    ("precision", "16-mixed", lambda c: c.precision.mode, "fp16"),
    ("precision", {"mode": "auto", "dtype": "fp16"}, lambda c: c.precision, PrecisionConfig("auto", "fp16")),
]


@pytest.mark.parametrize("key, value, get, want", MAPPED)
def test_each_keyword_sets_its_field(key, value, get, want):
    assert get(Config.from_kwargs(**{key: value})) == want
    assert get(Trainer(**{key: value}).config) == want


def test_every_keyword_is_tested():
    assert {key for key, *_ in MAPPED} == set(KEYWORDS)


def test_a_section_object_as_a_keyword_replaces_the_section():
    spelled = PrecisionConfig("16-mixed", fp8_recipe="rowwise")
    cfg = Config.from_kwargs(precision=spelled)
    assert cfg.precision is spelled
    assert Trainer(precision=spelled, overrides={"precision.dtype": "fp16"}).config.precision == PrecisionConfig(
        "fp16", dtype="fp16", fp8_recipe="rowwise")


def test_dotted_overrides_as_a_mapping_or_as_strings():
    cfg = Config.from_kwargs(overrides={"scaler.growth_interval": 100, "train.batch_size": 4})
    assert (cfg.scaler.growth_interval, cfg.train.batch_size) == (100, 4)
    assert Config.from_kwargs(overrides=["scaler.growth_interval=100"]).scaler.growth_interval == 100


def test_keywords_override_the_given_configs_fields_and_keep_the_rest():
    base = load_config(overrides=["train.steps=50", "optimizer.lr=0.01", "precision=bf16-mixed"])
    cfg = Config.from_kwargs(base, max_steps=5, clip=None)
    assert (cfg.train.steps, cfg.train.clip_norm, cfg.optimizer.lr) == (5, None, 0.01)
    assert cfg.precision.spelling_note is not None, "an untouched section keeps its spelling note"
    trainer = Trainer(base, max_steps=5)
    assert trainer.config.train.steps == 5 and base.train.steps == 50
    assert Trainer(base).config is base


def test_unknown_keywords_and_bad_values_are_reported_at_once_by_the_constructor():
    with pytest.raises(ConfigError) as info:
        Trainer(precison="bf16", batch_size=8, max_steps=0, lr=-1.0, precision="bf16x",
                overrides={"scaler.growth_intervl": 10})
    assert sorted(paths(info)) == sorted(["precison", "batch_size", "max_steps (train.steps)", "lr (optimizer.lr)",
                                          "precision (precision.mode)", "scaler.growth_intervl"])
    text = str(info.value)
    assert "did you mean 'precision'?" in text and "did you mean 'growth_interval'?" in text
    assert "overrides={'train.batch_size': ...}" in text and "must be an integer >= 1, got 0" in text


def test_a_field_given_twice_is_an_error():
    with pytest.raises(ConfigError) as info:
        Config.from_kwargs(max_steps=3, steps=4, overrides={"train.steps": 5})
    assert paths(info) == ["steps", "overrides"]
    assert "sets train.steps, which max_steps also sets" in str(info.value)


@pytest.mark.parametrize("key, value, where", [
    ("optimizer", torch.optim.SGD, "Trainer.fit(..., optimizer=...)"),
    ("schedule", object(), "Trainer.fit(..., scheduler=...)"),
])
def test_an_object_for_a_name_keyword_points_to_fit(key, value, where):
    with pytest.raises(ConfigError) as info:
        Trainer(**{key: value})
    assert paths(info) == [key] and where in str(info.value)


@pytest.mark.parametrize("config, message", [
    ("run.yaml", "must be a torchimpl.Config, got str; build one with torchimpl.load_config('run.yaml')"),
    ({"train": {"steps": 3}}, "must be a torchimpl.Config, got dict"),
    (nn.Linear(2, 1), "got a model (Linear): the model goes to fit(model, train_data, val_data)"),
])
def test_trainer_takes_a_config_and_names_anything_else(config, message):
    with pytest.raises(ConfigError) as info:
        Trainer(config)
    assert paths(info) == ["config"] and message in str(info.value)


def test_one_callback_is_taken_as_a_list_of_one():
    cb = Callback()
    assert Trainer(callbacks=cb).callbacks == [cb] and Trainer(callbacks=[cb, cb]).callbacks == [cb, cb]


# ---------------------------------------------------------------- a run, and the package


class LossModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.lin(x).float() - y) ** 2).mean()


def test_a_keyword_trainer_trains_in_bf16_and_says_so():
    torch.manual_seed(0)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    summary = Trainer(precision="bf16-mixed", max_steps=3, device="cpu").fit(LossModel(), data)
    assert (summary.precision_mode, summary.autocast_dtype, summary.steps) == ("bf16", "bfloat16", 3)
    assert summary.precision_note.startswith("'bf16-mixed' (Lightning) means bf16 autocast")
    assert summary.to_dict()["precision_note"] == summary.precision_note


def test_a_run_summary_reads_by_key_as_its_dict_does():
    torch.manual_seed(0)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    summary = Trainer(max_steps=2, device="cpu", overrides={"logging.dir": None}).fit(LossModel(), data)
    plain = summary.to_dict()
    assert plain["final_train_loss"] == summary.final_train_loss and plain["steps"] == 2
    assert {key: summary[key] for key in plain} == plain
    with pytest.raises(KeyError, match="no key 'final_loss'; keys: device, .*final_train_loss"):
        summary["final_loss"]


def test_every_public_config_name_is_exported():
    for name in (n for n in torchimpl.config.schema.__all__ if not n.isupper()):  # constants stay in their module
        assert name in torchimpl.__all__ and getattr(torchimpl, name) is getattr(torchimpl.config.schema, name)
    for name in ("PrecisionConfig", "OptimizerConfig", "ScalerConfig", "canonical_mode", "ResumeError"):
        assert name in torchimpl.__all__
    assert all(hasattr(torchimpl, name) for name in torchimpl.__all__)
