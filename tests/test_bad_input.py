"""The command line against bad input and faults: the project's own campaign.

Every case goes through the real command line (``torchimpl.cli.main`` in this process for what
is checked before work, a real ``python -m torchimpl.cli`` for signals, locks and kills) and
asserts three things: the exit status, a one-line message that names the file, field or line
and the fix, and that no file changed that should not have (a checksum of every file in the
folder before and after). No case may print a traceback.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ helpers


def checksums(folder: Path) -> dict[str, str]:
    """``relative path -> sha256`` of every file under ``folder`` (a link: ``-> target``)."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def cli(*args, cwd: Path | None = None) -> tuple[int, str, str]:
    """``ampspec ARGS`` in this process: (exit status, stdout, stderr). The signal handlers and
    the warning display that ``main`` installs are put back afterwards."""
    import contextlib
    import io

    from torchimpl.cli.app import main

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    show = warnings.showwarning
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("default")
            try:
                rc = main([str(a) for a in args])
            except SystemExit as exc:  # argparse's own refusals
                rc = exc.code
    finally:
        os.chdir(old)
        for s, h in handlers.items():
            signal.signal(s, h)
        warnings.showwarning = show
    return rc, out.getvalue(), err.getvalue()


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def spawn(*args, cwd: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torchimpl.cli", *map(str, args)], cwd=cwd,
                            env={**env(), **(extra_env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def ampspec(*args, cwd: Path, extra_env: dict[str, str] | None = None, timeout: int = 240) -> tuple[int, str, str]:
    p = spawn(*args, cwd=cwd, extra_env=extra_env)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


HAVE_SAFETENSORS = importlib.util.find_spec("safetensors") is not None


def refused(result: tuple[int, str, str], code: int, *names: str) -> str:
    """Assert exit ``code``, no traceback, and a message on stderr naming each of ``names``."""
    rc, out, err = result
    assert rc == code, f"exit {rc}, expected {code}\nstdout: {out[-1500:]}\nstderr: {err[-3000:]}"
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    for name in names:
        assert str(name) in err, f"{name!r} not named in:\n{err[-3000:]}"
    return err


TINY = ["device=cpu", "task.name=mlp", "task.size=tiny", "train.batch_size=4", "train.log_interval=1",
        "logging.progress=off"]


def sets(*items: str) -> list[str]:
    out = []
    for item in (*TINY, *items):
        out += ["--set", item]
    return out


# A user task whose model sends the process a real signal from inside a training step, or whose
# builder sends one while the run is being set up: deterministic instants for the signal cases.
SIGNAL_TASK = textwrap.dedent("""
    import os, signal, torch
    from torch import nn

    CALLS = {"make": 0, "forward": 0}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, y):
            CALLS["forward"] += 1
            if CALLS["forward"] == int(os.environ.get("KILL_AT_FORWARD", "0")):
                os.kill(os.getpid(), getattr(signal, os.environ["KILL_SIGNAL"]))
            return ((self.lin(x) - y) ** 2).mean()

    def make():
        CALLS["make"] += 1
        if CALLS["make"] == int(os.environ.get("KILL_AT_MAKE", "0")):
            os.kill(os.getpid(), getattr(signal, os.environ["KILL_SIGNAL"]))
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
        return Model(), data, data[:1]
""")


@pytest.fixture
def sigtask(tmp_path: Path) -> Path:
    (tmp_path / "sigtask.py").write_text(SIGNAL_TASK)
    return tmp_path


# ------------------------------------------------------------------ 1. signals


@pytest.mark.parametrize("sig,code", [("SIGINT", 130)])
def test_a_signal_inside_a_compare_run_stops_the_whole_comparison(sigtask, sig, code):
    # 6 steps and one evaluation per run: forward 15 is the second run's (bf16's) third step.
    r = ampspec("-q", "compare", "--task", "sigtask:make", "--steps", "6", "--device", "cpu", "--out", "cmp",
                cwd=sigtask, extra_env={"KILL_AT_FORWARD": "15", "KILL_SIGNAL": sig})
    err = refused(r, code, f"interrupted by {sig}", "runs finished: fp32", "bf16 stopped after",
                  "cmp/report.json")
    assert "The curves" not in r[1] and "agree" not in r[1], r[1]
    report = json.loads((sigtask / "cmp" / "report.json").read_text())
    assert report["interrupted"] == sig and report["agree"] is None, report
    assert report["finished"] == ["fp32"] and list(report["cut_short"]) == ["bf16"], report
    assert report["cut_short"]["bf16"] < 6 and "bf16+scaler" in report["not_run"], report
    assert [row["precision"] for row in report["rows"]] == ["fp32"], "a cut-short run has a row"
    assert "loss_curves" not in report and not (sigtask / "cmp" / "compare.png").exists()
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("sig,code", [("SIGTERM", 143)])
def test_a_signal_while_compare_sets_a_run_up_stops_it_with_a_report(sigtask, sig, code):
    r = ampspec("-q", "compare", "--task", "sigtask:make", "--steps", "3", "--device", "cpu", "--out", "cmp",
                cwd=sigtask, extra_env={"KILL_AT_MAKE": "2", "KILL_SIGNAL": sig})
    refused(r, code, f"interrupted by {sig}", "runs finished: fp32;", "no verdict")
    report = json.loads((sigtask / "cmp" / "report.json").read_text())
    assert report["finished"] == ["fp32"] and report["cut_short"] == {} and report["agree"] is None, report


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_while_train_sets_up_ends_with_a_line_not_a_traceback(sigtask, sig, code):
    before = checksums(sigtask)
    r = ampspec("train", *sets("task.name=sigtask:make", "train.steps=3", "logging.dir=null"), cwd=sigtask,
                extra_env={"KILL_AT_MAKE": "1", "KILL_SIGNAL": sig})
    err = refused(r, code, f"ampspec train: interrupted by {sig}")
    assert err.strip() != "ampspec train:" and len(err.strip().splitlines()) == 1, err
    assert checksums(sigtask) == before


# ------------------------------------------------------------------ 2. one run per folder

RUN = ["train.steps=2", "checkpoint.folder=ck", "train.trace_file=ck/trace.jsonl", "train.force_scaler=true"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A folder ``ck`` holding a finished two-step run (checkpoint, metrics.csv, trace)."""
    base = tmp_path_factory.mktemp("finished")
    rc, out, err = cli("train", *sets(*RUN), cwd=base)
    assert rc == 0, err
    return base


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    import shutil

    shutil.copytree(finished_run / "ck", tmp_path / "ck")
    return tmp_path


@pytest.mark.parametrize("extra", [
    [],                                               # the same folder, a fresh run
    ["train.steps=5"],                                # the same folder, a longer fresh run
    ["checkpoint.folder=other", "logging.dir=ck"],    # another checkpoint folder, the old run folder
    ["checkpoint.folder=other", "logging.dir=null"],  # only the old trace file
])
def test_a_fresh_train_into_a_folder_of_another_run_is_refused_before_training(run_copy, extra):
    before = checksums(run_copy)
    err = refused(cli("train", *sets(*RUN, *extra), cwd=run_copy), 2, "holds another run's files", "--resume",
                  "another folder", "--overwrite")
    assert "ck" in err
    assert checksums(run_copy) == before


def test_overwrite_replaces_the_other_run_and_leaves_no_file_of_it(run_copy):
    (run_copy / "ck" / "step-00000009.ckpt").write_bytes((run_copy / "ck" / "step-00000002.ckpt").read_bytes())
    rc, out, err = cli("train", *sets(*RUN), "--overwrite", cwd=run_copy)
    assert rc == 0, err
    assert "removed the previous run's files" in err and "step-00000009.ckpt" in err
    names = sorted(p.name for p in (run_copy / "ck").iterdir())
    assert names == ["metrics.csv", "step-00000002.ckpt", "trace.jsonl"], names


def test_resume_and_overwrite_together_are_refused(run_copy):
    before = checksums(run_copy)
    refused(cli("train", *sets(*RUN), "--resume", "--overwrite", cwd=run_copy), 2, "contradict")
    assert checksums(run_copy) == before


# ------------------------------------------------------------------ 3. the lock

SLOW_TASK = textwrap.dedent("""
    import os, time, torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, y):
            open("training", "w").close()
            time.sleep(0.05)
            return ((self.lin(x) - y) ** 2).mean()

    def make():
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
        return Model(), data, None
""")


def test_a_second_trainer_is_refused_at_once_naming_the_holder_and_a_kill_leaves_no_stale_lock(tmp_path):
    import time

    (tmp_path / "slowtask.py").write_text(SLOW_TASK)
    # No checkpoint and no metrics row before the end: the folder stays still while it trains.
    first = spawn("train", *sets("task.name=slowtask:make", "train.steps=100000", "checkpoint.folder=ck",
                                 "train.log_interval=100000"), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "training").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        before = checksums(tmp_path / "ck")
        assert (tmp_path / "ck" / ".ampspec.lock").read_text().strip() == str(first.pid)
        for extra in ([], ["--resume"], ["--overwrite"]):
            err = refused(cli("train", *sets("task.name=slowtask:make", "train.steps=3", "checkpoint.folder=ck"),
                              *extra, cwd=tmp_path), 2, "in use by another ampspec process", f"pid {first.pid}",
                          "checkpoint.folder")
        assert checksums(tmp_path / "ck") == before
    finally:
        first.kill()
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    rc, out, err = cli("train", *sets("task.name=slowtask:make", "train.steps=2", "checkpoint.folder=ck"),
                       "--overwrite", cwd=tmp_path)
    assert rc == 0, err
    assert not (tmp_path / "ck" / ".ampspec.lock").exists(), "a clean end removes its lock file"


# ------------------------------------------------------------------ 4, 7. configuration files and values

BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['lol'] * 9)}]\n"
               for p, c in zip(["", *"abcdefgh"], "abcdefghi"))

# (file contents, or None for the defaults; --set items; what the message must name)
CONFIG_CASES = {
    "alias bomb": (BOMB, [], ["run.yaml", "expand to more than"]),
    "self-referencing alias": ("a: &a [*a]\n", [], ["run.yaml", "line 1", "refers to the anchor it is inside"]),
    "self-referencing mapping": ("train: &t {steps: 2, x: *t}\n", [], ["run.yaml", "anchor it is inside"]),
    "deep nesting": ("a: " + "[" * 3000 + "]" * 3000 + "\n", [], ["run.yaml", "nested too deeply"]),
    "nesting past the limit": ("a: " + "[" * 70 + "]" * 70 + "\n", [], ["run.yaml", "nested deeper than"]),
    "duplicated section": ("train: {steps: 3}\ntrain: {steps: 5}\n", [], ["run.yaml", "line 2", "'train'",
                                                                        "given twice"]),
    "duplicated key": ("train:\n  steps: 3\n  steps: 4\n", [], ["run.yaml", "line 3", "'steps'"]),
    "python tag": ("train: !!python/object/apply:os.system ['true']\n", [], ["run.yaml", "not valid YAML"]),
    "not UTF-8": (b"train: {steps: 3}\n# caf\xe9\n", [], ["run.yaml", "not UTF-8", "byte 23"]),
    "a list, not a mapping": ("- 1\n- 2\n", [], ["run.yaml", "mapping of sections"]),
    "a scalar": ("42\n", [], ["run.yaml", "mapping of sections"]),
    "broken YAML": ("train: {steps: 3\n", [], ["run.yaml", "not valid YAML"]),
    "tab indentation": ("train:\n\tsteps: 3\n", [], ["run.yaml", "not valid YAML"]),
    "unknown section": ("trian: {steps: 3}\n", [], ["trian", "did you mean 'train'"]),
    "unknown key": ("train: {stpes: 3}\n", [], ["train.stpes", "did you mean 'steps'"]),
    "section as a list": ("train: [1, 2]\n", [], ["train", "mapping"]),
    "lr zero": (None, ["optimizer.lr=0"], ["optimizer.lr", "> 0"]),
    "lr negative": (None, ["optimizer.lr=-1e-3"], ["optimizer.lr"]),
    "lr huge": (None, ["optimizer.lr=1.0e300"], ["optimizer.lr", "float32"]),
    "lr nan": (None, ["optimizer.lr=.nan"], ["optimizer.lr", "finite"]),
    "lr a word": (None, ["optimizer.lr=fast"], ["optimizer.lr"]),
    "timeout inf": (None, ["train.distributed_timeout_s=.inf"], ["train.distributed_timeout_s", "finite"]),
    "timeout zero": (None, ["train.distributed_timeout_s=0"], ["train.distributed_timeout_s"]),
    "seed 2**33": (None, ["train.seed=8589934592"], ["train.seed", "2**32"]),
    "seed 1e20": (None, ["train.seed=1.0e20"], ["train.seed", "integer"]),
    "seed negative": (None, ["train.seed=-1"], ["train.seed", ">= 0"]),
    "seed bool": (None, ["train.seed=true"], ["train.seed", "integer"]),
    "steps zero": (None, ["train.steps=0"], ["train.steps", ">= 1"]),
    "steps past 8 digits": (None, ["train.steps=100000000"], ["train.steps", "8 digits"]),
    "steps a float": (None, ["train.steps=2.5"], ["train.steps", "integer"]),
    "clip inf": (None, ["train.clip_norm=.inf"], ["train.clip_norm", "finite"]),
    "clip negative": (None, ["train.clip_norm=-1"], ["train.clip_norm"]),
    "microbatches zero": (None, ["train.microbatches=0"], ["train.microbatches"]),
    "batch size a string": (None, ["train.batch_size=lots"], ["train.batch_size"]),
    "on_nonfinite": (None, ["train.on_nonfinite=ignore"], ["train.on_nonfinite", "'skip'"]),
    "keep_last zero": (None, ["checkpoint.keep_last=0"], ["checkpoint.keep_last"]),
    "checkpoint interval negative": (None, ["checkpoint.interval=-1"], ["checkpoint.interval"]),
    "growth interval zero": (None, ["scaler.growth_interval=0"], ["scaler.growth_interval"]),
    "init scale huge": (None, ["scaler.init_scale=1.0e300"], ["scaler.init_scale", "float32"]),
    "precision unknown": (None, ["precision.mode=fp12"], ["precision"]),
    "min_lr_ratio": (None, ["schedule.min_lr_ratio=2"], ["schedule.min_lr_ratio"]),
    "progress": (None, ["logging.progress=sometimes"], ["logging.progress"]),
    "override alias bomb": (None, ["train.steps=&a [*a]"], ["train.steps", "anchor it is inside"]),
    "override not YAML": (None, ["train.steps=[1"], ["train.steps", "not valid YAML"]),
    "override without =": (None, ["train.steps"], ["train.steps", "section.key=value"]),
    "override into a value": (None, ["device.x=1"], ["device", "mapping"]),
    "task path-like": (None, ["task.name=../../x:make"], ["task.name", "module:function"]),
    "task without function": (None, ["task.name=mymodule"], ["task.name"]),
    "task function not an identifier": (None, ["task.name=mod:1x"], ["task.name"]),
    "task absolute path": (None, ["task.name=/tmp/x:make"], ["task.name"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_bad_configuration_is_refused_before_any_work_naming_the_field(tmp_path, case):
    text, overrides, names = CONFIG_CASES[case]
    args = ["train"] + sets("checkpoint.folder=ck", "train.steps=2", *overrides)
    if text is not None:
        (tmp_path / "run.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
        args += ["--config", "run.yaml"]
    before = checksums(tmp_path)
    err = refused(cli(*args, cwd=tmp_path), 2, *names)
    assert err.startswith("ampspec train: error:") and len(err.strip().splitlines()) == 1, err
    assert checksums(tmp_path) == before


def test_a_missing_or_unreadable_configuration_is_named(tmp_path):
    refused(cli("train", "--config", tmp_path / "missing.yaml"), 2, "missing.yaml")
    (tmp_path / "folder.yaml").mkdir()
    refused(cli("train", "--config", tmp_path / "folder.yaml"), 2, "folder.yaml")


# ------------------------------------------------------------------ 5. no writes outside the run


def test_a_planted_metrics_link_is_refused_and_its_target_untouched(run_copy):
    (run_copy / "secret.txt").write_text("not yours\n")
    (run_copy / "ck" / "metrics.csv").unlink()
    (run_copy / "ck" / "metrics.csv").symlink_to(run_copy / "secret.txt")
    before = checksums(run_copy)
    for extra in ([], ["--resume"], ["--overwrite"]):
        refused(cli("train", *sets(*RUN), *extra, cwd=run_copy), 2, "ck/metrics.csv", "symbolic link")
        assert checksums(run_copy) == before, extra


def test_a_planted_trace_link_is_refused(run_copy):
    (run_copy / "secret.txt").write_text("not yours\n")
    (run_copy / "ck" / "trace.jsonl").unlink()
    (run_copy / "ck" / "trace.jsonl").symlink_to(run_copy / "secret.txt")
    before = checksums(run_copy)
    for extra in ([], ["--resume"], ["--overwrite"]):
        refused(cli("train", *sets(*RUN), *extra, cwd=run_copy), 2, "ck/trace.jsonl", "symbolic link")
        assert checksums(run_copy) == before, extra


@pytest.mark.parametrize("target", ["run.yaml", "ck/step-00000002.ckpt", "notes.txt", "binary.bin"])
def test_a_trace_file_that_is_not_a_trace_is_never_overwritten(run_copy, target):
    (run_copy / "run.yaml").write_text("train: {steps: 2}\n")
    (run_copy / "notes.txt").write_text("my notes\n")
    (run_copy / "binary.bin").write_bytes(bytes(range(256)))
    before = checksums(run_copy)
    for extra in ([], ["--resume"], ["--overwrite"]):
        args = ["train", "--config", "run.yaml", *sets(*RUN, f"train.trace_file={target}"), *extra]
        refused(cli(*args, cwd=run_copy), 2, "train.trace_file", target, "not a trace")
        assert checksums(run_copy) == before, extra


@pytest.mark.parametrize("target, why", [
    ("ck/metrics.csv", "is a name the run keeps for"), ("ck/step-00000009.ckpt", "is a name the run keeps for"),
    ("ck/precision_stats.csv", "is a name the run keeps for"), ("logs/metrics.csv", "is a name the run keeps for"),
    ("ck/.ampspec.lock", "not a trace"),  # the command line's lock exists (with its pid) when the trace is checked
])
def test_a_trace_named_as_another_run_file_is_refused_before_it_exists(tmp_path, target, why):
    # a fresh folder: nothing exists yet, so only the name can tell the trace would write over that file
    args = ["train", *sets("train.steps=2", "checkpoint.folder=ck", f"train.trace_file={target}",
                           *(["logging.dir=logs"] if target.startswith("logs") else []))]
    refused(cli(*args, cwd=tmp_path), 2, "train.trace_file", target, why)
    assert checksums(tmp_path) == {}


# ------------------------------------------------------------------ 6. damaged checkpoints


def _damage(kind: str, good: Path, bad: Path) -> None:
    import torch

    from torchimpl.run.checkpoint import load_checkpoint, save_checkpoint

    data = good.read_bytes()
    if kind == "truncated":
        bad.write_bytes(data[: len(data) // 2])
        return
    if kind == "bit flip":
        flipped = bytearray(data)
        flipped[-100] ^= 0x10
        bad.write_bytes(bytes(flipped))
        return
    if kind in ("text", "empty", "future format"):
        text = {"text": b"hello\n", "empty": b"", "future format": data.replace(b"CHECKPOINT 1 ", b"CHECKPOINT 7 ", 1)}
        bad.write_bytes(text[kind])
        return
    c = load_checkpoint(good)
    if kind == "wrong shapes":
        name = next(iter(c["model"]))
        c["model"][name] = torch.zeros(3, 3)
    elif kind == "rng too short":
        c["rng"]["python"] = c["rng"]["python"][:2]
    elif kind == "rng wrong dtype":
        c["rng"]["torch"] = c["rng"]["torch"].float()
    elif kind == "scaler malformed":
        c["scaler"] = {"scale": "big"}
    elif kind == "step negative":
        c["trainer"]["step"] = -5
    elif kind == "step a word":
        c["trainer"]["step"] = "lots"
    elif kind == "no optimizer":
        del c["optimizer"]
    elif kind == "data position":
        c["data"]["index"] = "x"
    save_checkpoint(c, bad)


DAMAGE = ["truncated", "bit flip", "text", "empty", "future format", "wrong shapes", "rng too short",
          "rng wrong dtype", "scaler malformed", "step negative", "step a word", "no optimizer", "data position"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_only_checkpoint_refuses_the_resume_and_changes_no_byte(run_copy, kind):
    ck = run_copy / "ck"
    _damage(kind, ck / "step-00000002.ckpt", ck / "step-00000002.ckpt")
    before = checksums(run_copy)
    refused(cli("train", *sets(*RUN, "train.steps=4"), "--resume", cwd=run_copy), 2, "step-00000002.ckpt",
            "nothing in the folder was changed")
    assert checksums(run_copy) == before


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_newest_checkpoint_is_named_and_passed_over(run_copy, kind, caplog):
    ck = run_copy / "ck"
    _damage(kind, ck / "step-00000002.ckpt", ck / "step-00000003.ckpt")
    rc, out, err = cli("train", *sets(*RUN, "train.steps=3"), "--resume", cwd=run_copy)
    assert rc == 0 and "Traceback" not in err, err
    # The warning goes through logging (a WARNING line on stderr in a terminal).
    assert any(m.startswith("cannot resume from step-00000003.ckpt") for m in caplog.messages), caplog.messages
    assert "resumed" in err or json.loads(out)["steps"] == 3
    from torchimpl.run.records import read_trace

    assert [r.step for r in read_trace(ck / "trace.jsonl")] == [0, 1, 2]


def test_a_stray_damaged_sharded_checkpoint_beside_good_ones_is_passed_over(run_copy, caplog):
    stray = run_copy / "ck" / "step-00000009.dcp"
    stray.mkdir()
    (stray / ".metadata").write_bytes(b"garbage")
    rc, out, err = cli("train", *sets(*RUN, "train.steps=3"), "--resume", cwd=run_copy)
    assert rc == 0 and "Traceback" not in err, err
    assert any(m.startswith("cannot resume from step-00000009.dcp") for m in caplog.messages), caplog.messages


# ------------------------------------------------------------------ 8. replay on bad traces

GOOD_RECORD = {"step": 0, "microbatches": 1, "scale_before": 65536.0, "found_inf": False, "applied": True,
               "grad_norm": 1.0, "clip_coef": 1.0, "scale_after": 65536.0, "growth_tracker": 1, "lr": 0.001}


def _records(n: int) -> list[dict]:
    return [dict(GOOD_RECORD, step=i, growth_tracker=i + 1) for i in range(n)]


def _lines(*objs) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs)


# (trace text or bytes, what the message must name)
TRACE_CASES = {
    "found_inf a string": (_lines(dict(GOOD_RECORD, found_inf="no")), [":1:", "'found_inf'", "true or false"]),
    "applied a number": (_lines(*_records(1), dict(GOOD_RECORD, step=1, applied=1)), [":2:", "'applied'"]),
    "scale_after a string NaN": (_lines(dict(GOOD_RECORD, scale_after="NaN")), [":1:", "'scale_after'", "a number"]),
    "scale_before a bool": (_lines(dict(GOOD_RECORD, scale_before=True)), [":1:", "'scale_before'"]),
    "step a float": (_lines(dict(GOOD_RECORD, step=0.0)), [":1:", "'step'", "an integer"]),
    "step a string": (_lines(dict(GOOD_RECORD, step="0")), [":1:", "'step'"]),
    "growth_tracker null": (_lines(dict(GOOD_RECORD, growth_tracker=None)), [":1:", "'growth_tracker'"]),
    "lr a list": (_lines(dict(GOOD_RECORD, lr=[0.001])), [":1:", "'lr'"]),
    "grad_norm a string": (_lines(dict(GOOD_RECORD, grad_norm="inf")), [":1:", "'grad_norm'", "or null"]),
    "a missing field": (_lines({k: v for k, v in GOOD_RECORD.items() if k != "lr"}), [":1:", "missing ['lr']"]),
    "an unknown field": (_lines(dict(GOOD_RECORD, colour="red")), [":1:", "unexpected ['colour']"]),
    "a list line": (_lines(*_records(2), "[1, 2]"), [":3:", "a JSON list"]),
    "a torn line": (_lines(*_records(2)) + '{"step": 2, "micro', [":3:", "not a step record"]),
    "deep nesting": (_lines(*_records(1), "[" * 100000 + "]" * 100000), [":2:", "nested too deeply"]),
    "binary": (bytes(range(128, 256)) * 4 + b"\n", [":1:", "not UTF-8"]),
    "a PNG": (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), [":1:", "not UTF-8"]),
    "empty": ("", ["holds no step records"]),
    "only blank lines": ("\n\n\n", ["holds no step records"]),
    "duplicate step": (_lines(*_records(3), _records(3)[1]), [":4:", "duplicate step 1", "line 2",
                                                              "nothing was replayed"]),
    "steps out of order": (_lines(*[_records(4)[i] for i in (0, 2, 1, 3)]), [":2:", "out of order",
                                                                            "step 2 follows step 0"]),
    "a gap": (_lines(*[_records(4)[i] for i in (0, 1, 3)]), [":3:", "step 3 follows step 1"]),
    "future header": (_lines({"ampspec_trace": 9, "scaler": {}}, *_records(1)), ["newer than this ampspec"]),
    "malformed header": (_lines({"ampspec_trace": 1, "scaler": "torch"}, *_records(2)), ["header's scaler policy"]),
}


@pytest.mark.parametrize("case", list(TRACE_CASES))
def test_replay_refuses_a_bad_trace_naming_the_line_and_field(tmp_path, case):
    text, names = TRACE_CASES[case]
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(text if isinstance(text, bytes) else text.encode())
    before = checksums(tmp_path)
    err = refused(cli("replay", trace), 2, *names)
    assert "trace.jsonl" in err and len(err.strip().splitlines()) == 1, err
    assert checksums(tmp_path) == before


def test_replay_of_a_missing_trace_or_a_folder_is_named(tmp_path):
    refused(cli("replay", tmp_path / "missing.jsonl"), 2, "missing.jsonl")
    refused(cli("replay", tmp_path), 2, str(tmp_path))


# ------------------------------------------------------------------ 9. user tasks

TASK_HEAD = textwrap.dedent("""
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self, width=4):
            super().__init__()
            self.lin = nn.Linear(width, 1)

        def forward(self, x, y):
            return ((self.lin(x) - y) ** 2).mean()

    def batches(n=4, width=4):
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(8, width, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]
""")

# (module name, module body after TASK_HEAD, function, exit status, what the message must name)
TASK_CASES = {
    "raises KeyError": ("t_key", "def make():\n    return {}['model']\n", "make", 2,
                        ["t_key:make", "make() raised KeyError", "t_key.py:"]),
    "raises RuntimeError": ("t_rt", "def make():\n    raise RuntimeError('no GPU here')\n", "make", 2,
                            ["t_rt:make", "RuntimeError: no GPU here", "t_rt.py:"]),
    "syntax error": ("t_syntax", "def make(:\n    pass\n", "make", 2, ["t_syntax:make", "t_syntax.py:", "SyntaxError"]),
    "raises at import": ("t_import", "1 / 0\n", "make", 2, ["t_import:make", "ZeroDivisionError", "t_import.py:"]),
    "string batches": ("t_strings", "def make():\n    return Model(), ['a', 'b'], None\n", "make", 2,
                       ["t_strings:make", "train_data[0] is a str"]),
    "dict of strings": ("t_dicts", "def make():\n    return Model(), [{'x': 'a'}], None\n", "make", 2,
                        ["train_data[0] is a dict holding no tensor"]),
    "data a string": ("t_text", "def make():\n    return Model(), 'data.csv', None\n", "make", 2,
                      ["train_data is a str"]),
    "data an iterator": ("t_iter", "def make():\n    return Model(), iter(batches()), None\n", "make", 2,
                         ["train_data is a list_iterator", "re-iterable"]),
    "val data a string": ("t_val", "def make():\n    return Model(), batches(), 'val'\n", "make", 2,
                          ["val_data is a str"]),
    "returns None": ("t_none", "def make():\n    pass\n", "make", 2, ["t_none:make", "must return"]),
    "returns no model": ("t_nomodel", "def make():\n    return 1, batches(), None\n", "make", 2, ["nn.Module first"]),
    "loss_fn not callable": ("t_loss", "def make():\n    return Model(), batches(), None, 3\n", "make", 2,
                             ["loss_fn is a int"]),
    "needs arguments": ("t_args", "def make(size):\n    return Model(), batches(), None\n", "make", 2,
                        ["make() needs the arguments ['size']"]),
    "a class": ("t_class", "class make:\n    pass\n", "make", 2, ["make is a type, not a Python function"]),
    "a builtin": ("t_builtin", "make = print\n", "make", 2, ["not a Python function"]),
    "no such function": ("t_nofunc", "def other():\n    pass\n", "make", 2, ["has no function 'make'"]),
    "fails while training": ("t_shape", "def make():\n    return Model(3), batches(), None\n", "make", 1,
                             ["t_shape:make", "failed while training", "RuntimeError"]),
    "non-scalar loss": ("t_vector", textwrap.dedent("""
        class Vector(Model):
            def forward(self, x, y):
                return (self.lin(x) - y) ** 2

        def make():
            return Vector(), batches(), None
        """), "make", 2, ["the loss must be a 0-d floating tensor", "loss.mean()"]),
    "raises in forward": ("t_fwd", textwrap.dedent("""
        class Broken(Model):
            def forward(self, x, y):
                raise KeyError('labels')

        def make():
            return Broken(), batches(), None
        """), "make", 1, ["t_fwd:make", "KeyError", "t_fwd.py:"]),
}


@pytest.fixture
def task_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no __pycache__: the folder's checksum is the test
    monkeypatch.setattr(sys, "path", list(sys.path))
    modules = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - modules:
        if name.startswith("t_") or name in ("json", "yaml"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize("case", list(TASK_CASES))
def test_a_bad_user_task_is_refused_naming_the_task(task_folder, case):
    module, body, func, code, names = TASK_CASES[case]
    (task_folder / f"{module}.py").write_text(TASK_HEAD + body)
    before = checksums(task_folder)
    err = refused(cli("train", *sets(f"task.name={module}:{func}", "train.steps=2", "logging.dir=null"),
                      cwd=task_folder), code, *names)
    assert len(err.strip().splitlines()) == 1, err
    assert checksums(task_folder) == before


@pytest.mark.parametrize("entry,names", [
    ("os:system", ["'os' is a module of Python's standard library"]),
    ("shutil:rmtree", ["'shutil' is a module of Python's standard library"]),
    ("json:make", ["'json' is a module of Python's standard library", "json.py can never be imported",
                   "rename it"]),
    ("yaml:make", ["yaml.py is shadowed by the installed module 'yaml'"]),
    ("t_missing:make", ["no module 't_missing'"]),
])
def test_a_task_that_is_not_the_users_own_function_is_refused_by_name(task_folder, entry, names):
    (task_folder / "json.py").write_text(TASK_HEAD + "def make():\n    return Model(), batches(), None\n")
    (task_folder / "yaml.py").write_text(TASK_HEAD + "def make():\n    return Model(), batches(), None\n")
    before = checksums(task_folder)
    refused(cli("train", *sets(f"task.name={entry}", "train.steps=2", "logging.dir=null"), cwd=task_folder), 2,
            entry, *names)
    assert checksums(task_folder) == before


# ------------------------------------------------------------------ 10. export


def _evil_pt(path: Path) -> None:
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch pwned",))

    path.write_bytes(pickle.dumps({"w": Evil()}))


def _export_source(kind: str, folder: Path) -> Path:
    good = folder / "ck" / "step-00000002.ckpt"
    if kind in DAMAGE:
        bad = folder / "bad.ckpt"
        _damage(kind, good, bad)
        return bad
    if kind == "evil .pt":
        _evil_pt(folder / "evil.pt")
        return folder / "evil.pt"
    if kind == "torch.save of an object":
        import torch

        torch.save({"w": torch.nn.Linear(2, 2)}, folder / "module.pt")
        return folder / "module.pt"
    if kind == "text .pt":
        (folder / "notes.pt").write_text("these are not weights\n")
        return folder / "notes.pt"
    if kind == "garbage .safetensors":
        (folder / "w.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}" + bytes(64))
        return folder / "w.safetensors"
    if kind == "garbage .dcp":
        dcp = folder / "step-00000005.dcp"
        dcp.mkdir()
        (dcp / ".metadata").write_bytes(b"garbage")
        (dcp / "meta.ckpt").write_bytes(good.read_bytes())
        return dcp
    if kind == "empty .dcp":
        (folder / "step-00000006.dcp").mkdir()
        return folder / "step-00000006.dcp"
    if kind == "folder without checkpoints":
        (folder / "empty").mkdir()
        return folder / "empty"
    if kind == "folder of damaged checkpoints":
        (folder / "damaged").mkdir()
        _damage("truncated", good, folder / "damaged" / "step-00000001.ckpt")
        return folder / "damaged"
    return folder / "missing.ckpt"


EXPORT_SOURCES = [k for k in DAMAGE if k not in ("rng too short", "rng wrong dtype", "scaler malformed",
                                                 "step negative", "step a word", "no optimizer", "data position")]
EXPORT_SOURCES += ["evil .pt", "torch.save of an object", "text .pt", "garbage .safetensors", "garbage .dcp",
                   "empty .dcp", "folder without checkpoints", "folder of damaged checkpoints", "missing"]


@pytest.mark.parametrize("kind", EXPORT_SOURCES)
def test_export_refuses_a_bad_source_naming_it_and_writes_nothing(run_copy, kind):
    source = _export_source(kind, run_copy)
    before = checksums(run_copy)
    out = "weights.safetensors" if kind == "garbage .safetensors" else "weights.pt"
    # Without the safetensors extra the refusal comes first, before anything is read: it names
    # the output that needs the package, and the install line.
    names = ([out, "pip install 'ampspec[safetensors]'"] if out.endswith(".safetensors") and not HAVE_SAFETENSORS
             else [source.name])
    err = refused(cli("export", source, out, cwd=run_copy), 2, *names)
    assert len(err.strip().splitlines()) == 1, err
    assert checksums(run_copy) == before and not (run_copy / "pwned").exists()


@pytest.mark.parametrize("out,names", [
    ("weights.bin", ["unknown format '.bin'"]),
    ("exists.pt", ["exists.pt exists", "--force"]),
    ("afolder.pt", ["afolder.pt", "folder"]),
    ("dangling.pt", ["dangling.pt is a symbolic link (to gone.pt)", "--force"]),
    ("linked.pt", ["linked.pt is a symbolic link (to exists.pt)", "--force"]),
])
def test_export_refuses_a_bad_output_naming_it(run_copy, out, names):
    (run_copy / "exists.pt").write_text("keep me\n")
    (run_copy / "afolder.pt").mkdir()
    (run_copy / "dangling.pt").symlink_to("gone.pt")
    (run_copy / "linked.pt").symlink_to("exists.pt")
    before = checksums(run_copy)
    refused(cli("export", "ck", out, cwd=run_copy), 2, *names)
    assert checksums(run_copy) == before and not (run_copy / "gone.pt").exists()


def test_export_force_replaces_a_link_itself_never_its_target(run_copy):
    (run_copy / "target.pt").write_text("keep me\n")
    (run_copy / "out.pt").symlink_to("target.pt")
    rc, out, err = cli("export", "ck", "out.pt", "--force", cwd=run_copy)
    assert rc == 0, err
    assert not (run_copy / "out.pt").is_symlink() and (run_copy / "target.pt").read_text() == "keep me\n"


# ------------------------------------------------------------------ 12. compare --out


@pytest.mark.parametrize("present", ["report.json", "compare.png", "trace-fp32.jsonl"])
def test_compare_refuses_an_out_folder_holding_another_comparison(tmp_path, present):
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / present).write_text("the earlier comparison's\n")
    before = checksums(tmp_path)
    refused(cli("compare", "--task", "mlp", "--steps", "2", "--device", "cpu", "--out", "cmp", cwd=tmp_path), 2,
            "--out cmp", present, "another --out", "--overwrite")
    assert checksums(tmp_path) == before


def test_compare_refuses_an_out_that_is_a_file(tmp_path):
    (tmp_path / "cmp").write_text("a file\n")
    before = checksums(tmp_path)
    refused(cli("compare", "--task", "mlp", "--steps", "2", "--device", "cpu", "--out", "cmp", cwd=tmp_path), 2,
            "cmp", "not a folder")
    assert checksums(tmp_path) == before


def test_compare_overwrite_replaces_the_earlier_report(tmp_path):
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "report.json").write_text('{"agree": true, "steps": 300}\n')
    rc, out, err = cli("-q", "compare", "--task", "mlp", "--steps", "2", "--device", "cpu", "--out", "cmp",
                       "--overwrite", cwd=tmp_path)
    assert rc in (0, 1) and "Traceback" not in err, err
    report = json.loads((tmp_path / "cmp" / "report.json").read_text())
    assert report["steps"] == 2 and not (tmp_path / "cmp" / ".ampspec.lock").exists()


# ------------------------------------------------------------------ 7. counters a callback changed


# A counter of the wrong type or sign is refused as the hook returns (torchimpl.train.callback_checks);
# one of the right type past the checkpoint names' range is refused at the save.
@pytest.mark.parametrize("value,seen", [(10**8, 10**8)])
def test_a_step_counter_set_to_nonsense_by_a_callback_is_refused_at_the_save(tmp_path, value, seen):
    from torchimpl.config.schema import load_config
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Callback, Trainer

    class Meddle(Callback):
        done = False

        def on_step_end(self, trainer, state):
            if not self.done:  # once: a counter set back at every step would never reach the end
                self.done, state.step = True, value

    cfg = load_config(overrides=[*TINY, "train.steps=3", f"checkpoint.folder={tmp_path / 'ck'}",
                                 "checkpoint.interval=1", "logging.dir=null"])
    task = build_task(cfg.task, seed=0, batch_size=4)
    with pytest.raises(ValueError, match=r"trainer's step must be an integer in \[0, 100000000\), got "
                                         + re.escape(repr(seen)) + r".*trainer\.state\.step"):
        Trainer(cfg, [Meddle()]).fit(task.model, task.train_data, loss_fn=task.loss_fn)
    assert not list((tmp_path / "ck").glob("step-*")), "a checkpoint was written under a nonsense name"


@pytest.mark.parametrize("value, fragment", [(-5, "got -5"), (2.5, "got 2.5 (float)"), ("3", "got '3' (str)")])
def test_a_step_counter_of_the_wrong_type_or_sign_is_refused_as_the_hook_returns(tmp_path, value, fragment):
    from torchimpl.train.callback_checks import CallbackStateError
    from torchimpl.config.schema import load_config
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Callback, Trainer

    class Meddle(Callback):
        def on_step_end(self, trainer, state):
            state.step = value

    cfg = load_config(overrides=[*TINY, "train.steps=3", f"checkpoint.folder={tmp_path / 'ck'}",
                                 "checkpoint.interval=1", "logging.dir=null"])
    task = build_task(cfg.task, seed=0, batch_size=4)
    with pytest.raises(CallbackStateError, match=r"callback Meddle\.on_step_end set trainer\.state\.step: .*"
                                                  + re.escape(fragment)):
        Trainer(cfg, [Meddle()]).fit(task.model, task.train_data, loss_fn=task.loss_fn)
    assert not list((tmp_path / "ck").glob("step-*")), "a checkpoint was written under a nonsense name"


# ------------------------------------------------------------------ doctor --task options


@pytest.mark.parametrize("extra, names", [
    (["--batch-size", "0"], ["--batch-size must be at least 1, got 0"]),
    (["--lr", "nan"], ["--lr must be a finite number >= 0, got nan"]),
    (["--lr", "-1"], ["--lr must be a finite number >= 0"]),
    (["--report", "notes.txt"], ["--report notes.txt exists and is not a doctor report", "choose another path"]),
    (["--report", "sub"], ["--report sub is a folder"]),
    (["--report", "link.json"], ["link.json is a symbolic link"]),
])
def test_doctor_options_are_refused_before_any_work(tmp_path, extra, names):
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "notes.txt")
    before = checksums(tmp_path)
    refused(cli("doctor", "--task", "mlp", "--size", "tiny", "--steps", "1", "--precision", "bf16", *extra,
                cwd=tmp_path), 2, *names)
    assert checksums(tmp_path) == before
