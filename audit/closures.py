"""Closure steps: optimizer steps whose gradients the step itself produces.

``optimizer.step(closure)`` calls ``closure`` inside the optimizer's own step function (torch's
optimizers: ``with torch.enable_grad(): loss = closure()``), after torch's step pre-hooks have
fired and before the update reads the gradients. The Lightning ``Trainer`` in automatic
optimization (``32-true``, ``bf16-mixed``), ``torch.optim.LBFGS`` and SAM-style optimizers take
their steps so. The audit's pre-hook therefore replaces the closure by one that reports when it
begins and returns (`wrap`), so that the gradients are copied where the update reads them: when
the closure has returned.

Some optimizers evaluate the closure more than once in a step, by their own rule; their update
is not a function of one set of gradients, and the specification has no such optimizer
(`own_evaluations` names them with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["ClosureStep", "closure_of", "with_closure", "wrap", "own_evaluations", "REEVALUATED", "RUNS_ANOTHER"]

# Optimizer classes (and their subclasses) that evaluate the closure several times per step.
OWN_EVALUATIONS: dict[type, str] = {
    torch.optim.LBFGS: ("torch.optim.LBFGS runs its own line search with several closure evaluations per step; "
                        "the spec has no LBFGS"),
}

RUNS_ANOTHER = ("its step ran {inner}'s step on the same parameters (a wrapper such as SAM's): the update is "
                "replayed as {inner}'s")
REEVALUATED = ("the optimizer evaluated its closure {n} times in one step (its update reads more than one set of "
               "gradients)")


@dataclass
class ClosureStep:
    """An optimizer step in progress that received a closure: where it was called, whether it
    runs inside an enabled scaler's ``scaler.step``, and how often the closure has returned."""

    where: str
    inside: bool
    returned: int = 0


def own_evaluations(cls: type) -> str | None:
    """Why the steps of ``cls`` are not replayed when it evaluates its closure itself, or None."""
    return next((OWN_EVALUATIONS[c] for c in cls.__mro__ if c in OWN_EVALUATIONS), None)


def closure_of(args: tuple, kwargs: dict) -> Callable[..., Any] | None:
    """The closure of an ``optimizer.step`` call as torch's step hooks receive it (``args[0]`` is
    the optimizer; torch's optimizers take the closure next or as ``closure``)."""
    closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    return closure if callable(closure) else None


def with_closure(args: tuple, kwargs: dict, closure: Callable[..., Any]) -> tuple[tuple, dict]:
    """The step's arguments (the hooks', the optimizer first) with ``closure`` in the place of the
    one given."""
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (args[0], closure, *args[2:]), kwargs


def wrap(closure: Callable[..., Any], end: Callable[[], None]) -> Callable[..., Any]:
    """``closure``, reporting ``end()`` after each call that returns."""

    def reported(*args: Any, **kwargs: Any) -> Any:
        out = closure(*args, **kwargs)
        end()
        return out

    return reported
