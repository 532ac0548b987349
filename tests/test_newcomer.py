"""A newcomer's first commands, and inputs that used to lose work or pass silently: each case
through the real command line (``test_bad_input``'s helpers), or the function it names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_bad_input import checksums, cli, refused, sets

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ configuration errors


def test_several_configuration_errors_print_one_per_line(tmp_path):
    r = cli("train", *sets("train.steps=0", "optimizer.lr=-1", "foo.bar=1"), cwd=tmp_path)
    err = refused(r, 2, "train.steps", "optimizer.lr", "foo")
    lines = err.rstrip("\n").splitlines()
    assert lines[0] == "ampspec train: error: invalid configuration (3 errors):", err
    assert [line.split(":")[0] for line in lines[1:]] == ["  foo", "  optimizer.lr", "  train.steps"], err
    assert checksums(tmp_path) == {}


def test_one_configuration_error_stays_on_one_line(tmp_path):
    err = refused(cli("train", *sets("train.steps=0"), cwd=tmp_path), 2, "train.steps")
    assert err == "ampspec train: error: invalid configuration: train.steps: must be an integer >= 1, got 0\n"


# ------------------------------------------------------------------ a deleted working directory


@pytest.mark.parametrize("command", [["train", "--set", "train.steps=2"], ["compare", "--steps", "2"]])
def test_a_deleted_working_directory_is_refused_before_any_work(tmp_path, command):
    gone = tmp_path / "gone"
    gone.mkdir()
    script = 'cd "$1" && rmdir "$1" && shift && exec "$@"'
    r = subprocess.run(["bash", "-c", script, "bash", str(gone), sys.executable, "-m", "torchimpl.cli", *command],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert r.stderr == (f"ampspec {command[0]}: error: the working directory no longer exists (it was deleted or "
                        "moved while this shell was in it); cd to an existing folder and run the command again\n")
    assert not gone.exists() and list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ replay --set


def _one_step_trace(tmp_path: Path) -> Path:
    rec = {"step": 0, "microbatches": 1, "scale_before": 65536.0, "found_inf": True, "applied": False,
           "grad_norm": None, "clip_coef": None, "scale_after": 32768.0, "growth_tracker": 0, "lr": 0.001}
    (tmp_path / "t.jsonl").write_text(json.dumps(rec) + "\n")
    return tmp_path / "t.jsonl"


@pytest.mark.parametrize("item", ["train.steps=5", "optimizer.lr=0.1", "device=cpu"])
def test_replay_refuses_a_set_it_could_not_apply_naming_the_fields_it_can(tmp_path, item):
    trace = _one_step_trace(tmp_path)
    err = refused(cli("replay", trace, "--set", item, cwd=tmp_path), 2, f"--set {item}", "would change nothing",
                  "it can change scaler.init_scale, scaler.growth_factor, scaler.backoff_factor, "
                  "scaler.growth_interval")
    assert len(err.splitlines()) == 1, err


def test_replay_still_takes_a_set_of_the_scalers_fields(tmp_path):
    trace = _one_step_trace(tmp_path)
    rc, out, err = cli("replay", trace, "--set", "scaler.backoff_factor=0.5", cwd=tmp_path)
    assert rc == 0 and "matches the reference" in out, out + err


# ------------------------------------------------------------------ ampspec config


def test_ampspec_config_prints_the_defaults_train_uses():
    from torchimpl.config.schema import load_config

    rc, out, err = cli("config")
    assert rc == 0 and err == "", err
    assert out.startswith("# ampspec train's configuration")
    assert yaml.safe_load(out) == load_config(task_defaults=True).to_dict()


def test_ampspec_config_round_trips_through_train_config(tmp_path):
    from torchimpl.config.schema import load_config

    given = (tmp_path / "mine.yaml")
    given.write_text("precision: bf16-mixed\noptimizer: {betas: [0.8, 0.95], eps: 1.0e-6}\nlogging: {progress: off}\n")
    chosen = ["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=3", "train.batch_size=4",
              "logging.dir=null", "schedule.name=constant"]
    rc, out, err = cli("config", "--config", given, *sets_of(chosen), cwd=tmp_path)
    assert rc == 0, err
    (tmp_path / "printed.yaml").write_text(out)
    want = load_config(given, chosen, task_defaults=True)
    assert load_config(tmp_path / "printed.yaml", task_defaults=True) == want
    assert load_config(tmp_path / "printed.yaml") == want  # every field written: no task defaults needed
    rc, out, err = cli("train", "--config", "printed.yaml", cwd=tmp_path)
    assert rc == 0, err
    summary = json.loads(out)
    assert (summary["steps"], summary["precision_mode"]) == (3, "bf16")


def test_ampspec_config_refuses_a_bad_set_as_train_does(tmp_path):
    refused(cli("config", "--set", "optimizer.eps=0", cwd=tmp_path), 2, "optimizer.eps", "> 0")


def sets_of(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


# ------------------------------------------------------------------ compare's ms/step

# A task whose model advances a fake clock: 1 s on each of its first three training forwards
# (the one-time costs of a precision), 2**-10 s on each later one; evaluation takes no time.
CLOCKED_TASK = """
import torch
from torch import nn

CLOCK = {"t": 0.0}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.calls = 0

    def forward(self, x, y):
        if self.training:
            self.calls += 1
            CLOCK["t"] += 2.0 ** -10 if self.calls > 3 else 1.0
        return ((self.lin(x).float() - y) ** 2).mean()


def make():
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
    return Model(), data, data[:1]
"""


def test_compare_times_each_precision_after_a_warm_up_and_says_so(tmp_path, monkeypatch):
    import importlib
    import time

    from torchimpl.cli.compare import WARMUP_STEPS, format_table, run_compare

    (tmp_path / "clocked.py").write_text(CLOCKED_TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    clocked = importlib.import_module("clocked")
    monkeypatch.setattr(time, "perf_counter", lambda: clocked.CLOCK["t"])
    # 6 steps: the warm-up is capped at half of them, 3, the three slow steps; a median of all six
    # steps would be half slow.
    res = run_compare(steps=6, device="cpu", out=tmp_path / "cmp", task="clocked:make")
    assert len(res.rows) >= 3 and WARMUP_STEPS >= 3
    for row in res.rows:
        assert (row["time_per_step_ms"], row["warmup_steps"]) == (1000 * 2.0 ** -10, 3), row
    assert format_table(res.rows).splitlines()[-1] == (
        "ms/step: the median step after 3 warm-up steps in each precision, which are not counted "
        "(they pay the precision's one-time costs)")


# ------------------------------------------------------------------ busy cores, train.threads


def _situation(**kw):
    from torchimpl.train.threads import ThreadSituation

    return ThreadSituation(**{"threads": 4, "cores": 4, "load": 6.0, "omp_env": None, **kw})


def test_the_busy_cores_warning_comes_only_at_torchs_default_thread_count_on_busy_cores():
    from torchimpl.train.threads import busy_warning

    text = busy_warning(_situation(), "train", None)
    assert text == ("the cores are busy (load 6.0 on 4 cores, about 5.0 of it other work) and torch runs 4 threads, "
                    "its default: they will wait for each other and a small model can train many times slower; "
                    "pass --set train.threads=1 (or set OMP_NUM_THREADS=1 before starting)")
    assert busy_warning(_situation(), "compare", None).endswith("; set OMP_NUM_THREADS=1 before starting")
    assert busy_warning(_situation(omp_env="4"), "train", None) is None  # the count was chosen
    assert busy_warning(_situation(), "train", 4) is None  # train.threads chose it
    assert busy_warning(_situation(load=1.0), "train", None) is None  # idle: the run's own load only
    assert busy_warning(_situation(threads=1), "train", None) is None  # one thread waits for nobody
    assert "OMP_NUM_THREADS=2" in busy_warning(_situation(load=3.0), "compare", None)  # two cores free


@pytest.fixture
def busy_machine(monkeypatch):
    """The load average of a machine whose every core other work keeps busy, torch at two
    threads and OMP_NUM_THREADS unset: the case of the warning."""
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count() or 1) + 4.0, 0.0, 0.0))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


TINY_RUN = ["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=2", "train.batch_size=4",
            "logging.dir=null", "logging.progress=off"]


def test_train_and_compare_warn_once_on_busy_cores_and_train_threads_silences_it(tmp_path, busy_machine, caplog):
    def busy() -> list[str]:  # pytest's log handler holds the records the command line prints
        found = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the cores are busy")]
        caplog.clear()
        return found

    rc, out, err = cli("train", *sets_of(TINY_RUN), cwd=tmp_path)
    assert rc == 0, err
    [text] = busy()
    assert "pass --set train.threads=" in text
    rc, out, err = cli("train", *sets_of([*TINY_RUN, "train.threads=1"]), cwd=tmp_path)
    assert rc == 0 and busy() == [], err
    rc, out, err = cli("compare", "--task", "mlp", "--steps", "2", "--device", "cpu", "--out", "cmp", cwd=tmp_path)
    [text] = busy()
    assert "set OMP_NUM_THREADS=" in text and "train.threads" not in text


def test_train_threads_sets_torchs_count_for_the_run_and_restores_it():
    import torch

    from torchimpl.config.schema import load_config
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Callback, Trainer

    seen = []

    class Threads(Callback):
        def on_step_end(self, trainer, state):
            seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    wanted = 3 if before != 3 else 2
    cfg = load_config(overrides=[*TINY_RUN, f"train.threads={wanted}"])
    task = build_task(cfg.task, seed=0, batch_size=4)
    Trainer(cfg, [Threads()]).fit(task.model, task.train_data, loss_fn=task.loss_fn)
    assert seen == [wanted, wanted] and torch.get_num_threads() == before


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "'two'"])
def test_train_threads_is_a_whole_number_of_at_least_one(value):
    from torchimpl.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"train\.threads: must be (an integer >= 1|an integer or null), got"):
        load_config(overrides=[f"train.threads={value}"])


# ------------------------------------------------------------------ resume with a changed task


def test_a_resume_with_a_changed_task_size_names_the_field_not_a_damaged_checkpoint(tmp_path):
    run = [*TINY_RUN, "checkpoint.folder=ck"]
    rc, out, err = cli("train", *sets_of(run), cwd=tmp_path)
    assert rc == 0, err
    before = checksums(tmp_path)
    err = refused(cli("train", *sets_of([*run, "task.size=small", "train.steps=4"]), "--resume", cwd=tmp_path), 2,
                  "task.size: 'tiny' (checkpoint) -> 'small' (now)", "Resume with the checkpoint's values")
    assert "damaged" not in err and "different model" not in err, err
    assert checksums(tmp_path) == before


# ------------------------------------------------------------------ bench/doctor_cost.py


def test_the_doctor_cost_benchmark_runs_several_rounds(tmp_path, capsys):
    """A smoke run (2 rounds of 1 step on the tiny task): every training run gets a run folder of
    its own, so the second round is not refused for the first one's files."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("doctor_cost", ROOT / "bench" / "doctor_cost.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main_(["--rounds", "2", "--steps", "1", "--size", "tiny", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "doctor_cost.json").read_text())
    assert (data["rounds"], data["steps"], data["size"]) == (2, 1, "tiny")
    assert sorted(data["ratio_vs_train"]) == ["doctor_bf16", "doctor_fp16", "loop_bf16", "loop_fp16",
                                              "train_stats_1", "train_stats_10"]
    assert all(r["rounds"] == 2 for r in data["ratio_vs_train"].values())
    # Each diagnosis against the training run in the precision it diagnoses: ampspec train does
    # not run fp16 on a CPU, so the fp16 diagnosis's baseline is the hand-written fp16 loop.
    same = data["ratio_vs_same_precision"]
    assert sorted(same) == ["doctor_bf16", "doctor_fp16"]
    assert same["doctor_bf16"] == data["ratio_vs_train"]["doctor_bf16"]
    assert same["doctor_fp16"]["rounds"] == 2 and same["doctor_fp16"] != data["ratio_vs_train"]["doctor_fp16"]
    out = capsys.readouterr().out
    assert "cost against a plain ampspec train of the same 1 steps" in out
    assert "doctor_fp16" in out.split("in its own precision")[1] and "x loop_fp16" in out
