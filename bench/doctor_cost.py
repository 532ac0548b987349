"""What ``ampspec doctor --task lm`` costs against ``ampspec train`` on the same task, and what
``logging.precision_stats`` costs a training run.

Candidates, each run in this process through ``torchimpl.cli.main`` (the commands themselves,
stdout discarded), on the embedded transformer (``lm``, size small, batch 16, CPU):

- ``train``: ``ampspec train`` for 20 steps in bf16 (metrics.csv in a temporary run folder, no
  TensorBoard, no progress display);
- ``loop_bf16``, ``loop_fp16``: a hand-written loop of the same steps on the same task (AdamW at
  the doctor's lr, ``torch.autocast`` in that dtype, fp16 with ``GradScaler("cpu")``): the
  training run in fp16, which ``ampspec train`` does not run on a CPU (it falls back to fp32);
- ``doctor_bf16``, ``doctor_fp16``: ``ampspec doctor --task lm --precision ... --steps 20``;
- ``train_stats_1``, ``train_stats_10``: ``train`` with ``logging.precision_stats`` 1 and 10.

R rounds, the order rotating each round, after one warm-up round; ratios are the median over
rounds of the per-round ratio to ``train`` (pairing by round cancels a shared machine's drift),
and each diagnosis's ratio to the training run in its own precision (``doctor_bf16`` over
``train``, ``doctor_fp16`` over ``loop_fp16``): a diagnosis runs the model in the mode it diagnoses, so on a CPU without float16
arithmetic (emulated, several times bf16's cost) an fp16 diagnosis over a bf16 run measures the
CPU, not the doctor.
Every training run writes a fresh run folder of its own (a folder holding an earlier run's
files is refused). The issue's bound: the doctor for 20 steps costs at most 3x 20 training steps.

    PYTHONPATH=. python bench/doctor_cost.py              # ~3-6 minutes on 2 busy cores
    PYTHONPATH=. python bench/doctor_cost.py --rounds 5
    PYTHONPATH=. python bench/doctor_cost.py --rounds 5 --clock cpu   # this process's CPU time
    PYTHONPATH=. python bench/doctor_cost.py --rounds 2 --steps 2 --size tiny --out /tmp/x   # a smoke run

Instructions (``--instructions``): where the timings drown in the load of a shared machine, the
script reruns itself under ``valgrind --tool=callgrind --instr-atstart=no`` (imports and the
warm-up uncounted, one intra-op thread) and counts the instructions of one run of each of
``train``, ``doctor_bf16`` and ``doctor_fp16`` (``--candidates``), each between a zeroing and a
dump of the counts (``bench/step_instructions.py``'s method). A count is a proxy: it leaves out
the kernel's time (page faults of fresh allocations) and the waits on memory, and Valgrind runs
torch's kernels without AVX-512 (it does not emulate it), so on a CPU with bf16 dot products the
model's bf16 matrix products count many times their native cost: compare the doctor's count over
``train``'s between revisions, not the ratio.

    PYTHONPATH=. python bench/doctor_cost.py --instructions --steps 2 --size tiny   # ~2 minutes
    PYTHONPATH=. python bench/doctor_cost.py --instructions   # 20 steps: over half an hour on 2 busy cores
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import os
import re
import subprocess
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
            "--set", "train.batch_size=16", "--set", f"train.steps={steps}", "--set", "logging.progress=off"]

    def train(stats: int, mode: str = "bf16") -> Callable[[], list[str]]:
        # every training candidate writes its run folder (metrics.csv, no TensorBoard), so that
        # the precision_stats candidates differ from the baseline in that setting alone; a new
        # folder for every run, since a folder holding an earlier run's files is refused
        return lambda: [*base, "--set", f"precision.mode={mode}",
                        "--set", f"logging.dir={folder / f'{mode}-stats{stats}-run{next(runs)}'}",
                        "--set", "logging.tensorboard=false", "--set", "checkpoint.folder=null",
                        "--set", f"logging.precision_stats={stats}"]

    doctor = ["doctor", "--task", "lm", "--size", size, "--batch-size", "16", "--steps", str(steps),
              "--device", "cpu"]
    return {"train": train(0), "loop_bf16": lambda: _loop("bf16", steps, size),
            "loop_fp16": lambda: _loop("fp16", steps, size), "doctor_bf16": lambda: [*doctor, "--precision", "bf16"],
            "doctor_fp16": lambda: [*doctor, "--precision", "fp16"], "train_stats_1": train(1),
            "train_stats_10": train(10)}


def _loop(mode: str, steps: int, size: str) -> Callable[[], int]:
    """A plain training loop of ``steps`` steps on the doctor's task (seed 0, batch 16, AdamW at
    the doctor's default lr 1e-3) under ``torch.autocast("cpu", dtype)``; fp16 with a GradScaler."""

    def run() -> int:
        import torch

        from torchimpl.config.schema import TaskConfig
        from torchimpl.task.builtin import build_task

        task = build_task(TaskConfig(name="lm", size=size), seed=0, batch_size=16)
        model, dtype = task.model, {"bf16": torch.bfloat16, "fp16": torch.float16}[mode]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", enabled=mode == "fp16")
        batches = iter(task.train_data)
        for _ in range(steps):
            inputs, targets = next(batches)
            with torch.autocast("cpu", dtype=dtype):
                loss = model(inputs, targets)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return 0

    return run


SAME_PRECISION = {"doctor_bf16": "train", "doctor_fp16": "loop_fp16"}
"""Each diagnosis's baseline: the training run in the precision it diagnoses."""


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""``--clock``: the wall time, or this process's CPU time (every thread's, user and system: what a
run costs the machine, less sensitive to other work than the wall time, not insensitive)."""


def _time(argv: list[str] | Callable[[], int], clock: Callable[[], float] = time.perf_counter) -> float:
    """The time of one candidate's run: a command line of ``ampspec``, or a loop (`_loop`)."""
    t0 = clock()
    with contextlib.redirect_stdout(io.StringIO()):
        code = argv() if callable(argv) else main(argv)
    elapsed = clock() - t0
    if code not in (0, 1):
        raise RuntimeError(f"{argv if callable(argv) else ' '.join(argv)} exited {code}")
    return elapsed


def run(rounds: int, steps: int = STEPS, size: str = "small", clock: str = "wall") -> dict:
    with tempfile.TemporaryDirectory(prefix="ampspec-doctor-bench-") as tmp:
        cands = _candidates(Path(tmp), steps, size)
        names = list(cands)
        for name in names:  # warm-up: imports, first-call allocations
            _time(cands[name]())
        blocks: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            for name in _harness.rotate(names, r):
                blocks[name].append(_time(cands[name](), CLOCKS[clock]))
    return {
        "machine": _harness.machine(),
        "steps": steps,
        "size": size,
        "rounds": rounds,
        "clock": clock,
        "seconds_median": {n: _harness.median(v) for n, v in blocks.items()},
        "ratio_vs_train": {n: _harness.paired_ratio(blocks, n, "train") for n in names if n != "train"},
        "ratio_vs_same_precision": {n: _harness.paired_ratio(blocks, n, b) for n, b in SAME_PRECISION.items()},
        "note": "a shared, busy 2-core machine: read the ratios, not the seconds",
    }


def instructions_inner(names: list[str], steps: int, size: str) -> None:
    """Under Valgrind: each candidate once uncounted (first-call paths), then once counted."""

    def control(*args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)

    with tempfile.TemporaryDirectory(prefix="ampspec-doctor-bench-") as tmp:
        cands = _candidates(Path(tmp), steps, size)
        for name in names:
            _time(cands[name]())
        control("-i", "on")
        for name in names:
            gc.collect()  # the young generation empty: no collection of earlier garbage in the block
            control("-z")
            _time(cands[name]())
            control("-d", name)


def instructions(names: list[str], steps: int, size: str) -> dict:
    """Instructions of one run of each candidate (``instructions_inner`` under Valgrind)."""
    from step_instructions import dump_totals

    with tempfile.TemporaryDirectory(prefix="ampspec-callgrind-") as folder:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={folder}/cg.out",
               sys.executable, __file__, "--inner-instructions", "--steps", str(steps), "--size", size,
               "--candidates", *names]
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        counts = {}
        for path in Path(folder).glob("cg.out*"):
            m = re.search(r"^desc: Trigger: dump (.*)$", path.read_text(errors="replace")[:3000], re.M)
            if m:
                counts[m.group(1)] = dump_totals(path)[0]
    if set(counts) != set(names):
        raise SystemExit(f"valgrind left {len(counts)} of {len(names)} dumps; its output ends:\n"
                         + (done.stdout + done.stderr)[-2000:])
    counts = {n: counts[n] for n in names}
    return {"machine": _harness.machine(), "steps": steps, "size": size, "instructions": counts,
            "ratio_vs_train": {n: counts[n] / counts["train"] for n in names if n != "train" and "train" in counts}}


def main_(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=STEPS, help="steps of every candidate")
    p.add_argument("--size", choices=("tiny", "small"), default="small", help="the lm task's size")
    p.add_argument("--out", help="folder for doctor_cost.json (default bench/results)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="what the timings measure")
    p.add_argument("--instructions", action="store_true",
                   help="count instructions under Valgrind's callgrind instead of timing")
    p.add_argument("--candidates", nargs="+", default=["train", "doctor_bf16", "doctor_fp16"],
                   choices=list(_candidates(Path("."))), help="with --instructions: the candidates counted")
    p.add_argument("--inner-instructions", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    if args.inner_instructions:
        instructions_inner(args.candidates, args.steps, args.size)
        return 0
    if args.instructions:
        _harness.require_valgrind("--instructions")
        data = instructions(args.candidates, args.steps, args.size)
        path = _harness.write_result("doctor_instructions", data, args.out)
        print(f"instructions of one run of {args.steps} steps (task lm, size {args.size}, one intra-op thread):")
        for name, n in data["instructions"].items():
            ratio = data["ratio_vs_train"].get(name)
            print(f"{name:16s} {n / 1e6:9.1f} M" + (f"   {ratio:.2f}x train" if ratio is not None else ""))
        print(f"written to {path}")
        return 0
    data = run(args.rounds, args.steps, args.size, args.clock)
    path = _harness.write_result("doctor_cost", data, args.out)
    print(f"cost against a plain ampspec train of the same {args.steps} steps (task lm, size {args.size}):")
    for name, r in data["ratio_vs_train"].items():
        print(f"{name:16s} {r['median']:.2f}x train (min {r['min']:.2f}, max {r['max']:.2f}, {r['rounds']} rounds)")
    print("each diagnosis against the training run in its own precision (the bound's measure):")
    for name, r in data["ratio_vs_same_precision"].items():
        print(f"{name:16s} {r['median']:.2f}x {SAME_PRECISION[name]} (min {r['min']:.2f}, max {r['max']:.2f})")
    print(f"{args.clock} seconds (median): " + ", ".join(f"{n} {s:.1f}" for n, s in data["seconds_median"].items()))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
