"""Three parts of the audit's replay, timed alone: the spec's fused multiply-add, the copies,
and the drawing of a sample's indices.

``fma``: Adam's native ``lerp_fused`` and ``addcmul_fused`` (`reference.optim._common`, rule 7)
of this tree against those of revision ``--against`` (its ``_common.py`` exported with ``git
show`` and loaded beside this one), alternating call block by call block, at 2**11 and 2**16
elements; printed: the median of the paired ratios this / other. Also the same elements'
float32 multiply-add (``x * w + y``), the floor of one rounding per operation, as a scale.

``copies``: one step's copies of the 0.2M MLP's tensors (7.7 MB, as `audit.worker` lays them
in a slab: gradients three times, parameters and Adam's state twice) by ``torch._foreach_copy_``
into 1, 2, 3, 4 and 6 slabs of shared memory in turn; printed: ms a step and the ratio to one
slab, whose memory stays in the caches.

``sample``: drawing the indices of the default sample (`audit.sampling`: 2**19 elements) of the
depth-4 MLPs of 12.8M and 50M parameters (bench/audit_overhead.py's ``--sizes``), all tensors,
once; the replay process does it once a run.

All run with the replay process's malloc settings (`audit.worker`): its NumPy temporaries come
from the heap, as there.

    PYTHONPATH=. python bench/_replay_parts.py --against HEAD~1
    PYTHONPATH=. python bench/_replay_parts.py --only copies
    PYTHONPATH=. python bench/_replay_parts.py --only sample
"""

from __future__ import annotations

import argparse
import importlib.util
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _harness  # noqa: E402,F401  (puts the repository root on sys.path)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from audit.worker import _keep_freed_memory  # noqa: E402

ROOT = HERE.parent
COMMON = "reference/optim/_common.py"


def _module_at(rev: str, folder: Path) -> ModuleType:
    """``reference/optim/_common.py`` of revision ``rev``, loaded under a name of its own."""
    text = subprocess.run(["git", "show", f"{rev}:{COMMON}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    path = folder / "other_common.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("other_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fma(against: str, rounds: int) -> None:
    from reference.optim import _common as this

    with tempfile.TemporaryDirectory(prefix="ampspec-parts-") as folder:
        other = _module_at(against, Path(folder))
        rng = np.random.default_rng(0)
        for n in (1 << 11, 1 << 16):
            x = (rng.standard_normal(n) * 1e-3).astype(np.float32)
            y = (rng.standard_normal(n) * 1e-3).astype(np.float32)
            calls = max(10, (1 << 22) // n)

            def block(m: ModuleType) -> float:
                t = time.perf_counter()
                for _ in range(calls):
                    m.lerp_fused(x, y, 0.1)
                    m.addcmul_fused(x, y, y, 0.001)
                return (time.perf_counter() - t) / calls

            times: dict[str, list[float]] = {"this": [], "other": []}
            for r in range(rounds):
                for name in _harness.rotate(["this", "other"], r):
                    times[name].append(block(this if name == "this" else other))
            ratio = _harness.paired_ratio(times, "this", "other")
            t = time.perf_counter()
            for _ in range(calls):
                np.add(np.multiply(x, np.float32(0.1)), y)
                np.add(np.multiply(np.multiply(y, np.float32(0.001)), y), x)
            floor = (time.perf_counter() - t) / calls
            print(f"fma {n:6d} elements: lerp_fused + addcmul_fused {1e6 * statistics.median(times['this']):7.1f} us, "
                  f"this / {against} {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]; "
                  f"float32 multiply-adds alone {1e6 * floor:6.1f} us ({statistics.median(times['this']) / floor:.1f}x)")


def copies(rounds: int) -> None:
    torch.set_num_threads(1)
    width, sizes = 256, []
    for rows, cols in ((width, 64), (width, width), (width, width), (width, width), (8, width)):
        sizes += [rows * cols, rows]  # a weight and its bias
    sources = [torch.randn(n) for n in sizes]
    nbytes = 4 * sum(sizes)
    per_step = 9  # gradients 3 times, parameters twice, Adam's two moments twice
    slab_bytes = per_step * nbytes
    fd = os.memfd_create("ampspec-parts")
    try:
        os.posix_fallocate(fd, 0, 6 * slab_bytes)
        mapping = mmap.mmap(fd, 6 * slab_bytes)
    finally:
        os.close(fd)
    flat = torch.frombuffer(mapping, dtype=torch.float32)
    slabs = []
    for s in range(6):
        at, lists = s * slab_bytes // 4, []
        for _ in range(per_step):
            views = []
            for n in sizes:
                views.append(flat[at:at + n])
                at += n
            lists.append(views)
        slabs.append(lists)
    results: dict[int, list[float]] = {}
    for r in range(rounds):
        for count in _harness.rotate([1, 2, 3, 4, 6], r):
            steps = 30
            t = time.perf_counter()
            for k in range(steps):
                for views in slabs[k % count]:
                    torch._foreach_copy_(views, sources)
            results.setdefault(count, []).append((time.perf_counter() - t) / steps)
    for count, times in results.items():
        ratio = _harness.paired_ratio({str(c): v for c, v in results.items()}, str(count), "1")
        print(f"copies of one step ({per_step * nbytes / 2**20:.1f} MiB) into {count} slab(s) in turn: "
              f"{1e3 * statistics.median(times):.3f} ms, {ratio['median']:.2f}x one slab")
    del flat, slabs
    mapping.close()


def sample() -> None:
    import audit_overhead

    from audit.sampling import Sampling

    for label in ("12.8M", "50M"):
        _, args = audit_overhead.parse_size(label)
        w = int(args[args.index("--width") + 1])
        shapes = [(w, 64), (w,), (w, w), (w,), (w, w), (w,), (w, w), (w,), (8, w), (8,)]
        plan = Sampling().plan(tuple(shapes), "elements")
        t = time.perf_counter()
        for i in range(len(shapes)):
            plan.indices(i)
        print(f"sample of the {label} MLP ({plan.describe()}): its indices drawn in "
              f"{1e3 * (time.perf_counter() - t):.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", default="HEAD", help="the revision whose fma32 is the baseline")
    ap.add_argument("--only", choices=("fma", "copies", "sample"), default=None)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    _keep_freed_memory()
    if args.only in (None, "fma"):
        fma(args.against, args.rounds)
    if args.only in (None, "copies"):
        copies(args.rounds)
    if args.only in (None, "sample"):
        sample()
    return 0


if __name__ == "__main__":
    sys.exit(main())
