"""The GradScaler's rules, each declared on its check.

The checks read the events of the call sequence (`audit.sequence`: the spec's stage of each
optimizer before and after a call, and the spec's refusal) and the replay's boundaries
(`audit.boundaries.Boundary`); they yield findings and change nothing. The recorder calls
each at the event it reads, so that a finding names the call site.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from audit.events import DirectSteps, ScalerFirstDrive, StepReapplied
from audit.findings import ERROR, Finding, rule, spec_stages

if TYPE_CHECKING:
    from audit.sequence import StageCall, UpdateCall

# The checks take the stage names from `reference.scaling` when they run (`spec_stages`):
# ``import audit`` (the pytest plugin's start) loads neither the specification nor NumPy.


@rule("unscale-twice", ERROR,
      "the gradients were unscaled twice in one step",
      "unscale once per step: scaler.unscale_(optimizer) before clipping, or let scaler.step do it; "
      "never divide the gradients by the scale by hand as well",
      framework_fixes={
          "accelerate": "call accelerator.clip_grad_norm_ (it unscales) once per step, under "
                        "`if accelerator.sync_gradients:`, and no scaler.unscale_ of your own",
          "lightning.fabric": "call fabric.clip_gradients (it unscales) once per step, after the last microbatch",
          "lightning.pytorch": "leave unscaling to the precision plugin: clip with Trainer(gradient_clip_val=...) "
                               "and do not call scaler.unscale_ in a hook"},
      doc="a second `unscale_` in one step, or gradients divided by the scale by hand, after "
          "`unscale_` or before `scaler.step` unscales them again (seen by the replay)",
      events=("StageCall", "Boundary"))
def unscale_twice(ev: StageCall | Any) -> Iterator[Finding]:
    """A ``scaler.unscale_`` that the spec's sequence meets at UNSCALED (torch raises right after,
    `reference.scaling.unscale_stage`); or, from the numbers (a `audit.boundaries.Boundary`),
    gradients reaching a stage equal to the unscaled gradients unscaled once more (by the inverse
    or by a division by the scale), after ``unscale_`` or before ``scaler.step`` unscales them."""
    UNSCALED = spec_stages().UNSCALED  # the spec's name, read when the check runs (above)
    if getattr(ev, "change", None) is None:  # a call of the sequence, not a boundary of the replay
        if ev.call == "unscale_" and ev.before.stage == UNSCALED:
            yield Finding("unscale-twice", ev.step, ev.where,
                          f"scaler.unscale_({ev.optimizer}) called a second time since the last update (torch "
                          f"raises {ev.refused!r})", expected="one scaler.unscale_ per step",
                          got="a second scaler.unscale_")
        return
    ch = ev.change
    if ch.kind == "unscale":
        again = "they were unscaled already" if ev.after_unscale or ev.prev != "backward" else \
            "the scaler unscales them again"
        yield Finding("unscale-twice", ev.step, ev.where,
                      f"the gradients were divided by the loss scale {float(ev.scale)!r} by hand {ev.between} "
                      f"({ev.count}; {ch.detail}); {again}", expected=ch.expected, got=ch.got)


@rule("step-without-update", ERROR,
      "scaler.step(optimizer) was not followed by scaler.update()",
      "call scaler.update() once after the scaler.step calls of every optimizer step",
      doc="`scaler.step` not followed by `scaler.update`", events=("StageCall",))
def step_without_update(ev: StageCall) -> Iterator[Finding]:
    """An optimizer that the spec's sequence holds at STEPPED when the scaler unscales or steps it
    again (torch raises there) or when the run ends: its ``scaler.step`` had no ``update`` after
    it. Scaling another loss first is no finding (a GAN's generator loss after the
    discriminator's step, with one update for both)."""
    STEPPED = spec_stages().STEPPED  # as UNSCALED above
    if ev.before.stage != STEPPED:
        return
    if ev.call == "end":
        message = f"the run ended after scaler.step({ev.optimizer}) at {ev.last_step_where} without scaler.update()"
    else:
        message = (f"scaler.step({ev.optimizer}) at {ev.last_step_where} was not followed by scaler.update(); torch "
                   f"raises at scaler.{ev.call} at {ev.where} ({ev.refused!r})")
    yield Finding("step-without-update", ev.step - 1, ev.last_step_where, message,
                  expected="scaler.update() after scaler.step", got="no scaler.update()")


@rule("update-without-step", ERROR,
      "scaler.update() ran on a step whose optimizer step did not go through scaler.step",
      "call scaler.step(optimizer) instead of optimizer.step(): it skips the step when the "
      "gradients hold inf or NaN",
      doc="`scaler.update` on a step stepped by `optimizer.step()` instead of `scaler.step`", events=("UpdateCall",))
def update_without_step(ev: UpdateCall) -> Iterator[Finding]:
    """``scaler.update()`` after a direct ``optimizer.step()`` on its scaled gradients, or with no
    optimizer at STEPPED in the spec's sequence (no ``scaler.step`` since the last update; with
    no inf check recorded either, `reference.scaling.check_update` refuses it, as torch does)."""
    for optimizer, step, where in ev.bypasses:
        yield Finding("update-without-step", step, where,
                      f"scaler.update() at {ev.where} follows {optimizer}.step() called directly at {where}: the "
                      "step ran even if the gradients held inf or NaN (scaler.step would have skipped it)",
                      expected="scaler.step(optimizer)", got="optimizer.step()")
    if not ev.stepped and not ev.bypasses:
        raises = f" (torch raises {ev.refused!r})" if ev.refused else ""
        yield Finding("update-without-step", ev.step, ev.where,
                      f"scaler.update() at {ev.where} with no scaler.step since the previous update{raises}",
                      expected="scaler.step(optimizer) before scaler.update()", got="scaler.update() alone")


@rule("step-bypasses-scaler", ERROR,
      "optimizer.step() applied gradients produced by a scaled loss, without scaler.step or scaler.update",
      "with a GradScaler, step with scaler.step(optimizer) and then call scaler.update()",
      framework_fixes={
          "lightning.fabric": "step the optimizer that fabric.setup returned: it steps through the precision "
                              "plugin's scaler",
          "accelerate": "step the optimizer that accelerator.prepare returned: it calls scaler.step and "
                        "scaler.update"},
      doc="`optimizer.step()` on scaled gradients, with neither `scaler.step` nor `update`; or a "
          "direct `optimizer.step()` after `scaler.step` with no backward and no `zero_grad` between "
          "(the same gradients applied twice, the non-finite ones of a skipped step applied)",
      events=("DirectSteps", "StepReapplied"))
def step_bypasses_scaler(ev: DirectSteps | StepReapplied) -> Iterator[Finding]:
    """Direct ``optimizer.step()`` calls on gradients of a loss ``ev.scaler`` scaled, still without
    a ``scaler.update()`` when the next loss is scaled (at ``ev.next_scale``) or the run ends
    (None) (`DirectSteps`).

    Or a direct step that applies again the gradients its last ``scaler.step`` used
    (`StepReapplied`: `audit.restep` finds them), with no backward and no ``zero_grad`` between."""
    if isinstance(ev, StepReapplied):
        how = ("applied, so this step applies them a second time" if ev.applied else
               "skipped (inf or NaN gradients), so this step applies the non-finite gradients")
        yield Finding("step-bypasses-scaler", ev.step, ev.where,
                      f"{ev.optimizer}.step() at {ev.where} applied the gradients that scaler.step({ev.optimizer}) "
                      f"used at step {ev.last} (no backward and no zero_grad between); {ev.scaler} had {how}",
                      expected="one scaler.step(optimizer) per backward window", got="scaler.step, then optimizer.step()")
        return
    scaler, bypasses, next_scale = ev.scaler, ev.bypasses, ev.next_scale
    for optimizer, step, where in bypasses:
        if next_scale is None:
            how = "without scaler.step or scaler.update"
        else:
            how = (f"without scaler.step (a step with inf or NaN gradients is not skipped), and the next loss was "
                   f"scaled at {next_scale} with no scaler.update between")
        yield Finding("step-bypasses-scaler", step, where,
                      f"{optimizer}.step() at {where} applied gradients of a loss scaled by {scaler} {how}",
                      expected="scaler.step(optimizer); scaler.update()", got="optimizer.step()")


@rule("new-scaler-mid-run", ERROR,
      "a new GradScaler started scaling parameters that an earlier scaler drove, without its state",
      "create the GradScaler once per run; when it must be recreated, load the previous "
      "state with scaler.load_state_dict before its first scale()",
      doc="a new GradScaler started driving parameters an earlier scaler drove, without "
          "`load_state_dict` (a second, independent training in the same script is no finding)",
      events=("ScalerFirstDrive",))
def new_scaler_mid_run(ev: ScalerFirstDrive) -> Iterator[Finding]:
    """A scaler's first optimizer, when the scaler's first ``scale()`` (at ``began``) came after
    other enabled scalers completed updates and no ``load_state_dict`` preceded it: ``earlier``
    are those scalers that drove parameters of this optimizer (a second, independent training in
    one script drives others: no finding)."""
    scaler, optimizer, began, loaded, earlier = ev.scaler, ev.optimizer, ev.began, ev.loaded, ev.earlier
    if loaded or not earlier:
        return
    t = earlier[-1]
    yield Finding("new-scaler-mid-run", optimizer.steps, scaler.where or began,
                  f"{scaler.label} (created at {scaler.where or 'before the audit'}) started scaling at {began} with "
                  f"its initial scale {scaler.obj.get_scale()!r}, for parameters that {t.label} drove through "
                  f"{t.updates} update(s) (its scale {t.obj.get_scale()!r}); the scale history and growth tracker "
                  "start over", expected=t.obj.get_scale(), got=scaler.obj.get_scale())
