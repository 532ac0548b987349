"""The GradScaler's per-optimizer call sequence, as the specification states it.

Each enabled scaler keeps, per optimizer, a `reference.scaling.OptimizerStage` (READY ->
UNSCALED -> STEPPED between two updates, rule 12). The recorder advances it only through the
spec's own stage functions: ``unscale_`` through `reference.scaling.unscale_stage`, ``step``
through `reference.scaling.step_stage`, ``update`` through `reference.scaling.check_update`.
What each call met is recorded as an event (`StageCall`, `UpdateCall`, named tuples as
`audit.events`' are): the stage before it, the stage the spec gives after it, and the spec's
exception when it refuses the call, which is the exception torch raises. The audit never raises
it itself: torch does, in the audited program, as it would without the audit; the event only
records that it will.

A fused (amp-aware) optimizer is outside rule 12's ``step_stage``, which is a plain
optimizer's sequence: its kernel checks the scaled gradients itself, with no unscale first, so
an unscale refusal the spec gives from READY (a float16 gradient, no gradient at all) is not
torch's; torch steps it and the stage becomes STEPPED.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, NamedTuple

import numpy as np

from reference import scaling
from reference.scaling import STEPPED, UNSCALED, OptimizerStage

__all__ = ["StageCall", "UpdateCall", "unscale_call", "step_call", "update_call", "stage_after", "READY_STAGE"]

READY_STAGE = OptimizerStage()


class StageCall(NamedTuple):
    """One ``unscale_`` or ``step`` of one optimizer (or ``end``: the run ended), in the sequence.

    ``before``: the optimizer's stage when the call came; ``after``: the spec's stage after it
    (None when the spec refuses it); ``left``: the stage a refused call leaves (torch's, e.g.
    UNSCALED after a step with no gradient); ``refused``: the spec's exception message.
    """

    call: str
    optimizer: str
    step: int
    where: str
    before: OptimizerStage
    after: OptimizerStage | None = None
    left: OptimizerStage | None = None
    refused: str | None = None
    last_step_where: str = "?"  # where this optimizer's last scaler.step was called


class UpdateCall(NamedTuple):
    """One ``update`` of a scaler: the stage of each optimizer it drove since the last update, the
    direct ``optimizer.step()`` calls on its scaled gradients since then, and the spec's refusal."""

    scaler: str
    step: int | None
    where: str
    stages: tuple[tuple[str, OptimizerStage], ...]
    bypasses: tuple[tuple[str, int, str], ...]  # (optimizer, its step, where optimizer.step() ran)
    refused: str | None = None

    @property
    def stepped(self) -> bool:
        """Whether any optimizer reached STEPPED (through scaler.step) since the last update."""
        return any(st.stage == STEPPED for _, st in self.stages)


def numpy_dtypes(dtypes: Iterable[Any]) -> list[Any]:
    """torch dtypes of the gradients as the spec's stage functions take them (NumPy dtypes); the
    spec checks only float16 (rule 12), so another dtype NumPy lacks is passed as ``object``."""
    return [_numpy_dtype(d) for d in dtypes]


@functools.lru_cache(maxsize=None)
def _numpy_dtype(d: Any) -> Any:
    name = str(d).removeprefix("torch.")
    try:
        return np.dtype(name)  # bfloat16 too: ml_dtypes registers it
    except TypeError:
        return np.dtype(object)


def unscale_call(before: OptimizerStage, *, optimizer: str, step: int, where: str, scaled: bool,
                 grad_dtypes: list[Any], last_step_where: str = "?") -> StageCall:
    """``scaler.unscale_(optimizer)`` from stage ``before``, through `reference.scaling.unscale_stage`."""
    try:
        after = scaling.unscale_stage(before, scaled=scaled, grad_dtypes=grad_dtypes)
    except (AssertionError, RuntimeError, ValueError) as exc:
        return StageCall("unscale_", optimizer, step, where, before, None, before, str(exc), last_step_where)
    return StageCall("unscale_", optimizer, step, where, before, after, after, None, last_step_where)


def step_call(before: OptimizerStage, *, optimizer: str, step: int, where: str, scaled: bool,
              grad_dtypes: list[Any], closure: bool, amp_aware: bool, last_step_where: str = "?") -> StageCall:
    """``scaler.step(optimizer)`` from stage ``before``, through `reference.scaling.step_stage`."""
    try:
        left, after = scaling.step_stage(before, scaled=scaled, grad_dtypes=grad_dtypes, closure=closure)
    except scaling.NoInfChecksError as exc:
        if amp_aware:  # the fused kernel records its own inf check (see the module docstring)
            return StageCall("step", optimizer, step, where, before, OptimizerStage(STEPPED, True),
                             None, None, last_step_where)
        return StageCall("step", optimizer, step, where, before, None, exc.stage, str(exc), last_step_where)
    except (AssertionError, RuntimeError, ValueError) as exc:
        if amp_aware and isinstance(exc, ValueError):  # a float16 gradient: the fused kernel takes it
            return StageCall("step", optimizer, step, where, before, OptimizerStage(STEPPED, True),
                             None, None, last_step_where)
        return StageCall("step", optimizer, step, where, before, None, before, str(exc), last_step_where)
    return StageCall("step", optimizer, step, where, before, after, left, None, last_step_where)


def stage_after(call: StageCall, ok: bool) -> OptimizerStage:
    """The stage once the call returned (``ok``) or raised: the spec's, else what torch did (a call
    the spec refused but torch ran is taken as torch ran it: UNSCALED after unscale_, STEPPED
    after step, so that the next call is judged from where torch is)."""
    if ok:
        if call.after is not None:
            return call.after
        return OptimizerStage(UNSCALED if call.call == "unscale_" else STEPPED, True)
    return call.left if call.left is not None else call.before


def update_call(stages: dict[str, OptimizerStage], *, scaler: str, step: int | None, where: str, scaled: bool,
                new_scale: bool, bypasses: Iterable[tuple[str, int, str]]) -> UpdateCall:
    """``scaler.update()``, through `reference.scaling.check_update`."""
    refused = None
    try:
        scaling.check_update(list(stages.values()), scaled=scaled, new_scale=new_scale)
    except AssertionError as exc:
        refused = str(exc)
    return UpdateCall(scaler, step, where, tuple(stages.items()), tuple(bypasses), refused)
