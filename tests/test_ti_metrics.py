"""What a user reads of a run: the trace's losses and header, metrics.csv, TensorBoard, the
progress lines, ``-v``/``-q``, and ``ampspec replay`` judging a trace on its own."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import sys

import pytest
import torch
from torch import nn

from torchimpl.cli.app import _parser, main
from torchimpl.config.schema import ConfigError, load_config
from torchimpl.run.metrics import COLUMNS, read_metrics
from torchimpl.run.records import read_trace, read_trace_header, read_trace_metrics
from torchimpl.train.reporting import PROGRESS_LOGGER
from torchimpl.run.state import config_changes
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer

BASE = ["device=cpu", "task.name=mlp", "task.size=tiny", "train.batch_size=4", "train.force_scaler=true",
        "scaler.growth_interval=2"]
LINE = re.compile(r"^step (\d+)/(\d+) loss \S+( val_loss \S+)? lr \S+ scale \S+ skipped \d+ \(\d+\.\d ms/step\)$")


@pytest.fixture(autouse=True)
def _progress_level():
    """The CLI sets the progress logger's level (``-q``); each test starts from INFO."""
    logger = logging.getLogger(PROGRESS_LOGGER)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(old)


class Evaluations(Trainer):
    """A trainer that remembers each validation loss it computed."""

    def evaluate(self, val_data):
        value = super().evaluate(val_data)
        self.values = [*getattr(self, "values", []), value]
        return value


def fit(*sets, trainer_class=Trainer, callbacks=(), val=False, resume=None, data=None, model=None):
    cfg = load_config(overrides=[*BASE, *sets])
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    trainer = trainer_class(cfg, list(callbacks))
    summary = trainer.fit(model or task.model, data or task.train_data, task.val_data if val else None,
                          loss_fn=None if model else task.loss_fn, resume=resume)
    return trainer, summary


class Scaled(nn.Module):
    """Linear regression whose loss is multiplied by the batch's third element (inf plants)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y, factor):
        return ((self.lin(x) - y) ** 2).mean() * factor


def poisoned(n, poison):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g),
             torch.tensor(math.inf if i in poison else 1.0)) for i in range(n)]


# ------------------------------------------------------------------ the trace


def test_trace_lines_carry_the_loss_and_the_validation_loss_after_each_evaluation(tmp_path):
    trace = tmp_path / "t.jsonl"
    t, s = fit("train.steps=7", "train.log_interval=2", "train.eval_interval=3", f"train.trace_file={trace}",
               "logging.dir=null", trainer_class=Evaluations, val=True)
    metrics = read_trace_metrics(trace)
    assert [m["step"] for m in metrics] == list(range(7))
    assert [m["loss"] for m in metrics] == [loss for _, loss in t.loss_history]
    # Evaluations after steps 3, 6 and at the end (7): on the lines of steps 2, 5 and 6.
    assert [m["val_loss"] for m in metrics] == [None, None, t.values[0], None, None, t.values[1], t.values[2]]
    assert t.values[2] == s.final_val_loss
    assert len(read_trace(trace)) == 7  # the records alone, header and metrics left out


def test_the_header_records_the_scaler_policy_and_the_run_settings(tmp_path):
    trace = tmp_path / "t.jsonl"
    t, _ = fit("train.steps=2", "train.microbatches=2", "train.clip_norm=0.5", f"train.trace_file={trace}",
               "logging.dir=null")
    header = read_trace_header(trace)
    assert json.loads(trace.read_text().splitlines()[0]) == header
    assert header["ampspec_trace"] == 1 and header["use_scaler"] is True
    assert header["scaler"] == dataclasses.asdict(t.config.scaler.resolved())
    assert header["scaler"]["growth_interval"] == 2
    assert header["settings"] == {"microbatches": 2, "clip_norm": 0.5, "precision_mode": "fp32",
                                  "optimizer_kind": t.optimizer_kind, "sync_free": False, "torch": torch.__version__}


def test_a_trace_without_header_or_losses_still_reads(tmp_path):
    trace = tmp_path / "t.jsonl"
    fit("train.steps=3", f"train.trace_file={trace}", "logging.dir=null")
    new = read_trace(trace)
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in new))
    assert read_trace_header(old) is None
    assert [r.to_json() for r in read_trace(old)] == [r.to_json() for r in new]
    assert [m["loss"] for m in read_trace_metrics(old)] == [None] * 3


def test_an_unknown_key_on_a_trace_line_is_still_an_error(tmp_path):
    trace = tmp_path / "t.jsonl"
    fit("train.steps=1", f"train.trace_file={trace}", "logging.dir=null")
    lines = trace.read_text().splitlines()
    lines[1] = lines[1][:-1] + ', "bogus": 1}'
    trace.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2: .*unexpected \['bogus'\]"):
        read_trace(trace)


# ------------------------------------------------------------------ replay on its own


def test_replay_without_config_uses_the_header_and_passes_for_a_non_default_policy(tmp_path, capsys, caplog):
    trace = tmp_path / "t.jsonl"
    fit("train.steps=8", "scaler.preset=megatron", f"train.trace_file={trace}", "logging.dir=null")
    assert main(["replay", str(trace)]) == 0
    assert "matches the reference" in capsys.readouterr().out
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_replay_of_a_trace_without_header_uses_the_defaults_and_says_so(tmp_path, capsys, caplog):
    trace = tmp_path / "t.jsonl"
    fit("train.steps=8", f"train.trace_file={trace}", "logging.dir=null")  # growth_interval=2
    old = tmp_path / "old.jsonl"
    old.write_text("".join(trace.read_text().splitlines(keepends=True)[1:]))
    assert main(["replay", str(old)]) == 1  # the false divergence the header prevents
    assert "first divergent step 1: scale_after" in capsys.readouterr().out
    assert any("has no header" in r.getMessage() and "growth_interval=2000" in r.getMessage()
               for r in caplog.records)


def test_replay_with_a_different_given_policy_uses_it_and_names_both(tmp_path, capsys, caplog):
    trace = tmp_path / "t.jsonl"
    fit("train.steps=8", f"train.trace_file={trace}", "logging.dir=null")
    assert main(["replay", str(trace), "--set", "scaler.growth_interval=3"]) == 1
    assert "first divergent" in capsys.readouterr().out
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "growth_interval=3 (given)" in msg and "growth_interval=2 (recorded)" in msg
    caplog.clear()
    assert main(["replay", str(trace), "--set", "scaler.growth_interval=2"]) == 0  # the same: no warning
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_replay_set_changes_only_the_named_field_of_the_recorded_policy(tmp_path, capsys, caplog):
    trace = tmp_path / "t.jsonl"
    fit("train.steps=8", "scaler.init_scale=256.0", "scaler.growth_factor=4.0", f"train.trace_file={trace}",
        "logging.dir=null")
    # The recorded value given again: nothing changes (no reset of init_scale and growth_factor).
    assert main(["replay", str(trace), "--set", "scaler.growth_interval=2"]) == 0, capsys.readouterr().out
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert main(["replay", str(trace), "--set", "scaler.growth_interval=7"]) == 1
    out = capsys.readouterr().out
    assert "first divergent step 1: scale_after" in out, out  # step 0 agrees: the rest of the policy is the run's
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert msg.endswith("growth_interval=7 (given) vs growth_interval=2 (recorded)"), msg
    assert main(["replay", str(trace), "--set", "scaler.growth_intervall=7"]) == 2
    assert "scaler.growth_intervall: unknown key (did you mean 'growth_interval'?)" in capsys.readouterr().err


# ------------------------------------------------------------------ metrics.csv


def test_metrics_csv_has_one_row_per_step_matching_the_trace(tmp_path):
    trace, folder = tmp_path / "t.jsonl", tmp_path / "run"
    t, s = fit("train.steps=6", "train.log_interval=4", "train.microbatches=2", "scaler.init_scale=256.0",
               f"train.trace_file={trace}", f"logging.dir={folder}", "logging.tensorboard=false",
               data=poisoned(12, poison={5}), model=Scaled())
    assert s.metrics_file == str(folder / "metrics.csv") and s.log_dir == str(folder)
    assert (folder / "metrics.csv").read_text().splitlines()[0] == ",".join(COLUMNS)
    rows, records, losses = read_metrics(folder / "metrics.csv"), read_trace(trace), read_trace_metrics(trace)
    assert [r["step"] for r in rows] == list(range(6))
    for row, rec, m in zip(rows, records, losses):
        want = {"step": rec.step, "loss": m["loss"], "val_loss": None, "lr": rec.lr, "scale": rec.scale_after,
                "grad_norm": rec.grad_norm, "skipped": 0 if rec.applied else 1}
        assert json.dumps(row) == json.dumps(want)  # NaN (the skipped step's norm) equal to NaN
    assert [r["skipped"] for r in rows] == [0, 0, 1, 0, 0, 0]  # batch 5 is in window 2 (step 2)


def test_a_resumed_run_s_metrics_equal_the_uninterrupted_run_s(tmp_path):
    class Crash(BaseException):
        pass

    class Die(Callback):
        def on_step_end(self, trainer, state):
            if state.step == 7:
                raise Crash()

    def sets(folder):
        return ["train.steps=10", "train.log_interval=3", "checkpoint.interval=4", f"checkpoint.folder={folder}",
                f"train.trace_file={folder / 't.jsonl'}", "logging.tensorboard=false"]

    whole, part = tmp_path / "whole", tmp_path / "part"
    _, s = fit(*sets(whole))
    assert s.metrics_file == str(whole / "metrics.csv")  # logging.dir: auto is the checkpoint folder
    with pytest.raises(Crash):
        fit(*sets(part), callbacks=[Die()])
    assert len(read_metrics(part / "metrics.csv")) == 7  # rows after the checkpoint at step 4
    fit(*sets(part), resume="latest")
    assert (part / "metrics.csv").read_text() == (whole / "metrics.csv").read_text()
    assert (part / "t.jsonl").read_text() == (whole / "t.jsonl").read_text()


def test_the_logging_section_may_change_on_a_resume():
    a = load_config(overrides=BASE).to_dict()
    b = load_config(overrides=[*BASE, "logging.dir=null", "logging.progress=off", "logging.csv=false"]).to_dict()
    assert config_changes(a, b, mid_window=False) == ([], [])


# ------------------------------------------------------------------ the run folder


def test_without_a_checkpoint_folder_each_run_gets_the_next_version_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPSPEC_RUNS_DIR", str(tmp_path / "runs"))
    (tmp_path / "runs" / "version_3").mkdir(parents=True)
    folders = [fit("train.steps=2", "logging.tensorboard=false")[1].log_dir for _ in range(2)]
    assert folders == [str(tmp_path / "runs" / "version_4"), str(tmp_path / "runs" / "version_5")]
    assert len(read_metrics(tmp_path / "runs" / "version_5" / "metrics.csv")) == 2


def test_logging_dir_null_writes_no_files(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPSPEC_RUNS_DIR", str(tmp_path / "runs"))
    _, s = fit("train.steps=2", "logging.dir=null")
    assert s.metrics_file is None and s.log_dir is None and not (tmp_path / "runs").exists()


def test_an_unwritable_run_folder_is_refused_before_step_1(tmp_path):
    (tmp_path / "file").write_text("")

    class Never(Callback):
        def on_step_end(self, trainer, state):
            raise AssertionError("trained")

    with pytest.raises(ValueError, match=r"logging.dir: cannot create .*file"):
        fit("train.steps=2", f"logging.dir={tmp_path / 'file'}", callbacks=[Never()])


def test_bad_logging_values_name_the_field():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["logging.progress=sometimes", "logging.tensorboard=true", "logging.dir=null"])
    text = str(e.value)
    assert "logging.progress: must be one of" in text and "logging.tensorboard: true needs a run folder" in text


# ------------------------------------------------------------------ TensorBoard


def test_tensorboard_scalars_are_written_when_installed(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (ampspec[tensorboard])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tmp_path / "run"
    t, _ = fit("train.steps=6", "train.eval_interval=3", f"logging.dir={folder}", val=True)
    assert list(folder.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(folder))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "val_loss", "lr", "scale", "grad_norm"}
    assert [e.step for e in acc.Scalars("loss")] == list(range(6))
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([loss for _, loss in t.loss_history], rel=1e-6)
    assert [e.step for e in acc.Scalars("val_loss")] == [2, 5]


def test_tensorboard_true_without_the_package_is_refused_at_start(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import now fails
    with pytest.raises(ValueError, match=r"logging.tensorboard: true.*pip install 'ampspec\[tensorboard\]'"):
        fit("train.steps=2", f"logging.dir={tmp_path / 'run'}", "logging.tensorboard=true")
    assert not (tmp_path / "run" / "metrics.csv").exists()
    _, s = fit("train.steps=2", f"logging.dir={tmp_path / 'run'}")  # null: only when installed
    assert s.metrics_file and not list((tmp_path / "run").glob("events.out.tfevents.*"))


# ------------------------------------------------------------------ progress and the command line


def test_progress_lines_show_on_a_non_terminal_stderr(capsys):
    fit("train.steps=5", "train.log_interval=2", "logging.dir=null")
    lines = capsys.readouterr().err.splitlines()
    assert [LINE.match(line).group(1, 2) for line in lines] == [("2", "5"), ("4", "5"), ("5", "5")], lines


@pytest.mark.parametrize("off", ["off", "'off'"])  # YAML reads a bare off as false
def test_progress_off_shows_nothing(capsys, off):
    fit("train.steps=5", "train.log_interval=2", "logging.dir=null", f"logging.progress={off}")
    assert capsys.readouterr().err == ""


def test_progress_lines_name_the_validation_loss(capsys):
    fit("train.steps=4", "train.log_interval=4", "train.eval_interval=2", "logging.dir=null", val=True)
    lines = capsys.readouterr().err.splitlines()
    assert [LINE.match(line).group(1) for line in lines] == ["2", "4"] and all(" val_loss " in x for x in lines)


@pytest.mark.parametrize("argv,verbose,quiet", [
    (["train", "-v"], True, False), (["-v", "train"], True, False), (["train", "-q"], False, True),
    (["-q", "train"], False, True), (["replay", "t.jsonl", "--quiet"], False, True), (["doctor"], False, False),
    (["compare", "--verbose"], True, False),
])
def test_verbose_and_quiet_parse_before_or_after_the_subcommand(argv, verbose, quiet):
    args = _parser().parse_args(argv)
    assert (args.verbose, args.quiet) == (verbose, quiet)


def test_verbose_with_quiet_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "-v", "-q"])
    assert e.value.code == 2 and "contradict" in capsys.readouterr().err


def test_quiet_silences_the_progress_lines(capsys):
    sets = [x for s in [*BASE, "train.steps=3", "train.log_interval=1", "logging.dir=null"] for x in ("--set", s)]
    assert main(["train", *sets]) == 0
    assert len([x for x in capsys.readouterr().err.splitlines() if LINE.match(x)]) == 3
    assert main(["train", *sets, "-q"]) == 0
    assert not [x for x in capsys.readouterr().err.splitlines() if LINE.match(x)]


@pytest.mark.parametrize("progress,tty", [("bar", False), ("auto", True)])
def test_the_bar_replaces_the_lines(capsys, monkeypatch, progress, tty):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    fit("train.steps=4", "train.log_interval=2", "logging.dir=null", f"logging.progress={progress}")
    err = capsys.readouterr().err
    assert "4/4" in err and ("step/s" in err or "s/step" in err), err  # tqdm's counter and rate
    assert not [x for x in err.splitlines() if LINE.match(x)]
