"""The audit's optimizer registry: torch's classes found through their MRO, subclasses replayed
as their parent when their step is or calls the parent's, a user's own optimizer replayed through
the spec it registers (the Lion of the worked example in `audit.optimizers`), and any other
optimizer named as not in the specification while its scaler stages are still checked."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import audit
from audit import optimizers
from reference import optim
from reference.optim import OptimizerSpec


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) in torch, as the worked example describes it."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                c = m * b1 + p.grad * (1 - b1)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(c.sign(), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad * (1 - b2))


# --- the worked example of audit.optimizers, verbatim ---------------------------------------


@dataclass(frozen=True)
class LionConfig:
    lr: float = 1e-4
    betas: tuple = (0.9, 0.99)
    weight_decay: float = 0.0


@dataclass(frozen=True)
class LionState:
    exp_avg: np.ndarray


def lion_init(p, cfg):
    return LionState(np.zeros_like(p))


def lion_step(params, grads, state, cfg, *, lr=None, **_):
    out_p, out_s = [], []
    for p, g, s in zip(params, grads, state):
        if g is not None:
            f, (b1, b2) = p.dtype.type, cfg.betas
            c = s.exp_avg * f(b1) + g * f(1 - b1)
            p = p * f(1 - cfg.lr * cfg.weight_decay) + f(-cfg.lr) * np.sign(c)
            s = LionState(s.exp_avg * f(b2) + g * f(1 - b2))
        out_p.append(p)
        out_s.append(s)
    return out_p, list(grads), tuple(out_s)


LION = OptimizerSpec("Lion", LionConfig, LionConfig, lion_init, {"for-loop": lion_step})


def lion_step_wrong_beta(params, grads, state, cfg, *, lr=None, **_):
    """The mutant: the second moment's beta used for the update's interpolation too."""
    return lion_step(params, grads, state, LionConfig(cfg.lr, (cfg.betas[1], cfg.betas[1]), cfg.weight_decay))


# --------------------------------------------------------------------------------------------


def _loop(make_optimizer, steps: int = 4, inf_at: int = 2) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=2)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == inf_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


@pytest.fixture
def user_rows(monkeypatch):
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(optimizers, "_ROWS", dict(optimizers._ROWS))


class ClippingSGD(torch.optim.SGD):
    """A framework's generated subclass: clips, then calls the parent's step."""

    def step(self, closure=None):
        torch.nn.utils.clip_grad_value_([p for g in self.param_groups for p in g["params"]], 10.0)
        return super().step(closure)


class OwnStepAdam(torch.optim.Adam):
    """A subclass whose step is its own arithmetic."""

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-g["lr"])


def test_every_spec_row_of_a_torch_optim_class_is_found_through_the_mro():
    for name, row in optim.SPECS.items():
        entry, why = optimizers.lookup(getattr(torch.optim, name))
        assert why is None and entry.spec is row, name
    entry, _ = optimizers.lookup(type("MyAdamW", (torch.optim.AdamW,), {}))
    assert entry.spec is optim.spec("AdamW"), "a subclass that keeps the step is its parent's"
    entry, _ = optimizers.lookup(ClippingSGD)
    assert entry.spec is optim.spec("SGD"), "a subclass whose step calls super().step is its parent's"


def test_a_subclass_with_its_own_step_and_an_unknown_class_are_not_replayed():
    entry, why = optimizers.lookup(OwnStepAdam)
    assert entry is None and why == (f"{__name__}.OwnStepAdam is not in the specification: OwnStepAdam.step "
                                     "neither is Adam.step nor calls it")
    entry, why = optimizers.lookup(Lion)
    assert entry is None and why == f"{__name__}.Lion is not in the specification"


@pytest.mark.parametrize("mode", ["inline", "process"])
def test_a_registered_user_optimizer_is_replayed_bit_for_bit(monkeypatch, user_rows, mode):
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", mode)
    audit.register_optimizer(Lion, LION)
    with audit.audit() as session:
        _loop(lambda p: Lion(p, lr=0.01, weight_decay=0.1))
    r = session.report
    assert r.findings == [], r.text()
    assert r.replay["not_replayed"] == {}, r.replay
    assert r.replay["steps_replayed"] == 4 and r.replay["steps_bit_exact"] == 4, r.replay


def test_a_wrong_user_spec_is_a_divergence(user_rows, monkeypatch):
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")
    audit.register_optimizer(Lion, OptimizerSpec("Lion", LionConfig, LionConfig, lion_init,
                                                 {"for-loop": lion_step_wrong_beta}))
    with audit.audit() as session:
        _loop(lambda p: Lion(p, lr=0.01))
    (f,) = {(f.rule, f.step) for f in session.report.findings}
    assert f == ("replay-divergence", 1), session.report.text()  # step 0: m = 0, the sign is the same


def test_an_unregistered_optimizer_still_has_its_scaler_stages_checked(monkeypatch):
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")
    with audit.audit() as session:
        _loop(lambda p: Lion(p, lr=0.01))
    r = session.report
    assert r.findings == [] and r.replay["updates_checked"] == 4, r.text()
    verdicts = [s.replay for s in r.steps]
    assert verdicts.count(f"partly replayed: {__name__}.Lion is not in the specification") == 3, verdicts
    assert r.replay["steps_replayed"] == 1  # the skipped step: its every stage is the scaler's


def test_a_subclass_that_calls_its_parents_step_is_replayed_as_the_parent(monkeypatch):
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")
    with audit.audit() as session:
        _loop(lambda p: ClippingSGD(p, lr=0.05, momentum=0.9))
    r = session.report
    assert r.replay["steps_replayed"] == 4 and r.replay["not_replayed"] == {}, r.text()


def test_register_optimizer_refuses_what_it_cannot_use():
    with pytest.raises(ValueError, match="torch.optim.Optimizer subclass"):
        audit.register_optimizer(object, LION)
    with pytest.raises(ValueError, match="must be a reference.optim.OptimizerSpec"):
        audit.register_optimizer(Lion, lion_step)
    with pytest.raises(ValueError, match="ulp bounds must be ints >= 0"):
        audit.register_optimizer(Lion, LION, ulp={"param": -1})


@pytest.mark.parametrize("foreach", [False, True])
def test_adafactor_is_replayed_every_step(monkeypatch, foreach):
    """Adafactor (factored weights, unfactored biases, weight decay) through a scaler with a
    skipped step: every step replayed, within its bounds on native kernels."""
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")
    with audit.audit() as session:
        _loop(lambda p: torch.optim.Adafactor(p, lr=0.05, weight_decay=0.01, foreach=foreach))
    r = session.report
    assert r.findings == [], r.text()
    assert r.replay["not_replayed"] == {} and r.replay["steps_replayed"] == 4, r.replay
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":  # exact kernels: reductions included
        assert r.replay["steps_bit_exact"] == 4, r.replay


TENSOR_LR_LOOPS = [("Adagrad", {"lr_decay": 0.1}), ("NAdam", {"decoupled_weight_decay": True, "weight_decay": 0.1}),
                   ("RAdam", {"foreach": True}), ("Adamax", {}), ("AdamW", {"fused": True})]


@pytest.mark.parametrize(("name", "kwargs"), TENSOR_LR_LOOPS)
@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
def test_a_tensor_learning_rate_is_replayed(monkeypatch, name, kwargs, lr_dtype):
    """A tensor lr is replayed as the spec computes with it (reference.optim._lr): every step,
    bit for bit with exact kernels."""
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")

    def make(params):
        return getattr(torch.optim, name)(params, lr=torch.tensor(0.05, dtype=lr_dtype), **kwargs)

    with audit.audit() as session:
        _loop(make)
    r = session.report
    assert r.findings == [], r.text()
    assert r.replay["not_replayed"] == {} and r.replay["steps_replayed"] == 4, r.replay
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        assert r.replay["steps_bit_exact"] == 4, r.replay


def test_a_tensor_learning_rate_the_spec_does_not_take_is_not_replayed(monkeypatch):
    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")
    with audit.audit() as session:
        _loop(lambda p: torch.optim.Adafactor(p, lr=torch.tensor(0.05)))
    r = session.report
    assert r.findings == [], r.text()
    assert any("a tensor learning rate (a tensor lr is not modelled for Adafactor" in s.replay for s in r.steps), \
        [s.replay for s in r.steps]


NATIVE_LOOPS = [("AdamW", {"weight_decay": 0.01}), ("AdamW", {"foreach": True, "amsgrad": True}),
                ("Adam", {"weight_decay": 0.01, "maximize": True}), ("Adam", {"foreach": True, "betas": (0.0, 0.99)})]


@pytest.mark.parametrize(("name", "kwargs"), NATIVE_LOOPS, ids=[f"{n}-{'-'.join(k)}" for n, k in NATIVE_LOOPS])
def test_float32_adam_is_replayed_bit_for_bit_on_native_kernels(monkeypatch, name, kwargs):
    """reference.optim._common rule 7: a float32 Adam(W) loop without clipping, its for-loop and
    foreach paths, through a scaler with a skipped step, on this machine's kernels: every step
    replayed bit for bit (bound 0 on native kernels too), and the report says so by name. On
    native kernels the same loop replayed without the fusions is not bit for bit (the loop
    shows them)."""
    from audit import replay

    monkeypatch.setenv("AMPSPEC_AUDIT_REPLAY", "inline")

    def run():
        with audit.audit() as session:
            _loop(lambda p: getattr(torch.optim, name)(p, lr=0.05, **kwargs))
        return session.report

    r = run()
    assert r.findings == [], r.text()
    assert r.replay["not_replayed"] == {} and r.replay["steps_replayed"] == 4, r.replay
    assert r.replay["steps_bit_exact"] == 4, r.replay
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "DEFAULT":
        assert "every field bit for bit" in r.replay["exactness"], r.replay["exactness"]
        return
    assert capability in replay.NATIVE_KERNELS, capability
    assert r.replay["exactness"].endswith("except float32 steps of Adam (for-loop, foreach), "
                                          "AdamW (for-loop, foreach): bit for bit"), r.replay["exactness"]
    assert "bit for bit" in r.text()
    monkeypatch.setattr(replay, "_native_exact", lambda *args: False)
    unfused = run()
    assert unfused.findings == [] and unfused.replay["steps_bit_exact"] < 4, unfused.replay


def test_a_joined_group_still_names_the_parameter_that_differs(monkeypatch):
    """The replay steps a float32 AdamW group joined (`OptimizerSpec.step_joined`, one call for
    the group) and compares each parameter's result: a step post-hook that nudges one element of
    the second parameter's first moment is a divergence naming that field of parameter 1, at the
    first step; the same loop without the hook is bit for bit at every step. In the replay
    process, as an audit runs by default."""
    from audit import replay, worker

    if not worker.available():
        pytest.skip("the replay process needs Linux shared memory")
    monkeypatch.delenv("AMPSPEC_AUDIT_REPLAY", raising=False)

    def run(nudge: bool):
        def make(params):
            opt = torch.optim.AdamW(params, lr=0.05)
            if nudge:
                second = opt.param_groups[0]["params"][1]
                opt.register_step_post_hook(lambda o, *_: o.state[second]["exp_avg"].view(-1)[3].add_(1.0))
            return opt

        with audit.audit() as session:
            _loop(make, inf_at=-1)
        return session.report

    clean = run(False)
    assert clean.findings == [] and clean.replay["runs_in"] == "process", clean.text()
    if torch.backends.cpu.get_cpu_capability() in replay.NATIVE_KERNELS:
        assert clean.replay["steps_bit_exact"] == 4, clean.replay
    nudged = run(True)
    divergences = [f for f in nudged.findings if f.rule == "replay-divergence"]
    assert [f.step for f in divergences] == [0], nudged.text()
    assert "exp_avg of parameter 1" in divergences[0].message, divergences[0].message
