"""A disk that fills (or a folder that stops being writable) while a run writes its files: the
error names the file and the fix, the run exits non-zero, the checkpoints written before stay
good, and a resume gives the uninterrupted run's files (``torchimpl.safe_files`` rule 3)."""

from __future__ import annotations

import errno

import pytest
import torch

import torchimpl.run.checkpoint
import torchimpl.run.records
from torchimpl.run.checkpoint import list_checkpoints, load_checkpoint


def _args(folder, *more):
    sets = ["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=6", "train.batch_size=8",
            "train.log_interval=1", "checkpoint.interval=2", f"checkpoint.folder={folder}",
            f"train.trace_file={folder / 'trace.jsonl'}", *more]
    return ["train", *[a for s in sets for a in ("--set", s)]]


def _main(args, capsys):
    from torchimpl.cli.app import main

    code = main(args)
    return code, capsys.readouterr().err


def _full_disk() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def _same_run(a, b):
    assert (a / "trace.jsonl").read_bytes() == (b / "trace.jsonl").read_bytes()
    assert (a / "metrics.csv").read_bytes() == (b / "metrics.csv").read_bytes()
    ma, mb = load_checkpoint(a / "step-00000006.ckpt")["model"], load_checkpoint(b / "step-00000006.ckpt")["model"]
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_a_full_disk_during_a_checkpoint_names_it_and_the_resume_is_the_uninterrupted_run(tmp_path, monkeypatch,
                                                                                          capsys):
    code, err = _main(_args(tmp_path / "straight"), capsys)
    assert code == 0, err
    real, calls = torchimpl.run.checkpoint.os.fsync, []

    def fsync(fd):  # the second checkpoint's file (a directory fsync ignores its errors)
        calls.append(fd)
        if len(calls) == 3:
            raise _full_disk()
        return real(fd)

    monkeypatch.setattr(torchimpl.run.checkpoint.os, "fsync", fsync)
    folder = tmp_path / "full"
    code, err = _main(_args(folder), capsys)
    assert code == 1, err  # a failed run (environment), not a usage error
    assert f"checkpoint {folder / 'step-00000004.ckpt'}: cannot write: No space left on device" in err
    assert "free space" in err and "[Errno" not in err
    assert [p.name for p in list_checkpoints(folder)] == ["step-00000002.ckpt"]
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp")]
    load_checkpoint(folder / "step-00000002.ckpt")
    monkeypatch.setattr(torchimpl.run.checkpoint.os, "fsync", real)
    code, err = _main([*_args(folder), "--resume"], capsys)
    assert code == 0, err
    _same_run(tmp_path / "straight", folder)


class _FillsUp:
    """A text file whose disk fills during its ``n``-th write, half of it written: a torn line."""

    def __init__(self, f, n):
        self.f, self.n, self.writes = f, n, 0

    def write(self, text):
        self.writes += 1
        if self.writes == self.n:
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise _full_disk()
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_during_a_trace_write_leaves_a_torn_line_the_resume_cuts(tmp_path, monkeypatch, capsys):
    code, err = _main(_args(tmp_path / "straight"), capsys)
    assert code == 0, err
    real = torchimpl.run.records.open_run_file
    monkeypatch.setattr(torchimpl.run.records, "open_run_file", lambda *a, **k: _FillsUp(real(*a, **k), 5))
    folder = tmp_path / "full"
    code, err = _main(_args(folder), capsys)
    assert code == 1, err  # a failed run (environment), not a usage error
    assert f"trace file {folder / 'trace.jsonl'}: cannot write: No space left on device" in err
    assert not (folder / "trace.jsonl").read_text().endswith("\n")  # the torn line is there
    monkeypatch.setattr(torchimpl.run.records, "open_run_file", real)
    code, err = _main([*_args(folder), "--resume"], capsys)
    assert code == 0, err
    _same_run(tmp_path / "straight", folder)


def test_the_error_says_what_to_do_for_a_read_only_folder(tmp_path):
    from torchimpl.safe_files import RunFileWriteError, writing

    with pytest.raises(RunFileWriteError) as info, writing(tmp_path / "x.csv", "metrics file"):
        raise OSError(errno.EROFS, "Read-only file system")
    text = str(info.value)
    assert text.startswith(f"metrics file {tmp_path / 'x.csv'}: cannot write: Read-only file system;")
    assert "make that folder writable" in text and info.value.errno == errno.EROFS


def _denied_inside(monkeypatch, folder):
    """From the moment the returned function is called, every write into ``folder`` fails with
    EACCES, as in a folder made read-only (simulated at the system calls: root writes anywhere)."""
    import os
    from pathlib import Path

    denied = {"on": False}
    real_open, real_unlink, real_replace = os.open, os.unlink, os.replace

    def inside(p):
        return denied["on"] and Path(os.fspath(p)).resolve().is_relative_to(Path(folder).resolve())

    def deny(p):
        raise PermissionError(errno.EACCES, "Permission denied", os.fspath(p))

    def open_(p, flags, *a, **k):
        if inside(p) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            deny(p)
        return real_open(p, flags, *a, **k)

    def unlink(p, *a, **k):
        if inside(p):
            deny(p)
        return real_unlink(p, *a, **k)

    def replace(src, dst, *a, **k):
        if inside(dst):
            deny(dst)
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "replace", replace)
    return lambda: denied.update(on=True)


def _before_the_second_checkpoint(monkeypatch, action):
    from torchimpl.train.cadence import Checkpointer

    real, calls = Checkpointer.save, []

    def save(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            action()
        return real(self, *a, **k)

    monkeypatch.setattr(Checkpointer, "save", save)


def test_a_checkpoint_folder_made_read_only_mid_run_exits_1_naming_it_and_keeps_the_last_checkpoint(
        tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ro"
    _before_the_second_checkpoint(monkeypatch, _denied_inside(monkeypatch, folder))
    code, err = _main(_args(folder), capsys)
    assert code == 1, err  # the environment stopped a run: not a usage error, and no raw errno
    assert f"checkpoint {folder / 'step-00000004.ckpt'}: cannot write: Permission denied" in err, err
    assert "make that folder writable" in err and "[Errno" not in err and ".ampspec.lock" not in err, err
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(folder)] == ["step-00000002.ckpt"]
    load_checkpoint(folder / "step-00000002.ckpt")


def test_a_checkpoint_folder_removed_mid_run_exits_1_naming_it(tmp_path, monkeypatch, capsys):
    import shutil

    folder = tmp_path / "gone"
    _before_the_second_checkpoint(monkeypatch, lambda: shutil.rmtree(folder))
    code, err = _main(_args(folder), capsys)
    assert code == 1, err
    assert f"checkpoint.folder {folder}: it no longer exists (deleted or moved while the run wrote to it)" in err, err
    assert not folder.exists()  # not made again, holding a run without its start
