"""The replay's stages before and after the optimizer step: found_inf and the skip, the unscale,
each clipping call, the boundaries between them (`audit.boundaries`), and the scale update.

A part of `audit.replay.Replayer` (its mixins), kept beside it so that each file holds one idea:
here the scaler's and the clipping's stages, there where the work runs and the optimizer stage.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from audit import boundaries
from audit.optimizers import optimizer_ref
from audit.rules import dispatch
from reference import clipping, scaling

__all__ = ["StepStages", "UpdateCheck", "NotReplayable", "NORM_ULP", "CLIP_ULP"]

# The rules that read a boundary (`audit.boundaries.Boundary`) declare it (``events``, run by
# `audit.rules.dispatch`); these of them are the loop's own edits.
EDIT_RULES = ("gradients-modified-before-unscale", "gradients-modified-after-unscale")

# The conformance suite's bounds for native kernels (conformance/expectations.py derives each;
# tests/test_audit.py checks these stay equal to them).
NORM_ULP = 2
CLIP_ULP = 4


class NotReplayable(Exception):
    """A step (or the rest of it) holds something outside the specification: the reason."""


class StepStages:
    """The stages of one step but the optimizer's (`audit.replay.Replayer` provides ``_check``,
    ``_diverge``, ``_bound``, ``_stage_optimizer`` and the state they keep)."""

    def _replay_step(self, o: Any, d: Any, rec: Any) -> None:
        """The stages in the contract's order; each takes torch's own input at its boundary."""
        step_where = _call_where(rec, ("scaler.step@", "optimizer.step@", "optimizer.step (compiled)@"))
        present = [i for i, g in enumerate(d.scaled) if g is not None]
        for i in present:
            if d.scaled[i].dtype not in (np.float16, np.float32, np.float64, np.dtype(ml_dtypes.bfloat16)):
                raise NotReplayable(f"{d.scaled[i].dtype} gradients")
        first = f"{d.first_stage} at {_call_where(rec, (d.first_stage + '@',))}"
        if d.backward is not None:
            self._boundary(o, rec, d, "backward", first, present, [d.scaled[i] for i in present],
                           {i: d.backward[i] for i in present}, 0, None)
        state = self._stage_found_inf(o, d, rec, present, step_where)
        g_spec: dict[int, Any] = {i: d.scaled[i] for i in present}  # read-only arrays, never written
        prev, bound, after_unscale = first, 0, False
        early = [c for c in d.clips if c.before_unscale]  # clip-before-unscale: the clip saw scaled values
        for c in early:
            bound = self._clip_boundary_and_stage(o, d, rec, c, g_spec, prev, bound, False)
            self._scaled_norm(o, rec, c, d.scale)
            prev = f"{c.kind} at {c.where}"
        unscaled_here = self._stage_unscale(d, g_spec, state)
        after_unscale = unscaled_here or state is None  # without a scaler every gradient is unscaled
        if unscaled_here and not early:
            at = _call_where(rec, ("scaler.unscale_@",))
            prev = f"scaler.unscale_ at {at}" if at != "?" else f"the unscale inside scaler.step at {step_where}"
        for c in d.clips:
            if not c.before_unscale:
                bound = self._clip_boundary_and_stage(o, d, rec, c, g_spec, prev, bound, after_unscale)
                prev = f"{c.kind} at {c.where}"
        if d.step_grads is None:
            return  # a skipped step: the optimizer was not called
        idx = [i for i, g in enumerate(d.step_grads) if g is not None]
        self._boundary(o, rec, d, prev, f"the optimizer step at {step_where}", idx, [d.step_grads[i] for i in idx],
                       g_spec if d.sample is None else _at_sample(g_spec, d.sample), bound, step_where,
                       after_unscale=after_unscale)
        if not d.on_cpu:
            raise NotReplayable("parameters on a device other than the CPU")
        if d.params_after is not None:
            self._stage_optimizer(o, d, rec, step_where)

    def _stage_found_inf(self, o: Any, d: Any, rec: Any, present: list[int], step_where: str) -> Any:
        """Stage 1: found_inf of the scaled gradients against the scaler's flag, and the skip.
        Returns the scaler state the unscale uses (None without an enabled scaler)."""
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
        return scaling.ScalerState(d.scale, 0, 1) if d.scale is not None else None

    def _stage_unscale(self, d: Any, g_spec: dict[int, Any], state: Any) -> bool:
        """Stage 2: the spec's unscale of the gradients in ``g_spec`` (the scaled ones, or what a
        clip before the unscale left), in place; whether it happened here (the fused kernel's own
        division happens in the optimizer stage)."""
        if state is None or not d.unscaled:  # no unscale_ ran (the fused kernel's own, or none at all)
            return False
        keys = [i for i, g in g_spec.items() if g is not None]
        unscaled, _ = scaling.unscale_gradients([g_spec[i] for i in keys], state)
        g_spec.update(zip(keys, unscaled))
        return True

    def _clip_boundary_and_stage(self, o: Any, d: Any, rec: Any, c: Any, g_spec: dict[int, Any],
                                 prev: str, bound: int, after_unscale: bool) -> int:
        self._boundary(o, rec, d, prev, f"{c.kind} at {c.where}", c.indices, c.grads_in, g_spec, bound, c.where,
                       after_unscale=after_unscale)
        return self._stage_clip(o, d, rec, c, g_spec)

    def _scaled_norm(self, o: Any, rec: Any, c: Any, scale: Any) -> None:
        """A clip of scaled gradients: the norm it measured against the unscaled gradients' norm
        (a divergence that the clip-before-unscale finding of this step explains and carries)."""
        if c.total_norm is None or scale is None or not float(scale):
            return
        got = float(np.asarray(c.total_norm).reshape(()))
        self._diverge(o, rec, f"total norm seen by {c.kind} at {c.where}", got, got / float(scale),
                      f"the clip measured the scaled gradients' norm {got!r}, {float(scale)!r} times the "
                      "unscaled one", c.where)

    def _stage_clip(self, o: Any, d: Any, rec: Any, c: Any, g_spec: dict[int, Any]) -> int:
        """Stage 3, one clipping call, from torch's input to it: its total norm against torch's;
        its clipped gradients go to ``g_spec``. Returns the bound their next check uses."""
        ins = [(i, g) for i, g in zip(c.indices, c.grads_in) if g is not None]
        if c.kind != "clip_grad_value_" and not d.on_cpu:
            raise NotReplayable(f"{c.kind} on a device other than the CPU (its rules there are not the CPU's)")
        if c.kind == "clip_grad_value_":
            out, bound = clipping.clip_grad_value([g for _, g in ins], float(c.arguments["clip_value"])), 0
        elif c.kind == "clip_grad_norm_":
            norm_type = float(c.arguments.get("norm_type", 2.0))
            if norm_type not in (2.0, math.inf):
                for i, _ in ins:
                    g_spec[i] = None
                raise NotReplayable(f"clip_grad_norm_ with norm_type={norm_type!r}")
            if c.total_norm is None:
                raise NotReplayable("a clip_grad_norm_ call that raised")
            res = clipping.clip_grad_norm([g for _, g in ins], float(c.arguments["max_norm"]), norm_type,
                                          num_threads=c.threads)
            total = np.asarray(res.total_norm)
            torch_total = np.asarray(c.total_norm).astype(total.dtype).reshape(())
            self._check(o, rec, f"total norm of {c.kind} at {c.where}", torch_total, total.reshape(()),
                        self._bound(NORM_ULP), c.where)
            out, bound = list(res.grads), self._bound(CLIP_ULP)
        else:  # clip_grads_with_norm_: the coefficient of the total the loop computed, exact
            total = c.arguments.get("total_norm")
            if not isinstance(total, np.ndarray) or total.size != 1:
                for i, _ in ins:
                    g_spec[i] = None
                raise NotReplayable(f"clip_grads_with_norm_ with a total_norm of type {type(total).__name__}")
            res = clipping.clip_grads_with_norm([g for _, g in ins], float(c.arguments["max_norm"]), total)
            out, bound = list(res.grads), 0
        if c.kind != "clip_grad_value_" and rec.clip_coef is None:
            rec.clip_coef = float(res.clip_coef)
        for (i, _), g in zip(ins, out):
            g_spec[i] = g
        return bound

    def _boundary(self, o: Any, rec: Any, d: Any, prev: str, into: str, indices: list[int],
                  got: list[Any], spec: dict[int, Any], bound: int, where: str | None,
                  after_unscale: bool = False) -> None:
        """torch's input to stage ``into`` against what the spec's previous stage ``prev`` gave
        (`audit.boundaries`): agreement, a second unscale or scale (errors), a numeric
        divergence of the previous stage, or the loop's own edit (info). The next stage starts
        from torch's input whatever it is."""
        pairs = [(i, g, spec[i]) for i, g in zip(indices, got) if g is not None and spec.get(i) is not None]
        ch = boundaries.measure(pairs, bound, d.scale)
        if ch is None:
            return
        if ch.kind == "none":
            self._max_seen = max(self._max_seen, ch.worst)
            return
        where = where or into.rsplit(" at ", 1)[-1]
        ev = boundaries.Boundary(rec.step, where, prev, into, ch, f"{len(ch.changed)} of {len(pairs)} gradients",
                                 d.scale, after_unscale)
        if ev.divergence:
            self._diverge(o, rec, f"gradients entering {into}", ch.got, ch.expected, ch.detail, where)
            return
        for f in dispatch(ev):
            self.findings.append(f)
            self._edits += int(f.rule in EDIT_RULES)


class UpdateCheck:
    """The scale update's stage: each ``scaler.update`` against the spec's."""

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

    def _update(self, label: str, closes: list[tuple[Any, Any]], before: tuple[Any, int],
                after: tuple[Any, int], new_scale: float | None, factors: tuple[float, float, int]) -> None:
        if not closes:
            return
        self._hooks = None
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


def _at_sample(g_spec: dict[int, Any], sample: Any) -> dict[int, Any]:
    """The spec's gradients at the elements the optimizer stage's sample took (`audit.sampling`):
    what the sampled copies of torch's gradients entering the step are compared with."""
    out: dict[int, Any] = {}
    for i, g in g_spec.items():
        if g is None or i >= len(sample.shapes) or sample.omitted(i):
            out[i] = None
        else:
            ix = sample.indices(i)
            out[i] = g if ix is None else np.asarray(g).reshape(-1)[ix]
    return out


def _call_where(rec: Any, prefixes: tuple[str, ...]) -> str:
    """The call site of the step's last call with one of ``prefixes`` (``name@file:line``)."""
    return next((c.split("@", 1)[1] for c in reversed(rec.calls) if c.startswith(prefixes)), "?")
