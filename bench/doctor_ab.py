"""The CPU time of the same ``ampspec doctor`` command on the code before a change and after it,
alternated run by run: where a shared machine's load moves every timing by tens of percent from
one minute to the next (``bench/doctor_cost.py``'s ratios), runs of the two codes side by side in
time share that drift, and their paired ratio does not.

Two worker processes, one per checkout, each importing its own ampspec once and running one
diagnosis after a warm-up; then R rounds, each asking one worker for a run and then the other
(the order alternating round by round) and taking after / before of the two CPU times (this
worker's CPU time, user and system, of one ``main(["doctor", ...])``, stdout discarded). The
result: the median over rounds of the paired ratio, its quartiles, and each side's seconds.

    git archive HEAD~3 | (mkdir -p /tmp/before && tar -x -C /tmp/before)   # the code before
    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/doctor_ab.py --before /tmp/before --rounds 20
    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/doctor_ab.py --before /tmp/before --precision fp16
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402  (puts the repository root on sys.path)

ROOT = Path(__file__).resolve().parent.parent


def _argv(precision: str, steps: int, size: str) -> list[str]:
    return ["doctor", "--task", "lm", "--size", size, "--batch-size", "16", "--steps", str(steps),
            "--device", "cpu", "--precision", precision]


def worker(root: str, argv: list[str]) -> None:
    """One checkout's runs: a warm-up, then one timed run per line read, its seconds printed."""
    sys.path.insert(0, root)
    import torchimpl
    from torchimpl.cli.app import main

    if not Path(torchimpl.__file__).resolve().is_relative_to(Path(root).resolve()):
        raise SystemExit(f"imported {torchimpl.__file__}, not the checkout at {root}")
    with contextlib.redirect_stdout(io.StringIO()):
        main(argv)
    for _ in sys.stdin:
        t0 = time.process_time()
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        print(json.dumps({"seconds": time.process_time() - t0, "code": code}), flush=True)


class _Worker:
    def __init__(self, root: Path, argv: list[str]) -> None:
        if not (root / "torchimpl" / "cli" / "app.py").is_file():
            raise SystemExit(f"{root} is not an ampspec checkout (no torchimpl/cli/app.py)")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(root), "--", *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))

    def run(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the worker exited {self.proc.wait()} (its error is above)")
        done = json.loads(line)
        if done["code"] not in (0, 1):
            raise SystemExit(f"ampspec doctor exited {done['code']} in a worker")
        return float(done["seconds"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def run(before: Path, rounds: int, argv: list[str]) -> dict:
    workers = {"before": _Worker(before, argv), "after": _Worker(ROOT, argv)}
    seconds: dict[str, list[float]] = {"before": [], "after": []}
    try:
        for r in range(rounds):
            for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                seconds[side].append(workers[side].run())
    finally:
        for w in workers.values():
            w.close()
    ratios = sorted(a / b for a, b in zip(seconds["after"], seconds["before"]))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"machine": _harness.machine(), "command": " ".join(["ampspec", *argv]), "before": str(before),
            "rounds": rounds, "clock": "process_time",
            "after_over_before": {"median": statistics.median(ratios), "q1": q[0], "q3": q[2]},
            "seconds_median": {k: statistics.median(v) for k, v in seconds.items()}}


def main_(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[3:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="a checkout of the code before (its root folder)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--out", help="folder for doctor_ab.json (default bench/results)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    data = run(Path(args.before).resolve(), args.rounds, _argv(args.precision, args.steps, args.size))
    path = _harness.write_result("doctor_ab", data, args.out)
    r, s = data["after_over_before"], data["seconds_median"]
    print(f"{data['command']}: after / before {r['median']:.3f} (quartiles {r['q1']:.3f} .. {r['q3']:.3f}, "
          f"{args.rounds} paired rounds); CPU seconds (median) before {s['before']:.3f}, after {s['after']:.3f}")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
