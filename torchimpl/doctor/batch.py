"""One step's statistics with few passes over each tensor and one host read for them all.

The numbers are those of ``stats.forward_numbers``, ``stats.backward_numbers`` and
``ParamStats.add`` (``torchimpl.precision.health``'s rules, tensor by tensor), bit for bit: the
same counts and maxima, and every float64 sum over the same values in the same order. What
changes is the work. Rule by rule, a module's output cost some forty passes (each rule its own
``isfinite``, masks, ``where`` and casts) and a host read per number; here each tensor is read in
about a dozen passes of arithmetic (signs, products, sums: the vectorised ops), every number of
the step is stacked and read once, and the rare extras are a second read (``bench/doctor_cost.py``).
Rules:

1. Finite tensors. Every rule simplifies where both tensors of a pair are finite: ``amax`` is
   max |x| (``aminmax``, one read), a "finite" mask is all true and ``where(finite, a, 0)`` is
   ``a``. A pair is known finite from numbers computed anyway: forward, both SQNR sums finite (a
   non-finite value in either tensor makes one inf or NaN; float32 squares cannot overflow a
   float64 sum); backward, both maxima finite (``aminmax`` propagates NaN). A pair that is not,
   is empty or differs in shape is computed by the per-tensor functions (the steps that overflow).
2. Counts from signs. Of finite x, ``|sign(x)|`` is 1 where x is non-zero: the non-zero count is
   its sum, and the entries non-zero in x but zero in y number ``nnz(x) - sum |sign(x) sign(y)|``
   (rules 5 and 6), in float64 (exact for any count below 2^53). Rule 5's cast is the cast itself:
   ``sign`` of f32(f32(x) * f32(scale)) cast to the format.
3. Order. Each float64 sum runs over the tensor torch's per-tensor function sums, in its order:
   the SQNR's over ``.double().reshape(-1)`` (logical order), the masses over ``.double().abs()``
   (the tensor's own layout).
4. Extras only where they can be non-zero: rule 4's overflow count where the shadow's amax
   reaches the threshold, the flushed masses where an entry flushed; both then by the per-tensor
   functions.
5. Scale range (rule 10) of a finite float32 gradient: ``low`` depends on the needed-th largest
   |g| only through its ``frexp`` exponent and whether it is a power of two, which its float32
   bits give (biased exponent E, mantissa zero or not: ``low = p - E + 126 + (2 if the mantissa
   is 0 else 1)``). The values ordered by (E, mantissa non-zero) are in the order of |g|, so one
   histogram of that key, summed from the top, finds the needed-th largest's key. A key of a
   subnormal (E = 0), or a gradient wider than float32, takes ``health.scale_range``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from torchimpl._torch_compat import _flatten_dense_tensors
from torchimpl.doctor.stats import BackwardNumbers, ForwardNumbers, backward_numbers, forward_numbers
from torchimpl.precision import health

__all__ = ["Scratch", "backward_batch", "forward_batch", "grad_batch", "param_batch"]

_LOW = (torch.float16, torch.bfloat16)
_F64 = torch.float64


class Scratch:
    """Rule 6: flat buffers that every pair and step of a run reuses, one per (use, dtype,
    device), grown to the largest tensor seen. A temporary per pass is a fresh allocation, and on
    a CPU the large ones are fresh pages from the kernel each step (a page fault per 4 KiB):
    ``bench/doctor_cost.py``. Each buffer's values are used before the next pair overwrites
    them (on an accelerator, in stream order)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._views: dict[tuple[str, torch.dtype, torch.device], dict[int, torch.Tensor]] = {}

    def get(self, use: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The first ``n`` entries of the buffer for ``use`` (contents undefined). The view is made
        once per size: a run's sizes repeat every step, and a slice is an op (a dispatch, some
        microseconds, a dozen times a pair). A buffer that grows drops the views of the old one."""
        key = (use, dtype, device)
        views = self._views.get(key)
        if views is not None:
            view = views.get(n)
            if view is not None:
                return view
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(n, dtype=dtype, device=device)
            views = self._views[key] = {}
        view = views[n] = buf[:n]  # type: ignore[index]
        return view


def _values(flat: Sequence[torch.Tensor]) -> list[float]:
    """``_read``'s one read of a flat list of 0-dim tensors."""
    if not flat:
        return []
    if flat[0].device.type == "cpu":
        return [float(x) for x in flat]
    return torch.stack(list(flat)).tolist()  # stack promotes every entry to float64


def _read(rows: Sequence[Sequence[torch.Tensor]]) -> list[list[float]]:
    """The host read of every row's 0-dim tensors: one ``tolist`` of them stacked (float64 holds
    each count exactly) on an accelerator, where each read is a sync; on a CPU, where a read is a
    load and stacking a few hundred scalars of mixed dtypes costs more, each value read as it is."""
    values = _values([x for row in rows for x in row])
    out, k = [], 0
    for row in rows:
        out.append(values[k:k + len(row)])
        k += len(row)
    return out


def _usable(m: torch.Tensor, s: torch.Tensor) -> bool:
    """Rule 1: the pairs the fast path may take (then known finite after the read)."""
    return m.shape == s.shape and m.numel() > 0 and s.dtype in (torch.float32, torch.float64)


def _plain(x: torch.Tensor) -> torch.Tensor:
    """x without autograd: detached only where it records a graph (a detach is a dispatched op,
    a thousand-odd a step on tensors that record none)."""
    return x.detach() if x.requires_grad else x


def _sign(x: torch.Tensor) -> torch.Tensor:
    """Rule 2: sign(x), computed in float32 for 16-bit x (its vectorised kernels)."""
    x = _plain(x)
    return x.sign() if x.dtype in (torch.float32, _F64) else x.float().sign()


def _count(p: torch.Tensor) -> torch.Tensor:
    """Rule 2: how many entries of a tensor of -1, 0 and 1 are non-zero: its dot product with
    itself (one read), exact in float32 below 2^24 entries (every partial sum an integer), in
    float64 above."""
    p = _flat(p)
    if p.numel() < 2**24:
        return torch.dot(p, p)
    return p.abs().sum(dtype=_F64)


def _nonzero(sx: torch.Tensor) -> torch.Tensor:
    """Rule 2: how many entries of sign(x) are non-zero."""
    return _count(sx)


def _both(sx: torch.Tensor, sy: torch.Tensor) -> torch.Tensor:
    """Rule 2: how many entries are non-zero in both."""
    return _count(sx * sy)


def _nonzero_and_both(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 2: (entries non-zero in x, entries non-zero in both), float64 0-dim, for finite x and y."""
    sx = _sign(x)
    return _nonzero(sx), _both(sx, _sign(y))


def _cast(g: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Rule 5's cast: f32(f32(g) * f32(scale)) into ``dtype``."""
    return (g.float() * torch.tensor(scale, dtype=torch.float32, device=g.device)).to(dtype)


def _lost_mass(a: torch.Tensor, sy: torch.Tensor) -> float:
    """Rules 13-14: the float64 sum of |x| where x is non-zero and y is zero, from ``a =
    x.double().abs()`` (finite, in x's own layout) and sign(y): ``a (1 - |sign y|)`` is |x| there
    and +0.0 elsewhere (where x is 0, a is), the values of the per-tensor ``where(lost, |x|, 0)``."""
    return float((a * (1 - sy.abs())).sum())


def _lost_mass_of(x: torch.Tensor, y: torch.Tensor, scratch: Scratch) -> float:
    """``_lost_mass(x.double().abs(), _sign(y))`` (y: the tensor whose zeros lose x's mass), in
    the run's buffers where both are contiguous (the same values, flat, summed in the same
    order); else as it is written."""
    if not (x.is_contiguous() and y.is_contiguous()):
        return _lost_mass(x.detach().double().abs(), _sign(y))
    n, dev = x.numel(), x.device
    a = scratch.get("r", n, _F64, dev).copy_(_flat(x)).abs_()
    kept = _sign_into(scratch.get("sy", n, _sign_dtype(y), dev), y).abs_().neg_().add_(1)  # 1 - |sign y|
    return float(a.mul_(kept).sum())


def _amax_pair(x: torch.Tensor) -> list[torch.Tensor]:
    """``aminmax`` (an empty tensor: zeros, as ``amax`` gives 0.0 and nothing is non-finite)."""
    if x.numel() == 0:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return [zero, zero]
    lo, hi = torch.aminmax(_plain(x))
    return [lo, hi]


def _amax(lo: float, hi: float) -> float:
    """Rule 1 (``amax``) from ``aminmax`` of a finite tensor (+0.0 for a tensor of zeros, as ``amax``)."""
    return max(abs(lo), abs(hi))


def _sqnr(signal: float, noise: float) -> float:
    """Rule 8 from its two sums (both finite: rule 1)."""
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """A tensor's values in logical order, one dimension (a view where its layout allows; a
    1-D tensor as it is)."""
    x = _plain(x)
    return x if x.dim() == 1 else x.reshape(-1)


def _sign_into(buf: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Rule 2: ``_sign(x)``'s values, flat, into ``buf`` (16-bit x upcast exactly first; x of
    ``buf``'s dtype in one pass, ``sign`` writing into it)."""
    if x.dtype == buf.dtype:
        return torch.sign(_flat(x), out=buf)
    buf.copy_(_flat(x))
    return buf.sign_()


def _sign_dtype(*xs: torch.Tensor) -> torch.dtype:
    """The dtype of ``_sign(x) * _sign(y)``: float64 where either is float64, else float32."""
    return _F64 if any(x.dtype == _F64 for x in xs) else torch.float32


def _forward_row(m: torch.Tensor, s: torch.Tensor, scratch: Scratch) -> list[torch.Tensor]:
    """Rule 6's passes over one finite-able output pair, into the run's buffers: the SQNR's two
    float64 sums over s in logical order (``(m - r)^2``, which is ``(r - m)^2`` bit for bit, squared
    in place, then ``|r| |r|``, which is ``r r``), the mass over |s| in s's layout (its logical order
    where s is contiguous), and the sign counts. m is widened into its float64 buffer before the
    subtraction: a float64 op on a 16-bit operand converts it per element on a slower path."""
    n, dev, fm, fs = s.numel(), s.device, _flat(m), _flat(s)
    x = scratch.get("r", n, _F64, dev).copy_(fs)  # exact: float32 widened
    d = scratch.get("d", n, _F64, dev).copy_(fm).sub_(x)  # exact widening, then m - r
    noise = d.mul_(d).sum()
    total = x.abs_().sum() if s.is_contiguous() else _plain(s).double().abs().sum()
    signal = x.mul_(x).sum()
    ss = _sign_into(scratch.get("sx", n, s.dtype if s.dtype == _F64 else torch.float32, dev), fs)
    both = _sign_into(scratch.get("sy", n, _sign_dtype(s, m), dev), fm).mul_(ss)
    return [*_amax_pair(fm), *_amax_pair(fs), signal, noise, _nonzero(ss), _count(both), total]


def forward_batch(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  scratch: Scratch | None = None) -> list[ForwardNumbers]:
    """``stats.forward_numbers`` for every (mixed, shadow) output pair of a step (``scratch``:
    the run's buffers, or buffers of this call alone)."""
    scratch = scratch if scratch is not None else Scratch()
    fast = [j for j, (m, s) in enumerate(pairs) if _usable(m, s)]
    rows = [_forward_row(*pairs[j], scratch) for j in fast]
    out: dict[int, ForwardNumbers] = {}
    for j, (lo_m, hi_m, lo_s, hi_s, signal, noise, nonzero, both, total) in zip(fast, _read(rows)):
        if not (math.isfinite(signal) and math.isfinite(noise)):
            continue  # rule 1: tensor by tensor
        m, s = pairs[j]
        amax_s = _amax(lo_s, hi_s)
        over = 0
        if m.dtype in _LOW and amax_s >= health._overflow_threshold(m.dtype)[0]:  # rule 4
            over = health.overflow_count(s, m.dtype)
        lost = int(nonzero - both)
        # rule 4: the lost mass only where an entry flushed (nothing flushed weighs 0.0)
        mass = (_lost_mass_of(s, m, scratch), total) if lost else (0.0, total)
        out[j] = ForwardNumbers(_amax(lo_m, hi_m), amax_s, _sqnr(signal, noise), False, False, over,
                                (lost, int(nonzero)), mass)
    return [out[j] if j in out else forward_numbers(*pairs[j]) for j in range(len(pairs))]


def _exponent_keys_(bits: torch.Tensor) -> torch.Tensor:
    """Rule 5, in place on the float32 bits of |g| (int32, sign bits clear: ``abs`` clears them,
    NaN's too): E + (mantissa non-zero) of each |g| (in [0, 256) for finite g). Two values with
    equal keys have equal ``low``: (E, mantissa non-zero) and (E + 1, mantissa zero) share
    ``p - E + 127``."""
    bits.clamp_max_(0x7F800000)  # ±inf and NaN (taken tensor by tensor) must not overflow the sum below
    return bits.add_(0x7FFFFF).bitwise_right_shift_(23)


def _needed_keys(bits: torch.Tensor, sizes: Sequence[int], nonzero: Sequence[torch.Tensor],
                 keep: float) -> list[torch.Tensor]:
    """Rule 5: for each gradient, the key of its needed-th largest |g| (needed = ceil(keep n), n
    its non-zero count), from the float32 bits of every gradient's |g| one after the other in
    ``bits`` (int32, segments of ``sizes``, each in any order; overwritten): the keys computed in
    one pass each, gradient p's moved to [256 p, 256 p + 256), one histogram of them all. ``keep
    n`` is a float64 product, as ``health.scale_range``'s: in float32 (a float32 count times keep
    rounded to float32) it differs for some n (32999 at keep 0.999: 32966 against 32967)."""
    keys = _exponent_keys_(bits)
    start = 0
    for p, size in enumerate(sizes):
        if p:
            keys[start:start + size].add_(256 * p)
        start += size
    from_top = torch.bincount(keys, minlength=256 * len(sizes)).view(len(sizes), 256).flip(1).cumsum(1)
    needed = torch.ceil(torch.stack(list(nonzero)).double() * keep).to(torch.int64).clamp_min(1)
    return list((255 - torch.searchsorted(from_top, needed.unsqueeze(1))).view(-1).unbind())


def _low_from_key(key: int, dtype: torch.dtype) -> int:
    """Rule 5: ``p - E + 126 + (2 if the mantissa is 0 else 1)`` = ``p + 128 - key``."""
    p = round(math.log2(health._facts(dtype)[2])) - 1
    return p + 128 - key


def _high(top: float, dtype: torch.dtype) -> int:
    """Rule 10's ``high`` from the largest |g| (``health.scale_range``'s formula)."""
    top_value = health._facts(dtype)[0]
    f, e = math.frexp(top)
    high = math.frexp(top_value)[1] - e
    while math.ldexp(f, e + high) > top_value:
        high -= 1
    return high


def _backward_row(m: torch.Tensor, g: torch.Tensor, scale: torch.Tensor, scratch: Scratch,
                  place: torch.Tensor | None) -> list[torch.Tensor]:
    """Rule 6's passes over one gradient pair, into the run's buffers (rules 5, 13 and 10 where
    the mixed gradient is 16-bit: the cast at the step's scale, ``scale`` as a float32 0-dim
    tensor on g's device, the mass over |g| in g's layout; |g| left in ``place`` for the scale
    range's key, ``_needed_keys``, where g is float32)."""
    n, dev, fm, fg = g.numel(), g.device, _flat(m), _flat(g)
    sg = _sign_into(scratch.get("sx", n, g.dtype if g.dtype == _F64 else torch.float32, dev), fg)
    nonzero = _nonzero(sg)
    both = _sign_into(scratch.get("sy", n, _sign_dtype(g, m), dev), fm).mul_(sg)
    row = [*_amax_pair(fm), *_amax_pair(fg), nonzero, _count(both)]
    if m.dtype in _LOW:
        cast = torch.mul(fg if fg.dtype == torch.float32 else fg.float(), scale,
                         out=scratch.get("c", n, torch.float32, dev))  # rule 5's cast: _cast's values
        # the cast's non-zero entries are non-zero in g (0 casts to 0): its count is the count
        # of entries non-zero in both, without a product with sign(g)
        cast.copy_(scratch.get("low", n, m.dtype, dev).copy_(cast)).sign_()
        a = torch.abs(fg, out=place if place is not None else scratch.get("a", n, g.dtype, dev))
        # the mass over |g| (logical order); the key reads its bits later (stream order)
        total = a.sum(dtype=_F64) if g.is_contiguous() else _plain(g).abs().sum(dtype=_F64)
        row += [_count(cast), total]
    return row


def _key_places(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], keyed: Sequence[int],
                scratch: Scratch) -> dict[torch.device, tuple[torch.Tensor, list[int]]]:
    """Rule 5: per device, one float32 buffer for the |g| of every keyed gradient (``keyed``:
    the pairs' indices), one after the other, and those indices in that order."""
    groups: dict[torch.device, list[int]] = {}
    for j in keyed:
        groups.setdefault(pairs[j][1].device, []).append(j)
    return {dev: (scratch.get("keys", sum(pairs[j][1].numel() for j in js), torch.float32, dev), js)
            for dev, js in groups.items()}


def backward_batch(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], scale: float,
                   keep: float, scratch: Scratch | None = None) -> list[BackwardNumbers]:
    """``stats.backward_numbers`` for every (mixed at the loss scale, shadow) gradient pair of a
    step (``scratch``: the run's buffers, or buffers of this call alone)."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep!r}")
    scratch = scratch if scratch is not None else Scratch()
    fast = [j for j, (m, s) in enumerate(pairs) if _usable(m, s)]
    # rule 5's f32(scale): one 0-dim tensor per device of the step's gradients
    factors = {d: torch.tensor(scale, dtype=torch.float32, device=d) for d in {pairs[j][1].device for j in fast}}
    # rule 5's key for each 16-bit gradient whose shadow is float32: every such |g| in one
    # buffer per device, one histogram for them all (a histogram per gradient is a dozen ops)
    keyed = [j for j in fast if pairs[j][0].dtype in _LOW and pairs[j][1].dtype == torch.float32]
    places, slots = _key_places(pairs, keyed, scratch), {}
    for buf, js in places.values():
        start = 0
        for j in js:
            slots[j] = buf[start:start + pairs[j][1].numel()]
            start += pairs[j][1].numel()
    rows = [_backward_row(*pairs[j], factors[pairs[j][1].device], scratch, slots.get(j)) for j in fast]
    row_of = dict(zip(fast, rows))
    for buf, js in places.values():
        keys = _needed_keys(buf.view(torch.int32), [pairs[j][1].numel() for j in js], [row_of[j][4] for j in js], keep)
        for j, key in zip(js, keys):
            row_of[j].append(key)
    for j in fast:
        if pairs[j][0].dtype in _LOW and j not in slots:  # a float64 shadow: its key is not used
            row_of[j].append(torch.zeros((), device=pairs[j][1].device))
    out: dict[int, BackwardNumbers] = {}
    for j, values in zip(fast, _read(rows)):
        lo_m, hi_m, lo_g, hi_g, nonzero, both = values[:6]
        if not all(math.isfinite(v) for v in (lo_m, hi_m, lo_g, hi_g)):
            continue  # rule 1: tensor by tensor
        m, g = pairs[j]
        n, flushed = int(nonzero), (int(nonzero - both), int(nonzero))
        if m.dtype not in _LOW:
            out[j] = BackwardNumbers(_amax(lo_m, hi_m), flushed, None, None, None)
            continue
        kept, total, key = values[6:]
        lost = n - int(kept)
        mass = (_lost_mass_of(g, _cast(g, m.dtype, scale), scratch), total) if lost \
            else (0.0, total)
        out[j] = BackwardNumbers(_amax(lo_m, hi_m), flushed, (lost, n), mass,
                                 _scale_range(g, m.dtype, keep, n, _amax(lo_g, hi_g), int(key)))
    return [out[j] if j in out else backward_numbers(*pairs[j], scale, keep) for j in range(len(pairs))]


def _scale_range(g: torch.Tensor, dtype: torch.dtype, keep: float, n: int, top: float,
                 key: int) -> health.ScaleRange:
    """Rule 5 (``health.scale_range`` where the key cannot say)."""
    if n == 0:
        return health.ScaleRange(None, None)
    if g.dtype != torch.float32 or key <= 1:  # a subnormal (or the smallest normal, which shares its key)
        return health.scale_range(g, dtype, keep)
    return health.ScaleRange(_low_from_key(key, dtype), _high(top, dtype))


def _segment_counts(values: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor | float]:
    """Each flat -1/0/1 value's non-zero count over consecutive segments of ``sizes``, value by
    value. On a CPU, where a read is a load, one NumPy ``add.reduceat`` of |v| per value, read
    at once (a float32 sum of ones is exact below 2^24 entries, whatever its order; float64 for a
    larger segment; an empty segment counts 0): an op per segment costs more than most segments'
    entries. Elsewhere one ``_count`` per slice, left for the step's one read (a running sum
    over all of them costs more)."""
    edges = list(itertools.accumulate(sizes, initial=0))
    if not values or values[0].device.type != "cpu":
        return [_count(v[a:b]) for v in values for a, b in zip(edges, edges[1:])]
    full = [j for j, n in enumerate(sizes) if n]
    starts = np.asarray([edges[j] for j in full], dtype=np.intp)
    dtype = np.float32 if max(sizes, default=0) < 2**24 else np.float64
    out: list[torch.Tensor | float] = []
    for v in values:
        counts = [0.0] * len(sizes)
        if full:
            for j, c in zip(full, np.add.reduceat(v.detach().abs().numpy(), starts, dtype=dtype).tolist()):
                counts[j] = c
        out += counts
    return out


def _flat_cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' values, each flat in logical order, joined (read only: one tensor may come
    back as a view of itself): torch's ``flatten_dense_tensors`` flattens them in C++, where a
    ``detach`` and a ``reshape`` per tensor from Python are two dispatched ops each, a hundred-odd
    a step; no graph under ``no_grad``."""
    with torch.no_grad():
        if _flatten_dense_tensors is not None:
            return _flatten_dense_tensors(list(tensors))
        return torch.cat([t.reshape(-1) for t in tensors])


def param_batch(stored: Sequence[torch.Tensor], after: Sequence[torch.Tensor],
                update: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """``health.applied_lost_count`` for each (stored, after, exact update) triple (rule 12): the
    parameters of one dtype joined, one read. Of a finite update, the counted entries are its
    non-zero ones and the lost ones those whose stored bits did not change (rule 2: the sign of
    the bits' difference, as integers of the dtype's width, is 0 exactly where they are equal)."""
    for b, a, e in zip(stored, after, update):
        if b.shape != a.shape or b.dtype != a.dtype or e.shape != b.shape:
            raise ValueError(f"before {b.dtype}{list(b.shape)}, after {a.dtype}{list(a.shape)} and exact "
                             f"{list(e.shape)} must be one parameter's: same dtype and shape")
    groups: dict[torch.dtype, list[int]] = {}
    for i, b in enumerate(stored):
        groups.setdefault(b.dtype, []).append(i)
    pending = []
    for group in groups.values():
        width = health._BITS[stored[group[0]].element_size()]
        changed = (_flat_cat([after[i] for i in group]).view(width)
                   - _flat_cat([stored[i] for i in group]).view(width)).sign()
        e = _flat_cat([update[i] for i in group])
        se = _sign(e)
        counts = _segment_counts([se, se * changed], [stored[i].numel() for i in group])
        pending.append((group, [*_amax_pair(e), *counts]))
    read = _values([x for _, v in pending for x in v])
    out: list[tuple[int, int]] = [(0, 0)] * len(stored)
    k = 0
    for group, v in pending:
        lo, hi = read[k], read[k + 1]
        counted, changed = read[k + 2:k + 2 + len(group)], read[k + 2 + len(group):k + 2 + 2 * len(group)]
        k += 2 + 2 * len(group)
        for i, c, ch in zip(group, counted, changed):
            finite = math.isfinite(lo) and math.isfinite(hi)  # rule 1, else tensor by tensor
            out[i] = (int(c - ch), int(c)) if finite else health.applied_lost_count(stored[i], after[i], update[i])
    return out


def grad_batch(mixed: Sequence[torch.Tensor], shadow: Sequence[torch.Tensor | None]
               ) -> tuple[bool, list[tuple[int, int] | None]]:
    """Whether every mixed gradient is finite, and ``health.flushed_count(shadow, mixed)`` of each
    pair with a shadow gradient (rule 6): the gradients joined, one read."""
    if not mixed:
        return True, []
    pairs = [j for j, r in enumerate(shadow) if r is not None]
    for j in pairs:
        if shadow[j].shape != mixed[j].shape:  # type: ignore[union-attr]
            raise ValueError(f"reference has shape {tuple(shadow[j].shape)} but observed has {tuple(mixed[j].shape)}")
    o_all = _flat_cat(mixed)
    parts = _amax_pair(o_all)
    if pairs:
        o = o_all if len(pairs) == len(mixed) else _flat_cat([mixed[j] for j in pairs])
        r = _flat_cat([shadow[j] for j in pairs])  # type: ignore[misc]
        sr = _sign(r)
        parts += [*_amax_pair(r), *_segment_counts([sr, sr * _sign(o)], [mixed[j].numel() for j in pairs])]
    read = _values(parts)
    finite = math.isfinite(read[0]) and math.isfinite(read[1])
    counts: list[tuple[int, int] | None] = [None] * len(mixed)
    if pairs:
        fast = finite and math.isfinite(read[2]) and math.isfinite(read[3])  # rule 1
        nonzero, both = read[4:4 + len(pairs)], read[4 + len(pairs):]
        for k, j in enumerate(pairs):
            counts[j] = (int(nonzero[k] - both[k]), int(nonzero[k])) if fast else \
                health.flushed_count(shadow[j], mixed[j])  # type: ignore[arg-type]
    return finite, counts
