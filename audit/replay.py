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
   torch's thread count, `clip_grads_with_norm` from the total the loop passed, or
   `clip_grad_value`): its total norm against torch's, and its clipped gradients against what
   enters the next stage.
4. The optimizer step (`reference.optim`: SGD, Adam, AdamW; for-loop, foreach and fused) from
   torch's parameters, gradients and state: the parameters and state after it. The for-loop and
   foreach Adam take torch's own square root (``reference.optim`` rule 9).
5. ``update`` (`reference.scaling.update_scale_multi`) from the scale and tracker before it and
   the spec's found_inf of every step it closes: the scale and tracker after it; and the scale
   the next update starts from must be the one this update left.

Exactness, as the conformance suite states and tests it (``conformance/expectations.py``): with
torch's scalar CPU kernels (``ATEN_CPU_CAPABILITY=default``) every field is compared bit for
bit. With native AVX2/AVX512 kernels, which fuse some multiply-adds: found_inf, the skip, the
scale, the tracker, unscaled gradients, value-clipped gradients, gradients clipped from a
given total (``clip_grads_with_norm_``) and the Adam step counter stay bit for bit; a total
norm is within ``NORM_ULP`` ULPs; norm-clipped gradients within ``CLIP_ULP`` ULPs of their dtype
(the coefficient follows the norm: at most one more ULP from its reciprocal and multiply, one
from the product's rounding); optimizer fields within the conformance bounds, in ULPs of ``x_abs``, the field's formula evaluated on magnitudes (a plain
ULP distance explodes where an update cancels to near zero). NaN compares as a class.

A step is not replayed, with the reason in the report, when it holds something outside the
specification: another optimizer class, bfloat16 or float16 parameters, a tensor learning rate,
``capturable``/``differentiable``, a norm order other than 2 and inf, or fused SGD unscaled by
its own kernel. The scaler and skip stages of such a step are still checked. On another device
(a GPU) found_inf, the skip, the unscale, value clipping and the scale update are compared, bit
for bit as on every device; norm clipping and the optimizer step are not, and their numbers are
not copied.
"""

from __future__ import annotations

import functools
import math
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch

from audit import _torch_compat  # noqa: F401  (checks the private torch names the audit uses)
from audit.rules import Finding
from reference import clipping, optim, scaling

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


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_SINT = {2: np.int16, 4: np.int32, 8: np.int64}


def _bits_hex(x: Any) -> str:
    a = np.asarray(x)
    view = _UINT.get(a.dtype.itemsize)
    return f"{int(a.view(view)):#0{2 + 2 * a.dtype.itemsize}x}" if view is not None else "?"


def _ordinals(x: np.ndarray) -> np.ndarray:
    """Each float's position on the number line (adjacent floats 1 apart, +0 and -0 both 0), as float64."""
    s = x.view(_SINT[x.dtype.itemsize]).astype(np.int64)
    mag = s & np.int64((1 << (8 * x.dtype.itemsize - 1)) - 1)
    return np.where(s < 0, -mag, mag).astype(np.float64)


@dataclass
class Comparison:
    """``problem`` None when the arrays agree at the bound; else the first mismatch described, with
    its two values. ``worst``: the largest distance among the elements that agree (ULPs)."""

    problem: str | None
    worst: float = 0.0
    expected: Any = None
    got: Any = None


def _screen(g: np.ndarray, e: np.ndarray, gi: np.ndarray, ei: np.ndarray, bound: int) -> tuple[np.ndarray, float]:
    """Whole-array passes over flat ``g`` and ``e`` (``gi``, ``ei``: their bits as signed integers):
    the flat indices the element-wise check must look at, and the largest ULP distance among the
    others, which agree.

    At ``bound`` 0 the pairs whose bits differ. Otherwise the pairs not plainly within ``bound // 2``
    ULPs: the difference of the bit patterns, wrapping in their integer type, has a magnitude of
    at most ``bound // 2``, and both values are finite. For two finite values that magnitude is
    their ULP distance: exactly so for one sign; for opposite signs the true difference lies
    between 1 and 2**bits - 1, and a wrapped magnitude within ``bound // 2`` needs a pattern within
    ``bound // 2`` below the sign bit (a NaN) or below all ones (a negative NaN).
    """
    if bound == 0:
        return (_NO_INDEX, 0.0) if np.array_equal(gi, ei) else (np.flatnonzero(gi != ei), 0.0)
    half = bound // 2
    d = np.subtract(gi, ei)
    np.abs(d, out=d)  # the most negative difference stays negative: the unsigned view makes it huge
    du = d.view(_UINT[g.dtype.itemsize])
    if np.isfinite(g).all() and np.isfinite(e).all():
        worst = int(du.max(initial=0))
        if worst <= half:
            return _NO_INDEX, float(worst)
        idx = np.flatnonzero(du > half)
    else:
        near = du <= half
        near &= np.isfinite(g)
        near &= np.isfinite(e)
        idx = np.flatnonzero(~near)
    du[idx] = 0  # our own scratch: the largest distance left is that of the pairs that agree
    return idx, float(du.max(initial=0))


_NO_INDEX = np.zeros(0, np.intp)


def _compare(got: np.ndarray, expected: np.ndarray, bound: int, x_abs: Any = None) -> Comparison:
    """``got`` against ``expected``: bit for bit (``bound`` 0), else within ``bound`` ULPs of the
    value, or of ``x_abs`` when given (an array, or a function of flat indices returning the
    magnitudes there). NaN compares as a class.

    Work goes only where it is needed: the bits first; then the ULP distance of the values that
    differ; ``x_abs`` only for those more than ``bound // 2`` ULPs apart. That is safe because
    ``x_abs`` is at least the result's magnitude (the triangle inequality: the formula on
    magnitudes bounds the formula's value), so one ULP of ``x_abs`` is at least half an ULP of
    either value, and ``bound // 2`` ULPs of the values are within ``bound`` ULPs of ``x_abs``.
    """
    got = np.asarray(got)
    expected = np.asarray(expected)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return Comparison(f"shape/dtype {got.shape} {got.dtype} against the spec's {expected.shape} "
                          f"{expected.dtype}", math.inf)
    gflat, eflat = got.reshape(-1), expected.reshape(-1)
    gi, ei = gflat.view(_SINT[got.dtype.itemsize]), eflat.view(_SINT[got.dtype.itemsize])
    idx, fast_worst = _screen(gflat, eflat, gi, ei, bound)
    if idx.size == 0:
        return Comparison(None, fast_worst)
    g, e = gflat[idx], eflat[idx]
    g_nan, e_nan = np.isnan(g), np.isnan(e)
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(g) & np.isfinite(e)
        if bound == 0:
            dist = np.where(g_nan & e_nan, 0.0, math.inf)
        else:
            dist = np.where(finite, np.abs(_ordinals(g) - _ordinals(e)), 0.0)
            far = finite & (dist > bound // 2) if x_abs is not None else None
            if far is not None and far.any():
                sub = idx[far]
                xa = np.abs(x_abs(sub) if callable(x_abs) else np.asarray(x_abs, np.float64).reshape(-1)[sub])
                unit = np.maximum(np.spacing(xa.astype(got.dtype)).astype(np.float64),
                                  float(np.finfo(got.dtype).smallest_subnormal))
                dist[far] = np.abs(g[far].astype(np.float64) - e[far].astype(np.float64)) / unit
    bad = np.where(g_nan | e_nan, g_nan != e_nan, np.where(finite, dist > bound, g != e))
    good = dist[~bad]
    worst = max(fast_worst, float(good.max()) if good.size else 0.0)
    if not bad.any():
        return Comparison(None, worst)
    k = int(np.argmax(bad))
    i = [int(v) for v in np.unravel_index(idx[k], got.shape)] if got.ndim else []
    unit_text = "" if bound == 0 else (f", {dist[k]:.1f} ULP{' of x_abs' if x_abs is not None else ''} apart "
                                       f"(bound {bound})")
    return Comparison(f"{int(bad.sum())} of {got.size} elements differ; first at index {i}: torch {float(g[k])!r} "
                      f"({_bits_hex(g[k])}), spec {float(e[k])!r} ({_bits_hex(e[k])}){unit_text}",
                      math.inf, float(e[k]), float(g[k]))


@dataclass(frozen=True)
class OptimizerRef:
    """What the replay needs of a torch optimizer: its label in the report and its class, as
    ``SGD``, ``Adam``, ``AdamW`` or the qualified name of any other."""

    label: str
    kind: str


_SPEC_OPTIMIZERS = {torch.optim.SGD: "SGD", torch.optim.Adam: "Adam", torch.optim.AdamW: "AdamW"}


def optimizer_ref(o: Any) -> OptimizerRef:
    cls = type(o.obj)
    return OptimizerRef(o.label, _SPEC_OPTIMIZERS.get(cls, f"{cls.__module__}.{cls.__qualname__}"))


MODES = ("process", "thread", "inline")


def worker_available() -> bool:
    """Whether ``process`` mode can run here."""
    from audit import worker

    return worker.available()


def default_mode() -> str:
    """``process`` where a forked worker with shared memory is available (Linux), else ``thread``;
    ``AMPSPEC_AUDIT_REPLAY`` (one of `MODES`) chooses otherwise."""
    from audit import worker

    chosen = os.environ.get("AMPSPEC_AUDIT_REPLAY", "").strip().lower()
    if chosen:
        if chosen not in MODES:
            raise ValueError(f"AMPSPEC_AUDIT_REPLAY must be one of {', '.join(MODES)}, got {chosen!r}")
        if chosen == "process" and not worker.available():
            raise ValueError("AMPSPEC_AUDIT_REPLAY=process needs Linux (os.fork and os.memfd_create)")
        return chosen
    return "process" if worker.available() else "thread"


class Replayer:
    """Replays steps as the recorder hands them over; turns divergences into findings at the end.

    Where the replay runs (``mode``, `default_mode`):

    - ``process``: in a worker process forked when the audit starts, before the audited program
      builds anything (`audit.worker`). The recorder's copies go straight into shared memory, so
      the training pays one copy of each array and a short message a step, and the replay's
      arithmetic runs on another core without contending for the interpreter lock.
    - ``thread``: on a worker thread of this process. NumPy releases the lock in its array
      loops, but the replay's Python between them holds it, and the training waits for it.
    - ``inline``: in the recorder's call, before the program continues.

    Each mode replays the steps in the order they came and reaches the same verdicts. The
    recorder hands over copies only, so the replay never touches a live tensor; at most
    ``_QUEUE`` steps wait, which bounds the memory the copies take (the training waits when the
    replay falls behind). ``finish`` waits for the replay; an error of the replay itself is
    raised there.
    """

    _QUEUE = 4

    def __init__(self, mode: str | None = None) -> None:
        self.mode = default_mode() if mode is None else mode
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._queue: queue.Queue | None = queue.Queue(maxsize=self._QUEUE) if self.mode == "thread" else None
        self._worker: threading.Thread | None = None
        self._error: BaseException | str | None = None
        self.capability = torch.backends.cpu.get_cpu_capability()
        self.exact = self.capability == "DEFAULT"
        self.divergences: list[Divergence] = []
        self.findings: list[Finding] = []  # found by the replay (a second unscale seen in the numbers)
        self.not_replayed: dict[str, int] = {}
        self.steps_replayed = 0
        self.steps_bit_exact = 0
        self.updates_checked = 0
        self.worst: dict[str, float] = {}
        self._found: dict[tuple[str, int], bool] = {}  # (optimizer, step) -> the spec's found_inf
        self._expected_after: dict[str, Any] = {}  # scaler label -> the scale its last update left
        self.process: Any = None
        self.fallback: str | None = None
        if self.mode == "process":
            from audit import worker

            try:
                self.process = worker.ReplayProcess(self._QUEUE)
            except OSError as exc:  # no fork or no pipe here (a process limit): the thread does the work
                self.mode, self.fallback = "thread", f"no replay process ({exc}): replayed on a thread"
                self._queue = queue.Queue(maxsize=self._QUEUE)

    @property
    def pool(self) -> Any:
        """Where the recorder's copies go (shared memory in ``process`` mode), or None."""
        return self.process

    # ------------------------------------------------------------------ description

    def exactness(self) -> str:
        if self.exact:
            return "scalar CPU kernels (ATEN_CPU_CAPABILITY=default): every field bit for bit"
        return (f"{self.capability} CPU kernels: found_inf, skip, scale, growth tracker, unscaled, value-clipped "
                f"and given-total-clipped gradients bit for bit; total norms within {NORM_ULP} ULP, norm-clipped "
                f"gradients within {CLIP_ULP} ULP; SGD within {SGD_BUFFER_ULP}/{SGD_PARAM_ULP} ULP (buffer/parameter) and Adam(W) within "
                f"{ADAM_MOMENT_ULP}/{ADAM_PARAM_ULP} ULP (moments/parameter) of x_abs")

    def _bound(self, native: int) -> int:
        return 0 if self.exact else native

    def _note(self, reason: str) -> None:
        self.not_replayed[reason] = self.not_replayed.get(reason, 0) + 1

    # ------------------------------------------------------------------ where the work runs

    def _submit(self, method: str, args: tuple, owner: Any = None, on_done: Any = None) -> None:
        """Run ``self.<method>(*args)`` where the mode says. ``owner``: the step data whose shared
        memory the job reads; ``on_done(result)``: applied here to the job's result (in process
        mode, where the job ran on copies of its arguments)."""
        if self.process is not None:
            self.process.submit(method, args, owner, on_done)
            return
        if self._queue is None:
            getattr(self, method)(*args)
            return
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="ampspec-audit-replay", daemon=True)
            self._worker.start()
        self._queue.put((method, args))

    def _work(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    getattr(self, item[0])(*item[1])
            except BaseException as exc:  # kept for finish(): the replay's own failure is not the program's
                self._error = exc
            finally:
                self._queue.task_done()

    def export_state(self) -> dict[str, Any]:
        """What the replay found, for the process that reports it (process mode)."""
        return {"divergences": self.divergences, "findings": self.findings, "not_replayed": self.not_replayed,
                "steps_replayed": self.steps_replayed, "steps_bit_exact": self.steps_bit_exact,
                "updates_checked": self.updates_checked, "worst": self.worst}

    def _wait(self) -> None:
        """Every job done; the replay's state here."""
        if self.process is not None:
            state, error = self.process.finish()
            if state is not None:
                for k, v in state.items():
                    setattr(self, k, v)
            for reason, count in self.process.unsent.items():
                self.not_replayed[reason] = self.not_replayed.get(reason, 0) + count
            if error is not None:
                self._error = error
        elif self._queue is not None and self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None

    # ------------------------------------------------------------------ steps

    def step(self, o: Any, d: Any, rec: Any, recorder: Any) -> None:
        """Replay one step of optimizer track ``o`` (where the mode says)."""

        def done(result: tuple[str, float | None]) -> None:
            rec.replay = result[0]
            if rec.clip_coef is None:
                rec.clip_coef = result[1]

        self._submit("_step", (optimizer_ref(o), d, rec), owner=d, on_done=done)

    def _step(self, o: OptimizerRef, d: Any, rec: Any) -> tuple[str, float | None]:
        self._replay_one(o, d, rec)
        return rec.replay, rec.clip_coef

    def _replay_one(self, o: OptimizerRef, d: Any, rec: Any) -> None:
        if d is not None and d.unsupported is not None:
            rec.replay = f"not replayed: {d.unsupported}"
            self._note(d.unsupported)
            return
        if d is None or d.scaled is None:
            rec.replay = "not replayed: no gradients reached a step-phase call"
            self._note(rec.replay[len("not replayed: "):])
            return
        before = len(self.divergences)
        self._max_seen = 0.0
        try:
            self._replay_step(o, d, rec)
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
               x_abs: Any = None) -> bool:
        c = _compare(got, expected, bound, x_abs)
        if c.problem is None:
            self._max_seen = max(self._max_seen, c.worst)
            return True
        self._diverge(o, rec, fld, c.got, c.expected, c.problem, where)
        return False

    def _replay_step(self, o: OptimizerRef, d: Any, rec: Any) -> None:
        step_where = next((c.split("@", 1)[1] for c in reversed(rec.calls)
                           if c.startswith(("scaler.step@", "optimizer.step@"))), "?")
        present = [i for i, g in enumerate(d.scaled) if g is not None]
        for i in present:
            if d.scaled[i].dtype not in (np.float16, np.float32, np.float64, np.dtype(ml_dtypes.bfloat16)):
                raise _NotReplayable(f"{d.scaled[i].dtype} gradients")
        scaled = [d.scaled[i] for i in present]
        spec_found = scaling.has_inf_or_nan(scaled)
        self._found[(o.label, rec.step)] = spec_found
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
            g_spec = dict(zip(present, scaled))  # read-only arrays, never written
        bound = 0
        after_unscale = state is not None and not kernel
        for c in d.clips:
            self._check_grads(o, rec, f"gradients entering {c.kind} at {c.where}", c.indices, c.grads_in, g_spec,
                              bound, c.where, state if after_unscale else None)
            after_unscale = False
            ins = [(i, g) for i, g in zip(c.indices, c.grads_in) if g is not None]
            if c.kind != "clip_grad_value_" and not d.on_cpu:
                raise _NotReplayable(f"{c.kind} on a device other than the CPU (its rules there are not the CPU's)")
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
                                              num_threads=c.threads)
                if rec.clip_coef is None:
                    rec.clip_coef = float(res.clip_coef)
                total = np.asarray(res.total_norm)
                torch_total = np.asarray(c.total_norm).astype(total.dtype).reshape(())
                self._check(o, rec, f"total norm of {c.kind} at {c.where}", torch_total, total.reshape(()),
                            self._bound(NORM_ULP), c.where)
                out = list(res.grads)
                bound = self._bound(CLIP_ULP)
            else:  # clip_grads_with_norm_: the coefficient of the total the loop computed, exact
                total = c.arguments.get("total_norm")
                if not isinstance(total, np.ndarray) or total.size != 1:
                    for i, _ in ins:
                        g_spec[i] = None
                    raise _NotReplayable(f"clip_grads_with_norm_ with a total_norm of type {type(total).__name__}")
                res = clipping.clip_grads_with_norm([g for _, g in ins], float(c.arguments["max_norm"]), total)
                if rec.clip_coef is None:
                    rec.clip_coef = float(res.clip_coef)
                out = list(res.grads)
                bound = 0
            for (i, _), g in zip(ins, out):
                g_spec[i] = g
        if d.step_grads is None:
            return  # a skipped step: the optimizer was not called
        idx = [i for i, g in enumerate(d.step_grads) if g is not None]
        self._check_grads(o, rec, f"gradients entering the optimizer step at {step_where}", idx,
                          [d.step_grads[i] for i in idx], g_spec, bound, step_where,
                          state if after_unscale else None)
        if not d.on_cpu:
            raise _NotReplayable("parameters on a device other than the CPU")
        if d.params_after is not None:
            self._replay_optimizer(o, d, rec, step_where)

    def _check_grads(self, o: Any, rec: Any, fld: str, indices: list[int], got: list[Any],
                     spec: dict[int, np.ndarray | None], bound: int, where: str,
                     unscale_state: Any) -> None:
        """One stage's input against the spec's previous output; after an unscale, a mismatch
        that is exactly a second unscale (by the inverse or by a division) is named as such."""
        for i, g in zip(indices, got):
            e = spec.get(i)
            if g is None or e is None:
                continue
            c = _compare(g, e, bound)
            if c.problem is None:
                self._max_seen = max(self._max_seen, c.worst)
                continue
            if unscale_state is not None and self._is_second_unscale(g, e, unscale_state):
                self.findings.append(Finding(
                    "unscale-twice", rec.step, where,
                    f"the {fld} are the unscaled gradients divided by the scale {float(unscale_state.scale)!r} "
                    f"once more (parameter {i}: {c.problem})", expected=c.expected, got=c.got))
            self._diverge(o, rec, fld, c.got, c.expected, f"parameter {i}: {c.problem}", where)
            return

    @staticmethod
    def _is_second_unscale(got: np.ndarray, once: np.ndarray, state: Any) -> bool:
        twice, _ = scaling.unscale_gradients([once], state)
        if _compare(got, twice[0], 0).problem is None:
            return True
        with np.errstate(all="ignore"):
            wide = once.astype(np.float64) / np.float64(state.scale) if once.dtype == np.float64 else \
                (once.astype(np.float32) / np.float32(state.scale)).astype(once.dtype)
        return _compare(got, np.asarray(wide, once.dtype), 0).problem is None

    # ------------------------------------------------------------------ the optimizer stage

    def _replay_optimizer(self, o: OptimizerRef, d: Any, rec: Any, where: str) -> None:
        for p_np in d.params_before:
            if p_np.dtype not in (np.float32, np.float64):
                raise _NotReplayable(f"{p_np.dtype} parameters (the specification's optimizers take float32 and float64)")
        for gi, group in enumerate(d.groups):
            idx = [i for i, g in enumerate(d.group_of) if g == gi]
            cfg, kind, impl = _spec_optimizer(o.kind, group)
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
                    mag = functools.partial(_sgd_magnitudes, cfg, params[j], g, states[j].momentum_buffer)
                    spec_buf = new_states[j].momentum_buffer
                    if spec_buf is not None and torch_state.get("momentum_buffer") is not None:
                        self._check(o, rec, f"momentum_buffer of {name}", torch_state["momentum_buffer"], spec_buf,
                                    0 if exact_here else SGD_BUFFER_ULP, where,
                                    None if exact_here else (lambda ix, mag=mag: mag(ix)[0]))
                    self._check(o, rec, name, d.params_after[i], new_params[j], 0 if exact_here else SGD_PARAM_ULP,
                                where, None if exact_here else (lambda ix, mag=mag: mag(ix)[1]))
                else:
                    new = new_states[j]
                    if "step" in torch_state:
                        self._check(o, rec, f"step counter of {name}",
                                    np.float32(np.asarray(torch_state["step"]).reshape(())), np.float32(new.step), 0, where)
                    mag = functools.partial(_adam_magnitudes, cfg, params[j], g, states[j], new)
                    for fld in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if cfg.amsgrad else ()):
                        if fld in torch_state:
                            self._check(o, rec, f"{fld} of {name}", torch_state[fld], getattr(new, fld),
                                        0 if exact_here else ADAM_MOMENT_ULP, where,
                                        None if exact_here else (lambda ix, mag=mag, fld=fld: mag(ix)[fld]))
                    self._check(o, rec, name, d.params_after[i], new_params[j], 0 if exact_here else ADAM_PARAM_ULP,
                                where, None if exact_here else (lambda ix, mag=mag: mag(ix)["param"]))

    # ------------------------------------------------------------------ update

    def update(self, s: Any, pending: list[Any], before: tuple[Any, int], after: tuple[Any, int], new_scale: Any,
               recorder: Any) -> None:
        """Check one ``scaler.update`` of scaler track ``s`` (after the steps it closes)."""
        scaler = s.obj
        factors = (float(scaler.get_growth_factor()), float(scaler.get_backoff_factor()),
                   int(scaler.get_growth_interval()))
        closes = [(optimizer_ref(o), rec) for o, _, rec in pending]
        new = None if new_scale is None else float(new_scale)
        self._submit("_update", (s.label, closes, before, after, new, factors))

    def resync(self, s: Any) -> None:
        """A scaler's state was loaded: its next update starts from what it holds then (in order)."""
        self._submit("_resync", (s.label,))

    def _resync(self, label: str) -> None:
        self._expected_after.pop(label, None)

    def _update(self, label: str, closes: list[tuple[OptimizerRef, Any]], before: tuple[Any, int],
                after: tuple[Any, int], new_scale: float | None, factors: tuple[float, float, int]) -> None:
        if not closes:
            return
        o, rec = closes[0]
        where = next((c.split("@", 1)[1] for c in reversed(rec.calls) if c.startswith("scaler.update@")), "?")
        expected_after = self._expected_after.get(label)
        if expected_after is not None and np.float32(before[0]) != expected_after:
            self._diverge(o, rec, "scale at scaler.update", float(before[0]), float(expected_after),
                          "the scale changed between two updates outside scaler.update", where)
        if new_scale is not None:
            self._expected_after[label] = np.float32(after[0])
            self._note("scaler.update(new_scale): the scale the loop set is taken as is")
            return
        # The spec's found_inf of each step the update closes (from its scaled gradients, as the
        # step's replay decided it), else the scaler's own flag.
        flags = [self._found.pop((ref.label, r.step), bool(r.found_inf)) for ref, r in closes]
        try:
            cfg = scaling.ScalerConfig(init_scale=float(before[0]) if float(before[0]) > 0 and
                                       math.isfinite(float(before[0])) else 1.0,
                                       growth_factor=factors[0], backoff_factor=factors[1],
                                       growth_interval=factors[2])
        except ValueError as exc:
            self._note(f"a scaler configuration outside the specification ({exc})")
            self._expected_after.pop(label, None)
            return
        spec = scaling.update_scale_multi(scaling.ScalerState(before[0], before[1], 1), flags, cfg)
        self.updates_checked += 1
        if np.float32(after[0]).view(np.uint32) != np.float32(spec.scale).view(np.uint32):
            self._diverge(o, rec, "scale after scaler.update", float(after[0]), float(spec.scale),
                          f"from scale {float(before[0])!r}, tracker {before[1]}, found_inf {flags}", where)
        elif int(after[1]) != int(spec.growth_tracker):
            self._diverge(o, rec, "growth tracker after scaler.update", int(after[1]), int(spec.growth_tracker),
                          f"from scale {float(before[0])!r}, tracker {before[1]}, found_inf {flags}", where)
        self._expected_after[label] = np.float32(after[0])

    # ------------------------------------------------------------------ the end

    def finish(self, recorder: Any) -> None:
        """Wait for the worker; then: each divergence at the step of a finding that changes the numbers is that finding's
        consequence (its numbers fill the finding's expected/got); the first other one becomes a
        ``replay-divergence`` finding naming both values and how many steps diverged."""
        self._wait()
        if self._error is not None:
            if isinstance(self._error, BaseException):
                raise RuntimeError(f"the audit's replay failed: {self._error!r}") from self._error
            raise RuntimeError(f"the audit's replay failed: {self._error}")
        recorder.findings.extend(self.findings)
        recorder.findings.sort(key=lambda f: -1 if f.step is None else f.step)  # the replay adds some late
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


def _spec_optimizer(kind: str, group: dict[str, Any]) -> tuple[Any, str, str]:
    """The spec's configuration, kind and implementation for one torch parameter group."""
    if group.get("differentiable") or group.get("capturable"):
        raise _NotReplayable("a capturable or differentiable optimizer")
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        raise _NotReplayable("a tensor learning rate")
    impl = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
    try:
        if kind == "SGD":
            return optim.SGDConfig(lr=float(lr), momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                                   nesterov=bool(group["nesterov"]), weight_decay=float(group["weight_decay"]),
                                   maximize=bool(group.get("maximize", False))), "sgd", impl
        if kind in ("Adam", "AdamW"):
            decoupled = bool(group.get("decoupled_weight_decay", kind == "AdamW"))
            return optim.AdamConfig(lr=float(lr), betas=tuple(float(b) for b in group["betas"]),
                                    eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                                    amsgrad=bool(group["amsgrad"]), maximize=bool(group.get("maximize", False)),
                                    decoupled_weight_decay=decoupled), "adam", impl
    except (ValueError, KeyError, TypeError) as exc:
        raise _NotReplayable(f"{kind} hyperparameters outside the specification ({exc})") from None
    raise _NotReplayable(f"{kind} is not in the specification (SGD, Adam, AdamW)")


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


def _flat(a: np.ndarray, ix: np.ndarray) -> np.ndarray:
    return np.asarray(a).reshape(-1)[ix].astype(np.float64)


def _sgd_magnitudes(cfg: Any, p: np.ndarray, g: np.ndarray, old_buf: np.ndarray | None,
                    ix: np.ndarray) -> tuple[Any, Any]:
    """x_abs of the momentum buffer and of the parameter at flat indices ``ix``: ``reference.optim``
    rule 2 on magnitudes."""
    d = np.abs(_flat(g, ix)) + cfg.weight_decay * np.abs(_flat(p, ix))
    buf = None
    if cfg.momentum != 0:
        buf = d if old_buf is None else cfg.momentum * np.abs(_flat(old_buf, ix)) + abs(1 - cfg.dampening) * d
        d = d + cfg.momentum * buf if cfg.nesterov else buf
    return buf, np.abs(_flat(p, ix)) + cfg.lr * d


def _adam_magnitudes(cfg: Any, p: np.ndarray, g: np.ndarray, old: Any, new: Any, ix: np.ndarray) -> dict[str, Any]:
    """x_abs of each Adam field at flat indices ``ix``: ``reference.optim`` rules 3-6 on magnitudes
    (the denominator is positive, taken from the spec's new second moment)."""
    beta1, beta2 = cfg.betas
    p64 = np.abs(_flat(p, ix))
    d = np.abs(_flat(g, ix)) + (0.0 if cfg.decoupled_weight_decay else cfg.weight_decay * p64)
    m = beta1 * np.abs(_flat(old.exp_avg, ix)) + (1 - beta1) * d
    v = beta2 * _flat(old.exp_avg_sq, ix) + (1 - beta2) * d * d
    out = {"exp_avg": m, "exp_avg_sq": v}
    root_of = _flat(new.exp_avg_sq, ix)
    if cfg.amsgrad:
        out["max_exp_avg_sq"] = np.maximum(_flat(old.max_exp_avg_sq, ix), v)
        root_of = _flat(new.max_exp_avg_sq, ix)
    t = float(new.step)
    step_size = cfg.lr / (1 - beta1**t)
    denom = np.sqrt(root_of) / math.sqrt(1 - beta2**t) + cfg.eps
    with np.errstate(divide="ignore", invalid="ignore"):
        update = np.where(denom > 0, step_size * m / denom, np.inf)
    decay = 1 - cfg.lr * cfg.weight_decay if cfg.decoupled_weight_decay else 1.0
    out["param"] = p64 * decay + update
    return out
