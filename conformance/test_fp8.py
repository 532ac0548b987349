"""Property 9: scaled float8 training, torchao against `reference.fp8`.

Exactness, per property (inputs drawn as bit patterns, `conformance.fp8_strategies`):

- quantize (amax, scale, fp8 bits) for every float8 format, tensorwise and axiswise (both axes
  torchao uses), power-of-two scales on and off, float32, bfloat16 and float64 inputs, with
  zeros, amax below the 1e-12 epsilon, subnormal and huge amax, and amax planted where rule 4's
  float32 log2 decides: bit for bit (NaN as a class);
- MX block scaling (e8m0 scale bytes and fp8 elements), floor, ceil and rceil: bit for bit;
- the recipes' three matmuls (output with bias, grad_input, grad_weight) through a real
  Float8Linear, every recipe, float32 and bfloat16 activations: bit for bit when the spec is
  handed the GEMM torch uses (rule 7 leaves its summation order open; every cast, scale,
  dtype, post-scale and bias step is the spec's own), all dimensions >= 2 (MKL's order depends
  on strides, which a size-1 dimension leaves free);
- scaled matmuls whose sum is exact in any order (K = 1; fp8 values in narrow exponent windows
  with power-of-two scales): bit for bit against the spec's exact GEMM, signed zeros compared by
  value (a GEMM may start its accumulator at +0);
- tensorwise matmuls with general inputs: every element within rule 7's bound of the exact sum,
  (gamma_K + 2^-53) * sum_k |A'_ik| |B'_kj| + K * 2^-149 (derived in
  `reference.fp8.accumulation_bound`); bfloat16 results within the bfloat16 roundings of the
  interval's ends (rounding is monotonic). The fraction bit-equal to the correctly rounded sum
  and the share of the bound used are reported as Hypothesis statistics and targets;
- torchimpl's converted layers as a user gets them (``torchimpl.precision.fp8.convert_to_fp8``), every
  recipe, mxfp8 included: the layer's configuration (float8) or each of its six MX casts
  (element format, block size, scale mode, shape) read back and compared with the spec's
  recipe, then output, grad_input and grad_weight bit for bit given torch's GEMM;
- rule 12: MX dequantize over any element and scale bytes (the NaN byte, 2^-127, zero blocks)
  bit for bit; the emulated MX matmul bit for bit given torch's GEMM and, in float32, within
  rule 7's bound of the exact sum wherever no partial sum can overflow;
- every recipe property draws 2-d, 3-d and 4-d activations (the backward flattens the leading
  axes and pairs rows); the embedded transformer trained three steps in float8 by the trainer
  is checked layer by layer against the spec at every step (bit for bit);
- compiled equals eager bit for bit (one example; ``slow``: a cold compile takes about a minute).

The matmul properties run on the CPU with mkldnn off (AMX machines route `_scaled_mm` through
oneDNN, another summation path) and compare within one process, never across machines. torchao
internals that change between releases are keyed by version in `conformance.expectations`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # its CUDA extensions: noise on CPU

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import event, given, target  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conformance import expectations  # noqa: E402
from conformance import fp8_strategies as fs  # noqa: E402
from conformance.assertions import Where, assert_equal, assert_same  # noqa: E402
from conformance.bridge import to_numpy, to_torch, torch_dtype  # noqa: E402
from reference import formats, fp8  # noqa: E402

pytest.importorskip("torchao.float8", reason="torchao is not installed: pip install '.[fp8]' (torchao==0.18.0)")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_ops import addmm_float8_unwrapped  # noqa: E402
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import MXTensor, to_mx  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402

from conformance import fp8_layers  # noqa: E402  (imports torchao)

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
REPRO = f"rerun this test with the @reproduce_failure blob printed above ({expectations.torchao_provenance()})"
# Every property is parametrized into at least two cases: 2,500 examples or more in thorough.


@pytest.fixture(autouse=True, scope="module")
def _mkldnn_off():
    """The reference CPU path of `_scaled_mm` and `mm`; restored afterwards."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    yield
    torch.backends.mkldnn.enabled = before


def _strided(x: np.ndarray) -> torch.Tensor:
    # Keeps the array's strides: MKL's summation order depends on the layout (rule 7).
    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def torch_gemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """torch's GEMM of the operands' dtype on the spec's operands, in the layouts handed over."""
    return to_numpy(torch.mm(_strided(a), _strided(b)))


def _zeros_by_value(x: np.ndarray) -> np.ndarray:
    return np.where(x.astype(np.float32) == 0, np.zeros((), x.dtype), x).astype(x.dtype)


# ----------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("dtype", [F32, BF16, np.dtype(np.float64)], ids=["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("fmt", fp8.FP8_FORMATS)
@given(data=st.data())
def test_quantize_matches_torchao(fmt, dtype, device, data):
    x, regime = data.draw(fs.quantize_input(dtype, fmt))
    granularity = data.draw(st.sampled_from(["tensorwise", "axiswise"]))
    axis = data.draw(st.sampled_from([-1, 0]))
    power_of_2 = data.draw(st.booleans())
    event(f"regime: {regime}")
    if power_of_2:
        plain = fp8.amax_to_scale(fp8.amax(x, None if granularity == "tensorwise" else axis), fmt)
        if (fp8.round_scale_down_to_power_of_2(plain) != fp8.exact_power_of_2_floor(plain)).any():
            event("power of two: float32 log2 above the exact floor")
    t = hp_tensor_to_float8_dynamic(
        to_torch(x, device), torch_dtype(formats.get_format(fmt).dtype), LinearMMConfig(),
        gemm_input_role=GemmInputRole.INPUT,
        scaling_granularity=ScalingGranularity.AXISWISE if granularity == "axiswise" else ScalingGranularity.TENSORWISE,
        axiswise_dim=axis if granularity == "axiswise" else None, round_scales_to_power_of_2=power_of_2)
    spec = fp8.quantize(x, fmt, granularity, axis, power_of_2)
    where = Where("fp8 quantize", field=f"{fmt} {granularity} axis={axis} power_of_2={power_of_2} {dtype}",
                  repro=REPRO)
    assert_same(to_numpy(t._scale).reshape(spec.scale.shape), spec.scale, where.at(where.field + " scale"))
    assert_same(to_numpy(t._data), spec.data, where.at(where.field + " data"))


def test_power_of_two_rule_is_torchaos_float32_log2(device):
    """The crafted case of rule 4 on its own, so that a change of rule names itself."""
    from reference.__main__ import FP8_POW2_AMAX

    x = np.array([[FP8_POW2_AMAX, 1.0]], np.float32)
    t = hp_tensor_to_float8_dynamic(to_torch(x, device), torch.float8_e4m3fn, LinearMMConfig(),
                                    round_scales_to_power_of_2=True)
    where = Where("fp8 power of two", field="scale at amax 0x3fe00001", repro="pytest conformance/test_fp8.py -k power_of_two")
    assert_equal(float(t._scale.item()), 256.0, where)
    assert float(fp8.exact_power_of_2_floor(fp8.amax_to_scale(np.float32(x.max()), "float8_e4m3fn"))) == 128.0


# ----------------------------------------------------------------------------- MX


@pytest.mark.parametrize("mode", ["floor", "ceil", "rceil"])
@pytest.mark.parametrize("elem", ["float8_e4m3fn", "float8_e5m2"])
@given(data=st.data())
def test_mx_scales_and_elements_match_torchao(elem, mode, device, data):
    dtype = data.draw(st.sampled_from([F32, BF16]))
    x = data.draw(fs.mx_input(dtype))
    scale, q = to_mx(to_torch(x, device), torch_dtype(formats.get_format(elem).dtype), 32,
                     ScaleCalculationMode(mode))
    spec = fp8.to_mx(x, elem, 32, mode)
    where = Where("fp8 MX", field=f"{elem} {mode} {dtype}", repro=REPRO)
    torch_bytes = scale.view(torch.uint8).cpu().numpy().reshape(spec.scale.shape)
    # Compared as e8m0 values: bit for bit, and 0xff (its one NaN) as a class of one.
    assert_same(torch_bytes.view(spec.scale.dtype), spec.scale, where.at(where.field + " scale"))
    assert_same(to_numpy(q), spec.data, where.at(where.field + " data"))


# ----------------------------------------------------------------------------- recipes


def _float8_linear(case: dict, recipe: str, bias: bool) -> torch.nn.Module:
    w = case["weight"]
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias)
    with torch.no_grad():
        lin.weight.copy_(to_torch(w))
        if bias:
            lin.bias.copy_(to_torch(case["bias"]))
    return convert_to_float8_training(torch.nn.Sequential(lin), config=Float8LinearConfig.from_recipe_name(recipe))


def _run_linear(case: dict, recipe: str, bias: bool) -> dict[str, np.ndarray]:
    model = _float8_linear(case, recipe, bias)
    x = to_torch(case["x"]).requires_grad_()
    y = model(x)
    y.backward(to_torch(case["grad_output"]))
    return {"output": to_numpy(y), "grad_input": to_numpy(x.grad), "weight.grad": to_numpy(model[0].weight.grad)}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", RECIPES)
@given(data=st.data())
def test_recipe_matmuls_match_torchao_given_torchs_gemm(recipe, dtype, data):
    # Every dimension >= 2: a size-1 dimension leaves its stride free, torch keeps whatever its
    # views produced there, and MKL picks its kernel (so its summation order) by the strides.
    # Size-1 dimensions are covered by the exact-sum and the accumulation-bound properties.
    case = data.draw(fs.linear_case(dtype, min_dim=2))
    event(f"{case['x'].ndim}-d input")
    if recipe.startswith("rowwise") and not expectations.rowwise_scaled_mm_on_cpu():
        with pytest.raises(RuntimeError, match=expectations.ROWWISE_REFUSAL):  # keyed: torch 2.11's CPU
            _run_linear(case, recipe, bias=True)
        return
    got = _run_linear(case, recipe, bias=True)
    y = fp8.linear_forward(case["x"], case["weight"], case["bias"], recipe, gemm=torch_gemm)
    g = fp8.linear_backward(case["x"], case["weight"], case["grad_output"], recipe, gemm=torch_gemm)
    where = Where("fp8 recipe", field=f"{recipe} {dtype}", repro=REPRO)
    assert_same(got["output"], y, where.at(where.field + " output"))
    assert_same(got["grad_input"], g.grad_input, where.at(where.field + " grad_input"))
    # autograd casts the matmul's grad_weight to the weight's float32 (exact from bfloat16).
    assert_same(got["weight.grad"], g.grad_weight.astype(np.float32), where.at(where.field + " grad_weight"))


@pytest.mark.parametrize("out", [F32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("k_one", [True, False], ids=["K=1", "exactly summable"])
@given(data=st.data())
def test_exact_matmuls_match_bit_for_bit(k_one, out, data):
    case = data.draw(fs.exact_matmul_case(k_one))
    fast_accum = case["fast_accum"]
    a, b = fp8.Quantized(case["qa"], case["sa"]), fp8.Quantized(case["qb"], case["sb"])
    spec = fp8.scaled_mm(a, b, out, fast_accum=fast_accum)
    # Keyed: torch 2.11's CPU _scaled_mm refuses scales of more than one element, which torchao
    # passes it for a rowwise matmul with fast accumulation (without, it scales the output itself).
    if fast_accum and max(case["sa"].size, case["sb"].size) > 1 and not expectations.rowwise_scaled_mm_on_cpu():
        with pytest.raises(RuntimeError, match=expectations.ROWWISE_REFUSAL):
            addmm_float8_unwrapped(to_torch(case["qa"]), to_torch(case["sa"]), to_torch(case["qb"]).t().contiguous().t(),
                                   to_torch(case["sb"]), torch_dtype(out), use_fast_accum=fast_accum)
        return
    got = addmm_float8_unwrapped(to_torch(case["qa"]), to_torch(case["sa"]), to_torch(case["qb"]).t().contiguous().t(),
                                 to_torch(case["sb"]), torch_dtype(out), use_fast_accum=fast_accum)
    event(f"{'rowwise' if case['rowwise'] else 'tensorwise'}, fast_accum={fast_accum}")
    where = Where("fp8 exact matmul", field=f"{'K=1' if k_one else 'summable'} rowwise={case['rowwise']} "
                  f"fast_accum={fast_accum} -> {out}", repro=REPRO)
    assert_same(_zeros_by_value(to_numpy(got)), _zeros_by_value(spec), where)


def _within_bound(got: np.ndarray, a_pre: np.ndarray, b_pre: np.ndarray, where: Where) -> tuple[bool, float]:
    """Every element of ``got`` within rule 7's bound of the exact sums; returns (bit-equal to
    the correctly rounded sum everywhere, the largest share of gamma_K * sum |a||b| used)."""
    exact = fp8.exact_sums(a_pre, b_pre)
    bound = fp8.accumulation_bound(a_pre, b_pre)
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = exact.astype(np.float32).astype(got.dtype)
        finite = np.isfinite(exact) & np.isfinite(rounded.astype(np.float64))
        assert_same(np.where(finite, rounded, got), rounded, where.at(where.field + " (non-finite sums)"))
        c = got.astype(np.float64)
        if got.dtype == F32:
            ok = np.abs(c - exact) <= bound
        else:  # the float32 interval's ends rounded as torch rounds: the result lies between them
            lo = (exact - bound).astype(np.float32).astype(got.dtype).astype(np.float64)
            hi = (exact + bound).astype(np.float32).astype(got.dtype).astype(np.float64)
            ok = (lo <= c) & (c <= hi)
        ok |= ~finite
        if not ok.all():
            i = tuple(int(v) for v in np.argwhere(~ok)[0])
            raise AssertionError(
                f"{where.header()}: {int((~ok).sum())} of {ok.size} elements outside the accumulation bound; "
                f"index {i}: torch {c[i]!r}, exact sum {exact[i]!r}, bound {bound[i]!r}\n{where.footer()}")
        k = a_pre.shape[1]
        gamma_t = (k * 2.0**-24 / (1 - k * 2.0**-24)) * (np.abs(a_pre.astype(np.float64)) @ np.abs(b_pre.astype(np.float64)))
        share = np.where(finite & (gamma_t > 0), np.abs(c - exact) / np.where(gamma_t > 0, gamma_t, 1), 0)
    return bool((got[finite] == rounded[finite]).all()), float(share.max()) if share.size else 0.0


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
@given(data=st.data())
def test_tensorwise_matmuls_are_within_the_accumulation_bound(dtype, data):
    case = data.draw(fs.linear_case(dtype, max_dim=32, specials=False))
    got = _run_linear(case, "tensorwise", bias=False)
    ops = fp8.linear_operands(case["x"], case["weight"], case["grad_output"], "tensorwise")
    got["grad_weight"] = got.pop("weight.grad").astype(dtype)  # exact: computed in grad_output's dtype
    # 3-d and 4-d activations: the matmuls multiply the flattened rows.
    got = {name: v.reshape(-1, v.shape[-1]) for name, v in got.items()}
    event(f"{case['x'].ndim}-d input")
    where = Where("fp8 tensorwise bound", field=f"{dtype}", repro=REPRO)
    worst = 0.0
    for name, (a, b) in ops.items():
        exact, share = _within_bound(got[name], fp8.prescale(a), fp8.prescale(b), where.at(f"{dtype} {name}"))
        event(f"{name}: {'bit-equal' if exact else 'not bit-equal'} to the correctly rounded sum")
        worst = max(worst, share)
    if dtype == F32:  # a bfloat16 result's own rounding dwarfs the float32 accumulation error
        target(worst, label="largest share of gamma_K * sum |a'||b'| used (float32)")


def test_the_bound_check_fails_outside_the_bound():
    """The bound test's own check: one float32 ULP beyond the bound of a long sum is refused."""
    a = np.full((1, 64), 1.0 + 2.0**-3, np.float32)
    b = np.full((64, 1), 1.0 + 2.0**-3, np.float32)
    exact = fp8.exact_sums(a, b)
    too_far = np.nextafter(np.float32(exact + fp8.accumulation_bound(a, b)), np.float32(np.inf)).reshape(1, 1)
    with pytest.raises(AssertionError, match="outside the accumulation bound"):
        _within_bound(too_far.astype(np.float32), a, b, Where("meta", field="bound"))
    _within_bound(exact.astype(np.float32), a, b, Where("meta", field="bound"))


# ----------------------------------------------------------------------------- torchimpl's layers

LAYER_RECIPES = RECIPES + ("mxfp8",)


def _torchimpl_layer(case: dict, recipe: str) -> torch.nn.Module:
    """One nn.Linear with the case's weight and bias, converted by torchimpl as a user's model."""
    from torchimpl.precision.fp8 import convert_to_fp8

    w = case["weight"]
    lin = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        lin.weight.copy_(to_torch(w))
        lin.bias.copy_(to_torch(case["bias"]))
    model, report = convert_to_fp8(torch.nn.Sequential(lin), recipe, "cpu", skip_first_last=False)
    assert report.converted == ("0",), f"torchimpl kept the layer in high precision: {report.kept}"
    return model


def _check_layer_settings(layer: torch.nn.Module, recipe: str, casts: list, case: dict, where: Where) -> None:
    """The converted layer is the spec's recipe: its configuration, or (MX) each cast it made."""
    if recipe != "mxfp8":
        got = fp8_layers.float8_recipe_of(layer, recipe)
        assert got == fp8.RECIPES[recipe], (f"{where.header()}: the converted layer is configured as {got}, "
                                            f"the spec's recipe is {fp8.RECIPES[recipe]}\n{where.footer()}")
        return
    spec = fp8.MX_RECIPES[recipe]
    mode = fp8_layers.mx_layer_mode(layer, recipe)
    assert mode == spec.mode, f"{where.header()}: torchimpl built the MX layer with {mode} scales, the recipe names {spec.mode}"
    k, n = case["weight"].shape[1], case["weight"].shape[0]
    shapes = fp8_layers.mx_cast_shapes(case["x"].size // k, k, n)
    assert [c.shape for c in casts] == shapes, f"{where.header()}: MX casts of shapes {[c.shape for c in casts]}, spec {shapes}"
    for i, c in enumerate(casts):
        assert c.recipe == spec, f"{where.header()}: MX cast {i} (shape {c.shape}) used {c.recipe}, the spec's recipe is {spec}"


def _layer_io(model: torch.nn.Module, x: np.ndarray, grad_output: np.ndarray) -> dict[str, np.ndarray]:
    xt = to_torch(x).requires_grad_()
    y = model(xt)
    y.backward(to_torch(grad_output))
    return {"output": to_numpy(y), "grad_input": to_numpy(xt.grad), "weight.grad": to_numpy(model[0].weight.grad)}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", LAYER_RECIPES)
@given(data=st.data())
def test_torchimpl_layers_follow_the_spec(recipe, dtype, data):
    """torchimpl's converted layer, as a user gets it, against rules 8-12 (torch's GEMM handed over).

    2-d, 3-d and 4-d activations: the layer flattens the leading axes to rows and its backward
    pairs row i of grad_output with row i of the input. The MX layer multiplies in its weight's
    dtype (torchimpl's pre-hook casts a bfloat16 input up, exactly; autograd casts grad_input
    back), so its rows must be a multiple of 32 (grad_weight blocks along them).
    """
    mx = recipe == "mxfp8"
    case = data.draw(fs.linear_case(dtype, min_dim=2, feature_multiple=32 if mx else 16, row_multiple=32 if mx else 1))
    event(f"{case['x'].ndim}-d input")
    model = _torchimpl_layer(case, recipe)
    where = Where("fp8 torchimpl layer", field=f"{recipe} {dtype} x{case['x'].shape}", repro=REPRO)
    go = case["grad_output"].astype(np.float32) if mx else case["grad_output"]
    with fp8_layers.recorded_mx_casts(recipe) as casts:
        got = _layer_io(model, case["x"], go)
    _check_layer_settings(model[0], recipe, casts, case, where)
    w, b = case["weight"], case["bias"]
    if mx:
        x = case["x"].astype(np.float32)
        y = fp8.mx_linear_forward(x, w, b, recipe, gemm=torch_gemm)
        g = fp8.mx_linear_backward(x, w, go, recipe, gemm=torch_gemm)
    else:
        y = fp8.linear_forward(case["x"], w, b, recipe, gemm=torch_gemm)
        g = fp8.linear_backward(case["x"], w, go, recipe, gemm=torch_gemm)
    assert_same(got["output"], y, where.at(where.field + " output"))
    assert_same(got["grad_input"], g.grad_input.astype(dtype), where.at(where.field + " grad_input"))
    assert_same(got["weight.grad"], g.grad_weight.astype(np.float32), where.at(where.field + " grad_weight"))


def _spec_layer(rec: dict, recipe: str) -> tuple[np.ndarray, fp8.LinearGrads]:
    if recipe == "mxfp8":
        return (fp8.mx_linear_forward(rec["x"], rec["weight"], rec["bias"], recipe, gemm=torch_gemm),
                fp8.mx_linear_backward(rec["x"], rec["weight"], rec["grad_output"], recipe, gemm=torch_gemm))
    return (fp8.linear_forward(rec["x"], rec["weight"], rec["bias"], recipe, gemm=torch_gemm),
            fp8.linear_backward(rec["x"], rec["weight"], rec["grad_output"], recipe, gemm=torch_gemm))


TRANSFORMER_STEPS = 3


@pytest.mark.parametrize("recipe", LAYER_RECIPES)
def test_float8_training_on_the_transformer_follows_the_spec(recipe):
    """The embedded transformer trained in float8 by the trainer, a few steps: each converted
    layer's (batch, sequence, features) forward and backward against the spec at every step.

    The layers get 3-d inputs (batch 32, 16 positions: 512 rows, a multiple of MX's 32) under
    the trainer's bf16 autocast, after torchimpl's pre-hook (bfloat16 for the float8 recipes,
    the weight's float32 for MX); the weights are the ones each step trained.
    """
    from torchimpl.config.schema import load_config
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Trainer

    cfg = load_config(overrides=["device=cpu", "task.name=lm", "train.batch_size=32", f"train.steps={TRANSFORMER_STEPS}",
                                 "train.log_interval=1", "precision.mode=fp8", f"precision.fp8_recipe={recipe}"])
    task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
    recorder = fp8_layers.LayerRecorder()
    summary = Trainer(cfg, [recorder]).fit(task.model, task.train_data, loss_fn=task.loss_fn)
    assert summary.steps_applied == TRANSFORMER_STEPS and len(recorder.steps) == TRANSFORMER_STEPS
    assert summary.fp8["converted"], "no layer of the transformer ran in float8"
    for step, layers in enumerate(recorder.steps, 1):
        assert sorted(layers) == sorted(summary.fp8["converted"]), f"step {step}: layers recorded {sorted(layers)}"
        for name, rec in layers.items():
            assert rec["x"].ndim == 3, f"step {step} {name}: input of shape {rec['x'].shape}, expected 3-d"
            where = Where("fp8 transformer training", step=step, field=f"{recipe} {name}",
                          repro=f"pytest conformance/test_fp8.py -k 'transformer and {recipe}'")
            y, g = _spec_layer(rec, recipe)
            assert_same(rec["output"], y, where.at(f"{where.field} output"))
            assert_same(rec["grad_input"], g.grad_input, where.at(f"{where.field} grad_input"))
            assert_same(rec["grad_weight"], g.grad_weight.astype(np.float32), where.at(f"{where.field} grad_weight"))


# ----------------------------------------------------------------------------- rule 12


def _mx_tensor(t: fp8.MXBlocks, orig_dtype: np.dtype) -> MXTensor:
    return MXTensor(to_torch(t.data), to_torch(t.scale), torch_dtype(t.data.dtype), t.block_size,
                    torch_dtype(orig_dtype), KernelPreference.EMULATED, None, False)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("elem", ["float8_e4m3fn", "float8_e5m2"])
@given(data=st.data())
def test_mx_dequantize_matches_torchao(elem, dtype, data):
    """Rule 12's dequantization over any block contents: every element byte (NaN encodings
    included), every scale byte (2^-127, the range's top, the NaN byte), zero blocks."""
    t = data.draw(fs.mx_blocks(elem))
    got = to_numpy(_mx_tensor(t, dtype).dequantize(torch_dtype(dtype)))
    event(f"scale bytes 0xff: {'some' if (t.scale.view(np.uint8) == 255).any() else 'none'}")
    assert_same(got, fp8.mx_dequantize(t, dtype), Where("fp8 MX dequantize", field=f"{elem} -> {dtype}", repro=REPRO))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("elem", ["float8_e4m3fn", "float8_e5m2"])
@given(data=st.data())
def test_mx_emulated_matmul_matches_torchao(elem, dtype, data):
    """Rule 12's matmul a @ b.T through torchao's MX dispatch (b transposed as the layers hand
    it): bit for bit given torch's GEMM, and for float32 within rule 7's bound of the exact sum
    of the spec's dequantized operands."""
    a, b = data.draw(fs.mx_matmul_case(elem))
    got = to_numpy(torch.mm(_mx_tensor(a, dtype), _mx_tensor(b, dtype).t()))
    where = Where("fp8 MX matmul", field=f"{elem} {dtype} {a.data.shape} @ {b.data.shape}.T", repro=REPRO)
    assert_same(got, fp8.mx_mm(a, b, dtype, gemm=torch_gemm), where)
    a_hp, b_hp = fp8.mx_dequantize(a, dtype), fp8.mx_dequantize(b, dtype).T
    with np.errstate(invalid="ignore", over="ignore"):
        magnitudes = np.abs(a_hp.astype(np.float64)) @ np.abs(b_hp.astype(np.float64))
    # Where no partial sum in any order can reach float32's range (every |partial| is at most
    # sum |a||b|), the order-free bound applies; beyond it an order may give inf - inf = NaN.
    no_overflow = bool(np.isfinite(magnitudes).all() and magnitudes.max(initial=0) < 2.0**127)
    if dtype == F32:  # a bfloat16 GEMM's own rounding is not rule 7's float32 bound
        event(f"float32 MX matmul bound checked: {no_overflow}")
    if dtype == F32 and no_overflow:
        _within_bound(got, a_hp, b_hp, where.at(where.field + " bound"))


# ----------------------------------------------------------------------------- compile, versions


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise"])
def test_compiled_equals_eager(recipe):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w = rng.standard_normal((32, 32)).astype(np.float32) * 0.1
    eager = _float8_linear({"weight": w, "bias": np.zeros(32, np.float32)}, recipe, bias=True)
    compiled_model = _float8_linear({"weight": w, "bias": np.zeros(32, np.float32)}, recipe, bias=True)
    compiled = torch.compile(compiled_model)
    out = {}
    for name, model, params in (("eager", eager, eager), ("compiled", compiled, compiled_model)):
        xt = torch.from_numpy(x).requires_grad_()
        y = model(xt)
        y.pow(2).sum().backward()
        out[name] = [to_numpy(y), to_numpy(xt.grad), to_numpy(params[0].weight.grad)]
    where = Where("fp8 compile", field=recipe, repro="pytest conformance/test_fp8.py -k compiled --runslow")
    for i, field in enumerate(("output", "grad_input", "weight.grad")):
        assert_same(out["compiled"][i], out["eager"][i], where.at(f"{recipe} {field}"))


def test_torchao_internals_are_the_keyed_ones():
    version = expectations.torchao_version()
    probed = expectations.probe_torchao_internals()
    keyed = expectations.TORCHAO_KEYED.get(version)
    assert keyed is not None, (
        f"torchao {version} is not keyed in conformance/expectations.py (keyed: {list(expectations.TORCHAO_KEYED)}); "
        f"it probes as {probed}. If the fp8 properties pass with it, key it there; reference.fp8 states "
        f"{sorted(expectations.TORCHAO_KEYED)[-1]}'s internals")
    differ = {k: (probed[k], keyed[k]) for k in keyed if probed.get(k) != keyed[k]}
    assert not differ, f"torchao {version} differs from its keyed internals (probed, keyed): {differ}"
