"""The run's lifecycle around its steps: faults, resumes, configuration changes, interrupts."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from torchimpl.run.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint
from torchimpl.config.schema import load_config
from torchimpl.run.records import read_trace
from torchimpl.run.state import ResumeError
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer

ROOT = Path(__file__).resolve().parents[1]


class Factor(nn.Module):
    """Linear regression whose loss is multiplied by the batch's third element."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y, factor):
        return ((self.lin(x) - y) ** 2).mean() * factor


def batches(n, poison=(), value=math.inf):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g),
             torch.tensor(value if i in poison else 1.0)) for i in range(n)]


def cfg(*sets):
    return load_config(overrides=["device=cpu", "train.log_interval=1", "optimizer.lr=0.1", *sets])


def _tiny(tmp_path, *sets):
    c = load_config(overrides=["device=cpu", "task.name=mlp", "task.size=tiny", "train.batch_size=4",
                               "train.steps=6", f"checkpoint.folder={tmp_path / 'ck'}", *sets])
    return c, build_task(c.task, seed=c.train.seed, batch_size=c.train.batch_size)


def _params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ 1. a collapsed scale


def test_a_collapsed_scale_stops_the_run_with_finite_weights_and_a_resumable_checkpoint(tmp_path):
    # Every batch overflows: the scale backs off from 2**-120 by halves until its float32
    # inverse overflows (below 2**-128), which torch's GradScaler would go on stepping with.
    c = cfg("train.steps=30", "train.force_scaler=true", "scaler.init_scale=7.52316384526264e-37",
            f"checkpoint.folder={tmp_path}", "checkpoint.interval=1", "train.clip_norm=null")
    data = batches(30, poison=set(range(30)))
    t = Trainer(c)
    s = t.fit(Factor(), data)
    assert s.outcome == "failed" and "loss scale collapsed" in s.stopped, s.stopped
    assert all(torch.isfinite(p).all() for p in t.model.parameters()), "a collapsed step was applied"
    assert s.steps_applied == 0 and s.diagnosis_report and Path(s.diagnosis_report).exists()
    last = list_checkpoints(tmp_path)[-1]
    scale = load_checkpoint(last)["scaler"]["scale"]
    assert scale > 0 and math.isfinite(1.0 / scale), f"{last} holds the collapsed scale {scale}"
    resumed = Trainer(cfg("train.steps=31", "train.force_scaler=true", f"checkpoint.folder={tmp_path}",
                          "train.clip_norm=null", "scaler.init_scale=7.52316384526264e-37"))
    r = resumed.fit(Factor(), batches(31), resume="latest")  # clean data now: it trains on
    assert r.outcome == "completed" and r.steps_applied >= 1


# ------------------------------------------------------------------ 2. the trace across a kill

KILLED = textwrap.dedent("""
    import os, sys
    from torchimpl.config.schema import load_config
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Callback, Trainer
    kill_after, resume, *sets = sys.argv[1:]
    cfg = load_config(overrides=sets)
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    class Kill(Callback):
        def on_step_end(self, trainer, state):
            if state.step == int(kill_after):
                os._exit(9)  # as SIGKILL: no flush, no finally
    Trainer(cfg, [Kill()]).fit(task.model, task.train_data, loss_fn=task.loss_fn,
                               resume="latest" if resume == "1" else None)
""")


def _run_killed(kill_after, resume, sets):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", KILLED, str(kill_after), resume, *sets], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("interval,log_interval", [(5, 10), (10, 5)])
def test_the_trace_after_a_kill_and_resume_equals_the_uninterrupted_one(tmp_path, interval, log_interval):
    def sets(folder):
        return ["device=cpu", "task.name=mlp", "task.size=tiny", "train.batch_size=4", "train.steps=30",
                "precision.mode=bf16", "train.force_scaler=true", "scaler.growth_interval=3",
                f"checkpoint.folder={folder}", f"checkpoint.interval={interval}",
                f"train.log_interval={log_interval}", f"train.trace_file={folder}/trace.jsonl"]

    whole, part = tmp_path / "whole", tmp_path / "part"
    assert _run_killed(-1, "0", sets(whole)).returncode == 0
    assert _run_killed(17, "0", sets(part)).returncode == 9
    r = _run_killed(-1, "1", sets(part))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (part / "trace.jsonl").read_text() == (whole / "trace.jsonl").read_text()
    from torchimpl.cli.app import main

    assert main(["replay", str(part / "trace.jsonl"), "--set", "scaler.growth_interval=3"]) == 0


# ------------------------------------------------------------------ 3. temporary files


def test_temporary_files_of_interrupted_writes_are_removed(tmp_path):
    c, task = _tiny(tmp_path, "checkpoint.interval=2")
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / ".tmp-step-00000004.ckpt-x1y2").write_bytes(b"half a checkpoint")
    (folder / ".tmp-step-00000002.dcp-abc").mkdir()
    Trainer(c).fit(task.model, task.train_data)
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".tmp-")]


# ------------------------------------------------------------------ 4. where a callback may save


@pytest.mark.parametrize("hook", ["on_microbatch_end", "on_after_backward", "on_step_end", "on_log"])
def test_a_save_from_every_allowed_hook_resumes_bit_for_bit(tmp_path, hook):
    sets = ("precision.mode=bf16", "train.force_scaler=true", "train.microbatches=2", "train.clip_norm=0.5",
            "train.log_interval=1")
    c, task = _tiny(tmp_path / "whole", *sets)  # a folder of its own: a run folder belongs to one run
    whole = Trainer(c)
    whole.fit(task.model, task.train_data)

    class SaveOnce(Callback):
        done = False

    def save(self, trainer, state, *rest):
        if not self.done and trainer.state.step == 2:
            self.done = True
            trainer.save_checkpoint(tmp_path / "x.ckpt")
            trainer.request_stop("saved")

    setattr(SaveOnce, hook, save)
    c2, task2 = _tiny(tmp_path, *sets)
    Trainer(c2, [SaveOnce()]).fit(task2.model, task2.train_data)
    c3, task3 = _tiny(tmp_path, *sets)
    again = Trainer(c3)
    again.fit(task3.model, task3.train_data, resume=tmp_path / "x.ckpt")
    assert _same(_params(whole), _params(again)), f"a save from {hook} did not resume bit for bit"


def test_a_save_from_on_before_optimizer_step_is_refused(tmp_path):
    class Save(Callback):
        def on_before_optimizer_step(self, trainer, state):
            trainer.save_checkpoint(tmp_path / "x.ckpt")

    c, task = _tiny(tmp_path)
    with pytest.raises(RuntimeError, match="on_before_optimizer_step.*unscale and clip them again"):
        Trainer(c, [Save()]).fit(task.model, task.train_data)
    assert not (tmp_path / "x.ckpt").exists()


# ------------------------------------------------------------------ 5. no usable checkpoint


def test_resume_with_only_damaged_checkpoints_is_refused_and_touches_nothing(tmp_path):
    c, task = _tiny(tmp_path, "checkpoint.interval=1", "train.steps=3")
    Trainer(c).fit(task.model, task.train_data)
    files = list_checkpoints(tmp_path / "ck")
    for f in files:
        data = bytearray(f.read_bytes())
        data[-10] ^= 0xFF
        f.write_bytes(bytes(data))
    before = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files}
    c2, task2 = _tiny(tmp_path, "checkpoint.interval=1", "train.steps=6")
    with pytest.raises(CheckpointError, match=r"none of the 3 checkpoints.*step-00000003.ckpt.*corrupted"):
        Trainer(c2).fit(task2.model, task2.train_data, resume="latest")
    assert {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in list_checkpoints(tmp_path / "ck")} == before


def test_a_checkpoint_missing_a_field_falls_back_to_the_previous_good_one(tmp_path):
    c, task = _tiny(tmp_path, "checkpoint.interval=1", "train.steps=3")
    Trainer(c).fit(task.model, task.train_data)
    newest = list_checkpoints(tmp_path / "ck")[-1]
    contents = load_checkpoint(newest)
    del contents["model_signature"]
    save_checkpoint(contents, newest)  # a valid header over a malformed payload
    c2, task2 = _tiny(tmp_path, "train.steps=4")
    t = Trainer(c2)

    class Start(Callback):
        def on_fit_start(self, trainer):
            self.step = trainer.state.step

    start = Start()
    t.callbacks.append(start)
    t.fit(task2.model, task2.train_data, resume="latest")
    assert start.step == 2, "did not fall back to step-00000002"


def test_an_empty_folder_starts_fresh_with_a_warning(tmp_path, caplog):
    c, task = _tiny(tmp_path)
    s = Trainer(c).fit(task.model, task.train_data, resume="latest")
    assert s.steps == 6 and any("starting a fresh run" in r.message for r in caplog.records)


# ------------------------------------------------------------------ 6. configuration changes


def _saved(tmp_path, *sets):
    c, task = _tiny(tmp_path, "train.steps=2", *sets)
    Trainer(c).fit(task.model, task.train_data)


@pytest.mark.parametrize("before,after,field", [
    (("optimizer.name=adamw",), ("optimizer.name=sgd",), "optimizer.name"),
    (("optimizer.fused=false",), ("optimizer.fused=true",), "optimizer.fused"),
    (("optimizer.fused=true",), ("optimizer.fused=false",), "optimizer.fused"),
    (("precision.mode=fp32",), ("precision.mode=bf16",), "precision.mode"),
])
def test_a_change_that_defines_the_run_is_refused(tmp_path, before, after, field):
    _saved(tmp_path, *before)
    c, task = _tiny(tmp_path, "train.steps=4", *after)
    with pytest.raises(ResumeError, match=rf"{field}: .* \(checkpoint\) -> .* \(now\)"):
        Trainer(c).fit(task.model, task.train_data, resume="latest")


def test_a_changed_hyperparameter_is_applied_with_a_warning(tmp_path):
    _saved(tmp_path, "optimizer.lr=0.5", "optimizer.weight_decay=0.0", "schedule.name=constant")
    c, task = _tiny(tmp_path, "train.steps=4", "optimizer.lr=0.001", "optimizer.weight_decay=0.1",
                    "schedule.name=constant")
    t = Trainer(c)
    with pytest.warns(UserWarning) as seen:
        t.fit(task.model, task.train_data, resume="latest")
    _only_these_warnings(seen, r"optimizer.lr: 0.5 \(checkpoint\) -> 0.001 \(now\)",
                         r"optimizer.weight_decay: 0.0 \(checkpoint\) -> 0.1 \(now\)")
    assert t.optimizer.param_groups[0]["lr"] == 0.001
    assert t.optimizer.param_groups[0]["weight_decay"] == 0.1


def _only_these_warnings(seen, *patterns: str) -> None:
    """Each pattern matches exactly one of the warnings ``seen`` caught, and every warning one
    pattern: an expected warning is asserted, and nothing else leaks into the test's output."""
    import re

    messages = [str(w.message) for w in seen]
    for pattern in patterns:
        assert sum(bool(re.search(pattern, m)) for m in messages) == 1, (pattern, messages)
    assert all(any(re.search(p, m) for p in patterns) for m in messages), messages


def test_a_float64_checkpoint_is_refused_for_a_float32_model(tmp_path):
    c, task = _tiny(tmp_path, "train.steps=2")
    Trainer(c).fit(task.model.double(), [tuple(t.double() for t in b) for b in task.train_data])
    c2, task2 = _tiny(tmp_path, "train.steps=3")
    with pytest.raises(CheckpointError, match="different dtypes.*torch.float64 saved, torch.float32 now"):
        Trainer(c2).fit(task2.model, task2.train_data, resume="latest")


# ------------------------------------------------------------------ 7. checked before step 1


@pytest.mark.parametrize("problem", ["folder_is_a_file", "trace_is_a_folder", "empty_val", "one_shot_val"])
def test_what_would_fail_at_the_end_fails_before_step_1(tmp_path, problem):
    blocker = tmp_path / "file"
    blocker.write_text("")
    sets = {"folder_is_a_file": [f"checkpoint.folder={blocker}"],
            "trace_is_a_folder": [f"train.trace_file={tmp_path}"]}.get(problem, [])
    val = {"empty_val": [], "one_shot_val": iter(batches(2))}.get(problem)
    steps = []

    class Count(Callback):
        def on_step_end(self, trainer, state):
            steps.append(state.step)

    with pytest.raises(ValueError, match="checkpoint.folder|trace_file|val_data"):
        Trainer(cfg(*sets), [Count()]).fit(Factor(), batches(4), val)
    assert steps == []


# ------------------------------------------------------------------ 8. interrupts

TRAIN = ["-m", "torchimpl.cli", "train", "--set", "device=cpu", "--set", "task.name=mlp",
         "--set", "task.size=tiny", "--set", "train.steps=100000", "--set", "train.batch_size=4"]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_at_a_step_boundary_saves_and_exits_with_its_code(tmp_path, sig, code):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    trace = tmp_path / "trace.jsonl"
    proc = subprocess.Popen([sys.executable, *TRAIN, "--set", f"checkpoint.folder={tmp_path}",
                             "--set", f"train.trace_file={trace}"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while (not trace.exists() or trace.read_text().count("\n") < 2) and time.time() < deadline:
        time.sleep(0.05)  # trained a few steps: a record after the header
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err and f"interrupted by {sig.name}" in err
    summary = json.loads(out)
    assert summary["outcome"] == f"interrupted:{sig.name}" and summary["last_checkpoint"]
    ckpt = load_checkpoint(summary["last_checkpoint"])
    assert ckpt["trainer"]["window_size"] == 0 and ckpt["trainer"]["step"] == summary["steps"]


# ------------------------------------------------------------------ 9-10. silent failure, bad losses


def test_a_run_that_applied_nothing_exits_3_with_valid_json(tmp_path, capsys, monkeypatch):
    from torchimpl.cli.app import main

    (tmp_path / "always_inf.py").write_text(textwrap.dedent("""
        import math, torch
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(2, 1)
            def forward(self, x, y):
                return ((self.lin(x) - y) ** 2).mean() * math.inf
        def make():
            data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 4
            return M(), data, None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["train", "--set", "device=cpu", "--set", "task.name=always_inf:make", "--set", "train.steps=3"])
    out, err = capsys.readouterr()
    summary = json.loads(out)  # strict JSON: a NaN would not parse
    assert code == 3 and summary["outcome"] == "no_progress" and "no step was applied" in err, (out, err)
    assert summary["final_train_loss"] is None  # the NaN loss, as JSON's null


def test_an_infinite_loss_with_finite_gradients_is_skipped(tmp_path):
    class Offset(Factor):
        def forward(self, x, y, factor):
            return ((self.lin(x) - y) ** 2).mean() + (factor - 1.0) * 0 + (math.inf if factor > 1 else 0.0)

    trace = tmp_path / "t.jsonl"
    s = Trainer(cfg("train.steps=3", f"train.trace_file={trace}")).fit(Offset(), batches(3, poison={1}, value=2.0))
    assert [r.applied for r in read_trace(trace)] == [True, False, True] and s.steps_skipped == 1


@pytest.mark.parametrize("loss,what", [(lambda m, b: m(*b).reshape(1, 1), "shape (1, 1)"),
                                       (lambda m, b: 1.5, "a float (1.5)"),
                                       (lambda m, b: m(*b).long(), "dtype torch.int64")])
def test_a_loss_that_is_not_a_0d_float_tensor_is_named(loss, what):
    with pytest.raises(ValueError, match=r"the loss must be a 0-d floating tensor, got .*" + re.escape(what)):
        Trainer(cfg("train.steps=1")).fit(Factor(), batches(1), loss_fn=loss)


def test_ten_sigkills_at_random_instants_leave_the_uninterrupted_run(tmp_path):
    """The kill campaign of ``bench/kill_campaign.py``, 10 kills (run 100 with the script)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import kill_campaign
    finally:
        sys.path.remove(str(ROOT / "bench"))
    f = kill_campaign.campaign(kills=10, steps=300, seed=1, work=tmp_path, max_delay=0.05)
    assert f["kills"] >= 5 and not f["failures"] and f["equal"], f
    assert f["resume_failures"] == f["bad_checkpoints"] == f["leftovers"] == 0, f
