"""The audit against loops modelled on public AMP training code (tests/audit_loops/real/).

Each loop reproduces the structure of a named original (repository, file and commit in its
docstring) on a tiny model and synthetic data, with chosen steps whose gradients overflow so
that the GradScaler skips them. The truth of each loop was decided by reading the original and
is stated in its docstring; here every loop must give exactly those findings (rule, severity,
steps) and nothing else, never fail, and replay every step whose optimizer the specification
knows. A representative part runs in CI; the rest is marked ``slow`` (``--runslow`` where the
option is registered, or ``AMPSPEC_RUNSLOW=1``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from audit.runner import run_script

REAL = Path(__file__).resolve().parent / "audit_loops" / "real"
ALL = set(range(12))


def _steps(*skipped: int) -> list[int]:
    return sorted(ALL - set(skipped))


# (loop, arguments, {(rule, severity): steps}, in CI)
CASES = [
    ("nanogpt_train.py", ["--inf-at", "3,7"],
     {("checkpoint-without-scaler", "error"): [4, 9], ("lr-changed-on-skipped-step", "warning"): [3]}, True),
    ("dino_train.py", ["--inf-at", "2,8"],
     {("gradients-modified-after-unscale", "info"): _steps(2, 8), ("lr-changed-on-skipped-step", "warning"): [2]},
     True),
    ("gradcache_contrastive.py", ["--inf-at", "3"], {}, True),
    ("open_clip_train.py", ["--inf-at", "4"], {("lr-changed-on-skipped-step", "warning"): [4]}, True),
    ("detectron2_amp.py", ["--inf-at", "3,8"], {("scheduler-on-skipped-step", "error"): [3, 8]}, True),
    ("amp_examples.py", ["--example", "multiple", "--inf-at", "3"], {}, True),
    ("amp_recipe_sweep.py", ["--inf-at", "5"], {}, True),
    ("clip_lora_train.py", ["--inf-at", "3,7", "--log-norm", "1"],
     {("unscale-twice", "error"): _steps(3, 7), ("scheduler-on-skipped-step", "error"): [3, 7]}, True),
    ("timm_train.py", ["--inf-at", "3,7"],
     {("gradients-modified-after-unscale", "info"): _steps(3, 7), ("lr-changed-on-skipped-step", "warning"): [3]},
     False),
    ("timm_train.py", ["--inf-at", "3,7", "--clip-mode", "norm"], {("lr-changed-on-skipped-step", "warning"): [3]},
     False),
    ("amp_examples.py", ["--example", "accumulation", "--inf-at", "3"], {}, False),
    ("amp_examples.py", ["--example", "penalty", "--inf-at", "3"], {}, False),
    ("amp_examples.py", ["--example", "clipping", "--inf-at", "3"], {}, False),
    ("clip_lora_train.py", ["--inf-at", "3,7"], {("scheduler-on-skipped-step", "error"): [3, 7]}, False),
    # Skipped: the last steps of epochs 0 and 1 and one inside; the scheduler steps at each epoch's start.
    ("ultralytics_trainer.py", ["--inf-at", "2,4,5"], {("lr-changed-on-skipped-step", "warning"): [2]}, True),
    ("ultralytics_trainer.py", ["--inf-at", "2,4,5", "--bug", "scheduler-per-step"],
     {("scheduler-on-skipped-step", "error"): [2, 4, 5], ("lr-changed-on-skipped-step", "warning"): [2]}, True),
    # Resumed after epoch 1: the second trainer's optimizer (steps from 0) skips batch 7, its step 1.
    ("ultralytics_trainer.py", ["--inf-at", "2,4,7", "--resume-at", "2"],
     {("lr-changed-on-skipped-step", "warning"): [1, 2]}, False),
    # Every step of epoch 2 skipped: the scheduler's advance at epoch 3 is unearned (the warmup ends
    # at batch 9, so the rate after step 8 is the scheduler's alone).
    ("ultralytics_trainer.py", ["--inf-at", "6,7,8"],
     {("scheduler-on-skipped-step", "error"): [8], ("lr-changed-on-skipped-step", "warning"): [6]}, False),
    ("mmengine_amp_wrapper.py", ["--inf-at", "2,5"], {}, True),
    ("mmengine_amp_wrapper.py", ["--inf-at", "2,5", "--bug", "checkpoint-without-scaler"],
     {("checkpoint-without-scaler", "error"): [3, 7, 11]}, False),
]

# Loops whose optimizer the specification does not know: their steps are named, not replayed
# (none now: the detectron2 loop's clipping subclass is replayed as its parent, SGD).
NOT_IN_SPEC: set[str] = set()


def _slow_enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("--runslow", default=False)) or os.environ.get("AMPSPEC_RUNSLOW") == "1"


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run_and_check(loop: str, args: list[str], expected: dict, tmp_path: Path):
    """Run a catalogue loop under the audit; its findings, as {(rule, severity): steps}, must be
    ``expected`` exactly. Returns the report."""
    report = run_script(REAL / loop, [*args, "--out", str(tmp_path)])
    assert report.error is None and report.script_status is None, report.error
    got: dict[tuple[str, str], list[int]] = {}
    for f in report.findings:
        got.setdefault((f.rule, f.severity), []).append(f.step)
    assert {k: sorted(v) for k, v in got.items()} == expected, report.text()
    return report


@pytest.mark.parametrize("loop,args,expected,ci", [
    pytest.param(*c, marks=() if c[3] else pytest.mark.slow) for c in CASES],
    ids=[f"{c[0]}:{' '.join(c[1])}" for c in CASES])
def test_each_real_loop_gives_exactly_its_truth(loop, args, expected, ci, tmp_path, request):
    if not ci and not _slow_enabled(request.config):
        pytest.skip("a slow catalogue loop: opt in with --runslow or AMPSPEC_RUNSLOW=1")
    report = _run_and_check(loop, args, expected, tmp_path)
    assert len(report.steps) == 12 * (2 if "multiple" in args else 1), report.text()
    skipped = {int(s) for s in args[args.index("--inf-at") + 1].split(",")}
    if len({r.optimizer for r in report.steps}) == 1:
        assert {r.step for r in report.steps if not r.applied} == skipped
    else:  # steps are counted per optimizer: several trainings (or optimizers) skip their own
        assert 1 <= sum(not r.applied for r in report.steps) <= len(skipped) * 2
    if loop not in NOT_IN_SPEC:
        assert report.replay["not_replayed"] == {}, report.replay
        assert report.replay["steps_replayed"] == len(report.steps)
    errors = any(sev == "error" for _, sev in expected)
    assert report.exit_status == (1 if errors else 0)


# Loops whose originals run under torchrun (two DDP ranks: rank 0 audited, rank 1 forked, see
# tests/audit_loops/real/_ddp.py) or compile their model. The steps and the skipped steps are
# stated per case: several of these loops step a number of times of their own (torchvision's
# two steps per batch, YOLOv5's accumulation that grows during warmup).
# (loop, arguments, {(rule, severity): steps}, optimizer steps, skipped steps, in CI)
_ODD = list(range(1, 24, 2))
DIST_CASES = [
    ("nanogpt_ddp_compile.py", ["--inf-at", "3,7", "--backend", "aot_eager"],
     {("checkpoint-without-scaler", "error"): [4, 9], ("lr-changed-on-skipped-step", "warning"): [3]}, 12, {3, 7},
     True),
    ("nanogpt_ddp_compile.py", ["--inf-at", "3,7"],
     {("checkpoint-without-scaler", "error"): [4, 9], ("lr-changed-on-skipped-step", "warning"): [3]}, 12, {3, 7},
     False),
    ("nanogpt_ddp_compile.py", ["--inf-at", "3,7", "--inf-rank", "0", "--compile", "0"],
     {("checkpoint-without-scaler", "error"): [4, 9], ("lr-changed-on-skipped-step", "warning"): [3]}, 12, {3, 7},
     False),
    ("nanogpt_ddp_compile.py", ["--inf-at", "3,7", "--backend", "aot_eager", "--bug", "clip-before-unscale"],
     {("clip-before-unscale", "error"): list(range(12)), ("checkpoint-without-scaler", "error"): [4, 9],
      ("lr-changed-on-skipped-step", "warning"): [3]}, 12, {3, 7}, False),
    ("torchvision_classification.py", ["--inf-at", ""],
     {("step-bypasses-scaler", "error"): _ODD, ("checkpoint-without-scaler", "error"): [7, 15, 23]}, 24, set(), True),
    # The overflow at batch 5 (step 10): the second step applies the inf gradients, the
    # parameters become NaN and the scaler skips every step after.
    ("torchvision_classification.py", ["--inf-at", "5"],
     {("step-bypasses-scaler", "error"): _ODD, ("checkpoint-without-scaler", "error"): [7, 15, 23]}, 24,
     set(range(10, 24, 2)), False),
    ("torchvision_classification.py", ["--inf-at", "5", "--fixed", "1"],
     {("checkpoint-without-scaler", "error"): [3, 7, 11]}, 12, {5}, False),
    ("yolov5_train.py", ["--inf-at", "3,10"],
     {("lr-changed-on-skipped-step", "warning"): [3], ("checkpoint-without-scaler", "error"): [5, 8],
      ("zero-grad-in-window", "error"): [6]}, 9, {3, 7}, True),
    ("yolov5_train.py", ["--inf-at", "", "--bug", "update-without-step"],
     {("update-without-step", "error"): list(range(9)), ("checkpoint-without-scaler", "error"): [5, 8],
      ("zero-grad-in-window", "error"): [6]}, 9, set(), False),
    # A whole compiled train step (forward, backward, opt.step() in one torch.compile): every step
    # seen and replayed through the compile rules (reference.compile).
    ("compile_tutorial_train.py", ["--inf-at", ""], {}, 12, set(), True),
    ("timm_ddp_compile.py", ["--inf-at", "4,7", "--torchcompile", "aot_eager"], {}, 12, {4, 7}, False),
    ("timm_ddp_compile.py", ["--inf-at", "4,7"], {}, 12, {4, 7}, False),
    ("timm_ddp_compile.py", ["--inf-at", "4,7", "--torchcompile", "aot_eager", "--clip-grad", "1.0"], {}, 12, {4, 7},
     False),
    ("timm_ddp_compile.py", ["--inf-at", "4,7", "--torchcompile", "aot_eager", "--clip-grad", "1.0", "--bug",
                             "clip-before-unscale"], {("clip-before-unscale", "error"): list(range(12))}, 12, {4, 7},
     False),
]


@pytest.mark.parametrize("loop,args,expected,n_steps,skipped,ci", [
    pytest.param(*c, marks=() if c[5] else pytest.mark.slow) for c in DIST_CASES],
    ids=[f"{c[0]}:{' '.join(c[1])}" for c in DIST_CASES])
def test_each_ddp_or_compiled_loop_gives_exactly_its_truth(loop, args, expected, n_steps, skipped, ci, tmp_path,
                                                           request):
    if not ci and not _slow_enabled(request.config):
        pytest.skip("a slow catalogue loop: opt in with --runslow or AMPSPEC_RUNSLOW=1")
    report = _run_and_check(loop, args, expected, tmp_path)
    assert len(report.steps) == n_steps, report.text()
    assert {r.step for r in report.steps if not r.applied} == skipped, report.text()
    assert report.replay["not_replayed"] == {}, report.replay
    assert report.replay["steps_replayed"] == n_steps
    assert report.exit_status == (1 if any(sev == "error" for _, sev in expected) else 0)
