"""Hypothesis strategies of the master-weight properties (conformance/test_master_weights.py).

A case is one registered optimizer's configuration (``strategies.OPTIMIZER_CASES``) and a
trajectory of parameters and gradients drawn as ``strategies.optimizer_trajectory`` draws them
(0-d and empty parameters among them, gradients sometimes None, sometimes holding inf/NaN: a
step the loss scaler's check skips), rounded into the storage format S, which is bfloat16 or
float16 (bfloat16 only for ``stochastic``). Learning rates reach up to 1, so weights move by
many ULPs of S on some steps and by far less than one on others (lost updates, and the
compensation buffer's work).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from conformance import strategies

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)


def storage_formats(option: str) -> tuple[np.dtype, ...]:
    """The formats an option stores parameters in (stochastic rounding targets bfloat16 only)."""
    return (BF16,) if option == "stochastic" else (BF16, F16)


@st.composite
def master_case(draw, name: str, option: str) -> dict:
    """``config`` (torch's keyword arguments), ``storage`` (S), ``params`` and ``grads`` in S
    (a step's list holds None for a parameter without a gradient), ``seed`` of the generator
    that draws the stochastic bits, ``boundary``: None (the generator's bits) or the offset of
    explicit bits from the low 16 bits of the float32 result (stochastic only)."""
    case = strategies.OPTIMIZER_CASES[name]
    storage = draw(st.sampled_from(storage_formats(option)), label="storage")
    trajectory = draw(strategies.optimizer_trajectory(plant_nonfinite=True, zero_d=True, min_ndim=case.min_ndim,
                                                      steps=case.steps), label="trajectory")
    with np.errstate(over="ignore", invalid="ignore"):
        params = [np.asarray(p).astype(storage) for p in trajectory["params"]]
        grads = [[None if g is None else np.asarray(g).astype(storage) for g in step] for step in trajectory["grads"]]
    # Stochastic rounding's boundary: bits equal to the low half of the float32 result, one below or
    # one above (explicit bits; elsewhere the generator's, where equality has probability 2^-16).
    boundary = draw(st.sampled_from([0, None, -1, 1]), label="boundary bits") if option == "stochastic" else None
    return dict(config=draw(case.config(), label="config"), storage=storage, params=params, grads=grads,
                seed=draw(st.integers(0, 2**31 - 1), label="seed"), boundary=boundary)


LERP_VALUES = (0.0, -0.0, 1.0, -1.0, 2.0**-120, -3.0, float("inf"))


@st.composite
def lerp_at_one_case(draw) -> dict:
    """``x.lerp(y, 1.0)`` operands: a dtype (float32, float64, bfloat16, float16), a shape (0-d,
    empty, or up to 70 elements: around the 64-byte blocks of the vectorized kernel, in one or two
    dimensions) and values with zeros of both signs, so that ``y = -0.0`` meets ``y - x`` of
    either sign in the vectorized head and in the scalar tail."""
    dtype = draw(st.sampled_from([np.dtype(np.float32), np.dtype(np.float64), BF16, F16]), label="dtype")
    n = draw(st.integers(0, 70), label="n")
    shape = draw(st.sampled_from([(), (n,), (1, n)] if n == 1 else [(n,), (1, n)]), label="shape")
    size = int(np.prod(shape))
    x = draw(st.lists(st.sampled_from(LERP_VALUES), min_size=size, max_size=size), label="x")
    y = draw(st.lists(st.sampled_from(LERP_VALUES[:2]) | st.sampled_from(LERP_VALUES), min_size=size,
                      max_size=size), label="y")
    return dict(x=np.array(x, np.float64).reshape(shape).astype(dtype),
                y=np.array(y, np.float64).reshape(shape).astype(dtype))
