"""A callback that leaves a trainer state field of the wrong type: named at once, the run fails
and its checkpoints stay good (``torchimpl.train.callback_checks``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchimpl.train.callback_checks import CallbackStateError
from torchimpl.run.checkpoint import list_checkpoints, load_checkpoint
from torchimpl.config.schema import load_config
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer


def _cfg(folder, *sets):
    return load_config(overrides=["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=6",
                                  "train.batch_size=8", "train.log_interval=2", f"checkpoint.folder={folder}",
                                  "checkpoint.interval=2", *sets])


def _fit(cfg, callbacks=(), resume=None):
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    trainer = Trainer(cfg, callbacks)
    summary = trainer.fit(task.model, task.train_data, loss_fn=task.loss_fn, resume=resume)
    return trainer, summary


class SetAt(Callback):
    """Sets ``state.<field>`` to ``value`` in ``hook`` at step ``at``."""

    def __init__(self, hook, field, value, at=3):
        self.hook, self.field, self.value, self.at = hook, field, value, at
        self.seen = None

    def _maybe(self, trainer):
        if trainer.state.step == self.at:
            setattr(trainer.state, self.field, self.value)

    def on_step_end(self, trainer, state):
        if self.hook == "on_step_end":
            self._maybe(trainer)

    def on_after_backward(self, trainer, state):
        if self.hook == "on_after_backward":
            self._maybe(trainer)

    def on_log(self, trainer, state, records, losses):
        if self.hook == "on_log":
            self._maybe(trainer)

    def on_fit_start(self, trainer):
        if self.hook == "on_fit_start":
            setattr(trainer.state, self.field, self.value)


def test_a_string_step_is_named_and_the_last_checkpoint_resumes_bit_for_bit(tmp_path):
    cfg = _cfg(tmp_path / "ck")
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    trainer = Trainer(cfg, [SetAt("on_step_end", "step", "3")])
    with pytest.raises(CallbackStateError) as info:
        trainer.fit(task.model, task.train_data, loss_fn=task.loss_fn)
    assert trainer.state.step == 3  # put back: what the trainer holds stays a run's state
    text = str(info.value)
    assert "callback SetAt.on_step_end set trainer.state.step" in text
    assert "non-negative int, got '3' (str)" in text and "Fix:" in text
    ckpts = list_checkpoints(tmp_path / "ck")
    assert [p.name for p in ckpts] == ["step-00000002.ckpt"]
    assert load_checkpoint(ckpts[0])["trainer"]["step"] == 2
    straight, _ = _fit(_cfg(tmp_path / "straight"))
    resumed, summary = _fit(_cfg(tmp_path / "ck"), resume="latest")
    assert summary.steps == 6 and summary.outcome == "completed"
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("hook, field, value, fragment", [
    ("on_after_backward", "window_done", 1.5, "got 1.5 (float)"),
    ("on_step_end", "applied_steps", np.int64(3), "(int64)"),
    ("on_step_end", "samples", -1, "got -1"),
    ("on_step_end", "epoch", True, "got True (bool)"),
    ("on_log", "last_train_loss", "low", "must be a float or None, got 'low' (str)"),
    ("on_fit_start", "step", None, "got None (NoneType)"),
])
def test_each_wrong_field_is_named_with_its_hook(tmp_path, hook, field, value, fragment):
    with pytest.raises(CallbackStateError) as info:
        _fit(_cfg(tmp_path / "ck"), [SetAt(hook, field, value, at=2 if hook == "on_log" else 3)])
    assert f"SetAt.{hook} set trainer.state.{field}: " in str(info.value) and fragment in str(info.value)
    for path in list_checkpoints(tmp_path / "ck"):  # whatever was saved before the hook verifies
        assert load_checkpoint(path)["trainer"]["step"] <= 2


def test_values_of_the_right_type_are_the_callbacks_to_set(tmp_path):
    class Ahead(Callback):
        def on_step_end(self, trainer, state):
            if state.step == 2:
                state.step = 5  # skip ahead: an int, allowed
                state.best_val_loss = 0.25

    _, summary = _fit(_cfg(tmp_path / "ck"), [Ahead()])
    assert summary.steps == 6 and summary.best_val_loss == 0.25


def test_the_command_line_exits_non_zero_naming_the_callback(tmp_path, monkeypatch, capsys):
    import torchimpl.train.trainer
    from torchimpl.cli.app import main

    monkeypatch.setattr(torchimpl.train.trainer, "precision_stats_callbacks",
                        lambda config: [SetAt("on_step_end", "step", "3")])
    code = main(["train", "--set", "device=cpu", "--set", "task.name=mlp", "--set", "task.size=tiny",
                 "--set", "train.steps=6", "--set", "train.batch_size=8",
                 "--set", f"checkpoint.folder={tmp_path / 'ck'}", "--set", "checkpoint.interval=2"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "SetAt.on_step_end set trainer.state.step" in err
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step-00000002.ckpt"]
    monkeypatch.setattr(torchimpl.train.trainer, "precision_stats_callbacks", lambda config: [])
    code = main(["train", "--set", "device=cpu", "--set", "task.name=mlp", "--set", "task.size=tiny",
                 "--set", "train.steps=6", "--set", "train.batch_size=8",
                 "--set", f"checkpoint.folder={tmp_path / 'ck'}", "--set", "checkpoint.interval=2", "--resume"])
    assert code == 0, capsys.readouterr().err


def test_a_fit_that_fails_in_on_fit_start_closes_its_run_files(tmp_path):
    """The trace and metrics files are open when ``on_fit_start`` runs; a callback that raises
    there ends the fit before its loop, and the files are closed all the same (no file left open
    for the collector to find later)."""
    from torchimpl.config.schema import load_config
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Callback, Trainer

    class Fails(Callback):
        def on_fit_start(self, trainer):
            self.reporter = trainer.reporter
            raise RuntimeError("on_fit_start failed")

    cfg = load_config(overrides=["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=2",
                                 "train.batch_size=4", f"train.trace_file={tmp_path / 'trace.jsonl'}",
                                 f"logging.dir={tmp_path / 'runs'}", "logging.progress=off"])
    cb = Fails()
    task = build_task(cfg.task, seed=0, batch_size=4)
    with pytest.raises(RuntimeError, match="on_fit_start failed"):
        Trainer(cfg, [cb]).fit(task.model, task.train_data)
    writer = cb.reporter.writer
    assert writer is not None and writer._file is None, "the trace file was left open"
    assert cb.reporter.metrics and all(getattr(s, "_file", None) is None and getattr(s, "_writer", None) is None
                                       for s in cb.reporter.metrics), "a metrics file was left open"
