"""The numeric replay: each recorded step recomputed by ``reference`` and compared with torch's.

The only module of the audit that imports the specification (an audit with ``replay=False``
never loads it).

Input: what the recorder copied during the step, bit for bit: the scaled gradients as backward
left them (``reference.step``'s conformance boundary: autograd is not re-implemented), the scale,
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
4. The optimizer step, through the row `audit.optimizers` finds for the optimizer's class (its
   spec row in `reference.optim`: for-loop, foreach and fused), from torch's parameters,
   gradients and state: the parameters and state after it. The for-loop and foreach paths take
   torch's own square root (``reference.optim`` rule 9). A compiled step (``torch.compile(opt.step)``,
   a compiled train step: copied around it, `audit.track_optimizer`) is recomputed as
   ``reference.compile`` states it: a correctly rounded square root (rule 2), each field bit for
   bit where the rule says so, else within `reference.compile.compiled_step_ulp` ULPs of ``x_abs``
   (rule 6: the row's native bound plus the float32 step scalars' error), on any CPU kernels.
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
ULP distance explodes where an update cancels to near zero), but float32 steps of a row's
``native_exact`` implementations (Adam and AdamW, for-loop and foreach), which the spec computes
with the kernels' fused multiply-adds (`reference.optim._common` rule 7), bit for bit. NaN
compares as a class.
Parameters held in bfloat16 or float16 (`audit.lost`): bit for bit on scalar and native kernels
alike (`reference.lowprec` rules 13 and 15), but fused Adam and AdamW on native kernels, within
``reference.lowprec.FUSED_NATIVE_ULPS`` ULPs of the 16-bit format at ``x_abs``.

A step is not replayed, with the reason in the report, when it holds something outside the
specification: an optimizer class `audit.optimizers` does not find, bfloat16 or float16 parameters, a tensor learning rate
the spec does not take (other than one float32/float64 element, or on a path whose spec refuses one),
``capturable``/``differentiable``, a norm order other than 2 and inf, or fused SGD unscaled by
its own kernel. The scaler and skip stages of such a step are still checked. On another device
(a GPU) found_inf, the skip, the unscale, value clipping and the scale update are compared, bit
for bit as on every device; norm clipping and the optimizer step are not, and their numbers are
not copied.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from audit import _torch_compat  # noqa: F401  (checks the private torch names the audit uses)
from audit import optimizers, worker
from audit.compiled import COMPILED_REPLAY
from audit.lost import LOW_DTYPES, LostBook, LowPrecisionStage, low_precision
from audit.sampling import SampleBook, Sampling
from audit.optimizers import OptimizerRef, optimizer_ref  # noqa: F401  (re-exported)
from audit.stages import CLIP_ULP, NORM_ULP, NotReplayable, StepStages, UpdateCheck
from reference import compile as compile_rules
from reference import optim
from reference.optim._common import NATIVE_KERNELS

__all__ = ["Replayer", "Divergence", "NORM_ULP", "CLIP_ULP"]

# The bounds for native kernels: the optimizers' are their spec rows' (``native_ulp``, read by
# audit/optimizers.py); the norm's and the clip's are the stages' (audit/stages.py).

# Rules whose breach changes the step's numbers: a divergence at the step of such a finding is
# its consequence, reported with the finding (its expected and got), not as a second finding.
EXPLAINING_RULES = frozenset({"clip-before-unscale", "unscale-twice", "scale-twice", "update-without-step",
                              "step-bypasses-scaler", "new-scaler-mid-run", "optimizer-before-to"})


_NotReplayable = NotReplayable


@dataclass
class Divergence:
    step: int
    optimizer: str
    field: str
    expected: Any
    got: Any
    detail: str
    where: str
    hooks: str | None = None  # the optimizer's own step hooks at that step (the cause may be theirs)


from audit.compare import _compare
from audit.events import Divergences
from audit.rules import dispatch


MODES = ("process", "thread", "inline")


def worker_available() -> bool:
    """Whether ``process`` mode can run here."""
    return worker.available()


def default_mode() -> str:
    """``process`` where a forked worker with shared memory is available (Linux), else ``thread``;
    ``AMPSPEC_AUDIT_REPLAY`` (one of `MODES`) chooses otherwise."""
    chosen = os.environ.get("AMPSPEC_AUDIT_REPLAY", "").strip().lower()
    if chosen:
        if chosen not in MODES:
            raise ValueError(f"AMPSPEC_AUDIT_REPLAY must be one of {', '.join(MODES)}, got {chosen!r}")
        if chosen == "process" and not worker.available():
            raise ValueError("AMPSPEC_AUDIT_REPLAY=process needs Linux (os.fork and os.memfd_create)")
        return chosen
    return "process" if worker.available() else "thread"


class Replayer(StepStages, UpdateCheck, LowPrecisionStage):
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

    def __init__(self, mode: str | None = None, sampling: Sampling | None = None) -> None:
        self.book = SampleBook(sampling if sampling is not None else Sampling())
        self.mode = default_mode() if mode is None else mode
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._queue: queue.Queue | None = queue.Queue(maxsize=self._QUEUE) if self.mode == "thread" else None
        self._worker: threading.Thread | None = None
        self._error: BaseException | str | None = None
        self.capability = torch.backends.cpu.get_cpu_capability()
        self.exact = self.capability == "DEFAULT"
        self.native = self.capability in NATIVE_KERNELS  # reference.optim._common rule 7 holds here
        self.divergences: list[Divergence] = []
        self.findings: list[Any] = []  # findings of the replay (a second unscale seen in the numbers)
        self.not_replayed: dict[str, int] = {}
        self.steps_replayed = 0
        self.steps_bit_exact = 0
        self.updates_checked = 0
        self.worst: dict[str, float] = {}
        self.lost = LostBook()  # the lost updates of bfloat16/float16 parameters (update-lost-to-rounding)
        self.lost_summary: dict[str, dict[str, Any]] = {}  # per parameter measured, the run's totals
        self._found: dict[tuple[str, int], bool] = {}  # (optimizer, step) -> the spec's found_inf
        self._expected_after: dict[str, Any] = {}  # scaler label -> the scale its last update left
        self.process: Any = None
        self.fallback: str | None = None
        if self.mode == "process":
            try:
                self.process = worker.ReplayProcess(self._QUEUE, _worker_replayer)
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
        sgd, adam = optim.spec("SGD").native_ulp, optim.spec("Adam").native_ulp
        return (f"{self.capability} CPU kernels: found_inf, skip, scale, growth tracker, unscaled, value-clipped "
                f"and given-total-clipped gradients bit for bit; total norms within {NORM_ULP} ULP, norm-clipped "
                f"gradients within {CLIP_ULP} ULP; SGD within {sgd['momentum_buffer']}/{sgd['param']} ULP "
                f"(buffer/parameter) and Adam(W) within {adam['exp_avg']}/{adam['param']} ULP (moments/parameter) "
                "of x_abs, the other optimizers within theirs (their spec rows' native_ulp), except float32 steps of "
                f"{_native_rows()}: bit for bit")

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
                "updates_checked": self.updates_checked, "worst": self.worst, "lost": self.lost}

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

    def sample_for(self, o: Any, params: list[Any]) -> tuple[bool, Any]:
        """For the step optimizer track ``o`` is in: (whether the sampling leaves it out, the
        `audit.sampling.StepSample` of its optimizer stage or None for the whole of it)."""
        return self.book.for_step(o, params, _sample_mode)

    def step(self, o: Any, d: Any, rec: Any, recorder: Any) -> None:
        """Replay one step of optimizer track ``o`` (where the mode says)."""
        if self.book.left_out(d, rec):  # nothing was copied: nothing to send
            return

        def done(result: tuple[str, float | None]) -> None:
            rec.replay = result[0]
            if rec.clip_coef is None:
                rec.clip_coef = result[1]

        self._submit("_step", (optimizer_ref(o, self.process is not None), d, rec), owner=d, on_done=done)

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
        self._edits = 0
        self._hooks = d.hooks
        self._stochastic = False
        try:
            self._replay_step(o, d, rec)
        except _NotReplayable as exc:
            rec.replay = f"partly replayed: {exc}" if len(self.divergences) == before else rec.replay
            self._note(str(exc))
        else:
            self.steps_replayed += 1
        if len(self.divergences) > before:
            rec.replay = f"diverged: {self.divergences[before].field}"
        elif rec.replay == "off" and self._stochastic:
            rec.replay = ("within the envelope of stochastic rounding (each bfloat16 weight one of the two "
                          "neighbours of the float32 step's result; its random bits are not observable)")
        elif rec.replay == "off":
            exact = self._max_seen == 0.0
            self.steps_bit_exact += int(exact)
            rec.replay = "bit for bit" if exact else f"within the bounds (largest {self._max_seen:.1f} ULP)"
            if getattr(d, "compiled", False):
                rec.replay = f"{COMPILED_REPLAY}: {rec.replay}"
            if self._edits:
                rec.replay += ", from gradients the loop changed between stages"
        if d.sample is not None and not rec.replay.startswith(("not replayed", "partly replayed")):
            rec.replay += f"; optimizer stage on a sample: {d.sample.describe()}"

    def _diverge(self, o: Any, rec: Any, fld: str, got: Any, expected: Any, detail: str, where: str) -> None:
        self.divergences.append(Divergence(rec.step, o.label, fld, expected, got, detail, where,
                                           getattr(self, "_hooks", None)))

    def _check(self, o: Any, rec: Any, fld: str, got: np.ndarray, expected: np.ndarray, bound: int, where: str,
               x_abs: Any = None, at: Any = None) -> bool:
        c = _compare(got, expected, bound, x_abs, at)
        if c.problem is None:
            self._max_seen = max(self._max_seen, c.worst)
            return True
        self._diverge(o, rec, fld, c.got, c.expected, c.problem, where)
        return False

    # ------------------------------------------------------------------ the optimizer stage

    def _stage_optimizer(self, o: OptimizerRef, d: Any, rec: Any, where: str) -> None:
        """Stage 4: the optimizer step from torch's parameters, gradients and state."""
        self._replay_optimizer(o, d, rec, where)

    def _replay_optimizer(self, o: OptimizerRef, d: Any, rec: Any, where: str) -> None:
        for p_np in d.params_before:
            if p_np is not None and p_np.dtype not in (np.float32, np.float64) and str(p_np.dtype) not in LOW_DTYPES:
                raise _NotReplayable(f"{p_np.dtype} parameters (the specification's optimizers take float32 and float64)")
        if o.entry is None:
            raise _NotReplayable(o.refused)
        if d.sample is not None and (len(d.sample.shapes) != len(d.params_before)
                                     or all(p is None for p in d.params_before)):
            raise _NotReplayable("the optimizer's parameters changed during the step (the sample no longer fits)")
        if o.stochastic:
            self._stochastic_step(o, d, rec, where)
            return
        low = low_precision(d.params_before)
        if low is not None:
            self._count_lost(o, d, rec, where)
        step = o.entry.spec.step if low is None else self._low_precision_step(o, d, low)
        native = self.native and low is None
        for idx, cfg, params, grads, states, (new_params, _, new_states) in self._spec_steps(o, d, step, native):
            exact = self.exact or (native and _native_exact(o, d, d.groups[d.group_of[idx[0]]], params))
            for j, i in enumerate(idx):
                self._compare_param(o, rec, cfg, i, params[j], grads[j], states[j], new_params[j], new_states[j],
                                    d, where, exact)

    # The stage mixins (audit.lost.LowPrecisionStage) reach the module's function through the replayer.
    _spec_steps = staticmethod(lambda o, d, step, native=False: _spec_steps(o, d, step, native))

    def _compare_param(self, o: OptimizerRef, rec: Any, cfg: Any, i: int, p: np.ndarray, g: Any, old: Any,
                       new_p: np.ndarray, new: Any, d: Any, where: str, eager_exact: bool | None = None) -> None:
        """One parameter and its state after the step: scalar fields (the step counter) bit for
        bit, arrays within the row's bound in ULPs of the spec's magnitudes (none where
        ``eager_exact``, which defaults to the kernels being scalar)."""
        name = f"parameter {i}"
        if g is None:
            self._check(o, rec, f"{name} (no gradient) after the step", d.params_after[i], new_p, 0, where,
                        at=None if d.sample is None or d.sample.whole(i) else (d.sample.indices(i), d.sample.shapes[i]))
            return
        entry, torch_state = o.entry, d.state_after[i]
        low = np.asarray(p).dtype.itemsize == 2 and str(np.asarray(p).dtype) in LOW_DTYPES and not getattr(d, "compiled", False)
        exact, bound = (self._low_bounds(o, d, i) if low else
                        _field_bounds(self.exact if eager_exact is None else eager_exact, o, d, cfg, i, old, new))
        x_abs = _magnitudes(entry, cfg, (p, g, old, new), exact)
        at = None if d.sample is None or d.sample.whole(i) else (d.sample.indices(i), d.sample.shapes[i])
        for fld in dataclasses.fields(new):
            value, got = getattr(new, fld.name), torch_state.get(fld.name)
            if value is None or got is None:
                continue
            if isinstance(value, np.floating):
                label = "step counter" if fld.name == "step" else fld.name
                # A compiled step's float32 scalar state (NAdam's mu_product) within its rule-5 error.
                scalar = 0 if fld.name == "step" or exact or not getattr(d, "compiled", False) else bound(fld.name)
                self._check(o, rec, f"{label} of {name}", value.dtype.type(np.asarray(got).reshape(())), value,
                            scalar, where, None if scalar == 0 else lambda ix, v=value: np.abs(np.float64(v)))
            elif np.isfinite(bound(fld.name)):
                self._check(o, rec, f"{fld.name} of {name}", got, value, bound(fld.name), where,
                            x_abs(fld.name), at if np.shape(value) == np.shape(p) else None)
        if np.isfinite(bound("param")):  # inf: reference.compile leaves the bound undetermined (RAdam's branch)
            self._check(o, rec, name, d.params_after[i], new_p, bound("param"), where, x_abs("param"), at)

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
        recorder.findings.extend(dispatch(Divergences(rest)))
        recorder.findings.extend(self._lost_findings(recorder))


def compiled_rule(o: OptimizerRef) -> Any:
    """`reference.compile`'s rule 6 for the optimizer of a compiled step, or NotReplayable naming
    why there is none (a registered optimizer, a torch version the rules were not measured on)."""
    if not o.entry.builtin:
        raise _NotReplayable(f"a compiled step of {o.kind}, a registered optimizer (the compile rules cover "
                             "the specification's rows only)")
    try:
        return compile_rules.compiled_step_rule(o.entry.spec.name, torch.__version__)
    except (KeyError, ValueError) as exc:
        raise _NotReplayable(f"a compiled step ({exc.args[0]})") from None


def _field_bounds(eager_exact: bool, o: OptimizerRef, d: Any, cfg: Any, i: int, old: Any, new: Any) -> tuple[bool, Any]:
    """(bit for bit, the bound of a field in ULPs of ``x_abs``) for parameter ``i``. An eager
    step: 0 on scalar CPU kernels (``eager_exact``), else the row's native bound. A compiled step
    (`reference.compile`, whatever the CPU kernels): 0 where rule 6 says its implementation is
    bitwise; the row's native bound where the step runs mostly eagerly; else
    `compiled_step_ulp` (the native bound plus the float32 scalars' error at this step)."""
    entry = o.entry
    if not getattr(d, "compiled", False):
        return eager_exact, lambda fld: 0 if eager_exact else entry.bound(fld)
    rule = compiled_rule(o)
    impl = "foreach" if d.groups[d.group_of[i]].get("foreach") else "for-loop"
    if impl in rule.bitwise:
        return True, lambda fld: 0
    native = entry.spec.native_ulp
    if rule.eager:
        return False, lambda fld: native.get(fld, 0)
    step = float(new.step) if getattr(new, "step", None) is not None else 1.0
    mu = float(getattr(old, "mu_product", None) or 1.0)
    return False, lambda fld: compile_rules.compiled_step_ulp(entry.spec.name, fld, native.get(fld, 0), cfg, step, mu)


def _worker_replayer() -> Replayer:
    """The replayer of the forked worker (`audit.worker` runs it; it does not import this module)."""
    return Replayer(mode="inline")


def _sample_mode(obj: Any) -> str:
    """How `audit.sampling` may sample the optimizer stage of ``obj``'s row: ``elements`` (an
    element-wise row of the specification), ``tensors`` (another of its rows), ``whole`` (a
    registered or an unknown optimizer)."""
    entry, _ = optimizers.lookup(type(obj))
    if entry is None or not entry.builtin:
        return "whole" if entry is None else "registered"
    return "elements" if entry.spec.elementwise else "tensors"


def _native_exact(o: OptimizerRef, d: Any, group: dict[str, Any], params: list[np.ndarray]) -> bool:
    """Whether the spec computes an eager step of this group bit for bit on native kernels: its
    implementation is in the row's ``native_exact`` and its parameters are float32
    (`reference.optim._common` rule 7)."""
    return (_implementation(group) in o.entry.spec.native_exact and not getattr(d, "compiled", False)
            and all(p.dtype == np.float32 for p in params))


def _spec_steps(o: OptimizerRef, d: Any, step: Any, native: bool = False) -> Any:
    """Per parameter group: its indices, the spec's configuration, its parameters, gradients and
    states before ``step`` (the spec row's, or `reference.master_weights.float32_step` on it), and
    the triple ``step`` returns. ``native``: the machine's kernels are native, and ``step`` is the
    row's: a group `_native_exact` says is computed with their fusions."""
    row = o.entry.spec
    for gi, group in enumerate(d.groups):
        idx = [i for i, g in enumerate(d.group_of) if g == gi and d.params_before[i] is not None]
        if not idx:
            continue  # a group the sample left out
        cfg, impl = _spec_config(o, group)
        lr = _tensor_lr(group["lr"]) if isinstance(group.get("lr"), torch.Tensor) else cfg.lr
        params = [d.params_before[i] for i in idx]
        grads = [d.step_grads[i] for i in idx]
        # A 16-bit parameter's state is read against its float32 widening (the spec's rows init float32).
        states = tuple(row.state_from(d.state_before[i], _wide(params[j]), cfg) for j, i in enumerate(idx))
        if impl in row.kernel_scaled:
            if d.kernel_unscale and row.kernel_skip_refused(cfg):
                raise _NotReplayable(f"{row.name} unscaled by its own kernel: {row.kernel_skip_refused(cfg)}")
            kwargs = {"grad_scale": d.scale if d.kernel_unscale else None,
                      "found_inf": float(d.torch_found_inf or 0.0) if d.amp_aware else 0.0}
        elif getattr(d, "compiled", False) and not compiled_rule(o).eager:
            kwargs = {"sqrt": None}  # reference.compile rule 2: a compiled square root is correctly rounded
        else:
            kwargs = {"sqrt": _torch_sqrt(impl)}
            if native and _native_exact(o, d, group, params):
                kwargs["native"] = True
        try:
            # One call a run of small tensors where the row says its elements do not depend on
            # their places (the same bits; a step costs about 60 us of Python a parameter).
            result = row.step_joined(impl, params, grads, states, cfg, lr=lr, **kwargs) if step == row.step else None
            if result is None:
                result = step(impl, params, grads, states, cfg, lr=lr, **kwargs)
        except ValueError as exc:
            if not isinstance(lr, np.ndarray):
                raise
            raise _NotReplayable(f"a tensor learning rate ({exc})") from None
        yield idx, cfg, params, grads, states, result


def _spec_config(o: OptimizerRef, group: dict[str, Any]) -> tuple[Any, str]:
    """The spec's configuration and implementation for one torch parameter group."""
    if group.get("differentiable") or group.get("capturable"):
        raise _NotReplayable("a capturable or differentiable optimizer")
    if isinstance(group.get("lr"), torch.Tensor):
        _tensor_lr(group["lr"])  # refuses what the spec does not take
        group = dict(group, lr=float(group["lr"]))  # the configuration holds its value
    impl = _implementation(group)
    if impl not in o.entry.spec.steps:
        raise _NotReplayable(f"{o.kind}'s {impl} implementation (the specification has "
                             f"{', '.join(o.entry.spec.steps)})")
    try:
        return o.entry.config(group), impl
    except (ValueError, KeyError, TypeError) as exc:
        raise _NotReplayable(f"{o.kind} hyperparameters outside the specification ({exc})") from None


def _native_rows() -> str:
    """The rows and paths the spec steps bit for bit on native kernels, for the report."""
    rows = [f"{row.name} ({', '.join(sorted(row.native_exact))})" for row in optim.SPECS.values() if row.native_exact]
    return ", ".join(rows) or "no optimizer"


def _implementation(group: dict[str, Any]) -> str:
    """The torch implementation a parameter group steps with."""
    return "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"


def _tensor_lr(lr: torch.Tensor) -> np.ndarray:
    """A tensor lr as the spec takes it (reference.optim._lr): a 0-d float32/float64 array."""
    if lr.numel() != 1 or lr.dtype not in (torch.float32, torch.float64) or lr.requires_grad:
        raise _NotReplayable(f"a tensor learning rate of {lr.numel()} elements, {lr.dtype}"
                             f"{', requiring grad' if lr.requires_grad else ''} (the specification takes a "
                             "one-element float32/float64 tensor)")
    return np.asarray(lr.detach().cpu().reshape(()).numpy())


def _wide(p: np.ndarray) -> np.ndarray:
    """A bfloat16/float16 array widened to float32 (exact); any other as it is."""
    return p.astype(np.float32) if p.dtype.itemsize == 2 and str(p.dtype) in LOW_DTYPES else p  # str() is slow


def _torch_sqrt(impl: str) -> Any:
    if impl == "foreach":
        return lambda a: torch._foreach_sqrt([_as_tensor(a)])[0].numpy()
    return lambda a: torch.sqrt(_as_tensor(a)).numpy()


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor of its own shape: ``np.ascontiguousarray`` would make a 0-d array (1,)."""
    return torch.from_numpy(np.require(a, requirements="C"))


def _flat(a: np.ndarray, ix: np.ndarray) -> np.ndarray:
    return np.asarray(a).reshape(-1)[ix].astype(np.float64)


def _magnitudes(entry: Any, cfg: Any, values: tuple, exact: bool) -> Any:
    """``x_abs`` of one parameter's fields: a function of the field's name giving None (bit for bit,
    or a row without magnitudes: ULPs of the value) or a function of flat indices.

    Element-wise magnitudes (a spec row's ``elementwise``; a user's row is taken whole) are evaluated only at the elements the
    compare needs them for (those more than half the bound apart), not over the whole parameter;
    any other row's once over the whole parameter."""
    row, p = entry.spec, values[0]
    if exact or row.magnitudes is None:
        return lambda fld: None
    if entry.builtin and row.elementwise and np.ndim(p) > 0:
        return lambda fld: lambda ix: np.asarray(row.magnitudes(cfg, *_at(values, p.shape, ix))[fld], np.float64)
    mags = functools.cache(lambda: row.magnitudes(cfg, *values))
    return lambda fld: lambda ix: _flat(mags()[fld], ix)


def _at(values: tuple, shape: tuple[int, ...], ix: np.ndarray) -> list[Any]:
    """``values`` (arrays of the parameter's ``shape``, and states holding such arrays) at the
    flat indices ``ix``; scalars and other fields as they are."""

    def pick(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return v.reshape(-1)[ix] if v.shape == shape else v
        names = _init_fields(type(v))
        if names is None:
            return v
        return type(v)(**{n: pick(getattr(v, n)) for n in names})  # dataclasses.replace, without its checks

    return [pick(v) for v in values]


@functools.cache
def _init_fields(cls: type) -> tuple[str, ...] | None:
    """The names of a dataclass's fields its ``__init__`` takes (None: not a dataclass). Cached:
    `_at` rebuilds a state at every mismatch the compare looks at closely, a dozen a step."""
    if not dataclasses.is_dataclass(cls):
        return None
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)
