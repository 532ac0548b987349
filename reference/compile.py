"""What ``torch.compile`` (TorchInductor's C++ backend, on the CPU) may change, measured per torch version.

Rules:

1. No contraction. Inductor builds its C++ kernels with ``-ffp-contract=off``
   (``torch._inductor.config.cpp.enable_floating_point_contract_flag``) and emits no ``fma`` for
   pointwise arithmetic: every multiply, add and divide of a compiled kernel rounds on its own,
   as the spec's formulas do. Eager ATen's AVX2/AVX512 kernels contract some multiply-adds
   (``add`` with ``alpha``, ``addcmul``, ``lerp``), which is why eager needs the spec's native
   bounds (``native_ulp``) where compiled code often needs none.
2. Square roots. A compiled kernel's ``sqrt`` is the vector instruction (``Vectorized::sqrt``)
   or ``std::sqrt``: correctly rounded. The spec is called with ``sqrt=None`` for compiled steps,
   where eager's for-loop and foreach paths take MKL's faithful one (reference.optim rule 9).
3. Model under autocast: matrix products (``mm``, ``addmm``, ``bmm``) stay calls of ATen's own
   kernels, so their bits are eager's for the same inputs. A chain of pointwise operations that
   Inductor fuses computes in float32 and rounds to the autocast dtype once, where the kernel
   stores a value to memory (an input of a matrix product, a value saved for backward, an output
   of the graph): every rounding eager makes inside the chain is dropped (`dropped_rounding_envelope`
   bounds the difference; `matmul_envelope` carries it through a following matrix product). A
   chain of one operation rounds where eager does: its bits are eager's up to the float32 code
   of that operation, whose error is a few float32 ULPs of the operation's magnitude (for gelu
   ``|h|``: ``1 + erf`` cancels in the tail), visible after the rounding only where it straddles
   a rounding boundary.
4. ``emulate_precision_casts``: with ``torch._inductor.config.emulate_precision_casts = True``
   every low-precision operation rounds its output to its dtype where eager does. The forward
   pass is then bitwise eager's wherever the compiled float32 code of each operation is eager's
   (arithmetic, relu, sigmoid, tanh, silu measured); an operation whose float32 code differs
   (``FLOAT32_CODE_DIFFERS``: ``gelu``, whose ``1 + erf`` cancels in the tail) keeps rule 3's
   one-operation envelope, forward and backward. The backward pass is bitwise too, except where
   a compiled decomposition splits an eager kernel that computes in float32 inside and rounds
   once (``sigmoid_backward``, ``tanh_backward``): emulation then rounds after every piece
   (``EMULATE_BACKWARD_DIVERGES``, both low-precision dtypes).
5. Optimizer steps: ``torch.compile(optimizer.step)`` traces the same Python update (for-loop or
   foreach), but while compiling ``torch.optim``'s ``_get_value`` returns the step count as a
   tensor, so every step-dependent scalar (Adam's bias corrections, Adamax's, Adagrad's decayed
   lr, NAdam's momentum products, RAdam's rectification) is computed in float32 from
   hyperparameters rounded to float32 (``powf``, then a cancellation in ``1 - beta ** t``),
   where eager computes it in float64 from Python floats.
6. Per optimizer (`compiled_step_rule`): whether the compiled step equals the spec bit for bit,
   and if not, why. Where it does not, `compiled_step_ulp` bounds each field in ULPs of ``x_abs``
   (the row's ``magnitudes``): the row's native bound (any rounding order of the same formula:
   compiled code re-associates ``(1 - beta2) * g * g`` as ``(1 - beta2) * (g * g)``, divides by a
   reciprocal step size, and computes each lerp as a separate multiply and add) plus the float32 scalars' relative error
   (`scalar_relative_error`).
7. Graphs and recompiles (`expected_graphs`): a compiled ``optimizer.step`` captures one graph
   (SGD with momentum two: its first step, without a buffer, is a graph of its own) and no
   other, however ``GradScaler`` changes its scale (the scale reaches the step only through
   ``unscale_``, outside the graph) and whatever steps it skips (``optimizer.step`` is not
   called). Adafactor's step calls ``Tensor.item()``, a graph break while
   ``torch._dynamo.config.capture_scalar_outputs`` is False: it runs mostly eagerly, captures no
   graph at torch's defaults and two with foreach and ``maximize`` (the negated gradients and
   what follows the break compile, their reductions then in Inductor's order, 2 ULPs from
   eager's measured): its count is not stated, and its fields keep eager's native bound. A compiled model compiles once for fixed shapes and dtypes: the loss
   scale multiplies its output outside the graph.

Every rule is keyed by torch's "major.minor" (`compile_rules`); a version nobody measured is a
ValueError naming the measured ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["CompileRules", "CompiledStepRule", "EMULATE_BACKWARD_DIVERGES", "FLOAT32_CODE_DIFFERS", "MEASURED",
           "RECOMPILES", "compile_rules", "compiled_step_rule", "compiled_step_ulp", "dropped_rounding_envelope",
           "expected_graphs", "matmul_envelope", "scalar_relative_error"]

U32 = 2.0**-24  # unit roundoff of float32: a rounding moves a value by at most U32 of its magnitude


@dataclass(frozen=True)
class CompiledStepRule:
    """Rule 6 for one registry optimizer: ``bitwise``: the implementations whose compiled step
    equals the spec's (``sqrt=None``) bit for bit in every field; ``why``: what differs where it
    is not bitwise; ``scalar_fields``: the fields the float32 scalars of rule 5 reach;
    ``graphs``: the graphs a run captures (rule 7; `expected_graphs`; None: not stated, it
    depends on the configuration); ``eager``: the step runs mostly eagerly, so the spec is
    compared with eager's native bound and eager's square root."""

    name: str
    bitwise: frozenset[str]
    why: str
    scalar_fields: frozenset[str] = frozenset()
    graphs: int | None = 1
    eager: bool = False


@dataclass(frozen=True)
class CompileRules:
    """Everything measured on one torch version (rules 1-7)."""

    version: str
    fp_contract: str
    steps: Mapping[str, CompiledStepRule] = field(default_factory=dict)
    recompiles: Mapping[str, int] = field(default_factory=dict)
    emulate_backward_diverges: frozenset[tuple[str, str]] = frozenset()
    float32_code_differs: frozenset[str] = frozenset()


_SCALARS = "rule 5: step-dependent scalars in float32"
_STEPS_2_13 = {
    "SGD": CompiledStepRule("SGD", frozenset({"for-loop", "foreach"}),
                            "none: no step-dependent scalar, every operation rounded once (rule 1)", graphs=2),
    "Adagrad": CompiledStepRule("Adagrad", frozenset(),
                                "the for-loop's tensor clr divides the gradient by std/clr; " + _SCALARS,
                                frozenset({"param"})),
    "RMSprop": CompiledStepRule("RMSprop", frozenset(),
                                "square_avg re-associated ((1-alpha)*(g*g)); the addcdiv by a reciprocal"),
    "Adadelta": CompiledStepRule("Adadelta", frozenset(),
                                 "square_avg and acc_delta re-associated ((1-rho)*(x*x)); sqrt correctly rounded"),
    "Adam": CompiledStepRule("Adam", frozenset(), "exp_avg_sq re-associated; step size as a reciprocal; "
                             + _SCALARS + " (1 - beta^t: cancellation)", frozenset({"param"})),
    "AdamW": CompiledStepRule("AdamW", frozenset(), "as Adam", frozenset({"param"})),
    "Adamax": CompiledStepRule("Adamax", frozenset(), "clr = lr / (1 - beta1^t): " + _SCALARS,
                               frozenset({"param"})),
    "NAdam": CompiledStepRule("NAdam", frozenset(), "exp_avg_sq re-associated; " + _SCALARS
                              + " (mu, mu_product, 1 - beta2^t)", frozenset({"param", "mu_product"})),
    "RAdam": CompiledStepRule("RAdam", frozenset(), "exp_avg_sq re-associated; " + _SCALARS
                              + " (rho_t = rho_inf - 2t beta2^t/(1 - beta2^t) cancels)", frozenset({"param"})),
    "Adafactor": CompiledStepRule("Adafactor", frozenset(), "Tensor.item() breaks the graph (rule 7): the "
                                  "step runs mostly eagerly, the pieces around the break compile (their reductions "
                                  "in Inductor's order); eager's native bound and square root",
                                  graphs=None, eager=True),
}

RECOMPILES = {"model": 1}
FLOAT32_CODE_DIFFERS = frozenset({"gelu"})
EMULATE_BACKWARD_DIVERGES = frozenset((op, dtype) for op in ("sigmoid", "tanh") for dtype in ("bfloat16", "float16"))

MEASURED: dict[str, CompileRules] = {
    "2.13": CompileRules("2.13", "off", _STEPS_2_13, RECOMPILES, EMULATE_BACKWARD_DIVERGES, FLOAT32_CODE_DIFFERS),
}


def compile_rules(torch_version: str) -> CompileRules:
    """Rules 1-7 as measured on ``torch_version`` ("2.13", "2.13.0+cpu"); a ValueError for a
    version not measured, naming the measured ones."""
    parts = torch_version.split("+")[0].split(".")
    key = ".".join(parts[:2])
    if key not in MEASURED:
        raise ValueError(f"the compile rules are not measured on torch {torch_version}; measured: "
                         f"{', '.join(MEASURED)} (measure with conformance/test_compile.py, then key them here)")
    return MEASURED[key]


def compiled_step_rule(name: str, torch_version: str) -> CompiledStepRule:
    """Rule 6 for registry optimizer ``name``; a KeyError naming the known ones."""
    steps = compile_rules(torch_version).steps
    if name not in steps:
        raise KeyError(f"no compile rule for optimizer {name!r}; known: {', '.join(steps)}")
    return steps[name]


def expected_graphs(name: str, config: Any, steps_taken: int, torch_version: str) -> int:
    """Rule 7: the graphs a compiled ``optimizer.step`` has captured after ``steps_taken`` steps
    that ran (GradScaler's skipped steps do not count; nor do scale changes): the rule's
    ``graphs``, reached one per step (SGD without momentum keeps no buffer: one graph); a
    ValueError where the rule states no count (Adafactor)."""
    rule = compiled_step_rule(name, torch_version)
    graphs = rule.graphs
    if graphs is None:
        raise ValueError(f"the compile rules state no graph count for {name}: {rule.why}")
    if name == "SGD" and not getattr(config, "momentum", 0.0):
        graphs = 1
    return min(steps_taken, graphs)


# --- rule 5: a running error bound of the float32 scalar chain ----------------------------------


@dataclass(frozen=True)
class _R:
    """A float32 scalar of the compiled step: ``v`` the value eager computes (float64, from the
    exact hyperparameters), ``e`` a bound on |compiled float32 value - v|."""

    v: float
    e: float

    def _round(self, v: float, e: float) -> _R:
        return _R(v, e + U32 * (abs(v) + e))  # the float32 result rounds once

    def __add__(self, o: Any) -> _R:
        o = _const(o)
        return self._round(self.v + o.v, self.e + o.e)

    __radd__ = __add__

    def __sub__(self, o: Any) -> _R:
        o = _const(o)
        return self._round(self.v - o.v, self.e + o.e)

    def __rsub__(self, o: Any) -> _R:
        return _const(o) - self

    def __mul__(self, o: Any) -> _R:
        o = _const(o)
        return self._round(self.v * o.v, abs(self.v) * o.e + abs(o.v) * self.e + self.e * o.e)

    __rmul__ = __mul__

    def __truediv__(self, o: Any) -> _R:
        o = _const(o)
        if abs(o.v) <= o.e:
            return _R(self.v / o.v if o.v else math.inf, math.inf)  # the divisor's sign is undetermined
        return self._round(self.v / o.v, (self.e + abs(self.v / o.v) * o.e) / (abs(o.v) - o.e))

    def __rtruediv__(self, o: Any) -> _R:
        return _const(o) / self

    def sqrt(self) -> _R:
        low = max(self.v - self.e, 0.0)
        root = math.sqrt(self.v)
        return self._round(root, self.e / (root + math.sqrt(low)) if self.e else 0.0)


def _const(x: Any) -> _R:
    """A hyperparameter (a Python float) as compiled code holds it: rounded to float32."""
    if isinstance(x, _R):
        return x
    return _R(float(x), abs(float(np.float32(x)) - float(x)))


def _pow(base: float, t: float) -> _R:
    """``powf(float32(base), t)`` for an integer step t (exact in float32 below 2^24): the base's
    rounding raised to the t-th power, plus one ULP for a faithful ``powf`` (glibc's is < 1 ULP)."""
    b32 = float(np.float32(base))
    exact, computed = base**t, b32**t
    return _R(exact, abs(computed - exact) + 2 * U32 * abs(computed))


def _relative(r: _R) -> float:
    return r.e / abs(r.v) if r.v else (0.0 if r.e == 0 else math.inf)


def _adam_scalars(cfg: Any, t: float) -> dict[str, float]:
    b1, b2 = cfg.betas
    bc1, bc2 = 1 - _pow(b1, t), 1 - _pow(b2, t)
    # param: lr / bc1 multiplies m; sqrt(bc2) divides sqrt(v) in the denominator.
    return {"param": _relative(_const(cfg.lr) / bc1) + _relative(bc2.sqrt())}


def _adamax_scalars(cfg: Any, t: float) -> dict[str, float]:
    return {"param": _relative(_const(cfg.lr) / (1 - _pow(cfg.betas[0], t)))}


def _adagrad_scalars(cfg: Any, t: float) -> dict[str, float]:
    return {"param": _relative(_const(cfg.lr) / (1 + _R(t - 1, 0.0) * cfg.lr_decay))}


def _nadam_scalars(cfg: Any, t: float, mu_product: float) -> dict[str, float]:
    b1, b2 = cfg.betas
    psi = cfg.momentum_decay

    def mu(k: float) -> _R:
        decay = _pow(0.96, k * psi)  # the exponent k*psi is one more float32 rounding
        decay = _R(decay.v, decay.e + abs(math.log(0.96)) * k * psi * U32 * decay.v)
        return b1 * (1 - 0.5 * decay)

    mu_t, mu_next = mu(t), mu(t + 1)
    prod = _R(mu_product, 0.0) * mu_t  # the stored product was equal before the step (it is compared)
    grad_coef = _const(cfg.lr) * (1 - mu_t) / (1 - prod)
    avg_coef = _const(cfg.lr) * mu_next / (1 - prod * mu_next)
    bc2 = (1 - _pow(b2, t)).sqrt()
    return {"param": max(_relative(grad_coef), _relative(avg_coef)) + _relative(bc2), "mu_product": _relative(prod)}


def _radam_scalars(cfg: Any, t: float) -> dict[str, float]:
    b1, b2 = cfg.betas
    rho_inf = 2 / (1 - b2) - 1  # a Python float in both paths
    bc1, bc2 = 1 - _pow(b1, t), 1 - _pow(b2, t)
    rho_t = rho_inf - 2 * _R(t, 0.0) * _pow(b2, t) / bc2
    if abs(rho_t.v - 5.0) <= rho_t.e:
        return {"param": math.inf}  # the float32 rho_t may fall on the other side of 5: another branch
    step = _const(cfg.lr) / bc1
    if rho_t.v <= 5.0:
        return {"param": _relative(step)}
    rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)).sqrt()
    return {"param": _relative(step) + _relative(rect) + _relative(bc2.sqrt())}


_SCALAR_CHAINS: dict[str, Callable[..., dict[str, float]]] = {
    "Adam": _adam_scalars, "AdamW": _adam_scalars, "Adamax": _adamax_scalars, "Adagrad": _adagrad_scalars,
    "NAdam": _nadam_scalars, "RAdam": _radam_scalars,
}


def scalar_relative_error(name: str, config: Any, step: float, mu_product: float = 1.0) -> dict[str, float]:
    """Rule 5: per field, a bound on the relative error that computing the step's scalars in
    float32 brings into the update (0 for fields and optimizers without step-dependent scalars).

    Derivation: each scalar is followed through its formula as torch writes it, as a pair (value
    eager computes, bound on the float32 value's distance to it). Hyperparameters enter rounded
    to float32; ``powf(beta, t)`` carries the base's rounding to the t-th power plus 1 ULP (a
    faithful powf); every other float32 operation adds its rounding, ``U32`` of its magnitude, to
    the propagated bounds (``|a||db| + |b||da|`` for a product, ``(da + |a/b| db) / (|b| - db)``
    for a quotient, ``da / (sqrt(a) + sqrt(a - da))`` for a square root). A subtraction
    ``1 - beta^t`` keeps the absolute bound, so its relative bound grows by ``beta^t / (1 -
    beta^t)``: the cancellation that dominates Adam's first steps. Coefficients that multiply the
    update add their relative bounds; the field's error is at most that times the update's
    magnitude, which ``x_abs`` contains. ``step``: the count after the increment (1 on a first
    step). ``mu_product``: NAdam's stored product before the step. An infinite value: the bound is
    undetermined (RAdam's float32 rho_t within its error of 5 may take the other branch).
    """
    chain = _SCALAR_CHAINS.get(name)
    if chain is None:
        return {}
    t = float(step)
    return chain(config, t, mu_product) if name == "NAdam" else chain(config, t)


def compiled_step_ulp(name: str, field_name: str, native_ulp: int, config: Any, step: float,
                      mu_product: float = 1.0) -> float:
    """Rule 6: the bound, in ULPs of ``x_abs`` (float32), on |compiled step - spec step| for one
    field of registry optimizer ``name``, given the row's ``native_ulp[field_name]``.

    Derivation. Compiled and spec evaluate the same formula on the same inputs. (a) Elementwise
    roundings: each of the k float32 roundings on the field's longest path moves it by at most
    ``U32`` of an intermediate bounded by ``x_abs``, and an ULP of ``x_abs`` is at least ``U32 *
    x_abs``, so each path is within k ULPs of the exact value: 2k, the row's native bound, which
    counts the longest eager path; the compiled path has no more elementwise roundings (rule 1:
    none contracted; its extra divisions by a reciprocal step size round the scalar, counted in
    (b)). (b) Scalars: a relative error r of the coefficients moves the update by at most r of its
    magnitude, at most ``r * x_abs``, so at most ``r / U32`` ULPs (`scalar_relative_error`).
    Second-order terms (products of two roundings, < 2^-40 relative) vanish under the ceiling's
    slack. The result is ``inf`` where the bound is undetermined.
    """
    r = scalar_relative_error(name, config, step, mu_product).get(field_name, 0.0)
    if math.isinf(r):
        return math.inf
    return native_ulp + math.ceil(r / U32)


# --- rule 3: a fused chain's dropped roundings ---------------------------------------------------


_LOW = {"bfloat16": 8, "float16": 11}  # significand bits (with the implicit one)


def _ulp(x: np.ndarray, dtype: str) -> np.ndarray:
    """One ULP of the low-precision ``dtype`` at |x| (normal range; float16's subnormal spacing
    below 2^-14)."""
    bits = _LOW[dtype]
    a = np.maximum(np.abs(np.asarray(x, np.float64)), np.finfo(np.float64).tiny)
    exponent = np.floor(np.log2(a))
    unit = np.exp2(exponent - (bits - 1))
    if dtype == "float16":
        unit = np.maximum(unit, 2.0**-24)
    return unit


def dropped_rounding_envelope(out: np.ndarray, dropped: list[tuple[np.ndarray, np.ndarray]], dtype: str,
                              float32_ops: int, magnitude: np.ndarray | None = None) -> np.ndarray:
    """Rule 3: elementwise bound on |compiled - eager| for the output of a fused pointwise chain.

    ``out``: eager's output (the autocast dtype, as float64). ``dropped``: for every rounding
    eager makes inside the chain and the compiled kernel does not, ``(z, dy_dz)``: the
    intermediate's value and the magnitude of the chain's derivative with respect to it.
    ``float32_ops``: the chain's operations computed in float32 by both; ``magnitude``: the chain
    evaluated on magnitudes (default ``|out|``), which bounds every intermediate's contribution.

    Derivation (first order): eager's rounding of z moves it by at most half an ULP of ``dtype``,
    which moves the output by ``|dy/dz| * ulp(z) / 2``; both compute each operation in float32,
    within ``float32_ops * U32 * magnitude`` of the exact chain (each side); then both round
    the output once: |round(a) - round(b)| <= |a - b| + ulp(a)/2 + ulp(b)/2 <= |a - b| + ulp(out)
    for a, b in one binade, plus one more ULP where they straddle a power of two.
    """
    out = np.asarray(out, np.float64)
    mag = np.abs(out) if magnitude is None else np.asarray(magnitude, np.float64)
    bound = 2 * _ulp(out, dtype) + float32_ops * 2 * U32 * mag
    for z, dy_dz in dropped:
        bound = bound + np.abs(np.asarray(dy_dz, np.float64)) * _ulp(z, dtype) / 2
    return bound


def matmul_envelope(a_abs: np.ndarray, delta_b: np.ndarray, b_abs: np.ndarray, out: np.ndarray,
                    dtype: str) -> np.ndarray:
    """Rule 3 through a matrix product ``a @ b`` that both compute with the same kernel (rule 3:
    ATen's own), rounded to ``dtype``: elementwise bound on |compiled - eager| of the product when
    ``b`` differs by at most ``delta_b`` elementwise and ``a`` is the same.

    Derivation: the exact products differ by at most ``|a| @ delta_b``; each side accumulates k
    float32 products in the same order, each partial sum rounding within ``U32`` of it, so within
    ``k U32 (|a| @ |b|)`` of its exact sum; both round to ``dtype`` once: 2 ULPs of the output
    (a straddled power of two included, as in `dropped_rounding_envelope`).
    """
    a_abs, delta_b, b_abs = (np.abs(np.asarray(x, np.float64)) for x in (a_abs, delta_b, b_abs))
    k = a_abs.shape[-1]
    return a_abs @ delta_b + 2 * k * U32 * (a_abs @ b_abs) + 2 * _ulp(out, dtype)
