"""What a callback may leave in the trainer's state, checked after each of its hooks.

1. ``TrainState``'s counters (``step``, ``applied_steps``, ``skipped_steps``, ``epoch``,
   ``batch_index``, ``samples``, ``window_size``, ``window_done``) stay non-negative Python
   ints, and its losses (``best_val_loss``, ``last_val_loss``, ``last_train_loss``) numbers or
   None. A callback may change them (skip ahead, reset a best loss) within those types.
2. A hook that leaves a field of another type or a negative counter raises
   :class:`CallbackStateError` (a ``TypeError``) at once, naming the callback, its hook, the
   field, the value and the fix. The field is put back to the value it held before the hook,
   so the records flushed while the run unwinds and every checkpoint already written stay
   consistent; nothing is saved after it (the run fails, and resumes from its last checkpoint).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from operator import attrgetter, is_
from typing import Any

__all__ = ["CallbackStateError", "check_state", "checked_hook", "checked_step_hook", "hook_name"]

COUNTERS = ("step", "applied_steps", "skipped_steps", "epoch", "batch_index", "samples", "window_size",
            "window_done")
LOSSES = ("best_val_loss", "last_val_loss", "last_train_loss")
_FIELDS = COUNTERS + LOSSES
_fields_of = attrgetter(*_FIELDS)  # the fields rule 1 covers, as one tuple, read in C


class CallbackStateError(TypeError):
    """A callback left a trainer state field of the wrong type or range (rule 2)."""


def _problem(field: str, value: Any) -> str | None:
    if field in COUNTERS:
        if type(value) is not int:  # bool, numpy integers and tensors are not counters
            return f"must be a non-negative int, got {value!r} ({type(value).__name__})"
        if value < 0:
            return f"must be a non-negative int, got {value}"
        return None
    if field in LOSSES and value is not None and (
            isinstance(value, bool) or not isinstance(value, numbers.Real)):
        return f"must be a float or None, got {value!r} ({type(value).__name__})"
    return None


def check_state(state: Any, before: dict[str, Any], who: str) -> None:
    """Rule 2 for ``state`` after ``who`` (``'MyCallback.on_step_end'``) ran; ``before`` is
    ``vars(state)`` copied before it."""
    now = vars(state)
    # The common case, a hook that changed nothing: every attribute is still the very object
    # it was (two loops in C, run on every step hook; the same verdict as the loop below).
    if len(now) == len(before) and all(map(is_, now, before)) and all(map(is_, now.values(), before.values())):
        return
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if value is before.get(f.name):
            continue
        problem = _problem(f.name, value)
        if problem is not None:
            setattr(state, f.name, before.get(f.name))
            raise CallbackStateError(
                f"callback {who} set trainer.state.{f.name}: it {problem}. Fix: leave the trainer's "
                f"counters to the trainer (read them; call trainer.request_stop() to end the run), or assign "
                f"a value of the right type (int(...)); the run stopped here and saved nothing after it")


def hook_name(hook: Callable[..., Any]) -> str:
    owner = getattr(hook, "__self__", None)
    name = getattr(hook, "__name__", "hook")
    return f"{type(owner).__name__}.{name}" if owner is not None else name


def checked_hook(hook: Callable[..., Any], state_of: Callable[[], Any], who: str | None = None) -> Callable[..., Any]:
    """``hook`` followed by :func:`check_state` on ``state_of()``; ``who`` names it (by default
    the bound method's class and name)."""
    who = who or hook_name(hook)

    def run(*args: Any, **kwargs: Any) -> Any:
        state = state_of()
        before = dict(vars(state))
        out = hook(*args, **kwargs)
        check_state(state, before, who)
        return out

    return run


def checked_step_hook(hook: Callable[[Any, Any], None], owner: Any, who: str) -> Callable[[Any], None]:
    """A step hook, ``hook(owner, state)``, followed by :func:`check_state` on the ``state`` it
    was called with: :func:`checked_hook`'s check for the hooks that run on every step, bound
    once, with no lookup of the state and no argument packing per call."""

    def run(state: Any) -> None:
        before = _fields_of(state)
        hook(owner, state)
        # The common case, a hook that changed nothing: every field is still the very object it was.
        if not all(map(is_, _fields_of(state), before)):
            check_state(state, dict(zip(_FIELDS, before)), who)

    return run
