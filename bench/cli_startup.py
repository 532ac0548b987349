"""How long the ``ampspec`` command takes to answer ``--help``, ``--version`` and an argument
error, against starting Python and against ``import torch``, paired round by round.

Each candidate is a fresh ``python`` process (the one running this script), started in turn
in every round, the order rotating; reported are the median wall times and the median of each
round's ratio to ``import torch`` (a ratio measured in the same round survives a busy
machine's drift; an absolute time on a shared CPU does not).

    python bench/cli_startup.py              # 15 rounds, about 1 minute on 2 cores
    python bench/cli_startup.py --rounds 5
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from _harness import machine, median, paired_ratio, rotate, write_result

ROOT = Path(__file__).resolve().parent.parent

CANDIDATES = {
    "python -c pass": ["-c", "pass"],
    "ampspec --help": ["-m", "torchimpl.cli", "--help"],
    "ampspec --version": ["-m", "torchimpl.cli", "--version"],
    "ampspec compare --steps x (argument error)": ["-m", "torchimpl.cli", "compare", "--steps", "x"],
    "python -c 'import torch'": ["-c", "import torch"],
}
BASE = "python -c 'import torch'"


def _once(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", help="folder for cli_startup.json (default bench/results)")
    args = p.parse_args()
    names = list(CANDIDATES)
    for name in names:  # warm the page cache once
        _once(CANDIDATES[name])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in rotate(names, r):
            times[name].append(_once(CANDIDATES[name]))
    rows = {n: {"median_s": median(times[n]), "ratio_to_import_torch": paired_ratio(times, n, BASE)}
            for n in names}
    for n in names:
        print(f"{n:45} {rows[n]['median_s']:6.3f} s  {rows[n]['ratio_to_import_torch']['median']:5.2f}x import torch")
    path = write_result("cli_startup", {"machine": machine(), "rounds": args.rounds, "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
