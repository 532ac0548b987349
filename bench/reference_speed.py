"""Speed of the NumPy reference against torch on the same CPU, and the conformance suite's pace.

Part 1: unscale + inf check + clip (L2, max_norm 1.0) of float32 gradients, split into the
tensor shapes of a GPT-style transformer (embedding, per-layer qkv/proj/fc1/fc2 weights and
biases, layer norms) adding up to about 1M and 10M elements (100M with ``--large``):

- ``reference``: ``reference.scaling.unscale_gradients_`` (which runs ``has_inf_or_nan``) then
  ``reference.clipping.clip_grad_norm_`` with its default ``order="torch_cpu"``, the bit-for-bit
  emulation of ATen's CPU summation order, both in place on fresh copies of the gradients (the
  copy is not timed), as the torch candidates work. Single-threaded (NumPy ufuncs).
- ``reference, new arrays``: ``unscale_gradients`` then ``clip_grad_norm``, the functional
  forms, each returning new arrays: the difference is the cost of allocating (and, on large
  inputs, page-faulting) two sets of gradient-sized arrays.
- ``reference exact``: the same with ``order="exact"`` (float64 squares, ``math.fsum``); 1M only,
  it is meant for small inputs.
- ``torch 1 thread`` / ``torch N threads``: ``torch._amp_foreach_non_finite_check_and_unscale_``
  then ``torch.nn.utils.get_total_norm`` + ``clip_grads_with_norm_`` (what torchimpl's Trainer
  runs), in place on fresh copies of the gradients (the copy is not timed).

Candidates alternate within each repetition; reported are median times, the ratio of each to
``torch 1 thread`` (the like-for-like comparison with single-threaded NumPy), and ns per
element, whose change from size to size shows how each grows.

Part 3 (first in the output): one optimizer step of every registered optimizer
(``reference.optim.SPECS``) and implementation on float32 parameters of the 1M-element shapes,
from a state one step old, with torch's defaults and, for SGD and Adam(W), the options whose
rules add work (``VARIANTS``: momentum, Nesterov with weight decay, dampening with maximize,
AMSGrad): the spec's step function against torch's optimizer with the same implementation and
options on 1 thread. Each round times a block of ``--block`` consecutive steps of each, in
alternating order, as the CPU time of the calling thread (``time.thread_time``: user and
system time, so page faults count and time spent preempted by other processes does not; torch
at 1 thread computes on the calling thread). Printed per row: the medians, and the per-round
ratio spec / torch as median [min-max] over the rounds (goal <= 3). The for-loop and foreach
spec steps take NumPy's square root (torch's own only matters for bits, not for speed). torch
runs its native kernels (``cpu_capability`` in the JSON), not the exact mode. On native kernels a
row's ``native_exact`` paths are timed twice more: ``native``, the spec's fused multiply-adds
(``step(..., native=True)``, bit for bit with torch there), and ``native joined``, the same with
the parameters laid end to end (``step_joined``, one call a run of parameters, as the audit's
replay steps a group).

The spec returns new arrays (parameters, moments) where torch updates in place, so a spec step
writes memory the operating system has to map and zero first, about as costly as the arithmetic
on a 1M-element step; glibc hands freed memory back when the top of its heap outgrows its trim
threshold, so this happens at every step. ``MALLOC_TOP_PAD_=268435456`` before the command
keeps the freed pages in the process and shows the ratio without that cost. The same spec
function can time differently in two rows (SGD's for-loop and foreach rows run one function):
what the torch candidate allocated and freed moves glibc's thresholds, and with them how many
of the spec's pages are fresh.

Part 2: Hypothesis examples per second for each property of ``pytest conformance`` (CPU,
the ``ci`` profile unless ``--profile`` says otherwise), from ``--hypothesis-show-statistics``:
passing examples divided by the seconds of the generate phase (which includes running them).

    PYTHONPATH=. python bench/reference_speed.py           # ~1 minute on 2 cores
    PYTHONPATH=. python bench/reference_speed.py --optimizers-only  # part 3 alone, ~1 minute
    .venv/bin/python bench/reference_speed.py --optimizers-only --reps 15   # the same, more rounds
    PYTHONPATH=. python bench/reference_speed.py --large   # adds 100M elements (~3 GB of RAM)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from reference import optim  # noqa: E402
from reference.optim._common import NATIVE_KERNELS  # noqa: E402
from reference.clipping import clip_grad_norm, clip_grad_norm_  # noqa: E402
from reference.scaling import ScalerState, unscale_gradients, unscale_gradients_  # noqa: E402

SCALE = np.float32(2.0**16)


def transformer_shapes(target: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-style model with about ``target`` parameters."""
    d = 128 if target <= 2_000_000 else 512 if target <= 20_000_000 else 1024
    vocab = {128: 2048, 512: 4096}.get(d, 16384)
    per_layer = [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    layer_size = sum(int(np.prod(s)) for s in per_layer)
    emb = vocab * d
    layers = max(1, round((target - emb - 2 * d) / layer_size))
    return [(vocab, d)] + per_layer * layers + [(d,), (d,)]


def make_grads(shapes: list[tuple[int, ...]], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Loss-scaled gradients: unit-scale values times the scale, all finite.
    return [(rng.standard_normal(s, dtype=np.float32) * np.float32(1e-3) * SCALE) for s in shapes]


def run_reference(grads: list[np.ndarray], order: str, in_place: bool = True) -> float:
    state = ScalerState(SCALE, np.int32(0), 1)
    if in_place:
        work = [g.copy() for g in grads]  # fresh scaled gradients, untimed
        t0 = time.perf_counter()
        unscaled, found = unscale_gradients_(work, state)
        result = clip_grad_norm_(unscaled, 1.0, order=order)
    else:
        t0 = time.perf_counter()
        unscaled, found = unscale_gradients(grads, state)
        result = clip_grad_norm(unscaled, 1.0, order=order)
    elapsed = time.perf_counter() - t0
    assert not found and np.isfinite(result.total_norm)
    return elapsed


class TorchCandidate:
    def __init__(self, grads: list[np.ndarray], threads: int):
        self.master = [torch.from_numpy(g) for g in grads]
        self.params = [torch.nn.Parameter(torch.empty_like(m)) for m in self.master]
        for p, m in zip(self.params, self.master):
            p.grad = m.clone()
        self.threads = threads

    def __call__(self) -> float:
        for p, m in zip(self.params, self.master):
            p.grad.copy_(m)  # fresh scaled gradients, untimed
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            grads = [p.grad for p in self.params]
            t0 = time.perf_counter()
            found = torch.zeros(())
            inv = torch.full((), 1.0 / float(SCALE))
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            torch.nn.utils.clip_grads_with_norm_(self.params, 1.0, norm)
            elapsed = time.perf_counter() - t0
        finally:
            torch.set_num_threads(before)
        assert float(found) == 0.0 and torch.isfinite(norm)
        return elapsed


def bench_size(target: int, reps: int, threads_all: int) -> dict:
    shapes = transformer_shapes(target)
    grads = make_grads(shapes)
    n = sum(g.size for g in grads)
    candidates = {
        "reference": lambda: run_reference(grads, "torch_cpu"),
        "reference, new arrays": lambda: run_reference(grads, "torch_cpu", in_place=False),
        "torch 1 thread": TorchCandidate(grads, 1),
    }
    if threads_all > 1:
        candidates[f"torch {threads_all} threads"] = TorchCandidate(grads, threads_all)
    if target <= 2_000_000:
        candidates["reference exact"] = lambda: run_reference(grads, "exact")
    names = list(candidates)
    for name in names:  # warm-up
        candidates[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        for name in _harness.rotate(names, r):
            times[name].append(candidates[name]())
    base = "torch 1 thread"
    out: dict = {"elements": n, "tensors": len(shapes), "largest_tensor": max(g.size for g in grads),
                 "candidates": {}}
    for name in names:
        med = _harness.median(times[name])
        out["candidates"][name] = {
            "median_ms": 1e3 * med,
            "ns_per_element": 1e9 * med / n,
            "ratio_vs_torch_1_thread": _harness.paired_ratio(times, name, base),
        }
    return out


# Options whose rules add work, beyond torch's defaults (the first, empty, row of each).
VARIANTS: dict[str, list[dict]] = {
    "SGD": [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
            {"momentum": 0.9, "dampening": 0.1, "maximize": True}],
    "Adam": [{}, {"amsgrad": True}],
    "AdamW": [{}, {"amsgrad": True}],
}
_FLAGS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _label(name: str, options: dict, impl: str) -> str:
    opts = ", ".join(f"{k}={v}" for k, v in options.items())
    return f"{name}({opts}) {impl}" if opts else f"{name} {impl}"


def _spec_forms(row: optim.OptimizerSpec, impl: str, cfg: object) -> dict[str, Callable]:
    """The spec's step of one row and implementation as the rows of part 3 time it: as
    ``row.step`` computes it (label suffix ""), and where the row has them on this machine's
    native kernels, its fused form (`` native``, reference.optim._common rule 7) and that form
    with the parameters laid end to end (`` native joined``, `OptimizerSpec.step_joined`, as the
    audit's replay steps a group)."""
    forms: dict[str, Callable] = {"": lambda p, g, s: row.step(impl, p, g, s, cfg)}
    if impl in row.native_exact and torch.backends.cpu.get_cpu_capability() in NATIVE_KERNELS:
        forms[" native"] = lambda p, g, s: row.step(impl, p, g, s, cfg, native=True)
        if row.position_free is not None and row.position_free(cfg):
            forms[" native joined"] = lambda p, g, s: row.step_joined(impl, p, g, s, cfg, native=True)
    return forms


def _time_block(step: Callable[[], object], block: int) -> float:
    t0 = time.thread_time()
    for _ in range(block):
        step()
    return (time.thread_time() - t0) / block


def bench_optimizers(target: int, reps: int, block: int) -> dict:
    """Part 3: the spec's step against torch's, per optimizer, options and implementation."""
    shapes = transformer_shapes(target)
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = make_grads(shapes)
    out: dict = {}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, row in optim.SPECS.items():
            cls = getattr(torch.optim, name)
            for options in VARIANTS.get(name, [{}]):
                cfg = row.make_config(**options)
                for impl in row.steps:
                    state = tuple(row.init_state(p, cfg) for p in params)
                    _, _, state = row.step(impl, params, grads, state, cfg)  # moments one step old
                    tp = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
                    opt = cls(tp, **options, **_FLAGS[impl])
                    for p, g in zip(tp, grads):
                        p.grad = torch.from_numpy(g)
                    opt.step()
                    for how, spec in _spec_forms(row, impl, cfg).items():
                        steps = {"spec": lambda state=state, spec=spec: spec(params, grads, state),
                                 "torch": opt.step}
                        for step in steps.values():  # warm-up: the first steps also grow the heap
                            _time_block(step, block)
                        times: dict[str, list[float]] = {"spec": [], "torch": []}
                        for r in range(reps):
                            for who in _harness.rotate(["spec", "torch"], r):
                                times[who].append(_time_block(steps[who], block))
                        out[_label(name, options, impl) + how] = {
                            "spec_ms": 1e3 * _harness.median(times["spec"]),
                            "torch_ms": 1e3 * _harness.median(times["torch"]),
                            "ratio_spec_vs_torch": _harness.paired_ratio(times, "spec", "torch")}
    finally:
        torch.set_num_threads(before)
    return out


def print_optimizers(res: dict, elements: int, tensors: int, reps: int, block: int) -> None:
    print(f"optimizer steps on {elements / 1e6:.2f}M float32 elements in {tensors} tensors, CPU time of "
          f"the calling thread, torch at 1 thread; spec / torch as median [min-max] of {reps} rounds "
          f"of {block} steps (goal <= 3):", flush=True)
    width = max(len(k) for k in res)
    for label, v in res.items():
        r = v["ratio_spec_vs_torch"]
        mark = "  over 3x" if r["median"] > 3 else ""
        print(f"  {label:<{width}}  spec {v['spec_ms']:6.2f} ms  torch {v['torch_ms']:6.2f} ms  "
              f"{r['median']:5.2f}x [{r['min']:.2f}-{r['max']:.2f}]{mark}", flush=True)
    over = [k for k, v in res.items() if v["ratio_spec_vs_torch"]["median"] > 3]
    print(f"  over 3x: {', '.join(over) if over else 'none'}", flush=True)


_TEST = re.compile(r"^(\S+::\S+):\s*$")
_PHASE = re.compile(r"during generate phase \(([\d.]+) seconds\)")
_PASSING = re.compile(r"(\d+) passing")


def conformance_throughput(profile: str, timeout: int) -> dict:
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), AMPSPEC_HYPOTHESIS_PROFILE=profile)
    cmd = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider",
           "--device", "cpu", "--hypothesis-show-statistics"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    per_test: dict[str, dict] = {}
    current = None
    for line in proc.stdout.splitlines():
        m = _TEST.match(line.strip())
        if m:
            current = m.group(1)
            continue
        if current is None:
            continue
        m = _PHASE.search(line)
        if m:
            per_test.setdefault(current, {"seconds": 0.0, "passing": 0})["seconds"] += float(m.group(1))
        m = _PASSING.search(line)
        if m and current in per_test:
            per_test[current]["passing"] += int(m.group(1))
    # One row per property (test function), summing its parametrisations.
    props: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "passing": 0, "cases": 0})
    for test_id, v in per_test.items():
        prop = test_id.split("[")[0]
        props[prop]["seconds"] += v["seconds"]
        props[prop]["passing"] += v["passing"]
        props[prop]["cases"] += 1
    for v in props.values():
        v["examples_per_s"] = v["passing"] / v["seconds"] if v["seconds"] > 0 else None
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    return {"command": " ".join(cmd[1:]), "profile": profile, "exit_code": proc.returncode,
            "wall_s": wall, "pytest_summary": summary, "properties": dict(props)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--large", action="store_true", help="also 100M elements (needs ~3 GB free)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", default="ci", help="Hypothesis profile for the conformance part")
    ap.add_argument("--skip-conformance", action="store_true")
    ap.add_argument("--optimizers-only", action="store_true", help="only part 3, the optimizer steps")
    ap.add_argument("--block", type=int, default=3, help="part 3: consecutive steps timed together per round")
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = ap.parse_args(argv)

    threads_all = torch.get_num_threads()
    sizes = [1_000_000, 10_000_000]
    if args.large:
        sizes.append(100_000_000)
    results: dict = {"machine": _harness.machine(), "settings": vars(args), "sizes": {}}
    opt_res = bench_optimizers(1_000_000, args.reps, args.block)
    results["optimizers_1M"] = opt_res
    shapes = transformer_shapes(1_000_000)
    print_optimizers(opt_res, sum(int(np.prod(s)) for s in shapes), len(shapes), args.reps, args.block)
    if args.optimizers_only:
        path = _harness.write_result("reference_speed_optimizers", results, args.out)
        print(f"-> {path}")
        return 0
    for size in sizes:
        reps = args.reps if size <= 10_000_000 else max(3, args.reps // 2)
        res = bench_size(size, reps, threads_all)
        results["sizes"][str(size)] = res
        c = res["candidates"]
        parts = [f"{name} {v['ratio_vs_torch_1_thread']['median']:.2f}x" for name, v in c.items()
                 if name != "torch 1 thread"]
        print(f"{res['elements'] / 1e6:.1f}M elements in {res['tensors']} tensors: torch 1 thread "
              f"{c['torch 1 thread']['ns_per_element']:.2f} ns/elem; vs it: " + ", ".join(parts), flush=True)
    if not args.skip_conformance:
        conf = conformance_throughput(args.profile, timeout=300)
        results["conformance"] = conf
        print(f"conformance ({conf['pytest_summary']}, {conf['wall_s']:.1f} s):", flush=True)
        for prop, v in conf["properties"].items():
            eps = v["examples_per_s"]
            print(f"  {prop}: {v['passing']} examples in {v['seconds']:.2f} s over {v['cases']} cases"
                  + (f" = {eps:.0f} examples/s" if eps else ""), flush=True)
    path = _harness.write_result("reference_speed", results, args.out)
    ratios = [s["candidates"]["reference"]["ratio_vs_torch_1_thread"]["median"] for s in results["sizes"].values()]
    print("reference_speed: reference/torch(1 thread) " + ", ".join(
        f"{k}: {r:.2f}x" for k, r in zip(results["sizes"], ratios)) + f" -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
