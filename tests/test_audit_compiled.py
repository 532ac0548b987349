"""The audit of compiled loops (tests/audit_loops/compiled_loop.py): ``torch.compile(model)``
under bf16 autocast, and the optimizer's step compiled too.

The audit must cause no graph break and no recompile: the loop runs once plainly and once under
the audit, each after ``torch._dynamo.reset()``, and torch's own counters (graphs compiled,
graph breaks) must be equal; the report states them, with none of the breaks in the audit's
code. A compiled optimizer step is recorded (every step counted, applied) and reported not
replayed with its reason, never as a divergence; an eager step beside a compiled model is
replayed as any other.
"""

from __future__ import annotations

import getpass
import os
import runpy
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from audit.runner import run_script
from audit.track_optimizer import COMPILED_STEP

LOOP = Path(__file__).resolve().parent / "audit_loops" / "compiled_loop.py"


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


def _plain(args: list[str]) -> tuple[int, int]:
    """The loop run as ``python compiled_loop.py ARGS``, in this process: torch's counts."""
    _fresh()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [str(LOOP), *args], [str(LOOP.parent)]
    try:
        runpy.run_path(str(LOOP), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return _counts()


def _audited(args: list[str]):
    _fresh()
    report = run_script(LOOP, args)
    return report, _counts()


@pytest.mark.parametrize("args,replayed", [
    (["--steps", "12"], False),  # Inductor: the model and the optimizer step compiled
    (["--steps", "12", "--scaler", "1", "--inf-at", "3,7"], True),  # the model compiled, scaler.step eager
], ids=["compiled-step", "compiled-model-scaler"])
def test_a_compiled_loop_is_audited_with_no_graph_break_or_recompile_of_the_audit(args, replayed):
    plain = _plain(args)
    report, audited = _audited(args)
    assert audited == plain, f"(graphs compiled, graph breaks): audited {audited}, plain {plain}\n{report.text()}"
    assert report.compiled == {"graphs_compiled": plain[0], "graph_breaks": plain[1], "graph_breaks_in_audit": 0}, \
        report.compiled
    assert f"{plain[0]} graph" in report.text() and "none of them in the audit's code" in report.text()
    assert report.findings == [] and report.exit_status == 0, report.text()
    assert len(report.steps) == 12 and all(r.applied for r in report.steps) is (not replayed), report.text()
    if replayed:
        assert {r.step for r in report.steps if not r.applied} == {3, 7}
        assert report.replay["not_replayed"] == {} and report.replay["steps_replayed"] == 12, report.replay
    else:
        assert report.replay["not_replayed"] == {COMPILED_STEP: 12}, report.replay
        assert report.replay["steps_replayed"] == 0
        assert all(r.replay == f"not replayed: {COMPILED_STEP}" for r in report.steps)


def test_a_compiled_loop_keeps_its_order_findings():
    """The audit's rules still see a compiled loop's calls: a backward inside autocast is flagged
    at every step (the compiled model's forward runs in the same autocast region)."""
    report, _ = _audited(["--steps", "6", "--scaler", "1", "--bug", "backward-in-autocast"])
    rules = {(f.rule, f.severity) for f in report.findings}
    assert rules == {("backward-in-autocast", "warning")}, report.text()
    assert sorted(f.step for f in report.findings) == list(range(6))
