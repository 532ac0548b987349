"""ampspec doctor: the catalogue of sick models gives exactly its verdicts, healthy models none;
the user's model is never changed; the fix (precision.fp32_modules) removes the verdict; the CLI."""

from __future__ import annotations

import copy
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from torchimpl import inspect_precision
from torchimpl.config.schema import TaskConfig
from torchimpl.doctor.verdicts import KINDS
from torchimpl.precision.fp8 import torchao_available
from torchimpl.task.builtin import build_task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doctor_models.models import CATALOGUE, forward_overflow  # noqa: E402

TESTS = Path(__file__).resolve().parent


def _doctor(name: str, steps: int | None = None, **extra):
    case = CATALOGUE[name]
    model, train, _ = case.make()
    return inspect_precision(model, train, precision=case.precision, steps=steps or case.steps,
                             **{**case.options, **extra})


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_each_catalogue_model_gives_exactly_its_verdicts(name):
    case = CATALOGUE[name]
    if case.needs_torchao and not torchao_available():
        pytest.skip("float8 models need torchao: pip install 'ampspec[fp8]'")
    report = _doctor(name)
    got = tuple((v.kind, v.module) for v in report.verdicts)
    assert got == case.expected, f"{name}: {got} != {case.expected}\n{report.text()}"
    assert report.healthy == (not case.expected)
    for v in report.verdicts:
        assert v.kind in KINDS and v.severity in ("error", "warning") and v.fix and v.message


@pytest.mark.parametrize("task,precision", [("mlp", "bf16"), ("mlp", "fp16"), ("lm", "fp16")])
def test_the_embedded_tasks_are_healthy(task, precision):
    t = build_task(TaskConfig(name=task, size="tiny"), seed=0, batch_size=8)
    report = inspect_precision(t.model, t.train_data, precision=precision, steps=3)
    assert report.verdicts == [], report.text()
    assert "no verdict: healthy" in report.text()
    assert all(s.sqnr_db > 30 for s in report.layers if s.dtype != "float32"), report.text()


def test_the_forward_overflow_fix_removes_the_verdict():
    before = _doctor("forward_overflow")
    [v] = before.verdicts
    assert v.kind == "forward-overflow" and "precision.fp32_modules: ['fc2']" in v.fix
    assert v.numbers["batches"] == 3 and v.numbers["amax"] > 65504
    after = _doctor("forward_overflow", fp32_modules=["fc2"])
    assert after.verdicts == [], after.text()
    fc2 = next(s for s in after.layers if s.name == "fc2")
    assert fc2.dtype == "float32"


def test_the_users_model_gradients_and_generators_are_left_as_they_were():
    model, train, _ = forward_overflow()
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    model.eval()
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    inspect_precision(model, train, precision="fp16", steps=2)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model.fc1.weight.grad, torch.ones_like(model.fc1.weight)) and model.fc2.weight.grad is None
    assert not model.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.fc2._forward_hooks and not model.fc2._forward_pre_hooks


class _Noise(nn.Module):
    """Multiplies by a draw from each of Python's, NumPy's and torch's generators, in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * (1 + random.random() + float(np.random.rand()) + float(torch.rand(())))


class _NoisyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.noise = _Noise()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.noise(self.fc(x)), y)


def test_mixed_and_shadow_draw_the_same_numbers_and_the_generators_are_left_as_they_were():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.zeros(16, 8)) for _ in range(3)]
    model = _NoisyNet()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    report = inspect_precision(model, batches, precision="bf16", steps=3)
    after = random.getstate(), np.random.get_state(), torch.get_rng_state()
    assert after[0] == states[0] and all(np.array_equal(a, b) for a, b in zip(after[1], states[1]))
    assert torch.equal(after[2], states[2])
    layers = {s.name: s for s in report.layers}
    # one draw apart, the float32 noise layer would be 0 to 10 dB; the same draws: fc's bf16 SQNR
    assert abs(layers["noise"].sqnr_db - layers["fc"].sqnr_db) < 1.0, report.text()


class _BatchNormNet(nn.Module):
    """Persistent buffers that the forward changes (BatchNorm's running statistics), a buffer
    that ``state_dict`` leaves out (counting 1 a forward under autocast, 2 in float32: the
    shadow's stays its own), and (``hooked``) a ``state_dict`` hook."""

    def __init__(self, hooked: bool) -> None:
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)
        self.register_buffer("calls", torch.zeros(()), persistent=False)
        if hooked:
            self.register_state_dict_post_hook(lambda module, state, prefix, meta: None)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1 if torch.is_autocast_enabled(x.device.type) else 2
        return F.mse_loss(self.head(torch.relu(self.bn(self.fc(x)))).float(), y)


def _batch_norm_net(hooked: bool) -> tuple:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    return _BatchNormNet(hooked), [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g))
                                   for _ in range(3)], None


@pytest.mark.parametrize("make,walk", [(forward_overflow, "tables"), (lambda: _batch_norm_net(False), "tables"),
                                       (lambda: _batch_norm_net(True), "state_dict")])
def test_the_shadow_starts_each_step_from_the_mixed_weights(make, walk):
    from torchimpl.doctor.inspect import _default_loss, _default_optimizer, _Runner

    model, train, _ = make()
    runner = _Runner(model, "bf16", torch.device("cpu"), _default_loss, _default_optimizer, 1.0, (), "tensorwise", 0.999)
    assert (runner._state_modules is None) == (walk == "state_dict")
    for i, batch in enumerate(train[:3]):
        runner.step(i, batch)
        runner._align()
        mixed, shadow = runner.mixed.state_dict(), runner.shadow.state_dict()
        assert mixed.keys() == shadow.keys()
        assert all(torch.equal(shadow[k], v.float() if v.is_floating_point() else v) for k, v in mixed.items()), \
            f"step {i}: the shadow drifted"
        states = [(runner.opt.state[p], runner.shadow_opt.state[q])
                  for p, q in zip(runner.mixed.parameters(), runner.shadow.parameters())]
        assert states and all(mine.keys() == theirs.keys() and all(
            torch.equal(theirs[k], v) and theirs[k] is not v for k, v in mine.items()) for mine, theirs in states), \
            f"step {i}: the shadow's optimizer state is not the mixed one's"
        if isinstance(model, _BatchNormNet):  # a buffer outside state_dict is not aligned
            assert float(runner.mixed.calls) == i + 1 and float(runner.shadow.calls) == 2 * (i + 1)
    first = "fc1" if hasattr(model, "fc1") else "fc"
    assert not torch.equal(runner.mixed.get_submodule(first).weight, model.get_submodule(first).weight)  # it trained


@pytest.mark.parametrize("scale", [1.0, 2.0**10])
def test_the_mixed_step_takes_the_unscaled_gradients(scale):
    """fp16 with SGD (Adam is all but blind to a gradient's scale): the mixed model's first update
    is the shadow's to within float16's error of the gradients, not ``scale`` times it."""
    from torchimpl.doctor.inspect import _default_loss, _Runner

    model, train, _ = CATALOGUE["small_mlp"].make()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    runner = _Runner(model, "fp16", torch.device("cpu"), _default_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
                     scale, (), "tensorwise", 0.999)
    runner.step(0, train[0])
    assert runner.obs.skipped == []
    mixed, shadow = dict(runner.mixed.named_parameters()), dict(runner.shadow.named_parameters())
    for n, w in start.items():
        ratio = float((mixed[n].detach() - w).norm() / (shadow[n].detach() - w).norm())
        assert 0.9 < ratio < 1.1, f"{n}: the mixed update is {ratio:.3g} times the shadow's"


def test_the_json_report_is_the_contract():
    report = _doctor("forward_overflow")
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert set(data) >= {"precision", "device", "steps", "healthy", "verdicts", "layers", "parameters", "notes"}
    [v] = data["verdicts"]
    assert set(v) == {"kind", "module", "severity", "message", "fix", "numbers"}
    assert (v["kind"], v["module"], v["severity"]) == ("forward-overflow", "fc2", "error")
    layer = next(x for x in data["layers"] if x["layer"] == "fc2")
    assert layer["dtype"] == "float16" and layer["headroom_bits"] < 0 and layer["overflow_steps"] == 3
    text = report.text()
    assert text.index("forward-overflow") < text.index("headroom bits")  # verdicts first


def test_a_cpu_run_names_the_ops_cuda_autocast_runs_in_float32():
    report = _doctor("fp16_normalization")
    note = next(n for n in report.notes if "CUDA autocast runs in float32" in n)
    assert "pow (in norm)" in note


def test_gradient_underflow_recommends_a_scale_that_cures_it():
    # One step: the same weights and batch at both scales (over more steps the cured run trains
    # differently, Adam taking full steps from gradients that no longer flush).
    [v] = _doctor("gradient_underflow", steps=1).verdicts
    low, high = v.numbers["scale_range_log2"]
    assert low is not None and high is not None and low <= high and f"2^{low}" in v.fix
    assert _doctor("gradient_underflow", steps=1, init_scale=2.0**low).verdicts == []
    assert _doctor("gradient_underflow", steps=1, init_scale=2.0**(low - 1)).verdicts != []


@pytest.mark.parametrize("kwargs,match", [
    ({"precision": "fp64"}, "precision must be one of"),
    ({"steps": 0}, "steps must be a positive integer"),
    ({"init_scale": math.inf}, "init_scale"),
    ({"fp32_modules": ["nope*"]}, "'nope\\*' matches no module"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, match):
    model, train, _ = forward_overflow()
    with pytest.raises(ValueError, match=match):
        inspect_precision(model, train, **{"precision": "fp16", "steps": 1, **kwargs})


def test_no_batches_is_refused():
    model, _, _ = forward_overflow()
    with pytest.raises(ValueError, match="batches yielded nothing"):
        inspect_precision(model, [], precision="bf16", steps=1)


# ---------------------------------------------------------------- the command


def _cli(args, monkeypatch, capsys):
    from torchimpl.cli.app import main

    monkeypatch.syspath_prepend(str(TESTS))
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_doctor_task_prints_verdicts_first_and_writes_the_report(tmp_path, monkeypatch, capsys):
    report = tmp_path / "doctor.json"
    code, out, _ = _cli(["doctor", "--task", "doctor_models.models:forward_overflow", "--precision", "fp16",
                         "--steps", "8", "--init-scale", "256", "--report", str(report)], monkeypatch, capsys)
    assert code == 1  # an error verdict
    assert out.index("[error] forward-overflow in fc2") < out.index("headroom bits")
    data = json.loads(report.read_text())
    assert [(v["kind"], v["module"]) for v in data["reports"][0]["verdicts"]] == [("forward-overflow", "fc2")]
    code, out, _ = _cli(["doctor", "--task", "doctor_models.models:forward_overflow", "--precision", "fp16",
                         "--steps", "8", "--init-scale", "256", "--fp32-module", "fc2"], monkeypatch, capsys)
    assert code == 0 and "no verdict: healthy" in out


def test_cli_doctor_without_task_prints_the_environment(monkeypatch, capsys):
    code, out, _ = _cli(["doctor"], monkeypatch, capsys)
    assert code == 0 and out.startswith("torch ") and "precision on cpu" in out


def test_cli_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code, _, err = _cli(["doctor", "--task", "mlp", "--steps", "1", "--plot", str(tmp_path / "d.png")],
                        monkeypatch, capsys)
    assert code == 2 and "pip install 'ampspec[plot]'" in err
    assert not (tmp_path / "d.png").exists()


def test_cli_plot_draws_the_picture(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="the picture needs the plot extra: pip install 'ampspec[plot]'")
    png = tmp_path / "d.png"
    code, out, _ = _cli(["doctor", "--task", "mlp", "--size", "tiny", "--precision", "bf16", "--steps", "1",
                         "--plot", str(png)], monkeypatch, capsys)
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the fix and the statistics in training


def _tiny_config(tmp_path, *sets):
    from torchimpl.config.schema import load_config

    c = load_config(overrides=["device=cpu", "task.name=mlp", "task.size=tiny", "train.batch_size=4",
                               "train.steps=3", "precision.mode=bf16", f"checkpoint.folder={tmp_path / 'ck'}", *sets])
    return c, build_task(c.task, seed=c.train.seed, batch_size=c.train.batch_size)


def test_fp32_modules_run_in_float32_in_training_and_show_in_the_summary(tmp_path):
    from torchimpl import Callback, Trainer

    seen = {}

    def watch(name):
        def hook(module, args, out):
            seen.setdefault(name, (out.dtype, torch.is_autocast_enabled("cpu")))

        return hook

    class Watch(Callback):
        def on_fit_start(self, trainer):
            for name in ("net.2", "net.3"):
                trainer.model.get_submodule(name).register_forward_hook(watch(name))

    c, task = _tiny_config(tmp_path, "precision.fp32_modules=[net.2]")
    summary = Trainer(c, callbacks=[Watch()]).fit(task.model, task.train_data)
    assert summary.fp32_modules == ["net.2"] and summary.to_dict()["fp32_modules"] == ["net.2"]
    assert seen["net.2"][0] == torch.float32  # the island: an fp32 output
    assert seen["net.3"] == (torch.bfloat16, True)  # and autocast is back on after it


def test_a_resume_that_changes_fp32_modules_is_refused(tmp_path):
    from torchimpl import ResumeError, Trainer

    c, task = _tiny_config(tmp_path, "precision.fp32_modules=[net.2]")
    Trainer(c).fit(task.model, task.train_data)
    c2, task2 = _tiny_config(tmp_path, "train.steps=5")
    with pytest.raises(ResumeError, match=r"precision.fp32_modules: \['net.2'\] \(checkpoint\) -> \[\] \(now\)"):
        Trainer(c2).fit(task2.model, task2.train_data, resume="latest")


def test_a_pattern_matching_no_module_is_refused_before_training(tmp_path):
    from torchimpl import Trainer

    c, task = _tiny_config(tmp_path, "precision.fp32_modules=[fc9]")
    with pytest.raises(ValueError, match="precision.fp32_modules: 'fc9' matches no module"):
        Trainer(c).fit(task.model, task.train_data)
    assert not list((tmp_path / "ck").glob("*.ckpt"))


def test_precision_stats_are_logged_every_n_steps(tmp_path):
    import csv

    from torchimpl import Trainer
    from torchimpl.train.precision_stats import COLUMNS, FILE_NAME

    c, task = _tiny_config(tmp_path, "train.steps=5", "logging.precision_stats=2")
    Trainer(c).fit(task.model, task.train_data)
    rows = list(csv.DictReader(open(tmp_path / "ck" / FILE_NAME)))
    assert tuple(rows[0]) == COLUMNS
    assert sorted({int(r["step"]) for r in rows}) == [0, 2, 4]
    net0 = [r for r in rows if r["module"] == "net.0"]
    assert [r["dtype"] for r in net0] == ["bfloat16"] * 3
    assert all(float(r["amax"]) > 0 and float(r["headroom_bits"]) > 100 for r in net0)


def test_precision_stats_are_off_by_default(tmp_path):
    from torchimpl import Trainer
    from torchimpl.config.schema import LoggingConfig
    from torchimpl.train.precision_stats import FILE_NAME

    assert LoggingConfig().precision_stats == 0
    c, task = _tiny_config(tmp_path)
    Trainer(c).fit(task.model, task.train_data)
    assert not (tmp_path / "ck" / FILE_NAME).exists()


def test_fp8_without_torchao_is_refused_or_left_out_with_a_note(monkeypatch, capsys):
    import torchimpl.precision.fp8

    monkeypatch.setattr(torchimpl.precision.fp8, "torchao_available", lambda: False)
    code, _, err = _cli(["doctor", "--task", "mlp", "--precision", "fp8", "--steps", "1"], monkeypatch, capsys)
    assert code == 2 and "pip install 'ampspec[fp8]'" in err
    code, out, _ = _cli(["doctor", "--task", "mlp", "--size", "tiny", "--steps", "1"], monkeypatch, capsys)
    assert code == 0 and "fp8 left out: torchao is not installed" in out
    assert "precision bf16" in out and "precision fp16" in out and "precision fp8" not in out


def test_verdicts_are_a_fixed_vocabulary_ranked_by_harm():
    from torchimpl.doctor.verdicts import Verdict, rank

    with pytest.raises(ValueError, match="unknown verdict kind 'overflow'"):
        Verdict("overflow", None, "m", "f")
    vs = [Verdict("loss-in-low-precision", None, "m", "f"), Verdict("forward-overflow", "b", "m", "f"),
          Verdict("forward-overflow", "a", "m", "f"), Verdict("not-precision", None, "m", "f")]
    assert [(v.kind, v.module) for v in rank(vs)] == [("not-precision", None), ("forward-overflow", "a"),
                                                      ("forward-overflow", "b"), ("loss-in-low-precision", None)]


@pytest.mark.parametrize("foreach", [True, False])
def test_copy_all_copies_each_pair_with_or_without_torchs_foreach_copy(foreach, monkeypatch):
    from torchimpl.doctor import shadow

    if not foreach:
        monkeypatch.setattr(shadow, "_foreach_copy_", None)
    src = [torch.randn(3, 4).to(torch.bfloat16), torch.tensor(5.0), torch.randn(2)]
    dst = [torch.zeros(3, 4), torch.zeros(()), torch.zeros(2, dtype=torch.float64)]
    kept = list(dst)
    shadow.copy_all(dst, src)
    assert all(d is k for d, k in zip(dst, kept))
    assert all(torch.equal(d, s.to(d.dtype)) for d, s in zip(dst, src))


def test_a_snapshot_holds_the_values_at_each_take_in_buffers_made_once():
    from torchimpl.doctor.shadow import Snapshot

    snap = Snapshot()
    ts = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.randn(4, 3).t()]
    first = snap.take(ts)
    want = [t.clone() for t in ts]
    for t in ts:
        t.add_(1)
    assert all(torch.equal(c, w) and c.stride() == t.stride() for c, w, t in zip(first, want, ts))
    second = snap.take(ts)
    assert all(a is b for a, b in zip(first, second)) and all(torch.equal(c, t) for c, t in zip(second, ts))
    grown = snap.take([*ts, torch.ones(2)])
    assert len(grown) == 4 and all(torch.equal(c, t) for c, t in zip(grown, [*ts, torch.ones(2)]))
