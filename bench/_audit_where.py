"""Where a replayed step's time goes, in both processes of ``ampspec audit``.

The workload of bench/audit_overhead.py (``--size``, default ``mlp``) runs under the audit with
the replay in its process, twice: ``--steps`` S and 2S steps. Timers wrap, in the program, the
copies into shared memory (`audit.worker.ReplayProcess.copy`), the jobs sent (``submit``, with
its pickling apart), a sampled step's copies with their gathers, and the results read (``_receive``: wall time, waits included); in the
replay process (forked with the wrappers in place), each job's method, each of the replay's
stages and the unpickling (CPU time), and the process's whole CPU time. Indented parts lie
inside the part above them (``_clip_boundary_and_stage`` holds a ``_boundary`` and the
``_stage_clip``). Each figure is the
difference of the two runs over S steps, so that the start, the first steps and the end cancel.
Run it on an idle machine; the figures of the two processes are taken side by side, as the
audit runs them.

    PYTHONPATH=. python bench/_audit_where.py
    PYTHONPATH=. python bench/_audit_where.py --size mlp-b512 --steps 60
    PYTHONPATH=. python bench/_audit_where.py --replay-sample 0.5
    PYTHONPATH=. python bench/_audit_where.py --size 12.8M --steps 14
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _harness  # noqa: E402,F401  (puts the repository root on sys.path)
import audit_overhead  # noqa: E402

import torch  # noqa: E402

# The replay's stages (audit.stages, audit.replay), timed in the replay process.
STAGES = ("_stage_found_inf", "_stage_unscale", "_clip_boundary_and_stage", "_stage_clip", "_boundary",
          "_stage_optimizer", "_compare_param")
# The order the parts are printed in (an indented part lies inside the one above it).
ORDER = {"program": ("sampled copies (their gathers and copy)", "copy", "submit (waits included)", "  pickle.dumps", "_receive (waits; in submit too)", "wall"),
         "replay process": ("pickle.loads", "_step", "  _stage_found_inf", "  _stage_unscale",
                            "  _clip_boundary_and_stage", "  _boundary", "  _stage_clip", "  _stage_optimizer",
                            "  _compare_param", "_update", "whole process")}


def _timing(f: Callable[..., Any], into: dict[str, float], label: str, clock: Callable[[], float]) -> Callable[..., Any]:
    """``f``, adding the time of each call on ``clock`` to ``into[label]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = clock()
        try:
            return f(*args, **kwargs)
        finally:
            into[label] += clock() - t

    return wrapper


def _timed(cls: Any, name: str, into: dict[str, float], clock: Callable[[], float], label: str | None = None) -> None:
    """Wrap ``cls.name`` to add its time on ``clock`` to ``into[label or name]``."""
    setattr(cls, name, _timing(getattr(cls, name), into, label or name, clock))


def measure(size: str, steps: int, sample: str = "auto") -> dict[str, dict[str, float]]:
    """One audited run of ``steps`` steps: seconds by part, in the program and in the replay process."""
    import audit.records as records
    import audit.replay as replay
    import audit.worker as worker
    from audit.runner import run_script

    program: dict[str, float] = collections.defaultdict(float)
    inside: dict[str, float] = collections.defaultdict(float)
    saved = {(cls, n): getattr(cls, n) for cls, n in [(worker.ReplayProcess, "copy"), (worker.ReplayProcess, "submit"),
                                                      (worker.ReplayProcess, "_receive"), (worker, "_serve"),
                                                      (records.Snapshots, "_sampled")]}
    saved.update({(replay.Replayer, n): getattr(replay.Replayer, n) for n in ("_step", "_update", *STAGES)})
    dumps, loads = pickle.dumps, pickle.loads
    out = Path(tempfile.mkdtemp(prefix="ampspec-where-")) / "replay-process.json"
    timed_dumps = _timing(dumps, program, "  pickle.dumps", time.perf_counter)
    timed_loads = _timing(loads, inside, "pickle.loads", time.process_time)

    serve = saved[(worker, "_serve")]

    def timed_serve(*args: Any) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        worker.pickle.loads = timed_loads
        try:
            serve(*args)
        finally:
            end = resource.getrusage(resource.RUSAGE_SELF)
            inside["whole process"] = (end.ru_utime + end.ru_stime) - (usage.ru_utime + usage.ru_stime)
            out.write_text(json.dumps(inside))

    _timed(records.Snapshots, "_sampled", program, time.perf_counter, label="sampled copies (their gathers and copy)")
    for n in ("copy", "submit", "_receive"):
        _timed(worker.ReplayProcess, n, program, time.perf_counter,
               label={"submit": "submit (waits included)", "_receive": "_receive (waits; in submit too)"}.get(n))
    for n in ("_step", "_update", *STAGES):
        _timed(replay.Replayer, n, inside, time.process_time, label=f"{n}" if n in ("_step", "_update") else f"  {n}")
    worker._serve = timed_serve
    worker.pickle.dumps = timed_dumps
    try:
        t0 = time.perf_counter()
        report = run_script(audit_overhead.SCRIPT, [*audit_overhead.SIZES[size], "--steps", str(steps)], replay=True,
                            replay_sample=sample)
        program["wall"] = time.perf_counter() - t0
    finally:
        for (cls, n), f in saved.items():
            setattr(cls, n, f)
        worker.pickle.dumps, worker.pickle.loads = dumps, loads
    if report.error is not None or report.findings:
        raise RuntimeError(f"the audited workload is not clean:\n{report.text()}")
    try:
        return {"program": dict(program), "replay process": json.loads(out.read_text())}
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="mlp", help=f"one of {', '.join(sorted(audit_overhead.SIZES))}, or a parameter "
                    "count (12.8M: audit_overhead.py --sizes' MLP)")
    ap.add_argument("--steps", type=int, default=100, help="S: the runs take S and 2S steps")
    ap.add_argument("--replay-sample", default="auto", help="the audit's --replay-sample (auto, all, a fraction)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.size not in audit_overhead.SIZES:
        audit_overhead.SIZES[args.size] = audit_overhead.parse_size(args.size)[1]
    measure(args.size, 10, args.replay_sample)  # imports and first calls, outside both runs
    short, long = measure(args.size, args.steps, args.replay_sample), measure(args.size, 2 * args.steps, args.replay_sample)
    print(f"{args.size} (--replay-sample {args.replay_sample}): ms a step (the run of {2 * args.steps} steps less the run of {args.steps}, over {args.steps})")
    for side in ("program", "replay process"):
        print(f"{side}:")
        for part in [p for p in ORDER[side] if p in long[side]]:
            per_step = 1e3 * (long[side][part] - short[side].get(part, 0.0)) / args.steps
            print(f"  {part:34} {per_step:7.3f}")
        for part in sorted(set(long[side]) - set(ORDER[side])):
            raise RuntimeError(f"{part!r} is measured but has no place in ORDER")
    return 0


if __name__ == "__main__":
    sys.exit(main())
