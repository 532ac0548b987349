"""The sections of the configuration that configure precision and the optimizer, with their
checks; the loss scaler's section is ``scale_policy``. Imports nothing of torchimpl but
``config.problems``, and no torch: a configuration is checked before any tensor exists.

The code these sections configure reads them: ``torchimpl.precision.plan`` (resolving
``PrecisionConfig``), ``torchimpl.train.optim`` (building ``OptimizerConfig``'s optimizer, whose
``register`` adds a row to :data:`OPTIMIZER_ROWS`). Precision rule 8 (the spellings other
libraries write) is :mod:`torchimpl.precision.plan`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
from dataclasses import dataclass
from typing import Any

from torchimpl.config.problems import ConfigError

__all__ = [
    "DTYPES",
    "FP8_RECIPES",
    "MASTER_WEIGHTS",
    "MODES",
    "OPTIMIZER_ROWS",
    "REFUSED_SPELLINGS",
    "SPELLINGS",
    "TRUE_MODES",
    "OptimizerConfig",
    "OptimizerRow",
    "PrecisionConfig",
    "canonical_mode",
]

# The precision section's notes are logged where precision is resolved, as before the move.
log = logging.getLogger("torchimpl.precision.plan")

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
"""The float8 recipes ``precision.fp8_recipe`` accepts (checked by ``PrecisionConfig``)."""

MODES = ("auto", "fp32", "bf16", "fp16", "fp8", "bf16-true", "fp16-true")
DTYPES = ("bf16", "fp16")
TRUE_MODES = ("bf16-true", "fp16-true")
"""The modes that hold the parameters themselves in 16 bits (Lightning's ``bf16-true`` and
``16-true``): no autocast; ``precision.master_weights`` says what keeps the updates."""

MASTER_WEIGHTS = ("none", "fp32", "kahan", "stochastic")
"""``precision.master_weights`` under a ``*-true`` mode: ``none`` (the 16-bit parameters are
stepped as they are, optimizer state in 16 bits too: Lightning's ``bf16-true``), ``fp32`` (a
float32 master copy and float32 optimizer state step; the 16-bit copy is cast from it), ``kahan``
(a 16-bit compensation buffer keeps what each rounding lost), ``stochastic`` (the update is
rounded to bf16 stochastically, with a seeded generator)."""

# Rule 8: other libraries' spellings -> (mode, the library that writes it).
SPELLINGS: dict[str, tuple[str, str]] = {
    "32-true": ("fp32", "Lightning"),
    "32": ("fp32", "Lightning"),
    "bf16-mixed": ("bf16", "Lightning"),
    "16-mixed": ("fp16", "Lightning"),
    "16": ("fp16", "Lightning"),
    "16-true": ("fp16-true", "Lightning"),
    "no": ("fp32", "Accelerate"),
}
_MEANING = {
    "fp32": "float32 throughout, without autocast or a loss scaler",
    "bf16": "bf16 autocast over float32 weights, without a loss scaler",
    "fp16": "fp16 autocast over float32 weights with a dynamic loss scaler",
    "fp16-true": "parameters held in fp16, without autocast, with a dynamic loss scaler",
}
# Rule 8: spellings of recipes ampspec does not implement -> why, and what to use instead.
REFUSED_SPELLINGS: dict[str, str] = {
    "64-true": "ampspec trains in float32 at most and has no float64 mode; use '32-true' (mode fp32)",
    "64": "ampspec trains in float32 at most and has no float64 mode; use '32-true' (mode fp32)",
    "transformer-engine": ("ampspec's float8 training goes through torchao, not NVIDIA Transformer Engine's "
                           "layers; use mode 'fp8' (precision.fp8_recipe picks the recipe)"),
    "transformer-engine-float16": ("ampspec's float8 training goes through torchao, not NVIDIA Transformer "
                                   "Engine's layers; use mode 'fp8' (precision.fp8_recipe picks the recipe)"),
}


def canonical_mode(value: Any) -> tuple[str, str | None]:
    """``(mode, note)`` for a precision as written (rule 8): a mode of :data:`MODES` or a spelling
    of :data:`SPELLINGS`, a string or a whole number; ``note`` says what a spelling means (None
    for a canonical mode). ``ValueError`` for a refused spelling (why, and what to use) and for
    anything else (the accepted spellings, with a did-you-mean)."""
    if isinstance(value, bool):
        hint = " (YAML reads an unquoted no as false: write 'no' in quotes)" if value is False else ""
        raise ValueError(f"precision mode must be a name like 'bf16' or 'bf16-mixed', got {value!r}{hint}")
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in MODES:
        return text, None
    if text in SPELLINGS:
        mode, library = SPELLINGS[text]
        note = f"{value!r} ({library}) means {_MEANING[mode]}: precision mode {mode!r}"
        return mode, note
    if text in REFUSED_SPELLINGS:
        raise ValueError(f"precision {value!r} is not supported: {REFUSED_SPELLINGS[text]}")
    accepted = list(MODES) + list(SPELLINGS)
    close = difflib.get_close_matches(text, accepted, n=1) if text else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"precision mode must be one of {', '.join(MODES)}, or the spellings "
                     f"{', '.join(SPELLINGS)} (16 and 32 as numbers too), got {value!r}{hint}")


@dataclass(frozen=True)
class PrecisionConfig:
    """What the user asks for: ``mode`` in auto|fp32|bf16|fp16|fp8|bf16-true|fp16-true, or a
    spelling of rule 8 (stored as its canonical mode, the spelling's meaning in ``spelling_note``);
    ``dtype`` in bf16|fp16 is the preferred mixed dtype, consulted only when ``mode`` is ``auto``;
    ``fp8_recipe`` and ``fp8_skip_first_last`` apply to ``mode: fp8`` only, ``master_weights``
    to the ``*-true`` modes only (:func:`_true_mode_problems` states what goes together)."""

    mode: str | int = "auto"
    """A mode or a spelling (rule 8; ``16`` as a number too); always a mode once constructed."""
    dtype: str = "bf16"
    fp8_recipe: str = "tensorwise"
    """torchao's float8 recipe: tensorwise, rowwise, rowwise_with_gw_hp, or mxfp8 (MX blocks)."""
    fp8_skip_first_last: bool = True
    """Keep the model's first and last linear layers in high precision under ``mode: fp8``."""
    fp32_modules: tuple[str, ...] = ()
    """Patterns (fnmatch) of qualified module names whose forward runs in an fp32 island, autocast
    off and inputs upcast (``torchimpl.precision.fp32_modules``): the fix for a forward overflow that loss
    scaling cannot cure (``ampspec doctor``). A pattern matching no module is refused at fit."""
    master_weights: str = "none"
    """With ``mode`` bf16-true or 16-true: what keeps the updates the 16-bit parameters cannot hold
    (:data:`MASTER_WEIGHTS`: none, fp32, kahan, stochastic); ``none`` under every other mode, whose
    parameters are float32 already."""

    def __post_init__(self) -> None:
        mode, note = canonical_mode(self.mode)
        # Not a field: equality, to_dict and the resume comparison see only the canonical mode.
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "_spelling_note", note)
        if note:
            log.info("precision: %s", note)
        if self.dtype not in DTYPES:
            raise ValueError(
                f"precision dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {self.fp8_recipe!r}")
        if not isinstance(self.fp8_skip_first_last, bool):
            raise ValueError(f"fp8_skip_first_last must be true or false, got {self.fp8_skip_first_last!r}")
        if isinstance(self.fp32_modules, list):
            object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))
        if not isinstance(self.fp32_modules, tuple) or not all(isinstance(p, str) and p for p in self.fp32_modules):
            raise ValueError(f"fp32_modules must be a list of module name patterns, got {self.fp32_modules!r}")
        if self.master_weights not in MASTER_WEIGHTS:
            close = difflib.get_close_matches(str(self.master_weights), MASTER_WEIGHTS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"master_weights must be one of {', '.join(MASTER_WEIGHTS)}, got "
                             f"{self.master_weights!r}{hint}")
        problems = _true_mode_problems(self)
        if problems:
            # A ConfigError names each field, so the loader reports these as they are instead of
            # retrying each field alone against the defaults.
            raise ConfigError(problems)

    @property
    def spelling_note(self) -> str | None:
        """What the spelling ``mode`` was given in means (rule 8); None for a canonical mode."""
        return self._spelling_note  # type: ignore[attr-defined]


def _true_mode_problems(config: PrecisionConfig) -> list[tuple[str, str]]:
    """The settings valid alone but not with (or without) a ``*-true`` mode, as ``(field, message)``."""
    mode, mw, out = config.mode, config.master_weights, []
    if mode not in TRUE_MODES:
        if mw != "none":
            out.append(("master_weights", f"{mw!r} applies to precision.mode bf16-true or 16-true, whose parameters "
                                          f"are held in 16 bits; under mode {mode!r} they are float32 already (their "
                                          "own master copy): remove master_weights, or set mode bf16-true"))
        return out
    if mode == "fp16-true" and mw == "none":
        # torch's GradScaler refuses this too ("Attempting to unscale FP16 gradients.").
        out.append(("master_weights", "16-true with no master copy steps fp16 parameters with fp16 optimizer "
                                      "state, where Adam's eps (1e-8) rounds to 0 and a second moment below "
                                      "6e-8 flushes (0 / 0 updates), and torch's GradScaler refuses to step fp16 "
                                      "parameters; set master_weights to fp32 or kahan, or use mode bf16-true"))
    if mode == "fp16-true" and mw == "stochastic":
        out.append(("master_weights", "stochastic rounding is bf16's (random bits added below bf16's 8-bit "
                                      "mantissa of a float32); under 16-true use fp32, or use mode bf16-true"))
    if config.fp8_recipe != "tensorwise" or config.fp8_skip_first_last is not True:
        out.append(("fp8_recipe" if config.fp8_recipe != "tensorwise" else "fp8_skip_first_last",
                    f"float8 settings apply to mode fp8, which keeps float32 weights; mode {mode!r} holds them in "
                    "16 bits: remove the fp8 settings, or set mode fp8"))
    if config.fp32_modules:
        out.append(("fp32_modules", "fp32 islands turn autocast off around modules whose weights are float32; "
                                    f"under mode {mode!r} there is no autocast and the weights are 16-bit: remove "
                                    "fp32_modules, or use mode bf16 (bf16-mixed)"))
    return out


@dataclass(frozen=True)
class OptimizerRow:
    """What the configuration knows of one optimizer: the name ``optimizer.name`` gives, the
    ``OptimizerConfig`` fields it takes besides ``lr`` and ``weight_decay``, and ``check(config)``
    returning ``(field, message)`` for settings valid alone but not together. A row of
    ``torchimpl.train.optim.REGISTRY`` is one too (it adds torch's class and kernels)."""

    name: str
    settings: tuple[str, ...] = ()
    check: Any = None


def _sgd_problems(config: "OptimizerConfig") -> list[tuple[str, str]]:
    if config.nesterov and config.momentum <= 0.0:
        return [("nesterov", f"Nesterov momentum needs momentum > 0, got momentum={config.momentum!r}; "
                             "set momentum (e.g. 0.9), or remove nesterov")]
    return []


OPTIMIZER_ROWS: dict[str, Any] = {row.name: row for row in (
    OptimizerRow("adamw", ("betas", "eps", "amsgrad")),
    OptimizerRow("adam", ("betas", "eps", "amsgrad")),
    OptimizerRow("sgd", ("momentum", "dampening", "nesterov"), _sgd_problems),
    OptimizerRow("adagrad", ("lr_decay", "initial_accumulator_value", "eps")),
    OptimizerRow("rmsprop", ("alpha", "eps", "momentum", "centered")),
    OptimizerRow("adamax", ("betas", "eps")),
    OptimizerRow("adadelta", ("rho", "eps")),
    OptimizerRow("nadam", ("betas", "eps", "momentum_decay", "decoupled_weight_decay")),
    OptimizerRow("radam", ("betas", "eps", "decoupled_weight_decay")),
    # Adafactor's eps is a pair (eps1 or None, eps2), not the float the other rows share: the
    # trainer keeps torch's default (None, 1e-3).
    OptimizerRow("adafactor", ("beta2_decay", "d")),
)}
"""The optimizers ``optimizer.name`` accepts, by name, in order (``torchimpl.train.optim.register``
adds its rows here: their settings and checks are the configuration's)."""


_F32_MAX = 3.4028234663852886e38


def _finite_at_least(name: str, value: Any, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (float(value) >= low and float(value) != float("inf")):
        raise ValueError(f"{name} must be a finite number{'' if low == -math.inf else f' >= {low}'}, got {value!r}")


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer settings. ``name``: a registered optimizer (``OPTIMIZER_ROWS``, which ``torchimpl.train.optim.register`` extends: adamw, adam, sgd, ...).
    ``lr`` and ``weight_decay`` apply to every optimizer; each other field only to the optimizers
    whose row lists it (``betas`` and ``eps`` to Adam(W), ``momentum`` and ``nesterov`` to SGD,
    ...), and a field set away from its default for another optimizer is an error naming it.
    Fields that default to ``None`` mean torch's default for the optimizer. ``fused`` is None
    (probe), True (attempt) or False."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0
    nesterov: bool = False
    fused: bool | None = None
    no_decay_bias_and_norm: bool = True
    amsgrad: bool | None = None
    dampening: float | None = None
    lr_decay: float | None = None
    initial_accumulator_value: float | None = None
    alpha: float | None = None
    centered: bool | None = None
    rho: float | None = None
    momentum_decay: float | None = None
    decoupled_weight_decay: bool | None = None
    beta2_decay: float | None = None
    d: float | None = None

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_ROWS:
            raise ValueError(
                f"optimizer name must be one of {', '.join(OPTIMIZER_ROWS)}, got {self.name!r}"
            )
        _finite_at_least("lr", self.lr, float("-inf"))
        if not 0.0 < float(self.lr) <= _F32_MAX:  # 0 trains nothing; torch keeps rates in float32 tensors too
            raise ValueError(f"lr must be > 0 and within float32's range (at most {_F32_MAX:.4g}), got {self.lr!r}")
        _finite_at_least("weight_decay", self.weight_decay, 0.0)
        _finite_at_least("eps", self.eps, float("-inf"))
        if not 0.0 < float(self.eps) < math.inf:  # eps = 0 divides 0 by 0 where a gradient has been zero: NaN weights
            raise ValueError(f"eps must be a finite number > 0 (it keeps a zero second moment from dividing "
                             f"by zero), got {self.eps!r}")
        _finite_at_least("momentum", self.momentum, 0.0)
        if self.dampening is not None:
            _finite_at_least("dampening", self.dampening, float("-inf"))
        for name in _NONNEGATIVE:
            if getattr(self, name) is not None:
                _finite_at_least(name, getattr(self, name), 0.0)
        if self.rho is not None and not float(self.rho) <= 1.0:  # torch's Adadelta refuses it only at build
            raise ValueError(f"rho must be in [0, 1], got {self.rho!r}")
        if self.beta2_decay is not None:
            _finite_at_least("beta2_decay", self.beta2_decay, float("-inf"))
            if not float(self.beta2_decay) <= 0.0:
                raise ValueError(f"beta2_decay must be <= 0 (Adafactor's second moment weighs the new gradient by "
                                 f"step ** beta2_decay), got {self.beta2_decay!r}; torch's default is -0.8")
        if self.d is not None:
            _finite_at_least("d", self.d, 1.0)
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair of numbers in [0, 1), got {betas!r}")
        for i, b in enumerate(betas):
            _finite_at_least(f"betas[{i}]", b, 0.0)
            if not b < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {b!r}")
        # YAML gives lists; keep the frozen config hashable and comparable.
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        for name in ("nesterov", "no_decay_bias_and_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("fused", "amsgrad", "centered", "decoupled_weight_decay"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be None, True or False, got {getattr(self, name)!r}")
        problems = self._cross_field_problems()
        if problems:
            # A ConfigError names each field, so the loader reports these as they are instead of
            # retrying each field alone against the defaults (which would blame the default
            # optimizer name).
            raise ConfigError(problems)

    def _cross_field_problems(self) -> list[tuple[str, str]]:
        """Settings that are valid alone but not together, as ``(field, message)``: a setting of
        another optimizer away from its default, then the row's own checks."""
        row = OPTIMIZER_ROWS[self.name]
        out = []
        for f in dataclasses.fields(self):
            if f.name in _COMMON or f.name in row.settings or getattr(self, f.name) == f.default:
                continue
            users = [r.name for r in OPTIMIZER_ROWS.values() if f.name in r.settings]
            who = " and ".join(repr(u) for u in users)
            out.append((f.name, f"only the {who} optimizer{'s' if len(users) > 1 else ''} use{'' if len(users) > 1 else 's'} "
                                f"{f.name}, and this one is {self.name!r} (got {f.name}={getattr(self, f.name)!r}); "
                                f"remove {f.name}, or set the optimizer's name to {' or '.join(repr(u) for u in users)}"))
        return out + (row.check(self) if row.check else [])


# Optional settings that are finite numbers >= 0 when given.
_NONNEGATIVE = ("lr_decay", "initial_accumulator_value", "alpha", "rho", "momentum_decay")
# Fields every optimizer takes, or that choose how it is built rather than what it computes.
_COMMON = frozenset({"name", "lr", "weight_decay", "fused", "no_decay_bias_and_norm"})
