"""Master weights: how a parameter held in bfloat16 or float16 takes an optimizer's step.

The model's parameters are stored in a low-precision format S (``bfloat16`` or ``float16``);
``g`` is a parameter's gradient in S; ``f32(x)`` converts to float32 (exact), ``S(x)`` rounds a
float32 value into S (RNE, rule 2 of ``reference.formats``). ``step`` is the registry row's step
function for the implementation at hand (``reference.optim``), run on float32 arrays: it is
torch's step on float32 tensors, bit for bit.

Rules:

1. The options are ``none``, ``fp32``, ``kahan`` and ``stochastic``. A parameter's state
   (``MasterState``) holds its stored weight (S), the float32 master (``fp32`` only), the
   compensation buffer (S, ``kahan`` only) and the optimizer's state.
2. Where the optimizer's state lives. ``fp32``: float32, as torch keeps it for a float32
   master; the state torch creates when the optimizer is built (over the S parameters: Adagrad's
   ``sum``) is S's, upcast exactly, so its initial value is the S rounding of the float32 one. ``none``, ``kahan``, ``stochastic``: as torch keeps it for a parameter of dtype S:
   every state array in S, the scalar counters (``step``, NAdam's ``mu_product``) float32.
   ``kahan`` and ``stochastic`` compute in float32 and store the state back in S (RNE) after
   each step (torchao's low-precision optimizers do the same).
3. ``none``: torch's optimizer steps the S tensors themselves, every operation rounded to S
   (``reference.lowprec`` models the optimizers and implementations it covers).
4. ``fp32``: the master ``m`` starts as ``f32(p)``; each step ``m' = step(m, f32(g), state)``
   and the stored weight becomes ``S(m')``. The exact update is ``m' - m`` (float32).
5. The float32 evaluation (``kahan``, ``stochastic``, and the exact update of ``none``):
   ``q = step(f32(p), f32(g), f32(state))``, the exact update ``u = q - f32(p)`` (float32).
6. ``kahan``: with compensation ``c`` (S, zero at the start), four float32 operations, each
   rounded once as written: ``y = f32(c) + u``; ``t = S(f32(p) + y)``;
   ``c' = S(y - (f32(t) - f32(p)))``; ``p' = t``. ``c'`` holds what the rounding of ``t`` lost
   (rounded to S), added back on the next step.
7. ``stochastic`` (S = bfloat16 only): ``p' = SR(q, bits)`` with ``bits`` one integer in
   [0, 2^16) per element, an explicit input: with ``b`` the float32 bit pattern of ``q``, the
   result is ``b`` with its low 16 bits cleared, plus ``0x10000`` (away from zero by one bf16
   ULP) when ``bits < (b & 0xFFFF)``; uint32 arithmetic, so the pattern wraps (torchao 0.18,
   ``torchao/optim/quant_utils.py`` ``_fp32_to_bf16_sr``, which draws the bits with
   ``torch.randint(0, 1 << 16, shape, dtype=torch.int32)``). A NaN result becomes torch's
   canonical bfloat16 NaN 0x7FC0. Each value rounds away with probability (b & 0xFFFF) / 2^16:
   unbiased.
8. A parameter without a gradient keeps its weight, master, compensation and state (rule 7 of
   ``reference.optim``). A skipped step (found_inf) calls nothing: every state is unchanged and
   no bits are drawn.
9. A lost update is ``reference.health`` rule 12 applied to ``(p, p', exact)``.
10. Memory (``bytes_held``): the bytes of every array a parameter's state holds (weight,
   master, compensation, each optimizer state array, each float32 scalar counter as the 4 bytes
   torch's 0-d tensor holds), after a first step, so that state created lazily (SGD's momentum
   buffer, Adafactor's factors) counts; gradients are not counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference.formats import cast, get_format
from reference.optim import OptimizerSpec

__all__ = [
    "OPTIONS",
    "STORAGE_FORMATS",
    "MasterState",
    "bytes_held",
    "bytes_per_parameter",
    "float32_step",
    "init_master_state",
    "kahan_add",
    "master_step",
    "state_in",
    "stochastic_round_bf16",
]

OPTIONS = ("none", "fp32", "kahan", "stochastic")
STORAGE_FORMATS = ("bfloat16", "float16")

_F32 = np.dtype(np.float32)


@dataclass(frozen=True)
class MasterState:
    """One parameter under an option (rule 1): ``weight`` in S, ``master`` (float32, ``fp32``
    only), ``compensation`` (S, ``kahan`` only), ``opt`` the registry row's state."""

    weight: np.ndarray
    master: np.ndarray | None
    compensation: np.ndarray | None
    opt: Any


def _check_option(option: str, storage: str) -> str:
    if option not in OPTIONS:
        raise ValueError(f"master_weights must be one of {', '.join(OPTIONS)}, got {option!r}")
    name = get_format(storage).name
    if name not in STORAGE_FORMATS:
        raise ValueError(f"parameters are stored in {' or '.join(STORAGE_FORMATS)}, got {name}")
    if option == "stochastic" and name != "bfloat16":
        raise ValueError(f"stochastic rounding is defined for bfloat16 storage only, got {name}: "
                         "use master_weights 'fp32' or 'kahan'")
    return name


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def _frozen(x: np.ndarray) -> np.ndarray:
    out = np.array(x, copy=True)
    out.setflags(write=False)
    return out


def state_in(opt: Any, storage: str | None) -> Any:
    """Rule 2: the optimizer state with every array field in ``storage`` (RNE), or in float32
    when ``storage`` is None; scalar fields (float32 counters) unchanged."""
    if opt is None:
        return None
    changes = {}
    for f in dataclasses.fields(opt):
        value = getattr(opt, f.name)
        if isinstance(value, np.ndarray):
            changes[f.name] = _frozen(_f32(value) if storage is None else cast(value, storage))
    return dataclasses.replace(opt, **changes)


def init_master_state(option: str, weight: np.ndarray, row: OptimizerSpec, config: Any,
                      storage: str = "bfloat16") -> MasterState:
    """Rules 1-2: a parameter's state before its first step; ``weight`` is in ``storage``."""
    name = _check_option(option, storage)
    w = np.asarray(weight)
    if w.dtype != get_format(name).dtype:
        raise ValueError(f"weight must be stored in {name}, got {w.dtype}")
    w32 = _f32(w)
    if option == "fp32":
        return MasterState(_frozen(w), _frozen(w32), None, state_in(state_in(row.init_state(w32, config), name), None))
    comp = _frozen(np.zeros_like(w)) if option == "kahan" else None
    return MasterState(_frozen(w), None, comp, state_in(row.init_state(w32, config), name))


def stochastic_round_bf16(x: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """Rule 7: float32 ``x`` to bfloat16, rounding away from zero when ``bits < low 16 bits``."""
    x32 = np.array(x, dtype=np.float32, order="C")  # ascontiguousarray would make a 0-d array 1-d
    b = np.asarray(bits)
    if b.shape != x32.shape or b.dtype.kind not in "iu":
        raise ValueError(f"bits must be integers of the parameter's shape {list(x32.shape)}, "
                         f"got {b.dtype}{list(b.shape)}")
    if b.size and (b.min() < 0 or b.max() >= 1 << 16):
        raise ValueError("bits must lie in [0, 2**16): one random 16-bit integer per element")
    pattern = x32.view(np.uint32)
    truncated = pattern & np.uint32(0xFFFF0000)
    away = b.astype(np.uint32) < (pattern & np.uint32(0xFFFF))
    with np.errstate(over="ignore"):
        rounded = np.asarray(np.where(away, truncated + np.uint32(0x10000), truncated), dtype=np.uint32)
    out = np.asarray(rounded >> np.uint32(16), dtype=np.uint16)
    out[np.isnan(rounded.view(np.float32))] = 0x7FC0
    return out.view(get_format("bfloat16").dtype)


def kahan_add(weight: np.ndarray, compensation: np.ndarray, update: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rule 6: the compensated addition of the float32 ``update`` to ``weight`` (S) with its
    compensation buffer (S); returns the new weight and compensation."""
    storage = np.asarray(weight).dtype
    p32, u = _f32(weight), np.asarray(update, dtype=np.float32)
    with np.errstate(all="ignore"):
        y = _f32(compensation) + u
        t = (p32 + y).astype(storage)
        c = (y - (_f32(t) - p32)).astype(storage)
    return t, c


def float32_step(row: OptimizerSpec, implementation: str, weights: Sequence[np.ndarray],
                 grads: Sequence[np.ndarray | None], opts: Sequence[Any], config: Any, *, lr: Any = None,
                 sqrt: Callable[[np.ndarray], np.ndarray] | None = None
                 ) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple[Any, ...]]:
    """Rule 5: the step in float32 from the stored weights, gradients and state; returns the
    float32 results ``q``, the exact updates ``u = q - f32(p)`` (None without a gradient) and
    the float32 state."""
    p32 = [_f32(w) for w in weights]
    g32 = [None if g is None else _f32(g) for g in grads]
    q, _, new = row.step(implementation, p32, g32, tuple(state_in(s, None) for s in opts), config, lr=lr, sqrt=sqrt)
    with np.errstate(all="ignore"):
        exact = [None if g is None else np.subtract(a, b, dtype=np.float32) for a, b, g in zip(q, p32, g32)]
    return q, exact, new


def master_step(option: str, row: OptimizerSpec, implementation: str, states: Sequence[MasterState],
                grads: Sequence[np.ndarray | None], config: Any, *, bits: Sequence[np.ndarray | None] | None = None,
                lr: Any = None, sqrt: Callable[[np.ndarray], np.ndarray] | None = None
                ) -> tuple[tuple[MasterState, ...], list[np.ndarray | None]]:
    """One applied step of ``option`` over every parameter (rules 3-8): the new states and the
    exact update of each parameter (None without a gradient), for rule 9."""
    if len(states) != len(grads):
        raise ValueError(f"states and grads must have the same length, got {len(states)} and {len(grads)}")
    if not states:
        return (), []
    storage = _check_option(option, np.asarray(states[0].weight).dtype.name)
    for i, (s, g) in enumerate(zip(states, grads)):
        if g is not None and (np.asarray(g).dtype != s.weight.dtype or np.shape(g) != s.weight.shape):
            raise ValueError(f"grads[{i}] must be {s.weight.dtype}{list(s.weight.shape)} like its weight, "
                             f"got {np.asarray(g).dtype}{list(np.shape(g))}")
    if option == "none":
        from reference import lowprec  # why: only `none` needs torch's low-precision kernels

        weights, opts = lowprec.step(row, implementation, [s.weight for s in states], grads,
                                     [s.opt for s in states], config, lr=lr)
        _, exact, _ = float32_step(row, implementation, [s.weight for s in states], grads, [s.opt for s in states],
                                   config, lr=lr, sqrt=sqrt)
        return tuple(MasterState(_frozen(w), None, None, o) for w, o in zip(weights, opts)), exact
    if option == "fp32":
        masters = [s.master for s in states]
        new, _, opts = row.step(implementation, masters, [None if g is None else _f32(g) for g in grads],
                                tuple(s.opt for s in states), config, lr=lr, sqrt=sqrt)
        with np.errstate(all="ignore"):
            exact = [None if g is None else np.subtract(a, b, dtype=np.float32) for a, b, g in zip(new, masters, grads)]
        out = tuple(MasterState(_frozen(cast(m, storage)) if g is not None else s.weight, _frozen(m), None, o)
                    for s, m, o, g in zip(states, new, opts, grads))
        return out, exact
    q, exact, opts = float32_step(row, implementation, [s.weight for s in states], grads,
                                  [s.opt for s in states], config, lr=lr, sqrt=sqrt)
    if option == "stochastic":
        if bits is None or len(bits) != len(states):
            raise ValueError("stochastic rounding takes its random bits as an input: one array of integers in "
                             "[0, 2**16) per parameter with a gradient (None for the others)")
    out = []
    for i, (s, g, qi, ui, o) in enumerate(zip(states, grads, q, exact, opts)):
        if g is None:
            out.append(s)
            continue
        stored = state_in(o, storage)
        if option == "kahan":
            w, c = kahan_add(s.weight, s.compensation, ui)
            out.append(MasterState(_frozen(w), None, _frozen(c), stored))
        else:
            if bits[i] is None:
                raise ValueError(f"bits[{i}] is None but params[{i}] has a gradient")
            out.append(MasterState(_frozen(stochastic_round_bf16(qi, bits[i])), None, None, stored))
    return tuple(out), exact


def _nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, np.floating):
        return 4  # torch keeps every scalar counter as a 0-d float32 tensor
    return 0


def bytes_held(option: str, row: OptimizerSpec, config: Any, shape: tuple[int, ...],
               storage: str = "bfloat16", implementation: str = "for-loop") -> int:
    """Rule 10: the bytes one parameter of ``shape`` holds under ``option`` after a first step
    (weight, master, compensation, optimizer state), gradients excluded."""
    name = _check_option(option, storage)
    weight = np.zeros(shape, get_format(name).dtype)
    probe = init_master_state("kahan" if option == "none" else option, weight, row, config, name)
    grad = np.zeros(shape, weight.dtype)
    bits = [np.zeros(shape, np.int32)]
    # `none` holds what kahan holds less the compensation: the state layout of rule 2.
    (after,), _ = master_step("kahan" if option == "none" else option, row, implementation, [probe], [grad],
                              config, bits=bits)
    total = after.weight.nbytes
    total += 0 if after.master is None else after.master.nbytes
    total += after.compensation.nbytes if (after.compensation is not None and option == "kahan") else 0
    total += sum(_nbytes(getattr(after.opt, f.name)) for f in dataclasses.fields(after.opt))
    return total


def bytes_per_parameter(option: str, row: OptimizerSpec, config: Any, shape: tuple[int, ...] = (64, 64),
                        storage: str = "bfloat16", implementation: str = "for-loop") -> float:
    """Rule 10 per element: ``bytes_held / numel`` (a factored state such as Adafactor's
    depends on the shape, hence ``shape``)."""
    numel = int(np.prod(shape, dtype=np.int64))
    if numel == 0:
        raise ValueError("bytes per parameter needs a parameter with at least one element")
    return bytes_held(option, row, config, shape, storage, implementation) / numel
