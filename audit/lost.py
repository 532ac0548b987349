"""Lost updates of parameters held in bfloat16 or float16, counted by the replay over windows of steps.

``update-lost-to-rounding`` (`audit.checks_numbers`) reads what this module gathers. Its
definitions:

1. The measured parameters are those torch stores in bfloat16 or float16 (a model moved with
   ``model.to(torch.bfloat16)`` and stepped by its optimizer as it is). A float32 parameter is not
   measured: its update is lost only below 2**-25 of its weight, which no learning rate of a
   training gives, and the exact update would need the step in float64. An optimizer stepping a
   float32 master copy holds float32 parameters: nothing to measure, whatever the model's copy is.
2. The exact update of one element at one step is the update the optimizer's spec row computes
   in float32 from torch's own parameter, gradient and state before the step, each widened
   exactly from its 16-bit value: the update a float32 master copy would apply at that step from
   the same state. It is ``u = q - f32(p)`` in float32, ``q`` the float32 step's result
   (`reference.master_weights.float32_step`, that module's rule 5).
3. An element's update was lost when its exact update is finite and non-zero and torch's stored
   bits did not change across the step (`reference.health.applied_lost_count`, rule 12). The
   count is over the elements whose exact update is finite and non-zero.
4. A window is ``LOST_WINDOW`` replayed steps of one optimizer at which it was called (a step
   the scaler skipped calls nothing); the counts of each parameter are summed over the window,
   and the run's last window may be shorter. With ``--replay-every N`` the window's steps are
   those replayed; with a sampled optimizer stage the counts are over the sampled elements (the
   finding says so, with the sample's size).

The replay (`audit.replay`) calls `LostBook.add` in its worker at each measured step; the
windows travel back with its state, and `events` turns them into `audit.boundaries.LostUpdates`
in the process that reports, where the parameters' names are known.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from audit.boundaries import LostUpdates
from audit.checks_numbers import LOST_WINDOW
from reference import health

__all__ = ["LOW_DTYPES", "LostBook", "Window", "events", "low_precision"]

LOW_DTYPES = ("bfloat16", "float16")


def low_precision(params: list[Any]) -> str | None:
    """The name of the 16-bit float dtype among ``params`` (NumPy copies; None entries skipped), or None."""
    return next((str(p.dtype) for p in params if p is not None and str(p.dtype) in LOW_DTYPES), None)


@dataclass
class Window:
    """One parameter's counts over one window (plain values: it travels between processes)."""

    optimizer: str
    index: int
    dtype: str
    shape: tuple[int, ...]
    sampled: str | None
    steps: list[int] = field(default_factory=list)
    where: str = "?"
    lost: int = 0
    counted: int = 0


@dataclass
class LostBook:
    """The windows of every measured parameter: those closed, and those still open."""

    closed: list[Window] = field(default_factory=list)
    open: dict[tuple[str, int], Window] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)  # optimizer -> measured steps in its open window

    def add(self, optimizer: str, index: int, step: int, where: str, before: np.ndarray, after: np.ndarray,
            exact: np.ndarray, shape: tuple[int, ...], sampled: str | None) -> None:
        """One parameter's step (definition 3), into its open window."""
        lost, counted = health.applied_lost_count(before, after, exact)
        w = self.open.get((optimizer, index))
        if w is None:
            w = self.open[optimizer, index] = Window(optimizer, index, str(before.dtype), tuple(shape), sampled)
        w.steps.append(step)
        w.where, w.lost, w.counted = where, w.lost + lost, w.counted + counted

    def step_done(self, optimizer: str) -> None:
        """One measured step of ``optimizer``: its windows close after ``LOST_WINDOW`` of them."""
        self.steps[optimizer] = self.steps.get(optimizer, 0) + 1
        if self.steps[optimizer] >= LOST_WINDOW:
            self.steps[optimizer] = 0
            for key in [k for k in self.open if k[0] == optimizer]:
                self.closed.append(self.open.pop(key))

    def windows(self) -> list[Window]:
        """Every window, the open (shorter) ones last, each optimizer's in step order."""
        return sorted([*self.closed, *self.open.values()], key=lambda w: (w.optimizer, w.steps[0], w.index))


def events(book: LostBook, names: dict[str, list[str]]) -> list[LostUpdates]:
    """The windows as events, each with its parameter's name (``names``: optimizer -> one name
    per parameter index, as `audit.recorder` finds them) and the run's totals of that parameter."""
    wins = book.windows()
    totals: dict[tuple[str, int], tuple[int, int]] = {}
    for w in wins:
        lost, counted = totals.get((w.optimizer, w.index), (0, 0))
        totals[w.optimizer, w.index] = (lost + w.lost, counted + w.counted)
    out = []
    for w in wins:
        given = names.get(w.optimizer, [])
        name = given[w.index] if w.index < len(given) and given[w.index] else f"{w.index}"
        run = totals[w.optimizer, w.index]
        out.append(LostUpdates(w.steps[-1], w.where, w.optimizer, name, w.dtype, w.shape, w.lost, w.counted,
                               tuple(w.steps), w.sampled, run[0], run[1]))
    return out
