"""The audit's overhead on this tree beside another revision's, measured in the same run.

    PYTHONPATH=. python bench/_audit_versus.py main --rounds 5 --only mlp tiny
    PYTHONPATH=. python bench/_audit_versus.py main --this HEAD   # a commit instead of the work tree

The other revision's files are exported with ``git archive`` into a temporary folder. Each round
runs ``bench/audit_overhead.py --rounds 1`` once in each tree (the order alternating from round
to round), each in a fresh interpreter, so both see the same load on a busy machine; each
invocation's own per-round ratios to ``plain`` are collected and their medians over the rounds
reported side by side.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def export(rev: str, into: Path) -> Path:
    data = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def one_round(tree: Path, sizes: list[str], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(tree / "bench" / "audit_overhead.py"), "--rounds", "1", "--only", *sizes,
           "--out", str(out)]
    subprocess.run(cmd, cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, check=True,
                   capture_output=True, timeout=1200)
    newest = max(out.glob("*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(newest.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", help="the revision to measure beside this tree (e.g. main)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="+", default=["mlp"])
    ap.add_argument("--this", default=None, help="a revision to measure instead of this work tree")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ampspec-versus-") as tmp:
        this = ROOT if args.this is None else export(args.this, Path(tmp) / "this")
        trees = {args.rev: export(args.rev, Path(tmp) / "other"), args.this or "this tree": this}
        ratios: dict[str, dict[str, dict[str, list[float]]]] = {k: {} for k in trees}
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                res = one_round(trees[name], args.only, Path(tmp) / "out" / name.replace(" ", "_"))
                for size, row in res["sizes"].items():
                    for cand, v in row["ratio_vs_plain"].items():
                        ratios[name].setdefault(size, {}).setdefault(cand, []).append(v["median"])
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for size in args.only:
        for name in trees:
            row = ratios[name].get(size, {})
            cells = "  ".join(f"{c} x{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for c, v in row.items())
            print(f"{size:8} {name:10} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
