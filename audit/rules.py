"""The audit's rules: a short name, a severity, what it means and the fix.

Each rule is a clause of the step contract (``reference.step``, rules 1-6) that a user's loop can
break by the order or the arguments of its calls, or a change to the numbers that the replay
measures between two stages. Pure data: no torch, no reference.

The severity contract (every rule below keeps to it):

- ``error``: the audit is certain, from what its instrumentation saw, that the loop breaks a
  clause of the step contract. Nothing that uninstrumented user code could legitimately do
  explains it (torch would raise, or the numbers show a division or multiplication by the loss
  scale, or a call order that no correct loop has).
- ``warning``: probably wrong, but a cause the audit cannot see could make it right; the
  finding says what was seen and why the audit cannot decide.
- ``info``: the loop's own code changed something the specification does not model (gradients
  edited after ``unscale_``, a learning rate set by hand); stated with its numbers. Not a
  mistake in itself.

A rule with a certain and an uncertain form (``loss-not-divided``, ``clip-threshold-scaled``,
``checkpoint-without-scaler``) gives its finding the lower severity when uncertain
(`Finding.level`). Exit status, as linters do it: 0 when no finding is an error, 1 when one is;
with ``strict`` warnings and info count as well; 2 when the audited program failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RULES", "Rule", "Finding", "ERROR", "WARNING", "INFO", "SEVERITIES"]

ERROR = "error"
WARNING = "warning"
INFO = "info"
SEVERITIES = (ERROR, WARNING, INFO)


@dataclass(frozen=True)
class Rule:
    name: str
    severity: str
    summary: str
    fix: str


RULES: dict[str, Rule] = {r.name: r for r in (
    Rule("clip-before-unscale", ERROR,
         "gradients were clipped while still multiplied by the loss scale",
         "call scaler.unscale_(optimizer) before clipping, then clip at the unscaled threshold"),
    # Certain when the threshold followed a change of the scale by exactly its factor; a warning
    # when only its size (at least the scale) suggests it.
    Rule("clip-threshold-scaled", ERROR,
         "the clipping threshold was multiplied by the loss scale although the gradients were unscaled",
         "pass the plain max_norm: after scaler.unscale_ the gradients are unscaled, so the threshold must be too"),
    Rule("unscale-twice", ERROR,
         "the gradients were unscaled twice in one step",
         "unscale once per step: scaler.unscale_(optimizer) before clipping, or let scaler.step do it; "
         "never divide the gradients by the scale by hand as well"),
    Rule("scale-twice", ERROR,
         "the gradients were multiplied by the loss scale once more after backward",
         "scale the loss once, with scaler.scale(loss); never multiply the gradients by scaler.get_scale()"),
    Rule("gradients-modified-before-unscale", INFO,
         "the loop's own code changed the scaled gradients between backward and scaler.unscale_",
         "nothing to fix if intended (masking, a custom clip on scaled values); the replay continued from "
         "the changed gradients"),
    Rule("gradients-modified-after-unscale", INFO,
         "the loop's own code changed the unscaled gradients before the next clipping call or the optimizer step",
         "nothing to fix if intended (per-parameter or adaptive clipping, masking: torch's AMP notes allow "
         "it); the replay continued from the changed gradients"),
    Rule("step-without-update", ERROR,
         "scaler.step(optimizer) was not followed by scaler.update()",
         "call scaler.update() once after the scaler.step calls of every optimizer step"),
    Rule("update-without-step", ERROR,
         "scaler.update() ran on a step whose optimizer step did not go through scaler.step",
         "call scaler.step(optimizer) instead of optimizer.step(): it skips the step when the "
         "gradients hold inf or NaN"),
    Rule("step-bypasses-scaler", ERROR,
         "optimizer.step() applied gradients produced by a scaled loss, without scaler.step or scaler.update",
         "with a GradScaler, step with scaler.step(optimizer) and then call scaler.update()"),
    Rule("scheduler-on-skipped-step", ERROR,
         "the LR scheduler stepped although its optimizer applied no step since the scheduler's last step",
         "advance the schedule only when the optimizer step was applied (with a GradScaler: when "
         "scaler.get_scale() did not decrease across scaler.update())"),
    Rule("lr-changed-on-skipped-step", WARNING,
         "a learning rate changed across a skipped step, and no LRScheduler of that optimizer stepped",
         "if the schedule is a function of the iteration, count applied optimizer steps instead (skip the "
         "update when scaler.get_scale() decreased across scaler.update())"),
    Rule("zero-grad-in-window", ERROR,
         "zero_grad discarded gradients accumulated by a backward pass that no optimizer step has used",
         "zero the gradients once per optimizer step, after the step (or before the window's first backward)"),
    # Certain only for micro-batches of one loss; a warning when the graph cannot tell.
    Rule("loss-not-divided", ERROR,
         "an accumulation window's losses were not divided by its number of microbatches",
         "divide each microbatch's loss by the window's number of microbatches before scaling and backward"),
    Rule("backward-in-autocast", WARNING,
         "backward ran inside an autocast region",
         "end the autocast region after the loss is computed; call backward outside it"),
    # Certain when nothing read the scaler's state after that step; a warning when
    # scaler.state_dict() was called (it may have been written by other means).
    Rule("checkpoint-without-scaler", ERROR,
         "a checkpoint saved the optimizer state but not the scaler state while a GradScaler was in use",
         "save scaler.state_dict() with the model and optimizer, and restore it with scaler.load_state_dict"),
    Rule("new-scaler-mid-run", ERROR,
         "a new GradScaler started scaling parameters that an earlier scaler drove, without its state",
         "create the GradScaler once per run; when it must be recreated, load the previous "
         "state with scaler.load_state_dict before its first scale()"),
    Rule("optimizer-before-to", ERROR,
         "parameters moved to another device or dtype after the optimizer holding them was built",
         "move the model with model.to(device) before building the optimizer"),
    Rule("replay-divergence", ERROR,
         "a stage of the step, fed torch's own input, computes otherwise in the specification",
         "read the field and the two values: torch, or a patched torch function, computes this stage "
         "differently from the step contract"),
)}


@dataclass
class Finding:
    """One finding: a rule broken at one step, at one call site of the user's code.

    ``level``: set for the uncertain form of a rule (a warning where the rule's certain form is an
    error); None keeps the rule's severity.

    ``step`` is the optimizer step (0-based, counting skipped steps) the call belongs to, or None
    when no step has started. ``expected`` and ``got`` are what the contract wants and what the
    loop did (numbers where the replay has them, else a description).
    """

    rule: str
    step: int | None
    where: str
    message: str
    expected: Any = None
    got: Any = None
    level: str | None = None  # the rule's uncertain form: a lower severity than the rule's own

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}; known: {sorted(RULES)}")
        if self.level is not None and self.level not in SEVERITIES:
            raise ValueError(f"level must be one of {SEVERITIES}, got {self.level!r}")

    @property
    def severity(self) -> str:
        return self.level or RULES[self.rule].severity

    @property
    def fix(self) -> str:
        return RULES[self.rule].fix

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "severity": self.severity, "step": self.step, "where": self.where,
                "message": self.message, "expected": _jsonable(self.expected), "got": _jsonable(self.got),
                "fix": self.fix}


def _jsonable(value: Any) -> Any:
    """Numbers as JSON numbers when finite, else as their repr; everything else as is or str."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    try:
        return _jsonable(float(value))
    except (TypeError, ValueError):
        return str(value)
