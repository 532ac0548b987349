"""Property 4: SGD, Adam and AdamW, step by step, against `reference.optim`.

Each optimizer (for-loop ``foreach=False``, ``foreach=True`` and ``fused=True``) runs a few steps
from recorded gradients (None: no gradient that step). Before every step the spec is given
torch's parameters and state, and after it every field must agree: parameters, momentum
buffers, exp_avg, exp_avg_sq, max_exp_avg_sq, the step counter and, for fused Adam(W) under a
real ``torch.amp.GradScaler``, the gradients the kernel leaves behind.

Why from torch's state each step: with exact kernels the two trajectories are then equal by
induction, so nothing is lost; with native kernels the per-step difference stays what one step
makes, which is what the bounds below derive, instead of compounding (a chaotic trajectory
would make any fixed bound either wrong or toothless).

What is compared with which spec function:
- SGD, every path: ``sgd_step`` (fused SGD on CPU rounds every operation like the for-loop);
- Adam/AdamW for-loop and foreach: ``adam_step`` with ``sqrt=`` torch's own square root for that
  path (``Tensor.sqrt``, ``torch._foreach_sqrt``): on x86 builds torch hands it to MKL's vector
  math, which is faithful but not correctly rounded (reference.optim rule 9); the spec's IEEE
  root would otherwise differ by an ULP in about 17% of elements. Everything else stays the
  spec's own arithmetic;
- fused Adam/AdamW: ``fused_adam_step`` with the scaler's scale as ``grad_scale`` and its
  found_inf (1.0 when a gradient is non-finite) -- the kernel's root is correctly rounded.

Exactness (``expectations.exact_kernels``): bit for bit with exact kernels, every field. On
native kernels the step counter, the skip and the unscaled gradients are still bit for bit
(counting and one correctly rounded division); parameters and moments are within the ULP
bounds derived in ``expectations`` and measured in ULPs of ``x_abs``, the field's formula
evaluated on magnitudes (see ``_sgd_magnitudes``/``_adam_magnitudes``): a plain ULP distance
explodes where a result cancels to near zero although the operands were large.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from conformance import expectations, strategies
from conformance.assertions import Where, assert_equal, assert_same
from conformance.bridge import to_numpy, to_torch
from reference import optim, scaling
from reference import step as ref_step

KINDS = ["SGD", "Adam", "AdamW"]
IMPLS = ["for-loop", "foreach", "fused"]
REPRO = "rerun this test with the @reproduce_failure blob printed above"
# Loss scales for fused Adam: powers of two, and others where a true division differs from a
# multiplication by the reciprocal.
SCALES = [1.0, 1024.0, 65536.0, 1000.0, 3.0, 12345.678]


def assert_within(actual: np.ndarray, expected: np.ndarray, x_abs: np.ndarray, max_ulp: int, where: Where) -> None:
    """|torch - spec| <= max_ulp ULPs of x_abs, elementwise; NaN as a class, infinities exact."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    a_nan, e_nan = np.isnan(a), np.isnan(e)
    finite = np.isfinite(a) & np.isfinite(e)
    with np.errstate(invalid="ignore", over="ignore"):
        unit = np.maximum(np.spacing(np.abs(np.asarray(x_abs, np.float64)).astype(np.float32)).astype(np.float64),
                          2.0**-149)
        dist = np.where(finite, np.abs(a - e) / unit, 0.0)
    bad = np.where(a_nan | e_nan, a_nan != e_nan, np.where(finite, dist > max_ulp, a != e))
    if bad.any():
        lines = [f"{where.header()}: {int(bad.sum())} of {a.size} elements differ by more than {max_ulp} ULP of x_abs:"]
        for ix in np.argwhere(bad)[:5]:
            i = tuple(int(k) for k in ix)
            lines.append(f"  index {i}: torch {a[i]!r} ({np.float32(a[i]).view(np.uint32):#010x}), spec {e[i]!r} "
                         f"({np.float32(e[i]).view(np.uint32):#010x}), x_abs {float(np.asarray(x_abs)[i]):.6g}, "
                         f"{dist[i]:.2f} ULP of x_abs")
        raise AssertionError("\n".join(lines + [where.footer()]))


def compare(actual, expected, x_abs, bound: int, where: Where, exact: bool) -> None:
    if exact:
        assert_same(actual, expected, where)
    else:
        assert_within(actual, expected, x_abs, bound, where)


def _sgd_magnitudes(cfg: optim.SGDConfig, p, g, old_buf):
    """x_abs of the momentum buffer and of the parameter (reference.optim rule 2 on magnitudes)."""
    d = np.abs(g.astype(np.float64)) + cfg.weight_decay * np.abs(p.astype(np.float64))
    buf = None
    if cfg.momentum != 0:
        buf = d if old_buf is None else cfg.momentum * np.abs(old_buf.astype(np.float64)) + abs(1 - cfg.dampening) * d
        d = d + cfg.momentum * buf if cfg.nesterov else buf
    return buf, np.abs(p.astype(np.float64)) + cfg.lr * d


def _adam_magnitudes(cfg: optim.AdamConfig, p, g, old: optim.AdamParamState, new: optim.AdamParamState) -> dict:
    """x_abs of each Adam field (rules 3-6 on magnitudes; the denominator is positive, taken
    from the spec's new second moment)."""
    beta1, beta2 = cfg.betas
    p64 = np.abs(p.astype(np.float64))
    d = np.abs(g.astype(np.float64)) + (0.0 if cfg.decoupled_weight_decay else cfg.weight_decay * p64)
    m = beta1 * np.abs(old.exp_avg.astype(np.float64)) + (1 - beta1) * d
    v = beta2 * old.exp_avg_sq.astype(np.float64) + (1 - beta2) * d * d
    out = dict(exp_avg=m, exp_avg_sq=v)
    root_of = new.exp_avg_sq
    if cfg.amsgrad:
        out["max_exp_avg_sq"] = np.maximum(old.max_exp_avg_sq.astype(np.float64), v)
        root_of = new.max_exp_avg_sq
    t = float(new.step)
    step_size = cfg.lr / (1 - beta1**t)
    denom = np.sqrt(root_of.astype(np.float64)) / math.sqrt(1 - beta2**t) + cfg.eps
    with np.errstate(divide="ignore", invalid="ignore"):
        update = np.where(denom > 0, step_size * m / denom, np.inf)
    decay = 1 - cfg.lr * cfg.weight_decay if cfg.decoupled_weight_decay else 1.0
    out["param"] = p64 * decay + update
    return out


def _late_first_gradient(cfg: optim.SGDConfig, grads, state) -> bool:
    """A parameter gets its first gradient while another already has a momentum buffer."""
    with_grad = [s for g, s in zip(grads, state) if g is not None]
    return cfg.momentum != 0 and any(s.momentum_buffer is None for s in with_grad) and any(
        s.momentum_buffer is not None for s in with_grad)


def _torch_optimizer(kind: str, impl: str, params, config: dict):
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    cls = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}[kind]
    return cls(params, **config, **flags)


def _spec_config(kind: str, config: dict):
    if kind == "SGD":
        return optim.SGDConfig(**config)
    return optim.AdamConfig(**config) if kind == "Adam" else optim.adamw_config(**config)


def _torch_sqrt(impl: str, device: str):
    if impl == "foreach":
        return lambda a: to_numpy(torch._foreach_sqrt([to_torch(a, device)])[0])
    return lambda a: to_numpy(torch.sqrt(to_torch(a, device)))


def _spec_state(kind: str, opt, p, spec_cfg):
    """The spec state equal to torch's current state of parameter ``p``."""
    state = opt.state.get(p, {})
    if kind == "SGD":
        buf = state.get("momentum_buffer")
        return optim.SGDParamState(momentum_buffer=None if buf is None else to_numpy(buf))
    if not state:
        return optim.init_state([to_numpy(p)], spec_cfg)[0]
    return optim.AdamParamState(
        step=np.float32(to_numpy(state["step"]).reshape(())),
        exp_avg=to_numpy(state["exp_avg"]),
        exp_avg_sq=to_numpy(state["exp_avg_sq"]),
        max_exp_avg_sq=to_numpy(state["max_exp_avg_sq"]) if spec_cfg.amsgrad else None,
    )


def run_optimizer_case(kind: str, impl: str, config: dict, trajectory: dict, scale: float, device: str,
                       lr_dtype: np.dtype | None = None, separate_unscale: bool = False) -> None:
    """``lr_dtype``: give torch the learning rate as a 0-d tensor of that dtype (a tensor lr) and
    the spec the same value as a 0-d array (reference.optim rule 11). ``separate_unscale``: a
    fused optimizer's gradients are unscaled by ``scaler.unscale_`` before ``scaler.step``, so
    the kernel must not unscale them again (``grad_scale=None`` in the spec)."""
    spec_cfg = _spec_config(kind, config)
    exact = expectations.exact_kernels(device)
    params = [torch.nn.Parameter(to_torch(p, device)) for p in trajectory["params"]]
    spec_lr = None
    if lr_dtype is not None:
        spec_lr = np.asarray(config["lr"], dtype=lr_dtype)
        config = dict(config, lr=to_torch(spec_lr, device))
    opt = _torch_optimizer(kind, impl, params, config)
    scaled = kind != "SGD" and impl == "fused"
    scaler = torch.amp.GradScaler(device, init_scale=scale, growth_interval=2) if scaled else None

    for step, grads in enumerate(trajectory["grads"]):
        where = Where(f"{kind}[{impl}]", step=step, repro=REPRO)
        before = [to_numpy(p) for p in params]
        state = tuple(_spec_state(kind, opt, p, spec_cfg) for p in params)
        for p, g in zip(params, grads):
            p.grad = None if g is None else to_torch(g, device)
        skipped = False
        if kind == "SGD":
            spec_params, spec_state = optim.sgd_step(before, grads, state, spec_cfg, lr=spec_lr)
            spec_grads = grads
            if impl == "fused" and _late_first_gradient(spec_cfg, grads, state) and \
                    expectations.fused_sgd_fails_on_late_first_gradient(device):
                with pytest.raises(TypeError, match="got NoneType"):
                    opt.step()
                event("fused SGD: late first gradient, keyed TypeError")
                return
            opt.step()
        elif scaled:
            scaler.scale(torch.ones((), device=device))  # the loss, as every iteration scales it
            scale_now = float(scaler.get_scale())
            with np.errstate(invalid="ignore"):
                skipped = any(g is not None and not np.isfinite(g).all() for g in grads)
            grad_scale = scale_now
            if separate_unscale:
                scaler.unscale_(opt)
                present = [g for g in grads if g is not None]
                unscaled = iter(scaling.unscale_gradients(present, scaling.ScalerState(scale_now, 0, 1))[0])
                grads, grad_scale = [None if g is None else next(unscaled) for g in grads], None
            spec_params, spec_grads, spec_state = optim.fused_adam_step(
                before, grads, state, spec_cfg, grad_scale=grad_scale, found_inf=1.0 if skipped else 0.0, lr=spec_lr)
            scaler.step(opt)
            scaler.update()
        else:
            spec_params, spec_state = optim.adam_step(before, grads, state, spec_cfg, sqrt=_torch_sqrt(impl, device),
                                                      lr=spec_lr)
            spec_grads = grads
            opt.step()

        for i, (p, old, new, g) in enumerate(zip(params, state, spec_state, spec_grads)):
            if g is None:
                assert_same(to_numpy(p), spec_params[i], where.at(f"params[{i}] (no grad)"))
                continue
            if scaled:
                # One correctly rounded division (or nothing, on a skipped step): exact anywhere.
                assert_same(to_numpy(p.grad), g, where.at(f"grads[{i}] after the step"))
            same = exact or skipped
            if kind == "SGD":
                buf_abs, p_abs = _sgd_magnitudes(spec_cfg, before[i], g, old.momentum_buffer)
                torch_buf = opt.state.get(p, {}).get("momentum_buffer")
                if new.momentum_buffer is None or torch_buf is None:
                    assert_equal(torch_buf is None, new.momentum_buffer is None, where.at(f"momentum_buffer[{i}] exists"))
                else:
                    compare(to_numpy(torch_buf), new.momentum_buffer, buf_abs, expectations.SGD_BUFFER_ULP,
                            where.at(f"momentum_buffer[{i}]"), same)
                compare(to_numpy(p), spec_params[i], p_abs, expectations.SGD_PARAM_ULP, where.at(f"params[{i}]"), same)
                continue
            torch_state = opt.state[p]
            assert_same(np.float32(to_numpy(torch_state["step"]).reshape(())), new.step, where.at(f"step[{i}]"))
            x_abs = _adam_magnitudes(spec_cfg, before[i], g, old, new) if not same else {}
            for field in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if spec_cfg.amsgrad else ()):
                compare(to_numpy(torch_state[field]), getattr(new, field), x_abs.get(field),
                        expectations.ADAM_MOMENT_ULP, where.at(f"{field}[{i}]"), same)
            compare(to_numpy(p), spec_params[i], x_abs.get("param"), expectations.ADAM_PARAM_ULP,
                    where.at(f"params[{i}]"), same)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_optimizer_steps_match_the_spec(kind, impl, device, data):
    config_strategy = strategies.sgd_config() if kind == "SGD" else strategies.adam_config()
    config = data.draw(config_strategy, label="config")
    scaled = kind != "SGD" and impl == "fused"
    trajectory = data.draw(strategies.optimizer_trajectory(plant_nonfinite=scaled), label="trajectory")
    scale = data.draw(st.sampled_from(SCALES), label="init_scale") if scaled else 1.0
    separate = scaled and data.draw(st.booleans(), label="separate unscale_")
    run_optimizer_case(kind, impl, config, trajectory, scale, device, separate_unscale=separate)


def test_fused_sgd_skipped_first_step_is_the_keyed_expectation(device):
    """torch's fused SGD keeps an uninitialised buffer after a skipped first step: a keyed fact,
    and the reason the spec refuses the sync-free mode for SGD with momentum."""
    probed = expectations.probe_fused_sgd_skipped_first_step_stores_a_buffer(device)
    expected = expectations.fused_sgd_skipped_first_step_stores_a_buffer(device)
    assert probed == expected, (
        f"torch {torch.__version__} on {device}: fused SGD stores a momentum buffer on a skipped first step="
        f"{probed}, the suite expects {expected}; update conformance/expectations.py after checking the change"
    )
    # The spec: a skipped step creates no buffer, and sync_free with momentum is refused.
    cfg = optim.SGDConfig(lr=0.1, momentum=0.9)
    assert optim.init_state([np.ones(4, np.float32)], cfg)[0].momentum_buffer is None
    with pytest.raises(ValueError, match="SGD with momentum"):
        ref_step.StepConfig(optimizer=cfg, optimizer_kind="fused", sync_free=True)


def test_fused_sgd_late_first_gradient_is_the_keyed_expectation(device):
    """torch's fused SGD raising on a parameter whose first gradient comes late is a keyed fact
    (the optimizer properties expect that TypeError where it is keyed True)."""
    probed = expectations.probe_fused_sgd_fails_on_late_first_gradient(device)
    if not expectations.keyed_device(device):
        pytest.skip(f"no {device} measurement is keyed: the optimizer properties follow the probe ({probed})")
    expected = expectations.fused_sgd_fails_on_late_first_gradient(device)
    assert probed == expected, (
        f"torch {torch.__version__} on {device}: fused SGD raises on a late first gradient={probed}, the "
        f"suite expects {expected}; update conformance/expectations.py after checking the change")


@pytest.mark.parametrize("impl", ["for-loop", "fused"])
@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_tensor_lrs_and_zero_d_parameters_match_the_spec(kind, impl, device, data):
    """reference.optim rule 11: a learning rate given as a float32 or float64 tensor (or a
    Python float), with 0-d parameters among the others: the for-loop Adam(W) computes its
    step size (and AdamW its decay factor) in the tensor's dtype, and a 0-d parameter meets a
    wider decay factor promoted; SGD and the fused kernels read the tensor's value."""
    config = data.draw(strategies.sgd_config() if kind == "SGD" else strategies.adam_config(), label="config")
    scaled = kind != "SGD" and impl == "fused"
    trajectory = data.draw(strategies.optimizer_trajectory(plant_nonfinite=scaled, zero_d=True), label="trajectory")
    lr_dtype = data.draw(st.sampled_from([np.dtype(np.float32), np.dtype(np.float64), None]), label="lr dtype")
    # Rates whose float32 and float64 quotients by the bias corrections part (not powers of two).
    config["lr"] = data.draw(st.one_of(st.sampled_from([0.37, 3e-4, 0.1, 0.013]), st.floats(1e-4, 0.5)), label="lr")
    scale = data.draw(st.sampled_from(SCALES), label="init_scale") if scaled else 1.0
    run_optimizer_case(kind, impl, config, trajectory, scale, device, lr_dtype=lr_dtype)
