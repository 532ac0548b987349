"""Which steps and which numbers the replay checks: every step whole, or a seeded sample.

The order rules see every call of every step whatever the sampling (the recorder runs them);
the sampling decides only what the numeric replay copies and recomputes, so that its cost stops
growing with the model:

- ``every`` N: the replay takes steps 0, N, 2N, ... of each optimizer; the others copy nothing.
  ``None`` is ``auto``: every step while the optimizer holds at most ``AUTO_WHOLE_BUDGET``
  elements, else every ``ceil(elements / AUTO_WHOLE_BUDGET)``-th.
- ``fraction``: of a replayed step's optimizer stage (the parameters, their gradients entering
  the step and their state, before and after), the share of the elements copied and
  recomputed. ``None`` is ``auto``: everything while the optimizer holds at most
  ``AUTO_BUDGET`` elements, else ``AUTO_BUDGET`` elements' worth. 1.0 is everything.

What needs a whole tensor is always whole on a replayed step: found_inf and the skip, the
unscale, every clipping call (its total norm is over every gradient), and the scale update.

How the optimizer stage is sampled depends on its row (the spec row's ``elementwise`` says
whether it is element-wise: each element's update reads only the same element of the parameter,
gradient and state):

- element-wise: of each tensor, ``ceil(fraction * n)`` elements, at least ``MIN_ELEMENTS``
  (a tensor that small is whole), chosen by a generator seeded with ``(seed, tensor index)``;
- otherwise (Adafactor's factored statistics read whole rows and columns): whole tensors, in
  an order seeded with ``seed``, until ``fraction`` of the elements are taken (at least one);
- a user's registered optimizer: everything (its step may couple the parameters).

The same elements are taken at every replayed step of a run: a fixed sample for a seed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Sampling", "SampleBook", "StepSample", "AUTO_BUDGET", "AUTO_WHOLE_BUDGET", "MIN_ELEMENTS",
           "parse_fraction", "parse_every", "sampling_statement"]

# Elements of a step's optimizer stage replayed under ``auto`` (all of them up to this many), and
# elements a step, on average, of the stages that need whole tensors (every step up to this many;
# past it, every Nth). The 0.2M-parameter MLP of bench/audit_overhead.py is replayed whole at
# every step; past it, the replay's work a step stops growing with the model (bench/audit_overhead.py
# --sizes shows the ratios).
AUTO_BUDGET = 1 << 19
AUTO_WHOLE_BUDGET = 1 << 21
MIN_ELEMENTS = 64


def parse_fraction(text: Any) -> float | None:
    """``--replay-sample``: ``auto`` (None), ``all`` (1.0) or a fraction in (0, 1]."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "auto"):
        return None
    if isinstance(text, str) and text.strip().lower() == "all":
        return 1.0
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not 0.0 < value <= 1.0:
        raise ValueError(f"replay_sample (--replay-sample) must be auto, all or a fraction in (0, 1], got {text!r}")
    return value


def parse_every(text: Any) -> int | None:
    """``--replay-every``: ``auto`` (None) or an integer >= 1."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "auto"):
        return None
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = 0
    if isinstance(text, bool) or isinstance(text, float) or value < 1:
        raise ValueError(f"replay_every (--replay-every) must be auto or an integer >= 1, got {text!r}")
    return value


@dataclass(frozen=True)
class Sampling:
    """The replay's sampling policy (module docstring)."""

    every: int | None = None
    fraction: float | None = None
    seed: int = 0

    def every_for(self, total: int) -> int:
        """The replay's step interval for an optimizer of ``total`` elements: ``every``, or under
        ``auto`` (None) 1 up to `AUTO_WHOLE_BUDGET` elements, else ``ceil(total / AUTO_WHOLE_BUDGET)``:
        the whole-tensor stages then cost at most that many elements a step on average."""
        return self.every if self.every is not None else max(1, math.ceil(total / AUTO_WHOLE_BUDGET))

    def plan(self, shapes: tuple[tuple[int, ...], ...], mode: str) -> "StepSample | None":
        """The optimizer stage's sample for tensors of ``shapes``; ``mode`` ``elements``,
        ``tensors`` or ``whole`` (what the row allows). None: everything."""
        sizes = tuple(math.prod(s) for s in shapes)
        total = sum(sizes)
        mode = "whole" if mode == "registered" else mode
        fraction = self.fraction if self.fraction is not None else min(1.0, AUTO_BUDGET / max(total, 1))
        if fraction >= 1.0 or mode == "whole" or total == 0:
            return None
        if mode == "elements":
            take = tuple(_elements(n, fraction) for n in sizes)
        else:
            take = _whole_tensors(sizes, fraction, self.seed)
        if all(k == n for k, n in zip(take, sizes)):
            return None
        return StepSample(self.seed, shapes, take)


def _elements(n: int, fraction: float) -> int:
    """Of a tensor of ``n`` elements: ``ceil(fraction * n)``, at least `MIN_ELEMENTS`, at most ``n``."""
    return min(n, max(MIN_ELEMENTS, math.ceil(fraction * n)))


def _whole_tensors(sizes: tuple[int, ...], fraction: float, seed: int) -> tuple[int, ...]:
    """Whole tensors in a seeded order until ``fraction`` of the elements are taken (at least one)."""
    order = np.random.default_rng([seed, 0x7E45]).permutation(len(sizes))
    take, got = [0] * len(sizes), 0
    for i in order:
        if got >= fraction * sum(sizes) and got:
            break
        take[i], got = sizes[i], got + sizes[i]
    return tuple(take)


@dataclass(frozen=True)
class StepSample:
    """One optimizer's sample: per tensor (its index in ``param_groups`` order), of ``shapes``, how
    many of its elements are taken (``take``: all of them, none, or some, chosen by `indices`).
    ``memo``: the indices made so far in this process (never pickled: each process makes its own,
    once: a step's job unpickles to the process's one sample of these fields, `_one_sample`)."""

    seed: int
    shapes: tuple[tuple[int, ...], ...]
    take: tuple[int, ...]
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def __reduce__(self) -> Any:
        return (_one_sample, (self.seed, self.shapes, self.take))

    def size(self, i: int) -> int:
        return math.prod(self.shapes[i])

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    def whole(self, i: int) -> bool:
        return self.take[i] == self.size(i)

    def omitted(self, i: int) -> bool:
        return self.take[i] == 0 and self.size(i) > 0

    def indices(self, i: int) -> np.ndarray | None:
        """The flat indices taken of tensor ``i`` (sorted; None: the whole tensor): ``take[i]``
        distinct ones from a generator seeded with ``(seed, i)``, made once per process."""
        if self.whole(i):
            return None
        ix = self.memo.get(i)
        if ix is None:
            ix = np.random.default_rng([self.seed, i]).choice(self.size(i), size=self.take[i], replace=False,
                                                               shuffle=False)
            ix.sort()
            ix.flags.writeable = False
            self.memo[i] = ix
        return ix

    @property
    def elements(self) -> int:
        return sum(self.take)

    @property
    def tensors(self) -> int:
        return sum(1 for k in self.take if k)

    def describe(self) -> str:
        return (f"{self.elements} of {sum(self.sizes)} elements in {self.tensors} of {len(self.shapes)} tensors "
                f"(seed {self.seed})")


@functools.lru_cache(maxsize=16)
def _one_sample(seed: int, shapes: tuple[tuple[int, ...], ...], take: tuple[int, ...]) -> StepSample:
    """This process's one `StepSample` of these fields. Every replayed step's job carries its
    sample; made anew, each would draw its indices again (a seeded choice without replacement
    per tensor, which costs more than the replay's arithmetic on what it picks)."""
    return StepSample(seed, shapes, take)


class SampleBook:
    """The replay's sampling over a run (in the audited program's process): each optimizer's
    plan, made once per set of shapes, and what was left out and sampled."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self.samples: dict[str, str] = {}  # optimizer label -> its optimizer stage's sample
        self.steps_left_out = 0  # steps the sampling left out (every Nth step)
        self.steps_sampled = 0  # replayed steps whose optimizer stage took a sample
        self._plans: dict[tuple[int, tuple[tuple[int, ...], ...]], tuple[int, StepSample | None]] = {}

    def for_step(self, o: Any, params: list[Any], mode_of: Any) -> tuple[bool, StepSample | None]:
        """For the step optimizer track ``o`` is in: (left out, the optimizer stage's sample or
        None for the whole of it); ``mode_of(optimizer)``: what its row allows (`Sampling.plan`)."""
        shapes = tuple(tuple(p.shape) for p in params)
        key = (id(o.obj), shapes)
        if key not in self._plans:
            mode = mode_of(o.obj)
            every = self.sampling.every_for(sum(p.numel() for p in params))
            plan = self._plans[key] = (every, self.sampling.plan(shapes, mode))
            self.samples[o.label] = (f"every {every} step{'s' if every != 1 else ''}; "
                                     + ("whole" if plan[1] is None else plan[1].describe()) + (
                "; a registered optimizer is replayed whole (its step may couple its parameters)"
                if mode == "registered" and self.sampling.fraction != 1.0 else ""))
        every, plan = self._plans[key]
        if o.steps % every:
            return True, None
        return False, plan

    def left_out(self, d: Any, rec: Any) -> bool:
        """Whether the step of ``d`` and ``rec`` was left out (its verdict set, counted); counts a sampled one."""
        if d is not None and d.unsampled:
            rec.replay = "not sampled (the replay takes steps 0, N, 2N, ...: N is in the report's sampling)"
            self.steps_left_out += 1
            return True
        self.steps_sampled += int(d is not None and d.sample is not None)
        return False


WHOLE = ("found_inf and the skip, the unscale, every clipping call (its total norm over every gradient) and the "
         "scale update, on every replayed step")


def sampling_statement(replayer: Any) -> dict[str, Any]:
    """What the replay of ``replayer`` (an `audit.replay.Replayer`) sampled, for the report."""
    book = replayer.book
    s = book.sampling
    return {"every": "auto" if s.every is None else s.every, "auto_whole_budget": AUTO_WHOLE_BUDGET, "sample": "auto" if s.fraction is None else s.fraction, "seed": s.seed,
            "auto_budget": AUTO_BUDGET, "steps_left_out": book.steps_left_out, "steps_sampled": book.steps_sampled,
            "optimizer_stage": dict(book.samples), "whole": WHOLE,
            "order_rules": "complete: every call of every step, whatever the sampling"}
