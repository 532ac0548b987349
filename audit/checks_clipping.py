"""The clipping rules, each declared on its check.

Each check reads one clipping call as the recorder saw it (the kind, the call site, the spec's
stage of the optimizer in the scaler's call sequence, the scale, the threshold) and yields
findings; it changes nothing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

from audit.events import ClipCall, ClipThreshold
from audit.findings import ERROR, WARNING, Finding, rule, spec_stages

if TYPE_CHECKING:
    from reference.scaling import OptimizerStage


@rule("clip-before-unscale", ERROR,
      "gradients were clipped while still multiplied by the loss scale",
      "call scaler.unscale_(optimizer) before clipping, then clip at the unscaled threshold",
      framework_fixes={
          "lightning.pytorch": "clip with Trainer(gradient_clip_val=...): the precision plugin unscales first",
          "lightning.fabric": "clip with fabric.clip_gradients(model, optimizer, max_norm=...): it unscales first",
          "accelerate": "clip with accelerator.clip_grad_norm_(parameters, max_norm): it unscales first",
          "transformers": "clip with TrainingArguments(max_grad_norm=...), not in a callback: the Trainer "
                          "clips through accelerator.clip_grad_norm_, which unscales first"},
      doc="clipped gradients still multiplied by the loss scale (before `scaler.unscale_`)", events=("ClipCall",))
def clip_before_unscale(ev: ClipCall) -> Iterator[Finding]:
    """A clipping call on an optimizer's parameters in a window whose backward started from a loss
    an enabled GradScaler (``scaler``) scaled (``stage`` is None otherwise), while the spec's call
    sequence does not hold the optimizer at UNSCALED: its gradients are still multiplied by the
    scale."""
    kind, optimizer, step, where, scaler, max_norm = ev.kind, ev.optimizer, ev.step, ev.where, ev.scaler, ev.max_norm
    stage: OptimizerStage | None = ev.stage
    UNSCALED = spec_stages().UNSCALED  # the spec's name, read when the check runs: ``import audit`` loads no spec
    if stage is None or stage.stage == UNSCALED:
        return
    scale = scaler.get_scale()  # read only for a finding: on a GPU it synchronises
    extra = ""
    if max_norm is not None and max_norm >= scale > 1:
        extra = f"; its threshold {max_norm!r} was multiplied by the scale too, which only approximately compensates"
    yield Finding("clip-before-unscale", step, where,
                  f"{kind} at {where} clipped {optimizer}'s gradients while they were still multiplied by the loss "
                  f"scale {scale!r} (scaler.unscale_ had not run this step){extra}",
                  expected="scaler.unscale_(optimizer) before clipping", got=f"{kind} before scaler.unscale_")


# Certain when the threshold followed a change of the scale by exactly its factor; a warning
# when only its size (at least the scale) suggests it.
@rule("clip-threshold-scaled", ERROR,
      "the clipping threshold was multiplied by the loss scale although the gradients were unscaled",
      "pass the plain max_norm: after scaler.unscale_ the gradients are unscaled, so the threshold must be too",
      framework_fixes={
          "lightning.pytorch": "set Trainer(gradient_clip_val=...) to the unscaled threshold",
          "lightning.fabric": "pass fabric.clip_gradients the unscaled max_norm",
          "accelerate": "pass accelerator.clip_grad_norm_ the unscaled max_norm",
          "transformers": "set TrainingArguments(max_grad_norm=...) to the unscaled threshold"},
      doc="clipped unscaled gradients at `max_norm * scale`: an error once the threshold followed a "
          "change of the scale by its factor; a warning while only its size (at least a scale of 1024"
          " or more) suggests it; an infinite threshold (norm only) is never a finding", uncertain=WARNING,
      events=("ClipThreshold",))
def clip_threshold_scaled(ev: ClipThreshold) -> Iterator[Finding]:
    """``clip_grad_norm_`` on unscaled gradients with a threshold that tracks the loss scale.

    ``ev.held``: (max_norm / scale, the scale, the first step) of the ratio the earlier calls kept,
    None before the first; ``ev.earlier``: this rule's warning for the optimizer, if any. A warning
    when the threshold is at least a scale of 2**10 or more (a deliberately large threshold
    cannot be told apart yet); an error once the ratio held while the scale changed: the
    threshold moved by exactly the scale's factor (it confirms the warning: the same finding,
    now certain). An infinite threshold measures the norm without clipping: never a finding.
    """
    optimizer, step, where, max_norm, scale = ev.optimizer, ev.step, ev.where, ev.max_norm, ev.scale
    held, earlier = ev.held, ev.earlier
    if not math.isfinite(max_norm):
        return
    ratio = max_norm / scale if scale else math.nan
    if held is None or held[0] != ratio:
        if earlier is None and scale >= 2.0**10 and max_norm >= scale:
            yield Finding("clip-threshold-scaled", step, where,
                          f"clip_grad_norm_ at {where} clipped {optimizer}'s unscaled gradients at {max_norm!r}, at "
                          f"least the loss scale {scale!r}: probably multiplied by the scale, so the clip does nothing "
                          f"(the intended threshold would be {ratio!r}); the audit cannot tell this from a "
                          "deliberately large threshold until the scale changes", expected=ratio, got=max_norm,
                          level=WARNING)
    elif scale != held[1]:
        message = (f"clip_grad_norm_ at {where}: the threshold changed with the loss scale (max_norm / scale = "
                   f"{ratio!r} at every step since step {held[2]}): it was multiplied by the scale, although the "
                   "gradients were unscaled")
        if earlier is None:
            yield Finding("clip-threshold-scaled", held[2], where, message, expected=ratio, got=max_norm)
        else:
            yield Finding("clip-threshold-scaled", earlier.step, earlier.where,
                          message + f"; first seen at step {earlier.step}, {earlier.where}", earlier.expected,
                          earlier.got)
