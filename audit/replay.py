"""The numeric replay: each recorded step recomputed by ``reference`` and compared with torch's.

The only module of the audit that imports the specification (an audit with ``replay=False``
never loads it).

Input: what the recorder copied during the step, bit for bit: the scaled gradients as backward
left them (the conformance boundary, DESIGN 3.4: autograd is not re-implemented), the scale,
the gradients entering each clipping call and the optimizer step, the parameters and optimizer
state before and after, the hyperparameters of every group, the scaler's state around
``update``.

What is recomputed, stage by stage in the contract's order, each stage fed torch's own input
so that a difference stays what one stage makes instead of compounding:

1. ``found_inf`` (`reference.scaling.has_inf_or_nan` of the scaled gradients) against the scaler's
   flag, and the skip: the step is applied exactly when no gradient is inf or NaN. Without a
   scaler torch has no skip; applying non-finite gradients is then the divergence.
2. Unscale (`reference.scaling.unscale_gradients`): the gradients entering the next stage (the
   first clipping call, or the step) must be the spec's unscaled gradients.
3. Each clipping call (`reference.clipping.clip_grad_norm` at torch's CPU summation order with
   torch's thread count, or `clip_grad_value`): its total norm against torch's, and its clipped
   gradients against what enters the next stage.
4. The optimizer step (`reference.optim`: SGD, Adam, AdamW; for-loop, foreach and fused) from
   torch's parameters, gradients and state: the parameters and state after it. The for-loop and
   foreach Adam take torch's own square root (``reference.optim`` rule 9).
5. ``update`` (`reference.scaling.update_scale_multi`) from the scale and tracker before it and
   the spec's found_inf of every step it closes: the scale and tracker after it; and the scale
   the next update starts from must be the one this update left.

Exactness, as the conformance suite states and tests it (``conformance/expectations.py``): with
torch's scalar CPU kernels (``ATEN_CPU_CAPABILITY=default``) every field is compared bit for
bit. With native AVX2/AVX512 kernels, which fuse some multiply-adds: found_inf, the skip, the
scale, the tracker, unscaled gradients, value-clipped gradients and the Adam step counter stay
bit for bit; a total norm is within ``NORM_ULP`` ULPs; norm-clipped gradients within
``CLIP_ULP`` ULPs of their dtype (the coefficient follows the norm: at most one more ULP from
its reciprocal and multiply, one from the product's rounding); optimizer fields within the
conformance bounds, in ULPs of ``x_abs``, the field's formula evaluated on magnitudes (a plain
ULP distance explodes where an update cancels to near zero). NaN compares as a class.

A step is not replayed, with the reason in the report, when it holds something outside the
specification: a CUDA tensor, another optimizer class, bfloat16 or float16 parameters, a tensor
learning rate, ``capturable``/``differentiable``, a norm order other than 2 and inf, or fused SGD
unscaled by its own kernel. The scaler and skip stages of such a step are still checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch

from audit.rules import Finding
from reference import clipping, formats, optim, scaling

__all__ = ["Replayer", "Divergence", "NORM_ULP", "CLIP_ULP", "SGD_BUFFER_ULP", "SGD_PARAM_ULP",
           "ADAM_MOMENT_ULP", "ADAM_PARAM_ULP"]

# The conformance suite's bounds for native kernels (conformance/expectations.py derives each;
# tests/test_audit.py checks these stay equal to them).
NORM_ULP = 2
CLIP_ULP = 4
SGD_BUFFER_ULP = 2 * 4
SGD_PARAM_ULP = 2 * 8
ADAM_MOMENT_ULP = 2 * 5
ADAM_PARAM_ULP = 2 * 15

# Rules whose breach changes the step's numbers: a divergence at the step of such a finding is
# its consequence, reported with the finding (its expected and got), not as a second finding.
EXPLAINING_RULES = frozenset({"clip-before-unscale", "unscale-twice", "update-without-step",
                              "step-bypasses-scaler", "new-scaler-mid-run", "optimizer-before-to"})


class _NotReplayable(Exception):
    pass


@dataclass
class Divergence:
    step: int
    optimizer: str
    field: str
    expected: Any
    got: Any
    detail: str
    where: str


def _bits_hex(x: Any) -> str:
    a = np.asarray(x)
    view = {2: np.uint16, 4: np.uint32, 8: np.uint64}.get(a.dtype.itemsize)
    return f"{int(a.view(view)):#0{2 + 2 * a.dtype.itemsize}x}" if view is not None else "?"


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ULP distance elementwise for same-dtype float arrays (float64 by its own ordinal)."""
    if a.dtype == np.float64:
        def ordinal(x: np.ndarray) -> np.ndarray:
            i = x.view(np.int64).astype(object)
            return np.where(i < 0, -(i & 0x7FFFFFFFFFFFFFFF), i)
        with np.errstate(invalid="ignore"):
            d = np.abs(ordinal(a) - ordinal(b)).astype(np.float64)
        return d
    return formats.ulp_distance(a, b, a.dtype.name).astype(np.float64)


def _compare(got: np.ndarray, expected: np.ndarray, bound: int, x_abs: np.ndarray | None = None) -> tuple[str | None, float]:
    """None when ``got`` matches ``expected`` (bits, or within ``bound`` ULPs of the values, or of
    ``x_abs`` when given); else a description of the first mismatch. Also the largest distance."""
    got = np.asarray(got)
    expected = np.asarray(expected)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"shape/dtype {got.shape} {got.dtype} against the spec's {expected.shape} {expected.dtype}", math.inf
    if got.size == 0:
        return None, 0.0
    wide_g = got.astype(np.float64)
    wide_e = expected.astype(np.float64)
    g_nan, e_nan = np.isnan(wide_g), np.isnan(wide_e)
    finite = np.isfinite(wide_g) & np.isfinite(wide_e)
    if bound == 0:
        view = {2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
        differ = np.where(g_nan | e_nan, g_nan != e_nan, got.view(view) != expected.view(view))
        dist = differ.astype(np.float64)
    elif x_abs is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            unit = np.maximum(np.spacing(np.abs(np.asarray(x_abs, np.float64)).astype(got.dtype)).astype(np.float64),
                              float(np.finfo(got.dtype).smallest_subnormal))
            dist = np.where(finite, np.abs(wide_g - wide_e) / unit, 0.0)
        differ = np.where(g_nan | e_nan, g_nan != e_nan, np.where(finite, dist > bound, wide_g != wide_e))
    else:
        dist = np.where(finite, _ulps(np.where(finite, got, 0).astype(got.dtype),
                                      np.where(finite, expected, 0).astype(got.dtype)), 0.0)
        differ = np.where(g_nan | e_nan, g_nan != e_nan, np.where(finite, dist > bound, wide_g != wide_e))
    worst = float(np.max(np.where(differ, 0.0, dist))) if dist.size else 0.0
    if not differ.any():
        return None, worst
    i = tuple(int(k) for k in np.argwhere(differ)[0])
    gv, ev = got[i], expected[i]
    unit = "" if bound == 0 else (f", {dist[i]:.1f} ULP{' of x_abs' if x_abs is not None else ''} apart (bound {bound})")
    n = int(differ.sum())
    return (f"{n} of {got.size} elements differ; first at index {list(i)}: torch {float(gv)!r} ({_bits_hex(gv)}), "
            f"spec {float(ev)!r} ({_bits_hex(ev)}){unit}"), math.inf


def _first(got: np.ndarray, expected: np.ndarray, index: str) -> tuple[Any, Any]:
    g, e = np.asarray(got).reshape(-1), np.asarray(expected).reshape(-1)
    wide_g, wide_e = g.astype(np.float64), e.astype(np.float64)
    same = (wide_g == wide_e) | (np.isnan(wide_g) & np.isnan(wide_e))
    if same.all() or g.size == 0:
        return None, None
    k = int(np.argmin(same))
    return float(e[k]), float(g[k])


class Replayer:
    """Replays steps as the recorder hands them over; turns divergences into findings at the end."""

    def __init__(self) -> None:
        self.capability = torch.backends.cpu.get_cpu_capability()
        self.exact = self.capability == "DEFAULT"
        self.divergences: list[Divergence] = []
        self.not_replayed: dict[str, int] = {}
        self.steps_replayed = 0
        self.steps_bit_exact = 0
        self.updates_checked = 0
        self.worst: dict[str, float] = {}

    # ------------------------------------------------------------------ description

    def exactness(self) -> str:
        if self.exact:
            return "scalar CPU kernels (ATEN_CPU_CAPABILITY=default): every field bit for bit"
        return (f"{self.capability} CPU kernels: found_inf, skip, scale, growth tracker, unscaled and value-clipped "
                f"gradients bit for bit; total norms within {NORM_ULP} ULP, norm-clipped gradients within {CLIP_ULP} "
                f"ULP; SGD within {SGD_BUFFER_ULP}/{SGD_PARAM_ULP} ULP (buffer/parameter) and Adam(W) within "
                f"{ADAM_MOMENT_ULP}/{ADAM_PARAM_ULP} ULP (moments/parameter) of x_abs")

    def _bound(self, native: int) -> int:
        return 0 if self.exact else native

    def _note(self, reason: str) -> None:
        self.not_replayed[reason] = self.not_replayed.get(reason, 0) + 1

    # ------------------------------------------------------------------ steps

    def step(self, o: Any, d: Any, rec: Any, recorder: Any) -> None:
        if d is None or d.scaled is None:
            rec.replay = "not replayed: no gradients reached a step-phase call"
            self._note(rec.replay[len("not replayed: "):])
            return
        before = len(self.divergences)
        self._max_seen = 0.0
        try:
            self._replay_step(o, d, rec, recorder)
        except _NotReplayable as exc:
            rec.replay = f"partly replayed: {exc}" if len(self.divergences) == before else rec.replay
            self._note(str(exc))
        else:
            self.steps_replayed += 1
        if len(self.divergences) > before:
            rec.replay = f"diverged: {self.divergences[before].field}"
        elif rec.replay == "off":
            exact = self._max_seen == 0.0
            self.steps_bit_exact += int(exact)
            rec.replay = "bit for bit" if exact else f"within the bounds (largest {self._max_seen:.1f} ULP)"

    def _diverge(self, o: Any, rec: Any, fld: str, got: Any, expected: Any, detail: str, where: str) -> None:
        self.divergences.append(Divergence(rec.step, o.label, fld, expected, got, detail, where))

    def _check(self, o: Any, rec: Any, fld: str, got: np.ndarray, expected: np.ndarray, bound: int, where: str,
               x_abs: np.ndarray | None = None) -> bool:
        problem, worst = _compare(got, expected, bound, x_abs)
        if problem is None:
            self._max_seen = max(self._max_seen, worst)
            return True
        e, g = _first(got, expected, "")
        self._diverge(o, rec, fld, g, e, problem, where)
        return False

    def _replay_step(self, o: Any, d: Any, rec: Any, recorder: Any) -> None:
        step_where = next((c.split("@", 1)[1] for c in reversed(rec.calls)
                           if c.startswith(("scaler.step@", "optimizer.step@"))), "?")
        present = [i for i, g in enumerate(d.scaled) if g is not None]
        for i in present:
            if d.scaled[i].dtype not in (np.float16, np.float32, np.float64, np.dtype(ml_dtypes.bfloat16)):
                raise _NotReplayable(f"{d.scaled[i].dtype} gradients")
        scaled = [d.scaled[i] for i in present]
        spec_found = scaling.has_inf_or_nan(scaled)
        if d.torch_found_inf is not None and bool(d.torch_found_inf != 0.0) != spec_found:
            self._diverge(o, rec, "found_inf", bool(d.torch_found_inf), spec_found,
                          f"the scaler's found_inf is {d.torch_found_inf!r}; the spec's check of the scaled gradients "
                          f"gives {spec_found}", step_where)
        if bool(rec.applied) == spec_found:
            self._diverge(o, rec, "applied", bool(rec.applied), not spec_found,
                          ("the optimizer applied a step with inf or NaN gradients" if rec.applied else
                           "the step was skipped although every gradient was finite"), step_where)

        # Stage 2: unscale (the fused kernel's own division happens in the optimizer stage).
        g_spec: dict[int, np.ndarray | None] = {}
        state = scaling.ScalerState(d.scale, 0, 1) if d.scale is not None else None
        kernel = d.kernel_unscale and not d.clips
        if state is not None and not kernel:
            unscaled, _ = scaling.unscale_gradients(scaled, state)
            g_spec = dict(zip(present, unscaled))
        else:
            g_spec = {i: g.copy() for i, g in zip(present, scaled)}
        bound = 0
        after_unscale = state is not None and not kernel
        for c in d.clips:
            self._check_grads(o, rec, f"gradients entering {c.kind} at {c.where}", c.indices, c.grads_in, g_spec,
                              bound, c.where, state if after_unscale else None, recorder)
            after_unscale = False
            ins = [(i, g) for i, g in zip(c.indices, c.grads_in) if g is not None]
            if c.kind == "clip_grad_value_":
                out = clipping.clip_grad_value([g for _, g in ins], float(c.arguments["clip_value"]))
                bound = 0
            elif c.kind == "clip_grad_norm_":
                norm_type = float(c.arguments.get("norm_type", 2.0))
                if norm_type not in (2.0, math.inf):
                    for i, _ in ins:
                        g_spec[i] = None
                    raise _NotReplayable(f"clip_grad_norm_ with norm_type={norm_type!r}")
                if c.total_norm is None:
                    raise _NotReplayable("a clip_grad_norm_ call that raised")
                res = clipping.clip_grad_norm([g for _, g in ins], float(c.arguments["max_norm"]), norm_type,
                                              num_threads=torch.get_num_threads())
                if rec.clip_coef is None:
                    rec.clip_coef = float(res.clip_coef)
                total = np.asarray(res.total_norm)
                torch_total = np.asarray(c.total_norm).astype(total.dtype).reshape(())
                self._check(o, rec, f"total norm of {c.kind} at {c.where}", torch_total, total.reshape(()),
                            self._bound(NORM_ULP), c.where)
                out = list(res.grads)
                bound = self._bound(CLIP_ULP)
            else:
                for i, _ in ins:
                    g_spec[i] = None  # clip_grads_with_norm_: the next stage's input is taken as is
                bound = 0
                continue
            for (i, _), g in zip(ins, out):
                g_spec[i] = g
        if d.step_grads is None:
            return  # a skipped step: the optimizer was not called
        idx = [i for i, g in enumerate(d.step_grads) if g is not None]
        self._check_grads(o, rec, f"gradients entering the optimizer step at {step_where}", idx,
                          [d.step_grads[i] for i in idx], g_spec, bound, step_where,
                          state if after_unscale else None, recorder)
        if d.params_after is not None:
            self._replay_optimizer(o, d, rec, step_where)

    def _check_grads(self, o: Any, rec: Any, fld: str, indices: list[int], got: list[Any],
                     spec: dict[int, np.ndarray | None], bound: int, where: str,
                     unscale_state: Any, recorder: Any) -> None:
        """One stage's input against the spec's previous output; after an unscale, a mismatch
        that is exactly a second unscale (by the inverse or by a division) is named as such."""
        for i, g in zip(indices, got):
            e = spec.get(i)
            if g is None or e is None:
                continue
            problem, worst = _compare(g, e, bound)
            if problem is None:
                self._max_seen = max(self._max_seen, worst)
                continue
            if unscale_state is not None and self._is_second_unscale(g, e, unscale_state):
                recorder._find("unscale-twice", rec.step, where,
                               f"the gradients entering {fld.split(' at ')[0].replace('gradients entering ', '')} at "
                               f"{where} are the unscaled gradients divided by the scale "
                               f"{float(unscale_state.scale)!r} once more (parameter {i}: {problem})",
                               expected=_first(g, e, "")[0], got=_first(g, e, "")[1])
            ev, gv = _first(g, e, "")
            self._diverge(o, rec, fld, gv, ev, f"parameter {i}: {problem}", where)
            return

    @staticmethod
    def _is_second_unscale(got: np.ndarray, once: np.ndarray, state: Any) -> bool:
        twice, _ = scaling.unscale_gradients([once], state)
        if _compare(got, twice[0], 0)[0] is None:
            return True
        with np.errstate(all="ignore"):
            wide = once.astype(np.float64) / np.float64(state.scale) if once.dtype == np.float64 else \
                (once.astype(np.float32) / np.float32(state.scale)).astype(once.dtype)
        return _compare(got, np.asarray(wide, once.dtype), 0)[0] is None

    # ------------------------------------------------------------------ the optimizer stage

    def _replay_optimizer(self, o: Any, d: Any, rec: Any, where: str) -> None:
        opt = o.obj
        for p_np in d.params_before:
            if p_np.dtype not in (np.float32, np.float64):
                raise _NotReplayable(f"{p_np.dtype} parameters (the specification's optimizers take float32 and float64)")
        if any(p.device.type != "cpu" for p in o.params()):
            raise _NotReplayable("parameters on a device other than the CPU")
        for gi, group in enumerate(d.groups):
            idx = [i for i, g in enumerate(d.group_of) if g == gi]
            cfg, kind, impl = _spec_optimizer(opt, group)
            params = [d.params_before[i] for i in idx]
            grads = [d.step_grads[i] for i in idx]
            torch_found = float(d.torch_found_inf or 0.0)
            if kind == "sgd":
                if impl == "fused" and d.kernel_unscale:
                    raise _NotReplayable("fused SGD unscaled by its own kernel")
                states = tuple(optim.SGDParamState(momentum_buffer=d.state_before[i].get("momentum_buffer"))
                               for i in idx)
                skip = d.amp_aware and torch_found == 1.0
                if skip:
                    new_params, new_states = [np.array(p, copy=True) for p in params], states
                else:
                    new_params, new_states = optim.sgd_step(params, grads, states, cfg, lr=cfg.lr)
            else:
                states = tuple(_adam_state(d.state_before[i], params[j], cfg) for j, i in enumerate(idx))
                if impl == "fused":
                    new_params, _, new_states = optim.fused_adam_step(
                        params, grads, states, cfg, grad_scale=d.scale if d.kernel_unscale else None,
                        found_inf=torch_found if d.amp_aware else 0.0, lr=cfg.lr)
                else:
                    new_params, new_states = optim.adam_step(params, grads, states, cfg, lr=cfg.lr,
                                                             sqrt=_torch_sqrt(impl))
            exact_here = self.exact
            for j, i in enumerate(idx):
                g = grads[j]
                name = f"parameter {i}"
                if g is None:
                    self._check(o, rec, f"{name} (no gradient) after the step", d.params_after[i], new_params[j], 0, where)
                    continue
                torch_state = d.state_after[i]
                if kind == "sgd":
                    buf_abs, p_abs = _sgd_magnitudes(cfg, params[j], g, states[j].momentum_buffer)
                    spec_buf = new_states[j].momentum_buffer
                    if spec_buf is not None and torch_state.get("momentum_buffer") is not None:
                        self._check(o, rec, f"momentum_buffer of {name}", torch_state["momentum_buffer"], spec_buf,
                                    0 if exact_here else SGD_BUFFER_ULP, where, None if exact_here else buf_abs)
                    self._check(o, rec, name, d.params_after[i], new_params[j], 0 if exact_here else SGD_PARAM_ULP,
                                where, None if exact_here else p_abs)
                else:
                    new = new_states[j]
                    if "step" in torch_state:
                        self._check(o, rec, f"step counter of {name}",
                                    np.float32(np.asarray(torch_state["step"]).reshape(())), np.float32(new.step), 0, where)
                    mags = {} if exact_here else _adam_magnitudes(cfg, params[j], g, states[j], new)
                    for fld in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if cfg.amsgrad else ()):
                        if fld in torch_state:
                            self._check(o, rec, f"{fld} of {name}", torch_state[fld], getattr(new, fld),
                                        0 if exact_here else ADAM_MOMENT_ULP, where, mags.get(fld))
                    self._check(o, rec, name, d.params_after[i], new_params[j], 0 if exact_here else ADAM_PARAM_ULP,
                                where, mags.get("param"))

    # ------------------------------------------------------------------ update

    def update(self, s: Any, pending: list[Any], before: tuple[Any, int], after: tuple[Any, int], new_scale: Any,
               recorder: Any) -> None:
        if not pending:
            return
        o, _, rec = pending[0]
        where = next((c.split("@", 1)[1] for c in reversed(rec.calls) if c.startswith("scaler.update@")), "?")
        if s.expected_after is not None and np.float32(before[0]) != s.expected_after:
            self._diverge(o, rec, "scale at scaler.update", float(before[0]), float(s.expected_after),
                          "the scale changed between two updates outside scaler.update", where)
        if new_scale is not None:
            s.expected_after = np.float32(after[0])
            self._note("scaler.update(new_scale): the scale the loop set is taken as is")
            return
        flags = []
        for _, data, r in pending:
            if data is not None and data.scaled is not None:
                flags.append(scaling.has_inf_or_nan([g for g in data.scaled if g is not None]))
            else:
                flags.append(bool(r.found_inf))
        scaler = s.obj
        try:
            cfg = scaling.ScalerConfig(init_scale=float(before[0]) if float(before[0]) > 0 and
                                       math.isfinite(float(before[0])) else 1.0,
                                       growth_factor=float(scaler.get_growth_factor()),
                                       backoff_factor=float(scaler.get_backoff_factor()),
                                       growth_interval=int(scaler.get_growth_interval()))
        except ValueError as exc:
            self._note(f"a scaler configuration outside the specification ({exc})")
            s.expected_after = None
            return
        spec = scaling.update_scale_multi(scaling.ScalerState(before[0], before[1], 1), flags, cfg)
        self.updates_checked += 1
        if np.float32(after[0]).view(np.uint32) != np.float32(spec.scale).view(np.uint32):
            self._diverge(o, rec, "scale after scaler.update", float(after[0]), float(spec.scale),
                          f"from scale {float(before[0])!r}, tracker {before[1]}, found_inf {flags}", where)
        elif int(after[1]) != int(spec.growth_tracker):
            self._diverge(o, rec, "growth tracker after scaler.update", int(after[1]), int(spec.growth_tracker),
                          f"from scale {float(before[0])!r}, tracker {before[1]}, found_inf {flags}", where)
        s.expected_after = np.float32(after[0])

    # ------------------------------------------------------------------ the end

    def finish(self, recorder: Any) -> None:
        """Each divergence at the step of a finding that changes the numbers is that finding's
        consequence (its numbers fill the finding's expected/got); the first other one becomes a
        ``replay-divergence`` finding naming both values and how many steps diverged."""
        explained_steps = {f.step for f in recorder.findings if f.rule in EXPLAINING_RULES}
        by_step = {}
        for f in recorder.findings:
            if f.rule in EXPLAINING_RULES:
                by_step.setdefault(f.step, f)
        rest = []
        for dv in self.divergences:
            if dv.step in explained_steps:
                f = by_step[dv.step]
                if isinstance(f.expected, str) and dv.expected is not None:
                    f.expected, f.got = dv.expected, dv.got
                    f.message += f"; the replay: {dv.field}: {dv.detail}"
                continue
            rest.append(dv)
        self.unexplained = rest
        if not rest:
            return
        first = rest[0]
        steps = sorted({dv.step for dv in rest})
        more = f"; {len(steps)} step(s) diverged in all (steps {_ranges(steps)})" if len(steps) > 1 else ""
        recorder.findings.append(Finding(
            "replay-divergence", first.step, first.where,
            f"step {first.step} of {first.optimizer}: {first.field}: {first.detail}{more}",
            expected=first.expected, got=first.got))


def _ranges(xs: list[int]) -> str:
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:  # type: ignore[list-item]
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out[:8]) + (", ..." if len(out) > 8 else "")


def _spec_optimizer(opt: Any, group: dict[str, Any]) -> tuple[Any, str, str]:
    """The spec's configuration, kind and implementation for one torch parameter group."""
    if group.get("differentiable") or group.get("capturable"):
        raise _NotReplayable("a capturable or differentiable optimizer")
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        raise _NotReplayable("a tensor learning rate")
    impl = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
    cls = type(opt)
    try:
        if cls is torch.optim.SGD:
            return optim.SGDConfig(lr=float(lr), momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                                   nesterov=bool(group["nesterov"]), weight_decay=float(group["weight_decay"]),
                                   maximize=bool(group.get("maximize", False))), "sgd", impl
        if cls in (torch.optim.Adam, torch.optim.AdamW):
            decoupled = bool(group.get("decoupled_weight_decay", cls is torch.optim.AdamW))
            return optim.AdamConfig(lr=float(lr), betas=tuple(float(b) for b in group["betas"]),
                                    eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                                    amsgrad=bool(group["amsgrad"]), maximize=bool(group.get("maximize", False)),
                                    decoupled_weight_decay=decoupled), "adam", impl
    except (ValueError, KeyError, TypeError) as exc:
        raise _NotReplayable(f"{cls.__name__} hyperparameters outside the specification ({exc})") from None
    raise _NotReplayable(f"{cls.__module__}.{cls.__name__} is not in the specification (SGD, Adam, AdamW)")


def _adam_state(s: dict[str, Any], p: np.ndarray, cfg: Any) -> Any:
    if not s:
        return optim.init_state([p], cfg)[0]
    return optim.AdamParamState(step=np.float32(np.asarray(s["step"]).reshape(())), exp_avg=s["exp_avg"],
                                exp_avg_sq=s["exp_avg_sq"],
                                max_exp_avg_sq=s.get("max_exp_avg_sq") if cfg.amsgrad else None)


def _torch_sqrt(impl: str) -> Any:
    if impl == "foreach":
        return lambda a: torch._foreach_sqrt([torch.from_numpy(np.ascontiguousarray(a))])[0].numpy()
    return lambda a: torch.sqrt(torch.from_numpy(np.ascontiguousarray(a))).numpy()


def _sgd_magnitudes(cfg: Any, p: np.ndarray, g: np.ndarray, old_buf: np.ndarray | None) -> tuple[Any, Any]:
    """x_abs of the momentum buffer and of the parameter: ``reference.optim`` rule 2 on magnitudes."""
    d = np.abs(g.astype(np.float64)) + cfg.weight_decay * np.abs(p.astype(np.float64))
    buf = None
    if cfg.momentum != 0:
        buf = d if old_buf is None else cfg.momentum * np.abs(old_buf.astype(np.float64)) + abs(1 - cfg.dampening) * d
        d = d + cfg.momentum * buf if cfg.nesterov else buf
    return buf, np.abs(p.astype(np.float64)) + cfg.lr * d


def _adam_magnitudes(cfg: Any, p: np.ndarray, g: np.ndarray, old: Any, new: Any) -> dict[str, Any]:
    """x_abs of each Adam field: ``reference.optim`` rules 3-6 on magnitudes (the denominator is
    positive, taken from the spec's new second moment)."""
    beta1, beta2 = cfg.betas
    p64 = np.abs(p.astype(np.float64))
    d = np.abs(g.astype(np.float64)) + (0.0 if cfg.decoupled_weight_decay else cfg.weight_decay * p64)
    m = beta1 * np.abs(old.exp_avg.astype(np.float64)) + (1 - beta1) * d
    v = beta2 * old.exp_avg_sq.astype(np.float64) + (1 - beta2) * d * d
    out = {"exp_avg": m, "exp_avg_sq": v}
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
