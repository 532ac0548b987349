"""torch's optimizers on bfloat16/float16 parameters against `reference.lowprec` on each CPU capability.

For each kernel level (``ATEN_CPU_CAPABILITY=default``, ``avx2`` and the machine's own), in a
fresh process: every covered pair (``lowprec.COVERED``: for-loop, foreach and fused paths; fused
SGD with momentum is refused and left out), two to four configurations each, sizes 0-d, 0, 1,
7, 8, 15, 16, 31, 32, 33, 64, 100, 1000 stepped together, bfloat16 and float16, three seeds, six
steps. Each step starts from torch's weights and state; every stored field is compared (NaN as
a class). Printed per pair: the parameter steps, how many differ bit for bit, and the largest
distance in ULPs of S at the spec row's magnitudes (fused Adam/AdamW on native kernels: rule
13's bound; inf where a pair stated bit for bit differs); a digest of torch's own bits, equal
across capabilities that run the same kernels.
Adafactor steps 0-d, vector, matrix and 3-d parameters (``SHAPES_OF``).
``--block BYTES`` steps the native paths with another block (a wrong model, to see it fail);
``--optimizer NAME`` sweeps one optimizer.

    PYTHONPATH=. python bench/lowprec_native.py        # about a minute on 2 cores
    PYTHONPATH=. python bench/lowprec_native.py --optimizer Adafactor
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(), (0,), (1,), (7,), (8,), (15,), (16,), (31,), (32,), (33,), (64,), (100,), (1000,)]
# Adafactor factors matrices over their last two dimensions, and refuses an empty parameter (torch
# raises ZeroDivisionError): 0-d, vectors, matrices (rows or columns of 1 among them) and 3-d tensors.
SHAPES_OF = {"Adafactor": [(), (1,), (7,), (33,), (100,), (1000,), (1, 1), (5, 1), (1, 9), (3, 5), (17, 40),
                           (64, 33), (2, 3, 4), (4, 33, 7), (2, 16, 100)]}
CONFIGS = {
    "SGD": [dict(lr=0.1), dict(lr=0.37, weight_decay=0.3),
            dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
            dict(lr=0.1, momentum=0.9, dampening=0.3, maximize=True)],
    "Adam": [dict(lr=0.01), dict(lr=0.01, weight_decay=0.1, amsgrad=True)],
    "AdamW": [dict(lr=0.01, weight_decay=0.1)],
    "RMSprop": [dict(lr=0.01), dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1)],
    "Adagrad": [dict(), dict(lr=0.37, weight_decay=0.3, eps=1e-3), dict(lr=0.1, lr_decay=0.01, maximize=True)],
    "Adamax": [dict(), dict(weight_decay=0.1)],
    "Adadelta": [dict(), dict(weight_decay=0.1, lr=0.5)],
    "NAdam": [dict(), dict(weight_decay=0.1, decoupled_weight_decay=True)],
    "RAdam": [dict(), dict(weight_decay=0.1, decoupled_weight_decay=True)],
    "Adafactor": [dict(), dict(lr=0.05, weight_decay=0.1, maximize=True),
                  dict(lr=0.3, eps=(1e-3, 1e-3), beta2_decay=-0.5, d=1.5)],
}
FLAGS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def _ulps(got, want, x_abs) -> float:
    """The largest distance in ULPs of S at ``x_abs`` (0 where bit for bit; NaN as a class)."""
    import numpy as np

    g, w = np.asarray(got), np.asarray(want)
    if np.array_equal(g.view(np.uint16), w.view(np.uint16)) or g.size == 0:
        return 0.0
    a, e = g.astype(np.float64), w.astype(np.float64)
    if (np.isnan(a) != np.isnan(e)).any():
        return float("inf")
    if x_abs is None:
        return float("inf") if (np.isfinite(a) & (a != e)).any() else 0.0
    unit = np.maximum(np.spacing(np.abs(np.asarray(x_abs, np.float64)).astype(g.dtype)).astype(np.float64),
                      float(np.finfo(g.dtype).smallest_subnormal))
    with np.errstate(invalid="ignore"):
        dist = np.where(np.isnan(a), 0.0, np.where(a == e, 0.0, np.abs(a - e) / unit))
    return float(np.max(dist)) if dist.size else 0.0


def sweep(block: int | None, only: str | None = None) -> dict:
    """This process's kernels against the spec: per pair, [parameter steps, differing, largest ULPs], digest."""
    import numpy as np
    import torch

    from conformance.bridge import to_numpy, to_torch
    from reference import lowprec, optim
    from reference import master_weights as mw

    kernels = torch.backends.cpu.get_cpu_capability()
    if block is not None:
        lowprec.KERNELS[kernels] = block
    out = {}
    for name, configs in CONFIGS.items():
        if only is not None and name != only:
            continue
        row = optim.spec(name)
        shapes = SHAPES_OF.get(name, SHAPES)
        for impl in lowprec.COVERED[name]:
            counts, digest = [0, 0, 0.0], hashlib.sha256()
            bounded = lowprec.bound(name, impl, kernels) > 0
            for storage in ("bfloat16", "float16"):
                for kwargs in configs:
                    cfg = row.make_config(**kwargs)
                    if lowprec.refused(name, impl, cfg):
                        continue
                    for seed in range(3):
                        rng = np.random.default_rng(seed)
                        ws = [rng.standard_normal(s).astype(np.float32).astype(storage) for s in shapes]
                        params = [torch.nn.Parameter(to_torch(w)) for w in ws]
                        opt = getattr(torch.optim, name)(params, **FLAGS[impl], **kwargs)
                        states = [mw.init_master_state("none", w, row, cfg, storage).opt for w in ws]
                        for _ in range(6):
                            grads = [rng.standard_normal(s).astype(np.float32).astype(storage) for s in shapes]
                            for p, g in zip(params, grads):
                                p.grad = to_torch(g)
                            opt.step()
                            new_w, new_s = lowprec.step(row, impl, ws, grads, states, cfg, kernels=kernels)
                            for i, p in enumerate(params):
                                mags = {} if not bounded else row.magnitudes(cfg, ws[i], grads[i], states[i],
                                                                             new_s[i])
                                far = _ulps(to_numpy(p.detach()), new_w[i], mags.get("param"))
                                digest.update(to_numpy(p.detach()).tobytes())
                                for f in dataclasses.fields(new_s[i]):
                                    value, got = getattr(new_s[i], f.name), opt.state[p].get(f.name)
                                    if isinstance(value, np.ndarray) and isinstance(got, torch.Tensor):
                                        far = max(far, _ulps(to_numpy(got), value, mags.get(f.name)))
                                        digest.update(to_numpy(got).tobytes())
                                counts = [counts[0] + 1, counts[1] + (far > 0), max(counts[2], far)]
                            ws = [to_numpy(p.detach()) for p in params]
                            states = [_torch_state(s, opt.state[p]) for s, p in zip(new_s, params)]
            out[f"{name} ({impl})"] = counts + [digest.hexdigest()[:12]]
    return dict(kernels=kernels, block=lowprec.KERNELS[kernels], pairs=out)


def _torch_state(spec_state, torch_state: dict):
    """The spec's state with torch's values (bits kept): the next step starts where torch is."""
    import numpy as np

    from conformance.bridge import to_numpy

    out = {}
    for f in dataclasses.fields(spec_state):
        got = torch_state.get(f.name)
        if got is not None and hasattr(got, "dtype"):
            value = to_numpy(got)
            scalar = isinstance(getattr(spec_state, f.name), np.floating)
            out[f.name] = value.reshape(()).astype(np.float32)[()] if scalar else value
    return dataclasses.replace(spec_state, **out)


def main() -> None:
    args = sys.argv[1:]
    block = int(args[args.index("--block") + 1]) if "--block" in args else None
    only = args[args.index("--optimizer") + 1] if "--optimizer" in args else None
    if only is not None and only not in CONFIGS:
        sys.exit(f"--optimizer {only!r}: not one of {', '.join(CONFIGS)}")
    if "--child" in args:
        print(json.dumps(sweep(block, only)))
        return
    for capability in ("default", "avx2", None):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        extra = ["--block", str(block)] if block is not None and capability != "default" else []
        extra += ["--optimizer", only] if only is not None else []
        run = subprocess.run([sys.executable, __file__, "--child", *extra], env=env, capture_output=True, text=True,
                             check=True, cwd=ROOT)
        result = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"{result['kernels']} (block {result['block']} bytes): pair: parameter steps, differing, "
              "largest ULPs of S, digest of torch's bits")
        for pair, (steps, differ, far, digest) in result["pairs"].items():
            print(f"  {pair}: {steps}, {differ}, {far:g}, {digest}")


if __name__ == "__main__":
    main()
