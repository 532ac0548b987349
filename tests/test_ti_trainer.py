"""The trainer's step contract, host-sync budget and autocast scope, on planted cases."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchimpl.config.schema import load_config
from torchimpl.run.records import read_trace
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer

aten = torch.ops.aten


class Poisoned(nn.Module):
    """Linear regression whose loss is multiplied by the batch's third element (inf plants)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.seen_autocast = []

    def forward(self, x, y, factor):
        self.seen_autocast.append(torch.is_autocast_enabled("cpu"))
        out = self.lin(x)
        if out.requires_grad:
            out.register_hook(lambda g: self.seen_autocast.append(("backward", torch.is_autocast_enabled("cpu"))))
        return ((out.float() - y) ** 2).mean() * factor


def batches(n, poison=()):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g),
             torch.tensor(math.inf if i in poison else 1.0)) for i in range(n)]


def cfg(*sets):
    base = ["device=cpu", "train.log_interval=1", "optimizer.lr=0.1", "schedule.name=cosine",
            "schedule.warmup_steps=2", "optimizer.weight_decay=0.0"]
    return load_config(overrides=base + list(sets))


class Capture(Callback):
    def __init__(self):
        self.scaled, self.clipped, self.params_after, self.lrs, self.autocast_at_step = [], [], [], [], []

    def on_after_backward(self, trainer, state):
        self.scaled.append([p.grad.clone() for p in trainer.params])

    def on_before_optimizer_step(self, trainer, state):
        self.clipped.append([p.grad.clone() for p in trainer.params])
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])
        self.autocast_at_step.append(torch.is_autocast_enabled("cpu"))

    def on_step_end(self, trainer, state):
        self.params_after.append([p.detach().clone() for p in trainer.params])


def test_inf_in_microbatch_2_of_4_skips_the_step_and_keeps_the_schedule(tmp_path):
    # Window 1 (batches 4..7) has an inf in its second microbatch.
    data = batches(16, poison={5})
    trace = tmp_path / "trace.jsonl"
    c = cfg("train.steps=4", "train.microbatches=4", "train.force_scaler=true",
            "scaler.init_scale=1024.0", f"train.trace_file={trace}")
    cap = Capture()
    summary = Trainer(c, [cap]).fit(Poisoned(), data)
    recs = read_trace(trace)
    assert [r.found_inf for r in recs] == [False, True, False, False], recs
    assert [r.applied for r in recs] == [True, False, True, True]
    assert all(r.microbatches == 4 for r in recs)
    assert summary.steps_applied == 3 and summary.steps_skipped == 1
    for a, b in zip(cap.params_after[0], cap.params_after[1]):
        assert torch.equal(a, b), "parameters changed on a skipped step"
    # The schedule did not advance over the skip: step 2 uses the lr step 1 would have used.
    assert recs[2].lr == recs[1].lr and recs[1].lr > recs[0].lr, [r.lr for r in recs]
    assert recs[1].scale_after == 512.0 and recs[1].growth_tracker == 0
    assert recs[2].scale_before == 512.0


def test_clipping_sees_unscaled_gradients_at_the_unchanged_threshold(tmp_path):
    trace = tmp_path / "t.jsonl"
    c = cfg("train.steps=2", "train.microbatches=2", "train.force_scaler=true",
            "scaler.init_scale=4096.0", "train.clip_norm=0.01", f"train.trace_file={trace}")
    cap = Capture()
    Trainer(c, [cap]).fit(Poisoned(), batches(8))
    recs = read_trace(trace)
    for rec, scaled, clipped in zip(recs, cap.scaled, cap.clipped):
        inv = torch.tensor(1.0 / rec.scale_before, dtype=torch.float32)
        unscaled = [g * inv for g in scaled]
        norm = torch.nn.utils.get_total_norm(unscaled)
        assert rec.grad_norm == norm.item(), f"recorded norm {rec.grad_norm} is not the unscaled norm {norm.item()}"
        coef = torch.clamp(0.01 / (norm + 1e-6), max=1.0)
        assert rec.clip_coef == coef.item() < 1.0
        for want, got in zip(unscaled, clipped):
            assert torch.equal(want * coef, got), "clipped gradients differ from unscale-then-clip"
        total = torch.nn.utils.get_total_norm(clipped).item()
        assert total == pytest.approx(0.01, rel=1e-4), f"clipped norm {total}, threshold 0.01"


def test_short_last_window_divides_by_its_real_size():
    # 5 batches per epoch, 2 microbatches per step: step 2 is a window of one batch.
    data = batches(5)
    cap = Capture()
    Trainer(cfg("train.steps=3", "train.microbatches=2", "train.clip_norm=null",
                "optimizer.name=sgd"), [cap]).fit(Poisoned(), data)
    model = Poisoned()
    model.lin.load_state_dict({k.split(".", 1)[1]: v for k, v in zip(
        ["lin.weight", "lin.bias"], cap.params_after[1])})
    loss = model(*data[4])
    loss.backward()
    for want, got in zip([model.lin.weight.grad, model.lin.bias.grad], cap.scaled[2]):
        assert torch.equal(want, got), "a window of one batch was not divided by 1"


def test_autocast_covers_forward_and_loss_only():
    model = Poisoned()
    cap = Capture()
    Trainer(cfg("train.steps=2", "precision.mode=bf16"), [cap]).fit(model, batches(4))
    forward = [s for s in model.seen_autocast if not isinstance(s, tuple)]
    backward = [s[1] for s in model.seen_autocast if isinstance(s, tuple)]
    assert forward and all(forward), "forward ran outside autocast"
    assert backward and not any(backward), "backward ran inside autocast"
    assert not any(cap.autocast_at_step), "the optimizer step ran inside autocast"


class SyncCounter(TorchDispatchMode):
    """Counts host reads of tensor values, except the optimizer's host-side step counters."""

    def __init__(self, optimizer_state_ptrs):
        super().__init__()
        self.ptrs = optimizer_state_ptrs
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
                    aten.nonzero.default):
            if not (args and isinstance(args[0], torch.Tensor) and args[0].data_ptr() in self.ptrs()):
                self.count += 1
        return func(*args, **(kwargs or {}))


class CountPerStep(Callback):
    def on_fit_start(self, trainer):
        def step_ptrs():
            return {s["step"].data_ptr() for s in trainer.optimizer.state.values() if "step" in s}
        self.counter = SyncCounter(step_ptrs)
        self.counter.__enter__()
        self.per_step, self.last = [], 0

    def on_step_end(self, trainer, state):
        self.per_step.append(self.counter.count - self.last)
        self.last = self.counter.count

    def on_fit_end(self, trainer, summary):
        self.counter.__exit__(None, None, None)


@pytest.mark.parametrize("precision,extra", [("fp32", []), ("bf16", ["train.force_scaler=true"])])
def test_sync_budget_one_per_step_none_per_microbatch(precision, extra):
    task = build_task(load_config(overrides=["task.name=mlp", "task.size=tiny"]).task, seed=0, batch_size=8)
    counter = CountPerStep()
    c = cfg("train.steps=6", "train.microbatches=3", f"precision.mode={precision}",
            "train.log_interval=100", *extra)
    Trainer(c, [counter]).fit(task.model, task.train_data)
    assert counter.per_step == [1] * 6, f"host syncs per step (3 microbatches each): {counter.per_step}"


@pytest.mark.parametrize("extra", [[], ["train.force_scaler=true"]])
def test_sync_free_mode_with_fused_optimizer_makes_no_sync_between_log_points(tmp_path, extra):
    task = build_task(load_config(overrides=["task.name=mlp", "task.size=tiny"]).task, seed=0, batch_size=8)
    counter = CountPerStep()
    trace = tmp_path / "t.jsonl"
    c = cfg("train.steps=6", "train.microbatches=2", "optimizer.fused=true", "train.sync_free=true",
            "train.log_interval=3", f"train.trace_file={trace}", *extra)
    summary = Trainer(c, [counter]).fit(task.model, task.train_data)
    assert summary.sync_free and summary.optimizer_kind == "fused"
    assert counter.per_step == [0] * 6, f"host syncs per step in sync-free mode: {counter.per_step}"
    recs = read_trace(trace)
    assert [r.step for r in recs] == list(range(6)) and all(r.applied for r in recs)
    lrs = [r.lr for r in recs]
    assert lrs[0] < lrs[1] and lrs[2] > lrs[5], f"schedule not followed on the device: {lrs}"


def test_sync_free_schedule_matches_host_schedule_and_skips(tmp_path):
    data = batches(12, poison={3})
    out = {}
    for mode in ("true", "false"):
        trace = tmp_path / f"{mode}.jsonl"
        c = cfg("train.steps=6", "optimizer.fused=true", f"train.sync_free={mode}", "train.force_scaler=true",
                "scaler.init_scale=256.0", f"train.trace_file={trace}")
        s = Trainer(c).fit(Poisoned(), data)
        out[mode] = (read_trace(trace), s)
    host, free = out["false"][0], out["true"][0]
    assert [r.applied for r in free] == [r.applied for r in host] == [True, True, True, False, True, True]
    assert out["true"][1].steps_skipped == 1
    for a, b in zip(host, free):
        # The device schedule is the host's float64 rate rounded once to float32 (the kernel
        # reads either as a double), and it stands still on the skipped step in both modes.
        assert b.lr == float(np.float32(a.lr)), (a, b)
        assert (a.scale_after, a.growth_tracker) == (b.scale_after, b.growth_tracker)


def test_sync_free_is_refused_for_fused_sgd_with_momentum():
    # torch's fused SGD creates its momentum buffers with empty_like before its kernel reads
    # found_inf: a first step skipped inside the kernel would leave them uninitialised.
    c = cfg("train.steps=3", "optimizer.name=sgd", "optimizer.momentum=0.9", "optimizer.fused=true",
            "train.sync_free=true", "train.force_scaler=true")
    with pytest.warns(UserWarning, match="refused for fused SGD with momentum"):
        s = Trainer(c).fit(Poisoned(), batches(3, poison={0}))
    assert s.optimizer_kind == "fused" and not s.sync_free
    assert any("momentum" in d for d in s.downgrades), s.downgrades
    assert s.steps_skipped == 1 and s.steps_applied == 2


def test_sync_free_counters_at_log_points_survive_a_checkpoint_between_them(tmp_path):
    # A checkpoint reads the device counter of applied steps, which already includes the steps
    # whose records are still pending; the next log point must count those once, not twice.
    seen = []

    class Counters(Callback):
        def on_log(self, trainer, state, records, losses):
            seen.append((state.step, state.applied_steps, state.skipped_steps))

    c = cfg("train.steps=6", "optimizer.fused=true", "train.sync_free=true", "train.force_scaler=true",
            "scaler.init_scale=256.0", "train.log_interval=3", f"checkpoint.folder={tmp_path}",
            "checkpoint.interval=2")
    s = Trainer(c, [Counters()]).fit(Poisoned(), batches(12, poison={1}))
    assert s.sync_free
    # Log points at steps 3 and 6, and before each checkpoint (steps 2, 4 and 6, where the end's
    # flush already happened): each step counted once.
    assert seen == [(2, 1, 1), (3, 2, 1), (4, 3, 1), (6, 5, 1)], seen


def test_stop_on_nonfinite_loss_writes_a_diagnosis(tmp_path):
    c = cfg("train.steps=5", "train.on_nonfinite=stop", f"checkpoint.folder={tmp_path}")
    s = Trainer(c).fit(Poisoned(), batches(10, poison={2}))
    assert s.stopped and "non-finite" in s.stopped and s.steps == 2, s
    assert s.diagnosis_report and (tmp_path / "nonfinite-step00000002.json").exists()


def test_compile_runs_and_matches_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    pytest.importorskip("torch._inductor")
    data = batches(4)
    a = Trainer(cfg("train.steps=2", "train.compile=true")).fit(Poisoned(), data)
    b = Trainer(cfg("train.steps=2")).fit(Poisoned(), data)
    assert a.compiled and a.final_train_loss == pytest.approx(b.final_train_loss, rel=1e-5)


def test_guard_hit_skips_the_step_when_on_nonfinite_is_skip(tmp_path):
    # Window 1 (batches 2, 3): the guard stops the forward of batch 3 at its inf input.
    data = batches(8, poison={3})
    trace = tmp_path / "t.jsonl"
    c = cfg("train.steps=4", "train.microbatches=2", "train.guard=true", "train.force_scaler=true",
            "scaler.init_scale=1024.0", f"train.trace_file={trace}")
    cap = Capture()
    trainer = Trainer(c, [cap])
    s = trainer.fit(Poisoned(), data, val_data=batches(2, poison={0}))
    recs = read_trace(trace)
    assert s.stopped is None and s.steps == 4 and s.steps_skipped == 1, s
    assert [r.found_inf for r in recs] == [False, True, False, False]
    assert [r.applied for r in recs] == [True, False, True, True]
    assert recs[1].scale_after == 512.0 and recs[2].scale_before == 512.0
    assert recs[2].lr == recs[1].lr, "the schedule moved over the skipped step"
    for a, b in zip(cap.params_after[0], cap.params_after[1]):
        assert torch.equal(a, b), "parameters changed on the skipped step"
    assert trainer.state.batch_index == 8 and trainer.state.samples == 64, "the skipped window's batches were not consumed"
    # The guard watches training only: the non-finite validation loss is recorded, not raised.
    assert s.final_val_loss is not None and not math.isfinite(s.final_val_loss)


def test_guard_hit_stops_with_a_diagnosis_when_on_nonfinite_is_stop(tmp_path):
    c = cfg("train.steps=5", "train.guard=true", "train.on_nonfinite=stop", f"checkpoint.folder={tmp_path}")
    s = Trainer(c).fit(Poisoned(), batches(10, poison={2}))
    assert s.stopped and "non-finite" in s.stopped and s.steps == 2, s
    report = json.loads((tmp_path / "nonfinite-step00000002.json").read_text())
    assert report["step"] == 2 and "input[2]" in report["problem"], report["problem"]
    assert s.diagnosis_report == str(tmp_path / "nonfinite-step00000002.json")


@pytest.mark.parametrize("factor,found", [(1e30, False), (math.inf, True)])
def test_without_scaler_found_inf_is_the_gradient_check_not_the_norm(tmp_path, factor, found):
    # 1e30: finite gradients whose squares overflow float32, so the clip norm is inf and the
    # coefficient 0, yet no gradient is inf or NaN: found_inf stays false and the step applies
    # (reference.step: has_inf_or_nan of the gradients). inf: a real non-finite gradient.
    data = [(x, y, torch.tensor(factor)) for x, y, _ in batches(2)]
    trace = tmp_path / "t.jsonl"
    cap = Capture()
    Trainer(cfg("train.steps=1", "train.clip_norm=1.0", f"train.trace_file={trace}"), [cap]).fit(Poisoned(), data)
    (rec,) = read_trace(trace)
    assert rec.found_inf is found and rec.applied is (not found), rec
    assert not math.isfinite(rec.grad_norm), rec
    if not found:
        assert rec.grad_norm == math.inf and rec.clip_coef == 0.0, rec
        assert all(torch.equal(g, torch.zeros_like(g)) for g in cap.clipped[0]), "finite grads times 0 are 0"


class MixedDtypes(nn.Module):
    """Parameters of several dtypes; the loss scales every gradient by the batch's factor."""

    def __init__(self, dtypes):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(n, generator=g).to(dt))
                                    for n, dt in zip((37, 19, 8, 5), dtypes)])

    def forward(self, x, factor):
        return sum((p.float() * x[: p.numel()]).sum() for p in self.ps) * factor


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16, torch.float16, torch.float32),
                                    (torch.float32, torch.float64, torch.float32, torch.float64),
                                    # torch stacks the float64 group's norm before the float32 one's:
                                    # in first-seen order the total differs in its last bit
                                    (torch.float32, torch.float32, torch.float64, torch.float32)])
@pytest.mark.parametrize("factor", [3.0, math.inf])
def test_clipping_without_scaler_matches_torch_clip_grad_norm_bit_for_bit(tmp_path, dtypes, factor):
    # Float32/bfloat16/float16 gradients with a float32 norm take the fused check-and-multiply;
    # a float64 gradient makes the norm float64 and takes the plain check and multiply.
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(40, generator=g) * 10, torch.tensor(factor if i == 1 else 1.0)) for i in range(3)]
    trace = tmp_path / "t.jsonl"
    cap = Capture()
    Trainer(cfg("train.steps=3", "train.clip_norm=0.5", "optimizer.name=sgd", f"train.trace_file={trace}"),
            [cap]).fit(MixedDtypes(dtypes), data)
    recs = read_trace(trace)
    for rec, scaled, clipped in zip(recs, cap.scaled, cap.clipped):
        want = [s.clone() for s in scaled]
        params = [nn.Parameter(torch.zeros_like(w)) for w in want]
        for p, w in zip(params, want):
            p.grad = w
        norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
        assert rec.found_inf is (not all(torch.isfinite(s.float()).all() for s in scaled)), rec
        assert torch.equal(torch.tensor(rec.grad_norm, dtype=torch.float64), norm.double()) or (
            math.isnan(rec.grad_norm) and norm.isnan()), (rec, norm)
        for w, got in zip(want, clipped):
            assert w.dtype == got.dtype and torch.equal(w.isnan(), got.isnan())
            bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w.element_size()]
            finite = ~w.isnan()  # NaN payloads aside, every bit (the sign of zero too)
            assert torch.equal(w[finite].view(bits), got[finite].view(bits)), "clipped gradients differ from torch's"
    assert [r.found_inf for r in recs] == [False, factor != 3.0, False]


def test_scaler_disabled_in_config_trains_without_one():
    task = build_task(load_config(overrides=["task.name=mlp", "task.size=tiny"]).task, seed=0, batch_size=8)
    c = cfg("train.steps=3", "train.force_scaler=true", "scaler.enabled=false", "precision.mode=bf16")
    with pytest.warns(UserWarning, match="scaler.enabled is false"):
        summary = Trainer(c).fit(task.model, task.train_data)
    assert not summary.use_scaler and summary.final_scale is None
    assert summary.steps_applied == 3 and math.isfinite(summary.final_train_loss)
