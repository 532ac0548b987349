"""``logging.precision_stats``: the TensorBoard scalars beside the CSV rows, and a resumed run's
rows (``torchimpl.train.precision_stats`` rule 2). The scalars are checked through a recording writer
in every run (CI installs ``.[test]``, without tensorboard) and through the real package when it
is installed."""

from __future__ import annotations

import csv
import math
from typing import ClassVar

import pytest

import torchimpl.run.metrics
from torchimpl.config.schema import load_config
from torchimpl.train.precision_stats import FILE_NAME
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer


def _cfg(folder, *sets):
    return load_config(overrides=["device=cpu", "task.name=mlp", "task.size=tiny", "train.batch_size=4",
                                  "train.steps=5", "precision.mode=bf16", f"checkpoint.folder={folder}",
                                  "logging.precision_stats=2", *sets])


def _fit(cfg, callbacks=(), resume=None):
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    return Trainer(cfg, callbacks).fit(task.model, task.train_data, loss_fn=task.loss_fn, resume=resume)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class RecordingWriter:
    """Stands in for SummaryWriter: every scalar as (tag, value, step)."""

    written: ClassVar[list[tuple[str, float, int]]] = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir = log_dir

    def add_scalar(self, tag, value, global_step=None):
        RecordingWriter.written.append((tag, value, global_step))

    def flush(self):
        pass

    def close(self):
        pass


STATS = ("amax", "headroom_bits", "subnormal_fraction")


def test_the_scalars_are_the_csv_rows(tmp_path, monkeypatch):
    RecordingWriter.written = []
    monkeypatch.setattr(torchimpl.run.metrics, "_summary_writer_class", lambda: RecordingWriter)
    _fit(_cfg(tmp_path / "ck", "logging.tensorboard=true"))
    rows = _rows(tmp_path / "ck" / FILE_NAME)
    assert sorted({int(r["step"]) for r in rows}) == [0, 2, 4]
    expected = {(f"precision/{r['module']}/{k}", float(r[k]), int(r["step"]))
                for r in rows for k in STATS if math.isfinite(float(r[k]))}
    got = {(tag, value, step) for tag, value, step in RecordingWriter.written if tag.startswith("precision/")}
    assert got == expected
    assert ("precision/net.0/amax", float(next(r for r in rows if r["module"] == "net.0")["amax"]), 0) in got
    assert len([w for w in RecordingWriter.written if w[0].startswith("precision/")]) == len(expected)  # once each


def test_without_tensorboard_only_the_csv_is_written(tmp_path, monkeypatch):
    RecordingWriter.written = []
    monkeypatch.setattr(torchimpl.run.metrics, "_summary_writer_class", lambda: RecordingWriter)
    _fit(_cfg(tmp_path / "ck", "logging.tensorboard=false"))
    assert _rows(tmp_path / "ck" / FILE_NAME) and RecordingWriter.written == []


def test_the_scalars_reach_tensorboards_event_files_when_installed(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (ampspec[tensorboard])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _fit(_cfg(tmp_path / "ck", "logging.tensorboard=true"))
    events = EventAccumulator(str(tmp_path / "ck"))
    events.Reload()
    amax = {e.step: e.value for e in events.Scalars("precision/net.0/amax")}
    rows = [r for r in _rows(tmp_path / "ck" / FILE_NAME) if r["module"] == "net.0"]
    assert sorted(amax) == [0, 2, 4]
    for r in rows:  # TensorBoard keeps float32
        assert amax[int(r["step"])] == pytest.approx(float(r["amax"]), rel=2 ** -23)


class CrashAt(Callback):
    """Dies like a killed run: after a checkpoint, with rows of a later step already written."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, state):
        if state.step == self.step:
            raise RuntimeError("killed")


def test_a_resumed_run_has_the_uninterrupted_runs_rows(tmp_path):
    _fit(_cfg(tmp_path / "straight", "logging.tensorboard=false"))
    cut = _cfg(tmp_path / "cut", "logging.tensorboard=false", "checkpoint.interval=2")
    with pytest.raises(RuntimeError, match="killed"):
        _fit(cut, [CrashAt(4)])
    # the checkpoint is at step 2; step 2's rows (written when it ended) are past it
    assert sorted({int(r["step"]) for r in _rows(tmp_path / "cut" / FILE_NAME)}) == [0, 2]
    _fit(cut, resume="latest")
    straight, resumed = _rows(tmp_path / "straight" / FILE_NAME), _rows(tmp_path / "cut" / FILE_NAME)
    assert [(r["step"], r["module"]) for r in resumed] == [(r["step"], r["module"]) for r in straight]
    assert resumed == straight  # bit for bit on CPU


def test_a_link_planted_as_the_statistics_file_is_refused_before_any_work(tmp_path):
    from torchimpl.run.folder import RunFolderError  # noqa: F401 - the refusal is a ValueError

    (tmp_path / "ck").mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep")
    (tmp_path / "ck" / FILE_NAME).symlink_to(target)
    with pytest.raises(ValueError, match=rf"precision statistics file .*{FILE_NAME} is a symbolic link"):
        _fit(_cfg(tmp_path / "ck", "logging.tensorboard=false"))
    assert target.read_text() == "keep"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [FILE_NAME]


def test_another_runs_statistics_file_is_another_runs_file(tmp_path):
    from torchimpl.run.folder import RunFolderError

    _fit(_cfg(tmp_path / "ck", "logging.tensorboard=false", "logging.csv=false", "checkpoint.folder=null",
              f"logging.dir={tmp_path / 'ck'}"))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [FILE_NAME]
    with pytest.raises(RunFolderError, match=FILE_NAME):
        _fit(_cfg(tmp_path / "ck", "logging.tensorboard=false", "logging.csv=false", "checkpoint.folder=null",
                  f"logging.dir={tmp_path / 'ck'}"))


def test_statistics_without_a_run_folder_are_refused_naming_the_fix():
    from torchimpl.config.schema import ConfigError

    with pytest.raises(ConfigError, match=r"logging.precision_stats: 2 needs a run folder, but logging.dir is null"):
        load_config(overrides=["logging.dir=null", "logging.precision_stats=2"])


def test_a_fit_that_fails_mid_run_leaves_no_hook_on_the_model(tmp_path):
    cfg = _cfg(tmp_path)
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)

    def data():  # two batches, then the data source breaks
        for i, batch in enumerate(task.train_data):
            if i == 2:
                raise RuntimeError("the data source broke")
            yield batch

    with pytest.raises(Exception, match="the data source broke"):
        Trainer(cfg).fit(task.model, data(), loss_fn=task.loss_fn)
    assert (tmp_path / FILE_NAME).exists()  # the statistics were on, so hooks were hung
    left = [name for name, m in task.model.named_modules()
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks]
    assert not left, f"hooks left on {left}"
