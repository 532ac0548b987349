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
The issue's bound: the doctor for 20 steps costs at most 3x 20 training steps.

    PYTHONPATH=. python bench/doctor_cost.py              # ~3-6 minutes on 2 busy cores
    PYTHONPATH=. python bench/doctor_cost.py --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402  (puts the repository root on sys.path)

from torchimpl.cli import main  # noqa: E402

STEPS = 20
_TRAIN = ["train", "-q", "--set", "device=cpu", "--set", "task.name=lm", "--set", "train.batch_size=16",
          "--set", f"train.steps={STEPS}", "--set", "precision.mode=bf16", "--set", "logging.progress=off"]


def _candidates(folder: Path) -> dict[str, list[str]]:
    def train(stats: int) -> list[str]:
        # every training candidate writes its run folder (metrics.csv, no TensorBoard), so that
        # the precision_stats candidates differ from the baseline in that setting alone
        return [*_TRAIN, "--set", f"logging.dir={folder / f'stats{stats}'}", "--set", "logging.tensorboard=false",
                "--set", "checkpoint.folder=null", "--set", f"logging.precision_stats={stats}"]

    doctor = ["doctor", "--task", "lm", "--batch-size", "16", "--steps", str(STEPS), "--device", "cpu"]
    return {"train": train(0), "doctor_bf16": [*doctor, "--precision", "bf16"],
            "doctor_fp16": [*doctor, "--precision", "fp16"], "train_stats_1": train(1),
            "train_stats_10": train(10)}


def _time(argv: list[str]) -> float:
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    elapsed = time.perf_counter() - t0
    if code not in (0, 1):
        raise RuntimeError(f"{' '.join(argv)} exited {code}")
    return elapsed


def run(rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ampspec-doctor-bench-") as tmp:
        cands = _candidates(Path(tmp))
        names = list(cands)
        for name in names:  # warm-up: imports, first-call allocations
            _time(cands[name])
        blocks: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            for name in _harness.rotate(names, r):
                blocks[name].append(_time(cands[name]))
    return {
        "machine": _harness.machine(),
        "steps": STEPS,
        "rounds": rounds,
        "seconds_median": {n: _harness.median(v) for n, v in blocks.items()},
        "ratio_vs_train": {n: _harness.paired_ratio(blocks, n, "train") for n in names if n != "train"},
        "note": "a shared, busy 2-core machine: read the ratios, not the seconds",
    }


def main_(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="folder for doctor_cost.json (default bench/results)")
    args = p.parse_args(argv)
    data = run(args.rounds)
    path = _harness.write_result("doctor_cost", data, args.out)
    for name, r in data["ratio_vs_train"].items():
        print(f"{name:16s} {r['median']:.2f}x train (min {r['min']:.2f}, max {r['max']:.2f}, {r['rounds']} rounds)")
    print(f"seconds (median): " + ", ".join(f"{n} {s:.1f}" for n, s in data["seconds_median"].items()))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
