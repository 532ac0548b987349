"""``Trainer.fit`` applies the run folder rule and the run lock itself (``torchimpl.run.folder``
rule 6, ``torchimpl.run.lock`` rules 4-5): a run started from Python never overwrites another."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from torchimpl.config.schema import load_config
from torchimpl.run.folder import RunFolderError
from torchimpl.run.lock import RunLockedError, hold
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, *sets):
    return load_config(overrides=["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=4",
                                  "train.batch_size=8", "train.log_interval=2", f"checkpoint.folder={tmp_path / 'ck'}",
                                  "checkpoint.interval=2", f"train.trace_file={tmp_path / 'trace.jsonl'}", *sets])


def _fit(cfg, callbacks=(), **kw):
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    trainer = Trainer(cfg, callbacks)
    return trainer, trainer.fit(task.model, task.train_data, loss_fn=task.loss_fn, **kw)


def _checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_fresh_fit_into_the_folder_is_refused_and_changes_no_byte(tmp_path):
    _fit(_cfg(tmp_path))
    before = _checksums(tmp_path)
    assert "ck/step-00000004.ckpt" in before and "trace.jsonl" in before
    with pytest.raises(RunFolderError) as info:
        _fit(_cfg(tmp_path, "train.steps=2"))
    text = str(info.value)
    assert str(tmp_path / "ck") in text and "step-00000004.ckpt" in text and "trace.jsonl" in text
    assert "fit(..., resume='latest')" in text and "fit(..., overwrite=True)" in text and "--" not in text
    assert _checksums(tmp_path) == before


def test_only_the_trace_of_another_run_is_enough_to_refuse(tmp_path):
    _fit(_cfg(tmp_path, "checkpoint.folder=null"))
    with pytest.raises(RunFolderError, match="trace.jsonl"):
        _fit(_cfg(tmp_path, "checkpoint.folder=null"))


def test_resume_continues_and_overwrite_replaces(tmp_path):
    _fit(_cfg(tmp_path))
    _, resumed = _fit(_cfg(tmp_path, "train.steps=6"), resume="latest")
    assert resumed.steps == 6
    with pytest.warns(UserWarning, match=r"overwrite=True: removed the previous run's files"):
        replaced, summary = _fit(_cfg(tmp_path, "train.steps=2"), overwrite=True)
    assert summary.steps == 2
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.ckpt")) == ["step-00000002.ckpt"]
    fresh, _ = _fit(_cfg(tmp_path / "fresh", "train.steps=2"))
    for a, b in zip(replaced.model.state_dict().values(), fresh.model.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="contradict"):
        _fit(_cfg(tmp_path), resume="latest", overwrite=True)


def test_a_fit_into_a_folder_another_thread_trains_in_is_refused_at_once(tmp_path):
    errors: list[BaseException] = []

    class SecondRun(Callback):
        def on_step_end(self, trainer, state):
            if state.step != 1:
                return

            def other():
                try:
                    _fit(_cfg(tmp_path), resume="latest")  # a resume: the folder rule lets it in, the lock not
                except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                    errors.append(exc)

            t = threading.Thread(target=other)
            t.start()
            t.join()

    _, summary = _fit(_cfg(tmp_path), [SecondRun()])
    assert summary.steps == 4
    assert len(errors) == 1 and isinstance(errors[0], RunLockedError), errors
    assert "in use by another run in this process" in str(errors[0])


def test_a_fit_into_a_folder_another_process_holds_is_refused_naming_its_pid(tmp_path):
    code = ("import sys, time; from torchimpl.run.lock import hold\n"
            f"with hold({str(tmp_path / 'ck')!r}, 'ck'):\n"
            "    print('held', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=rf"pid {proc.pid}"):
            _fit(_cfg(tmp_path))
    finally:
        proc.kill()
        proc.wait()
    assert not list((tmp_path / "ck").glob("*.ckpt"))


def test_the_lock_is_the_threads_own(tmp_path):
    folder = tmp_path / "f"
    seen: list[BaseException] = []

    def other():
        try:
            with hold(folder, "f"):
                pass
        except RunLockedError as exc:
            seen.append(exc)

    with hold(folder, "f"):
        with hold(folder, "f"):  # the same thread again: held once more
            pass
        assert (folder / ".ampspec.lock").exists()  # the inner release kept the outer hold
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(seen) == 1
    t = threading.Thread(target=other)  # released: another thread may take it now
    t.start()
    t.join()
    assert len(seen) == 1 and not folder.exists()
