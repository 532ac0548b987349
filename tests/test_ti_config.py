"""Configuration: defaults < file < overrides, round trip, and one error naming every bad field."""

from __future__ import annotations

import pytest

from torchimpl.config.schema import Config, ConfigError, TrainConfig, load_config
from torchimpl.train.schedule import lr_at, lr_from_table, lr_table
from torchimpl.config.schema import ScheduleConfig

import torch


def test_precedence_defaults_file_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train: {steps: 50, microbatches: 2}\noptimizer: {lr: 3e-4}\n")
    c = load_config(f, ["train.steps=7", "train.clip_norm=null"])
    assert (c.train.steps, c.train.microbatches, c.train.clip_norm) == (7, 2, None)
    assert c.optimizer.lr == 3e-4 and c.train.batch_size == TrainConfig().batch_size


def test_round_trip():
    c = load_config(overrides=["optimizer.betas=[0.8, 0.95]", "schedule.name=constant"])
    assert Config.from_dict(c.to_dict()) == c


def test_every_bad_field_is_named_in_one_error():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({
            "bogus": 1,
            "train": {"steps": 0, "stepz": 3, "clip_norm": "x", "on_nonfinite": "panic", "compile": "yes"},
            "schedule": {"min_lr_ratio": 2.0},
            "checkpoint": {"keep_last": 0},
            "optimizer": {"lr": -1.0},
            "scaler": {"growth_factor": 0.5},
            "task": {"name": "nope"},
        })
    paths = {p for p, _ in info.value.errors}
    want = {"bogus", "train.steps", "train.stepz", "train.clip_norm", "train.on_nonfinite", "train.compile",
            "schedule.min_lr_ratio", "checkpoint.keep_last", "optimizer.lr", "scaler.growth_factor", "task.name"}
    assert want <= paths, f"not named: {want - paths}"
    text = str(info.value)
    assert "did you mean 'steps'" in text and "'skip', 'stop'" in text and ">= 1" in text


def test_bad_override_syntax_and_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(overrides=["train.steps"])
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "none.yaml")
    (tmp_path / "l.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "l.yaml")


def test_schedule_warmup_cosine_and_device_form_agree():
    s = ScheduleConfig(name="cosine", warmup_steps=4, min_lr_ratio=0.1)
    lrs = [lr_at(n, 1.0, s, 20) for n in range(25)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == 1.0
    assert lrs[20] == pytest.approx(0.1) and lrs[24] == pytest.approx(0.1)
    table = lr_table(1.0, s, 20, "cpu", last=24)
    dev = [lr_from_table(table, torch.tensor(n)).item() for n in range(25)]
    assert table.dtype == torch.float32 and dev == [float(torch.tensor(x, dtype=torch.float32)) for x in lrs]


def test_cross_field_error_is_reported_when_each_field_alone_is_valid():
    # min_scale and init_scale are each valid against the defaults; only together do they clash.
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"scaler": {"min_scale": 100.0, "init_scale": 50.0}})
    assert ("scaler", ) == tuple(p for p, _ in info.value.errors)
    assert "init_scale must be >= min_scale" in str(info.value)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_guard_is_refused_in_distributed_runs(engine):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["train.guard=true", f"train.distributed={engine}"])
    assert [p for p, _ in info.value.errors] == ["train.guard"]
    assert "distributed=none" in str(info.value)


def test_an_override_into_a_section_that_is_not_a_mapping_is_an_error():
    with pytest.raises(ConfigError, match=r"task: must be a mapping of keys to values, got 'mlp'"):
        load_config(data={"task": "mlp"}, overrides=["task.size=tiny"])
    with pytest.raises(ConfigError, match=r"task: must be a mapping"):
        load_config(data={"task": "mlp"})
    assert load_config(data={"task": {"name": "mlp"}}, overrides=["task.size=tiny"]).task.name == "mlp"


# Every field with a domain, at a value just outside it: (overrides, the field, what the error
# must say of the allowed range). The value is named too, as "got <value>".
_OUT_OF_DOMAIN = [
    (["optimizer.lr=0"], "optimizer.lr", "> 0"),
    (["optimizer.lr=-1e-3"], "optimizer.lr", "> 0"),
    (["optimizer.eps=0"], "optimizer.eps", "> 0"),
    (["optimizer.name=adagrad", "optimizer.eps=0"], "optimizer.eps", "> 0"),
    (["optimizer.betas=[0.9, 1.0]"], "optimizer.betas", "[0, 1)"),
    (["optimizer.betas=[-0.1, 0.9]"], "optimizer.betas", ">= 0.0"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay", ">= 0.0"),
    (["optimizer.name=sgd", "optimizer.momentum=-0.9"], "optimizer.momentum", ">= 0.0"),
    (["optimizer.name=adadelta", "optimizer.rho=1.5"], "optimizer.rho", "[0, 1]"),
    (["optimizer.name=rmsprop", "optimizer.alpha=-1"], "optimizer.alpha", ">= 0.0"),
    (["optimizer.name=adafactor", "optimizer.d=0.5"], "optimizer.d", ">= 1.0"),
    (["train.clip_norm=0"], "train.clip_norm", "> 0 or null"),
    (["train.steps=0"], "train.steps", ">= 1"),
    (["train.microbatches=0"], "train.microbatches", ">= 1"),
    (["train.batch_size=0"], "train.batch_size", ">= 1"),
    (["train.log_interval=0"], "train.log_interval", ">= 1"),
    (["train.distributed_timeout_s=0"], "train.distributed_timeout_s", "> 0"),
    (["scaler.growth_factor=1"], "scaler.growth_factor", "> 1"),
    (["scaler.backoff_factor=1"], "scaler.backoff_factor", "> 0 and < 1"),
    (["scaler.backoff_factor=0"], "scaler.backoff_factor", "> 0 and < 1"),
    (["scaler.growth_interval=0"], "scaler.growth_interval", ">= 1"),
    (["scaler.init_scale=0"], "scaler.init_scale", "> 0"),
    (["scaler.hysteresis=0"], "scaler.hysteresis", ">= 1"),
    (["schedule.min_lr_ratio=1.5"], "schedule.min_lr_ratio", "[0, 1]"),
    (["schedule.warmup_steps=-1"], "schedule.warmup_steps", ">= 0"),
    (["schedule.decay_steps=0"], "schedule.decay_steps", ">= 1"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last", ">= 1"),
    (["checkpoint.interval=-1"], "checkpoint.interval", ">= 0"),
    (["logging.precision_stats=-1"], "logging.precision_stats", ">= 0"),
]


@pytest.mark.parametrize("overrides, path, allowed", _OUT_OF_DOMAIN, ids=[" ".join(c[0]) for c in _OUT_OF_DOMAIN])
def test_a_value_outside_its_fields_domain_is_refused_naming_field_value_and_range(overrides, path, allowed):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    [(where, message)] = info.value.errors
    value = overrides[-1].split("=", 1)[1]
    if value.startswith("["):  # a pair: the error names the item that is out of range
        value = next(v for v in value.strip("[]").split(", ") if not 0 <= float(v) < 1)
    assert where == path and allowed in message, (where, message)
    assert message.startswith("must") or message.startswith(path.rsplit(".", 1)[-1]), message  # no class name
    assert f"got {float(value)!r}" in message or f"got {value}" in message, message
