"""torch's optimizers stepping parameters stored in bfloat16 or float16 (the ``none`` option of
``reference.master_weights``), operation by operation as torch's CPU kernels round them.

Rules (S is the storage format; each torch operation computes in float32 and rounds its result
once to S, except where a rule says otherwise):

1. Coverage: the optimizers and implementations in ``COVERED``. Any other pair raises
   ``NotImplementedError`` naming it: the specification does not claim torch's bits there.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from reference.optim._registry import OptimizerSpec

__all__ = ["COVERED", "step"]

COVERED: dict[str, tuple[str, ...]] = {}


def step(row: OptimizerSpec, implementation: str, weights: Sequence[np.ndarray], grads: Sequence[np.ndarray | None],
         opts: Sequence[Any], config: Any, *, lr: Any = None) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple]:
    """One step of ``row``'s ``implementation`` on S tensors: (weights, exact updates, states)."""
    if implementation not in COVERED.get(row.name, ()):
        raise NotImplementedError(
            f"the specification does not model torch's {row.name} ({implementation}) on low-precision parameters; "
            f"covered: {_covered()}")
    return COVERED_STEPS[row.name](implementation, weights, grads, opts, config, lr=lr)


COVERED_STEPS: dict[str, Any] = {}


def _covered() -> str:
    return "; ".join(name + " (" + ", ".join(impls) + ")" for name, impls in COVERED.items()) or "none"
