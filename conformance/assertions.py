"""Comparisons of torch results against the specification, with self-contained failure messages.

Every failure names the property, the step and the field, prints both values with their bit
patterns and ULP distance, and ends with a one-line reproduction. Rules (the conformance
method in docs/architecture.md):

1. Finite values, signed zeros and subnormals must match bit for bit.
2. NaN is compared as a class, never by bits: encodings differ between libraries and between
   torch's own CPU paths.
3. A ULP tolerance is allowed only where a comment at the call site derives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reference import formats

_MAX_SHOWN = 5


@dataclass(frozen=True)
class Where:
    """Where a comparison happens: enough to find and rerun the failing case."""

    prop: str
    step: int | None = None
    field: str = ""
    repro: str = ""

    def at(self, field: str, step: int | None = None) -> "Where":
        return Where(self.prop, self.step if step is None else step, field, self.repro)

    def header(self) -> str:
        step = f" step {self.step}" if self.step is not None else ""
        return f"{self.prop}{step}, field {self.field!r}"

    def footer(self) -> str:
        return f"reproduce: {self.repro}" if self.repro else ""


def _format_for(dtype: np.dtype) -> formats.Format | None:
    try:
        return formats.get_format(np.dtype(dtype).name)
    except ValueError:
        return None


def _hex(x: np.ndarray) -> str:
    width = x.dtype.itemsize * 2
    return "0x" + format(int(formats.bits(np.asarray(x).reshape(1))[0]), f"0{width}x")


def _describe(actual: np.ndarray, expected: np.ndarray, index: tuple[int, ...]) -> str:
    a, e = actual[index], expected[index]
    fmt = _format_for(actual.dtype)
    ulps = ""
    if fmt is not None and np.isfinite(np.float64(a)) and np.isfinite(np.float64(e)):
        ulps = f", {int(formats.ulp_distance(np.asarray([a]), np.asarray([e]), fmt)[0])} ULP apart"
    return f"  index {index}: torch {float(a)!r} ({_hex(a)}), spec {float(e)!r} ({_hex(e)}){ulps}"


def _isnan(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # ml_dtypes warns when it widens a NaN
        return np.isnan(x.astype(np.float64))


def _mismatch(actual: np.ndarray, expected: np.ndarray, max_ulp: int) -> np.ndarray:
    a_nan = _isnan(actual)
    e_nan = _isnan(expected)
    if max_ulp == 0:
        differ = formats.bits(actual) != formats.bits(expected)
    else:
        fmt = _format_for(actual.dtype)
        if fmt is None:
            raise ValueError(f"no ULP measure for dtype {actual.dtype}")
        finite = ~(a_nan | e_nan)
        dist = np.zeros(actual.shape, dtype=np.int64)
        dist[finite] = formats.ulp_distance(actual[finite], expected[finite], fmt)
        differ = dist > max_ulp
    return np.where(a_nan | e_nan, a_nan != e_nan, differ)


def assert_same(actual: np.ndarray, expected: np.ndarray, where: Where, max_ulp: int = 0) -> None:
    """Assert ``actual`` (from torch) equals ``expected`` (from the spec) under the rules above."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    problems = []
    if actual.dtype != expected.dtype:
        problems.append(f"  dtype: torch {actual.dtype}, spec {expected.dtype}")
    if actual.shape != expected.shape:
        problems.append(f"  shape: torch {actual.shape}, spec {expected.shape}")
    if not problems:
        bad = _mismatch(actual, expected, max_ulp)
        if bad.any():
            idx = np.argwhere(bad)
            tol = "bit for bit" if max_ulp == 0 else f"within {max_ulp} ULP"
            problems.append(f"  {len(idx)} of {actual.size} elements differ ({tol}, NaN as a class):")
            problems += [_describe(actual, expected, tuple(int(i) for i in ix)) for ix in idx[:_MAX_SHOWN]]
    if problems:
        raise AssertionError("\n".join([where.header() + ":", *problems, where.footer()]).rstrip())


def assert_same_list(actual: list[np.ndarray], expected: list[np.ndarray], where: Where, max_ulp: int = 0) -> None:
    """`assert_same` over lists of arrays, naming the list index in the field."""
    if len(actual) != len(expected):
        raise AssertionError(f"{where.header()}: torch has {len(actual)} tensors, spec {len(expected)}\n{where.footer()}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_same(a, e, where.at(f"{where.field}[{i}]"), max_ulp=max_ulp)


def assert_equal(actual: object, expected: object, where: Where) -> None:
    """Exact equality of plain values (bools, ints, Python floats compared as float32 bits)."""
    if isinstance(actual, float) or isinstance(expected, float):
        ok = _float_equal(actual, expected)
    else:
        ok = actual == expected
    if not ok:
        raise AssertionError(f"{where.header()}: torch {actual!r}, spec {expected!r}\n{where.footer()}".rstrip())


def _float_equal(a: object, b: object) -> bool:
    fa, fb = float(a), float(b)  # type: ignore[arg-type]
    if np.isnan(fa) or np.isnan(fb):
        return bool(np.isnan(fa) and np.isnan(fb))
    return np.float64(fa).view(np.uint64) == np.float64(fb).view(np.uint64)
