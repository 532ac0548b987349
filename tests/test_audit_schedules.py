"""The schedule rules judged by position, and scaler state found wherever a checkpoint keeps it.

- ``scheduler-on-skipped-step`` reads where each LRScheduler stood at each optimizer step
  (`audit.schedules`), not how often it was called: a scheduler stepped at an epoch's start, or
  returned to where it stood, is no finding; an advance with no applied step since the previous
  one is, at the exact skipped step;
- ``lr-changed-on-skipped-step`` counts every skipped step across which the rates moved to values
  no LRScheduler set;
- ``checkpoint-without-scaler`` finds scaler state by its content at any depth (`audit.saved`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from audit import audit, saved
from audit.events import CheckpointSaved
from audit.rules import dispatch
from test_audit_real import _run_and_check

REAL = Path(__file__).resolve().parent / "audit_loops" / "real"


def _train(steps: int, skipped: set[int], on_step=None, on_epoch=None, per_epoch: int = 3,
           save=None) -> None:
    """A GradScaler loop whose listed steps overflow (the scaler skips them). ``on_epoch(epoch)``
    runs at each epoch's start, ``on_step(step, applied)`` after each step, ``save(step)`` after
    each epoch's last step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    _train.objects = model, opt, scaler
    for step in range(steps):
        if on_epoch is not None and step % per_epoch == 0:
            on_epoch(step // per_epoch)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.ones(3, 4)).float().pow(2).mean()
        if step in skipped:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if on_step is not None:
            on_step(step, scaler.get_scale() >= before)
        if save is not None and (step + 1) % per_epoch == 0:
            save(step)


def _found(session) -> list[tuple[str, str, int]]:
    return [(f.rule, f.severity, f.step) for f in session.report.findings]


def _quiet_step(sched, *args) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the order warning, and step(epoch)'s deprecation
        sched.step(*args)


# ----------------------------------------------------------------------------- by position


def test_a_resumed_scheduler_stepped_at_each_epochs_start_is_no_finding():
    """Built with last_epoch = start_epoch - 1 (a resume) and stepped before each epoch's first
    optimizer step; skipped steps inside epochs that applied others."""
    held = {}

    def on_epoch(epoch):
        if epoch == 0:
            opt = _train.objects[1]
            for group in opt.param_groups:
                group["initial_lr"] = group["lr"]
            held["s"] = torch.optim.lr_scheduler.MultiStepLR(opt, [4, 6], gamma=0.5, last_epoch=2 - 1)
        _quiet_step(held["s"])

    with audit(replay=False) as session:
        _train(9, {2, 4}, on_epoch=on_epoch)
    assert _found(session) == [], session.report.text()
    assert held["s"].last_epoch == 2 + 3


def test_a_scheduler_returned_to_where_it_stood_did_not_advance():
    """After a skipped step the loop steps its scheduler, then sets it back with step(epoch):
    the next step runs at the same position, so the schedule did not move across the skip."""
    held = {}

    def on_step(step, applied):
        s = held.setdefault("s", torch.optim.lr_scheduler.LambdaLR(_train.objects[1], lambda n: 1 / (1 + n)))
        position = s.last_epoch
        _quiet_step(s)
        if not applied:
            _quiet_step(s, position)

    with audit(replay=False) as session:
        _train(6, {1, 3}, on_step=on_step)
    assert _found(session) == [], session.report.text()


def test_a_per_iteration_scheduler_is_the_error_at_each_skipped_step_and_at_the_last():
    held = {}

    def on_step(step, applied):
        held.setdefault("s", torch.optim.lr_scheduler.StepLR(_train.objects[1], step_size=2, gamma=0.5))
        _quiet_step(held["s"])

    with audit(replay=False) as session:
        _train(6, {1, 3, 5}, on_step=on_step)
    assert _found(session) == [("scheduler-on-skipped-step", "error", s) for s in (1, 3, 5)], session.report.text()
    first = session.report.findings[0]
    assert "moved its position from 1 to 2 after step 1 of SGD#0 was skipped" in first.message


def test_an_epoch_scheduler_earns_its_advance_with_any_applied_step_of_the_epoch():
    """The rule's judgement for interval schedulers: an epoch whose last step was skipped but
    which applied others is no finding; an epoch whose every step was skipped is the error, at
    its last step."""
    held = {}

    def on_epoch(epoch):
        s = held.setdefault("s", torch.optim.lr_scheduler.StepLR(_train.objects[1], step_size=1, gamma=0.5))
        if epoch:
            _quiet_step(s)

    with audit(replay=False) as session:
        _train(12, {2, 6, 7, 8}, on_epoch=on_epoch)
    assert _found(session) == [("scheduler-on-skipped-step", "error", 8)], session.report.text()
    assert "after steps 6 to 8 of SGD#0 were all skipped" in session.report.findings[0].message


def test_the_children_of_a_sequential_scheduler_are_judged_through_their_parent():
    held = {}

    def on_step(step, applied):
        if "s" not in held:
            opt = _train.objects[1]
            warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
            cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
            held["s"] = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[2])
        _quiet_step(held["s"])

    with audit(replay=False) as session:
        _train(6, {3}, on_step=on_step)
    assert _found(session) == [("scheduler-on-skipped-step", "error", 3)], session.report.text()
    assert session.report.findings[0].message.startswith("SequentialLR.step()")


# ----------------------------------------------------------------------------- hand-set rates


@pytest.mark.parametrize("inf_at,count,listed", [("2,4,5", 3, "2, 4, 5"), ("6,7,8", 2, "6, 7")])
def test_the_warning_counts_every_skipped_step_whose_rates_no_scheduler_set(inf_at, count, listed, tmp_path):
    """Ultralytics' warmup by hand moves the rates at every batch; at an epoch's end its
    LRScheduler steps too and the warmup overwrites its rate: still the warmup's move. After the
    warmup (batch 9) the rates are the scheduler's alone: step 8 is not counted."""
    expected = {("lr-changed-on-skipped-step", "warning"): [int(inf_at[0])]}
    if inf_at == "6,7,8":
        expected[("scheduler-on-skipped-step", "error")] = [8]
    report = _run_and_check("ultralytics_trainer.py", ["--inf-at", inf_at], expected, tmp_path)
    (f,) = [f for f in report.findings if f.rule == "lr-changed-on-skipped-step"]
    assert f"advanced across {count} of its 3 skipped step(s) (steps {listed})" in f.message, f.message
    assert f"the schedule runs {count} step(s) ahead of the applied updates" in f.message


# ----------------------------------------------------------------------------- scaler state


class _Wrapper:
    """A framework's optimizer wrapper, saved as an object."""

    def __init__(self, optimizer, scaler) -> None:
        self.optimizer = optimizer
        self.loss_scaler = scaler


class _DeepSpeedLikeScaler:
    def __init__(self) -> None:
        self.cur_scale, self.cur_iter, self.last_overflow_iter, self.scale_window = 65536.0, 3, -1, 1000


def _shapes():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    state = opt.state_dict()
    return model, opt, scaler, state


@pytest.mark.parametrize("name", ["mmengine", "lightning", "object", "deepspeed", "apex", "fairseq", "megatron",
                                  "tuple", "accelerate"])
def test_scaler_state_is_recognised_by_its_content_anywhere(name):
    model, opt, scaler, state = _shapes()
    obj = {
        "mmengine": {"meta": {}, "optimizer": {**state, "loss_scaler": scaler.state_dict()}},
        "lightning": {"optimizer_states": [state], "MixedPrecision": scaler.state_dict()},
        "object": {"optim_wrapper": _Wrapper(opt, scaler)},
        "deepspeed": {"optimizer": {**state, "loss_scaler": _DeepSpeedLikeScaler()}},
        "apex": {"optimizer": state, "amp": {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}}},
        "fairseq": {"last_optimizer_state": {**state, "loss_scale": 128.0}},
        "megatron": {"optimizer": {"optimizer": state, "grad_scaler": {"scale": torch.tensor(8.0),
                                                                        "growth_tracker": 0}}},
        "tuple": ({"optimizer": state}, [{"x": ({"scaler": scaler.state_dict()},)}]),
        "accelerate": scaler.state_dict(),
    }[name]
    assert saved.classify(obj) == (name != "accelerate", True)


def test_optimizer_state_without_scaler_state_is_told_apart_and_the_walk_is_bounded():
    model, opt, scaler, state = _shapes()
    assert saved.classify({"model": model.state_dict(), "optimizer": state, "scale_of_images": 2.0}) == (True, False)
    assert saved.classify({"ema": model, "optimizer": opt}) == (True, False)
    looped: dict = {"optimizer": state}
    looped["self"] = looped
    assert saved.classify(looped) == (True, False)
    deep: dict = {}
    leaf = deep
    for _ in range(saved.MAX_DEPTH + 2):
        leaf["next"] = {}
        leaf = leaf["next"]
    leaf["scaler"] = scaler.state_dict()
    assert saved.classify({"optimizer": state, "log": deep}) == (True, None)  # not known: not read whole
    wide = [{"i": [i]} for i in range(saved.MAX_NODES + 1)]
    assert saved.classify([state, wide]) == (True, None)
    assert saved.classify([scaler.state_dict(), wide]) == (False, True)


def test_the_walk_calls_no_code_of_the_saved_objects():
    class Trap:
        def __getattr__(self, name):
            raise AssertionError(f"read {name}")

        def state_dict(self):
            raise AssertionError("called state_dict")

    trap = Trap()
    trap.__dict__["optimizer"] = _shapes()[3]
    assert saved.classify({"trainer": trap}) == (True, False)


@pytest.mark.parametrize("layout", ["nested", "object", "left-out"])
def test_a_checkpoint_with_the_scaler_inside_the_optimizer_state_is_no_finding(layout, tmp_path):
    """MMEngine's layout (the scaler's state_dict beside the optimizer's ``state`` and
    ``param_groups``) and a wrapper object holding the scaler; left out, still the error."""
    def save(step):
        model, opt, scaler = _train.objects
        if layout == "nested":
            optimizer = {**opt.state_dict(), "loss_scaler": scaler.state_dict()}
        else:
            optimizer = _Wrapper(opt, scaler) if layout == "object" else opt.state_dict()
        torch.save({"state_dict": model.state_dict(), "optimizer": optimizer}, tmp_path / "ckpt.pth")

    with audit(replay=False) as session:
        _train(6, {1}, save=save)
    expected = [("checkpoint-without-scaler", "error", s) for s in (2, 5)] if layout == "left-out" else []
    assert _found(session) == expected, session.report.text()


def test_a_checkpoint_too_deep_to_read_whole_is_a_warning_that_says_so():
    deep = ("torch.save at t.py:1", True, None, 3)
    (f,) = dispatch(CheckpointSaved([deep], "GradScaler#0", None))
    assert (f.rule, f.severity, f.step) == ("checkpoint-without-scaler", "warning", 3)
    assert "too large or deep to read whole" in f.message
    (f,) = dispatch(CheckpointSaved([("torch.save at t.py:1", True, False, 3)], "GradScaler#0", None))
    assert f.severity == "error"


def test_the_mmengine_loop_with_its_scaler_left_out_is_still_the_error(tmp_path):
    _run_and_check("mmengine_amp_wrapper.py", ["--inf-at", "2,5", "--bug", "checkpoint-without-scaler"],
                   {("checkpoint-without-scaler", "error"): [3, 7, 11]}, tmp_path)
