"""torchimpl.train.step and torchimpl.run.state: the engine's parts, each on its own."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from torchimpl.train.cadence import Checkpointer, Evaluator, LogPoints, quiet_steps
from torchimpl.train.clipping import group_by_device_and_dtype
from torchimpl.config.schema import CheckpointConfig, load_config
from torchimpl.run.records import FIELDS, PendingRecords, StepRecord
from torchimpl.run.state import DataCursor, TrainState
from torchimpl.train.scaler import DynamicLossScaler, ScalerConfig
from torchimpl.train.schedule import AppliedStepSchedule
from torchimpl.train.step import DynamicScaling, HostSkip, KernelSkip, UnitScaling, choose_sync_free


def _params(*values):
    params = [nn.Parameter(torch.zeros(3)) for _ in values]
    for p, v in zip(params, values):
        p.grad = torch.full((3,), v)
    return params


def _flags():
    """The step's flags as the engine keeps them: found_inf and the loss sum in one complex64."""
    flags = torch.zeros((), dtype=torch.complex64)
    return (flags, *torch.view_as_real(flags).unbind())


def test_unit_scaling_checks_without_changing_a_bit():
    params = _params(0.1, 2.0**-140, -0.0)
    before = [p.grad.clone() for p in params]
    unit = UnitScaling(group_by_device_and_dtype(params), torch.ones(()))
    found = torch.zeros(())
    unit.unscale_(None, found)
    assert found.item() == 0.0
    for p, b in zip(params, before):
        assert torch.equal(p.grad.view(torch.int32), b.view(torch.int32)), "the check at scale 1 changed a gradient"
    params[1].grad[2] = math.nan
    unit.unscale_(None, found)
    assert found.item() == 1.0
    assert unit.scale_before() == 1.0 and unit.update(found) == (1.0, 0) and unit.final_scale() is None
    assert unit.collapsed() is None
    loss = torch.tensor(3.0)
    assert unit.scale(loss) is loss


def test_unit_scaling_warns_when_a_checkpoint_holds_a_scaler_state():
    unit = UnitScaling([], torch.ones(()))
    with pytest.warns(UserWarning, match="uses no scaler; the state was ignored"):
        unit.load_state_dict({"scale": 1024.0}, Path("x.ckpt"), "bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unit.load_state_dict(None, Path("x.ckpt"), "bf16")


def test_dynamic_scaling_snapshots_do_not_follow_the_live_scale():
    scaler = DynamicLossScaler("cpu", ScalerConfig(init_scale=8.0, growth_interval=1))
    params = _params(1.0)
    scaling = DynamicScaling(scaler, group_by_device_and_dtype(params), torch.ones(()))
    scaling.materialise(torch.device("cpu"))
    before = scaling.scale_before()
    opt = torch.optim.SGD(params, lr=0.1)
    found = torch.zeros(())
    scaling.unscale_(opt, found)
    opt.step()
    after, tracker = scaling.update(found)
    assert float(before) == 8.0 and float(after) == 16.0 and int(tracker) == 0
    assert scaling.collapsed() is None
    with pytest.warns(UserWarning, match="holds no loss-scaler state"):
        scaling.load_state_dict(None, Path("x.ckpt"), "fp16")


def test_the_scale_before_a_step_is_the_last_snapshot_only_while_the_live_scale_is_unwritten():
    scaler = DynamicLossScaler("cpu", ScalerConfig(init_scale=8.0, growth_interval=1))
    params = _params(1.0)
    scaling = DynamicScaling(scaler, group_by_device_and_dtype(params), torch.ones(()))
    scaling.materialise(torch.device("cpu"))
    opt = torch.optim.SGD(params, lr=0.1)
    found = torch.zeros(())
    scaling.unscale_(opt, found)
    after, _ = scaling.update(found)
    before = scaling.scale_before()
    assert before is after and float(before) == 16.0, "no copy is needed: nothing wrote the scale since"
    scaler.state_tensors()[0].fill_(3.0)  # as a loaded state or a hook's update(new_scale) writes it
    before = scaling.scale_before()
    assert before is not after and float(before) == 3.0 and float(after) == 16.0


def test_host_skip_steps_only_clean_steps_and_moves_the_schedule_only_then():
    cfg = load_config(overrides=["schedule.name=cosine", "schedule.warmup_steps=2", "optimizer.lr=0.1"])
    params = _params(1.0)
    opt = torch.optim.SGD(params, lr=0.1)
    skip = HostSkip(opt, AppliedStepSchedule(opt, cfg.schedule, 10), fused=False, stop_on_nonfinite=False,
                    unit_scaling=False)
    state = TrainState()
    flags, found, loss = _flags()
    found.fill_(1.0)
    decision = skip.step(flags, found, loss)
    assert decision.applied is False and torch.equal(params[0], torch.zeros(3)), "a found_inf step was applied"
    skip.advance(decision, found, state)
    assert (state.applied_steps, state.skipped_steps, skip.schedule.applied_steps) == (0, 1, 0)
    found.zero_()
    decision = skip.step(flags, found, loss)
    skip.advance(decision, found, state)
    assert decision.applied is True and (state.applied_steps, skip.schedule.applied_steps) == (1, 1)


def test_host_skip_reports_a_nonfinite_loss_before_any_update():
    cfg = load_config(overrides=["train.on_nonfinite=stop"])
    params = _params(1.0)
    opt = torch.optim.SGD(params, lr=0.1)
    skip = HostSkip(opt, AppliedStepSchedule(opt, cfg.schedule, 10), fused=False, stop_on_nonfinite=True,
                    unit_scaling=True)
    flags, found, loss = _flags()
    loss.fill_(math.inf)
    assert skip.step(flags, found, loss).problem == "non-finite loss"
    loss.zero_()
    found.fill_(1.0)  # without a scaler nothing backs off: non-finite gradients stop the run too
    assert skip.step(flags, found, loss).problem == "non-finite gradients"
    assert torch.equal(params[0], torch.zeros(3))


def test_kernel_skip_counts_at_the_flush_and_saves_the_device_count():
    cfg = load_config(overrides=["schedule.name=constant", "optimizer.lr=0.5"])
    params = _params(1.0)
    opt = torch.optim.AdamW(params, lr=0.5, fused=True)
    skip = KernelSkip(opt, AppliedStepSchedule(opt, cfg.schedule, 4), device=torch.device("cpu"),
                      config=cfg.schedule, total_steps=4, stop_on_nonfinite=True)
    state = TrainState()
    flags, found, loss = _flags()
    found.fill_(1.0)
    decision = skip.step(flags, found, loss)
    assert decision.applied is None and torch.equal(params[0], torch.zeros(3)), "the kernel did not skip"
    skip.advance(decision, found, state)
    state.step = 1
    assert skip.counters(state) == (0, 1) and (state.applied_steps, state.skipped_steps) == (0, 0)
    pending = PendingRecords()
    pending.add(decision.loss_sum, step=0, microbatches=1, scale_before=1.0, found_inf=decision.found,
                applied=None, grad_norm=None, clip_coef=None, scale_after=1.0, growth_tracker=0, lr=decision.lr)
    records, losses = pending.read()
    assert skip.count(records, losses, state) is None
    assert records[0].applied is False and (state.applied_steps, state.skipped_steps) == (0, 1)
    assert "non-finite loss" in skip.count(records, [math.nan], state)


def test_sync_free_refusals_name_the_fix():
    w = [torch.nn.Parameter(torch.zeros(2))]
    sgd = torch.optim.SGD(w, lr=0.1, momentum=0.9, fused=True)
    assert choose_sync_free(False, "for-loop", sgd) == (False, None)
    ok, why = choose_sync_free(True, "for-loop", torch.optim.SGD(w, lr=0.1))
    assert not ok and "optimizer.fused=true" in why
    ok, why = choose_sync_free(True, "fused", sgd)
    assert not ok and "momentum" in why
    adamw = torch.optim.AdamW(w, fused=True)
    assert choose_sync_free(True, "fused", adamw) == (True, None)
    ok, why = choose_sync_free(True, "fused", adamw, scheduler=torch.optim.lr_scheduler.StepLR(adamw, 2))
    assert not ok and "StepLR" in why and "host" in why


def test_pending_records_are_read_by_name_in_one_transfer():
    pending = PendingRecords()
    values = dict(step=4, microbatches=3, scale_before=torch.tensor(1024.0), found_inf=torch.tensor(0.0),
                  applied=True, grad_norm=torch.tensor(2.5), clip_coef=torch.tensor(0.4),
                  scale_after=torch.tensor(2048.0), growth_tracker=torch.tensor(0, dtype=torch.int32), lr=0.01)
    pending.add(torch.tensor(3.0), **dict(reversed(list(values.items()))))  # any keyword order
    records, losses = pending.read()
    assert len(pending) == 0 and losses == [1.0]
    rec = records[0]
    assert [getattr(rec, f) for f in FIELDS] == [4, 3, 1024.0, False, True, 2.5, float(torch.tensor(0.4)), 2048.0, 0,
                                                 0.01]
    assert type(rec.found_inf) is bool and type(rec.growth_tracker) is int


def test_pending_records_read_a_column_of_tensors_and_host_numbers_alike():
    """Steps whose field is a device tensor at one step and a host number at another (a flush
    after a resume) read as the same numbers, each record equal to one built field by field."""
    pending = PendingRecords()
    for step, (scale, norm) in enumerate([(torch.tensor(8.0), 0.5), (16.0, torch.tensor(0.25, dtype=torch.float64))]):
        pending.add(torch.tensor(6.0) if step else 3.0, step=step, microbatches=3, scale_before=scale, found_inf=0.0,
                    applied=None, grad_norm=norm, clip_coef=None, scale_after=scale, growth_tracker=step, lr=0.01)
    records, losses = pending.read()
    assert losses == [1.0, 2.0]
    assert records == [StepRecord(0, 3, 8.0, False, True, 0.5, None, 8.0, 0, 0.01),
                       StepRecord(1, 3, 16.0, False, True, 0.25, None, 16.0, 1, 0.01)]
    assert [type(getattr(records[1], f)) for f in FIELDS] == [int, int, float, bool, bool, float, type(None), float,
                                                              int, float]


def test_pending_records_of_one_flush_must_hold_the_same_fields():
    pending = PendingRecords()
    row = dict(step=0, microbatches=1, scale_before=1.0, found_inf=0.0, applied=True, grad_norm=None,
               clip_coef=None, scale_after=1.0, growth_tracker=0, lr=0.01)
    pending.add(1.0, **row)
    pending.add(1.0, **dict(row, lr=None, step=1) | {"extra": 1})
    with pytest.raises(TypeError, match="differ in their fields"):
        pending.read()
    pending.add(1.0, **row)
    pending.add(1.0, **{k: v for k, v in row.items() if k != "lr"}, extra=1)  # as many fields, one other
    with pytest.raises(TypeError, match="differ in their fields"):
        pending.read()
    pending.add(1.0, **{k: v for k, v in row.items() if k != "lr"}, extra=1)
    with pytest.raises(TypeError, match=r"missing \['lr'\], unexpected \['extra'\]"):
        pending.read()


@pytest.mark.parametrize("val_data, eval_interval, folder, ckpt_interval", [
    (None, 0, None, 0), ([1], 0, None, 0), ([1], 7, None, 0), (None, 3, "ck", 4), ([1], 6, "ck", 0), ([1], 4, "ck", 6)])
def test_quiet_steps_are_the_steps_at_which_no_part_is_due(val_data, eval_interval, folder, ckpt_interval):
    """``quiet_steps`` says a step is quiet exactly when, short of the last step and a stop, none of
    the log point, the evaluation and the checkpoint is due there."""
    logs = LogPoints(5)
    evaluator = Evaluator(val_data, eval_interval)
    checkpointer = Checkpointer(CheckpointConfig(folder=folder, interval=ckpt_interval), dist=None)
    quiet = quiet_steps(logs, evaluator, checkpointer)
    for step in range(1, 90):
        due = (logs.due(step, last=False, stopping=False) or evaluator.due(step, last=False)
               or checkpointer.due(step, last=False, interrupted=False))
        assert quiet(step) is not due, step


def test_data_cursor_resumes_a_plain_list_at_its_position():
    data = [torch.tensor([i]) for i in range(5)]
    state = TrainState()
    cursor = DataCursor(data, state)
    first = cursor.fetch(3) + cursor.fetch(3)  # the second window ends with the epoch
    assert [int(b) for b in first] == [0, 1, 2, 3, 4]
    state.batch_index = 5
    assert [int(b) for b in cursor.fetch(2)] == [0, 1] and state.epoch == 1
    state.batch_index = 2
    saved = cursor.state_dict()
    resumed_state = TrainState()
    resumed = DataCursor(data, resumed_state)
    resumed.load_state_dict(saved)
    assert resumed_state.epoch == 1 and [int(b) for b in resumed.fetch(2)] == [2, 3]


def test_data_cursor_refuses_a_one_shot_generator_on_its_second_epoch():
    state = TrainState()
    cursor = DataCursor((torch.tensor([i]) for i in range(2)), state)
    assert len(cursor.fetch(2)) == 2
    state.batch_index = 2
    with pytest.raises(ValueError, match="yielded no batches in epoch 1.*one-shot generator"):
        cursor.fetch(1)  # the epoch ended; the generator has nothing for the next one


def test_dynamic_scaling_checks_the_unscaled_gradients_and_backs_off_on_them():
    """A finite scaled gradient that unscaling overflows: found, so the update backs off
    (torch's GradScaler checks only the scaled values and would apply the inf)."""
    params = _params(3.0e38)
    scaler = DynamicLossScaler("cpu", ScalerConfig(init_scale=2.0**-4, growth_interval=100))
    scaling = DynamicScaling(scaler, group_by_device_and_dtype(params), torch.ones(()))
    scaling.materialise(torch.device("cpu"))
    opt = torch.optim.SGD(params, lr=0.1)
    found = torch.zeros(())
    scaling.unscale_(opt, found)
    assert found.item() == 0.0 and torch.isinf(params[0].grad).all(), "the scaled check saw the overflow"
    scaling.check_unscaled(found)
    assert found.item() == 1.0
    after, _ = scaling.update(found)
    assert float(after) == 2.0**-5


def test_scale_collapse_is_the_float32_inverse_overflowing():
    from torchimpl.train.step import scale_collapsed

    scales = torch.tensor([0.0, 2.0**-149, 2.0**-128, 2.0**-127.5, 2.0**-127, 1.0, 2.0**127, math.nan])
    torch_says = ~torch.isfinite(scales.double().reciprocal().float())  # what unscale_ would multiply by
    assert [scale_collapsed(float(s)) for s in scales] == torch_says.tolist()


def test_pending_records_of_one_flush_may_hold_their_fields_in_any_order():
    """Rows with the same fields in another keyword order are read by name, not by position."""
    pending = PendingRecords()
    row = dict(step=0, microbatches=1, scale_before=1.0, found_inf=0.0, applied=True, grad_norm=torch.tensor(0.5),
               clip_coef=None, scale_after=2.0, growth_tracker=0, lr=0.01)
    pending.add(1.0, **row)
    pending.add(3.0, **dict(reversed(list(dict(row, step=1, grad_norm=torch.tensor(0.25)).items()))))
    records, losses = pending.read()
    assert losses == [1.0, 3.0]
    assert records == [StepRecord(0, 1, 1.0, False, True, 0.5, None, 2.0, 0, 0.01),
                       StepRecord(1, 1, 1.0, False, True, 0.25, None, 2.0, 0, 0.01)]


def test_the_engine_holds_each_parameters_gradient_accumulator_across_steps():
    """The step engine keeps autograd's AccumulateGrad node of every trainable parameter alive
    for the run: after the last step each parameter's node is one the engine held from the
    start (without a holder each step's graph frees it and the next forward builds another)."""
    from torchimpl import Trainer

    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))

        def forward(self, x, y):
            return nn.functional.mse_loss(self.net(x), y)

    model = Regression()
    model.net[0].bias.requires_grad_(False)
    batches = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(3)]
    trainer = Trainer(load_config(overrides=["device=cpu", "train.steps=3", "logging.dir=null", "logging.progress=off"]))
    trainer.fit(model, batches)
    held = trainer.engine._accumulators
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(held) == 3 and all(type(n).__name__ == "AccumulateGrad" for n in held)
    assert all(p.view_as(p).grad_fn.next_functions[0][0] is node for p, node in zip(trainable, held))
