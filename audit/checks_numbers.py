"""The rules the replay decides from the numbers, each declared on its check.

The boundary checks read one `audit.boundaries.Boundary` (torch's input to a stage against what
the spec's previous stage gave, classified by `audit.boundaries.measure`); ``replay-divergence``
reads the replay's divergences that no order finding explains; ``update-lost-to-rounding`` reads
one parameter's lost updates over a window of replayed steps (`audit.boundaries.LostUpdates`).
``unscale-twice``, found from
the numbers as well as from the calls, has its check with the scaler's rules
(`audit.checks_scaler`). They yield findings and change nothing.
"""

from __future__ import annotations

from typing import Any, Iterator

from audit.events import Divergences
from audit.findings import ERROR, INFO, WARNING, Finding, rule


@rule("scale-twice", ERROR,
      "the gradients were multiplied by the loss scale once more after backward",
      "scale the loss once, with scaler.scale(loss); never multiply the gradients by scaler.get_scale()",
      doc="gradients multiplied by the loss scale after backward (seen by the replay)", events=("Boundary",))
def scale_twice(ev: Any) -> Iterator[Finding]:
    """Every changed gradient at a boundary is the expected one multiplied by the loss scale."""
    ch = ev.change
    if ch.kind != "scale":
        return
    yield Finding("scale-twice", ev.step, ev.where,
                  f"the gradients were multiplied by the loss scale {float(ev.scale)!r} {ev.between} ({ev.count}; "
                  f"{ch.detail}): the update is that many times too large", expected=ch.expected, got=ch.got)


def _edit(ev: Any, rule_name: str) -> Finding:
    ratio = ev.change.ratio
    return Finding(rule_name, ev.step, ev.where,
                   f"the loop's own code changed {ev.count} {ev.between}: the norm of the gradients is {ratio:.6g} "
                   f"times the specification's ({ev.change.detail}); the replay continued from the changed gradients",
                   expected="the previous stage's output", got=f"norm ratio {ratio:.6g}")


@rule("gradients-modified-before-unscale", INFO,
      "the loop's own code changed the scaled gradients between backward and scaler.unscale_",
      "nothing to fix if intended (masking, a custom clip on scaled values); the replay continued from "
      "the changed gradients",
      doc="your code changed the scaled gradients before the scaler saw them (norm ratio given)",
      events=("Boundary",))
def gradients_modified_before_unscale(ev: Any) -> Iterator[Finding]:
    """A boundary before the unscale where the gradients differ by more than a stage's rounding
    (or by a few ULPs from what backward left, which no spec stage computed) and by no factor of
    the scale: the loop's own edit (masking, a clip of its own on scaled values)."""
    if ev.change.kind in ("edit", "numeric") and not ev.divergence and not ev.after_unscale:
        yield _edit(ev, "gradients-modified-before-unscale")


@rule("gradients-modified-after-unscale", INFO,
      "the loop's own code changed the unscaled gradients before the next clipping call or the optimizer step",
      "nothing to fix if intended (per-parameter or adaptive clipping, masking: torch's AMP notes allow "
      "it); the replay continued from the changed gradients",
      doc="your code changed the gradients between `unscale_` (or a clip) and the next clip or the "
          "step: per-parameter or adaptive clipping, masking (norm ratio and the calls around it "
          "given)", events=("Boundary",))
def gradients_modified_after_unscale(ev: Any) -> Iterator[Finding]:
    """A boundary after the unscale (or without a scaler) where the gradients differ by more than a
    stage's rounding and by no factor of the scale: per-parameter or adaptive clipping, masking."""
    if ev.change.kind in ("edit", "numeric") and not ev.divergence and ev.after_unscale:
        yield _edit(ev, "gradients-modified-after-unscale")


@rule("replay-divergence", ERROR,
      "a stage of the step, fed torch's own input, computes otherwise in the specification",
      "read the field and the two values: torch, or a patched torch function, computes this stage "
      "differently from the step contract",
      doc="a stage of the step, fed torch's own input, computes otherwise in the specification; a "
          "warning when the optimizer has step hooks of your own", uncertain=WARNING, events=("Divergences",))
def replay_divergence(ev: Divergences) -> Iterator[Finding]:
    """The replay's divergences that no order finding of their step explains (`audit.replay`): one
    finding, at the first, naming both values and how many steps diverged; a warning when the
    optimizer has step hooks of the loop's own (they may change what the step computes)."""
    divergences = ev.divergences
    if not divergences:
        return
    first = divergences[0]
    steps = sorted({dv.step for dv in divergences})
    more = f"; {len(steps)} step(s) diverged in all (steps {_ranges(steps)})" if len(steps) > 1 else ""
    hooks = ""
    if first.hooks:  # user code inside the step: the difference may be theirs, not torch's
        hooks = (f"; {first.optimizer} has step hooks of its own ({first.hooks}), which may change what the "
                 "step computes: the audit cannot tell")
    yield Finding("replay-divergence", first.step, first.where,
                  f"step {first.step} of {first.optimizer}: {first.field}: {first.detail}{more}{hooks}",
                  expected=first.expected, got=first.got, level=WARNING if first.hooks else None)


LOST_FRACTION = 0.5
"""``update-lost-to-rounding`` warns when more than this share of a parameter's updates over a window were lost."""
LOST_WINDOW = 10
"""The window: this many replayed steps of the optimizer (the run's last window may be shorter)."""


@rule("update-lost-to-rounding", WARNING,
      "more than half of the updates of a parameter held in bfloat16 or float16 left its stored value unchanged "
      "over a window of steps: the optimizer's update rounded back to the old weight",
      "keep a float32 master copy of the parameters for the optimizer to step (cast the low-precision copy "
      "from it after each step), or an optimizer that keeps the rounding error: Kahan summation, or stochastic "
      "rounding (torchao.optim._AdamW(..., bf16_stochastic_round=True)); in ampspec's own trainer: "
      "precision.master_weights: fp32 (or kahan, stochastic)",
      doc=f"more than {LOST_FRACTION:.0%} of a bfloat16 or float16 parameter's updates over a window of "
          f"{LOST_WINDOW} replayed steps were "
          "lost: the stored bits did not change where the update computed in float32 from torch's own "
          "parameter, gradient and state was finite and non-zero (`reference.health` rule 12); the fraction "
          "is over the replay's sample when it samples", events=("LostUpdates",))
def update_lost_to_rounding(ev: Any) -> Iterator[Finding]:
    """One window of one parameter (`audit.boundaries.LostUpdates`): a finding when its lost
    updates are more than ``LOST_FRACTION`` of its counted ones (the elements whose exact update
    was finite and non-zero; a window with none counted is no finding)."""
    if not ev.counted or ev.lost <= LOST_FRACTION * ev.counted:
        return
    shape = "[" + ", ".join(str(n) for n in ev.shape) + "]"
    span = f"step {ev.steps[0]}" if len(ev.steps) == 1 else f"steps {ev.steps[0]}-{ev.steps[-1]}"
    over = f" (the replay's sample: {ev.sampled})" if ev.sampled else ""
    run = ev.run_lost / ev.run_counted if ev.run_counted else 0.0
    yield Finding("update-lost-to-rounding", ev.step, ev.where,
                  f"{ev.optimizer}'s parameter {ev.parameter} ({ev.dtype} {shape}): {ev.fraction:.1%} of its "
                  f"updates over {span} ({len(ev.steps)} replayed step(s)) were lost, {ev.lost} of {ev.counted} "
                  f"element updates{over}: the stored value did not change although the update computed in "
                  f"float32 was non-zero; over the run {run:.1%} ({ev.run_lost} of {ev.run_counted})",
                  expected=f"at most {LOST_FRACTION:.0%} of the updates lost", got=round(ev.fraction, 6))


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
