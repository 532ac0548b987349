"""torch's fused SGD and fused Adagrad on bfloat16/float16 parameters against `reference.lowprec`.

For each kernel level (the scalar kernels, ``ATEN_CPU_CAPABILITY=default``, and the machine's
own), in a fresh process: sizes 0-d, 0, 1, 7, 8, 15, 16, 31, 32, 33, 64, 100, 1000 stepped
together by torch's fused optimizer, three SGD configurations (momentum 0: plain, weight decay,
maximize) and four Adagrad ones (plain, weight decay with eps, lr decay with maximize, an initial
accumulator), bfloat16 and float16, three seeds, four steps. Each step starts from torch's
weights; every stored field is compared bit for bit. Two models are counted: rule 15 (the
kernels' own loop) and rule 8's float32 fused step rounded once (the model of fused Adam), with
the parameter steps and the elements that differ.

    PYTHONPATH=. python bench/lowprec_fused.py        # about a minute on 2 cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(), (0,), (1,), (7,), (8,), (15,), (16,), (31,), (32,), (33,), (64,), (100,), (1000,)]
CONFIGS = {"SGD": [dict(lr=0.1), dict(lr=0.37, weight_decay=0.3), dict(lr=0.01, maximize=True, weight_decay=0.01)],
           "Adagrad": [dict(), dict(lr=0.37, weight_decay=0.3, eps=1e-3),
                       dict(lr=0.1, lr_decay=0.01, maximize=True, weight_decay=0.01),
                       dict(lr=0.05, initial_accumulator_value=0.1)]}


def _differ(got, want) -> int:
    import numpy as np

    return int((np.asarray(got).view(np.uint16) != np.asarray(want).view(np.uint16)).sum())


def sweep(model: str) -> dict:
    """This process's kernels: ``model`` is ``rule15`` or ``rule8``; counts of what differs."""
    import numpy as np
    import torch

    from conformance.bridge import to_numpy, to_torch
    from reference import lowprec, optim
    from reference import master_weights as mw

    kernels = torch.backends.cpu.get_cpu_capability()
    steps = differing = elements = 0
    for name, configs in CONFIGS.items():
        row = optim.spec(name)
        for storage in ("bfloat16", "float16"):
            for kwargs in configs:
                cfg = row.make_config(**kwargs)
                for seed in range(3):
                    rng = np.random.default_rng(seed)
                    ws = [rng.standard_normal(s).astype(np.float32).astype(storage) for s in SHAPES]
                    params = [torch.nn.Parameter(to_torch(w)) for w in ws]
                    opt = getattr(torch.optim, name)(params, fused=True, **kwargs)
                    states = [mw.init_master_state("none", w, row, cfg, storage).opt for w in ws]
                    for _ in range(4):
                        grads = [rng.standard_normal(s).astype(np.float32).astype(storage) for s in SHAPES]
                        for p, g in zip(params, grads):
                            p.grad = to_torch(g)
                        opt.step()
                        if model == "rule15":
                            new_w, states = lowprec.step(row, "fused", ws, grads, states, cfg, kernels=kernels)
                        else:
                            new_w, states = lowprec._fused(row, ws, grads, states, cfg, float(cfg.lr))
                        for i, p in enumerate(params):
                            n = _differ(to_numpy(p.detach()), new_w[i])
                            if name == "Adagrad":
                                n += _differ(to_numpy(opt.state[p]["sum"]), states[i].sum)
                            steps, differing, elements = steps + 1, differing + (n > 0), elements + n
                        ws = [to_numpy(p.detach()) for p in params]
    return dict(kernels=kernels, model=model, parameter_steps=steps, differing=differing, elements=elements)


def main() -> None:
    if len(sys.argv) == 2:
        print(json.dumps(sweep(sys.argv[1])))
        return
    for capability in ("default", None):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        for model in ("rule15", "rule8"):
            out = subprocess.run([sys.executable, __file__, model], env=env, capture_output=True, text=True,
                                 check=True, cwd=ROOT)
            print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
