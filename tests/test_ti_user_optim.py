"""Your own optimizer and scheduler in ``Trainer.fit``: the step contract, checkpoints, refusals."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from torchimpl.run.checkpoint import load_checkpoint
from torchimpl.config.schema import load_config
from torchimpl.run.state import ResumeError
from torchimpl.train.trainer import Callback, Trainer


class Regression(nn.Module):
    """Linear regression whose loss is multiplied by the batch's third element (inf plants a fault)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(4, 2)
        self.out = nn.Linear(2, 1)

    def forward(self, x, y, factor):
        return ((self.out(torch.tanh(self.lin(x))) - y) ** 2).mean() * factor


def batches(n, poison=()):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g),
             torch.tensor(math.inf if i in poison else 1.0)) for i in range(n)]


def cfg(*sets):
    return load_config(overrides=["device=cpu", "train.log_interval=1", "train.steps=6", *sets])


def sgd_step(model, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def test_own_optimizer_and_scheduler_train_as_the_hand_loop_bit_for_bit():
    data = batches(6)
    hand = Regression()
    opt, sched = sgd_step(hand)
    for x, y, f in data:
        opt.zero_grad()
        hand(x, y, f).backward()
        opt.step()
        sched.step()
    model = Regression()
    opt2, sched2 = sgd_step(model)
    summary = Trainer(cfg("train.clip_norm=null")).fit(model, data, optimizer=opt2, scheduler=sched2)
    assert summary.steps_applied == 6
    assert all(torch.equal(a, b) for a, b in zip(params(hand), params(model)))
    assert sched2.last_epoch == 6 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert summary.optimizer_kind == "for-loop" and "torch.optim.sgd.SGD" in summary.optimizer_reason


class Watch(Callback):
    def __init__(self):
        self.lrs, self.norms = [], []

    def on_before_optimizer_step(self, trainer, state):
        self.norms.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in trainer.params])).item())

    def on_log(self, trainer, state, records, losses):
        self.lrs += [(r.step, r.applied, r.lr) for r in records]


def test_the_scheduler_advances_only_on_applied_steps_and_clipping_sees_unscaled_gradients():
    model = Regression()
    opt, sched = sgd_step(model)
    watch = Watch()
    summary = Trainer(cfg("train.force_scaler=true", "train.steps=8", "train.clip_norm=0.01"),
                      callbacks=[watch]).fit(model, batches(8, poison=(1, 2, 5)), optimizer=opt, scheduler=sched)
    applied = [a for _, a, _ in watch.lrs]
    assert applied == [True, False, False, True, True, False, True, True]
    assert sched.last_epoch == summary.steps_applied == 5
    # StepLR(step_size=2, gamma=0.5) counts applied steps: 0.1 for the first two applied, ...
    expected, n = [], 0
    for a in applied:
        expected.append(0.1 * 0.5 ** (n // 2))
        n += a
    assert [lr for _, _, lr in watch.lrs] == pytest.approx(expected, rel=0, abs=0)
    # The scale is 65536: clipping measured the scaled gradients would leave norms ~65536x larger.
    assert max(watch.norms) <= 0.01 * (1 + 1e-6)


def _run(tmp_path, steps, *, resume=None, make=sgd_step, extra=()):
    model = Regression()
    opt, sched = make(model)
    trainer = Trainer(cfg(f"train.steps={steps}", f"checkpoint.folder={tmp_path / 'ck'}", "checkpoint.interval=3",
                          "train.force_scaler=true", *extra))
    trainer.fit(model, batches(4, poison=(1,)), optimizer=opt, scheduler=sched, resume=resume)
    return model, opt, sched


def test_own_optimizer_and_scheduler_resume_bit_for_bit(tmp_path):
    whole, opt, sched = _run(tmp_path / "a", 9)
    _run(tmp_path / "b", 3)
    resumed, opt2, sched2 = _run(tmp_path / "b", 9, resume="latest")
    assert all(torch.equal(a, b) for a, b in zip(params(whole), params(resumed)))
    assert sched2.state_dict() == sched.state_dict()
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["momentum_buffer"], s2[k]["momentum_buffer"]) for k in s1)
    ckpt = load_checkpoint(tmp_path / "b" / "ck" / "step-00000003.ckpt")
    assert ckpt["optimizer_source"] == {"user": True, "optimizer": "torch.optim.sgd.SGD",
                                        "scheduler": "torch.optim.lr_scheduler.StepLR"}
    assert ckpt["scaler"] is not None


def test_resume_refuses_another_optimizer_or_scheduler_class(tmp_path):
    _run(tmp_path, 3)

    def adam(model):
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2)

    def sgd_exp(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return opt, torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)

    def sgd_none(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None

    for make, words in ((adam, "torch.optim.adam.Adam (now)"), (sgd_exp, "ExponentialLR (now)"),
                        (sgd_none, "scheduler: torch.optim.lr_scheduler.StepLR (checkpoint) -> None")):
        with pytest.raises(ResumeError, match=r"defines the run") as err:
            _run(tmp_path, 6, resume="latest", make=make)
        assert words in str(err.value)
    # The configuration's optimizer where yours was saved.
    with pytest.raises(ResumeError, match="your optimizer \\(checkpoint\\) -> the configuration's optimizer"):
        Trainer(cfg("train.steps=6", f"checkpoint.folder={tmp_path / 'ck'}")).fit(
            Regression(), batches(4), resume="latest")


def test_a_changed_hyperparameter_is_named_and_the_checkpoints_kept(tmp_path):
    _run(tmp_path, 3)

    def momentum_half(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    with pytest.warns(UserWarning, match=r"param_groups\[0\]\['momentum'\] is 0.9 in the checkpoint and 0.5"):
        _, opt, _ = _run(tmp_path, 6, resume="latest", make=momentum_half)
    assert opt.param_groups[0]["momentum"] == 0.9


def test_config_sections_that_own_optimizers_make_unused_are_named():
    model = Regression()
    opt, _ = sgd_step(model)
    with pytest.warns(UserWarning, match="schedule section is not used"):
        Trainer(cfg("schedule.name=constant", "train.steps=1")).fit(model, batches(1), optimizer=opt)
    assert opt.param_groups[0]["lr"] == 0.1  # no scheduler: the optimizer's rate stays as built


def test_functions_build_the_optimizer_and_scheduler_on_the_moved_model():
    model = Regression()
    seen = []

    def make_opt(ps):
        ps = list(ps)
        seen.append(ps)
        return torch.optim.AdamW(ps, lr=0.01)

    trainer = Trainer(cfg("train.steps=3"))
    trainer.fit(model, batches(3), optimizer=make_opt,
                scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda n: 1.0 / (n + 1)))
    assert [id(p) for p in seen[0]] == [id(p) for p in model.parameters()]
    assert trainer.scheduler.last_epoch == 3
    assert trainer.optimizer.param_groups[0]["lr"] == 0.01 / 4


def test_sync_free_runs_a_fused_optimizer_at_its_rate_and_refuses_a_scheduler():
    model = Regression()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    trainer = Trainer(cfg("train.sync_free=true", "train.force_scaler=true", "train.steps=4"))
    summary = trainer.fit(model, batches(4, poison=(1,)), optimizer=opt)
    assert summary.sync_free and summary.steps_skipped == 1
    model = Regression()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    with pytest.warns(UserWarning, match="cannot run your scheduler"):
        summary = Trainer(cfg("train.sync_free=true", "train.steps=2")).fit(
            model, batches(2), optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    assert not summary.sync_free


class Unsafe:
    """A scheduler factor whose state a checkpoint could not load with weights_only=True."""

    def __init__(self):
        self.table = {"kind": Regression}

    def __call__(self, n):
        return 1.0


@pytest.mark.parametrize("bad, words", [
    (lambda m, o: dict(optimizer=torch.optim.SGD(Regression(seed=1).parameters(), lr=0.1)),
     "is not a trainable parameter of the model"),
    (lambda m, o: dict(optimizer=o, scheduler=torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD(m.parameters(), lr=0.1), 2)), "drives another optimizer"),
    (lambda m, o: dict(optimizer=o, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(o)),
     "ReduceLROnPlateau steps on a validation metric"),
    (lambda m, o: dict(scheduler=torch.optim.lr_scheduler.StepLR(o, 2)), "needs the optimizer it drives"),
    (lambda m, o: dict(optimizer="adamw"), "must be a torch.optim.Optimizer or a function"),
    (lambda m, o: dict(optimizer=lambda ps: None), "returned a NoneType"),
    (lambda m, o: dict(optimizer=o, scheduler=torch.optim.lr_scheduler.LambdaLR(o, Unsafe())),
     "cannot load safely"),
])
def test_bad_optimizers_and_schedulers_are_refused_before_training(bad, words):
    model = Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = params(model)
    with pytest.raises(ValueError, match=words):
        Trainer(cfg()).fit(model, batches(2), **bad(model, opt))
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))


def test_an_optimizer_instance_is_refused_with_fsdp2_naming_the_function_form():
    model = Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="pass a function params -> Optimizer"):
        Trainer(cfg("train.distributed=fsdp2")).fit(model, batches(2), optimizer=opt)


def test_state_on_another_device_is_refused():
    model = Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    p = next(model.parameters())
    opt.state[p]["momentum_buffer"] = torch.zeros(p.shape, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="state 'momentum_buffer' of parameter 'lin.weight' is on meta"):
            Trainer(cfg()).fit(model, batches(2), optimizer=opt)
