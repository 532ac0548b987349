"""Unit tests of the audit: instrumentation and its removal, the pieces of the rules, the replay's
stages failing when torch does something else, the reports, the command and the fixture."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
import torch

import torchimpl.cli.app as cli
from audit import RULES, Audit, Finding, audit
from audit.recorder import _classify, _loss_factor, call_site
from audit.runner import run_script, split_audit_options
from audit.worker import available as worker_available

ROOT = Path(__file__).resolve().parents[1]
LOOPS = ROOT / "tests" / "audit_loops"


def _loop(bug: str = "none", steps: int = 4, clip: float = 1.0, inf_at: int = -1,
          scaler_cls: type = torch.amp.GradScaler) -> list[float]:
    """A small GradScaler loop written inline; returns its losses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = scaler_cls("cpu", growth_interval=2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x), y)
            if bug == "backward-in-autocast":
                scaler.scale(loss).backward()
        if step == inf_at:
            loss = loss * float("inf")
        if bug != "backward-in-autocast":
            scaler.scale(loss).backward()
        if bug == "clip-before-unscale":
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.unscale_(opt)
        if bug != "clip-before-unscale":
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
    return losses


def _patched_objects() -> list[object]:
    """Every object the instrumentation replaces (read without going through any of them)."""
    from torch.nn.utils import clip_grad
    from torch.optim import lr_scheduler

    out: list[object] = [torch.save, torch.serialization.save, torch.autograd.backward,
                         torch.Tensor.__dict__["backward"], torch.optim.Optimizer.__dict__["zero_grad"],
                         torch.optim.Optimizer.__dict__["add_param_group"], torch.nn.Module.__dict__["zero_grad"],
                         torch.amp.autocast_mode.autocast.__dict__["__enter__"],
                         torch.amp.autocast_mode.autocast.__dict__["__exit__"]]
    out += [torch.amp.GradScaler.__dict__[n] for n in ("__init__", "scale", "unscale_", "step", "update",
                                                          "state_dict", "load_state_dict")]
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    out += [ShardedGradScaler.__dict__[n] for n in ("scale", "unscale_", "update")]
    out += [c.__dict__["step"] for c in vars(lr_scheduler).values()
            if isinstance(c, type) and issubclass(c, lr_scheduler.LRScheduler) and "step" in c.__dict__]
    for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"):
        public = getattr(torch.nn.utils, name)
        out += [public, getattr(clip_grad, name.replace("clip_grads", "_clip_grads"), None),
                public.__closure__[0].cell_contents if public.__closure__ else None]
    return out


def _hooks() -> int:
    from torch.optim import optimizer

    return len(optimizer._global_optimizer_pre_hooks) + len(optimizer._global_optimizer_post_hooks)


# ----------------------------------------------------------------------------- instrumentation


def test_the_instrumentation_is_removed_after_the_audit_even_when_the_code_fails():
    before, hooks = _patched_objects(), _hooks()
    with audit() as session:
        assert [a is b for a, b in zip(_patched_objects(), before)].count(False) >= 20
        _loop(steps=2)
    assert all(a is b for a, b in zip(_patched_objects(), before)) and _hooks() == hooks
    with pytest.raises(ZeroDivisionError):
        with audit():
            _loop(steps=1)
            1 / 0
    assert all(a is b for a, b in zip(_patched_objects(), before)) and _hooks() == hooks
    assert session.report.ok


def test_audits_do_not_nest():
    with audit():
        with pytest.raises(RuntimeError, match="already active"):
            Audit().start()


def test_the_audited_run_computes_exactly_what_the_plain_run_computes():
    plain = _loop(steps=6, inf_at=2)
    with audit() as session:
        audited = _loop(steps=6, inf_at=2)
    assert np.array(plain).view(np.uint64).tolist() == np.array(audited).view(np.uint64).tolist() or \
        [repr(a) for a in plain] == [repr(a) for a in audited]
    assert [r.applied for r in session.report.steps] == [True, True, False, True, True, True]


def test_the_context_manager_reports_and_stops_at_the_step_limit():
    with audit() as session:
        _loop(bug="clip-before-unscale", steps=3)
    assert [(f.rule, f.step) for f in session.report.findings] == [("clip-before-unscale", s) for s in range(3)]
    with audit(steps=2) as limited:
        _loop(steps=10)
    assert [r.step for r in limited.report.steps] == [0, 1] and limited.report.stopped
    with pytest.raises(ValueError, match="steps"):
        audit(steps=0)


def test_the_call_site_is_the_callers_line():
    here = call_site()
    assert here.endswith(f"test_audit.py:{sys._getframe().f_lineno - 1}")


# ----------------------------------------------------------------------------- rule pieces


def test_the_loss_factor_is_read_from_the_graph():
    x = torch.randn(3, requires_grad=True)
    loss = (x * x).mean()
    scaled = torch.amp.GradScaler("cpu").scale(loss / 4)
    assert _loss_factor(loss) == 1.0
    assert _loss_factor(loss / 4) == 0.25
    assert _loss_factor(loss * 0.25) == 0.25
    assert _loss_factor(torch.tensor(0.5) * loss) == 0.5
    assert _loss_factor((loss / 4).double()) == 0.25
    assert _loss_factor(loss + loss) == 1.0
    assert _loss_factor(scaled) == 0.25 * 65536.0  # the scaler's own multiply: excluded by the recorder


def test_saved_objects_are_classified_by_what_they_hold():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    assert _classify({"model": model.state_dict(), "optimizer": opt.state_dict()}) == (True, False)
    assert _classify({"optimizer": opt.state_dict(), "amp": {"scaler": scaler.state_dict()}}) == (True, True)
    assert _classify([opt, scaler]) == (True, True)
    assert _classify(model.state_dict()) == (False, False)


def test_audit_options_after_the_script_and_the_double_dash():
    assert split_audit_options(["--lr", "1", "--report", "r.json", "--steps=3", "--no-replay"]) == \
        (["--lr", "1"], {"report": "r.json", "steps": "3", "no_replay": True})
    assert split_audit_options(["--steps", "3", "--", "--steps", "100", "--report", "x"]) == \
        (["--steps", "100", "--report", "x"], {"steps": "3"})
    with pytest.raises(ValueError, match="--report needs a value"):
        split_audit_options(["--report"])


def test_every_rule_has_a_severity_a_summary_and_a_fix():
    assert {r.severity for r in RULES.values()} == {"error", "warning", "info"}
    assert all(r.summary and r.fix for r in RULES.values())
    assert Finding("loss-not-divided", 0, "x:1", "m", level="warning").severity == "warning"
    with pytest.raises(ValueError, match="level must be one of"):
        Finding("loss-not-divided", 0, "x:1", "m", level="fatal")
    with pytest.raises(ValueError, match="level must be one of .'error',. for a optimizer-before-to finding"):
        Finding("optimizer-before-to", 0, "x:1", "m", level="warning")
    with pytest.raises(ValueError, match="unknown rule"):
        Finding("no-such-rule", 0, "x:1", "m")
    d = Finding("replay-divergence", 3, "t.py:9", "m", expected=float("nan"), got=np.float32(2.5)).to_dict()
    assert {"rule", "step", "where", "message", "expected", "got"} <= set(d)
    assert d["expected"] == "nan" and d["got"] == 2.5


# ----------------------------------------------------------------------------- the replay's stages


def test_the_replay_bounds_are_the_conformance_suites_and_the_spec_rows():
    from audit import optimizers, replay
    from conformance import expectations
    from reference import optim

    assert replay.NORM_ULP == expectations.NORM_ULP
    for name, row in optim.SPECS.items():
        entry, _ = optimizers.lookup(getattr(torch.optim, name))
        assert dict(entry.ulp) == dict(row.native_ulp), f"{name}: the audit's bounds are not its spec row's"


def test_a_scaler_override_that_calls_the_base_method_reports_once(monkeypatch):
    """A GradScaler subclass the audit instruments (as FSDP's ShardedGradScaler) whose override
    calls ``super()``: the inner call is not a second update (which would be a false
    update-without-step)."""
    import audit.instrument as instrument

    class Overriding(torch.amp.GradScaler):
        def update(self, new_scale=None):
            return super().update(new_scale)

        def unscale_(self, optimizer):
            return super().unscale_(optimizer)

    monkeypatch.setattr(instrument, "_scaler_subclasses", lambda: [Overriding])
    with audit() as session:
        _loop(steps=4, inf_at=2, scaler_cls=Overriding)
    assert session.report.findings == [], session.report.text()
    assert session.report.replay["updates_checked"] == 4
    for r in session.report.steps:
        names = [c.split("@")[0] for c in r.calls]
        assert names.count("scaler.unscale_") == 1 and names.count("scaler.update") == 1, r.calls


def test_an_eager_loop_is_reported_without_dynamo_s_disabled_wrappers(monkeypatch):
    """Where no compiled code runs, each wrapper of a call Dynamo does not trace reports directly,
    not through its version with Dynamo off (`audit.instrument._skipped_by_dynamo`,
    ``torch._disable_dynamo``, which sets and restores Dynamo's frame callback: 1-2 us a call):
    the audited loop makes as many of those calls as the plain one (torch's own
    ``Optimizer.zero_grad`` makes them). Each wrapper stays a function Dynamo skips: a compiled
    function breaks its graph there as without the audit (tests/test_audit_compiled.py)."""
    import torch._dynamo.eval_frame as eval_frame

    real, calls = eval_frame.set_eval_frame, []

    def counted(callback):
        calls.append(callback)
        return real(callback)

    monkeypatch.setattr(eval_frame, "set_eval_frame", counted)
    _loop(steps=3, inf_at=1)
    plain, calls[:] = len(calls), []
    with audit() as session:
        _loop(steps=3, inf_at=1)
        wrappers = {"GradScaler." + n: getattr(torch.amp.GradScaler, n)
                    for n in ("scale", "unscale_", "step", "update", "state_dict", "load_state_dict")}
        wrappers.update({"Optimizer.zero_grad": torch.optim.Optimizer.zero_grad,
                         "Tensor.backward": torch.Tensor.backward, "torch.autograd.backward": torch.autograd.backward})
        skipped = {n: getattr(w, "_torchdynamo_disable", False) for n, w in wrappers.items()}
    assert plain > 0 and len(calls) == plain, (plain, len(calls))
    assert skipped == {n: True for n in wrappers}
    assert session.report.ok and len(session.report.steps) == 3, session.report.text()


def test_a_scale_update_unlike_the_specifications_is_a_divergence(monkeypatch):
    original = torch._amp_update_scale_
    calls = []

    def wrong_update(scale, tracker, found_inf, growth, backoff, interval):
        out = original(scale, tracker, found_inf, growth, backoff, interval)
        calls.append(1)
        if len(calls) == 3:
            scale.mul_(3.0)  # one update grows by a factor the policy does not have
        return out

    monkeypatch.setattr(torch, "_amp_update_scale_", wrong_update)
    with audit() as session:
        _loop(steps=5)
    (f,) = session.report.findings
    assert (f.rule, f.step) == ("replay-divergence", 2)
    assert "scale after scaler.update" in f.message and f.got == 3 * f.expected


def test_a_missed_overflow_is_a_divergence(monkeypatch):
    original = torch._amp_foreach_non_finite_check_and_unscale_

    def blind_check(grads, found_inf, inv_scale):
        original(grads, found_inf, inv_scale)
        found_inf.zero_()  # a check that never reports inf

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", blind_check)
    with audit() as session:
        _loop(steps=4, inf_at=1)
    (f,) = session.report.findings
    assert (f.rule, f.step) == ("replay-divergence", 1) and "found_inf" in f.message
    assert (f.expected, f.got) == (True, False)


def test_the_layering_holds_and_the_order_rules_load_only_the_specification_s_call_sequence():
    """Without the replay the audit reads the specification's GradScaler call sequence
    (``reference.scaling`` rule 12, the stages its order rules are judged by) and nothing of its
    arithmetic: the replay alone loads the rest."""
    code = textwrap.dedent("""
        import sys
        import reference, torchimpl, torchimpl.cli.app
        assert not any(m.split(".")[0] == "audit" for m in sys.modules), "torchimpl or reference imported the audit"
        for m in [m for m in sys.modules if m == "reference" or m.startswith("reference.")]:
            del sys.modules[m]
        sys.path.insert(0, %r)
        import test_audit
        from audit import audit
        with audit(replay=False) as s:
            test_audit._loop(bug="clip-before-unscale", steps=2)
        assert [f.rule for f in s.report.findings] == ["clip-before-unscale"] * 2
        spec = sorted(m for m in sys.modules if m == "reference" or m.startswith("reference."))
        assert spec == ["reference", "reference.scaling"], spec
        print("ok")
    """) % str(ROOT / "tests")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr


# ----------------------------------------------------------------------------- reports and the command


def test_the_text_report_groups_by_rule_with_the_first_in_full():
    report = run_script(LOOPS / "scaler_loop.py", ["--bug", "clip-before-unscale", "--steps", "14"])
    lines = report.text().splitlines()
    head = lines.index(next(l for l in lines if l.startswith("clip-before-unscale (error)")))
    assert "14 findings" in lines[head]
    assert lines[head + 1].startswith("  step 0, ") and "loss scale 65536.0" in lines[head + 1]
    assert lines[head + 2].startswith("    expected: ") and lines[head + 3].startswith("    got: ")
    assert lines[head + 4].startswith("    fix: call scaler.unscale_(optimizer)")
    assert lines[head + 5] == f"  step 1, {report.findings[1].where}"
    assert lines[-1].startswith("  ... and 4 more, steps 10-13")


def _cli(capsys, *args):
    status = cli.main(["audit", *map(str, args)])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("argv,script_sees", [
    (["--steps", "2", "{script}", "--", "--steps", "10000"], ["--steps", "10000"]),
    (["{script}", "--", "--steps", "10000"], ["--steps", "10000"]),
    (["{script}", "--lr", "1", "--steps", "2", "--", "--report", "x"], ["--lr", "1", "--report", "x"]),
    (["-q", "{script}", "--lr", "1"], ["--lr", "1"]),
])
def test_after_a_double_dash_everything_goes_to_the_script(tmp_path, capsys, argv, script_sees):
    """docs/audit.md's ``ampspec audit --steps 50 train.py -- --steps 10000``: the script gets its own
    ``--steps``, the audit keeps its limit."""
    script = tmp_path / "show_argv.py"
    script.write_text("import json, sys\nprint('ARGV ' + json.dumps(sys.argv[1:]))\n")
    status, out, _ = _cli(capsys, *[a.format(script=script) for a in argv])
    assert status == 0
    seen = next(line for line in out.splitlines() if line.startswith("ARGV "))
    assert json.loads(seen[5:]) == script_sees


def test_the_command_exit_status_and_json_report(tmp_path, capsys):
    loop = LOOPS / "accumulation_loop.py"
    status, out, _ = _cli(capsys, loop, "--steps", "3")
    assert status == 0 and "0 findings" in out and "stopped after 3 steps" in out
    report = tmp_path / "r.json"
    status, out, _ = _cli(capsys, loop, "--bug", "loss-not-divided", "--report", report, "--steps", "2")
    assert status == 1 and "loss-not-divided (error)" in out
    data = json.loads(report.read_text())
    assert data["status"] == "findings" and data["exit_status"] == 1 and len(data["steps"]) == 2
    first = data["findings"][0]
    assert (first["rule"], first["step"], first["where"].rsplit(":", 1)[0].endswith("accumulation_loop.py")) == \
        ("loss-not-divided", 0, True)
    assert {"message", "expected", "got", "fix", "severity"} <= set(first)
    assert data["steps"][0]["microbatches"] == 4 and data["steps"][0]["replay"] in ("bit for bit",) or \
        data["steps"][0]["replay"].startswith("within the bounds")
    status, out, _ = _cli(capsys, "--no-replay", loop, "--steps", "2", "--", "--bug", "zero-grad-in-window")
    assert status == 1 and "numeric replay: off" in out and "zero-grad-in-window" in out


def test_bad_scripts_exit_2_with_a_clear_message(tmp_path, capsys):
    status, _, err = _cli(capsys, tmp_path / "missing.py")
    assert status == 2 and "no such script" in err
    failing = tmp_path / "failing.py"
    failing.write_text("import torch\n\ndef train():\n    raise KeyError('no such column')\n\ntrain()\n")
    status, out, err = _cli(capsys, failing)
    assert status == 2 and "the audited program failed" in out
    assert "Traceback" in err and 'failing.py", line 4, in train' in err and "KeyError: 'no such column'" in err
    assert "runpy" not in err and "audit/runner.py" not in err
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\ndef f(:\n")
    status, out, err = _cli(capsys, broken)
    assert status == 2 and "the audited program failed" in out
    # As Python shows it: the file, the line and the error; no traceback through runpy or the audit.
    assert 'broken.py", line 2' in err and "SyntaxError" in err and "Traceback" not in err, err
    assert "runpy" not in err and "audit/" not in err


def test_a_script_exit_status_is_the_commands_and_the_report_is_still_written(tmp_path, capsys):
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.path.insert(0, %r)\nfrom test_audit import _loop\n_loop(steps=2)\n"
                     "sys.exit(3)\n" % str(ROOT / "tests"))
    report = tmp_path / "r.json"
    status, out, err = _cli(capsys, exits, "--report", report)
    assert status == 3 and "exited with status 3" in out
    assert "Traceback" not in err and "ScriptExit" not in err + out
    data = json.loads(report.read_text())
    assert data["exit_status"] == 3 and data["script_status"] == 3 and len(data["steps"]) == 2
    exits.write_text("import sys\nsys.exit('no data found')\n")
    status, _, err = _cli(capsys, exits)
    assert status == 1 and "no data found" in err
    exits.write_text("import sys\nsys.exit(0)\n")
    assert _cli(capsys, exits)[0] == 0


def test_a_script_that_forks_gets_one_report_from_its_parent(tmp_path, capsys):
    """The child inherits the audit: it must neither join nor kill the parent's replay worker
    (multiprocessing asserts 'can only join a child process'), nor print or write a report."""
    script = tmp_path / "forks.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        import torch
        torch.set_num_threads(1)  # OpenMP's threads do not survive a fork (as in DataLoader workers)
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_audit import _loop
        _loop(steps=2)
        pid = os.fork()
        if pid == 0:
            _loop(steps=1)   # the child trains too, unaudited, and returns normally
        else:
            assert os.waitpid(pid, 0)[1] == 0
    """))
    report = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "torchimpl.cli", "audit", str(script), "--report", str(report)],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "can only join a child process" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.count("ampspec audit of") == 1, r.stdout
    data = json.loads(report.read_text())
    assert len(data["steps"]) == 2 and data["findings"] == []


def test_exit_status_counts_errors_only_unless_strict(tmp_path, capsys):
    """As linters do it: a warning is printed and reported, and fails only under --strict."""
    loop = LOOPS / "scaler_loop.py"
    status, out, _ = _cli(capsys, loop, "--steps", "2", "--bug", "backward-in-autocast")
    assert status == 0 and "2 findings (0 errors, 2 warnings, 0 info)" in out
    status, out, _ = _cli(capsys, "--strict", loop, "--steps", "2", "--bug", "backward-in-autocast")
    assert status == 1 and "[strict" in out
    status, out, _ = _cli(capsys, loop, "--steps", "2", "--bug", "clip-before-unscale", "--strict")
    assert status == 1 and "2 findings (2 errors, 0 warnings, 0 info)" in out


# ----------------------------------------------------------------------------- the pytest fixture


def test_the_pytest_fixture_fails_a_test_whose_loop_breaks_a_rule(tmp_path):
    (tmp_path / "test_user.py").write_text(textwrap.dedent(f"""
        import sys
        import pytest
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_audit import _loop

        def test_good(ampspec_audit):
            _loop(steps=3)

        def test_bad(ampspec_audit):
            _loop(bug="clip-before-unscale", steps=2)

        def test_decides_itself(ampspec_audit):
            _loop(bug="clip-before-unscale", steps=1)
            report = ampspec_audit.stop()
            assert report.rules() == ["clip-before-unscale"]

        def test_warning_passes(ampspec_audit):
            _loop(bug="backward-in-autocast", steps=1)

        @pytest.mark.ampspec_audit(strict=True)
        def test_warning_fails_when_strict(ampspec_audit):
            _loop(bug="backward-in-autocast", steps=1)
    """))
    from importlib.metadata import entry_points

    registered = any(ep.name == "ampspec_audit" for ep in entry_points(group="pytest11"))
    args = [] if registered else ["-p", "audit.pytest_plugin"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "test_user.py"],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=180,
                       cwd=tmp_path)
    assert "2 failed, 3 passed" in r.stdout, r.stdout + r.stderr
    assert "FAILED test_user.py::test_bad" in r.stdout and "clip-before-unscale (error)" in r.stdout
    assert "FAILED test_user.py::test_warning_fails_when_strict" in r.stdout
    assert "AuditFindingsWarning" in r.stdout and "backward-in-autocast (warning)" in r.stdout


# ----------------------------------------------------------------------------- the replay's worker


@pytest.mark.parametrize("loop,args", [
    ("scaler_loop.py", ["--bug", "unscale-twice", "--steps", "6", "--inf-at", "2"]),
    ("scheduler_loop.py", ["--steps", "12", "--every", "4", "--rollback", "8", "--inf-at", "3,9"]),
    ("two_optimizers_loop.py", ["--steps", "6", "--order", "gan", "--inf-at", "2"]),
    ("scaler_loop.py", ["--bug", "gradients-altered", "--clip", "split", "--steps", "4"]),
])
def test_the_replay_finds_the_same_in_a_process_on_a_thread_and_inline(monkeypatch, loop, args, tmp_path):
    """The three places the replay can run reach the same findings and step verdicts."""

    def run(mode: str) -> tuple[list, list]:
        monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", mode)
        out = tmp_path / "out"  # one folder for every mode: the messages name the files
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        extra = ["--out", str(out)] if "scheduler" in loop else []
        report = run_script(LOOPS / loop, [*args, *extra])
        assert report.error is None, report.error
        return ([(f.rule, f.step, f.message) for f in report.findings],
                [{k: v for k, v in r.to_dict().items()} for r in report.steps])

    modes = ["inline", "thread"] + (["process"] if worker_available() else [])
    results = {m: run(m) for m in modes}
    for m in modes[1:]:
        assert results[m] == results["inline"], m
    assert any(r["replay"] != "off" for r in results["inline"][1])


def test_an_unknown_replay_mode_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "gpu")
    with pytest.raises(ValueError, match="AMPSPEC_AUDIT_REPLAY must be one of process, thread, inline, got 'gpu'"):
        audit().start()


def test_off_the_cpu_only_the_scaler_and_skip_stages_are_replayed(monkeypatch):
    """A step on another device (a GPU) keeps its found_inf, skip and unscale checks, which hold
    bit for bit on every device; the clip norm (another summation order) and the optimizer are
    named not replayed, so a norm that differs from the CPU's is no false divergence."""
    import audit.replay as replay

    seen = []
    monkeypatch.setattr(replay.Replayer, "step", lambda self, o, d, rec, recorder: seen.append((o, d, rec)))
    with audit():
        _loop(steps=1)
        _loop(steps=1, clip=float("inf"))  # a coefficient of 1: the clipped gradients are the unscaled ones

    def replay_off_the_cpu(o, d, rec):
        d.on_cpu = False
        r = replay.Replayer(mode="inline")
        rec.replay = "off"
        r._replay_one(replay.optimizer_ref(o), d, rec)
        return r, rec.replay

    (o, d, rec), (o2, d2, rec2) = seen
    d.clips[0].total_norm = np.float32(d.clips[0].total_norm * 1.5)
    r, verdict = replay_off_the_cpu(o, d, rec)
    assert r.divergences == [] and verdict.startswith("partly replayed: clip_grad_norm_ on a device other than the CPU")
    d2.clips = []
    r, verdict = replay_off_the_cpu(o2, d2, rec2)
    assert r.divergences == [] and verdict == "partly replayed: parameters on a device other than the CPU"
    d2.scaled[0] = np.full_like(d2.scaled[0], np.inf)  # an overflow the scaler's flag did not see
    r, verdict = replay_off_the_cpu(o2, d2, rec2)
    assert [dv.field for dv in r.divergences][:1] == ["found_inf"]


def test_a_failure_of_the_replay_itself_is_raised_not_hidden(monkeypatch):
    import audit.replay as replay

    def broken(self, *args):
        raise ValueError("a bug in the replay")

    monkeypatch.setattr(replay.Replayer, "_replay_step", broken)
    before = _patched_objects()
    session = audit().start()
    _loop(steps=2)
    with pytest.raises(RuntimeError, match="the audit's replay failed: ValueError"):
        session.stop()
    assert all(a is b for a, b in zip(_patched_objects(), before))


# ---------------------------------------------------------------------------------- the comparison

_EDGES = {np.float32: [0, 1, 0x007FFFFF, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7FFFFFFF, 0x80000000,
                       0x80000001, 0xFF7FFFFF, 0xFF800000, 0xFFFFFFFF, 0x3F800000],
          np.float16: [0, 1, 0x03FF, 0x7BFF, 0x7C00, 0x7E00, 0x7FFF, 0x8000, 0x8001, 0xFBFF, 0xFC00, 0xFFFF, 0x3C00]}


def _oracle(got: np.ndarray, expected: np.ndarray, bound: int, x_abs: np.ndarray | None) -> bool:
    """Element by element, on Python numbers: the contract `_compare` states."""
    width = 8 * got.dtype.itemsize
    for g, e, xa in zip(got.tolist(), expected.tolist(), [None] * got.size if x_abs is None else x_abs.tolist()):
        gb = int(np.array(g, got.dtype).view(f"u{got.dtype.itemsize}"))
        eb = int(np.array(e, got.dtype).view(f"u{got.dtype.itemsize}"))
        if math.isnan(g) or math.isnan(e):
            if math.isnan(g) != math.isnan(e):
                return False
            continue
        if bound == 0:
            if gb != eb:
                return False
            continue
        if math.isinf(g) or math.isinf(e):
            if g != e:
                return False
            continue

        def ordinal(b: int) -> int:
            mag = b & ((1 << (width - 1)) - 1)
            return -mag if b >> (width - 1) else mag

        dist = abs(ordinal(gb) - ordinal(eb))
        if dist <= bound // 2 or x_abs is None:
            if dist > bound:
                return False
            continue
        unit = max(float(np.spacing(np.array(abs(xa), got.dtype))), float(np.finfo(got.dtype).smallest_subnormal))
        if abs(g - e) / unit > bound:
            return False
    return True


@st.composite
def _compared_pairs(draw: Any) -> tuple[np.ndarray, np.ndarray, int, np.ndarray | None]:
    """Pairs of arrays a few ULPs apart: bit patterns drawn at random or at the edges (zeros of
    both signs, the largest finite, infinities, NaNs), the other array's patterns at distances up
    to a little past the bound (wrapping), now and then the same magnitude of the other sign."""
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    width = 8 * np.dtype(dtype).itemsize
    bound = draw(st.sampled_from([0, 2, 4, 8, 30]))
    n = draw(st.integers(1, 6))
    pattern = st.integers(0, 7).flatmap(lambda k: st.sampled_from(_EDGES[dtype]) if k == 0
                                        else st.integers(0, (1 << width) - 1))
    base = draw(st.lists(pattern, min_size=n, max_size=n))
    near = sorted({0, bound // 2, bound // 2 + 1, bound, bound + 1})  # either side of both thresholds
    delta = st.one_of(st.sampled_from(near + [-d for d in near]), st.integers(-bound - 2, bound + 2))
    deltas = draw(st.lists(delta, min_size=n, max_size=n))
    flips = draw(st.lists(st.integers(0, 5).map(lambda k: k == 0), min_size=n, max_size=n))
    other = np.array([(b + d) % (1 << width) ^ (f << (width - 1)) for b, d, f in zip(base, deltas, flips)],
                     dtype=f"u{width // 8}")
    got, expected = np.array(base, dtype=f"u{width // 8}").view(dtype), other.view(dtype)
    if draw(st.booleans()):
        got, expected = expected, got
    x_abs = None
    if draw(st.booleans()):
        with np.errstate(all="ignore"):
            x_abs = np.abs(got.astype(np.float64)) * draw(st.sampled_from([0.0, 1.0, 4.0]))
        x_abs = np.where(np.isfinite(x_abs), x_abs, 0.0)
    return got, expected, bound, x_abs


_TWO_ULP = np.array([0x3F800002, 0x40000000], np.uint32).view(np.float32)  # 1.0 two ULPs up, 2.0


@settings(max_examples=400, deadline=None)
@given(_compared_pairs())
@example((_TWO_ULP, np.array([1.0, 2.0], np.float32), 2, np.zeros(2)))  # past bound // 2: x_abs decides
@example((np.array([0.0], np.float32), np.array([-0.0], np.float32), 0, None))  # the bits differ
def test_the_comparison_agrees_with_an_element_by_element_ulp_distance(case):
    """The replay's whole-array comparison (with its fast path) decides each pair as the stated rule
    does one element at a time: NaN as a class, bit for bit at bound 0, else within ``bound`` ULPs
    of the value, or of ``x_abs`` past ``bound // 2``."""
    from audit.replay import _compare

    got, expected, bound, x_abs = case
    with np.errstate(all="ignore"):
        verdict = _compare(got, expected, bound, x_abs).problem is None
        want = _oracle(got, expected, bound, x_abs)
    assert verdict == want, (f"bound {bound}: got bits {got.view(f'u{got.dtype.itemsize}').tolist()}, expected bits "
                             f"{expected.view(f'u{got.dtype.itemsize}').tolist()}, x_abs {x_abs}: the comparison "
                             f"says {verdict}, the rule {want}")


# ---------------------------------------------------------------------------------- the replay process

needs_process = pytest.mark.skipif(not worker_available(), reason="the replay process needs Linux (os.fork, os.memfd_create)")


@needs_process
def test_the_replay_process_ends_with_the_audit(monkeypatch):
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "process")
    session = audit().start()
    proc = session._recorder.replayer.process._proc
    _loop(steps=3)
    report = session.stop()
    assert report.replay["steps_replayed"] == 3
    assert not proc.is_alive() and proc.exitcode == 0


@needs_process
def test_a_replay_process_that_dies_is_reported_and_the_training_goes_on(monkeypatch):
    """The worker killed mid-run: the user's loop runs to its end unchanged, and stopping the
    audit raises, naming what happened (a replay that silently stopped would be a false pass)."""
    import signal

    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "process")
    plain = _loop(steps=6)
    session = audit().start()
    proc = session._recorder.replayer.process._proc
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)
    assert _loop(steps=6) == plain
    with pytest.raises(RuntimeError, match="the replay process ended unexpectedly"):
        session.stop()


@needs_process
def test_without_shared_memory_the_copies_are_ordinary_arrays_and_the_report_the_same(monkeypatch):
    import audit.worker as worker

    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "process")

    def report() -> list:
        with audit() as session:
            _loop(steps=4, inf_at=1, bug="clip-before-unscale")
        return [session.report.replay, [(f.rule, f.step, f.message) for f in session.report.findings],
                [r.to_dict() for r in session.report.steps]]

    shared = report()

    def refused(self, ident, size):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(worker._Slab, "__init__", refused)
    assert report() == shared
    assert shared[0]["steps_replayed"] == 4


@needs_process
def test_when_no_replay_process_can_start_the_thread_replays_and_the_report_says_so(monkeypatch):
    import audit.worker as worker

    def no_fork(self, jobs, make_replayer):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "process")
    monkeypatch.setattr(worker.ReplayProcess, "__init__", no_fork)
    with audit() as session:
        _loop(steps=3)
    r = session.report
    assert r.replay["runs_in"] == "thread" and r.replay["steps_replayed"] == 3 and not r.findings
    assert "no replay process ([Errno 11] Resource temporarily unavailable): replayed on a thread" in r.text()


@needs_process
def test_a_step_that_cannot_be_sent_to_the_replay_process_is_named_not_replayed(monkeypatch):
    """A parameter group holding something of the program's that does not pickle (here a lock):
    the training is untouched and the step is listed as not replayed, with the reason."""
    import threading

    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "process")
    original = torch.optim.SGD.__init__

    def with_a_lock(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.param_groups[0]["lock"] = threading.Lock()

    monkeypatch.setattr(torch.optim.SGD, "__init__", with_a_lock)
    plain = _loop(steps=3)
    with audit() as session:
        assert _loop(steps=3) == plain
    r = session.report
    assert r.replay["steps_replayed"] == 0 and not r.findings
    (reason,) = r.replay["not_replayed"]
    assert reason.startswith("the step's data could not be sent to the replay process (TypeError")
    assert all(s.replay == f"not replayed: {reason}" for s in r.steps)


# ----------------------------------------------------------------------------- the severity contract


def test_a_checkpoint_without_the_scaler_is_a_warning_when_the_scaler_state_was_read(tmp_path):
    """scaler.state_dict() called, but no torch.save holds it: it may be written by other means
    (pickle here), so the audit cannot be certain."""
    script = tmp_path / "pickled_scaler.py"
    script.write_text(textwrap.dedent(f"""
        import pickle, sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for step in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.ones(3, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            torch.save({{"optimizer": opt.state_dict()}}, {str(tmp_path / "ckpt.pt")!r})
            if sys.argv[1] == "pickle":
                with open({str(tmp_path / "scaler.pkl")!r}, "wb") as f:
                    pickle.dump(scaler.state_dict(), f)
    """))
    for mode, severity in (("pickle", "warning"), ("none", "error")):
        report = run_script(script, [mode])
        assert [(f.rule, f.severity, f.step) for f in report.findings] == \
            [("checkpoint-without-scaler", severity, 0), ("checkpoint-without-scaler", severity, 1)], report.text()
        assert report.exit_status == (1 if severity == "error" else 0)


def test_an_infinite_clip_threshold_measures_the_norm_and_is_no_finding(tmp_path):
    script = tmp_path / "norm_only.py"
    script.write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for step in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.ones(3, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            scaler.step(opt)
            scaler.update()
    """))
    report = run_script(script)
    assert report.findings == [] and report.error is None, report.text()


def test_the_boundary_names_a_division_a_multiplication_a_numeric_difference_and_an_edit():
    from audit import boundaries

    scale = np.float32(65536.0)
    e = np.linspace(-3, 3, 64, dtype=np.float32)
    cases = {"unscale": e * np.float32(1 / 65536.0), "scale": e * scale,
             "numeric": np.nextafter(e, np.float32(np.inf)), "edit": e * np.float32(0.5)}
    for kind, got in cases.items():
        ch = boundaries.measure([(0, got, e)], 0, scale)
        assert ch.kind == kind, (kind, ch)
    assert boundaries.measure([(0, e.copy(), e)], 0, scale).kind == "none"
    assert boundaries.measure([(0, e * np.float32(0.5), e)], 0, scale).ratio == pytest.approx(0.5)
    # Without a scaler a multiple of 65536 is an edit, not a second scale.
    assert boundaries.measure([(0, e * scale, e)], 0, None).kind == "edit"


@pytest.mark.parametrize("mode,finding", [("cached", None), ("microbatches", "error"), ("sum-root", "warning")])
def test_several_backward_passes_are_an_accumulation_window_only_for_microbatches_of_one_loss(mode, finding):
    """A full-batch loss recomputed per microbatch over cached (detached) representations is no
    window; undivided microbatches of one loss are (an error); a root the audit does not know
    as a loss cannot be decided (a warning)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    chunks = [torch.randn(3, 6) for _ in range(3)]
    with audit() as session:
        for step in range(2):
            opt.zero_grad()
            with torch.no_grad():
                cached = [model(x) for x in chunks]
            for j, x in enumerate(chunks):
                out = model(x)
                if mode == "cached":
                    reps = torch.cat(cached[:j] + [out] + cached[j + 1:])
                    loss = torch.nn.functional.cross_entropy(reps, torch.arange(9) % 4)
                elif mode == "microbatches":
                    loss = torch.nn.functional.cross_entropy(out, torch.arange(3))
                else:
                    loss = out.pow(2).sum()
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    got = [(f.rule, f.severity, f.step) for f in session.report.findings]
    assert got == ([] if finding is None else [("loss-not-divided", finding, 0), ("loss-not-divided", finding, 1)]), \
        session.report.text()


def test_no_class_over_300_lines_and_no_function_over_60_in_the_audit():
    import ast

    too_long = []
    for path in sorted((ROOT / "audit").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                limit = 300 if isinstance(node, ast.ClassDef) else 60
                if node.end_lineno - node.lineno + 1 > limit:
                    too_long.append(f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert too_long == []
