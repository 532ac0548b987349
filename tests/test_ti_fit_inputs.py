"""Bad arguments to ``Trainer.fit``: refused before any work, naming the argument and the fix."""

from __future__ import annotations

import pytest
import torch

from torchimpl.run.checkpoint import CheckpointError
from torchimpl.config.schema import load_config
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer


def _cfg(*sets):
    return load_config(overrides=["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=2",
                                  "train.batch_size=8", "logging.dir=null", *sets])


class Started(Callback):
    def __init__(self):
        self.started = False

    def on_fit_start(self, trainer):
        self.started = True


@pytest.mark.parametrize("data, message", [
    (1, "train_data is of type int, not batches"),
    ("abc", "train_data is of type str, not batches"),
    ([], "train_data holds no batches"),
    (["a", "b"], "train_data[0] is a str holding no tensor"),
    ([{"x": 1}], "train_data[0] is a dict holding no tensor"),
])
def test_train_data_that_is_not_batches_is_refused_before_any_work(data, message):
    task = build_task(_cfg().task, seed=0, batch_size=8)
    before = [p.detach().clone() for p in task.model.parameters()]
    started = Started()
    with pytest.raises(ValueError) as info:
        Trainer(_cfg(), [started]).fit(task.model, data, loss_fn=task.loss_fn)
    assert message in str(info.value)
    assert not started.started
    assert all(torch.equal(a, b) for a, b in zip(before, task.model.parameters()))


def test_a_folder_given_as_the_checkpoint_to_resume_is_named_as_a_folder(tmp_path):
    task = build_task(_cfg().task, seed=0, batch_size=8)
    with pytest.raises(CheckpointError, match=r"is a folder, not a checkpoint: give a checkpoint file"):
        Trainer(_cfg(f"checkpoint.folder={tmp_path / 'ck'}")).fit(task.model, task.train_data, resume=tmp_path)


@pytest.mark.parametrize("sets, resume, message", [
    ((), "latest", "resume='latest' needs checkpoint.folder"),
    ((), "missing.ckpt", "cannot read checkpoint missing.ckpt: No such file or directory; give an existing"),
])
def test_a_resume_from_nothing_is_refused_before_the_model_moves(sets, resume, message, monkeypatch):
    import torchimpl.train.trainer

    calls = []
    monkeypatch.setattr(torchimpl.train.trainer, "resolve_precision", lambda *a, **k: calls.append(a))
    task = build_task(_cfg().task, seed=0, batch_size=8)
    with pytest.raises(ValueError, match=message):
        Trainer(_cfg(*sets)).fit(task.model, task.train_data, resume=resume)
    assert calls == []  # refused before the set-up began


def test_save_checkpoint_never_replaces_a_file_that_is_not_a_checkpoint(tmp_path):
    from torchimpl.run.checkpoint import save_checkpoint

    notes = tmp_path / "notes.txt"
    notes.write_text("keep me\n")
    refused = []

    class SaveOver(Callback):
        def on_step_end(self, trainer, state):
            for path in (notes, tmp_path):
                try:
                    trainer.save_checkpoint(path)
                except ValueError as exc:
                    refused.append(str(exc))
            trainer.save_checkpoint(tmp_path / "ok.ckpt")  # a new file, then a checkpoint: replaced
            trainer.save_checkpoint(tmp_path / "ok.ckpt")

    task = build_task(_cfg().task, seed=0, batch_size=8)
    Trainer(_cfg("train.steps=1"), [SaveOver()]).fit(task.model, task.train_data, loss_fn=task.loss_fn)
    assert notes.read_text() == "keep me\n"
    assert "notes.txt exists and is not an ampspec checkpoint" in refused[0] and "is a folder" in refused[1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    torn = tmp_path / "torn.ckpt"
    torn.write_bytes(b"AMPSPEC-CHE")  # a header cut short: a damaged checkpoint, replaceable
    save_checkpoint({"format": 1}, torn)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    save_checkpoint({"format": 1}, empty)


class Mine(Callback):
    def on_step_end(self, trainer, state):
        pass


class Duck:
    def on_step_end(self, trainer, state):
        pass


@pytest.mark.parametrize("callbacks, message", [
    ([Mine], r"callbacks\[0\] is the class Mine, not an instance: pass Mine\(\)"),
    ([Mine(), Duck()], r"callbacks\[1\] is a Duck, not a Callback: subclass torchimpl.Callback"),
    ([object()], r"callbacks\[0\] is a object, not a Callback"),
    ("abc", "callbacks must be a list of Callback instances, got str"),
    (3, "callbacks must be a list of Callback instances, got int"),
])
def test_callbacks_that_are_not_callback_instances_are_refused_when_the_trainer_is_made(callbacks, message):
    with pytest.raises(TypeError, match=message):
        Trainer(_cfg(), callbacks)
    assert len(Trainer(_cfg(), Mine()).callbacks) == 1  # one callback where a list belongs


def test_a_file_under_a_checkpoints_name_is_the_runs_own_however_damaged(tmp_path):
    from torchimpl.run.checkpoint import save_checkpoint

    damaged = tmp_path / "step-00000003.ckpt"
    damaged.write_text("not a checkpoint any more\n")
    save_checkpoint({"format": 1}, damaged)
    assert damaged.read_bytes().startswith(b"AMPSPEC-CHECKPOINT")
