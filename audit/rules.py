"""The audit's rules: a short name, a severity, what it means and the fix.

Each rule is a clause of the step contract (``reference.step``, rules 1-6) that a user's loop can
break by the order or the arguments of its calls. ``replay-divergence`` is the numeric one: the
spec, fed the recorded scaled gradients, computes a different step than torch did. Pure data:
no torch, no reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RULES", "Rule", "Finding", "ERROR", "WARNING"]

ERROR = "error"
WARNING = "warning"


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
    Rule("clip-threshold-scaled", ERROR,
         "the clipping threshold was multiplied by the loss scale although the gradients were unscaled",
         "pass the plain max_norm: after scaler.unscale_ the gradients are unscaled, so the threshold must be too"),
    Rule("unscale-twice", ERROR,
         "the gradients were unscaled twice in one step",
         "unscale once per step: scaler.unscale_(optimizer) before clipping, or let scaler.step do it; "
         "never divide the gradients by the scale by hand as well"),
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
    Rule("zero-grad-in-window", ERROR,
         "zero_grad discarded gradients accumulated by a backward pass that no optimizer step has used",
         "zero the gradients once per optimizer step, after the step (or before the window's first backward)"),
    Rule("loss-not-divided", ERROR,
         "an accumulation window's losses were not divided by its number of microbatches",
         "divide each microbatch's loss by the window's number of microbatches before scaling and backward"),
    Rule("backward-in-autocast", WARNING,
         "backward ran inside an autocast region",
         "end the autocast region after the loss is computed; call backward outside it"),
    Rule("checkpoint-without-scaler", ERROR,
         "a checkpoint saved the optimizer state but not the scaler state while a GradScaler was in use",
         "save scaler.state_dict() with the model and optimizer, and restore it with scaler.load_state_dict"),
    Rule("new-scaler-mid-run", ERROR,
         "a new GradScaler started scaling mid-run without the previous scaler's state",
         "create the GradScaler once per run; when it must be recreated, load the previous "
         "state with scaler.load_state_dict before its first scale()"),
    Rule("optimizer-before-to", ERROR,
         "parameters moved to another device or dtype after the optimizer holding them was built",
         "move the model with model.to(device) before building the optimizer"),
    Rule("replay-divergence", ERROR,
         "the specification, fed the recorded scaled gradients, computes a different step",
         "read the field and the two values: the loop does something to the gradients, the scale or "
         "the parameters that the step contract does not"),
)}


@dataclass
class Finding:
    """One finding: a rule broken at one step, at one call site of the user's code.

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

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}; known: {sorted(RULES)}")

    @property
    def severity(self) -> str:
        return RULES[self.rule].severity

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
