"""Every Hypothesis strategy of the conformance suite, in one place.

Narrow-dtype values are drawn as integer bit patterns and viewed as the dtype, so both sides get
the same bits: Hypothesis cannot draw ml_dtypes dtypes, and drawing floats then casting would hide
ties. Subnormals are never switched off: loss scaling lives there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as nps

from torchimpl.train import optim as ti_optim

FLT_MAX = float(np.finfo(np.float32).max)

# Gradient dtypes that torch.amp.GradScaler.unscale_ accepts (fp16 grads are refused by design).
GRAD_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))


def bit_patterns(dtype: np.dtype | type, shape: int | tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    """Arrays of ``dtype`` whose elements are arbitrary bit patterns (every NaN, inf, subnormal)."""
    dtype = np.dtype(dtype)
    uint = np.dtype(f"uint{8 * dtype.itemsize}")
    return nps.arrays(uint, shape).map(lambda a: a.view(dtype))


def special_float32() -> st.SearchStrategy[float]:
    """float32 values where casts go wrong: ties, the maxima, overflow, tiny subnormals, ±0, ±inf, NaN."""
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), FLT_MAX, -FLT_MAX, 2.0**-149, -(2.0**-149),
                2.0**-126, 65504.0, 65520.0, 65519.996, 448.0, 464.0, 465.0, 57344.0, 61440.0, 240.0, 248.0,
                1.0 + 2.0**-8, 1.0 + 2.0**-11, 2.0**-24, 2.0**-25, 3.0 * 2.0**-26]
    return st.one_of(st.sampled_from(specials), st.floats(width=32, allow_nan=True, allow_infinity=True))


def float32_neighbourhoods(size: int = 64) -> st.SearchStrategy[np.ndarray]:
    """float32 arrays built from a few centres and their bitwise neighbours (±k ULP)."""

    @st.composite
    def build(draw) -> np.ndarray:
        centres = draw(st.lists(special_float32(), min_size=1, max_size=6))
        offsets = draw(st.lists(st.integers(-3, 3), min_size=1, max_size=7))
        bits = np.array(centres, np.float32).view(np.int32).astype(np.int64)
        around = (bits[:, None] + np.array(offsets, np.int64)[None, :]).ravel()
        around = np.clip(around, np.iinfo(np.int32).min, np.iinfo(np.int32).max).astype(np.int32)
        extra = draw(nps.arrays(np.float32, st.integers(0, size), elements=st.floats(width=32)))
        return np.concatenate([around.view(np.float32), extra])

    return build()


def scales() -> st.SearchStrategy[float]:
    """Loss scales: powers of two, arbitrary positive floats, near FLT_MAX and near zero."""
    return st.one_of(
        st.integers(-30, 127).map(lambda k: 2.0**k),
        st.floats(min_value=2.0**-20, max_value=2.0**40, allow_nan=False, allow_infinity=False),
        st.sampled_from([FLT_MAX, float(np.float32(3e38)), 2.0**-126, 2.0**-149, 1.0]),
    )


@st.composite
def scaler_params(draw) -> dict:
    """Keyword arguments of a loss scaler: torch's defaults and odd but valid corners."""
    return dict(
        init_scale=float(np.float32(draw(scales()))),
        growth_factor=draw(st.one_of(st.just(2.0), st.floats(min_value=1.0001, max_value=8.0))),
        backoff_factor=draw(st.one_of(st.just(0.5), st.floats(min_value=0.01, max_value=0.9999))),
        growth_interval=draw(st.integers(1, 6)),
    )


@st.composite
def gradient(draw, dtype: np.dtype, shape: tuple[int, ...], magnitude: float, plant_prob: float) -> np.ndarray:
    """One gradient of ``dtype`` with values around ``magnitude`` and, sometimes, planted inf/NaN."""
    n = int(np.prod(shape))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n) * magnitude
    if n and draw(st.floats(0, 1)) < plant_prob:
        where = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3))
        for i in where:
            values[i] = draw(st.sampled_from([np.inf, -np.inf, np.nan]))
    return values.astype(np.float32).astype(dtype).reshape(shape)


@st.composite
def gradient_tree(draw, dtypes=GRAD_DTYPES, max_tensors: int = 5, plant_prob: float = 0.3) -> list[np.ndarray]:
    """A list of gradients of mixed shapes (zero-size included) and dtypes."""
    count = draw(st.integers(0, max_tensors))
    magnitude = draw(st.sampled_from([1e-30, 1e-8, 1e-3, 1.0, 1e3, 1e30]))
    grads = []
    for _ in range(count):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=2)))
        dtype = np.dtype(draw(st.sampled_from(dtypes)))
        grads.append(draw(gradient(dtype, shape, magnitude, plant_prob)))
    return grads


def inf_pattern(steps: int) -> st.SearchStrategy[list[bool]]:
    """Which of ``steps`` consecutive steps see a non-finite gradient."""
    return st.lists(st.booleans(), min_size=steps, max_size=steps)


# --- Clipping and optimizers -------------------------------------------------------------------

# Every gradient dtype clip_grad_norm_ accepts (it has no fp16 restriction, unlike unscale_).
CLIP_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float64))

# Gradient magnitudes for clipping: tiny (float32 squares underflow to 0), small, unit, large, huge
# (float32 squares overflow). None of them puts float32 squares in the subnormal range, where a
# fused multiply-add changes a norm by far more than an ULP (see expectations.NORM_ULP).
CLIP_MAGNITUDES = (1e-30, 1e-8, 1e-3, 1.0, 1e3, 1e30)


@st.composite
def clip_case(draw, norm_types=(2.0, float("inf"))) -> dict:
    """Gradients for clip_grad_norm_: mixed dtypes, sizes that exercise the 8-lane body, the
    tail and zero size, per-tensor magnitudes, sometimes inf/NaN; a norm type and a max_norm."""
    count = draw(st.integers(0, 7))
    grads = []
    for _ in range(count):
        size = draw(st.one_of(st.integers(0, 20), st.integers(21, 2500)))
        dtype = np.dtype(draw(st.sampled_from(CLIP_DTYPES)))
        magnitude = draw(st.sampled_from(CLIP_MAGNITUDES))
        with np.errstate(over="ignore"):  # 1e30 in float16/bfloat16 is meant to overflow
            grads.append(draw(gradient(dtype, (size,), magnitude, plant_prob=0.1)))
    max_norm = draw(st.one_of(st.sampled_from([0.0, 1e-6, 1.0, 1e3, float("inf")]),
                              st.floats(min_value=1e-3, max_value=10.0)))
    return dict(grads=grads, norm_type=draw(st.sampled_from(norm_types)), max_norm=max_norm)


@st.composite
def given_total_clip_case(draw) -> dict:
    """clip_case's gradients with a total norm computed by anyone: any bit pattern of a float16,
    bfloat16, float32 or float64 scalar (inf, NaN, 0, subnormal, negative included)."""
    case = draw(clip_case(norm_types=(2.0,)))
    dtype = draw(st.sampled_from(CLIP_DTYPES))
    case["total_norm"] = draw(bit_patterns(dtype, ()))
    return case


@st.composite
def clip_value_case(draw) -> dict:
    """Gradients for clip_grad_value_ (at least one: see expectations) and a clip value, some
    larger than float16's maximum."""
    with np.errstate(over="ignore"):
        grads = draw(gradient_tree(dtypes=CLIP_DTYPES, max_tensors=4, plant_prob=0.4).filter(bool))
    clip_value = draw(st.one_of(st.sampled_from([0.0, 2.0**-149, 0.5, 1.0, 65504.0, 1e5, float("inf")]),
                                st.floats(min_value=0.0, max_value=1e3)))
    return dict(grads=grads, clip_value=clip_value)


@st.composite
def sgd_config(draw) -> dict:
    """torch.optim.SGD keyword arguments: momentum, dampening, Nesterov, weight decay, maximize."""
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9]))
    nesterov = momentum > 0 and draw(st.booleans())
    return dict(lr=draw(st.floats(1e-4, 1.0)), momentum=momentum,
                dampening=0.0 if nesterov else draw(st.sampled_from([0.0, 0.1, 0.5])),
                nesterov=nesterov, weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.5])),
                maximize=draw(st.booleans()))


@st.composite
def adam_config(draw) -> dict:
    """torch.optim.Adam/AdamW keyword arguments: betas, eps, weight decay, AMSGrad, maximize."""
    return dict(lr=draw(st.floats(1e-5, 0.5)),
                betas=(draw(st.sampled_from([0.9, 0.5, 0.0])), draw(st.sampled_from([0.999, 0.9, 0.5]))),
                eps=draw(st.sampled_from([1e-8, 1e-3, 0.0])), weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.5])),
                amsgrad=draw(st.booleans()), maximize=draw(st.booleans()))


@st.composite
def adagrad_config(draw) -> dict:
    """torch.optim.Adagrad keyword arguments: lr decay, weight decay, initial accumulator, eps, maximize."""
    return dict(lr=draw(st.floats(1e-4, 1.0)), lr_decay=draw(st.sampled_from([0.0, 1e-2, 0.5])),
                weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.5])),
                initial_accumulator_value=draw(st.sampled_from([0.0, 0.1, 1.0])),
                eps=draw(st.sampled_from([1e-10, 1e-3, 0.0])), maximize=draw(st.booleans()))


@st.composite
def rmsprop_config(draw) -> dict:
    """torch.optim.RMSprop keyword arguments: alpha, eps, weight decay, momentum, centered, maximize."""
    return dict(lr=draw(st.floats(1e-4, 1.0)), alpha=draw(st.sampled_from([0.99, 0.9, 0.5, 0.0])),
                eps=draw(st.sampled_from([1e-8, 1e-3, 0.0])), weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.5])),
                momentum=draw(st.sampled_from([0.0, 0.5, 0.9])), centered=draw(st.booleans()),
                maximize=draw(st.booleans()))


@st.composite
def adamax_config(draw) -> dict:
    """torch.optim.Adamax keyword arguments: betas, eps, weight decay, maximize."""
    return dict(lr=draw(st.floats(1e-5, 0.5)),
                betas=(draw(st.sampled_from([0.9, 0.5, 0.0])), draw(st.sampled_from([0.999, 0.9, 0.5]))),
                eps=draw(st.sampled_from([1e-8, 1e-3, 0.0])), weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.5])),
                maximize=draw(st.booleans()))


@st.composite
def adadelta_config(draw) -> dict:
    """torch.optim.Adadelta keyword arguments: rho, eps, weight decay, maximize."""
    return dict(lr=draw(st.floats(1e-3, 1.0)), rho=draw(st.sampled_from([0.9, 0.5, 0.0, 1.0])),
                eps=draw(st.sampled_from([1e-6, 1e-3, 0.0])), weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.5])),
                maximize=draw(st.booleans()))


@st.composite
def nadam_config(draw) -> dict:
    """torch.optim.NAdam keyword arguments: betas, eps, (decoupled) weight decay, momentum decay, maximize."""
    return dict(lr=draw(st.floats(1e-5, 0.5)),
                betas=(draw(st.sampled_from([0.9, 0.5, 0.0])), draw(st.sampled_from([0.999, 0.9, 0.5]))),
                eps=draw(st.sampled_from([1e-8, 1e-3, 0.0])), weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.5])),
                momentum_decay=draw(st.sampled_from([4e-3, 0.0, 0.5])),
                decoupled_weight_decay=draw(st.booleans()), maximize=draw(st.booleans()))


@st.composite
def radam_config(draw) -> dict:
    """torch.optim.RAdam keyword arguments: betas (some rectify from step 2, some after many steps,
    some never), eps, (decoupled) weight decay, maximize. Large rates often: the rectified update
    is a product of small factors, which a small rate would leave below the parameter's ULP."""
    return dict(lr=draw(st.one_of(st.sampled_from([0.5, 0.1]), st.floats(1e-5, 0.5))),
                betas=(draw(st.sampled_from([0.9, 0.5, 0.0])), draw(st.sampled_from([0.999, 0.9, 0.5, 0.1]))),
                eps=draw(st.sampled_from([1e-8, 1e-3, 0.0])), weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.5])),
                decoupled_weight_decay=draw(st.booleans()), maximize=draw(st.booleans()))


@st.composite
def adafactor_config(draw) -> dict:
    """torch.optim.Adafactor keyword arguments: beta2 decay (0: the moment is the latest square),
    eps1 (None: the dtype's epsilon; 0: a zero gradient's root is 0 and its update NaN), eps2
    (the floor of the parameter's RMS), the clipping threshold d (1 clips most first steps, 1e3
    none), decoupled weight decay, maximize. Rates above 1/sqrt(step) are capped by it."""
    return dict(lr=draw(st.one_of(st.sampled_from([1e-2, 0.5]), st.floats(1e-5, 1.0))),
                beta2_decay=draw(st.sampled_from([-0.8, -0.5, 0.0, -1.0])),
                eps=(draw(st.sampled_from([None, 1e-30, 1e-3, 0.0])), draw(st.sampled_from([1e-3, 0.0, 1.0]))),
                d=draw(st.sampled_from([1.0, 1.5, 1e3])), weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.5])),
                maximize=draw(st.booleans()))


@st.composite
def optimizer_trajectory(draw, plant_nonfinite: bool = False, zero_d: bool = False,
                         dtypes: tuple[np.dtype, ...] = (np.dtype(np.float32),), min_ndim: int = 0,
                         steps: tuple[int, int] = (1, 6), zero_d_first: bool = False, min_dim_size: int = 0) -> dict:
    """Initial parameters of one of ``dtypes`` and the gradients recorded for each step (None: no
    gradient that step). With ``plant_nonfinite`` some steps carry inf/NaN, as loss-scaled
    gradients do; with ``zero_d`` parameters may be 0-d (where 0-d tensor hyperparameters
    promote), with ``zero_d_first`` the first one is, beside up to two others; ``min_ndim`` is
    the fewest dimensions a parameter has (Adafactor factors matrices); ``steps``: the range of
    the number of steps; ``min_dim_size``: the smallest size of a dimension (the compiled
    properties, whose every example compiles, draw no empty tensors)."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    dims = st.lists(st.integers(min_dim_size, 33), min_size=max(min_ndim, 0 if zero_d else 1), max_size=max(2, min_ndim)).map(tuple)
    shapes = draw(st.lists(st.one_of(st.just(()), dims) if zero_d else dims, min_size=1, max_size=3))
    if zero_d_first:
        shapes = [()] + shapes[:2]
    param_magnitude = draw(st.sampled_from([1e-3, 1.0, 10.0]))
    grad_magnitude = draw(st.sampled_from([1e-6, 1e-2, 1.0, 1e2]))
    params = [draw(gradient(dtype, s, param_magnitude, plant_prob=0.0)) for s in shapes]
    grads = []
    for _ in range(draw(st.integers(*steps))):
        # The first parameter always has one: GradScaler.step refuses a step without any.
        grads.append([None if i > 0 and draw(st.integers(0, 9)) == 0 else
                      draw(gradient(dtype, s, grad_magnitude, plant_prob=0.3 if plant_nonfinite else 0.0))
                      for i, s in enumerate(shapes)])
    return dict(params=params, grads=grads)


@st.composite
def joined_trajectory(draw, dtypes: tuple[np.dtype, ...] = (np.dtype(np.float32),)) -> dict:
    """A trajectory (as `optimizer_trajectory`'s) for stepping parameters joined end to end: two to
    four of them (0-d, 1-D and 2-D, sizes that leave a vectorized loop's tail, so that joining moves
    tail elements into a head), every gradient given (the states stay at one step count) except,
    sometimes, one step's; about half the gradients' elements zeros of either sign, where rule 4's
    vectorized head and scalar tail of a lerp at weight 1 give different signs."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    shapes = draw(st.lists(st.one_of(st.just(()), st.tuples(st.integers(1, 40)),
                                     st.tuples(st.integers(1, 9), st.integers(1, 9))), min_size=2, max_size=4))
    params = [draw(gradient(dtype, s, draw(st.sampled_from([1e-3, 1.0])), plant_prob=0.0)) for s in shapes]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    missing = draw(st.one_of(st.none(), st.tuples(st.integers(0, 5), st.integers(0, len(shapes) - 1))))
    grads = []
    for k in range(draw(st.integers(2, 6))):
        step = []
        for i, s in enumerate(shapes):
            g = draw(gradient(dtype, s, 1.0, plant_prob=0.0))
            zeros = np.copysign(np.zeros(s), rng.standard_normal(s)).astype(dtype)
            step.append(None if missing == (k, i) else np.where(rng.random(s) < 0.5, zeros, g))
        grads.append(step)
    return dict(params=params, grads=grads)


@dataclass(frozen=True)
class OptimizerCase:
    """The conformance row of one registered optimizer (by its spec row's name): torch's class,
    the strategy of its keyword arguments, the implementations where torch takes a tensor lr
    and the spec models it, the fewest dimensions a parameter must have, and the bounds."""

    torch_class: type
    config: Callable[[], st.SearchStrategy[dict]]
    tensor_lr: tuple[str, ...] = ()
    tensor_lr_gap: tuple[str, ...] = ()
    """Implementations where torch takes a tensor lr that the spec does not model yet (it refuses one)."""
    min_ndim: int = 0
    steps: tuple[int, int] = (1, 6)
    ulp: Mapping[str, int] | None = None
    """Bounds on native kernels per field; None (the rule): the spec row's ``native_ulp``."""


OPTIMIZER_CASES: dict[str, OptimizerCase] = {}


def optimizer_case(name: str, case: OptimizerCase) -> OptimizerCase:
    """Add the conformance row of the spec row ``name``."""
    OPTIMIZER_CASES[name] = case
    return case


# Where torch 2.13 takes a tensor lr on CPU: every path, except foreach Adam(W), which refuses it
# ("lr as a Tensor is not supported for capturable=False and foreach=True"; capturable needs CUDA).
EVERY_PATH, LOOPS = ("for-loop", "foreach", "fused"), ("for-loop", "foreach")
optimizer_case("SGD", OptimizerCase(torch.optim.SGD, sgd_config, EVERY_PATH))
optimizer_case("Adam", OptimizerCase(torch.optim.Adam, adam_config, ("for-loop", "fused")))
optimizer_case("AdamW", OptimizerCase(torch.optim.AdamW, adam_config, ("for-loop", "fused")))
optimizer_case("Adagrad", OptimizerCase(torch.optim.Adagrad, adagrad_config, EVERY_PATH))
optimizer_case("RMSprop", OptimizerCase(torch.optim.RMSprop, rmsprop_config, LOOPS))
optimizer_case("Adamax", OptimizerCase(torch.optim.Adamax, adamax_config, LOOPS))
optimizer_case("Adadelta", OptimizerCase(torch.optim.Adadelta, adadelta_config, LOOPS))
optimizer_case("NAdam", OptimizerCase(torch.optim.NAdam, nadam_config, LOOPS))
# RAdam rectifies from about step 6 whatever beta2 (rho_t is 1 at step 1): its trajectories go past it.
optimizer_case("RAdam", OptimizerCase(torch.optim.RAdam, radam_config, LOOPS, steps=(5, 9)))
optimizer_case("Adafactor", OptimizerCase(torch.optim.Adafactor, adafactor_config, tensor_lr_gap=LOOPS))


# ----------------------------------------------------------------------------- property 5: the trainer

# Loss scales for the end-to-end trainer property: torch's default, a non-power-of-two scale
# (unscaling by multiplying with the rounded inverse then differs from a true division), scales
# that underflow every gradient (2**-20, and 2**-140 whose inverse is inf in float32), and ones
# whose growth or whose scaled gradients overflow.
TRAINER_SCALES = (2.0**16, 3.0 * 2.0**10, 1.0, 2.0**-20, 2.0**-140, 2.0**100, 2.0**126)


@st.composite
def trainer_case(draw) -> dict:
    """One end-to-end training run: configuration, planted faults and an optional resume point.

    Keys: ``task`` (``mlp``/``lm``), ``precision`` (``fp32``, ``bf16`` autocast, ``fp16`` which
    the CPU runs in fp32 with a forced loss scaler), ``force_scaler``, ``steps``,
    ``microbatches``, ``sync_free`` (only with a fused optimizer), ``log_interval`` (records are
    read at log points), ``batches_per_epoch`` (small, so short last windows happen),
    ``clip_norm``, ``scaler`` (keyword arguments of ``torchimpl.train.scaler.ScalerConfig``),
    ``optimizer`` (of ``OptimizerConfig``: for-loop or fused, parameter groups with or without
    ``no_decay_bias_and_norm``), ``schedule`` (of ``ScheduleConfig``), ``faults`` (global microbatch
    index -> ``("data" | "hook" | "loss", value)``), ``resume`` (``None``, ``("step", r)`` to save after
    step r, or ``("microbatch", r, j)`` to save after the j-th microbatch of step r), ``seed`` and
    ``user``: ``None`` (the configuration's optimizer and schedule), ``{"scheduler": None}`` (the
    user's own torch optimizer of the same settings, handed to ``fit``, at a constant rate) or
    ``{"scheduler": {"step_size": s, "gamma": g}}`` (and the user's ``StepLR``).
    """
    task = draw(st.sampled_from(["mlp", "lm"]))
    precision = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    force_scaler = True if precision == "fp16" else draw(st.booleans())
    steps = draw(st.integers(2, 5))
    microbatches = draw(st.integers(1, 3))
    preset = draw(st.sampled_from(["torch", "megatron", "deepspeed"]))
    init_scale = draw(st.sampled_from(TRAINER_SCALES))
    if preset != "torch":
        init_scale = max(init_scale, 1.0)  # their floor is 1.0
    scaler = dict(
        preset=preset,
        init_scale=init_scale,
        growth_factor=draw(st.sampled_from([2.0, 1.5, 2.0**64])),
        backoff_factor=draw(st.sampled_from([0.5, 0.25, 0.7])),
        growth_interval=draw(st.integers(1, 3)),
    )
    if preset == "torch" and draw(st.booleans()):
        scaler["hysteresis"] = 2  # the torch preset through the extended update
    name = draw(st.sampled_from(list(ti_optim.REGISTRY)))
    # One draw for the optimizer call, so that each of the three modes gets its share (the fused
    # ones where torch has a fused kernel for this optimizer on the CPU).
    fusable = "cpu" in ti_optim.REGISTRY[name].fused_devices
    mode = draw(st.sampled_from(["for-loop", "fused", "sync-free"] if fusable else ["for-loop"]))
    fused = mode != "for-loop"
    optimizer = dict(name=name, lr=draw(st.sampled_from([1e-3, 0.01, 0.1])),
                     weight_decay=draw(st.sampled_from([0.0, 0.01, 0.5])), fused=fused,
                     no_decay_bias_and_norm=draw(st.booleans()))
    if "momentum" in ti_optim.REGISTRY[name].settings:
        momentum = draw(st.sampled_from([0.0, 0.9]))
        optimizer.update(momentum=momentum)
        if "nesterov" in ti_optim.REGISTRY[name].settings:
            optimizer.update(nesterov=momentum > 0 and draw(st.booleans()))
    schedule = dict(
        name=draw(st.sampled_from(["constant", "cosine"])),
        warmup_steps=draw(st.integers(0, 2)),
        min_lr_ratio=draw(st.sampled_from([0.0, 0.1, 0.5])),
        decay_steps=draw(st.one_of(st.none(), st.integers(1, 6))),
    )
    total_mb = steps * microbatches
    fault_at = draw(st.lists(st.integers(0, total_mb - 1), max_size=2, unique=True))
    # "loss": a non-finite constant added to the loss (finite gradients)
    kinds = ["hook", "data", "loss"] if task == "mlp" else ["hook", "loss"]  # token ids cannot hold an inf
    faults = {i: (draw(st.sampled_from(kinds)), draw(st.sampled_from([float("inf"), float("-inf"), float("nan")])))
              for i in fault_at}
    resume = draw(st.one_of(
        st.none(),
        st.integers(1, steps - 1).map(lambda r: ("step", r)),
        st.tuples(st.just("microbatch"), st.integers(0, steps - 1), st.integers(1, 2)),
    ))
    return dict(
        task=task, precision=precision, force_scaler=force_scaler, steps=steps, microbatches=microbatches,
        sync_free=mode == "sync-free", log_interval=draw(st.integers(1, 3)),
        batches_per_epoch=draw(st.integers(2, 7)),
        clip_norm=draw(st.one_of(st.none(), st.sampled_from([0.05, 1.0]), st.floats(0.01, 10.0))),
        scaler=scaler, optimizer=optimizer, schedule=schedule, faults=faults, resume=resume,
        seed=draw(st.integers(0, 3)), user=draw(user_optimizer()),
    )


def user_optimizer() -> st.SearchStrategy:
    """Whether a trainer case hands ``fit`` its own optimizer, and its own StepLR (about half of
    the cases keep the configuration's)."""
    step_lr = st.fixed_dictionaries({"step_size": st.integers(1, 2), "gamma": st.sampled_from([0.5, 0.7, 0.1])})
    return st.one_of(st.none(), st.fixed_dictionaries({"scheduler": st.one_of(st.none(), step_lr)}))


# --- Reaching the rounding: scales, thresholds, 0-d tensors, lifecycles ------------------------

# Every gradient/loss dtype, for the properties that drive torch's kernels directly (the unscale
# kernel accepts float16, which only GradScaler.unscale_ refuses).
ALL_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64))

# found_inf values the update kernel may meet: torch's own flags (0, 1, and sums of several
# optimizers' flags) and the values its rule still decides (NaN counts as found, so do negatives).
FOUND_INF_VALUES = (0.0, -0.0, 1.0, 2.0, 3.0, 0.5, -1.0, float("nan"), float("inf"))


def growth_factors() -> st.SearchStrategy[float]:
    """Growth factors where f32(f64(S) * g) and f32(S) * f32(g) part: most that are not a power
    of two, whose float64 value is not a float32 one."""
    return st.one_of(st.just(2.0), st.floats(min_value=1.0 + 2.0**-20, max_value=8.0), st.sampled_from([1.1, 3.0, 2.0**64]))


def backoff_factors() -> st.SearchStrategy[float]:
    """Backoff factors, powers of two and others (0.1 is not a float32 value)."""
    return st.one_of(st.just(0.5), st.floats(min_value=2.0**-20, max_value=1.0 - 2.0**-20), st.sampled_from([0.1, 0.7]))


def unrounded_scales() -> st.SearchStrategy[float]:
    """Initial scales as a user gives them: often not float32 values (torch keeps them unrounded
    until the first scale()), but positive and finite in float32."""
    return st.one_of(scales(), st.floats(min_value=2.0**-126, max_value=3e38), st.sampled_from([0.1, 1e-3, 65535.5, 1e38]))


def float32_bits_scalar() -> st.SearchStrategy[np.float32]:
    """Any float32: every NaN, inf, zero, subnormal and normal, as bits."""
    return st.integers(0, 2**32 - 1).map(lambda b: np.array([b], np.uint32).view(np.float32)[0])


@st.composite
def loss_case(draw) -> dict:
    """A loss of any dtype, 0-d or not, as bits, and a loss scale (often not a power of two)."""
    dtype = np.dtype(draw(st.sampled_from(ALL_FLOAT_DTYPES)))
    shape = draw(st.sampled_from([(), (1,), (3,)]))
    return dict(loss=draw(bit_patterns(dtype, shape)), scale=float(np.float32(draw(scales()))))


@st.composite
def update_kernel_case(draw) -> dict:
    """Arguments of torch._amp_update_scale_: any float32 scale, trackers below, at and past the
    interval, every found_inf value, factors where the rounding order matters."""
    interval = draw(st.integers(1, 4))
    return dict(scale=draw(st.one_of(float32_bits_scalar(), st.sampled_from([np.float32(FLT_MAX), np.float32(3e38),
                                                                            np.float32(2.0**-149), np.float32(1.0)]))),
                tracker=draw(st.integers(0, interval + 2)), found_inf=draw(st.sampled_from(FOUND_INF_VALUES)),
                growth_factor=draw(growth_factors()), backoff_factor=draw(backoff_factors()), growth_interval=interval)


@st.composite
def unscale_kernel_case(draw) -> dict:
    """Arguments of torch._amp_foreach_non_finite_check_and_unscale_: gradients of every dtype
    (near float32's maximum too, so that an inverse above 1 overflows), some inf/NaN, scales
    below 1 included, and a flag that may already be set."""
    count = draw(st.integers(0, 4))
    magnitude = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30, 3e38]))
    grads = []
    for _ in range(count):
        dtype = np.dtype(draw(st.sampled_from(ALL_FLOAT_DTYPES)))
        shape = draw(st.sampled_from([(), (1,), (5,), (0,), (2, 3)]))
        with np.errstate(over="ignore"):
            grads.append(draw(gradient(dtype, shape, magnitude, plant_prob=0.3)))
    return dict(grads=grads, scale=float(np.float32(draw(scales()))), found_inf=draw(st.sampled_from([0.0, 1.0, 5.0])))


@st.composite
def rounding_scaler_params(draw) -> dict:
    """Scaler settings that reach the rounding: unrounded initial scales, factors that are not
    powers of two, intervals short enough that the scale really grows in a few steps."""
    return dict(init_scale=draw(unrounded_scales()), growth_factor=draw(growth_factors()),
                backoff_factor=draw(backoff_factors()), growth_interval=draw(st.integers(1, 3)))


# Events of a scaler's life: a clean or overflowing iteration, or something done to it between
# iterations (save and compare, load into a fresh or a used scaler, pickle, set a new scale).
LIFECYCLE_EVENTS = ("clean", "clean", "clean", "overflow", "overflow", "save", "load_fresh", "load_used",
                    "pickle", "new_scale")


@st.composite
def lifecycle(draw, max_events: int = 14, tamper: bool = True) -> list[tuple]:
    """A scaler's history: each event with what it needs. ``tamper``: loads may replace the
    saved scale by an unrounded one and the tracker by any count up to two past the interval."""
    events = []
    for _ in range(draw(st.integers(1, max_events))):
        kind = draw(st.sampled_from(LIFECYCLE_EVENTS))
        if kind in ("load_fresh", "load_used") and tamper and draw(st.booleans()):
            events.append((kind, draw(st.one_of(st.none(), unrounded_scales())), draw(st.integers(0, 5))))
        elif kind in ("load_fresh", "load_used"):
            events.append((kind, None, None))
        elif kind == "new_scale":
            events.append((kind, draw(unrounded_scales()), draw(st.booleans())))
        else:
            events.append((kind,))
    return events


# One optimizer's gradients for an iteration of the call-sequence property.
GRAD_PATTERNS = ("finite", "finite", "inf", "none", "fp16")
CALLS = ("scale", "unscale_", "step", "step", "step_closure", "update", "update", "update_new_scale", "grads")


@st.composite
def call_sequence(draw, optimizers: int = 2) -> list[tuple]:
    """Calls on a scaler shared by ``optimizers`` optimizers, in any order, valid or not."""
    calls = []
    for _ in range(draw(st.integers(1, 16))):
        name = draw(st.sampled_from(CALLS))
        if name in ("unscale_", "step", "step_closure"):
            calls.append((name, draw(st.integers(0, optimizers - 1))))
        elif name == "grads":
            calls.append((name, draw(st.integers(0, optimizers - 1)), draw(st.sampled_from(GRAD_PATTERNS))))
        elif name == "update_new_scale":
            calls.append((name, draw(unrounded_scales())))
        else:
            calls.append((name,))
    return calls


@st.composite
def float64_gradient(draw, shape: tuple[int, ...], magnitude: float) -> np.ndarray:
    """A float64 gradient with float64 values (``gradient`` goes through float32, which would
    turn magnitudes past 3e38 into inf)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return (rng.standard_normal(int(np.prod(shape))) * magnitude).reshape(shape)


@st.composite
def zero_d_clip_case(draw) -> dict:
    """clip_grad_norm_ with 0-d gradients of every dtype beside float64 ones (a float64 total and
    coefficient), magnitudes up to where the coefficient is subnormal or zero in float32, and
    thresholds that clip."""
    grads = []
    for _ in range(draw(st.integers(1, 4))):
        dtype = np.dtype(draw(st.sampled_from(CLIP_DTYPES)))
        with np.errstate(over="ignore"):
            grads.append(draw(gradient(dtype, (), draw(st.sampled_from([1e-3, 1.0, 1e3, 1e30])), plant_prob=0.05)))
    for _ in range(draw(st.integers(0, 3))):
        shape = draw(st.sampled_from([(), (1,), (4,), (9,)]))
        magnitude = draw(st.sampled_from([1.0, 1e10, 1e40, 1e100, 1e300]))
        grads.append(draw(float64_gradient(shape, magnitude)))
    order = draw(st.permutations(range(len(grads))))
    max_norm = draw(st.one_of(st.sampled_from([1e-6, 1.0, 0.3]), st.floats(min_value=1e-8, max_value=10.0)))
    return dict(grads=[grads[i] for i in order], norm_type=draw(st.sampled_from([2.0, float("inf")])), max_norm=max_norm)


@st.composite
def clipping_clip_case(draw) -> dict:
    """clip_case with a threshold that clips: max_norm a fraction (not a power of two) of the
    gradients' own total norm, so the coefficient's rounding reaches every gradient."""
    from reference import clipping

    case = draw(clip_case())
    if case["grads"] and not any(g.size == 0 for g in case["grads"]):
        with np.errstate(all="ignore"):
            total = float(clipping.total_norm(case["grads"], case["norm_type"]))
        if np.isfinite(total) and total > 0:
            case["max_norm"] = total * draw(st.floats(min_value=0.01, max_value=0.99))
    return case


# ---------------------------------------------------------------- precision health (reference.health)

HEALTH_FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
"""The formats the doctor judges activations, gradients and weights in."""


def _format_edges(fmt: str) -> np.ndarray:
    """float32 values at a format's edges and their float32 neighbours: max, the overflow tie
    (max + half the spacing at max), the smallest normal and subnormal, half the smallest subnormal."""
    fi = ml_dtypes.finfo(getattr(ml_dtypes, fmt) if fmt != "float16" else np.float16)
    top = float(fi.max)
    spacing = 2.0 ** (np.floor(np.log2(top)) - np.log2(1 / float(fi.eps)))
    centres = np.array([top, top + spacing / 2, float(fi.tiny), float(fi.smallest_subnormal),
                        float(fi.smallest_subnormal) / 2, 1.0], np.float64)
    c32 = centres.astype(np.float32)
    around = [c32, np.nextafter(c32, np.float32(np.inf)), np.nextafter(c32, np.float32(0))]
    edges = np.concatenate(around)
    return np.concatenate([edges, -edges])


@st.composite
def health_values(draw) -> dict:
    """float32 values around every format's edges (ties at max, half the smallest subnormal), times
    a magnitude, with a format and a scale: the inputs of the overflow/underflow/amax rules. The
    format's own edges are always included, divided by a power-of-two scale so that the scaled
    values land on them exactly."""
    fmt = draw(st.sampled_from(HEALTH_FORMATS))
    x = draw(float32_neighbourhoods(48))
    magnitude = draw(st.sampled_from([1.0, 1.0, 2.0**-20, 2.0**10, 3.0]))
    with np.errstate(over="ignore", invalid="ignore"):
        x = (x * np.float32(magnitude)).astype(np.float32)
    k = draw(st.one_of(st.just(0), st.integers(-20, 20)))
    power = 2.0**k
    with np.errstate(over="ignore", invalid="ignore"):
        edges = (_format_edges(fmt).astype(np.float64) / power).astype(np.float32)
    scale = draw(st.one_of(st.just(power), st.floats(2.0**-10, 2.0**10, allow_nan=False)))
    return {"x": np.concatenate([edges, x]), "fmt": fmt, "scale": scale}


def _log_spread(draw, size: st.SearchStrategy[int], low: int, high: int) -> np.ndarray:
    """float32 values m * 2^k spread over binades low..high, exact powers of two among them."""
    exps = draw(nps.arrays(np.int32, size, elements=st.integers(low, high)))
    mant = draw(nps.arrays(np.float64, exps.shape, elements=st.sampled_from(
        [0.5, 0.75, 0.5000001, 0.999, -0.5, -0.9, 0.0])))
    return np.ldexp(mant, exps).astype(np.float32)


@st.composite
def shadow_pair(draw) -> dict:
    """An fp32 shadow's tensor and the mixed run's same tensor: the shadow rounded to a format
    (so values flush, overflow and differ by rounding), with a few entries planted to ±0. The
    values span float32's subnormals to beyond float16's max, powers of two included, and the
    format's own edges (its smallest normal and subnormal, max and the overflow tie) always."""
    fmt = draw(st.sampled_from(HEALTH_FORMATS[:2]))
    ref = _log_spread(draw, st.integers(1, 64), -150, 17)
    noise = draw(nps.arrays(np.float32, ref.shape, elements=st.floats(-1e5, 1e5, width=32)))
    ref = np.concatenate([_format_edges(fmt), ref, noise]).astype(np.float32)
    from reference.formats import cast

    obs = cast(ref, fmt).astype(np.float32)
    zero = draw(nps.arrays(np.bool_, ref.shape))
    obs = np.where(zero, np.float32(0), obs)
    return {"reference": ref, "observed": obs, "fmt": fmt}


_MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23, "float8_e4m3fn": 3}


@st.composite
def weight_update(draw) -> dict:
    """Stored weights (arbitrary bit patterns of a format, many cut to exact powers of two) and
    updates at and around a quarter, a half and one of the exact gap above them, in either
    direction: the ties and the halved gap below a power of two of the half-ULP rule."""
    fmt = draw(st.sampled_from(tuple(_MANTISSA_BITS)))
    dtype = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
             "float32": np.dtype(np.float32), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}[fmt]
    n = draw(st.integers(1, 40))
    w = draw(bit_patterns(dtype, n))
    uint = np.dtype(f"uint{8 * dtype.itemsize}")
    power = draw(nps.arrays(np.bool_, n))
    cut = ~np.array((1 << _MANTISSA_BITS[fmt]) - 1, dtype=uint)
    w = np.where(power, w.view(uint) & cut, w.view(uint)).astype(uint).view(dtype)
    factors = draw(nps.arrays(np.float64, n, elements=st.sampled_from(
        [0.0, 0.2, 0.25, 0.3, 0.49, 0.5, 0.51, 1.0, -0.2, -0.25, -0.3, -0.49, -0.5, -0.51, -1.0])))
    finfo = ml_dtypes.finfo(dtype)
    w64 = w.astype(np.float32).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        finite = np.where(np.isfinite(w64), np.abs(w64), 0.0)
        _, e = np.frexp(finite)
        gap = np.maximum(np.ldexp(1.0, e - 1 - _MANTISSA_BITS[fmt]), float(finfo.smallest_subnormal))
        u = (gap * factors).astype(np.float32)
    return {"weight": w, "update": u, "fmt": fmt}


@st.composite
def gradient_magnitudes(draw) -> dict:
    """Unscaled gradients spread over many binades, for the loss-scale range."""
    exps = draw(nps.arrays(np.int32, st.integers(1, 64), elements=st.integers(-60, 20)))
    mant = draw(nps.arrays(np.float32, exps.shape, elements=st.sampled_from([0.5, 0.75, 0.5000001, 0.999, -0.5, -0.9])))
    g = np.ldexp(mant.astype(np.float64), exps).astype(np.float32)
    return {"grad": g, "fmt": draw(st.sampled_from(("float16", "bfloat16"))),
            "keep": draw(st.sampled_from([0.999, 0.9, 0.5, 1.0]))}
