"""The audit against a catalogue of hand-written CPU loops (tests/audit_loops/).

Each loop is a plain script, audited unmodified in this process. The correct loops must give no
finding over 200 steps, with every step replayed through the specification; each planted
mistake (``--bug``) must be flagged with its rule, at exactly the expected steps, and nothing
else. The framework loops (Lightning Fabric, Accelerate) must give no false alarm; they are
skipped, with the reason, where the ``frameworks`` extra is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from audit.runner import run_script

LOOPS = Path(__file__).resolve().parent / "audit_loops"
ROOT = Path(__file__).resolve().parents[1]

# (loop, arguments): each correct, audited for 200 steps (40 for the optimizer variants).
CORRECT = [
    ("scaler_loop.py", ["--steps", "200", "--inf-at", "5,50"]),
    ("scaler_loop.py", ["--steps", "40", "--optimizer", "sgd", "--inf-at", "3"]),
    ("scaler_loop.py", ["--steps", "40", "--optimizer", "adam-fused", "--inf-at", "3"]),
    ("scaler_loop.py", ["--steps", "40", "--clip", "split", "--inf-at", "3"]),
    ("bf16_loop.py", ["--steps", "200"]),
    ("bf16_loop.py", ["--steps", "40", "--optimizer", "sgd"]),
    ("bf16_loop.py", ["--steps", "40", "--optimizer", "adam-foreach"]),
    ("accumulation_loop.py", ["--steps", "200", "--inf-at", "7"]),
    ("scheduler_loop.py", ["--steps", "200", "--inf-at", "7,60,130"]),
    ("two_optimizers_loop.py", ["--steps", "60", "--inf-at", "4,30"]),
    ("two_optimizers_loop.py", ["--steps", "40", "--order", "gan", "--inf-at", "4"]),
    ("sharded_loop.py", ["--steps", "40", "--inf-at", "3"]),
    # A 0-d learnable temperature beside the weights, under AdamW, fused Adam and SGD.
    ("zero_dim_loop.py", ["--steps", "40", "--inf-at", "3"]),
    ("zero_dim_loop.py", ["--steps", "12", "--optimizer", "adam-fused", "--inf-at", "3"]),
    ("zero_dim_loop.py", ["--steps", "12", "--optimizer", "sgd"]),
    # A bf16 model whose optimizer steps a float32 master copy kept by hand, at a tiny learning rate.
    ("lowprec_loop.py", ["--steps", "40"]),
]

ALL12 = list(range(12))
# (loop, arguments, rule, the steps it must be flagged at, exit status)
PLANTED = [
    ("scaler_loop.py", ["--bug", "clip-before-unscale"], "clip-before-unscale", ALL12, 1),
    # A threshold at least the scale: a warning (it may be deliberate) until the scale changes ...
    ("scaler_loop.py", ["--bug", "clip-threshold-scaled"], "clip-threshold-scaled", [0], 0),
    # ... and the threshold follows it by exactly its factor: then certain, an error.
    ("scaler_loop.py", ["--bug", "clip-threshold-scaled", "--inf-at", "3"], "clip-threshold-scaled", [0], 1),
    ("scaler_loop.py", ["--bug", "unscale-twice"], "unscale-twice", ALL12, 1),
    ("scaler_loop.py", ["--bug", "unscale-twice-call"], "unscale-twice", [0], 2),
    ("scaler_loop.py", ["--bug", "step-without-update"], "step-without-update", [0], 2),
    ("scaler_loop.py", ["--bug", "update-without-step", "--inf-at", "5"], "update-without-step", ALL12, 1),
    ("scaler_loop.py", ["--bug", "step-bypasses-scaler"], "step-bypasses-scaler", ALL12, 1),
    ("scaler_loop.py", ["--bug", "backward-in-autocast"], "backward-in-autocast", ALL12, 0),
    # The loop's own edit after unscale_ (torch's AMP notes allow it): info at each step, no cascade.
    ("scaler_loop.py", ["--bug", "gradients-altered"], "gradients-modified-after-unscale", ALL12, 0),
    ("scaler_loop.py", ["--bug", "gradients-altered", "--clip", "split"], "gradients-modified-after-unscale",
     ALL12, 0),
    # A hand division by the scale before scaler.step, which unscales again; a multiplication by it.
    ("scaler_loop.py", ["--bug", "unscale-by-hand"], "unscale-twice", ALL12, 1),
    ("scaler_loop.py", ["--bug", "scale-twice"], "scale-twice", ALL12, 1),
    ("scaler_loop.py", ["--bug", "gradients-masked"], "gradients-modified-before-unscale", ALL12, 0),
    ("scaler_loop.py", ["--bug", "clip-before-unscale", "--clip", "split"], "clip-before-unscale", ALL12, 1),
    ("bf16_loop.py", ["--bug", "backward-in-autocast"], "backward-in-autocast", ALL12, 0),
    ("bf16_loop.py", ["--bug", "optimizer-before-to"], "optimizer-before-to", [0], 1),
    ("bf16_loop.py", ["--bug", "zero-grad-in-window"], "zero-grad-in-window", ALL12, 1),
    # A step hook of the loop's own changes the parameters: the divergence is a warning (the hook may mean it).
    ("bf16_loop.py", ["--bug", "parameters-altered"], "replay-divergence", [0], 0),
    ("accumulation_loop.py", ["--bug", "loss-not-divided"], "loss-not-divided", ALL12, 1),
    ("accumulation_loop.py", ["--bug", "zero-grad-in-window"], "zero-grad-in-window", ALL12, 1),
    ("scheduler_loop.py", ["--bug", "scheduler-on-skipped-step", "--steps", "40", "--every", "10", "--rollback", "30",
                           "--inf-at", "5,33"], "scheduler-on-skipped-step", [5, 33], 1),
    ("scheduler_loop.py", ["--bug", "checkpoint-without-scaler", "--steps", "40", "--every", "10", "--rollback", "30",
                           "--inf-at", "5,33"], "checkpoint-without-scaler", [9, 19, 29, 39], 1),
    ("scheduler_loop.py", ["--bug", "new-scaler-mid-run", "--steps", "40", "--every", "10", "--rollback", "30",
                           "--inf-at", "5,33"], "new-scaler-mid-run", [30], 1),
    ("two_optimizers_loop.py", ["--bug", "zero-grad-in-window"], "zero-grad-in-window", [0], 2),
    ("sharded_loop.py", ["--bug", "step-without-update"], "step-without-update", [0], 2),
    ("sharded_loop.py", ["--bug", "clip-before-unscale", "--fsdp"], "clip-before-unscale", ALL12, 1),
    # A bf16 model stepped by a plain AdamW at lr 1e-5: each of its 4 parameters, at the end of the
    # first window of 10 steps.
    ("lowprec_loop.py", ["--bug", "update-lost-to-rounding"], "update-lost-to-rounding", [9, 9, 9, 9], 0),
]

NUMERIC_RULES = {"replay-divergence", "gradients-modified-after-unscale", "gradients-modified-before-unscale",
                 "scale-twice", "update-lost-to-rounding"}

# What torch itself raises after the audit named the mistake, by (loop, bug).
TORCH_ERRORS = {("scaler_loop.py", "unscale-twice-call"): "unscale_() has already been called on this optimizer",
                ("scaler_loop.py", "step-without-update"): "unscale_() is being called after step()",
                ("two_optimizers_loop.py", "zero-grad-in-window"): "No inf checks were recorded for this optimizer",
                ("sharded_loop.py", "step-without-update"): "unscale_() is being called after step()"}


@pytest.fixture(autouse=True)
def _restore_threads():
    """The loops run on one thread (tests/audit_loops/_common.py); the rest of the suite keeps its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _peer(module: str) -> str | None:
    try:
        __import__(module)
    except Exception as exc:  # any import failure: the peer cannot run here
        return f"{module} does not import ({exc!r}); install the 'frameworks' extra: pip install '.[frameworks]'"
    return None


def _args_with_default_steps(args: list[str], steps: int = 12) -> list[str]:
    return args if "--steps" in args else [*args, "--steps", str(steps)]


@pytest.mark.parametrize("loop,args", CORRECT, ids=[f"{l}:{' '.join(a)}" for l, a in CORRECT])
def test_correct_loops_have_no_finding_and_replay_every_step(loop, args, tmp_path):
    report = run_script(LOOPS / loop, [*args, *(["--out", str(tmp_path)] if "scheduler" in loop else [])])
    assert report.error is None, report.error
    assert report.findings == [], report.text()
    assert report.exit_status == 0
    n = int(args[args.index("--steps") + 1])
    optimizers = sorted({r.optimizer for r in report.steps})
    for label in optimizers:
        assert [r.step for r in report.steps if r.optimizer == label] == list(range(n))
    assert report.replay["steps_replayed"] == n * len(optimizers) and report.replay["not_replayed"] == {}, report.replay
    assert all(r.replay.startswith(("bit for bit", "within the bounds")) for r in report.steps)
    skipped = {int(s) for s in args[args.index("--inf-at") + 1].split(",")} if "--inf-at" in args else set()
    # Skipped: the overflowing steps (of the optimizer whose loss overflowed, with two).
    assert {r.step for r in report.steps if not r.applied} == skipped
    if "scaler" in loop or "accumulation" in loop or "scheduler" in loop or "zero_dim" in loop:
        assert report.replay["updates_checked"] == n


def test_an_fsdp2_loop_is_checked_by_the_order_rules_and_its_sharded_steps_are_named_not_replayed(tmp_path):
    """FSDP2's parameters and gradients are DTensors (one rank's shards): the audit leaves the
    training as it is, checks every order rule and the scaler's updates, and names why no step
    is replayed."""
    report = run_script(LOOPS / "sharded_loop.py", ["--fsdp", "--steps", "12", "--inf-at", "3"])
    assert report.error is None and report.findings == [], report.text()
    assert [r.step for r in report.steps] == list(range(12)) and [r.applied for r in report.steps].count(False) == 1
    assert report.replay["steps_replayed"] == 0 and report.replay["updates_checked"] == 12
    assert report.replay["not_replayed"] == {"DTensor parameters or gradients (sharded tensors)": 12}
    assert all(r.replay == "not replayed: DTensor parameters or gradients (sharded tensors)" for r in report.steps)


@pytest.mark.parametrize("loop,args,rule,steps,status", PLANTED,
                         ids=[f"{l}:{' '.join(a)}" for l, a, *_ in PLANTED])
def test_each_planted_mistake_is_flagged_at_its_steps_and_nothing_else(loop, args, rule, steps, status, tmp_path):
    extra = ["--out", str(tmp_path)] if "scheduler" in loop else []
    report = run_script(LOOPS / loop, [*_args_with_default_steps(args), *extra])
    assert {f.rule for f in report.findings} == {rule}, report.text()
    assert sorted(f.step for f in report.findings) == steps, report.text()
    assert report.exit_status == status, report.text()
    for f in report.findings:
        assert f.where.startswith(str(LOOPS / loop)) or Path(f.where.rsplit(":", 1)[0]).name == loop, f.where
    if (loop, args[1]) in TORCH_ERRORS:
        assert TORCH_ERRORS[loop, args[1]] in report.error
        assert "audit/instrument.py" not in report.error, "the audit's own frames belong to no user's traceback"
    else:
        assert report.error is None, report.error


def test_the_call_site_is_the_line_of_the_mistake():
    report = run_script(LOOPS / "scaler_loop.py", ["--bug", "clip-before-unscale", "--steps", "2"])
    line = next(i for i, text in enumerate((LOOPS / "scaler_loop.py").read_text().splitlines(), 1)
                if "clip_grad_norm_(model.parameters(), 1.0)" in text)
    assert report.findings[0].where.endswith(f"scaler_loop.py:{line}")
    # With the replay, the finding carries the numbers: spec (unscaled) against torch (scaled).
    f = report.findings[0]
    assert isinstance(f.expected, float) and isinstance(f.got, float) and f.got == pytest.approx(f.expected * 65536)
    # A forgotten update is reported where the step it follows was taken.
    report = run_script(LOOPS / "scaler_loop.py", ["--bug", "step-without-update", "--steps", "3"])
    lines = (LOOPS / "scaler_loop.py").read_text().splitlines()
    at = next(i for i, text in enumerate(lines, 1) if 'bug == "step-without-update"' in text and "elif" in text) + 1
    assert lines[at - 1].strip() == "scaler.step(opt)"
    assert report.findings[0].where.endswith(f"scaler_loop.py:{at}")


def test_order_rules_alone_find_the_same_mistakes_without_the_replay(tmp_path):
    for loop, args, rule, steps, status in PLANTED:
        if rule in NUMERIC_RULES or args[1] in ("unscale-twice", "unscale-by-hand"):
            continue  # these are found from the numbers
        extra = ["--out", str(tmp_path)] if "scheduler" in loop else []
        report = run_script(LOOPS / loop, [*_args_with_default_steps(args), *extra], replay=False)
        assert {f.rule for f in report.findings} == {rule}, (loop, args, report.text())
        assert sorted(f.step for f in report.findings) == steps, (loop, args, report.text())
        assert report.replay is None and report.exit_status == status


def test_the_step_limit_stops_the_script_after_n_steps():
    report = run_script(LOOPS / "scaler_loop.py", [], steps=5)
    assert [r.step for r in report.steps] == [0, 1, 2, 3, 4]
    assert report.stopped and report.error is None and report.exit_status == 0


def test_exact_kernels_replay_every_step_bit_for_bit():
    """Under ATEN_CPU_CAPABILITY=default torch rounds every operation separately: each step of
    each loop, every optimizer kind included, must then equal the specification bit for bit."""
    code = (
        "import json, sys\nfrom audit.runner import run_script\nout = []\n"
        "for loop, args in json.loads(sys.argv[1]):\n"
        "    r = run_script(loop, args)\n"
        "    out.append([r.exit_status, r.replay['steps_bit_exact'], len(r.steps), [s.replay for s in r.steps]])\n"
        "print(json.dumps(out))\n")
    cases = [(str(LOOPS / l), a) for l, a in [
        ("scaler_loop.py", ["--steps", "25", "--inf-at", "3,11"]),
        ("scaler_loop.py", ["--steps", "12", "--optimizer", "sgd", "--inf-at", "3"]),
        ("scaler_loop.py", ["--steps", "12", "--optimizer", "adam-fused", "--inf-at", "3"]),
        ("bf16_loop.py", ["--steps", "12", "--optimizer", "adam-foreach"]),
        ("accumulation_loop.py", ["--steps", "12", "--inf-at", "3"]),
        ("zero_dim_loop.py", ["--steps", "12", "--optimizer", "adam-foreach", "--inf-at", "3"]),
        ("lowprec_loop.py", ["--steps", "12"])]]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    for (loop, args), (status, exact, n, per_step) in zip(cases, json.loads(r.stdout.splitlines()[-1])):
        assert status == 0 and exact == n, (loop, args, per_step)


# 60 steps each, a checkpoint every 20: the frameworks' own setup dominates their time.
FRAMEWORK = [
    ("fabric_loop.py", ["--steps", "60", "--every", "20"], "lightning.fabric"),
    ("fabric_loop.py", ["--steps", "60", "--every", "20", "--scaler", "1"], "lightning.fabric"),
    ("accelerate_loop.py", ["--steps", "60", "--every", "20"], "accelerate"),
]


@pytest.mark.parametrize("loop,args,module", FRAMEWORK, ids=[f"{l}:{' '.join(a)}" for l, a, _ in FRAMEWORK])
def test_framework_loops_have_no_false_alarm(loop, args, module, tmp_path):
    reason = _peer(module)
    if reason is not None:
        pytest.skip(reason)
    report = run_script(LOOPS / loop, [*args, "--out", str(tmp_path)])
    assert report.error is None, report.error
    assert report.findings == [], report.text()
    assert len(report.steps) == 60 and report.replay["steps_replayed"] == 60, report.replay
    assert any("torch.save" in c for r in report.steps for c in r.calls), "the loop's checkpoints were not seen"


def test_a_fabric_checkpoint_without_the_scaler_state_is_flagged(tmp_path):
    reason = _peer("lightning.fabric")
    if reason is not None:
        pytest.skip(reason)
    report = run_script(LOOPS / "fabric_loop.py", ["--steps", "20", "--scaler", "1", "--every", "10",
                                                   "--bug", "checkpoint-without-scaler", "--out", str(tmp_path)])
    assert [(f.rule, f.step) for f in report.findings] == [("checkpoint-without-scaler", 9),
                                                           ("checkpoint-without-scaler", 19)], report.text()
