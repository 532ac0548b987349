"""CPU time of the audit's replay per step, apart from the training: a load-robust figure.

The workload of bench/audit_overhead.py (``--size``, default ``mlp``) runs once under the audit
with the replay inline, and each step's data is kept; those steps are then replayed again and
again by a fresh `audit.replay.Replayer` in this process, timed with ``time.process_time`` (CPU
time of this process, which a busy machine's other processes inflate far less than wall time).
Printed: the median and the least CPU milliseconds a step over ``--rounds`` rounds. To set two
revisions side by side, run it in each tree (``git archive REV | tar -x -C DIR``).
``--separate``: each round also replays the steps with every group stepped parameter by
parameter (`reference.optim`'s ``step_joined`` off), alternating with the default, and prints
the paired ratio joined / separate.

    PYTHONPATH=. python bench/_audit_replay_cpu.py --rounds 7
    PYTHONPATH=. python bench/_audit_replay_cpu.py --size tiny --separate --rounds 15
    PYTHONPATH=. python bench/_audit_replay_cpu.py --size 12.8M --steps 5 --rounds 3 --replay-sample all
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _harness  # (also puts the repository root on sys.path)
import audit_overhead
import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="mlp", help=f"one of {', '.join(sorted(audit_overhead.SIZES))}, or a parameter "
                    "count (0.2M, 12.8M: audit_overhead.py --sizes' MLP)")
    ap.add_argument("--replay-sample", default="auto", help="the audit's --replay-sample (auto, all, a fraction)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--separate", action="store_true", help="also time the steps with step_joined off, alternating")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from audit import replay
    from audit.runner import run_script

    kept = []
    original = replay.Replayer._step

    def keep(self, o, d, rec):
        kept.append((o, d, copy.deepcopy(rec)))
        return original(self, o, d, rec)

    os.environ["AMPSPEC_AUDIT_REPLAY"] = "inline"
    replay.Replayer._step = keep
    try:
        if args.size not in audit_overhead.SIZES:
            audit_overhead.SIZES[args.size] = audit_overhead.parse_size(args.size)[1]
        # Every step replayed (the sampling of the optimizer stage as asked): the figure is a replayed step's.
        report = run_script(audit_overhead.SCRIPT, [*audit_overhead.SIZES[args.size], "--steps", str(args.steps)],
                            replay_every=1, replay_sample=args.replay_sample)
    finally:
        replay.Replayer._step = original
        os.environ.pop("AMPSPEC_AUDIT_REPLAY")
    if report.error is not None or report.findings:
        raise RuntimeError(f"the audited workload is not clean:\n{report.text()}")
    steps = kept[2:]  # the first steps create the optimizer's state
    replayer = replay.Replayer(mode="inline")
    from reference.optim import OptimizerSpec

    joined = OptimizerSpec.step_joined
    forms = {"joined": joined, "separate": lambda *a, **k: None} if args.separate else {"joined": joined}
    per_step: dict[str, list[float]] = {form: [] for form in forms}
    try:
        for r in range(args.rounds):
            for form in _harness.rotate(list(forms), r):
                OptimizerSpec.step_joined = forms[form]
                t0 = time.process_time()
                for o, d, rec in steps:
                    rec = copy.copy(rec)
                    rec.replay = "off"
                    replayer._step(o, d, rec)
                per_step[form].append((time.process_time() - t0) / len(steps))
    finally:
        OptimizerSpec.step_joined = joined
    if replayer.divergences:
        raise RuntimeError(f"the replay diverged: {replayer.divergences[0]}")
    for form, times in per_step.items():
        label = f" ({form})" if args.separate else ""
        print(f"{args.size} (--replay-sample {args.replay_sample}){label}: replay CPU per step "
              f"{1e3 * statistics.median(times):.2f} ms (least {1e3 * min(times):.2f}) over {args.rounds} rounds "
              f"of {len(steps)} steps")
    if args.separate:
        ratio = _harness.paired_ratio(per_step, "joined", "separate")
        print(f"joined / separate: {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
