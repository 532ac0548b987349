"""Ctrl-C inside an accumulation window, then a resume: the run stops at the next step boundary,
saves, and the resumed run ends where the uninterrupted one does, bit for bit on CPU."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from torchimpl.run.checkpoint import load_checkpoint
from torchimpl.config.schema import load_config
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer


def _cfg(tmp_path, name):
    folder = tmp_path / name
    return load_config(overrides=["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=8",
                                  "train.batch_size=4", "train.microbatches=3", "precision.mode=bf16",
                                  "train.force_scaler=true", "scaler.growth_interval=2", "train.log_interval=1",
                                  f"checkpoint.folder={folder}", "checkpoint.interval=100",
                                  f"train.trace_file={folder / 'trace.jsonl'}"])


def _fit(cfg, callbacks=(), resume=None):
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    trainer = Trainer(cfg, callbacks)
    return trainer, trainer.fit(task.model, task.train_data, loss_fn=task.loss_fn, resume=resume)


class CtrlC(Callback):
    """SIGINT to this process after the second microbatch of step 3's window."""

    def on_microbatch_end(self, trainer, state):
        if state.step == 3 and state.window_done == 2:
            os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def ctrl_c_handled():
    """SIGINT raises KeyboardInterrupt in this test, as in a terminal, however the suite was
    started: a shell starts a background job (``pytest &``, ``nohup``) with SIGINT ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_mid_window_stops_at_the_boundary_and_resumes_bit_for_bit(tmp_path, ctrl_c_handled):
    straight, _ = _fit(_cfg(tmp_path, "straight"))
    cut = _cfg(tmp_path, "cut")
    _, summary = _fit(cut, [CtrlC()])
    assert summary.outcome == "interrupted:SIGINT" and summary.steps == 4  # step 3's window finished
    saved = load_checkpoint(summary.last_checkpoint)
    assert saved["trainer"]["step"] == 4 and saved["trainer"]["window_size"] == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler was put back
    resumed, done = _fit(cut, resume="latest")
    assert done.outcome == "completed" and done.steps == 8
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert (tmp_path / "cut" / "trace.jsonl").read_bytes() == (tmp_path / "straight" / "trace.jsonl").read_bytes()
