"""CPU time of the audit's replay per step, apart from the training: a load-robust figure.

The workload of bench/audit_overhead.py (``--size``, default ``mlp``) runs once under the audit
with the replay inline, and each step's data is kept; those steps are then replayed again and
again by a fresh `audit.replay.Replayer` in this process, timed with ``time.process_time`` (CPU
time of this process, which a busy machine's other processes inflate far less than wall time).
Printed: the median and the least CPU milliseconds a step over ``--rounds`` rounds. To set two
revisions side by side, run it in each tree (``git archive REV | tar -x -C DIR``).

    PYTHONPATH=. python bench/_audit_replay_cpu.py --rounds 7
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
import _harness  # noqa: F401  (puts the repository root on sys.path)
import audit_overhead
import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="mlp", help=f"one of {', '.join(sorted(audit_overhead.SIZES))}, or a parameter "
                    "count (0.2M, 12.8M: audit_overhead.py --sizes' MLP)")
    ap.add_argument("--replay-sample", default="auto", help="the audit's --replay-sample (auto, all, a fraction)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=7)
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
    per_step = []
    for _ in range(args.rounds):
        t0 = time.process_time()
        for o, d, rec in steps:
            rec = copy.copy(rec)
            rec.replay = "off"
            replayer._step(o, d, rec)
        per_step.append((time.process_time() - t0) / len(steps))
    if replayer.divergences:
        raise RuntimeError(f"the replay diverged: {replayer.divergences[0]}")
    print(f"{args.size} (--replay-sample {args.replay_sample}): replay CPU per step {1e3 * statistics.median(per_step):.2f} ms "
          f"(least {1e3 * min(per_step):.2f}) over {args.rounds} rounds of {len(steps)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
