"""Which direct ``optimizer.step()`` applies again the gradients ``scaler.step`` just used.

After ``scaler.step(optimizer)`` the gradients are unscaled in place and stay in ``.grad`` until
the next ``zero_grad`` or backward. A direct ``optimizer.step()`` of the same optimizer before
either applies them a second time, outside the scaler: an iteration updates twice, and on a
step the scaler skipped (inf or NaN gradients) the direct one applies the non-finite gradients.
No correct loop does this, so it is ``step-bypasses-scaler``, certain: the gradients the step
reads came from a loss the scaler scaled, and no ``scaler.step`` checks them.

Decided when the direct step begins, from the optimizer's window: no backward and no
``zero_grad`` (of the optimizer or of a module holding its parameters) since its last step, that
last step went through ``scaler.step`` of an enabled scaler, and a gradient is still present.
"""

from __future__ import annotations

from typing import Any

from audit.events import StepReapplied
from audit.records import OptTrack, ScalerTrack
from audit.rules import dispatch

__all__ = ["check_restep", "stale_scaler"]


def stale_scaler(scalers: dict[int, ScalerTrack], o: OptTrack) -> ScalerTrack | None:
    """The enabled scaler whose ``scaler.step`` last used the gradients a direct step of ``o``
    is about to apply again; None when the window holds new gradients or none."""
    w, last = o.window, o.last_record
    if w.backwards or last is None or any(".zero_grad@" in c for c in w.calls):
        return None
    if not any(c.startswith("scaler.step@") for c in last.calls):
        return None
    if all(p.grad is None for p in o.params()):
        return None
    driving = [s for s in scalers.values() if s.enabled and s.used and id(o.obj) in s.driven]
    return driving[-1] if driving else None


def check_restep(rec: Any, o: OptTrack, where: str) -> None:
    """Run ``step-bypasses-scaler``'s check when the direct step of ``o`` at ``where`` re-applies
    the gradients of its last ``scaler.step`` (``rec``: the recorder)."""
    s = stale_scaler(rec.scalers, o)
    if s is None:
        return
    last = o.last_record
    rec._report(dispatch(StepReapplied(s.label, o.label, o.steps, where, last.step, last.applied)))
