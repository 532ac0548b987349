"""reference.formats: the facts of each format, RNE casts, saturation, tf32 rounding, ULP distance."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from reference.formats import (
    FORMATS,
    NAN_DISTANCE,
    Format,
    bits,
    cast,
    get_format,
    round_to_tf32,
    torch_cpu_e4m3fn_saturates,
    ulp_distance,
)

FLOAT8 = [n for n in FORMATS if n.startswith("float8_")]


def f32(*values) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def bits_of(x) -> list[int]:
    return [int(b) for b in np.atleast_1d(bits(x))]


# --- format facts ---------------------------------------------------------------------------


def test_formats_cover_the_design_list():
    expected = ["float32", "tfloat32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
    # ml_dtypes >= 0.5 (the declared minimum) provides every float8 type named here
    assert list(FORMATS) == expected


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "tfloat32"])
def test_stated_facts_match_finfo(name):
    fmt = FORMATS[name]
    numpy_own = fmt.dtype in (np.dtype(np.float32), np.dtype(np.float16))
    info = np.finfo(fmt.dtype) if numpy_own else ml_dtypes.finfo(fmt.dtype)
    stated = (fmt.exponent_bits, fmt.mantissa_bits, fmt.max, fmt.smallest_normal,
              fmt.smallest_subnormal, fmt.eps)
    measured = (info.nexp, info.nmant, float(info.max), float(info.tiny),
                float(info.smallest_subnormal), float(info.eps))
    assert stated == measured, f"{name}: stated {stated}, finfo says {measured}"
    assert fmt.spacing_at_one == fmt.eps
    assert fmt.bits == (fmt.exponent_bits + fmt.mantissa_bits + (name != "float8_e8m0fnu"))
    assert fmt.dtype.itemsize * 8 == info.bits


@pytest.mark.parametrize("name", list(FORMATS))
def test_spacing_at_one_is_the_gap_to_the_next_value(name):
    fmt = FORMATS[name]
    one = cast(1.0, fmt)
    up = cast(1.0 + fmt.spacing_at_one, fmt)
    assert float(up) - float(one) == fmt.spacing_at_one
    assert ulp_distance(one, up, fmt) == 1, f"{name}: 1 + spacing is not the next value after 1"


@pytest.mark.parametrize("name", list(FORMATS))
def test_max_smallest_normal_and_subnormal_are_representable_and_extreme(name):
    fmt = FORMATS[name]
    for value in (fmt.max, fmt.smallest_normal, fmt.smallest_subnormal):
        assert float(cast(value, fmt)) == value, f"{name}: {value} does not survive a cast"
    # max + 2 spacings (past the rounding threshold of max + half a spacing) is inf or NaN
    above = fmt.max + fmt.max * fmt.eps
    assert not math.isfinite(float(cast(above, fmt))), f"{name}: {above} did not overflow"


def test_inf_and_nan_flags():
    with_inf = {n for n, f in FORMATS.items() if f.has_inf}
    assert with_inf == {"float32", "tfloat32", "float16", "bfloat16", "float8_e5m2"}
    assert all(f.has_nan for f in FORMATS.values())
    for name, fmt in FORMATS.items():
        got = float(cast(np.inf, fmt))
        assert (got == math.inf) if fmt.has_inf else math.isnan(got), f"{name}: inf -> {got}"


def test_tf32_facts_stated_by_hand():
    tf = FORMATS["tfloat32"]
    assert (tf.bits, tf.exponent_bits, tf.mantissa_bits) == (19, 8, 10)
    assert tf.max == (2 - 2**-10) * 2.0**127
    assert tf.smallest_normal == 2.0**-126
    assert tf.smallest_subnormal == 2.0**-136
    assert tf.eps == tf.spacing_at_one == 2.0**-10
    assert tf.dtype == np.float32


def test_formats_are_frozen():
    with pytest.raises(AttributeError):
        FORMATS["float16"].max = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        FORMATS["float16"] = FORMATS["bfloat16"]  # type: ignore[index]


# --- names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "alias, name",
    [("fp32", "float32"), ("tf32", "tfloat32"), ("fp16", "float16"), ("half", "float16"),
     ("bf16", "bfloat16"), ("BF16", "bfloat16"), ("e4m3fn", "float8_e4m3fn"), ("e5m2", "float8_e5m2"),
     ("e4m3fnuz", "float8_e4m3fnuz"), ("e5m2fnuz", "float8_e5m2fnuz"), ("e8m0fnu", "float8_e8m0fnu"),
     ("float8_e4m3fn", "float8_e4m3fn")],
)
def test_aliases(alias, name):
    assert get_format(alias) is FORMATS[name]


def test_get_format_passes_a_format_through():
    assert get_format(FORMATS["bfloat16"]) is FORMATS["bfloat16"]


@pytest.mark.parametrize("bad", ["fp8", "float64", "", "e4m3"])
def test_unknown_format_names_it_and_lists_known(bad):
    with pytest.raises(ValueError) as err:
        get_format(bad)
    message = str(err.value)
    assert repr(bad) in message and "float8_e4m3fn" in message and "bfloat16" in message
    with pytest.raises(ValueError, match="unknown format"):
        cast(1.0, bad)


def test_format_argument_of_wrong_type():
    with pytest.raises(ValueError, match="format must be"):
        get_format(np.float16)  # type: ignore[arg-type]


# --- DESIGN §3.1 facts ----------------------------------------------------------------------


def test_underflow_and_subnormal_in_fp16():
    assert float(cast(1e-8, "fp16")) == 0.0
    tiny = cast(2.0**-24, "fp16")
    assert float(tiny) > 0 and bits_of(tiny) == [0x0001], "2^-24 must be fp16's smallest subnormal"


def test_overflow_fp16_but_not_bf16():
    assert float(cast(70000.0, "fp16")) == math.inf
    assert math.isfinite(float(cast(70000.0, "bf16")))
    assert float(cast(np.float64(1e39), "bf16")) == math.inf


def test_precision_near_one():
    assert float(cast(1.001, "bf16")) == 1.0
    assert float(cast(1.001, "fp16")) != 1.0
    assert float(cast(1.001, "fp16")) == 1.0 + 2**-10


def test_maxima():
    assert float(cast(65504.0, "fp16")) == 65504.0 == FORMATS["float16"].max
    assert FORMATS["bfloat16"].max == pytest.approx(3.39e38, rel=1e-3)
    assert float(np.finfo(np.float16).max) == 65504.0


def test_spacing_near_one():
    assert FORMATS["float16"].spacing_at_one == 2.0**-10
    assert FORMATS["bfloat16"].spacing_at_one == 2.0**-7


# --- saturation ---------------------------------------------------------------------------


def test_e4m3fn_overflow_nan_without_saturation_and_max_with_it():
    x = f32(1e6, np.inf, -1e6, -np.inf)
    assert np.isnan(cast(x, "e4m3fn").astype(np.float32)).all()
    assert cast(x, "e4m3fn", saturate=True).astype(np.float32).tolist() == [448, 448, -448, -448]


@pytest.mark.parametrize("version, saturates", [("2.11", False), ("2.12.1", False), ("2.13", True),
                                                 ("2.13.0+cpu", True), ("2.14.1", True), ("3.0", True)])
def test_torch_cpu_e4m3fn_rule_by_release(version, saturates):
    """Rule 9: NaN on overflow up to 2.12, ±448 from 2.13."""
    assert torch_cpu_e4m3fn_saturates(version) is saturates
    got = cast(f32(1e6, -np.inf), "e4m3fn", saturate=torch_cpu_e4m3fn_saturates(version)).astype(np.float32)
    assert got.tolist() == [448, -448] if saturates else np.isnan(got).all()


@pytest.mark.parametrize("bad", ["", "2", "two.13", "2.x"])
def test_torch_cpu_e4m3fn_rule_refuses_a_malformed_version(bad):
    with pytest.raises(ValueError, match="torch_version must look like"):
        torch_cpu_e4m3fn_saturates(bad)


def test_saturation_keeps_nan_and_in_range_values():
    x = f32(np.nan, 0.3, -17.0, 2.0**-9, -0.0)
    sat, plain = cast(x, "e4m3fn", saturate=True), cast(x, "e4m3fn")
    assert np.isnan(sat.astype(np.float32)[0])
    assert bits_of(sat)[1:] == bits_of(plain)[1:], "saturation changed an in-range value"


@pytest.mark.parametrize("name", list(FORMATS))
def test_saturate_maps_inf_and_overflow_to_max(name):
    fmt = FORMATS[name]
    x = f32(np.inf, -np.inf, np.finfo(np.float32).max)
    got = cast(x, fmt, saturate=True).astype(np.float64)
    assert got[0] == fmt.max and got[2] == fmt.max, f"{name}: {got}"
    if name == "float8_e8m0fnu":  # no sign: -max is NaN in ml_dtypes' encoding
        assert math.isnan(got[1])
    else:
        assert got[1] == -fmt.max, f"{name}: -inf -> {got[1]}"


def test_ties_at_the_overflow_threshold():
    # max + half a spacing: RNE goes to whichever neighbour has an even mantissa
    assert float(cast(464.0, "e4m3fn")) == 448.0
    assert math.isnan(float(cast(465.0, "e4m3fn")))
    assert math.isnan(float(cast(248.0, "e4m3fnuz")))
    assert bits_of(cast(248.0, "e4m3fnuz")) == [0x80]
    assert float(cast(247.9, "e4m3fnuz")) == 240.0
    assert float(cast(61440.0, "e5m2")) == math.inf
    assert bits_of(cast(61440.0, "e5m2")) == [0x7C]
    assert math.isnan(float(cast(61440.0, "e5m2fnuz")))
    assert float(cast(61439.0, "e5m2")) == 57344.0


def test_e5m2_overflow_is_inf_and_fnuz_overflow_is_the_single_nan():
    assert cast(f32(1e6, -1e6), "e5m2").astype(np.float32).tolist() == [math.inf, -math.inf]
    assert bits_of(cast(f32(1e6, -1e6, np.inf, np.nan), "e5m2fnuz")) == [0x80] * 4
    assert bits_of(cast(f32(1e6, -np.inf, np.nan), "e4m3fnuz")) == [0x80] * 3


# --- rounding and subnormals ----------------------------------------------------------------


def test_round_half_to_even_in_the_normal_range():
    # e4m3fn spacing in [4, 8) is 0.5: 4.25 and 4.75 are ties
    assert cast(f32(4.25, 4.75, 4.2500005), "e4m3fn").astype(np.float32).tolist() == [4.0, 5.0, 4.5]
    # bfloat16 spacing at 1 is 2^-7
    assert float(cast(1 + 2**-8, "bf16")) == 1.0
    assert float(cast(1 + 3 * 2**-8, "bf16")) == 1 + 2**-6


@pytest.mark.parametrize(
    "name, sub", [("float16", 2.0**-24), ("bfloat16", 2.0**-133), ("float8_e4m3fn", 2.0**-9),
                  ("float8_e5m2", 2.0**-16), ("float8_e4m3fnuz", 2.0**-10), ("float8_e5m2fnuz", 2.0**-17)],
)
def test_subnormals_are_kept_and_round_to_even(name, sub):
    assert FORMATS[name].smallest_subnormal == sub
    got = cast(f32(sub, sub / 2, 1.5 * sub, 2.5 * sub, 0.75 * sub, -sub), name).astype(np.float64)
    # sub/2 ties to 0 (even), 1.5 sub ties to 2 sub, 2.5 sub ties to 2 sub, 0.75 sub rounds up
    assert got.tolist() == [sub, 0.0, 2 * sub, 2 * sub, sub, -sub], f"{name}: {got}"


def test_negative_underflow_keeps_the_sign_where_there_is_minus_zero():
    assert bits_of(cast(f32(-1e-30), "e4m3fn")) == [0x80]  # -0
    assert bits_of(cast(f32(-1e-30), "e4m3fnuz")) == [0x00]  # no -0 in fnuz: 0x80 is NaN


def test_e8m0_values_and_ties():
    got = cast(f32(1.0, 1.5, 2.5, 3.0, 6.0, 2.0**-127, 2.0**127), "e8m0fnu").astype(np.float64)
    assert got.tolist() == [1.0, 2.0, 2.0, 4.0, 8.0, 2.0**-127, 2.0**127]
    assert bits_of(cast(1.0, "e8m0fnu")) == [127]


def test_e8m0_sign_and_zero_ml_dtypes_vs_torch():
    x = f32(-1.0, 0.0, -0.0, -3.0, np.nan, -np.inf, 4.0)
    assert bits_of(cast(x, "e8m0fnu")) == [0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 129]
    torch_style = cast(x, "e8m0fnu", torch_e8m0=True)
    assert bits_of(torch_style) == [127, 0x00, 0x00, 129, 0xFF, 0xFF, 129]  # |-3| ties up to 4
    assert float(torch_style[1]) == 2.0**-127, "torch's 0x00 decodes to 2^-127, not 0"


def test_e8m0_below_two_to_the_minus_126_follows_torch_not_the_nearest():
    """Rule 6 on float32 subnormals: above 2^-127 everything goes up to 2^-126 (1.1 * 2^-127 is
    nearer 2^-127), at or below it to 2^-127; 1.5 * 2^127 and up is NaN. The spec computes this
    itself, so it holds whatever ml_dtypes' own cast does (0.7 rounds these to the nearest)."""
    tiny = f32(2.0**-127, 1.1 * 2.0**-127, 1.9 * 2.0**-127, 0.5 * 2.0**-127, 2.0**-149, 1.25 * 2.0**127,
               1.5 * 2.0**127)
    assert bits_of(cast(tiny, "e8m0fnu")) == [0, 1, 1, 0, 0, 254, 0xFF]
    assert bits_of(cast(f32(1.5 * 2.0**127, np.inf), "e8m0fnu", saturate=True)) == [254, 254]


def test_torch_e8m0_only_for_e8m0():
    with pytest.raises(ValueError, match="torch_e8m0"):
        cast(1.0, "e4m3fn", torch_e8m0=True)


# --- float64 goes through float32 -----------------------------------------------------------


def test_float64_is_rounded_twice_like_torch():
    x = np.float64((1 + 2**-4) * (1 + 2**-40))
    assert float(cast(x, "e4m3fn")) == 1.0, "float64 must go through float32 (which lands on a tie)"
    # one correct rounding would give 1.125: ml_dtypes' scalar constructor rounds once
    assert float(ml_dtypes.float8_e4m3fn(x)) == 1.125


def test_float64_near_tie_in_fp16():
    x = np.float64(2.98023223877e-08)  # just above 2^-25, the tie between 0 and 2^-24
    assert x > 2.0**-25
    assert bits_of(cast(x, "fp16")) == [0x0000]
    assert bits_of(np.float64(x).astype(np.float16)) == [0x0001], "NumPy's direct cast rounds once"


def test_float64_array_equals_explicit_float32_hop():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(4096) * 300
    for name in FORMATS:
        assert bits_of(cast(x, name)) == bits_of(cast(x.astype(np.float32), name)), name


def test_float32_identity_and_copy():
    x = f32(1.0, np.nan, -0.0, 1e-45, np.inf)
    y = cast(x, "fp32")
    assert y.dtype == np.float32 and bits_of(y) == bits_of(x)
    y[0] = 5
    assert x[0] == 1.0, "cast must not alias its input"


def test_float16_path_needs_no_ml_dtypes():
    x = f32(1.0, 65519.0, 65520.0, -2.0**-25, 2.0**-25 * 3)
    got = cast(x, "float16")
    assert got.dtype == np.float16
    assert got.astype(np.float64).tolist() == [1.0, 65504.0, math.inf, -0.0, 2.0**-23]
    assert bits_of(got[3]) == [0x8000]


def test_sources_of_every_narrow_width_and_ints():
    assert float(cast(np.float16(1.5), "e4m3fn")) == 1.5
    assert float(cast(cast(1.25, "bf16"), "e5m2")) == 1.25
    assert float(cast(np.arange(3), "bf16")[2]) == 2.0
    assert cast(1.0, "bf16").shape == () and cast([[1.0]], "e5m2").shape == (1, 1)
    assert cast(np.zeros((0, 3)), "fp16").shape == (0, 3)


@pytest.mark.parametrize("bad", [np.array([1 + 2j]), np.array(["a"]), np.array([None], dtype=object)])
def test_cast_rejects_non_real_input(bad):
    with pytest.raises(ValueError, match="x must hold real numbers"):
        cast(bad, "bf16")


# --- tf32 ---------------------------------------------------------------------------------------


def test_tf32_ties_to_even():
    one = 1.0
    half_ulp = 2.0**-11
    x = f32(one + half_ulp, one + 3 * half_ulp, one + half_ulp + 2.0**-23, -(one + half_ulp))
    assert round_to_tf32(x).tolist() == [1.0, 1 + 2**-9, 1 + 2**-10, -1.0]


def test_tf32_overflow_to_inf_and_specials_pass_through():
    tf_max = FORMATS["tfloat32"].max
    x = f32(np.finfo(np.float32).max, tf_max, -np.finfo(np.float32).max, np.inf, -np.inf)
    assert round_to_tf32(x).tolist() == [math.inf, tf_max, -math.inf, math.inf, -math.inf]
    nans = np.array([0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0xFF800001], dtype=np.uint32).view(np.float32)
    assert bits_of(round_to_tf32(nans)) == bits_of(nans), "NaN bits must be unchanged (none becomes inf)"


def test_tf32_subnormals_and_zero():
    x = f32(2.0**-136, 2.0**-137, 3 * 2.0**-137, -0.0, 2.0**-149)
    assert round_to_tf32(x).tolist() == [2.0**-136, 0.0, 2.0**-135, -0.0, 0.0]
    assert bits_of(round_to_tf32(f32(-0.0))) == [0x80000000]


def test_tf32_matches_exact_rounding_on_random_values():
    rng = np.random.default_rng(1)
    u = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32)
    u[::2] = (u[::2] & np.uint32(0xFFFFE000)) | np.uint32(0x1000)  # every other value an exact tie
    x = u.view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) >= 2.0**-126)]
    got = round_to_tf32(x).astype(np.float64)
    # independent reference: 11 significant bits (1 + 10) by np.rint, which rounds half to even
    mant, exp = np.frexp(x.astype(np.float64))
    ref = np.ldexp(np.rint(np.ldexp(mant, 11)), exp - 11)
    ref = np.where(np.abs(ref) > FORMATS["tfloat32"].max, np.sign(ref) * np.inf, ref)
    differ = np.flatnonzero(got != ref)
    first = differ[:1]
    assert differ.size == 0, f"{differ.size} differ, first {x[first]}: {got[first]} vs {ref[first]}"


def test_tf32_via_cast_and_saturate():
    assert bits_of(cast(f32(1 + 2**-11), "tf32")) == bits_of(f32(1.0))
    assert cast(np.float64(1e39), "tf32").tolist() == math.inf
    assert cast(np.float64(1e39), "tf32", saturate=True).tolist() == FORMATS["tfloat32"].max


def test_round_to_tf32_takes_float32_only():
    with pytest.raises(ValueError, match="round_to_tf32 takes float32, got float64"):
        round_to_tf32(np.array([1.0]))


# --- bits --------------------------------------------------------------------------------------


def test_bits_widths():
    assert bits(f32(1.0)).dtype == np.uint32 and bits_of(f32(1.0)) == [0x3F800000]
    assert bits(np.float16(-2.0)).dtype == np.uint16 and bits_of(np.float16(-2.0)) == [0xC000]
    assert bits_of(cast(1.0, "bf16")) == [0x3F80]
    assert bits_of(cast(-448.0, "e4m3fn")) == [0xFE]
    assert bits(np.float64(1.0)).dtype == np.uint64


def test_bits_rejects_integers():
    with pytest.raises(ValueError, match="bits takes a floating-point array"):
        bits(np.arange(3))


# --- ulp_distance ------------------------------------------------------------------------------


def test_ulp_distance_across_zero_bf16():
    bf = ml_dtypes.bfloat16
    sub = np.array([2.0**-133], dtype=np.float32).astype(bf)
    pos_zero, neg_zero = np.zeros(1, bf), -np.zeros(1, bf)
    assert ulp_distance(pos_zero, neg_zero, "bf16").tolist() == [0]
    assert ulp_distance(sub, -sub, "bf16").tolist() == [2]
    assert ulp_distance(cast(1.0, "bf16"), cast(-1.0, "bf16"), "bf16") == 2 * 0x3F80


def test_ulp_distance_e4m3fn_walks_every_value():
    patterns = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    values = patterns.astype(np.float32)
    finite = patterns[np.isfinite(values)]
    order = finite[np.argsort(finite.astype(np.float32), kind="stable")]
    # the 254 finite patterns hold 253 values (±0 share one): adjacent ones are 1 apart, ±0 are 0
    steps = ulp_distance(order[:-1], order[1:], "e4m3fn")
    assert sorted(set(steps.tolist())) == [0, 1] and int(np.sum(steps == 0)) == 1
    assert int(ulp_distance(cast(-448.0, "e4m3fn"), cast(448.0, "e4m3fn"), "e4m3fn")) == 2 * 126


def test_ulp_distance_float32_equals_numpy():
    rng = np.random.default_rng(2)
    a = (rng.standard_normal(2000) * 10.0 ** rng.integers(-30, 30, 2000)).astype(np.float32)
    b = (a * (1 + rng.standard_normal(2000) * 1e-5)).astype(np.float32)  # same sign, nearby
    ours = ulp_distance(a, b, "fp32")
    theirs = np.testing.assert_array_max_ulp(a, b, maxulp=2**31)
    assert np.array_equal(ours, np.asarray(theirs).reshape(-1).astype(np.int64))
    # and the spacing-based count inside one binade
    k = rng.integers(0, 100, 2000)
    c = np.abs(a) + k * np.spacing(np.abs(a))
    same_binade = np.frexp(c)[1] == np.frexp(np.abs(a))[1]
    assert np.array_equal(ulp_distance(np.abs(a), c.astype(np.float32), "fp32")[same_binade], k[same_binade])


def test_ulp_distance_nextafter_chain_across_zero_and_binades():
    x = np.float32(-3 * 2.0**-149)
    start = x
    for _ in range(7):
        x = np.nextafter(x, np.float32(1))
    assert ulp_distance(np.float32(start), x, "fp32") == 7
    assert ulp_distance(f32(1.0), f32(np.nextafter(np.float32(1), np.float32(0))), "fp32") == [1]


def test_ulp_distance_inf_and_nan():
    fp16_max, inf = np.float16(65504), np.float16(np.inf)
    assert ulp_distance(fp16_max, inf, "fp16") == 1
    nan = np.float16(np.nan)
    got = ulp_distance(np.array([nan, nan, 1.0], np.float16), np.array([nan, 1.0, nan], np.float16), "fp16")
    assert got.tolist() == [0, NAN_DISTANCE, NAN_DISTANCE]
    assert got.dtype == np.int64
    e4_nan = np.array([0x7F, 0xFF], dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    assert ulp_distance(e4_nan[0], e4_nan[1], "e4m3fn") == 0, "NaN vs NaN is the same class"


def test_ulp_distance_e8m0_and_fnuz():
    e8 = cast(f32(2.0**-127, 1.0, 2.0**127), "e8m0fnu")
    assert ulp_distance(e8[0], e8[1:], "e8m0fnu").tolist() == [127, 254]
    fnuz = cast(f32(-2.0**-10, 2.0**-10, 0.0), "e4m3fnuz")
    assert ulp_distance(fnuz[0], fnuz[1:], "e4m3fnuz").tolist() == [2, 1]


def test_ulp_distance_tf32():
    a = round_to_tf32(f32(1.0, -2.0**-136))
    b = round_to_tf32(f32(1 + 2**-9, 2.0**-136))
    assert ulp_distance(a, b, "tf32").tolist() == [2, 2]
    with pytest.raises(ValueError, match="not tfloat32 values"):
        ulp_distance(f32(1 + 2**-20), f32(1.0), "tf32")


def test_ulp_distance_broadcasts_and_checks_dtype():
    assert ulp_distance(f32(1.0), f32(1.0, 2.0), "fp32").shape == (2,)
    with pytest.raises(ValueError, match="b must have dtype bfloat16"):
        ulp_distance(cast(1.0, "bf16"), f32(1.0), "bf16")
    with pytest.raises(ValueError, match="a must have dtype float32"):
        ulp_distance(1.0, f32(1.0), "fp32")


def test_format_dataclass_fields():
    assert [f for f in Format.__dataclass_fields__] == [
        "name", "bits", "exponent_bits", "mantissa_bits", "max", "smallest_normal",
        "smallest_subnormal", "eps", "spacing_at_one", "has_inf", "has_nan", "dtype"]
