"""The audit of compiled loops: tests/audit_loops/compiled_loop.py (``torch.compile(model)``
under bf16 autocast, and the optimizer's step compiled too) and the real-code catalogue's whole
compiled train step (tests/audit_loops/real/compile_tutorial_train.py: forward, backward and
``opt.step()`` in one compiled function).

The audit must cause no graph break and no recompile: each loop runs once plainly and once under
the audit, each after ``torch._dynamo.reset()``, and torch's own counters (graphs compiled,
graph breaks) must be equal; the report states them, with none of the breaks in the audit's
code. A compiled optimizer step is recorded (every step counted, applied) and replayed through
the spec's compile rules (`reference.compile`): agreeing within ``compiled_step_ulp``; a step
whose update is not the one its group states (the weight decay skipped) diverges, named with
the parameter, the element, both values and the bound. The bound is needed (0 ULP fails the
correct loop) and tight enough (1000 times looser lets the planted mistake pass).
"""

from __future__ import annotations

import getpass
import os
import re
import runpy
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import reference.compile as rc
from audit.compiled import COMPILED_REPLAY
from audit.runner import run_script
from audit.track_optimizer import GRADIENTS_GONE

LOOP = Path(__file__).resolve().parent / "audit_loops" / "compiled_loop.py"
TRAIN_STEP = Path(__file__).resolve().parent / "audit_loops" / "real" / "compile_tutorial_train.py"


@pytest.fixture(autouse=True)
def _inductor_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # Inductor's cache persists outside the checkout: a compile costs seconds, a cached one less.
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(Path(tempfile.gettempdir()) /
                                                              f"ampspec-inductor-{getpass.getuser()}")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", cache)


def _counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _fresh() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _plain(args: list[str], loop: Path = LOOP) -> tuple[int, int]:
    """The loop run as ``python LOOP ARGS``, in this process: torch's counts."""
    _fresh()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [str(loop), *args], [str(loop.parent)]
    try:
        runpy.run_path(str(loop), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return _counts()


def _audited(args: list[str], loop: Path = LOOP):
    _fresh()
    report = run_script(loop, args)
    return report, _counts()


def _same_counts(plain: tuple[int, int], audited: tuple[int, int], report) -> None:
    """The audit added no graph and no graph break, and its report says so."""
    assert audited == plain, f"(graphs compiled, graph breaks): audited {audited}, plain {plain}\n{report.text()}"
    assert report.compiled == {"graphs_compiled": plain[0], "graph_breaks": plain[1], "graph_breaks_in_audit": 0}, \
        report.compiled
    assert f"{plain[0]} graph" in report.text() and "none of them in the audit's code" in report.text()


def _replayed_compiled(report, n: int) -> None:
    """Every one of ``n`` steps applied and replayed through the compile rules, in agreement."""
    assert report.findings == [] and report.exit_status == 0, report.text()
    assert len(report.steps) == n and all(r.applied for r in report.steps), report.text()
    assert report.replay["not_replayed"] == {} and report.replay["steps_replayed"] == n, report.replay
    assert all(r.replay.startswith(f"{COMPILED_REPLAY}: within the bounds") for r in report.steps), \
        [r.replay for r in report.steps]
    assert f"compiled optimizer steps ({n}x)" in report.text()


@pytest.mark.parametrize("args,compiled", [
    (["--steps", "12"], True),  # Inductor: the model and the optimizer step compiled
    (["--steps", "12", "--scaler", "1", "--inf-at", "3,7"], False),  # the model compiled, scaler.step eager
    # opt.step = torch.compile(opt.step), called by scaler.step: no hook fires, the step is seen
    # by its effects at scaler.step's end (applied, replayed); the skipped steps are skipped.
    (["--steps", "12", "--scaler", "1", "--step", "attribute", "--inf-at", "3,7"], True),
], ids=["compiled-step", "compiled-model-scaler", "compiled-step-in-scaler-step"])
def test_a_compiled_loop_is_audited_with_no_graph_break_or_recompile_of_the_audit(args, compiled):
    plain = _plain(args)
    report, audited = _audited(args)
    _same_counts(plain, audited, report)
    if compiled and "--scaler" not in args:
        _replayed_compiled(report, 12)
        return
    assert report.findings == [] and report.exit_status == 0, report.text()
    assert {r.step for r in report.steps if not r.applied} == {3, 7}
    assert report.replay["not_replayed"] == {} and report.replay["steps_replayed"] == 12, report.replay
    replays = {r.step: r.replay for r in report.steps if r.applied}
    assert all(v.startswith(COMPILED_REPLAY) is compiled for v in replays.values()), replays


def test_a_whole_compiled_train_step_is_seen_and_replayed_with_no_graph_break_of_the_audit(tmp_path: Path):
    """Forward, backward and ``opt.step()`` in one compiled function (PyTorch's tutorial): torch
    breaks the graph at ``loss.backward()`` and at ``Optimizer.zero_grad``, and the audit's
    wrappers of those run eagerly there (no break of their own); the backward and the zero_grad
    are seen, the compiled step between them copied around and replayed."""
    args = ["--steps", "6", "--inf-at", "", "--out", str(tmp_path)]
    plain = _plain(args, TRAIN_STEP)
    report, audited = _audited(args, TRAIN_STEP)
    _same_counts(plain, audited, report)
    _replayed_compiled(report, 6)
    assert all(any(c.startswith("backward@") for c in r.calls) for r in report.steps), report.steps[0].calls


def test_a_compiled_step_whose_gradients_were_zeroed_inside_the_graph_is_not_replayed(tmp_path: Path):
    """``model.zero_grad()`` inside the compiled train step is traced (the audit's wrapper runs
    the original alone there): the step is seen at the next backward with its gradients gone,
    and said not replayed with that reason, never compared against gradients it did not read."""
    args = ["--steps", "4", "--inf-at", "", "--out", str(tmp_path), "--zero", "module"]
    plain = _plain(args, TRAIN_STEP)
    report, audited = _audited(args, TRAIN_STEP)
    _same_counts(plain, audited, report)
    assert report.findings == [] and all(r.applied for r in report.steps), report.text()
    assert report.replay["not_replayed"] == {GRADIENTS_GONE: 3}, report.replay
    assert report.steps[-1].replay.startswith(COMPILED_REPLAY)  # seen at the end, its gradients still there


def _divergence_steps(report) -> list[int]:
    return sorted(f.step for f in report.findings if f.rule == "replay-divergence")


def test_a_compiled_step_that_skips_the_weight_decay_diverges(monkeypatch: pytest.MonkeyPatch):
    """The planted mistake diverges where the decay it skipped exceeds the bound (from step 1: at
    step 0 the float32 bias correction's cancellation makes the bound wider than one decay),
    named with the parameter, the element, both values and the bound; and a bound 1000 times
    looser (the mutant) lets it pass: the bound is tight enough to see it."""
    args = ["--steps", "6", "--bug", "replay-divergence"]
    report, _ = _audited(args)
    steps = [r.step for r in report.steps if r.replay.startswith("diverged")]
    assert steps == [1, 2, 3, 4, 5] and _divergence_steps(report) == [1], report.text()
    f = next(f for f in report.findings if f.rule == "replay-divergence")
    assert re.search(r"parameter \d+: .* first at index \[\d+, \d+\]: torch -?\d\.\d+.*, spec -?\d\.\d+.* "
                     r"ULP of x_abs apart \(bound \d+\)", f.message), f.message
    real = rc.compiled_step_ulp
    monkeypatch.setattr(rc, "compiled_step_ulp", lambda *a, **k: 1000 * real(*a, **k))
    loose, _ = _audited(args)
    assert loose.findings == [] and loose.replay["steps_replayed"] == 6, loose.text()


def test_the_compiled_bound_is_needed(monkeypatch: pytest.MonkeyPatch):
    """The mutant ``compiled_step_ulp`` = 0 (a compiled step held to the spec bit for bit) fails
    the correct compiled loop: the compiled AdamW differs from the spec (rules 5-6)."""
    monkeypatch.setattr(rc, "compiled_step_ulp", lambda *a, **k: 0)
    report, _ = _audited(["--steps", "3"])
    assert _divergence_steps(report) == [0] and report.replay["steps_replayed"] == 3, report.text()


def test_a_compiled_loop_keeps_its_order_findings():
    """The audit's rules still see a compiled loop's calls: a backward inside autocast is flagged
    at every step (the compiled model's forward runs in the same autocast region)."""
    report, _ = _audited(["--steps", "6", "--scaler", "1", "--bug", "backward-in-autocast"])
    rules = {(f.rule, f.severity) for f in report.findings}
    assert rules == {("backward-in-autocast", "warning")}, report.text()
    assert sorted(f.step for f in report.findings) == list(range(6))


COMPILED_SCALER = Path(__file__).resolve().parent / "audit_loops" / "compiled_scaler_step.py"


@pytest.mark.parametrize("clip", ["0", "1.0"])
def test_a_train_step_compiled_with_its_grad_scaler_is_seen_with_no_graph_break_in_the_audit(clip):
    """GradScaler's calls inside a compiled function run eagerly at torch's own breaks, and the
    audit's wrappers of them with them: none of the breaks is in the audit's code (traced, its
    bookkeeping broke the graph 17 times), every scale update is seen and replayed, and the
    traced clip, which the audit does not see as a clip, is reported by its effect (info) only."""
    report, _ = _audited(["--steps", "6", "--clip", clip], COMPILED_SCALER)
    assert report.compiled is not None and report.compiled["graph_breaks_in_audit"] == 0, report.text()
    assert report.exit_status == 0 and len(report.steps) == 6 and all(r.applied for r in report.steps), report.text()
    assert report.replay["steps_replayed"] == 6 and report.replay["not_replayed"] == {}, report.replay
    assert "6 scaler updates replayed" in report.text()
    rules = {f.rule for f in report.findings}
    assert rules == (set() if clip == "0" else {"gradients-modified-after-unscale"}), report.text()
