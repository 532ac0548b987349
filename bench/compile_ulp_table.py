"""The measured table of docs/compile.md: each registry optimizer's compiled step against the spec.

For every optimizer of ``reference.optim.SPECS`` and its for-loop and foreach paths, a compiled
``optimizer.step`` (``torch.compile``, TorchInductor on the CPU) takes ``--steps`` steps of
float32 parameters (two tensors, 401 elements) from a fixed seed; before each step the spec
(``sqrt=None``, reference.compile rule 2) is given torch's state and after it every array field
is compared in ULPs of ``x_abs`` (the row's ``magnitudes``). Printed per optimizer and path: the
graphs captured, the share of elements not bit-equal, the largest distance, and the bound
`reference.compile.compiled_step_ulp` gave at the step of that largest distance (``-`` where the
rule says bitwise). Prints a Markdown table.

    PYTHONPATH=. python bench/compile_ulp_table.py --steps 8
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _harness  # noqa: F401  (puts the repository root on sys.path)
import numpy as np
import torch

from conformance import strategies
from conformance.bridge import to_numpy, to_torch
from reference import compile as rc
from reference import optim


def _state(opt, p) -> dict:
    return {k: to_numpy(v) if isinstance(v, torch.Tensor) else v for k, v in opt.state.get(p, {}).items()}


def measure(name: str, impl: str, steps: int) -> dict:
    """One row: per field the largest ULP distance, the differing share and the tightest bound."""
    from torch._dynamo.utils import counters

    row, case = optim.spec(name), strategies.OPTIMIZER_CASES[name]
    rule = rc.compiled_step_rule(name, torch.__version__)
    rng = np.random.default_rng(1)
    shapes = [(257,), (16, 9)] if case.min_ndim < 2 else [(33, 9), (16, 9)]
    params = [torch.nn.Parameter(torch.from_numpy(rng.standard_normal(s).astype(np.float32))) for s in shapes]
    extra = {"momentum": 0.9} if name == "SGD" else {}
    opt = case.torch_class(params, lr=1e-2, foreach=impl == "foreach", **extra)
    cfg = row.make_config(lr=1e-2, **extra)
    torch._dynamo.reset()
    counters.clear()
    opt.step = torch.compile(opt.step)
    out: dict = {}
    for _ in range(steps):
        grads = [rng.standard_normal(s).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 2)) for s in shapes]
        before = [to_numpy(p) for p in params]
        state = tuple(row.state_from(_state(opt, p), b, cfg) for p, b in zip(params, before))
        for p, g in zip(params, grads):
            p.grad = to_torch(g)
        sqrt = (lambda a: to_numpy(torch.sqrt(to_torch(a)))) if rule.eager else None
        spec_p, _, spec_s = row.step(impl, before, grads, state, cfg, sqrt=sqrt)
        opt.step()
        for i, p in enumerate(params):
            x_abs = row.magnitudes(cfg, before[i], grads[i], state[i], spec_s[i])
            fields = [("param", to_numpy(p), spec_p[i])] + [
                (f.name, _state(opt, p)[f.name], getattr(spec_s[i], f.name)) for f in dataclasses.fields(spec_s[i])
                if isinstance(getattr(spec_s[i], f.name), np.ndarray)]
            for fname, got, exp in fields:
                got, exp = np.asarray(got, np.float64), np.asarray(exp, np.float64)
                unit = np.maximum(np.spacing(np.abs(x_abs[fname]).astype(np.float32)).astype(np.float64), 2.0**-149)
                dist = float(np.max(np.abs(got - exp) / unit)) if got.size else 0.0
                bound = rc.compiled_step_ulp(name, fname, row.native_ulp[fname], cfg, float(spec_s[i].step)
                                             if hasattr(spec_s[i], "step") else 1.0,
                                             float(getattr(state[i], "mu_product", 1.0) or 1.0))
                worst, differ, size, at_worst = out.get(fname, (-1.0, 0, 0, float("inf")))
                if dist > worst:
                    worst, at_worst = dist, bound
                out[fname] = (worst, differ + int(np.sum(got != exp)), size + got.size, at_worst)
    out["graphs"] = int(counters["stats"]["unique_graphs"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.steps} steps")
    print("| optimizer | path | rule | graphs | field: differing share, max ULP of x_abs (the bound at that step) |")
    print("|---|---|---|---|---|")
    for name in optim.SPECS:
        rule = rc.compiled_step_rule(name, torch.__version__)
        for impl in ("for-loop", "foreach"):
            res = measure(name, impl, args.steps)
            graphs = res.pop("graphs")
            cells = []
            for fname, (worst, differ, size, tight) in res.items():
                bound = "-" if impl in rule.bitwise else ("inf" if tight == float("inf") else f"{tight:.0f}")
                cells.append(f"{fname}: {differ}/{size}, {worst:.3g} ({bound})")
            kind = "bitwise" if impl in rule.bitwise else ("eager" if rule.eager else "bounded")
            print(f"| {name} | {impl} | {kind} | {graphs} | {'; '.join(cells)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
