"""The embedded tasks' training settings: one source (torchimpl.config.embedded), the same in
``ampspec train`` and ``ampspec compare``, and never over a value the user gave."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchimpl.cli.compare import run_config
from torchimpl.config.schema import load_config
from torchimpl.config.embedded import TASK_DEFAULTS
from torchimpl.train.optim import OptimizerConfig


@pytest.mark.parametrize("task", ["lm", "mlp"])
def test_compare_trains_each_embedded_task_as_train_does(task, tmp_path):
    train = load_config(overrides=[f"task.name={task}"], task_defaults=True)
    for label, mode in (("fp32", "fp32"), ("bf16", "bf16")):
        run = run_config(label, mode, [], dev="cpu", task=task, steps=200, seed=0, eval_every=10, out=tmp_path)
        assert run.optimizer == train.optimizer and run.schedule == train.schedule, (run.optimizer, train.optimizer)
    assert train.optimizer.lr == TASK_DEFAULTS[task]["optimizer"]["lr"] != OptimizerConfig().lr
    assert train.schedule.warmup_steps == TASK_DEFAULTS[task]["schedule"]["warmup_steps"]


def test_a_users_task_keeps_the_general_defaults_in_both_commands(tmp_path):
    train = load_config(overrides=["task.name=mymodule:make"], task_defaults=True)
    run = run_config("fp32", "fp32", [], dev="cpu", task="mymodule:make", steps=50, seed=0, eval_every=5,
                     out=tmp_path)
    assert train.optimizer == run.optimizer == OptimizerConfig()
    assert train.schedule.warmup_steps == run.schedule.warmup_steps == 0


def test_what_the_user_writes_wins_over_the_tasks_settings(tmp_path: Path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("task: {name: lm}\noptimizer: {lr: 1.0e-4}\n")
    c = load_config(cfg, task_defaults=True)
    assert c.optimizer.lr == 1e-4 and c.schedule.warmup_steps == TASK_DEFAULTS["lm"]["schedule"]["warmup_steps"]
    c = load_config(overrides=["schedule.warmup_steps=0", "optimizer.weight_decay=0.0"], task_defaults=True)
    assert c.schedule.warmup_steps == 0 and c.optimizer.lr == TASK_DEFAULTS["lm"]["optimizer"]["lr"]
    assert c.optimizer.weight_decay == 0.0


def test_a_configuration_loaded_for_ones_own_model_keeps_the_general_defaults():
    # task.name defaults to lm, but from Python the model is the caller's: no task settings.
    c = load_config()
    assert c.optimizer == OptimizerConfig() and c.schedule.warmup_steps == 0
