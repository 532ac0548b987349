"""precision.mode fp8: resolution, the module filter, training, resume, compare, and the errors.

Tests that run torchao skip with the reason when it is not installed (CI installs ``.[test]``
only); the resolution rules and the errors without torchao run everywhere.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import torchimpl.precision.fp8 as tfp8
from torchimpl.config.schema import ConfigError, load_config
from torchimpl.precision.plan import PrecisionConfig, PrecisionDowngradeWarning, resolve_precision
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Callback, Trainer

needs_torchao = pytest.mark.skipif(not tfp8.torchao_available(),
                                   reason="torchao is not installed: pip install '.[fp8]' (torchao==0.18.0)")
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")


def fp8_cfg(*sets: str, recipe: str = "tensorwise"):
    base = ["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=4", "train.log_interval=2",
            "precision.mode=fp8", f"precision.fp8_recipe={recipe}", "train.batch_size=32"]
    return load_config(overrides=base + list(sets))


def _fit(cfg, callbacks=(), resume=None):
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    trainer = Trainer(cfg, callbacks)
    summary = trainer.fit(task.model, task.train_data, task.val_data, loss_fn=task.loss_fn, resume=resume)
    return trainer, summary


# ----------------------------------------------------------------------------- resolution


@needs_torchao
def test_cpu_fp8_plan_is_bf16_autocast_without_a_scaler_and_says_it_is_emulated():
    plan = resolve_precision(PrecisionConfig(mode="fp8", fp8_recipe="rowwise"), "cpu")
    assert (plan.mode, plan.dtype, plan.use_scaler, plan.autocast_enabled, plan.reason) == (
        "fp8", torch.bfloat16, False, True, None)
    assert plan.fp8_recipe == "rowwise" and plan.is_mixed_precision
    assert "emulation" in plan.note and "not a speed-up" in plan.note


def test_fp8_without_torchao_is_refused_before_any_work(monkeypatch):
    monkeypatch.setattr(tfp8, "torchao_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs torchao.*pip install 'ampspec\[fp8\]' \(torchao==0.18.0\)"):
        resolve_precision(PrecisionConfig(mode="fp8"), "cpu")
    model = nn.Linear(16, 16)
    before = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="needs torchao"):
        Trainer(fp8_cfg()).fit(model, [(torch.ones(2, 16), torch.ones(2, 16))])
    assert torch.equal(model.weight, before) and model.weight.device.type == "cpu"


def test_bad_fp8_fields_name_themselves():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["precision.fp8_recipe=delayed", "precision.fp8_skip_first_last=3"])
    text = str(info.value)
    assert "precision.fp8_recipe: must be one of tensorwise, rowwise, rowwise_with_gw_hp, mxfp8, got 'delayed'" in text
    assert "precision.fp8_skip_first_last" in text


@needs_torchao
@pytest.mark.parametrize("capability, recipe, mode, fragment", [
    ((8, 0), "tensorwise", "bf16", "capability 8.9 or newer"),
    ((9, 0), "rowwise", "fp8", "native torch._scaled_mm"),
    ((9, 0), "mxfp8", "fp8", "emulated"),
    ((10, 0), "mxfp8", "fp8", "native MX"),
])
def test_cuda_fp8_by_compute_capability(monkeypatch, capability, recipe, mode, fragment):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr("torchimpl.precision.plan.cuda_bf16_supported", lambda: True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plan = resolve_precision(PrecisionConfig(mode="fp8", fp8_recipe=recipe), "cuda")
    assert plan.mode == mode
    assert fragment in (plan.note or plan.reason)
    downgrades = [w for w in seen if issubclass(w.category, PrecisionDowngradeWarning)]
    assert len(downgrades) == (mode != "fp8")


@needs_torchao
def test_fp8_on_mps_downgrades_to_fp32_with_a_warning():
    with pytest.warns(PrecisionDowngradeWarning, match="not supported on mps"):
        plan = resolve_precision(PrecisionConfig(mode="fp8"), "mps")
    assert plan.mode == "fp32" and plan.reason


# ----------------------------------------------------------------------------- the filter


@needs_torchao
def test_the_filter_on_the_embedded_transformer():
    task = build_task(load_config(overrides=["task.name=lm"]).task, seed=0, batch_size=4)
    model, report = tfp8.convert_to_fp8(task.model, "tensorwise", "cpu")
    assert report.converted == ("blocks.layers.0.linear2", "blocks.layers.1.linear1", "blocks.layers.1.linear2")
    kept = dict(report.kept)
    assert "forward never runs" in kept["blocks.layers.0.self_attn.out_proj"]
    assert "first linear layer" in kept["blocks.layers.0.linear1"]
    assert "64x11" in kept["head"] and "multiples of 16" in kept["head"]
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(model.blocks.layers[1].linear1, Float8Linear)
    assert type(model.blocks.layers[0].self_attn.out_proj) is not Float8Linear
    assert type(model.blocks.layers[0].linear1) is nn.Linear
    _, all_layers = tfp8.convert_to_fp8(build_task(load_config(overrides=["task.name=lm"]).task, seed=0,
                                                   batch_size=4).model, "tensorwise", "cpu", skip_first_last=False)
    assert "blocks.layers.0.linear1" in all_layers.converted


@needs_torchao
def test_mx_needs_multiples_of_32():
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 1))
    _, report = tfp8.convert_to_fp8(model, "mxfp8", "cpu")
    assert report.converted == ("2", "3")
    assert "multiples of 32" in dict(report.kept)["1"]


@needs_torchao
def test_a_model_without_an_eligible_layer_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"no linear layer to run in float8 .*10x3.*multiples of 16.*fp8_skip_first_last"):
        tfp8.convert_to_fp8(nn.Sequential(nn.Linear(10, 3), nn.ReLU(), nn.Linear(3, 1)), "tensorwise", "cpu")
    with pytest.raises(ValueError, match="first linear layer"):
        tfp8.convert_to_fp8(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), "rowwise", "cpu")
    with pytest.raises(ValueError, match="no nn.Linear layer"):
        tfp8.convert_to_fp8(nn.Sequential(nn.Conv1d(1, 1, 3)), "tensorwise", "cpu")


@needs_torchao
def test_conversion_keeps_the_parameters_and_their_names():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8))
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    converted, _ = tfp8.convert_to_fp8(model, "tensorwise", "cpu")
    assert list(converted.state_dict()) == keys
    assert all(p is params[n] for n, p in converted.named_parameters())


@needs_torchao
def test_under_cpu_autocast_float8_layers_quantize_the_bf16_input_as_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    model, _ = tfp8.convert_to_fp8(model, "rowwise_with_gw_hp", "cpu")
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model[1](x)
    y.float().sum().backward()  # raises without the hook: bf16 grad_output against a float32 input
    assert y.dtype == torch.bfloat16
    direct = model[1](x.to(torch.bfloat16))  # what torchao computes under CUDA autocast
    assert torch.equal(y, direct)


# ----------------------------------------------------------------------------- training


@needs_torchao
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_trains_on_cpu_without_a_scaler(recipe):
    trainer, summary = _fit(fp8_cfg(recipe=recipe))
    assert summary.precision_mode == "fp8" and summary.autocast_dtype == "bfloat16"
    assert not summary.use_scaler and summary.steps_applied == 4
    assert summary.fp8["recipe"] == recipe and summary.fp8["converted"] == ["net.3"]
    assert "emulation" in summary.fp8["kernel"]
    assert set(summary.fp8["kept"]) == {"net.0", "net.5"}
    layer = trainer.model.net[3]
    assert type(layer) is not nn.Linear
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert summary.final_train_loss is not None and summary.final_train_loss == summary.final_train_loss
    bf16, _ = _fit(fp8_cfg("precision.mode=bf16"))
    assert not torch.equal(bf16.model.net[3].weight, layer.weight)  # float8 changed the numbers


class StopAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, state):
        if state.step == self.step:
            trainer.save_checkpoint()
            trainer.request_stop("test")


@needs_torchao
@pytest.mark.parametrize("recipe", RECIPES)
def test_resume_with_converted_modules_is_bit_for_bit(tmp_path, recipe):
    sets = [f"checkpoint.folder={tmp_path / 'ckpt'}", "train.steps=6"]
    straight, _ = _fit(fp8_cfg("train.steps=6", recipe=recipe))
    first, s1 = _fit(fp8_cfg(*sets, recipe=recipe), callbacks=[StopAt(3)])
    assert s1.stopped == "test" and s1.steps == 3
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".ckpt"] == ["step-00000003.ckpt"]
    resumed, s2 = _fit(fp8_cfg(*sets, recipe=recipe), resume="latest")
    assert s2.steps == 6
    # Not trivially equal: the stopped run's weights are three steps behind.
    assert any(not torch.equal(a, b) for a, b in zip(first.model.state_dict().values(),
                                                      straight.model.state_dict().values()))
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), f"{recipe}: {name} differs after resume"
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for k in sa:
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[k][field], sb[k][field])


@needs_torchao
def test_compare_has_an_fp8_row(tmp_path):
    from torchimpl.cli.compare import run_compare

    res = run_compare(steps=3, device="cpu", out=tmp_path, task="mlp", window=2)
    rows = {r["precision"]: r for r in res.rows}
    assert set(rows) == {"fp32", "bf16", "bf16+scaler", "fp8"} and rows["fp8"]["plan"] == "fp8"


def test_compare_leaves_fp8_out_without_torchao(tmp_path, monkeypatch):
    from torchimpl.cli.compare import run_compare

    monkeypatch.setattr(tfp8, "torchao_available", lambda: False)
    res = run_compare(steps=2, device="cpu", out=tmp_path, task="mlp", window=2)
    assert [r["precision"] for r in res.rows] == ["fp32", "bf16", "bf16+scaler"]


@needs_torchao
def test_a_root_linear_is_replaced_and_the_trainer_keeps_torchaos_module():
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    data = [(torch.randn(8, 32), torch.randn(8, 32)) for _ in range(4)]
    trainer = Trainer(fp8_cfg("precision.fp8_skip_first_last=false", "train.steps=2"))
    summary = trainer.fit(model, data, loss_fn=lambda m, b: ((m(b[0]).float() - b[1]) ** 2).mean())
    assert type(trainer.model).__name__ == "Float8Linear" and summary.fp8["converted"] == [""]
    assert trainer.model.weight is model.weight  # the same parameter, trained


# ----------------------------------------------------------------------------- refused up front

TORCH_2_11_CPU_REFUSAL = ("(scale_a.numel() == 1 && scale_b.numel() == 1) INTERNAL ASSERT FAILED at "
                          "\"aten/src/ATen/native/Blas.cpp\":249, please report a bug to PyTorch. "
                          "Now _scaled_mm only supports per-tensor scaling for CPU backend")


def _torch_2_11_scaled_mm(monkeypatch):
    """torch 2.11's CPU torch._scaled_mm, as conformance/expectations.py records it: rowwise
    (more than one element) scales are refused, per-tensor ones computed."""
    real = torch._scaled_mm

    def scaled_mm(a, b, *args, scale_a=None, scale_b=None, **kwargs):
        if a.device.type == "cpu" and (scale_a.numel() > 1 or scale_b.numel() > 1):
            raise RuntimeError(TORCH_2_11_CPU_REFUSAL)
        return real(a, b, *args, scale_a=scale_a, scale_b=scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    probe = getattr(tfp8, "rowwise_refusal", None)
    if probe is not None:  # a fresh cache for the patched torch, the real one's left as it was
        monkeypatch.setattr(tfp8, "rowwise_refusal", functools.cache(probe.__wrapped__))


@needs_torchao
def test_the_rowwise_probe_agrees_with_the_keyed_fact():
    from conformance import expectations

    tfp8.rowwise_refusal.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", expectations.UnmeasuredTorchVersion)
        expected = expectations.rowwise_scaled_mm_on_cpu()
    assert (tfp8.rowwise_refusal() is None) == expected


@needs_torchao
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_on_a_cpu_torch_without_rowwise_scaled_mm_is_refused_before_any_work(monkeypatch, tmp_path, recipe):
    _torch_2_11_scaled_mm(monkeypatch)
    fix = r"precision.fp8_recipe tensorwise or mxfp8, or torch 2.12 or newer"
    with pytest.raises(ValueError, match=rf"precision.fp8_recipe '{recipe}'.*only supports per-tensor.*{fix}"):
        resolve_precision(PrecisionConfig(mode="fp8", fp8_recipe=recipe), "cpu")
    with pytest.raises(ValueError, match=fix):
        tfp8.convert_to_fp8(nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]), recipe, "cpu")
    cfg = fp8_cfg(f"checkpoint.folder={tmp_path / 'ck'}", recipe=recipe)
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    started = []

    class Started(Callback):
        def on_fit_start(self, trainer):
            started.append(True)

    with pytest.raises(ValueError, match=fix):
        Trainer(cfg, [Started()]).fit(task.model, task.train_data, loss_fn=task.loss_fn)
    assert not started and not list((tmp_path / "ck").glob("*"))
    assert all(torch.equal(v, before[k]) for k, v in task.model.state_dict().items())
    # tensorwise passes one-element scales, which that torch computes
    assert resolve_precision(PrecisionConfig(mode="fp8", fp8_recipe="tensorwise"), "cpu").mode == "fp8"


def test_the_rowwise_check_reads_the_probe_on_the_cpu_only(monkeypatch):
    monkeypatch.setattr(tfp8, "rowwise_refusal", lambda: "only supports per-tensor scaling for CPU backend")
    with pytest.raises(ValueError, match="rowwise"):
        tfp8.check_recipe("rowwise", "cpu")
    tfp8.check_recipe("tensorwise", "cpu")
    tfp8.check_recipe("mxfp8", "cpu")
    tfp8.check_recipe("rowwise", "cuda")  # measured on the CPU only: CUDA's kernels are another matter
    monkeypatch.setattr(tfp8, "rowwise_refusal", lambda: None)
    tfp8.check_recipe("rowwise", "cpu")


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 64, generator=g), torch.randn(n, 64, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _mx_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@needs_torchao
def test_mx_layers_refuse_rows_that_are_not_a_multiple_of_32_before_the_first_step(tmp_path):
    cfg = load_config(overrides=["device=cpu", "precision.mode=fp8", "precision.fp8_recipe=mxfp8", "train.steps=2",
                                 f"checkpoint.folder={tmp_path / 'ck'}", "checkpoint.interval=1"])
    model = _mx_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = torch.utils.data.DataLoader(_Rows(40), batch_size=20)  # 20 rows: not a multiple of 32
    with pytest.raises(ValueError) as info:
        Trainer(cfg).fit(model, data, loss_fn=_mse)
    text = str(info.value)
    assert "layer '2'" in text and "shape [20, 64]" in text and "20 rows" in text
    assert "multiple of 32" in text and "drop_last=True" in text and "precision.fp8_recipe tensorwise" in text
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not list((tmp_path / "ck").glob("*.ckpt"))


@needs_torchao
def test_an_mx_batch_the_first_one_hides_is_refused_in_its_forward_before_its_backward(tmp_path):
    cfg = load_config(overrides=["device=cpu", "precision.mode=fp8", "precision.fp8_recipe=mxfp8", "train.steps=3",
                                 f"checkpoint.folder={tmp_path / 'ck'}", "checkpoint.interval=1"])
    model = _mx_model()
    data = torch.utils.data.DataLoader(_Rows(80), batch_size=32)  # 32, 32, then a short last batch of 16
    with pytest.raises(ValueError, match=r"layer '2' gets an input of shape \[16, 64\], 16 rows"):
        Trainer(cfg).fit(model, data, loss_fn=_mse)
    # the two good steps were saved; the third never ran its backward
    assert [p.name for p in sorted((tmp_path / "ck").glob("*.ckpt"))] == ["step-00000001.ckpt", "step-00000002.ckpt"]
    ok = load_config(overrides=["device=cpu", "precision.mode=fp8", "precision.fp8_recipe=mxfp8", "train.steps=2"])
    summary = Trainer(ok).fit(_mx_model(), torch.utils.data.DataLoader(_Rows(80), batch_size=32, drop_last=True),
                              loss_fn=_mse)
    assert summary.steps_applied == 2
    with torch.no_grad():  # evaluation has no backward: any rows
        model(torch.randn(3, 64))
