"""Lost updates of parameters held in bfloat16 or float16, counted by the replay over windows of steps.

``update-lost-to-rounding`` (`audit.checks_numbers`) reads what this module gathers. Its
definitions:

1. The measured parameters are those torch stores in bfloat16 or float16 (a model moved with
   ``model.to(torch.bfloat16)`` and stepped by its optimizer as it is). A float32 parameter is not
   measured: its update is lost only below 2**-25 of its weight, which no learning rate of a
   training gives, and the exact update would need the step in float64. An optimizer stepping a
   float32 master copy holds float32 parameters: nothing to measure, whatever the model's copy is.
2. The exact update of one element at one step is the update the optimizer's spec row computes
   in float32 from torch's own parameter, gradient and state before the step, each widened
   exactly from its 16-bit value: the update a float32 master copy would apply at that step from
   the same state. It is ``u = q - f32(p)`` in float32, ``q`` the float32 step's result
   (`reference.master_weights.float32_step`, that module's rule 5).
3. An element's update was lost when its exact update is finite and non-zero and torch's stored
   bits did not change across the step (`reference.health.applied_lost_count`, rule 12). The
   count is over the elements whose exact update is finite and non-zero.
4. A window is ``LOST_WINDOW`` replayed steps of one optimizer at which it was called (a step
   the scaler skipped calls nothing); the counts of each parameter are summed over the window,
   and the run's last window may be shorter. With ``--replay-every N`` the window's steps are
   those replayed; with a sampled optimizer stage the counts are over the sampled elements (the
   finding says so, with the sample's size).

The replay (`audit.replay`) calls `LostBook.add` in its worker at each measured step; the
windows travel back with its state, and `events` turns them into `audit.boundaries.LostUpdates`
in the process that reports, where the parameters' names are known.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from audit.boundaries import LostUpdates
from audit.rules import LOST_WINDOW, dispatch
from audit.stages import NotReplayable

__all__ = ["LOW_DTYPES", "LostBook", "LowPrecisionStage", "Window", "events", "low_precision", "stochastic_envelope"]

LOW_DTYPES = ("bfloat16", "float16")


def low_precision(params: list[Any]) -> str | None:
    """The name of the 16-bit float dtype among ``params`` (NumPy copies; None entries skipped), or None."""
    # itemsize first: str() of a dtype is slow, and the replay asks this of every parameter each step
    return next((str(p.dtype) for p in params if p is not None and p.dtype.itemsize == 2
                 and str(p.dtype) in LOW_DTYPES), None)


@dataclass
class Window:
    """One parameter's counts over one window (plain values: it travels between processes)."""

    optimizer: str
    index: int
    dtype: str
    shape: tuple[int, ...]
    sampled: str | None
    steps: list[int] = field(default_factory=list)
    where: str = "?"
    lost: int = 0
    counted: int = 0


@dataclass
class LostBook:
    """The windows of every measured parameter: those closed, and those still open."""

    closed: list[Window] = field(default_factory=list)
    open: dict[tuple[str, int], Window] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)  # optimizer -> measured steps in its open window

    def add(self, optimizer: str, index: int, step: int, where: str, before: np.ndarray, after: np.ndarray,
            exact: np.ndarray, shape: tuple[int, ...], sampled: str | None) -> None:
        """One parameter's step (definition 3), into its open window."""
        from reference import health  # the replay's: the order rules load no arithmetic of the spec

        lost, counted = health.applied_lost_count(before, after, exact)
        w = self.open.get((optimizer, index))
        if w is None:
            w = self.open[optimizer, index] = Window(optimizer, index, str(before.dtype), tuple(shape), sampled)
        w.steps.append(step)
        w.where, w.lost, w.counted = where, w.lost + lost, w.counted + counted

    def step_done(self, optimizer: str) -> None:
        """One measured step of ``optimizer``: its windows close after ``LOST_WINDOW`` of them."""
        self.steps[optimizer] = self.steps.get(optimizer, 0) + 1
        if self.steps[optimizer] >= LOST_WINDOW:
            self.steps[optimizer] = 0
            for key in [k for k in self.open if k[0] == optimizer]:
                self.closed.append(self.open.pop(key))

    def windows(self) -> list[Window]:
        """Every window, the open (shorter) ones last, each optimizer's in step order."""
        return sorted([*self.closed, *self.open.values()], key=lambda w: (w.optimizer, w.steps[0], w.index))


def events(book: LostBook, names: dict[str, list[str]]) -> list[LostUpdates]:
    """The windows as events, each with its parameter's name (``names``: optimizer -> one name
    per parameter index, as `audit.recorder` finds them) and the run's totals of that parameter."""
    wins = book.windows()
    totals: dict[tuple[str, int], tuple[int, int]] = {}
    for w in wins:
        lost, counted = totals.get((w.optimizer, w.index), (0, 0))
        totals[w.optimizer, w.index] = (lost + w.lost, counted + w.counted)
    out = []
    for w in wins:
        given = names.get(w.optimizer, [])
        name = given[w.index] if w.index < len(given) and given[w.index] else f"{w.index}"
        run = totals[w.optimizer, w.index]
        out.append(LostUpdates(w.steps[-1], w.where, w.optimizer, name, w.dtype, w.shape, w.lost, w.counted,
                               tuple(w.steps), w.sampled, run[0], run[1]))
    return out


# ---------------------------------------------------------------------------------- stochastic rounding

ENVELOPE_WEIGHT_ULPS = 2
"""float32 ULPs of the weight: torchao computes ``p - lr*wd*p`` where the spec has ``p*(1 - lr*wd)``
(one rounding each way), then subtracts the update (half an ULP of the result each way)."""
ENVELOPE_UPDATE_SHARE = 2.0**-12
"""Of the exact update: torchao's bias corrections are float32 tensors (``1 - f32(0.999)**step``
is off by up to 1.3e-5 relative at step 1, half that through the square root), the spec's are
Python floats; 2**-12 (2.4e-4) is 20 times that."""


def stochastic_envelope(after: np.ndarray, q: np.ndarray, before: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """The flat indices of the bfloat16 ``after`` that no stochastic rounding of the float32 step's
    result can give (`reference.master_weights` rule 7): a stochastic rounding of ``x`` is ``x``'s
    bfloat16 truncation toward zero or the next bfloat16 away from zero, and the optimizer's own
    float32 result may differ from the spec's ``q`` by ``tol = ENVELOPE_WEIGHT_ULPS`` float32 ULPs
    of the weight ``before`` (and one of ``q``) plus ``ENVELOPE_UPDATE_SHARE`` of the exact update.
    So ``after`` must lie between the truncation of ``|q| - tol`` and one bfloat16 above the
    truncation of ``|q| + tol``, on ``q``'s side of zero (either side where that range reaches 0).
    Elements whose ``q`` is not finite are not judged."""
    q64 = np.asarray(q, np.float64).reshape(-1)
    w32 = np.abs(np.asarray(before, np.float32).reshape(-1))
    tol = (ENVELOPE_WEIGHT_ULPS * np.spacing(w32).astype(np.float64)
           + np.spacing(np.abs(q64).astype(np.float32)).astype(np.float64)
           + ENVELOPE_UPDATE_SHARE * np.abs(np.asarray(exact, np.float64).reshape(-1)))
    a = np.asarray(after).astype(np.float32).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        low = np.maximum(np.abs(q64) - tol, 0.0).astype(np.float32)
        high = (np.abs(q64) + tol).astype(np.float32)
        # float32 rounding of the bounds may go inward: one float32 step outward.
        low = np.nextafter(low, np.float32(0))
        high = np.nextafter(high, np.float32(np.inf))
        floor_bits = low.view(np.uint32) & np.uint32(0xFFFF0000)
        ceil_bits = (high.view(np.uint32) & np.uint32(0xFFFF0000)) + np.uint32(0x10000)
        mag = np.abs(a).view(np.uint32)
        inside = (mag >= floor_bits) & (mag <= ceil_bits)
        side = (np.signbit(a) == np.signbit(q64)) | (np.abs(q64) <= tol) | (a == 0)
    judged = np.isfinite(q64)
    return np.flatnonzero(judged & ~(inside & side))


# ---------------------------------------------------------------------------------- the replay's part


class LowPrecisionStage:
    """The optimizer stage of 16-bit parameters (`audit.replay.Replayer` provides ``_spec_steps``,
    ``_check``, ``_diverge``, ``lost`` and the state they keep): the lost updates a step of
    bfloat16/float16 parameters counts, the envelope of a stochastic-rounding optimizer, and
    the ``update-lost-to-rounding`` findings at the end."""

    @staticmethod
    def _float32(o: Any) -> Any:
        """The spec row's step in float32 from 16-bit inputs (`reference.master_weights.float32_step`:
        the results ``q``, the exact updates ``u``, the float32 states), with `_spec_steps`' arguments."""
        row = o.entry.spec

        def float32(impl: str, params: Any, grads: Any, states: Any, cfg: Any, *, lr: Any = None, sqrt: Any = None,
                     grad_scale: Any = None, found_inf: float = 0.0) -> Any:
            if grad_scale is not None or found_inf:
                raise NotReplayable(f"{row.name} unscaled by its own kernel on 16-bit parameters (the exact "
                                     "update is not specified there)")
            from reference import master_weights  # the replay's: the order rules load no arithmetic of the spec

            return master_weights.float32_step(row, impl, params, grads, states, cfg, lr=lr, sqrt=sqrt)

        return float32

    def _low_precision_step(self, o: Any, d: Any, low: str) -> Any:
        """The step function that replays the optimizer stage of 16-bit parameters stepped by torch
        itself (`reference.lowprec`, the ``none`` option of `reference.master_weights`), with
        `_spec_steps`' arguments, on the machine's CPU kernels (`reference.lowprec` rule 13);
        NotReplayable naming the reason where the specification does not claim torch's bits: a
        pair it does not model, a mix of dtypes, an unscaling kernel, a tensor learning rate, or a
        CPU capability it does not know."""
        from reference import lowprec  # the replay's: the order rules load no arithmetic of the spec

        row, why = o.entry.spec, None
        impls = {"fused" if g.get("fused") else "foreach" if g.get("foreach") else "for-loop" for g in d.groups}
        missing = sorted(i for i in impls if not lowprec.covered(row.name, i))
        if {str(p.dtype) for p in d.params_before if p is not None} != {low}:
            why = f"a mix of {low} and other parameters in one optimizer"
        elif missing or not o.entry.builtin:
            why = f"torch's {row.name} ({', '.join(missing) or 'a user row'}) on {low} tensors is not modelled"
        elif self.capability not in lowprec.KERNELS:
            why = (f"{self.capability} kernels: the specification states torch's kernels on {low} tensors for "
                   f"{', '.join(lowprec.KERNELS)} only")
        if why is not None:
            raise NotReplayable(f"{low} parameters: the optimizer stage is not compared ({why}); its lost "
                                "updates are counted (update-lost-to-rounding)")
        storage = np.dtype(next(p for p in d.params_before if p is not None).dtype)

        def stepped(impl: str, params: Any, grads: Any, states: Any, cfg: Any, *, lr: Any = None, sqrt: Any = None,
                    grad_scale: Any = None, found_inf: float = 0.0) -> Any:
            if grad_scale is not None or found_inf:
                raise NotReplayable(f"{row.name} unscaled by its own kernel on {low} parameters (not modelled)")
            try:
                new_p, new_s = lowprec.step(row, impl, params, grads, [lowprec.state_to(s, storage) for s in states],
                                            cfg, lr=lr, kernels=self.capability)
            except NotImplementedError as exc:
                raise NotReplayable(f"{low} parameters: {exc}") from None
            return new_p, list(grads), new_s

        return stepped

    def _low_bounds(self, o: Any, d: Any, i: int) -> tuple[bool, Any]:
        """(bit for bit, the bound of a field in ULPs of S at ``x_abs``) of 16-bit parameter ``i``
        stepped by torch (`reference.lowprec.bound`): 0 but for fused Adam and AdamW on native kernels."""
        from reference import lowprec  # the replay's: the order rules load no arithmetic of the spec

        group = d.groups[d.group_of[i]]
        impl = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
        ulps = lowprec.bound(o.entry.spec.name, impl, self.capability)
        return ulps == 0, lambda fld: ulps

    def _stochastic_step(self, o: Any, d: Any, rec: Any, where: str) -> None:
        """An optimizer that rounds its bfloat16 weights stochastically (`audit.optimizers.STOCHASTIC_ROWS`),
        by envelope: each weight one of the two bfloat16 neighbours of the spec row's float32 result
        (`audit.lost.stochastic_envelope`); each state array as the spec's float32 state rounded to
        its dtype, within 1 ULP (torchao's float32 formulas differ from the row's by a few float32
        ULPs, which can move a rounding to the next value); a parameter without a gradient unchanged."""
        self._stochastic = True
        for idx, _, params, grads, _, (q, exact, new_states) in self._spec_steps(o, d, self._float32(o)):
            for j, i in enumerate(idx):
                before, after = d.params_before[i], d.params_after[i]
                at = None if d.sample is None or d.sample.whole(i) else (d.sample.indices(i), d.sample.shapes[i])
                if grads[j] is None or str(before.dtype) != "bfloat16":
                    self._check(o, rec, f"parameter {i}", after, before, 0, where, at=at)
                    continue
                bad = stochastic_envelope(after, q[j], before, exact[j])
                if bad.size:
                    k = int(bad[0])
                    self._diverge(o, rec, f"parameter {i}", float(after.reshape(-1)[k]), float(q[j].reshape(-1)[k]),
                                  f"{bad.size} of {after.size} elements are neither bfloat16 neighbour of the float32 "
                                  f"step's result (within its envelope); first at flat index {k}", where)
                for fld in dataclasses.fields(new_states[j]):
                    value, got = getattr(new_states[j], fld.name), d.state_after[i].get(fld.name)
                    if got is None or not isinstance(value, np.ndarray) or np.shape(value) != np.shape(got):
                        continue
                    if isinstance(got, np.ndarray) and got.dtype != value.dtype:
                        value = value.astype(got.dtype)  # the state stored back in its dtype, to nearest
                    self._check(o, rec, f"{fld.name} of parameter {i}", got, value, 1, where, at=at)

    def _count_lost(self, o: Any, d: Any, rec: Any, where: str) -> None:
        """The lost updates of the step's bfloat16/float16 parameters (`audit.lost`): the spec row's
        step in float32 from torch's widened inputs gives each element's exact update
        (`reference.master_weights` rule 5); torch's stored bits before and after say which were lost."""
        for idx, _, params, grads, _, (_, exact, _) in self._spec_steps(o, d, self._float32(o)):
            for j, i in enumerate(idx):
                before, after = d.params_before[i], d.params_after[i]
                if grads[j] is None or after is None or str(before.dtype) not in LOW_DTYPES:
                    continue  # no update, or a float32 parameter beside the low-precision ones
                whole = d.sample is None or d.sample.whole(i)
                shape = before.shape if d.sample is None else d.sample.shapes[i]
                sampled = None if whole else f"{before.size} of {int(np.prod(shape))} elements, seed {d.sample.seed}"
                self.lost.add(o.label, i, rec.step, where, before, after, exact[j], tuple(shape), sampled)
        self.lost.step_done(o.label)


    def _lost_findings(self, recorder: Any) -> list[Any]:
        """``update-lost-to-rounding``: each window of each measured parameter as an event, named
        from the recorder's optimizers, handed to the rules that read it; a parameter is reported
        at its first window over the threshold (the finding states the run's share too)."""
        names = {o.label: o.names or [] for o in recorder.optimizers.values()}
        found: set[tuple[str, str]] = set()
        out = []
        evs = events(self.lost, names)
        self.lost_summary = {}
        for ev in evs:  # the run's totals of each parameter, for the report's replay summary
            self.lost_summary[f"{ev.optimizer}'s {ev.parameter}"] = {
                "dtype": ev.dtype, "shape": list(ev.shape), "lost": ev.run_lost, "counted": ev.run_counted,
                "fraction": round(ev.run_lost / ev.run_counted, 6) if ev.run_counted else 0.0,
                "sampled": ev.sampled}
        for ev in evs:
            if (ev.optimizer, ev.parameter) not in found:
                new = list(dispatch(ev))
                found |= {(ev.optimizer, ev.parameter)} if new else set()
                out += new
        return out


