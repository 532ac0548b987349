"""NonFiniteGuard, check_placement and diagnose_nonfinite on planted faults."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchimpl.precision.diagnostics import DiagnosisReport, diagnose_nonfinite
from torchimpl.precision.guard import Misplacement, NonFiniteError, NonFiniteGuard, check_placement
from torchimpl.precision.plan import PrecisionConfig, PrecisionPlan, resolve_precision

FP32 = PrecisionPlan("fp32", torch.float32, False, False, "cpu")
FP16 = PrecisionPlan("fp16", torch.float16, True, True, "cpu")


class LogHead(nn.Module):
    """Planted fault: log(relu(x)) is -inf wherever x <= 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.relu())


class Net(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), act)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


class RootAbs(nn.Module):
    """sqrt(x*x): finite forward, NaN gradient where x == 0 (inf from sqrt' times 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x)


class DivByZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x - x)


class HandRMSNorm(nn.Module):
    """RMSNorm with eps=1e-8, which rounds to 0 in fp16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-8)


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g), torch.zeros(8, 1)


# --- guard ----------------------------------------------------------------------------------------


def test_guard_names_module_with_planted_log_zero():
    torch.manual_seed(0)
    model = Net(LogHead())
    x, _ = _batch()
    hidden = model.body[0](x).relu()
    with NonFiniteGuard(model), pytest.raises(NonFiniteError) as info:
        model(x)
    err = info.value
    assert err.module_name == "body.1", str(err)
    assert (err.tensor, err.dtype, err.phase) == ("output", torch.float32, "forward")
    assert err.num_inf == int((hidden == 0).sum()) > 0 and err.num_nan == 0, str(err)
    assert "module body.1 (LogHead)" in str(err)
    assert f"{err.num_inf} inf and 0 NaN of 32 elements" in str(err)


def test_guard_names_input_of_root():
    model = Net(nn.ReLU())
    x = torch.ones(2, 4)
    x[1, 2] = float("nan")
    with NonFiniteGuard(model), pytest.raises(NonFiniteError) as info:
        model(x)
    assert (info.value.module_name, info.value.tensor) == ("", "input[0]")
    assert "module <root> (Net)" in str(info.value)
    assert (info.value.num_inf, info.value.num_nan) == (0, 1)


def test_guard_backward_names_module_whose_output_gradient_is_non_finite():
    model = nn.Sequential(nn.Linear(4, 4), RootAbs(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    with NonFiniteGuard(model) as guard:
        loss = model(torch.ones(3, 4)).sum()  # forward is finite: sqrt(0) = 0
        with pytest.raises(NonFiniteError) as info:
            loss.backward()
    assert not guard.installed
    err = info.value
    assert (err.module_name, err.tensor, err.phase) == ("0", "grad_output", "backward"), str(err)
    assert (err.num_inf, err.num_nan) == (0, 12), str(err)


def test_guard_paths_in_tuple_and_dict_outputs():
    class Pair(nn.Module):
        def forward(self, x):
            return x, x.log()

    class Named(nn.Module):
        def forward(self, x):
            return {"ok": x, "bad": x / 0}

    for module, path in ((Pair(), "output[1]"), (Named(), "output['bad']")):
        with NonFiniteGuard(module), pytest.raises(NonFiniteError) as info:
            module(-torch.ones(2))
        assert info.value.tensor == path, str(info.value)


def test_guard_removal_leaves_no_hooks_and_no_checks():
    model = Net(LogHead())
    guard = NonFiniteGuard(model)
    out = None
    with pytest.raises(NonFiniteError):
        out = model(_batch()[0])
    guard.remove()
    for name, m in model.named_modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, f"hook left on {name!r}"
    out = model(_batch()[0])  # the fault is still there; nothing checks it any more
    assert not torch.isfinite(out).all()


def test_gradient_hooks_of_a_removed_guard_are_inert():
    model = nn.Sequential(nn.Linear(4, 4), RootAbs(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    guard = NonFiniteGuard(model)
    loss = model(torch.ones(3, 4)).sum()
    guard.remove()
    loss.backward()  # tensor hooks attached during forward return without checking
    assert torch.isnan(model[0].weight.grad).all()


def test_guard_tolerates_inplace_activations_and_stays_quiet_when_finite():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    with NonFiniteGuard(model):
        model(torch.randn(5, 4)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_guard_forward_only_and_validation():
    model = nn.Sequential(nn.Linear(4, 4), RootAbs())
    with torch.no_grad():
        model[0].weight.zero_()
    with NonFiniteGuard(model, backward=False):
        model(torch.ones(1, 4)).sum().backward()  # NaN gradient, but backward checks are off
    with pytest.raises(ValueError, match="at least one of forward and backward"):
        NonFiniteGuard(model, forward=False, backward=False)
    with pytest.raises(ValueError, match="model must be an nn.Module, got int"):
        NonFiniteGuard(3)  # type: ignore[arg-type]


# --- placement ----------------------------------------------------------------------------------


class WithAttributes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.bn = nn.BatchNorm1d(2)
        self.mask = torch.ones(2)  # a plain attribute: module.to() does not move it
        self.tables = [torch.zeros(3), "not a tensor"]


def test_placement_finds_plain_attributes_left_behind_by_to():
    model = WithAttributes().to("meta")
    found = check_placement(model, "meta")
    assert found == [
        Misplacement("mask", "attribute", torch.device("cpu"), torch.float32, "device"),
        Misplacement("tables[0]", "attribute", torch.device("cpu"), torch.float32, "device"),
    ], found


def test_placement_lists_parameters_and_buffers_off_device():
    model = WithAttributes()
    model.bn.to("meta")
    found = check_placement(model, torch.device("cpu", 0))
    names = [(m.name, m.kind, m.device.type) for m in found]
    assert names == [
        ("bn.weight", "parameter", "meta"),
        ("bn.bias", "parameter", "meta"),
        ("bn.running_mean", "buffer", "meta"),
        ("bn.running_var", "buffer", "meta"),
        ("bn.num_batches_tracked", "buffer", "meta"),
    ], names


def test_placement_dtype_check_skips_integer_tensors():
    model = WithAttributes()
    model.lin.half()
    assert check_placement(model, "cpu") == [], "without dtype only devices are checked"
    found = check_placement(model, "cpu", dtype=torch.float32)
    assert [(m.name, m.problem, m.dtype) for m in found] == [
        ("lin.weight", "dtype", torch.float16),
        ("lin.bias", "dtype", torch.float16),
    ]
    model.mask = torch.ones(2, dtype=torch.float16, device="meta")
    assert check_placement(model, "cpu", dtype=torch.float32)[-1] == Misplacement(
        "mask", "attribute", torch.device("meta"), torch.float16, "device and dtype"
    )


def test_placement_nested_module_names():
    outer = nn.Sequential(WithAttributes())
    outer[0].mask = outer[0].mask.to("meta")
    assert [m.name for m in check_placement(outer, "cpu")] == ["0.mask"]


# --- diagnosis ----------------------------------------------------------------------------------


def _snapshot(model: nn.Module):
    return [(n, p.detach().clone(), p.grad) for n, p in model.named_parameters()]


def test_diagnosis_of_planted_log_zero_leaves_model_and_rng_alone():
    torch.manual_seed(0)
    model = Net(LogHead())
    before = _snapshot(model)
    rng = torch.get_rng_state()
    report = diagnose_nonfinite(model, _batch(), mse, FP32)
    assert isinstance(report, DiagnosisReport)
    assert report.reproduced
    assert [c.name for c in report.checks] == [
        "fp32_rerun", "loss_in_fp32", "unscale_before_clip", "unsafe_math",
        "fp16_normalization", "bf16_rerun",
    ]
    assert report.first_failure is report.check("fp32_rerun")
    assert "reduced precision is not the cause" in report.first_failure.detail
    unsafe = report.check("unsafe_math")
    assert unsafe.passed is False
    first = report.findings["unsafe_math"][0]
    assert (first.op, first.module, first.phase) == ("aten.log.default", "body.1", "forward")
    assert first.problem.startswith("log of zero (")
    assert report.first_nonfinite_op["fp32"].module == "body.1"
    assert report.check("bf16_rerun").passed is None
    for (n, p0, g0), (_, p1) in zip(before, model.named_parameters()):
        assert torch.equal(p0, p1) and p1.grad is g0, f"{n} changed"
    assert torch.equal(rng, torch.get_rng_state()), "the diagnosis must not consume RNG"
    assert "[FAIL] unsafe_math: aten.log.default in module body.1" in str(report)


def test_diagnosis_of_division_by_zero():
    model = Net(DivByZero())
    report = diagnose_nonfinite(model, _batch(), mse, FP32)
    first = report.findings["unsafe_math"][0]
    assert (first.op, first.module) == ("aten.div.Tensor", "body.1"), first
    assert first.problem == "division by zero in 32 of 32 divisor elements"


def test_diagnosis_finds_division_by_zero_in_backward():
    model = nn.Sequential(nn.Linear(4, 4), RootAbs(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    report = diagnose_nonfinite(model, _batch(), mse, FP32)
    assert report.check("fp32_rerun").passed is False
    first = report.findings["unsafe_math"][0]
    assert (first.op, first.phase) == ("aten.div.Tensor", "backward"), first


def test_diagnosis_of_fp16_overflow_that_bf16_fixes():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(3e4)  # 4 * 3e4 > 65504: inf in fp16, fine in bf16 and fp32
    batch = (torch.ones(8, 4), torch.zeros(8, 1))
    report = diagnose_nonfinite(model, batch, mse, FP16)
    assert report.reproduced
    assert report.check("fp32_rerun").passed is True
    assert "reduced precision is the cause" in report.check("fp32_rerun").detail
    assert report.check("unsafe_math").passed is True
    assert report.check("fp16_normalization").passed is True
    assert report.first_failure is report.check("bf16_rerun")
    assert "precision mode bf16 fixes it" in report.first_failure.detail
    origin = report.first_nonfinite_op["plan"]
    assert (origin.op, origin.module) == ("aten.addmm.default", "0"), origin
    assert "torch.float16" in origin.problem


def test_diagnosis_of_fp16_norm_with_lost_eps():
    model = nn.Sequential(nn.Linear(4, 4), HandRMSNorm(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    report = diagnose_nonfinite(model, _batch(), mse, FP16)
    assert report.check("fp32_rerun").passed is True
    assert report.first_failure is report.check("fp16_normalization")
    finding = report.findings["fp16_normalization"][0]
    assert (finding.op, finding.module) == ("aten.rsqrt.default", "1"), finding
    assert report.check("bf16_rerun").passed is False, "eps=1e-8 survives in bf16"


def test_diagnosis_flags_fp16_layer_norm_with_tiny_variance():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()  # every row the constant 0.5: variance 0
        model[0].bias.fill_(0.5)
    report = diagnose_nonfinite(model, _batch(), mse, FP16)
    finding = report.findings["fp16_normalization"][0]
    assert (finding.op, finding.module) == ("aten.native_layer_norm.default", "1"), finding
    assert "8 of 8 groups have variance below" in finding.problem


def test_diagnosis_loss_dtype_check():
    def low_loss(model, batch):
        return model(batch[0]).mean()  # under CPU fp16 autocast, mean stays float16

    model = nn.Linear(4, 1)
    report = diagnose_nonfinite(model, _batch(), low_loss, FP16)
    check = report.check("loss_in_fp32")
    assert check.passed is False and "torch.float16" in check.detail
    assert not report.reproduced
    assert report.check("bf16_rerun").passed is None


def test_unscale_check_reads_the_scalers_record():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    plan = PrecisionPlan("fp16", torch.float16, True, True, "cpu")

    def unscale_check(**kw):
        return diagnose_nonfinite(model, _batch(), mse, plan, **kw).check("unscale_before_clip")

    assert unscale_check().passed is None, "a scaler plan without a scaler is unknown"
    assert unscale_check(scaler=scaler).passed is None, "no optimizer: unknown"
    assert unscale_check(scaler=scaler, optimizer=opt).passed is None, "no record: unknown"
    scaler.scale(mse(model, _batch())).backward()
    scaler.unscale_(opt)
    grads = [p.grad.clone() for p in model.parameters()]
    ok = unscale_check(scaler=scaler, optimizer=opt)
    assert ok.passed is True and "unscale_(optimizer) was called" in ok.detail
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    state = scaler._per_optimizer_states[id(opt)]
    ready = type(state["stage"]).READY
    state["stage"] = ready
    assert unscale_check(scaler=scaler, optimizer=opt).passed is False
    scaler.step(opt)
    assert unscale_check(scaler=scaler, optimizer=opt).passed is None
    no_scaler = diagnose_nonfinite(model, _batch(), mse, FP32).check("unscale_before_clip")
    assert no_scaler.passed is True


def test_diagnosis_with_guard_installed_on_the_model():
    model = Net(LogHead())
    with NonFiniteGuard(model):
        report = diagnose_nonfinite(model, _batch(), mse, FP32)
        assert report.check("unsafe_math").passed is False
        with pytest.raises(NonFiniteError):  # the guard still watches the original model
            model(_batch()[0])


def test_diagnosis_reruns_see_the_same_dropout_mask():
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    plan = resolve_precision(PrecisionConfig("bf16"), "cpu")
    a = diagnose_nonfinite(model, _batch(), mse, plan)
    b = diagnose_nonfinite(model, _batch(), mse, plan)
    assert a.check("fp32_rerun").detail == b.check("fp32_rerun").detail


def test_diagnosis_validates_arguments():
    model = nn.Linear(4, 1)
    with pytest.raises(ValueError, match="plan must be a PrecisionPlan, got str"):
        diagnose_nonfinite(model, _batch(), mse, "fp32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must return a one-element loss tensor"):
        diagnose_nonfinite(model, _batch(), lambda m, b: m(b[0]), FP32)
    with pytest.raises(ValueError, match="max_findings must be >= 1, got 0"):
        diagnose_nonfinite(model, _batch(), mse, FP32, max_findings=0)
