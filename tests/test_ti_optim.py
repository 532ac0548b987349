"""OptimizerConfig validation, the fused-AdamW probe, and build_optimizer's kinds and groups."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import torchimpl.train.optim as optim_mod
from torchimpl.train.optim import (
    BuiltOptimizer,
    FusedOptimizerWarning,
    OptimizerConfig,
    build_optimizer,
    supports_fused_adamw,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.lin(self.emb(idx))))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "lamb"}, "optimizer name must be one of adamw, adam, sgd, adagrad, rmsprop, adamax, adadelta, nadam, radam, adafactor, got 'lamb'"),
        ({"lr": -1e-3}, "lr must be > 0 and within float32's range (at most 3.403e+38), got -0.001"),
        ({"lr": 0.0}, "lr must be > 0 and within float32's range (at most 3.403e+38), got 0.0"),
        ({"lr": float("nan")}, "lr must be a finite number, got nan"),
        ({"lr": "1e-3"}, "lr must be a number, got '1e-3'"),
        ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0.0, got -0.1"),
        ({"eps": float("inf")}, "eps must be a finite number, got inf"),
        ({"eps": 0.0}, "eps must be a finite number > 0 (it keeps a zero second moment from dividing by zero), got 0.0"),
        ({"name": "rmsprop", "eps": -1e-8}, "eps must be a finite number > 0 (it keeps a zero second moment"),
        ({"name": "adadelta", "rho": 1.5}, "rho must be in [0, 1], got 1.5"),
        ({"name": "adadelta", "rho": -0.5}, "rho must be a finite number >= 0.0, got -0.5"),
        ({"betas": (0.9,)}, "betas must be a pair of numbers in [0, 1), got (0.9,)"),
        ({"betas": (0.9, 1.0)}, "betas[1] must be in [0, 1), got 1.0"),
        ({"betas": (-0.1, 0.9)}, "betas[0] must be a finite number >= 0.0, got -0.1"),
        ({"fused": "yes"}, "fused must be None, True or False, got 'yes'"),
        ({"nesterov": 1}, "nesterov must be a bool, got 1"),
        ({"name": "adamw", "momentum": 0.9},
         "invalid configuration: momentum: only the 'sgd' and 'rmsprop' optimizers use momentum, and this one is "
         "'adamw' (got momentum=0.9); remove momentum, or set the optimizer's name to 'sgd' or 'rmsprop'"),
        ({"name": "adam", "nesterov": True},
         "invalid configuration: nesterov: only the 'sgd' optimizer uses nesterov, and this one is 'adam'"),
        ({"name": "sgd", "nesterov": True},
         "invalid configuration: nesterov: Nesterov momentum needs momentum > 0, got momentum=0.0; "
         "set momentum (e.g. 0.9), or remove nesterov"),
        ({"name": "sgd", "momentum": -0.5}, "momentum must be a finite number >= 0.0, got -0.5"),
        ({"name": "adafactor", "beta2_decay": 0.5},
         "beta2_decay must be <= 0 (Adafactor's second moment weighs the new gradient by step ** beta2_decay), got 0.5"),
        ({"name": "adafactor", "beta2_decay": float("nan")}, "beta2_decay must be a finite number, got nan"),
        ({"name": "adafactor", "d": 0.5}, "d must be a finite number >= 1.0, got 0.5"),
        ({"name": "adamw", "d": 2.0},
         "invalid configuration: d: only the 'adafactor' optimizer uses d, and this one is 'adamw' (got d=2.0); "
         "remove d, or set the optimizer's name to 'adafactor'"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError) as info:
        OptimizerConfig(**kwargs)
    assert str(info.value).startswith(message), str(info.value)


def test_config_normalises_betas_and_is_frozen():
    cfg = OptimizerConfig(betas=[0.8, 0.99])  # type: ignore[arg-type]
    assert cfg.betas == (0.8, 0.99) and isinstance(cfg.betas, tuple)
    assert cfg == OptimizerConfig(betas=(0.8, 0.99))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]


# --- the probe ------------------------------------------------------------------------------------


def test_fused_adamw_probe_on_cpu():
    # torch >= 2.4 (so every supported torch) has a fused CPU AdamW kernel: the probe says so.
    assert supports_fused_adamw("cpu") is True
    assert supports_fused_adamw(torch.device("cpu")) is True


@pytest.mark.parametrize("error", [TypeError, RuntimeError, ValueError])
def test_fused_adamw_probe_catches_constructor_failure(monkeypatch, error):
    seen = {}

    def failing(params, **kwargs):
        seen.update(kwargs, params=list(params))
        raise error("fused=True is not supported here")

    monkeypatch.setattr(torch.optim, "AdamW", failing)
    assert supports_fused_adamw("cpu") is False
    assert seen["fused"] is True
    assert [tuple(p.shape) for p in seen["params"]] == [(1,)], "one one-element parameter"


def test_fused_adamw_probe_does_not_catch_other_errors(monkeypatch):
    def broken(params, **kwargs):
        raise KeyError("bug")

    monkeypatch.setattr(torch.optim, "AdamW", broken)
    with pytest.raises(KeyError):
        supports_fused_adamw("cpu")


def test_fused_adamw_probe_unavailable_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def never(*a, **k):
        raise AssertionError("must not construct on an unavailable device")

    monkeypatch.setattr(torch.optim, "AdamW", never)
    assert supports_fused_adamw("cuda") is False
    assert supports_fused_adamw("cuda:1") is False


def test_fused_adamw_probe_unavailable_mps(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert supports_fused_adamw("mps") is False


# --- build_optimizer --------------------------------------------------------------------------


def _ids(params):
    return [id(p) for p in params]


def test_groups_exclude_biases_and_norms_from_decay():
    model = Net()
    built = build_optimizer(model, OptimizerConfig(weight_decay=0.1), "cpu")
    groups = built.optimizer.param_groups
    assert len(groups) == 2
    decay = [model.emb.weight, model.lin.weight, model.head.weight]
    assert _ids(groups[0]["params"]) == _ids(decay)
    assert groups[0]["weight_decay"] == 0.1
    assert _ids(groups[1]["params"]) == _ids([model.lin.bias, model.norm.weight, model.norm.bias])
    assert groups[1]["weight_decay"] == 0.0


def test_single_group_when_disabled_and_frozen_params_left_out():
    model = Net()
    model.emb.weight.requires_grad_(False)
    cfg = OptimizerConfig(weight_decay=0.1, no_decay_bias_and_norm=False)
    groups = build_optimizer(model, cfg, "cpu").optimizer.param_groups
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1
    expected = [p for n, p in model.named_parameters() if n != "emb.weight"]
    assert _ids(groups[0]["params"]) == _ids(expected)


def test_no_empty_group():
    model = nn.Linear(3, 3, bias=False)
    groups = build_optimizer(model, OptimizerConfig(), "cpu").optimizer.param_groups
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.01


@pytest.mark.parametrize(
    "cfg, cls, settings",
    [
        (
            OptimizerConfig("adamw", lr=0.02, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05),
            torch.optim.AdamW,
            {"lr": 0.02, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.05},
        ),
        (
            OptimizerConfig("adam", lr=0.03, weight_decay=0.0),
            torch.optim.Adam,
            {"lr": 0.03, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
        ),
        (
            OptimizerConfig("sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
            torch.optim.SGD,
            {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
        ),
    ],
)
def test_optimizer_class_and_settings(cfg, cls, settings):
    built = build_optimizer(Net(), cfg, "cpu")
    assert type(built.optimizer) is cls
    got = {k: built.optimizer.defaults[k] for k in settings}
    assert got == settings
    assert built.optimizer.param_groups[0]["weight_decay"] == settings["weight_decay"]


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_kinds_on_cpu(name):
    model = Net()
    default = build_optimizer(model, OptimizerConfig(name), "cpu")
    assert default.kind == "for-loop", "fused=None on the CPU keeps torch's default for-loop"
    assert default.optimizer.defaults["foreach"] is False
    assert not default.optimizer.defaults.get("fused")
    assert "fused=None on cpu" in default.reason

    off = build_optimizer(model, OptimizerConfig(name, fused=False), "cpu")
    assert off.kind == "for-loop" and "fused disabled" in off.reason

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused = build_optimizer(model, OptimizerConfig(name, fused=True), "cpu")
    assert fused.kind == "fused"
    assert fused.optimizer.defaults["fused"] is True
    assert isinstance(fused, BuiltOptimizer)


def test_requested_fused_failure_warns_and_falls_back(monkeypatch):
    real = torch.optim.AdamW

    class Refusing(real):  # type: ignore[misc, valid-type]
        def __init__(self, params, **kwargs):
            if kwargs.get("fused"):
                raise RuntimeError("`fused=True` requires all the params to be floating point")
            super().__init__(params, **kwargs)

    monkeypatch.setitem(optim_mod.REGISTRY, "adamw", dataclasses.replace(optim_mod.REGISTRY["adamw"], cls=Refusing))
    with pytest.warns(FusedOptimizerWarning) as caught:
        built = build_optimizer(Net(), OptimizerConfig(fused=True), "cpu")
    assert len(caught) == 1
    assert built.kind == "for-loop"
    assert not built.optimizer.defaults.get("fused")
    assert "requires all the params to be floating point" in built.reason
    assert str(caught[0].message) == built.reason


def test_model_not_on_device_is_rejected_and_nothing_moves():
    model = Net()
    with pytest.raises(ValueError) as info:
        build_optimizer(model, OptimizerConfig(), "meta")
    msg = str(info.value)
    assert "parameter 'emb.weight' is on cpu" in msg, msg
    assert "call model.to(device) before build_optimizer" in msg, msg
    assert all(p.device.type == "cpu" for p in model.parameters()), "nothing may be moved"


def test_first_misplaced_parameter_is_named():
    model = Net()
    model.norm.to("meta")
    with pytest.raises(ValueError, match="parameter 'norm.weight' is on meta"):
        build_optimizer(model, OptimizerConfig(), "cpu")


def test_cpu_index_is_the_same_device():
    assert build_optimizer(Net(), OptimizerConfig(), "cpu:0").kind == "for-loop"


def test_no_trainable_parameters():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="model has no trainable parameters"):
        build_optimizer(model, OptimizerConfig(), "cpu")


def test_build_rejects_non_config():
    with pytest.raises(ValueError, match="config must be an OptimizerConfig, got dict"):
        build_optimizer(Net(), {"name": "sgd"}, "cpu")  # type: ignore[arg-type]


def test_fused_and_for_loop_both_train():
    torch.manual_seed(0)
    x = torch.randint(0, 5, (6,))
    for fused in (False, True):
        model = Net()
        before = [p.detach().clone() for p in model.parameters()]
        opt = build_optimizer(model, OptimizerConfig(lr=0.1, fused=fused), "cpu").optimizer
        model(x).square().mean().backward()
        opt.step()
        changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
        assert all(changed), f"fused={fused}: a step must update every parameter"


@pytest.mark.parametrize("sets", [
    ["optimizer.name=rmsprop", "optimizer.alpha=0.9", "optimizer.centered=true", "optimizer.momentum=0.5"],
    ["optimizer.name=adagrad", "optimizer.lr_decay=0.01", "optimizer.fused=true"],
    ["optimizer.name=nadam", "optimizer.decoupled_weight_decay=true", "optimizer.momentum_decay=0.01"],
    ["optimizer.name=radam"], ["optimizer.name=adamax"], ["optimizer.name=adadelta", "optimizer.rho=0.5"],
    ["optimizer.name=adafactor", "optimizer.d=2.0", "optimizer.beta2_decay=0.0"],
], ids=lambda s: s[0].split("=")[1])
def test_every_optimizer_trains_checkpoints_its_settings_and_resumes_bit_for_bit(tmp_path, sets):
    """A registered optimizer by name: its settings reach torch's class, are saved with the
    run's configuration, and resuming from a checkpoint equals the uninterrupted run."""
    from torchimpl.run.checkpoint import latest_checkpoint, load_checkpoint
    from torchimpl.config.schema import load_config
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Trainer

    def run(steps: int, folder: str, resume: bool = False):
        cfg = load_config(overrides=["device=cpu", "task.name=mlp", "task.size=tiny", f"train.steps={steps}",
                                     "train.batch_size=4", "precision.mode=bf16", "train.force_scaler=true",
                                     "schedule.name=constant",
                                     f"checkpoint.folder={tmp_path / folder}", *sets])
        task = build_task(cfg.task, seed=0, batch_size=4)
        t = Trainer(cfg)
        t.fit(task.model, task.train_data, resume="latest" if resume else None)
        return t

    full = run(4, "full")
    row = optim_mod.REGISTRY[sets[0].split("=")[1]]
    assert type(full.optimizer) is row.cls
    for s in sets[1:]:
        key, value = s.split("=")
        name = key.split(".")[1]
        if name != "fused":
            assert full.optimizer.defaults[name] == pytest.approx(float(value) if value[0].isdigit() else value == "true")
    run(2, "ck")
    saved = load_checkpoint(latest_checkpoint(tmp_path / "ck"))
    kept = saved["config"]["optimizer"]
    for s in sets:
        key, value = s.split("=")
        expected = value if key == "optimizer.name" else (value == "true" if value in ("true", "false") else float(value))
        assert kept[key.split(".")[1]] == expected, f"{key} is not in the checkpoint's configuration: {kept}"
    resumed = run(4, "ck", resume=True)
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)
    for (ka, a), (kb, b) in zip(full.optimizer.state.items(), resumed.optimizer.state.items()):
        for name in a:
            assert torch.equal(torch.as_tensor(a[name]), torch.as_tensor(b[name])), name
