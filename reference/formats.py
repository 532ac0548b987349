"""Number formats of mixed-precision training, and how values are rounded into them.

Rules:

1. The formats are float32, tfloat32, float16, bfloat16 and the float8 family that ml_dtypes
   provides (float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz, float8_e8m0fnu).
   Each is described by a frozen ``Format``; ``FORMATS`` holds those the installed ml_dtypes
   defines, keyed by canonical name. float16 is NumPy's own type; tfloat32 is stored as float32.
2. A cast rounds to nearest, ties to even (RNE), subnormals included: nothing is flushed to zero.
3. A cast first converts its input to float32, as torch does. That is exact for every source
   format of 32 bits or fewer, but float64 is rounded twice (float64 -> float32 -> target), which
   can differ from one correct rounding: (1 + 2^-4)(1 + 2^-40) lands on the float32 tie 1.0625 and
   becomes 1.0 in float8_e4m3fn instead of 1.125; 2.98023223877e-08 lands on 2^-25, the float16
   tie between 0 and 2^-24, and becomes 0 instead of 2^-24 (NumPy's own float64 -> float16 gives
   2^-24).
4. Overflow without saturation (``saturate=False``, the OFP8 non-saturating mode and what
   ml_dtypes does): a value that rounds past ``max`` becomes inf, or NaN in a format without inf
   (the ``fn``/``fnuz`` types); inf becomes inf or NaN the same way. The threshold is max plus
   half a spacing and at that exact tie RNE decides: float8_e4m3fn 464 -> 448 (max has an even
   mantissa) but float8_e4m3fnuz 248 -> NaN, float8_e5m2 61440 -> inf, float8_e5m2fnuz 61440 -> NaN.
5. Overflow with saturation (``saturate=True``): clamp to [-max, max], then cast; so overflow and
   ±inf become ±max and NaN stays NaN. Because RNE never rounds a value at or below max past max,
   this equals rounding first and saturating after. torch 2.13 on CPU casts to float8_e4m3fn
   this way (from float32, float16 and bfloat16); its casts to the other formats do not saturate.
6. float8_e8m0fnu has no sign, no zero, no inf, no subnormals: 2^-127 ... 2^127 and one NaN
   (0xff); pattern k is 2^(k - 127). A positive float32 with exponent field E and mantissa m
   becomes pattern E, plus one when m's top bit is set and either another bit of m is set or
   E > 0. For normal values that is the nearest power of two by the significand (ties,
   1.5 * 2^k, round up); below 2^-126 (E = 0) every value above 2^-127 becomes 2^-126 and every
   value up to 2^-127 becomes 2^-127, which is not the nearest. A pattern of 255 (inf, NaN, and
   values from 1.5 * 2^127 up) is NaN. This is torch's rule, measured on all 2^31 non-negative
   float32 patterns; ml_dtypes 0.5-0.6 cast positive values the same way, 0.7 rounds the values
   below 2^-126 to the nearest instead, so the spec computes the rule itself. Signs and zeros:
   by default negatives and ±0 are NaN, as ml_dtypes has it; torch ignores the sign and encodes
   ±0 as 0x00, which decodes to 2^-127. ``torch_e8m0=True`` gives torch's encoding.
7. tfloat32 is float32 with the low 13 of its 23 mantissa bits rounded away (RNE), keeping
   float32's exponent range: 8 exponent bits, 10 mantissa bits, max (2 - 2^-10) * 2^127. Rounding
   past that max gives inf; inf and NaN pass through.
8. Distances between values are counted in representable values of the format (ULPs) by mapping
   the sign-magnitude bit pattern to a monotonic integer, so -0 and +0 are 0 apart and inf is one
   step beyond max. NaN is a class: NaN to NaN is 0, NaN to anything else is ``NAN_DISTANCE``.
9. torch's CPU conversion to float8_e4m3fn (from float32, float16 and bfloat16) depends on its
   release: up to 2.12 it is rule 4, from 2.13 on it is rule 5 (pytorch/pytorch#178817).
   ``torch_cpu_e4m3fn_saturates(version)`` says which; ``cast(x, "float8_e4m3fn",
   saturate=torch_cpu_e4m3fn_saturates(version))`` is that release's CPU cast. On a machine with
   torch 2.11 or 2.12, overflow and ±inf give NaN (0x7f/0xff), not ±448. The conformance suite
   checks each release it measured against this rule (``conformance/expectations.py``).

Facts of each format (checked against ``numpy.finfo`` / ``ml_dtypes.finfo`` by the tests):

==================  ====  ===  ====  ===============  ===========  ==============  =====  ===  ===
name                bits  exp  mant  max              min normal   min subnormal   eps    inf  NaN
==================  ====  ===  ====  ===============  ===========  ==============  =====  ===  ===
float32             32    8    23    (2-2^-23)2^127   2^-126       2^-149          2^-23  yes  yes
tfloat32            19    8    10    (2-2^-10)2^127   2^-126       2^-136          2^-10  yes  yes
float16             16    5    10    65504            2^-14        2^-24           2^-10  yes  yes
bfloat16            16    8    7     (2-2^-7)2^127    2^-126       2^-133          2^-7   yes  yes
float8_e4m3fn       8     4    3     448              2^-6         2^-9            2^-3   no   yes
float8_e5m2         8     5    2     57344            2^-14        2^-16           2^-2   yes  yes
float8_e4m3fnuz     8     4    3     240              2^-7         2^-10           2^-3   no   yes
float8_e5m2fnuz     8     5    2     57344            2^-15        2^-17           2^-2   no   yes
float8_e8m0fnu      8     8    0     2^127            2^-127       2^-127 (none)   1      no   yes
==================  ====  ===  ====  ===============  ===========  ==============  =====  ===  ===

``bits`` is the width of the encoding (sign + exponent + mantissa; e8m0fnu has no sign bit); the
storage width is ``dtype.itemsize``. ``eps`` and ``spacing_at_one`` are the same number, the gap
from 1 to the next larger value, 2^-mantissa_bits. A format without subnormals reports its
smallest positive value as ``smallest_subnormal``, as ml_dtypes' finfo does. The fnuz types have a
single NaN, 0x80, in place of -0; their exponent bias is one larger than the IEEE-style one.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class Format:
    """A binary floating-point format. Values are Python floats; ``dtype`` is the storage type."""

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    spacing_at_one: float
    has_inf: bool
    has_nan: bool
    dtype: np.dtype


def _fmt(name, dtype, bits, exp, mant, max_, normal, subnormal, has_inf) -> Format:
    eps = 2.0**-mant
    return Format(name, bits, exp, mant, max_, normal, subnormal, eps, eps, has_inf, True, np.dtype(dtype))


def _h(text: str) -> float:
    return float.fromhex(text)


# (name, ml_dtypes attribute or numpy type, bits, exponent bits, mantissa bits, max,
#  smallest normal, smallest subnormal, has_inf). Stated by hand so the module reads as a spec.
_FACTS = (
    ("float32", np.float32, 32, 8, 23, _h("0x1.fffffep127"), _h("0x1p-126"), _h("0x1p-149"), True),
    ("tfloat32", np.float32, 19, 8, 10, _h("0x1.ffcp127"), _h("0x1p-126"), _h("0x1p-136"), True),
    ("float16", np.float16, 16, 5, 10, 65504.0, _h("0x1p-14"), _h("0x1p-24"), True),
    ("bfloat16", "bfloat16", 16, 8, 7, _h("0x1.fep127"), _h("0x1p-126"), _h("0x1p-133"), True),
    ("float8_e4m3fn", "float8_e4m3fn", 8, 4, 3, 448.0, _h("0x1p-6"), _h("0x1p-9"), False),
    ("float8_e5m2", "float8_e5m2", 8, 5, 2, 57344.0, _h("0x1p-14"), _h("0x1p-16"), True),
    ("float8_e4m3fnuz", "float8_e4m3fnuz", 8, 4, 3, 240.0, _h("0x1p-7"), _h("0x1p-10"), False),
    ("float8_e5m2fnuz", "float8_e5m2fnuz", 8, 5, 2, 57344.0, _h("0x1p-15"), _h("0x1p-17"), False),
    ("float8_e8m0fnu", "float8_e8m0fnu", 8, 8, 0, _h("0x1p127"), _h("0x1p-127"), _h("0x1p-127"), False),
)


def _build_formats() -> Mapping[str, Format]:
    table = {}
    for name, dtype, *facts in _FACTS:
        if isinstance(dtype, str):
            if not hasattr(ml_dtypes, dtype):
                continue
            dtype = getattr(ml_dtypes, dtype)
        table[name] = _fmt(name, dtype, *facts)
    return types.MappingProxyType(table)


FORMATS: Mapping[str, Format] = _build_formats()

_ALIASES: Mapping[str, str] = types.MappingProxyType(
    {
        "fp32": "float32",
        "f32": "float32",
        "single": "float32",
        "tf32": "tfloat32",
        "fp16": "float16",
        "f16": "float16",
        "half": "float16",
        "bf16": "bfloat16",
        "e4m3fn": "float8_e4m3fn",
        "fp8_e4m3fn": "float8_e4m3fn",
        "e5m2": "float8_e5m2",
        "fp8_e5m2": "float8_e5m2",
        "e4m3fnuz": "float8_e4m3fnuz",
        "fp8_e4m3fnuz": "float8_e4m3fnuz",
        "e5m2fnuz": "float8_e5m2fnuz",
        "fp8_e5m2fnuz": "float8_e5m2fnuz",
        "e8m0fnu": "float8_e8m0fnu",
        "fp8_e8m0fnu": "float8_e8m0fnu",
    }
)

NAN_DISTANCE: int = int(np.iinfo(np.int64).max)
"""``ulp_distance`` between a NaN and a non-NaN: larger than any real distance, so a bound fails."""


def get_format(name_or_alias: str | Format) -> Format:
    """The ``Format`` for a canonical name or alias (case-insensitive); a ``Format`` is returned as is.

    Raises ``ValueError`` naming the unknown name and listing the known ones, or saying that the
    installed ml_dtypes lacks the format.
    """
    if isinstance(name_or_alias, Format):
        return name_or_alias
    if not isinstance(name_or_alias, str):
        raise ValueError(f"format must be a format name or a Format, got {name_or_alias!r}")
    key = name_or_alias.strip().lower()
    key = _ALIASES.get(key, key)
    if key in FORMATS:
        return FORMATS[key]
    if any(key == facts[0] for facts in _FACTS):
        raise ValueError(f"format {name_or_alias!r} is not provided by ml_dtypes {ml_dtypes.__version__}")
    raise ValueError(
        f"unknown format {name_or_alias!r}; known formats: {', '.join(FORMATS)}"
        f" (aliases: {', '.join(_ALIASES)})"
    )


def _to_float32(x) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind in "cOSUMm" or (arr.dtype.kind == "V" and arr.dtype.names is not None):
        raise ValueError(f"x must hold real numbers, got dtype {arr.dtype}")
    # float64 -> float32 is the one lossy hop (rule 3); every other source is exact in float32.
    # Overflow to inf is the specified result, not an accident to warn about.
    with np.errstate(over="ignore"):
        return arr.astype(np.float32)


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """Round float32 values to tfloat32 (10 mantissa bits, RNE); returns float32 storage.

    Rule 7. Works on the uint32 view: add 0xfff plus the lowest kept bit, clear the low 13 bits.
    A carry out of the mantissa increments the exponent, so rounding past tf32's max gives inf.
    Subnormals round the same way. inf is unchanged; NaN is returned with its bits unchanged.
    ``x`` must be float32 (use ``cast(x, "tfloat32")`` for other sources); raises ``ValueError``.
    """
    arr = np.asarray(x)
    if arr.dtype != np.float32:
        raise ValueError(f"round_to_tf32 takes float32, got {arr.dtype}; use cast(x, 'tfloat32')")
    u = arr.view(np.uint32)
    nan = np.isnan(arr)
    # NaN patterns are excluded before the add: -NaN's bits would wrap around uint32.
    finite_or_inf = np.where(nan, np.uint32(0), u)
    lowest_kept = (finite_or_inf >> np.uint32(13)) & np.uint32(1)
    rounded = (finite_or_inf + np.uint32(0xFFF) + lowest_kept) & np.uint32(0xFFFFE000)
    return np.where(nan, u, rounded).astype(np.uint32).view(np.float32)


def cast(
    x,
    fmt: str | Format,
    *,
    saturate: bool = False,
    torch_e8m0: bool = False,
) -> np.ndarray:
    """Round ``x`` into ``fmt``: RNE, via float32 (rules 2-6). Returns an array of ``fmt.dtype``.

    ``x`` is any real array-like (floats of any width, ml_dtypes floats, ints); float64 is rounded
    to float32 first, as torch does, so it is rounded twice. ``saturate=True`` clamps to
    [-max, max] before rounding (overflow and ±inf -> ±max, NaN stays NaN); ``saturate=False``
    lets overflow become inf, or NaN where the format has no inf. For float8_e8m0fnu, negatives
    and ±0 give NaN unless ``torch_e8m0=True``, which encodes |x| and maps ±0 to 0x00 (= 2^-127).
    float32 -> float32 is the identity (a copy); tfloat32 uses ``round_to_tf32``.
    Raises ``ValueError`` for an unknown format, a complex or non-numeric ``x``, or
    ``torch_e8m0=True`` with another format.
    """
    f = get_format(fmt)
    if torch_e8m0 and f.name != "float8_e8m0fnu":
        raise ValueError(f"torch_e8m0 applies only to float8_e8m0fnu, got format {f.name}")
    x32 = _to_float32(x)
    if torch_e8m0:
        x32 = np.abs(x32)
    if saturate:
        # np.clip propagates NaN, so NaN passes through as rule 5 requires.
        x32 = np.clip(x32, np.float32(-f.max), np.float32(f.max))
    if f.name == "tfloat32":
        return round_to_tf32(x32)
    if f.name == "float8_e8m0fnu":
        return _to_e8m0(x32, torch_e8m0).view(f.dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        return x32.astype(f.dtype)


def torch_cpu_e4m3fn_saturates(torch_version: str) -> bool:
    """Rule 9: does torch ``torch_version``'s CPU cast to float8_e4m3fn saturate (rule 5)?

    ``torch_version`` is "major.minor" or a full version ("2.12.1", "2.13.0+cpu"). False (rule 4,
    overflow and ±inf to NaN) up to 2.12, True from 2.13. Raises ``ValueError`` for a version
    string without a numeric major and minor.
    """
    parts = torch_version.split("+")[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"torch_version must look like '2.13' or '2.13.0', got {torch_version!r}") from None
    return (major, minor) >= (2, 13)


def _to_e8m0(x32: np.ndarray, torch_e8m0: bool) -> np.ndarray:
    """Rule 6 on float32 values, as uint8 patterns."""
    u = np.asarray(x32, np.float32).view(np.uint32)
    if torch_e8m0:
        u = u & np.uint32(0x7FFFFFFF)  # the sign is ignored; +0 gives pattern 0 by the rule
    exponent = (u >> np.uint32(23)) & np.uint32(0xFF)
    top = (u >> np.uint32(22)) & np.uint32(1)
    rest = (u & np.uint32(0x3FFFFF)) != 0
    k = exponent + (top.astype(bool) & (rest | (exponent > 0))).astype(np.uint32)
    code = np.minimum(k, np.uint32(255))
    if not torch_e8m0:
        code = np.where((u >> np.uint32(31)).astype(bool) | (u == 0), np.uint32(255), code)
    return np.asarray(code.astype(np.uint8))


def bits(x: np.ndarray) -> np.ndarray:
    """The bit patterns of a floating-point array, viewed as the unsigned int of the same width.

    Works for NumPy floats (float16/32/64) and the ml_dtypes types: bfloat16 -> uint16,
    float8 -> uint8. Raises ``ValueError`` for any other dtype.
    """
    arr = np.asarray(x)
    known = arr.dtype.kind == "f" or any(arr.dtype == f.dtype for f in FORMATS.values())
    if not known or arr.dtype.itemsize not in (1, 2, 4, 8):
        raise ValueError(f"bits takes a floating-point array, got dtype {arr.dtype}")
    return arr.view(np.dtype(f"uint{8 * arr.dtype.itemsize}"))


def _ordinal(x: np.ndarray, f: Format) -> np.ndarray:
    """Signed position of each value on the format's number line: monotonic, ±0 -> 0."""
    u = bits(x).astype(np.int64)
    if f.name == "float8_e8m0fnu":
        return u  # no sign bit: the pattern is already ordered
    width = 8 * f.dtype.itemsize
    sign = u >> (width - 1)
    magnitude = u & ((1 << (width - 1)) - 1)
    ordinal = np.where(sign == 1, -magnitude, magnitude)
    if f.name == "tfloat32":
        ordinal = ordinal >> 13  # exact: tf32 values have their low 13 bits clear
    return ordinal


def ulp_distance(a: np.ndarray, b: np.ndarray, fmt: str | Format) -> np.ndarray:
    """How many representable values of ``fmt`` separate ``a`` and ``b`` (rule 8); int64 array.

    ``a`` and ``b`` must already be of ``fmt.dtype`` (float32 for tfloat32, whose values must be
    tf32-representable); they broadcast together. 0 means equal (+0 and -0 included); adjacent
    values are 1 apart; max and inf are 1 apart; -min_subnormal and +min_subnormal are 2 apart.
    Both NaN -> 0; exactly one NaN -> ``NAN_DISTANCE``. Raises ``ValueError`` for a dtype that is
    not the format's, or for float32 values that are not tfloat32 values when ``fmt`` is tfloat32.
    """
    f = get_format(fmt)
    arrays = []
    for arg, value in (("a", a), ("b", b)):
        arr = np.asarray(value)
        if arr.dtype != f.dtype:
            raise ValueError(f"{arg} must have dtype {f.dtype} for {f.name}, got {arr.dtype}; cast it first")
        if f.name == "tfloat32" and np.any(((bits(arr) & np.uint32(0x1FFF)) != 0) & ~np.isnan(arr)):
            raise ValueError(f"{arg} holds float32 values that are not tfloat32 values; round_to_tf32 first")
        arrays.append(arr)
    a_arr, b_arr = np.broadcast_arrays(*arrays)
    a_nan = np.isnan(a_arr.astype(np.float32))
    b_nan = np.isnan(b_arr.astype(np.float32))
    distance = np.abs(_ordinal(a_arr, f) - _ordinal(b_arr, f))
    distance = np.where(a_nan | b_nan, NAN_DISTANCE, distance)
    return np.where(a_nan & b_nan, 0, distance).astype(np.int64)
