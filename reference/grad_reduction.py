"""Gradient reductions across ranks: the wire dtype, where the division by the world size goes,
and the order in which gloo adds on the CPU.

A reduction of ``W`` ranks' gradients is a :class:`Reduction`; `reduce` computes it element by
element (every element is reduced on its own, so a reduce-scatter gives each rank its slice of
the all-reduce result). ``wire(x)`` rounds a float32 value to the wire dtype (nearest even,
subnormals kept: `reference.formats` rule 2); ``f32`` is float32 rounding. Rules:

1. Stages, in this order on every element: (a) each rank casts its gradient to the wire dtype
   (``buffer.to(lp)``; FSDP2's copy into its reduce-dtype buffer), exact when it already holds
   that dtype; (b) the pre-step on each rank, one rounding to the wire dtype:
   ``wire(f32(x) / p)`` for a pre-division (``div_`` on a bf16/fp16 tensor computes in float32
   and rounds once), or ``wire(f32(x) * f32(m))`` for a pre-multiplication; (c) the sum over the
   ranks in the wire dtype (rules 2, 3); (d) the post-division ``wire(f32(s) / q)``; (e) the cast
   of the result to float32, exact from bf16 and fp16.
2. gloo's sum on the CPU, 2 ranks: ``wire(f32(a) + f32(b))``, one rounding; the same bits on
   both ranks and in either order (addition is commutative). Measured on torch 2.13 for fp32,
   bf16 and fp16, all-reduce and reduce-scatter.
3. gloo's sum, ``W > 2`` ranks: gloo cuts the buffer into chunks and reduces each around a ring
   that starts at a different rank, so each element is a sequential sum of the ``W`` values in
   *some* rank order, rounded to the wire dtype after each of the ``W - 1`` additions; every
   rank receives the same bits. The spec pins no order: the admissible results are those of
   the ``W!`` orders (`sum_candidates`; measured at 3 and 4 ranks, 20000 elements per dtype:
   every element equals one of them, and no single order matches all). Envelope, from the
   number of roundings: each addition errs by at most half an ULP of its result, and every
   partial sum is at most ``B = sum|x_i| * (1 + u)^(W-2)`` (``u`` the unit roundoff), so
   ``|r - sum x_i| <= (W - 1) / 2`` ULPs of ``B`` in the wire dtype (`sum_envelope`).
4. ``ReduceOp.AVG`` on gloo is the sum of rules 2-3 followed by a post-division by ``W`` in the
   wire dtype (rule 1d): the sum is rounded, and can overflow, before it is divided. Measured:
   65504 on both of 2 ranks averages to inf in fp16 (65504 in float32 arithmetic).
5. ``ReduceOp.PREMUL_SUM(f)`` multiplies each rank's wire value by ``f`` before the sum (NCCL's
   definition, a pre-multiplication, rule 1b, by ``wire(f)``); gloo refuses it ("Cannot use
   ReduceOp.PREMUL_SUM with Gloo", measured), so it is stated here but checked nowhere on CPU.
6. DDP without a hook, float32 (`reference.distributed` rule 1): each rank multiplies by
   ``f32(1 / W)`` in float32, then the float32 sum.
7. DDP's ``fp16_compress_hook`` / ``bf16_compress_hook``: ``buffer.to(lp)``, ``div_(W)`` in lp
   (a pre-division), all-reduce SUM in lp, ``copy_`` into the float32 bucket:
   ``f32(lp(lp(lp(g0) / W) + lp(lp(g1) / W)))`` at 2 ranks.
8. FSDP2 (``_get_gradient_divide_factors``), reduce dtype ``rd`` (the parameter dtype when
   None), factor ``f`` (``set_gradient_divide_factor``, default ``W``): one rank: a plain copy
   (with a factor set, not modelled). fp32 and bf16: ``AVG`` (rule 4) when ``f == W``, else
   ``PREMUL_SUM(1 / f)`` (rule 5); with ``set_force_sum_reduction_for_comms(True)``: SUM, then a
   post-division by ``f`` — on gloo the same bits as ``AVG`` (rule 4). fp16 (any other dtype):
   SUM between a pre-division by ``p`` and a post-division by ``f / p``, ``p`` the smallest power
   of two with ``p * p >= f`` while ``p`` divides ``f`` (W=2: 2 and 1, no post-division; W=4: 2
   and 2; W=8: 4 and 2). The reduced shard is then cast to the parameter's original dtype.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = [
    "WIRE_DTYPES",
    "Reduction",
    "ddp_compress_hook",
    "ddp_default",
    "fsdp2_divide_factors",
    "fsdp2_reduction",
    "gloo_sum",
    "reduce",
    "reduce_candidates",
    "sum_candidates",
    "sum_envelope",
    "to_wire",
]

WIRE_DTYPES: dict[str, type] = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}
_UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
_MAX_ORDERED_RANKS = 6  # W! orders: 720 at six ranks


@dataclass(frozen=True)
class Reduction:
    """One gradient reduction (rule 1): wire dtype, pre-step, post-division, world size.

    ``pre`` is ``None``, ``("div", p)`` or ``("mul", m)``; ``post`` is ``None`` or the divisor
    ``q``. ``op`` names the collective torch issues (``"sum"``, ``"avg"``, ``"premul_sum"``),
    for messages and for `runs_on_gloo`; the arithmetic is in ``pre`` and ``post``.
    """

    wire: str
    world_size: int
    pre: tuple[str, float] | None = None
    post: float | None = None
    op: str = "sum"

    def __post_init__(self) -> None:
        if self.wire not in WIRE_DTYPES:
            raise ValueError(f"wire must be one of {sorted(WIRE_DTYPES)}, got {self.wire!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if self.pre is not None and (self.pre[0] not in ("div", "mul") or not self.pre[1] > 0):
            raise ValueError(f"pre must be None, ('div', p) or ('mul', m) with a positive factor, got {self.pre!r}")
        if self.post is not None and not self.post > 0:
            raise ValueError(f"post must be None or a positive divisor, got {self.post!r}")
        if self.op not in ("sum", "avg", "premul_sum"):
            raise ValueError(f"op must be 'sum', 'avg' or 'premul_sum', got {self.op!r}")

    @property
    def runs_on_gloo(self) -> bool:
        """Rule 5: gloo has no PREMUL_SUM."""
        return self.op != "premul_sum" or self.world_size == 1


def to_wire(x: np.ndarray, wire: str) -> np.ndarray:
    """Rule 1a: ``x`` rounded to the wire dtype (through float32, as torch casts)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x).astype(np.float32).astype(WIRE_DTYPES[wire])


def _pre(x: np.ndarray, red: Reduction) -> np.ndarray:
    """Rule 1b: the per-rank pre-division or pre-multiplication, one rounding to the wire dtype."""
    if red.pre is None:
        return x
    kind, factor = red.pre
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        if kind == "div":
            out = x.astype(np.float32) / np.float32(factor)
        else:
            out = x.astype(np.float32) * np.float32(to_wire(np.float32(factor), red.wire))
    return out.astype(WIRE_DTYPES[red.wire])


def _add(a: np.ndarray, b: np.ndarray, wire: str) -> np.ndarray:
    """Rule 2: one addition in float32, rounded to the wire dtype."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (a.astype(np.float32) + b.astype(np.float32)).astype(WIRE_DTYPES[wire])


def _post(s: np.ndarray, red: Reduction) -> np.ndarray:
    """Rule 1d: the post-division of the wire sum, one rounding to the wire dtype."""
    if red.post is None or red.post == 1:
        return s
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        return (s.astype(np.float32) / np.float32(red.post)).astype(WIRE_DTYPES[red.wire])


def gloo_sum(values: Sequence[np.ndarray], wire: str) -> np.ndarray:
    """Rule 2: gloo's sum of 1 or 2 ranks' wire-dtype values (W > 2: use `sum_candidates`)."""
    vals = [to_wire(v, wire) for v in values]
    if len(vals) == 1:
        return vals[0]
    if len(vals) != 2:
        raise ValueError(f"gloo fixes no order of additions for {len(vals)} ranks (rule 3): "
                         "use sum_candidates or sum_envelope")
    return _add(vals[0], vals[1], wire)


def sum_candidates(values: Sequence[np.ndarray], wire: str) -> np.ndarray:
    """Rule 3: every result a sequential sum in some rank order gives, stacked on a new axis 0.

    Row ``k`` is the sum in the ``k``-th permutation of the ranks (``itertools.permutations``
    order), rounded to the wire dtype after each addition. Up to 6 ranks.
    """
    vals = [to_wire(v, wire) for v in values]
    if not 1 <= len(vals) <= _MAX_ORDERED_RANKS:
        raise ValueError(f"sum_candidates takes 1 to {_MAX_ORDERED_RANKS} ranks, got {len(vals)}")
    rows = []
    for order in itertools.permutations(range(len(vals))):
        acc = vals[order[0]]
        for r in order[1:]:
            acc = _add(acc, vals[r], wire)
        rows.append(acc)
    return np.stack(rows)


def sum_envelope(values: Sequence[np.ndarray], wire: str) -> np.ndarray:
    """Rule 3: the bound on ``|r - sum x_i|`` over every order, as float64 (finite inputs).

    ``(W - 1) / 2`` ULPs (in the wire dtype) of ``B = sum|x_i| * (1 + u)^(W-2)``, ``B`` rounded
    up to the wire dtype so that its ULP is not underestimated.
    """
    vals = [to_wire(v, wire).astype(np.float64) for v in values]
    w = len(vals)
    if w < 1:
        raise ValueError("sum_envelope needs at least one rank")
    mags = np.abs(np.stack(vals))
    # math.fsum is exact then rounded once; the factor 1 + 2^-50 covers that rounding.
    total = np.vectorize(lambda *xs: math.fsum(xs), otypes=[np.float64])(*mags) if w > 1 else mags[0]
    bound = np.asarray(total) * (1 + _UNIT_ROUNDOFF[wire]) ** max(w - 2, 0) * (1 + 2.0**-50)
    dt = WIRE_DTYPES[wire]
    up = bound.astype(np.float32).astype(dt).astype(np.float64)
    up = np.where(up < bound, np.nextafter(up.astype(dt), dt(np.inf)).astype(np.float64), up)
    ulp = np.spacing(up.astype(dt)).astype(np.float64)
    return (w - 1) / 2 * ulp


def _check(per_rank: Sequence[np.ndarray], red: Reduction) -> list[np.ndarray]:
    vals = [np.asarray(g) for g in per_rank]
    if len(vals) != red.world_size:
        raise ValueError(f"got gradients from {len(vals)} ranks for a reduction over {red.world_size}")
    shapes = {v.shape for v in vals}
    if len(shapes) != 1:
        raise ValueError(f"the ranks' gradients differ in shape: {sorted(shapes)}")
    return vals


def reduce(per_rank: Sequence[np.ndarray], red: Reduction) -> np.ndarray:
    """Rule 1: the float32 result every rank holds after the reduction of 1 or 2 ranks."""
    vals = _check(per_rank, red)
    pre = [_pre(to_wire(v, red.wire), red) for v in vals]
    return _post(gloo_sum(pre, red.wire), red).astype(np.float32)


def reduce_candidates(per_rank: Sequence[np.ndarray], red: Reduction) -> np.ndarray:
    """Rules 1 and 3: the admissible float32 results, one row per order of the ranks (W <= 6)."""
    vals = _check(per_rank, red)
    pre = [_pre(to_wire(v, red.wire), red) for v in vals]
    return np.stack([_post(s, red).astype(np.float32) for s in sum_candidates(pre, red.wire)])


def ddp_default(world_size: int) -> Reduction:
    """Rule 6: DDP without a comm hook."""
    return Reduction("fp32", world_size, pre=("mul", float(np.float32(1.0 / world_size))), op="sum")


def ddp_compress_hook(wire: str, world_size: int) -> Reduction:
    """Rule 7: DDP with ``fp16_compress_hook`` (``wire="fp16"``) or ``bf16_compress_hook``."""
    if wire not in ("bf16", "fp16"):
        raise ValueError(f"DDP's compress hooks send bf16 or fp16, got {wire!r}")
    return Reduction(wire, world_size, pre=("div", float(world_size)), op="sum")


def fsdp2_divide_factors(reduce_dtype: str, world_size: int, factor: float | None = None,
                         force_sum: bool = False) -> tuple[float | None, float | None, str]:
    """Rule 8: ``(pre-divisor, post-divisor, op)`` as FSDP2 chooses them (``op`` in sum/avg/premul_sum)."""
    if reduce_dtype not in WIRE_DTYPES:
        raise ValueError(f"reduce_dtype must be one of {sorted(WIRE_DTYPES)}, got {reduce_dtype!r}")
    if factor is not None and not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor!r}")
    if reduce_dtype in ("fp32", "bf16") and not force_sum:
        if factor is None:
            return None, None, "sum" if world_size == 1 else "avg"
        return None, None, "avg" if factor == world_size else "premul_sum"
    f = float(world_size) if factor is None else float(factor)
    if reduce_dtype != "fp16":
        return None, f, "sum"
    pre = 1
    while f % pre == 0 and f / pre > pre:
        pre *= 2
    return float(pre), f / pre, "sum"


def fsdp2_reduction(reduce_dtype: str, world_size: int, factor: float | None = None,
                    force_sum: bool = False) -> Reduction:
    """Rule 8 as a `Reduction` (the gradients enter in the parameter dtype, cast by rule 1a)."""
    pre, post, op = fsdp2_divide_factors(reduce_dtype, world_size, factor, force_sum)
    if world_size == 1:
        if factor is not None:
            # torch divides a single rank's copy by the factor on top of the fp16 pre/post
            # division; that corner is not modelled.
            raise ValueError("a gradient divide factor on one rank is not modelled")
        return Reduction(reduce_dtype, 1, op="sum")  # no collective: a copy
    if op == "avg":
        return Reduction(reduce_dtype, world_size, post=float(world_size), op="avg")
    if op == "premul_sum":
        return Reduction(reduce_dtype, world_size, pre=("mul", 1.0 / float(factor)), op="premul_sum")
    return Reduction(reduce_dtype, world_size, pre=None if pre in (None, 1) else ("div", pre), post=post, op="sum")
