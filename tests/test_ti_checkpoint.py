"""Checkpoints: exact resume in a fresh process, corruption, mismatches, and SIGKILL while saving."""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from torchimpl.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from torchimpl.config.schema import load_config
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer

ROOT = Path(__file__).resolve().parents[1]

RUN = textwrap.dedent("""
    import sys, torch
    from torchimpl.config.schema import load_config
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Callback, Trainer
    mode, out, stop_step, stop_mb, *sets = sys.argv[1:]
    cfg = load_config(overrides=sets)
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    class StopAt(Callback):
        def on_microbatch_end(self, trainer, state):
            if state.step == int(stop_step) and state.window_done == int(stop_mb):
                trainer.save_checkpoint(); trainer.request_stop("test")
        def on_step_end(self, trainer, state):
            if int(stop_mb) == 0 and state.step == int(stop_step):
                trainer.save_checkpoint(); trainer.request_stop("test")
    cbs = [StopAt()] if mode == "part" else []
    t = Trainer(cfg, cbs)
    s = t.fit(task.model, task.train_data, resume="latest" if mode == "resume" else None)
    torch.save({"model": t.model.state_dict(), "opt": t.optimizer.state_dict(),
                "scaler": t.scaler.state_dict() if t.scaler else None,
                "lr": t.optimizer.param_groups[0]["lr"], "state": vars(t.state),
                "skipped": s.steps_skipped}, out)
""")


def _run(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", RUN, *map(str, args)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(args[1], weights_only=True)


def _assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where}: tensors differ (max |diff| {(a.double() - b.double()).abs().max()})"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("precision,stop_step,stop_mb", [
    ("fp32", 3, 1),  # inside an accumulation window
    ("bf16", 2, 0),  # right after a skipped step (the huge initial scale overflows at first)
])
def test_resume_in_a_fresh_process_is_bit_exact(tmp_path, precision, stop_step, stop_mb):
    sets = ["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=7", "train.microbatches=3",
            "train.batch_size=8", f"precision.mode={precision}", "train.force_scaler=true",
            "scaler.init_scale=3.0e38", "scaler.growth_interval=2", "schedule.warmup_steps=2"]
    full = _run(tmp_path, "full", tmp_path / "full.pt", -1, 0, *sets, f"checkpoint.folder={tmp_path / 'one'}")
    sets.append(f"checkpoint.folder={tmp_path / 'ck'}")
    assert full["skipped"] >= 1, "the planted overflow did not skip a step"
    _run(tmp_path, "part", tmp_path / "part.pt", stop_step, stop_mb, *sets)
    ck = list_checkpoints(tmp_path / "ck")
    assert ck[-1].name == f"step-{stop_step:08d}" + (f"-mb{stop_mb:03d}" if stop_mb else "") + ".ckpt"
    resumed = _run(tmp_path, "resume", tmp_path / "resumed.pt", -1, 0, *sets)
    _assert_same(full, resumed, "state")


def _tiny_trainer(tmp_path, **sets):
    over = ["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=2", "train.batch_size=4",
            f"checkpoint.folder={tmp_path}"] + [f"{k}={v}" for k, v in sets.items()]
    cfg = load_config(overrides=over)
    return Trainer(cfg), build_task(cfg.task, seed=0, batch_size=4)


def test_truncated_and_bit_flipped_files_are_rejected_and_the_previous_one_loads(tmp_path):
    t, task = _tiny_trainer(tmp_path, **{"checkpoint.interval": 1})
    t.fit(task.model, task.train_data)
    first, second = list_checkpoints(tmp_path)
    data = second.read_bytes()
    second.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(second)
    assert latest_checkpoint(tmp_path) == first
    flipped = bytearray(data)
    flipped[-100] ^= 0x10
    second.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(second)
    assert latest_checkpoint(tmp_path) == first
    load_checkpoint(first)


def test_checkpoint_from_another_model_is_refused(tmp_path):
    t, task = _tiny_trainer(tmp_path)
    t.fit(task.model, task.train_data)
    # The same configuration with another model passed to fit (a changed task.size is refused as
    # a configuration change instead, naming the field: tests/test_newcomer.py).
    other, _ = _tiny_trainer(tmp_path)
    task2 = build_task(load_config(overrides=["task.name=mlp", "task.size=small"]).task, seed=0, batch_size=4)
    with pytest.raises(CheckpointError, match="different model"):
        other.fit(task2.model, task2.train_data, resume="latest")


def test_scaler_state_mismatches_warn_and_say_what_was_done(tmp_path):
    t, task = _tiny_trainer(tmp_path)
    t.fit(task.model, task.train_data)
    t2, task2 = _tiny_trainer(tmp_path, **{"train.force_scaler": "true", "train.steps": 3})
    # Garbage of earlier tests finalised now, not inside the recorded window (a collection there
    # would add its ResourceWarnings to the resume's warnings).
    gc.collect()
    with pytest.warns(UserWarning) as seen:
        t2.fit(task2.model, task2.train_data, resume="latest")
    _only_these_warnings(seen, "no loss-scaler state.*starts fresh",
                         r"train.force_scaler: False \(checkpoint\) -> True \(now\); the new value is used")
    t3, task3 = _tiny_trainer(tmp_path, **{"train.steps": 4})
    gc.collect()
    with pytest.warns(UserWarning) as seen:
        t3.fit(task3.model, task3.train_data, resume="latest")
    _only_these_warnings(seen, "uses no scaler; the state was ignored",
                         r"train.force_scaler: True \(checkpoint\) -> False \(now\); the new value is used")


def _only_these_warnings(seen, *patterns: str) -> None:
    """Each pattern matches exactly one of the warnings ``seen`` caught, and every warning one
    pattern: an expected warning is asserted, and nothing else leaks into the test's output."""
    import re

    messages = [str(w.message) for w in seen]
    for pattern in patterns:
        assert sum(bool(re.search(pattern, m)) for m in messages) == 1, (pattern, messages)
    assert all(any(re.search(p, m) for p in patterns) for m in messages), messages


def test_keep_last_prunes_old_checkpoints(tmp_path):
    t, task = _tiny_trainer(tmp_path, **{"checkpoint.interval": 1, "checkpoint.keep_last": 2, "train.steps": 5})
    t.fit(task.model, task.train_data)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004.ckpt", "step-00000005.ckpt"]


def test_checkpoint_holds_only_plain_types(tmp_path):
    t, task = _tiny_trainer(tmp_path)
    t.fit(task.model, task.train_data)
    ck = load_checkpoint(latest_checkpoint(tmp_path))  # weights_only=True inside
    assert {"model", "optimizer", "schedule", "scaler", "trainer", "rng", "data", "config", "versions"} <= ck.keys()
    assert ck["versions"]["torch"] == str(torch.__version__)


SAVER = textwrap.dedent("""
    import sys, torch
    from torchimpl.run.checkpoint import save_checkpoint, checkpoint_name
    folder, start = sys.argv[1], int(sys.argv[2])
    blob = torch.arange(400_000, dtype=torch.float32)
    print("ready", flush=True)
    i = start
    while True:
        save_checkpoint({"format": 1, "i": i, "blob": blob + i}, f"{folder}/{checkpoint_name(i)}")
        i += 1
""")


def test_sigkill_while_saving_never_leaves_a_bad_newest_checkpoint(tmp_path):
    rng = random.Random(0)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = 0
    for _ in range(8):
        p = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path), str(start)], env=env,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p.stdout.close()
        newest = latest_checkpoint(tmp_path)
        if newest is None:
            continue
        ck = load_checkpoint(newest)
        assert torch.equal(ck["blob"], torch.arange(400_000, dtype=torch.float32) + ck["i"])
        assert newest == list_checkpoints(tmp_path)[-1], "the newest named checkpoint did not verify"
        start = ck["i"] + 1
    assert latest_checkpoint(tmp_path) is not None, "no save completed in any run"


_FORMAT1 = Path(__file__).parent / "data" / "format1-mlp-bf16-scaler-mid-window.ckpt"


def test_a_format_1_checkpoint_from_the_previous_trainer_resumes(tmp_path):
    """Written by the trainer before the step engine (inside step 3's window, bf16 with a forced
    scaler, clip 0.5, AdamW, cosine): everything it saved is restored as saved."""
    saved = load_checkpoint(_FORMAT1)
    assert saved["format"] == 1
    cfg = load_config(overrides=[
        "device=cpu", "task.name=mlp", "task.size=tiny", "precision.mode=bf16", "optimizer.name=adamw",
        "optimizer.lr=0.01", "schedule.name=cosine", "schedule.warmup_steps=2", "train.steps=6",
        "train.microbatches=2", "train.batch_size=4", "train.clip_norm=0.5", "train.seed=3",
        "train.force_scaler=true", "scaler.init_scale=1024", "scaler.growth_interval=2"])
    task = build_task(cfg.task, seed=3, batch_size=4)
    seen = {}

    class Restored(Callback):
        def on_fit_start(self, trainer):
            seen["state"] = dataclasses.asdict(trainer.state)
            seen["scaler"] = trainer.scaler.state_dict()
            seen["grads"] = [None if p.grad is None else p.grad.clone() for p in trainer.params]
            seen["model"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    summary = Trainer(cfg, callbacks=[Restored()]).fit(task.model, task.train_data, loss_fn=task.loss_fn,
                                                       resume=_FORMAT1)
    assert seen["state"] == saved["trainer"]
    assert seen["scaler"] == saved["scaler"]
    for mine, theirs in zip(seen["grads"], saved["accumulation"]["grads"]):
        assert torch.equal(mine, theirs), "the window's accumulated gradients were not restored as saved"
    for name, value in saved["model"].items():
        assert torch.equal(seen["model"][name], value), f"parameter {name} was not restored as saved"
    assert summary.steps == 6 and summary.stopped is None and math.isfinite(summary.final_train_loss)
