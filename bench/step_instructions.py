"""Instructions per optimizer step of torchimpl's Trainer and of the hand loop, counted by Valgrind.

A count of instructions does not move with the load of a shared machine as a time does, so it
can compare two revisions, or the trainer with the hand loop, where the timings of
``bench/trainer_overhead.py`` are lost in the noise. It is a proxy: an instruction that waits on
memory costs more than one that does not, and the thread hand-offs (the GIL, mutexes) count
however long they wait, so they are shown apart.

Method: the script runs itself under ``valgrind --tool=callgrind --instr-atstart=no`` (imports
and set-up uncounted). For each candidate it switches counting on, trains a fresh block of
``--short`` steps and of ``--short + --extra`` steps (``bench/_loops.py``, the workload of
``bench/trainer_overhead.py``), dumping the counts after each; the difference over ``--extra``
is the count of one step, log points included at their share (``--extra`` a multiple of the
log interval). ``callgrind_annotate`` gives the totals and the thread hand-offs' share.

    PYTHONPATH=. python bench/step_instructions.py --only mlp/bf16    # ~2 minutes a configuration
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402  (puts the repository root on sys.path)

CANDIDATES = ("hand", "ampspec")
# Functions whose count depends on how long a thread waits, not on the work done.
THREAD_SYNC = re.compile(r"gil|pthread|mutex|futex|cond_|sem_|sched_|lll_|spin|wait", re.IGNORECASE)


def inner(config: str, short: int, extra: int) -> None:
    """Under Valgrind: the blocks, each between a zeroing and a dump of the counts."""
    import torch

    from _loops import RUNNERS
    from trainer_overhead import make_workloads

    torch.set_num_threads(1)
    workload = next(w for w in make_workloads(2, 32, 2 * (short + extra)) if w.name == config)
    warnings.simplefilter("ignore")

    def control(*args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)

    for name in CANDIDATES:
        RUNNERS[name](workload, short, lambda event: None)  # first-call paths, uncounted
    control("-i", "on")
    for name in CANDIDATES:
        for steps in (short, short + extra):
            # Each block starts from an empty young generation: a collection of the set-up's
            # garbage would otherwise fall in one block and not the other.
            gc.collect()
            control("-z")
            RUNNERS[name](workload, steps, lambda event: None)
            control("-d", f"{name}-{steps}")


def dump_totals(path: Path) -> tuple[int, int]:
    """A dump's instruction count and the part of it in thread hand-offs."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", str(path)], capture_output=True, text=True,
                          check=True).stdout
    total = sync = 0
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)$", line)
        if m:
            count = int(m.group(1).replace(",", ""))
            if "PROGRAM TOTALS" in m.group(2):
                total = count
            elif THREAD_SYNC.search(m.group(2)):
                sync += count
    return total, sync


def outer(config: str, short: int, extra: int, folder: Path) -> dict:
    """Run :func:`inner` under Valgrind; instructions per step for each candidate."""
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={folder}/cg.out",
           sys.executable, __file__, "--inner", "--only", config, "--short", str(short), "--extra", str(extra)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dumps = {}
    for path in folder.glob("cg.out*"):
        head = path.read_text(errors="replace")[:3000]
        m = re.search(r"^desc: Trigger: dump (.*)$", head, re.M)
        if m:
            dumps[m.group(1)] = dump_totals(path)
    if len(dumps) != 2 * len(CANDIDATES):
        raise SystemExit(f"{config}: valgrind left {len(dumps)} of {2 * len(CANDIDATES)} dumps; its output ends:\n"
                         + (done.stdout + done.stderr)[-2000:])
    out = {}
    for name in CANDIDATES:
        (t0, s0), (t1, s1) = dumps[f"{name}-{short}"], dumps[f"{name}-{short + extra}"]
        out[name] = {"instructions_per_step": (t1 - t0) / extra, "thread_sync_per_step": (s1 - s0) / extra}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", default=["mlp/bf16", "mlp/bf16+scaler"], metavar="CONFIG")
    ap.add_argument("--short", type=int, default=10, help="steps of the shorter block")
    ap.add_argument("--extra", type=int, default=20, help="steps the longer block adds (a multiple of 10)")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = ap.parse_args(argv)
    if args.inner:
        inner(args.only[0], args.short, args.extra)
        return 0
    _harness.require_valgrind("step_instructions")
    results: dict = {"machine": _harness.machine(), "settings": vars(args), "configs": {}}
    for config in args.only:
        with tempfile.TemporaryDirectory(prefix="ampspec-callgrind-") as folder:
            counts = outer(config, args.short, args.extra, Path(folder))
        results["configs"][config] = counts
        hand, ours = counts["hand"], counts["ampspec"]
        extra = ours["instructions_per_step"] - hand["instructions_per_step"]
        extra_sync = ours["thread_sync_per_step"] - hand["thread_sync_per_step"]
        print(f"{config}: hand {hand['instructions_per_step'] / 1e6:.3f} M instructions/step, ampspec "
              f"{extra / 1e3:+.1f} k ({extra_sync / 1e3:+.1f} k of them in thread hand-offs)", flush=True)
    path = _harness.write_result("step_instructions", results, args.out)
    print(f"step_instructions -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
