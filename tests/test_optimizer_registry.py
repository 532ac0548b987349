"""The optimizer registries: every registered optimizer is covered by every consumer, and adding
one touches four places only (CONTRIBUTING.md's recipe): its spec module (its rules, step
function, state, hyperparameters and its one row with the native-kernel bounds; the package
imports it), its torchimpl row, its conformance strategy entry and its row in docs/spec.md's
table -- shown with a toy optimizer added in this test and nowhere else (its spec module
written to a temporary folder on the package's path)."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from audit import optimizers as audit_optimizers
from conformance import strategies
from conformance.test_optimizers import run_optimizer_case
from reference import optim
from reference import step as ref_step
from torchimpl.train import optim as ti_optim
from torchimpl import spec_bridge
from torchimpl.config import sections as config_sections
from torchimpl.config.schema import Config


_ROOT = Path(__file__).resolve().parents[1]


def _docs_optimizers(text: str) -> set[str]:
    """The optimizers docs/spec.md's table of optimizers names (``| SGD (`sgd`) | ...``)."""
    return set(re.findall(r"(?:^\| |, )(\w+) \(`\w+`\)", text, re.MULTILINE))


def _assert_every_consumer_covers_every_row(docs: str | None = None) -> None:
    """Every spec row has a conformance row of its torch class, native-kernel bounds for every
    field it compares, an audit row with those same bounds, a torchimpl row, magnitudes and a
    row in docs/spec.md's table (``docs``: that page's text); every torchimpl row bridges to its
    spec row."""
    torch_rows = {row.cls.__name__: row for row in ti_optim.REGISTRY.values()}
    documented = _docs_optimizers((_ROOT / "docs" / "spec.md").read_text() if docs is None else docs)
    for name, row in optim.SPECS.items():
        assert name in documented, f"{name}: no row in docs/spec.md's table of optimizers"
        assert name in strategies.OPTIMIZER_CASES, f"{name}: no conformance row in conformance/strategies.py"
        case = strategies.OPTIMIZER_CASES[name]
        assert case.torch_class.__name__ == name, f"{name}: the conformance row's class is {case.torch_class}"
        # The same lookup as the property's (conformance/test_optimizers.py run_optimizer_case).
        bounds = case.ulp if case.ulp is not None else dict(row.native_ulp)
        assert bounds, f"{name}: no native-kernel bounds (the spec row's native_ulp)"
        cfg = row.make_config()
        init = row.init_state(np.zeros(2, np.float32), cfg)
        # Scalar fields (step counters) are compared bit for bit everywhere: no bound.
        fields = {f for f in row.state_fields(cfg) if not isinstance(getattr(init, f), np.floating)} | {"param"}
        assert fields <= set(bounds), f"{name}: bounds missing for {sorted(fields - set(bounds))}"
        entry, why = audit_optimizers.lookup(case.torch_class)
        assert entry is not None and entry.spec is row, f"{name}: the audit does not find it ({why})"
        assert fields <= set(entry.ulp) and all(entry.bound(f) == bounds[f] for f in fields), \
            f"{name}: the audit's bounds {dict(entry.ulp)} are not the conformance suite's {dict(bounds)}"
        assert name in torch_rows, f"{name}: no torchimpl row (torchimpl/train/optim.py REGISTRY)"
        assert row.magnitudes is not None, f"{name}: no magnitudes (x_abs) for the native-kernel bounds"
    for row in ti_optim.REGISTRY.values():
        spec_row = optim.spec(row.cls.__name__)
        assert set(row.settings) <= set(spec_row.hyperparameters()), \
            f"{row.name}: settings {sorted(set(row.settings) - set(spec_row.hyperparameters()))} are not the spec's"
        # The bridge builds the spec's configuration from the trainer's for every row.
        cfg = spec_bridge.optimizer_config(ti_optim.OptimizerConfig(name=row.name))
        assert optim.spec_for(cfg).config_type is spec_row.config_type


def test_every_spec_row_is_covered_by_every_consumer():
    _assert_every_consumer_covers_every_row()


# --- a toy optimizer, in the four places -------------------------------------------------------

# Place one: the spec module, as a contributor writes it in reference/optim/ (here in a temporary
# folder put on the package's path): its rule, state, hyperparameters and its one row.
SPEC_MODULE = '''"""SignSGD: 1. ``p = f(p + f(f(-lr) * sign(g)))``; ``step += 1``."""
from dataclasses import dataclass

import numpy as np

from reference.optim._common import check_inputs, for_each_param
from reference.optim._registry import OptimizerSpec, register


@dataclass(frozen=True)
class SignSGDConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0


@dataclass(frozen=True)
class SignSGDState:
    step: np.float32


def sign_sgd(params, grads, state, config, *, lr=None, **_):
    arrays = check_inputs(params, grads, state, config, SignSGDConfig, SignSGDState)
    rate = config.lr if lr is None else float(lr)

    def update(p, g, s):
        return p + p.dtype.type(-rate) * np.sign(g), SignSGDState(np.float32(s.step + 1)), g

    return for_each_param(arrays, grads, state, update)


def sign_sgd_magnitudes(config, p, g, old, new):
    return {"param": np.abs(np.asarray(p, np.float64)) + config.lr}


# Native kernels: one multiply and one add, k = 2 roundings: 2k = 4 ULPs of x_abs.
register(OptimizerSpec("SignSGD", SignSGDConfig, SignSGDConfig, lambda p, cfg: SignSGDState(np.float32(0)),
                       {"for-loop": sign_sgd}, magnitudes=sign_sgd_magnitudes, native_ulp={"param": 4},
                       elementwise=True))
'''


class SignSGD(torch.optim.Optimizer):
    """The toy's torch side: ``p -= lr * sign(g)``."""

    def __init__(self, params, lr=1e-3, weight_decay=0.0, foreach=None):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, foreach=foreach))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["step"] = self.state[p].get("step", torch.tensor(0.0)) + 1
                    p.add_(p.grad.sign(), alpha=-group["lr"])


# Place four: its row in docs/spec.md's table (added to the page's text here).
DOCS_ROW = "| SignSGD (`signsgd`) | for-loop | every field | param 4 | 0 | none |\n"


@pytest.fixture
def toy(monkeypatch, tmp_path):
    monkeypatch.setattr(optim._registry, "SPECS", dict(optim.SPECS))
    monkeypatch.setattr(optim, "SPECS", optim._registry.SPECS)
    monkeypatch.setattr(ti_optim, "REGISTRY", dict(ti_optim.REGISTRY))
    monkeypatch.setattr(config_sections, "OPTIMIZER_ROWS", dict(config_sections.OPTIMIZER_ROWS))
    monkeypatch.setattr(strategies, "OPTIMIZER_CASES", dict(strategies.OPTIMIZER_CASES))
    # The toy stands for a new torch.optim class: the audit finds those by name in torch.optim,
    # with no registration of its own (its rows are reset to be read again from the spec's).
    monkeypatch.setattr(torch.optim, "SignSGD", SignSGD, raising=False)
    monkeypatch.setattr(audit_optimizers, "_ROWS", {})
    # Place one: the spec module, found and imported by the package as any of its modules.
    (tmp_path / "signsgd_toy.py").write_text(SPEC_MODULE)
    monkeypatch.setattr(optim, "__path__", [*optim.__path__, str(tmp_path)])
    optim.import_optimizer_modules()
    module = sys.modules["reference.optim.signsgd_toy"]
    # Place two: the torchimpl row.
    ti_optim.register(ti_optim.TorchOptimizer("signsgd", SignSGD))
    # Place three: the conformance strategy entry.
    strategies.optimizer_case("SignSGD", strategies.OptimizerCase(
        SignSGD, lambda: st.fixed_dictionaries({"lr": st.floats(1e-4, 1.0)})))
    yield module
    sys.modules.pop("reference.optim.signsgd_toy", None)


def test_without_its_docs_row_a_new_optimizer_is_refused(toy):
    with pytest.raises(AssertionError, match="SignSGD: no row in docs/spec.md's table"):
        _assert_every_consumer_covers_every_row()


def test_a_toy_optimizer_added_in_four_places_reaches_every_consumer(toy):
    row = optim.spec("SignSGD")
    SignSGDConfig, sign_sgd, _magnitudes = toy.SignSGDConfig, toy.sign_sgd, toy.sign_sgd_magnitudes
    SignSGDState = toy.SignSGDState
    # Every consumer covers it, the audit with the spec row's bounds, and nothing else was needed.
    _assert_every_consumer_covers_every_row((_ROOT / "docs" / "spec.md").read_text() + DOCS_ROW)
    assert audit_optimizers.lookup(SignSGD)[0].ulp == {"param": 4}
    assert audit_optimizers.optimizer_ref(type("Track", (), {"obj": SignSGD([torch.zeros(1)]), "label": "o"})
                                          ).entry.spec.elementwise
    assert row.hyperparameters() == {"lr": 1e-3, "weight_decay": 0.0}
    # The trainer's configuration accepts its name, builds torch's class and bridges to the spec.
    config = Config.from_dict({"optimizer": {"name": "signsgd", "lr": 0.1, "weight_decay": 0.0}})
    built = ti_optim.build_optimizer(torch.nn.Linear(2, 2), config.optimizer, "cpu")
    assert type(built.optimizer) is SignSGD and built.kind == "for-loop"
    step_config = spec_bridge.step_config(config, scaler_policy=None, optimizer_kind="for-loop", sync_free=False,
                                          param_ndims=[2, 1])
    assert step_config.optimizer == SignSGDConfig(lr=0.1, weight_decay=0.0)
    assert step_config.param_groups[1].config_for(step_config.optimizer).weight_decay == 0.0
    # The spec's training step runs it, skipping on an overflow as for any optimizer.
    state = ref_step.init_train_state([np.ones((2, 2), np.float32), np.ones(2, np.float32)], step_config)
    grads = [np.full((2, 2), 0.5, np.float32), np.array([-1.0, 0.0], np.float32)]
    result = ref_step.train_step(state, grads, step_config)
    expected = np.float32(1) + np.float32(-0.1) * np.sign(grads[1])
    assert result.record.applied and np.array_equal(result.state.params[1], expected)
    # The conformance property compares it with torch step by step.
    trajectory = {"params": [np.ones(3, np.float32)], "grads": [[np.array([1.0, -2.0, 0.0], np.float32)]] * 2}
    run_optimizer_case("SignSGD", "for-loop", {"lr": 0.25}, trajectory, 1024.0, "cpu")
    # A wrong spec fails that property: the consumers are really using the row.
    optim._registry.SPECS["SignSGD"] = optim.OptimizerSpec(
        "SignSGD", SignSGDConfig, SignSGDConfig, lambda p, cfg: SignSGDState(np.float32(0)),
        {"for-loop": lambda *a, **k: (lambda p, g, s: ([x * 2 for x in p], g, s))(*sign_sgd(*a, **k))},
        magnitudes=_magnitudes, native_ulp={"param": 4})
    with pytest.raises(AssertionError, match="params"):
        run_optimizer_case("SignSGD", "for-loop", {"lr": 0.25}, trajectory, None, "cpu")


def test_each_built_in_optimizer_is_declared_once_in_the_configurations_row():
    """One row per fact: a built-in optimizer's settings, check, torch class, fused devices and
    sync-free refusal are its ``config.sections`` row; the torch registry's row is that row
    resolved (the class looked up in ``torch.optim``), with nothing of its own."""
    sections = config_sections
    built_in = [r for r in sections.OPTIMIZER_ROWS.values() if isinstance(r, sections.OptimizerRow)]
    assert not built_in, "every configuration row is resolved once torchimpl.train.optim is imported"
    declared = {
        "adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop",
        "adamax": "Adamax", "adadelta": "Adadelta", "nadam": "NAdam", "radam": "RAdam", "adafactor": "Adafactor",
    }
    for name, cls_name in declared.items():
        row = ti_optim.REGISTRY[name]
        assert row.cls is getattr(torch.optim, cls_name), name
        assert sections.OPTIMIZER_ROWS[name] is row, f"{name}: the configuration reads the resolved row"
    source = Path(ti_optim.__file__).read_text()
    for cls_name in declared.values():
        assert f"torch.optim.{cls_name}," not in source, f"train/optim.py names torch.optim.{cls_name} itself"


@pytest.mark.parametrize("name", sorted(optim.SPECS))
def test_state_from_fills_every_field_torch_did_not_give_from_the_initial_state(name):
    """``state_from``: each field the mapping gives is its value (a scalar field read as a float32
    scalar); each one it lacks is ``init_state``'s, of the parameter's shape. Guards the
    element-wise rows' shortcut (no parameter-sized initial arrays when every field is given):
    taking it with a field missing leaves that field empty."""
    row = optim.SPECS[name]
    cfg = row.make_config(**({"momentum": 0.9} if name == "SGD" else {}))
    p = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
    init = row.init_state(p, cfg)
    fields = [f.name for f in dataclasses.fields(init) if getattr(init, f.name) is not None]
    given = {n: (np.float32(3.0) if isinstance(getattr(init, n), np.floating) else np.full_like(p, 0.25))
             for n in fields}
    for mapping in [given] + [{k: v for k, v in given.items() if k != left_out} for left_out in fields]:
        state = row.state_from(mapping, p, cfg)
        for n in fields:
            want = mapping.get(n, getattr(init, n))
            got = getattr(state, n)
            assert type(got) is type(want) and np.shape(got) == np.shape(want) and np.array_equal(got, want), (
                f"{name}: field {n} with {sorted(mapping)} given: got {got!r}, want {want!r}")
