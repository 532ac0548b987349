"""Where ``ampspec doctor --task lm`` spends its time: the wall time of each part of the
inspection's step, as a multiple of a plain ``ampspec train`` of the same steps.

The candidates are ``bench/doctor_cost.py``'s ``train`` and ``doctor_<precision>`` (the commands
themselves, in this process). Each part is a method of the inspection's runner, timed by
wrapping it (no profiler, whose overhead would fall on the Python-heavy parts):

- ``_run`` mixed / shadow: a forward and backward of the mixed model (the first step's also under
  the op scan) and of the fp32 shadow;
- ``_layers``: every module's output and gradient statistics;
- ``_params_and_update``: the two optimizer steps and the parameter statistics;
- ``_align``: the shadow taking the mixed model's weights and optimizer state.

R rounds after one warm-up; each part's time is its total over the round's doctor run, divided
by that round's train run; medians over rounds.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/doctor_parts.py --precision bf16 --rounds 3
    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/doctor_parts.py --precision fp16 --clock cpu   # CPU time

Ops (``--ops``): where timings drown in a shared machine's load, the torch ops each part
dispatches a step (every ``aten`` call, a ``TorchDispatchMode`` counting them: each costs a
dispatch and, called from Python, the interpreter's overhead), over one ``--steps`` diagnosis
after a warm-up. A count, exact and repeatable, not a time: a read of a number and a pass over a
tensor count one each.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/doctor_parts.py --precision bf16 --ops   # seconds
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402  (puts the repository root on sys.path)
import doctor_cost  # noqa: E402

from torchimpl.cli.app import main  # noqa: E402
from torchimpl.doctor import inspect as doctor_inspect  # noqa: E402

PARTS = ("_layers", "_params_and_update", "_align")
_CLOCK = [time.perf_counter]
"""``--clock``'s function (``doctor_cost.CLOCKS``): the wall time or this process's CPU time."""


def _timed(acc: dict[str, float], name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = _CLOCK[0]()
        try:
            return f(*args, **kwargs)
        finally:
            acc[name] += _CLOCK[0]() - t0
    return wrapper


def _timed_run(acc: dict[str, float], f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, model: Any, batch: Any, mixed: bool, rng: Any, scanner: Any) -> Any:
        t0 = _CLOCK[0]()
        try:
            return f(self, model, batch, mixed, rng, scanner)
        finally:
            acc["_run mixed" if mixed else "_run shadow"] += _CLOCK[0]() - t0
    return wrapper


def _run_quiet(argv: list[str]) -> float:
    t0 = _CLOCK[0]()
    with contextlib.redirect_stdout(io.StringIO()):
        main(argv)
    return _CLOCK[0]() - t0


def run(precision: str, rounds: int, steps: int, size: str) -> dict:
    acc: dict[str, float] = collections.defaultdict(float)
    runner = doctor_inspect._Runner
    saved = {name: getattr(runner, name) for name in (*PARTS, "_run")}
    for name in PARTS:
        setattr(runner, name, _timed(acc, name, saved[name]))
    runner._run = _timed_run(acc, saved["_run"])
    try:
        with tempfile.TemporaryDirectory(prefix="ampspec-doctor-parts-") as tmp:
            cands = doctor_cost._candidates(Path(tmp), steps, size)
            doctor = f"doctor_{precision}"
            _run_quiet(cands["train"]())
            _run_quiet(cands[doctor]())
            per_round: dict[str, list[float]] = collections.defaultdict(list)
            for _ in range(rounds):
                acc.clear()
                train = _run_quiet(cands["train"]())
                total = _run_quiet(cands[doctor]())
                per_round["doctor"].append(total / train)
                for name, seconds in acc.items():
                    per_round[name].append(seconds / train)
    finally:
        for name, f in saved.items():
            setattr(runner, name, f)
    return {"machine": _harness.machine(), "precision": precision, "steps": steps, "size": size, "rounds": rounds,
            "clock": _CLOCK[0].__name__, "ratio_vs_train_median": {k: _harness.median(v) for k, v in per_round.items()}}


def ops(precision: str, steps: int, size: str) -> dict:
    """The ops each part dispatches per step (``--ops``), and each part's most frequent ops."""
    from torchimpl._torch_compat import TorchDispatchMode

    counts: collections.Counter = collections.Counter()
    where = ["start-up and report"]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            counts[where[0], func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    def part(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            outer, where[0] = where[0], name
            try:
                return f(*args, **kwargs)
            finally:
                where[0] = outer
        return wrapper

    runner = doctor_inspect._Runner
    saved = {name: getattr(runner, name) for name in (*PARTS, "_run")}
    for name in (*PARTS, "_run"):
        setattr(runner, name, part(name, saved[name]))
    argv = ["doctor", "--task", "lm", "--size", size, "--batch-size", "16", "--steps", str(steps),
            "--device", "cpu", "--precision", precision]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main(argv)  # warm-up: first-call paths
            counts.clear()
            with Count():
                main(argv)
    finally:
        for name, f in saved.items():
            setattr(runner, name, f)
    parts: collections.Counter = collections.Counter()
    for (name, _), n in counts.items():
        parts[name] += n
    top = {name: dict(sorted(((op, n / steps) for (w, op), n in counts.items() if w == name),
                             key=lambda kv: -kv[1])[:8]) for name in parts}
    return {"machine": _harness.machine(), "precision": precision, "steps": steps, "size": size,
            "ops_per_step": {k: v / steps for k, v in parts.items()}, "most_frequent_per_step": top}


def main_(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=doctor_cost.STEPS)
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--out", help="folder for doctor_parts.json (default bench/results)")
    p.add_argument("--clock", choices=sorted(doctor_cost.CLOCKS), default="wall", help="what the timings measure")
    p.add_argument("--ops", action="store_true", help="count each part's dispatched torch ops instead of timing")
    args = p.parse_args(argv)
    _CLOCK[0] = doctor_cost.CLOCKS[args.clock]
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    if args.ops:
        data = ops(args.precision, args.steps, args.size)
        path = _harness.write_result("doctor_ops", data, args.out)
        print(f"ampspec doctor --precision {args.precision}: torch ops dispatched per step, by part "
              f"(one run of {args.steps} steps):")
        for name, n in sorted(data["ops_per_step"].items(), key=lambda kv: -kv[1]):
            top = ", ".join(f"{op} {k:.0f}" for op, k in data["most_frequent_per_step"][name].items())
            print(f"{name:20s} {n:7.0f}   ({top})")
        print(f"written to {path}")
        return 0
    data = run(args.precision, args.rounds, args.steps, args.size)
    path = _harness.write_result("doctor_parts", data, args.out)
    print(f"ampspec doctor --precision {args.precision}, parts as multiples of a plain train of {args.steps} steps:")
    for name, r in sorted(data["ratio_vs_train_median"].items(), key=lambda kv: -kv[1]):
        print(f"{name:20s} {r:.2f}x")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
