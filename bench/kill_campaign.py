"""SIGKILL campaign: kill ``ampspec train`` at random instants, resume, and compare with a run
that was never interrupted.

One uninterrupted run first; then the same run started with ``--resume`` again and again, each
attempt killed with SIGKILL after a random delay once it is training (checkpoints every step,
so many kills land inside a checkpoint write), until an attempt finishes. At the end it checks:
every resume started (no refusal, no crash other than the kill), every checkpoint left in the
folder verifies, no temporary file is left, and the final checkpoint (model, optimizer, scaler,
counters), the trace and ``metrics.csv`` equal the uninterrupted run's, bit for bit. One line of figures:

    PYTHONPATH=. python bench/kill_campaign.py --kills 100
    PYTHONPATH=. python bench/kill_campaign.py --kills 30 --ddp    # two DDP ranks under torchrun

Exit status 0 when everything held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _command(folder: Path, steps: int, resume: bool, ddp: bool = False) -> list[str]:
    sets = ["device=cpu", "task.name=mlp", "task.size=tiny", "train.batch_size=4", f"train.steps={steps}",
            "precision.mode=bf16", "train.force_scaler=true", "scaler.growth_interval=3", "train.microbatches=2",
            f"checkpoint.folder={folder}", "checkpoint.interval=1", "checkpoint.keep_last=2",
            "train.log_interval=3", f"train.trace_file={folder / 'trace.jsonl'}"]
    if ddp:  # two gloo ranks under torchrun; the whole process group is killed
        sets.append("train.distributed=ddp")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "torchimpl.cli", "train"]
    else:
        cmd = [sys.executable, "-m", "torchimpl.cli", "train"]
    for s in sets:
        cmd += ["--set", s]
    return cmd + (["--resume"] if resume else [])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _final_state(folder: Path, steps: int) -> dict:
    from torchimpl.run.checkpoint import load_checkpoint

    c = load_checkpoint(folder / f"step-{steps:08d}.ckpt")
    return {"model": c["model"], "optimizer": c["optimizer"], "scaler": c["scaler"], "trainer": c["trainer"]}


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):  # bit for bit (a NaN equals itself)
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def campaign(kills: int, steps: int, seed: int, work: Path, max_delay: float = 0.3, ddp: bool = False) -> dict:
    from torchimpl.run.checkpoint import CheckpointError, verify_checkpoint

    rng = random.Random(seed)
    whole, part = work / "whole", work / "part"
    part.mkdir()
    subprocess.run(_command(whole, steps, False, ddp), env=_env(), check=True, capture_output=True)
    figures = {"kills": 0, "inside_write": 0, "resume_failures": 0, "bad_checkpoints": 0, "leftovers": 0,
               "attempts": 0}
    failures: list[str] = []
    while True:
        figures["attempts"] += 1
        proc = subprocess.Popen(_command(part, steps, figures["attempts"] > 1, ddp), env=_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        if figures["kills"] < kills:
            trace = part / "trace.jsonl"
            # Wait until this attempt trains (its trace grows), then kill at a random instant.
            size = trace.stat().st_size if trace.exists() else 0
            deadline = time.time() + 60
            while proc.poll() is None and time.time() < deadline and \
                    (not trace.exists() or trace.stat().st_size <= size):
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, max_delay))
            if proc.poll() is None:
                tmp_before = any(p.name.startswith(".tmp-step-") for p in part.iterdir())
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank at once
                proc.wait()
                figures["kills"] += 1
                figures["inside_write"] += tmp_before or any(p.name.startswith(".tmp-step-") for p in part.iterdir())
                continue
        _, err = proc.communicate()
        if proc.returncode != 0:
            figures["resume_failures"] += 1
            failures.append(f"attempt {figures['attempts']}: exit {proc.returncode}: {err.strip()[-500:]}")
            if figures["resume_failures"] > 3:
                break
            continue
        break
    for p in part.iterdir():
        if p.name.startswith(".tmp-"):
            figures["leftovers"] += 1
        elif p.name.startswith("step-"):
            try:
                verify_checkpoint(p)
            except CheckpointError as exc:
                figures["bad_checkpoints"] += 1
                failures.append(str(exc))
    same_state = _equal(_final_state(whole, steps), _final_state(part, steps))
    same_trace = (whole / "trace.jsonl").read_bytes() == (part / "trace.jsonl").read_bytes()
    same_metrics = (whole / "metrics.csv").read_bytes() == (part / "metrics.csv").read_bytes()
    figures["equal"] = same_state and same_trace and same_metrics
    if not same_metrics:
        failures.append("metrics.csv differs from the uninterrupted run's")
    if not same_state:
        failures.append("the final checkpoint differs from the uninterrupted run's")
    if not same_trace:
        failures.append("the trace differs from the uninterrupted run's")
    figures["failures"] = failures
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of the run (default 8 per kill)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ddp", action="store_true", help="two DDP ranks (gloo) under torchrun, killed together")
    args = ap.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="ampspec-kills-") as tmp:
        f = campaign(args.kills, args.steps or max(30, 8 * args.kills), args.seed, Path(tmp), ddp=args.ddp)
    ok = not f["failures"] and f["equal"]
    print(f"kill campaign{' (DDP, 2 ranks)' if args.ddp else ''}: {f['kills']} kills ({f['inside_write']} inside a checkpoint write), "
          f"{f['attempts']} attempts, {f['resume_failures']} resume failures, {f['bad_checkpoints']} checkpoints "
          f"that fail to verify, {f['leftovers']} leftover temporary files, final state, trace and metrics "
          f"{'equal' if f['equal'] else 'DIFFERENT'} to the uninterrupted run's ({time.time() - t0:.0f} s)")
    for line in f["failures"]:
        print("  " + line)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
