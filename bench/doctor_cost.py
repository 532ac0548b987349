"""What ``ampspec doctor --task lm`` costs against ``ampspec train`` on the same task, and what
``logging.precision_stats`` costs a training run.

Candidates, each run in this process through ``torchimpl.cli.main`` (the commands themselves,
stdout discarded), on the embedded transformer (``lm``, size small, batch 16, CPU):

- ``train``: ``ampspec train`` for 20 steps in bf16 (metrics.csv in a temporary run folder, no
  TensorBoard, no progress display);
- ``doctor_bf16``, ``doctor_fp16``: ``ampspec doctor --task lm --precision ... --steps 20``;
- ``train_stats_1``, ``train_stats_10``: ``train`` with ``logging.precision_stats`` 1 and 10.

R rounds, the order rotating each round, after one warm-up round; ratios are the median over
rounds of the per-round ratio to ``train`` (pairing by round cancels a shared machine's drift).
Every training run writes a fresh run folder of its own (a folder holding an earlier run's
files is refused). The issue's bound: the doctor for 20 steps costs at most 3x 20 training steps.

    PYTHONPATH=. python bench/doctor_cost.py              # ~3-6 minutes on 2 busy cores
    PYTHONPATH=. python bench/doctor_cost.py --rounds 5
    PYTHONPATH=. python bench/doctor_cost.py --rounds 2 --steps 2 --size tiny --out /tmp/x   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402  (puts the repository root on sys.path)

from torchimpl.cli.app import main  # noqa: E402

STEPS = 20


def _candidates(folder: Path, steps: int = STEPS, size: str = "small") -> dict[str, Callable[[], list[str]]]:
    """Each candidate's command line, made afresh for each of its runs."""
    runs = itertools.count()
    base = ["train", "-q", "--set", "device=cpu", "--set", "task.name=lm", "--set", f"task.size={size}",
            "--set", "train.batch_size=16", "--set", f"train.steps={steps}", "--set", "precision.mode=bf16",
            "--set", "logging.progress=off"]

    def train(stats: int) -> Callable[[], list[str]]:
        # every training candidate writes its run folder (metrics.csv, no TensorBoard), so that
        # the precision_stats candidates differ from the baseline in that setting alone; a new
        # folder for every run, since a folder holding an earlier run's files is refused
        return lambda: [*base, "--set", f"logging.dir={folder / f'stats{stats}-run{next(runs)}'}",
                        "--set", "logging.tensorboard=false", "--set", "checkpoint.folder=null",
                        "--set", f"logging.precision_stats={stats}"]

    doctor = ["doctor", "--task", "lm", "--size", size, "--batch-size", "16", "--steps", str(steps),
              "--device", "cpu"]
    return {"train": train(0), "doctor_bf16": lambda: [*doctor, "--precision", "bf16"],
            "doctor_fp16": lambda: [*doctor, "--precision", "fp16"], "train_stats_1": train(1),
            "train_stats_10": train(10)}


def _time(argv: list[str]) -> float:
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    elapsed = time.perf_counter() - t0
    if code not in (0, 1):
        raise RuntimeError(f"{' '.join(argv)} exited {code}")
    return elapsed


def run(rounds: int, steps: int = STEPS, size: str = "small") -> dict:
    with tempfile.TemporaryDirectory(prefix="ampspec-doctor-bench-") as tmp:
        cands = _candidates(Path(tmp), steps, size)
        names = list(cands)
        for name in names:  # warm-up: imports, first-call allocations
            _time(cands[name]())
        blocks: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            for name in _harness.rotate(names, r):
                blocks[name].append(_time(cands[name]()))
    return {
        "machine": _harness.machine(),
        "steps": steps,
        "size": size,
        "rounds": rounds,
        "seconds_median": {n: _harness.median(v) for n, v in blocks.items()},
        "ratio_vs_train": {n: _harness.paired_ratio(blocks, n, "train") for n in names if n != "train"},
        "note": "a shared, busy 2-core machine: read the ratios, not the seconds",
    }


def main_(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=STEPS, help="steps of every candidate")
    p.add_argument("--size", choices=("tiny", "small"), default="small", help="the lm task's size")
    p.add_argument("--out", help="folder for doctor_cost.json (default bench/results)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    data = run(args.rounds, args.steps, args.size)
    path = _harness.write_result("doctor_cost", data, args.out)
    print(f"cost against a plain ampspec train of the same {args.steps} steps (task lm, size {args.size}):")
    for name, r in data["ratio_vs_train"].items():
        print(f"{name:16s} {r['median']:.2f}x train (min {r['min']:.2f}, max {r['max']:.2f}, {r['rounds']} rounds)")
    print(f"seconds (median): " + ", ".join(f"{n} {s:.1f}" for n, s in data["seconds_median"].items()))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
