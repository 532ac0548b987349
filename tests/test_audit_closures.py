"""The audit on closure steps: ``optimizer.step(closure)``, whose backward passes run inside the
step (tests/audit_loops/frameworks/: the Lightning Trainer, LBFGS, a SAM-style optimizer).

A correct configuration gives no error and no warning, every step recorded and either replayed
or named not replayed with its reason; the planted mistakes are found at exactly their steps.
What the Lightning configurations do, from its source (lightning 2.6): ``Precision.optimizer_step``
passes the training closure to ``optimizer.step(closure=...)`` (32-true, bf16-mixed);
``MixedPrecision.optimizer_step`` with a scaler runs it first, then ``scaler.unscale_``, the
clipping, ``scaler.step`` and ``scaler.update``; manual optimization runs ``training_step``
inside the precision's autocast region, ``manual_backward`` included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from audit.runner import run_script

ROOT = Path(__file__).resolve().parents[1]
LOOPS = Path(__file__).resolve().parent / "audit_loops" / "frameworks"
LIGHTNING = LOOPS / "lightning_trainer.py"
REPLAYED = ("bit for bit", "within the bounds")
LBFGS = "torch.optim.LBFGS runs its own line search with several closure evaluations per step; the spec has no LBFGS"


@pytest.fixture(autouse=True)
def _restore_threads():
    """The loops run on one thread (_closure_common.py); the rest of the suite keeps its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _lightning() -> None:
    try:
        import lightning.pytorch  # noqa: F401
    except Exception as exc:  # any import failure: the framework cannot run here
        pytest.skip(f"lightning.pytorch does not import ({exc!r}); install the 'frameworks' extra")


def _steps(report, label: str) -> list[int]:
    return [r.step for r in report.steps if r.optimizer == label]


def _clean_and_replayed(report, n: int, skipped: set[int] = frozenset()) -> None:
    """No finding, n steps of one optimizer, each replayed; the skipped ones exactly ``skipped``."""
    assert report.error is None, report.error
    assert report.findings == [], report.text()
    assert report.exit_status == 0
    assert [r.step for r in report.steps] == list(range(n)), [(r.optimizer, r.step) for r in report.steps]
    assert report.replay["steps_replayed"] == n and report.replay["not_replayed"] == {}, report.replay
    assert all(r.replay.startswith(REPLAYED) for r in report.steps), [r.replay for r in report.steps]
    assert {r.step for r in report.steps if not r.applied} == skipped


# (arguments, skipped steps, scaler updates checked): each a correct Lightning Trainer run.
LIGHTNING_CORRECT = [
    (["--steps", "6", "--accumulate", "2", "--clip", "0.5", "--scheduler", "step"], set(), 0),
    (["--steps", "6", "--precision", "bf16-mixed", "--clip", "0.5"], set(), 0),
    (["--steps", "8", "--precision", "16-mixed", "--accumulate", "2", "--clip", "0.5", "--inf-at", "3"], {3}, 8),
    (["--steps", "6", "--manual", "--clip", "0.5", "--scheduler", "step"], set(), 0),
    (["--steps", "6", "--manual", "--precision", "16-mixed", "--inf-at", "2"], {2}, 6),
]


@pytest.mark.parametrize("args,skipped,updates", LIGHTNING_CORRECT, ids=[" ".join(a) for a, *_ in LIGHTNING_CORRECT])
def test_the_lightning_trainer_steps_are_replayed_with_no_finding(args, skipped, updates):
    """32-true and bf16-mixed run the backward inside optimizer.step(closure); the replay takes
    the gradients the update reads, after the closure and Lightning's clipping in it."""
    _lightning()
    report = run_script(LIGHTNING, args)
    if "--manual" in args and "16-mixed" in args:
        # Manual optimization runs training_step, and so manual_backward, inside Lightning's autocast:
        # info, made by the framework (the loop cannot leave its region).
        assert {(f.rule, f.severity) for f in report.findings} == {("backward-in-autocast", "info")}, report.text()
        report.findings = []
    _clean_and_replayed(report, int(args[1]), skipped)
    assert report.replay["updates_checked"] == updates
    if "--accumulate" in args:
        assert all(r.microbatches == 2 for r in report.steps)
    if "--clip" in args and "--manual" not in args:
        assert all(r.grad_norm is not None and r.clip_coef is not None for r in report.steps)


def test_lightning_manual_optimization_in_bf16_runs_its_backward_in_autocast():
    """The truth of manual optimization under bf16-mixed: the backward runs inside the autocast
    region Lightning enters around training_step, which the loop cannot leave: info each step,
    naming Lightning's frame, not a warning; every step replayed."""
    _lightning()
    report = run_script(LIGHTNING, ["--steps", "6", "--manual", "--precision", "bf16-mixed"])
    assert [(f.rule, f.step, f.severity) for f in report.findings] == [("backward-in-autocast", s, "info")
                                                                       for s in range(6)]
    assert all("lightning.pytorch" in f.message for f in report.findings), report.text()
    assert report.exit_status == 0 and report.error is None
    assert report.replay["steps_replayed"] == 6 and all(r.replay.startswith(REPLAYED) for r in report.steps)


def test_lightning_manual_clipping_under_16_mixed_clips_scaled_gradients():
    """self.clip_gradients before opt.step() under 16-mixed: Lightning unscales only inside its
    opt.step(), so the clip sees scaled gradients, at every step (the skipped one included)."""
    _lightning()
    report = run_script(LIGHTNING, ["--steps", "6", "--bug", "clip-before-unscale", "--inf-at", "3"])
    clips = [f for f in report.findings if f.rule == "clip-before-unscale"]
    assert [f.step for f in clips] == list(range(6)), report.text()
    assert {f.rule for f in report.findings} == {"clip-before-unscale", "backward-in-autocast"}
    line = next(i for i, text in enumerate(LIGHTNING.read_text().splitlines(), 1) if "self.clip_gradients(" in text)
    assert all(f.where.endswith(f"lightning_trainer.py:{line}") for f in clips), [f.where for f in clips]
    assert report.exit_status == 1 and report.error is None
    assert [r.applied for r in report.steps] == [True, True, True, False, True, True]


def test_lightning_steps_a_per_step_scheduler_on_the_steps_the_scaler_skipped():
    """Lightning steps an ``interval: "step"`` scheduler after every optimizer_step, whether the
    scaler applied it or not: scheduler-on-skipped-step at exactly the overflowing steps."""
    _lightning()
    report = run_script(LIGHTNING, ["--steps", "7", "--precision", "16-mixed", "--scheduler", "step",
                                    "--inf-at", "2,4"])
    assert [(f.rule, f.step) for f in report.findings] == [("scheduler-on-skipped-step", 2),
                                                           ("scheduler-on-skipped-step", 4)], report.text()
    assert report.exit_status == 1 and report.error is None
    assert report.replay["steps_replayed"] == 7 and report.replay["updates_checked"] == 7


@pytest.mark.parametrize("args", [["--steps", "4"], ["--steps", "4", "--line-search", "strong_wolfe", "--bf16"]],
                         ids=["fixed step", "strong_wolfe bf16"])
def test_lbfgs_steps_are_checked_and_named_not_replayed(args):
    """LBFGS evaluates its closure several times a step (zero_grad, backward each time, the
    parameters moved in between): no finding, one pass per step, each step not replayed with
    the reason."""
    report = run_script(LOOPS / "lbfgs_loop.py", args)
    assert report.error is None and report.findings == [], report.text()
    assert [r.step for r in report.steps] == [0, 1, 2, 3] and all(r.microbatches == 1 for r in report.steps)
    assert report.replay["not_replayed"] == {LBFGS: 4} and report.replay["steps_replayed"] == 0
    assert all(r.replay == f"not replayed: {LBFGS}" for r in report.steps)


def test_a_backward_in_autocast_inside_an_lbfgs_closure_belongs_to_its_step():
    report = run_script(LOOPS / "lbfgs_loop.py", ["--steps", "4", "--bug", "backward-in-autocast"])
    assert [(f.rule, f.step) for f in report.findings] == [("backward-in-autocast", s) for s in range(4)]
    assert report.error is None


@pytest.mark.parametrize("args", [["--steps", "6"], ["--steps", "6", "--base", "adamw"],
                                  ["--steps", "6", "--style", "closure"],
                                  ["--steps", "6", "--style", "closure", "--base", "adamw"]],
                         ids=["two-calls sgd", "two-calls adamw", "closure sgd", "closure adamw"])
def test_a_sam_style_optimizer_s_base_steps_are_replayed(args):
    """SAM's ascent moves the parameters and zeroes the gradients, the second pass's gradients
    drive the base optimizer's step: each base step replayed from them; SAM's own step (the
    closure style) is named not replayed, its update being the base step's."""
    report = run_script(LOOPS / "sam_loop.py", args)
    assert report.error is None and report.findings == [], report.text()
    base = "AdamW#0" if "adamw" in args else "SGD#0"
    assert _steps(report, base) == list(range(6))
    assert all(r.microbatches == 1 and r.replay.startswith(REPLAYED) for r in report.steps if r.optimizer == base)
    assert report.replay["steps_replayed"] == 6
    wrapper = [r for r in report.steps if r.optimizer == "SAM#0"]
    if "closure" in args:
        reason = f"its step ran {base}'s step on the same parameters (a wrapper such as SAM's): the update is " \
                 f"replayed as {base}'s"
        assert [r.step for r in wrapper] == list(range(6)) and report.replay["not_replayed"] == {reason: 6}
    else:
        assert wrapper == [] and report.replay["not_replayed"] == {}


CLOSURE_LOOP = textwrap.dedent("""
    import sys
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2) if sys.argv[2] == "adam" else \\
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    if "nudge" in sys.argv:  # a step hook that nudges a weight after each step: not what the optimizer computes
        opt.register_step_post_hook(lambda *_: next(model.parameters()).data.mul_(0.999))
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if "clip" in sys.argv:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            return loss

        if sys.argv[1] == "positional":
            opt.step(closure)
        elif sys.argv[1] == "keyword":
            opt.step(closure=closure)
        else:  # a disabled scaler passes the closure on to optimizer.step
            scaler.step(opt, closure=closure)
            scaler.update()
    """)


@pytest.mark.parametrize("form", ["positional", "keyword", "disabled-scaler"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_closure_step_is_replayed_from_the_gradients_its_closure_left(form, optimizer, tmp_path):
    """The closure's backward and clipping run inside the step, after torch's pre-hook: the
    update is replayed from what the closure left, whichever way the closure is passed."""
    script = tmp_path / "closure_loop.py"
    script.write_text(CLOSURE_LOOP)
    report = run_script(script, [form, optimizer, "clip"])
    _clean_and_replayed(report, 5)
    assert all(r.grad_norm is not None and r.microbatches == 1 for r in report.steps)


@pytest.mark.parametrize("form", ["positional", "disabled-scaler"])
def test_the_update_of_a_closure_step_is_compared(form, tmp_path):
    """The replay compares the closure step's update (no clipping call in the closure: the
    update is the closure's first step-phase call): a hook's change to the weights after it is a
    divergence at every step (a warning: the hook may mean it)."""
    script = tmp_path / "closure_loop.py"
    script.write_text(CLOSURE_LOOP)
    report = run_script(script, [form, "sgd", "nudge"])
    assert [(f.rule, f.step) for f in report.findings] == [("replay-divergence", 0)], report.text()
    assert "5 step(s) diverged" in report.findings[0].message and report.exit_status == 0
    assert all(r.replay == "diverged: parameter 0" for r in report.steps), [r.replay for r in report.steps]


def test_exact_kernels_replay_closure_steps_bit_for_bit():
    """Under ATEN_CPU_CAPABILITY=default torch rounds every operation separately: the Trainer's
    closure steps (accumulated, clipped inside the closure) and SAM's base steps equal the
    specification bit for bit."""
    _lightning()
    code = ("import json, sys\nfrom audit.runner import run_script\nout = []\n"
            "for loop, args in json.loads(sys.argv[1]):\n"
            "    r = run_script(loop, args)\n"
            "    out.append([r.exit_status, r.replay['steps_replayed'], r.replay['steps_bit_exact']])\n"
            "print(json.dumps(out))\n")
    cases = [(str(LIGHTNING), ["--steps", "4", "--accumulate", "2", "--clip", "0.5"]),
             (str(LOOPS / "sam_loop.py"), ["--steps", "4", "--style", "closure", "--base", "adamw"])]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == [[0, 4, 4], [0, 4, 4]]
