"""The registry of the specification's optimizers: one row per torch.optim class.

A row (`OptimizerSpec`) holds everything a consumer needs and nothing a consumer decides:
torch's class name, the configuration (its hyperparameters are torch's keyword arguments, with
torch's defaults), the state torch creates before a first step, and one pure step function per
implementation torch has on the CPU (``for-loop``, ``foreach``, ``fused``). Consumers
(`reference.step`, the audit, torchimpl's bridge, the conformance suite) look a row up and call
it; none of them names an optimizer.

Every step function has one signature:
``step(params, grads, state, config, *, lr=None, sqrt=None, grad_scale=None, found_inf=0.0)``
returning ``(params, grads, state)``: the new parameters, the gradients as the optimizer leaves
them in ``.grad``, and the new per-parameter states. ``sqrt`` is the elementwise square root to
use (rule 9 of `reference.optim`; ``None``: the correctly rounded one), ``grad_scale`` and
``found_inf`` are what ``GradScaler.step`` hands a kernel that does its own unscaling and
skipping; implementations not in ``kernel_scaled`` are never called on a skipped step and take
neither.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["IMPLEMENTATIONS", "OptimizerSpec", "SPECS", "register", "spec", "spec_for"]

IMPLEMENTATIONS = ("for-loop", "foreach", "fused")

StepFunction = Callable[..., tuple[list[np.ndarray], list[Any], tuple[Any, ...]]]


def _never(config: Any) -> str | None:
    return None


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer of the specification.

    ``name``: torch's class name. ``config``: builds the configuration from torch's keyword
    arguments (its signature's defaults are torch's defaults); ``config_type`` is what it returns.
    ``init_state(param, config)``: one parameter's state before its first step; the state is a
    frozen dataclass whose fields are named as torch's ``optimizer.state[p]`` keys.
    ``steps``: implementation name -> step function (module docstring). ``kernel_scaled``: the
    implementations whose kernel takes ``grad_scale``/``found_inf`` and is called on every
    step. ``kernel_skip_refused(config)``: why the spec cannot model this configuration in a kernel
    that skips by itself (``None`` when it can). ``magnitudes(config, param, grad, old, new)``:
    ``x_abs`` of every compared field (the field's formula on magnitudes, float64), the scale of
    the ULP bounds on native kernels. ``native_ulp``: per compared field (``param`` for the
    parameter) the bound on native kernels in ULPs of ``x_abs`` (the audit and the conformance
    suite read it; neither keeps a table of its own). ``elementwise``: each element's ``x_abs``
    depends only on the same element of the inputs (the audit then evaluates ``magnitudes`` at
    sampled elements only; False: over whole tensors). ``native_exact``: the implementations whose
    float32 step on native kernels (`reference.optim._common` rule 7) the spec computes bit for
    bit when its step function is called with ``native=True``; ``native_ulp`` bounds the others.
    ``position_free(config)``: every element's new values depend only on the same element of the
    inputs and on nothing of its place in its tensor (no rule of a vectorized head, such as rule
    4's lerp at weight 1), for every implementation; `step_joined` then steps runs of small
    parameters laid end to end as one (None: never).
    """

    name: str
    config: Callable[..., Any]
    config_type: type
    init_state: Callable[[np.ndarray, Any], Any]
    steps: Mapping[str, StepFunction]
    kernel_scaled: frozenset[str] = frozenset()
    kernel_skip_refused: Callable[[Any], str | None] = _never
    magnitudes: Callable[..., dict[str, np.ndarray]] | None = field(default=None, compare=False)
    native_ulp: Mapping[str, int] = field(default_factory=dict, compare=False)
    elementwise: bool = False
    native_exact: frozenset[str] = frozenset()
    position_free: Callable[[Any], bool] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        unknown = set(self.steps) - set(IMPLEMENTATIONS)
        if unknown or not self.steps:
            raise ValueError(f"{self.name}: implementations must be some of {IMPLEMENTATIONS}, got {sorted(self.steps)}")
        if not set(self.kernel_scaled) <= set(self.steps):
            raise ValueError(f"{self.name}: kernel_scaled {sorted(self.kernel_scaled)} are not implementations")
        if not set(self.native_exact) <= set(self.steps):
            raise ValueError(f"{self.name}: native_exact {sorted(self.native_exact)} are not implementations")

    def hyperparameters(self) -> dict[str, Any]:
        """Hyperparameter name -> torch's default."""
        return dict(_defaults(self.config))

    def make_config(self, **hyperparameters: Any) -> Any:
        """The configuration; a name torch's class does not take is a ValueError naming it."""
        unknown = sorted(set(hyperparameters) - set(self.hyperparameters()))
        if unknown:
            raise ValueError(f"{self.name} has no hyperparameter {', '.join(unknown)}; "
                             f"its hyperparameters: {', '.join(self.hyperparameters())}")
        return self.config(**hyperparameters)

    def state_fields(self, config: Any) -> tuple[str, ...]:
        """The state's fields torch keeps for this configuration (those ``init_state`` fills, and
        the ones created at the first step, such as SGD's momentum buffer)."""
        probe = self.init_state(np.zeros(2, np.float32), config)
        stepped = self.step("for-loop" if "for-loop" in self.steps else next(iter(self.steps)),
                            [np.zeros(2, np.float32)], [np.ones(2, np.float32)], (probe,), config)[2][0]
        return tuple(f.name for f in dataclasses.fields(probe) if getattr(stepped, f.name) is not None)

    def state_from(self, mapping: Mapping[str, Any], param: np.ndarray, config: Any) -> Any:
        """The spec's state equal to torch's ``optimizer.state[p]`` given as NumPy values by key
        (an empty mapping: the state before a first step). Scalar fields (the step counter) are
        read as float32 scalars, as torch keeps them."""
        if mapping and self.elementwise:
            # An element-wise row's fields do not depend on the parameter's shape: a state of an
            # empty parameter shows them, and where the mapping gives every field that state
            # holds, none of the parameter-sized initial arrays would be kept (no need to make them).
            probe = _probe(self, np.asarray(param).dtype, config)
            if all(mapping.get(f.name) is not None for f in dataclasses.fields(probe)
                   if getattr(probe, f.name) is not None):
                return _with_values(probe, mapping)
        init = self.init_state(param, config)
        if not mapping:
            return init
        return _with_values(init, mapping)

    def step(self, implementation: str, params: Any, grads: Any, state: Any, config: Any, *, lr: Any = None,
             sqrt: Callable[[np.ndarray], np.ndarray] | None = None, grad_scale: float | None = None,
             found_inf: float = 0.0, native: bool = False) -> tuple[list[np.ndarray], list[Any], tuple[Any, ...]]:
        """One step of ``implementation`` (module docstring); ``native``: as torch's native kernels
        compute it (an implementation in ``native_exact``, float32 parameters)."""
        if implementation not in self.steps:
            raise ValueError(f"{self.name} has no {implementation!r} implementation in the specification; "
                             f"it has {', '.join(self.steps)}")
        if native:
            if implementation not in self.native_exact:
                raise ValueError(f"{self.name}'s {implementation} path on native kernels is not modelled bit for bit "
                                 f"(native_exact: {', '.join(sorted(self.native_exact)) or 'none'})")
            return self.steps[implementation](params, grads, state, config, lr=lr, sqrt=sqrt, grad_scale=grad_scale,
                                              found_inf=found_inf, native=True)
        if implementation not in self.kernel_scaled and (grad_scale is not None or found_inf != 0.0):
            raise ValueError(f"{self.name}'s {implementation} path takes no grad_scale/found_inf: "
                             "GradScaler unscales its gradients and skips the call")
        return self.steps[implementation](params, grads, state, config, lr=lr, sqrt=sqrt, grad_scale=grad_scale,
                                          found_inf=found_inf)

    def step_joined(self, implementation: str, params: Any, grads: Any, state: Any, config: Any,
                    **kwargs: Any) -> tuple[list[np.ndarray], list[Any], tuple[Any, ...]] | None:
        """`step` computed over runs of small parameters laid end to end as one flat parameter
        each (`_runs`), then split back, the others in one call: the same bits as `step`, in one
        call a run instead of one a parameter. None (nothing computed) unless
        ``position_free(config)`` holds, every parameter has a gradient of its own dtype, all
        share one dtype, and their states agree on every scalar field (the step counter) and on
        which fields they hold."""
        if not _joinable(self, params, grads, state, config):
            return None
        new_params: list[Any] = [None] * len(params)
        new_states: list[Any] = [None] * len(params)
        runs = _runs(params)
        alone = [first for first, last in runs if last - first == 1]
        if alone:  # the parameters left alone: one call, as `step` takes them
            new_p, _, new_s = self.step(implementation, [params[i] for i in alone], [grads[i] for i in alone],
                                        tuple(state[i] for i in alone), config, **kwargs)
            for i, p, s in zip(alone, new_p, new_s):
                new_params[i], new_states[i] = p, s
        for first, last in runs:
            if last - first > 1:
                p, g, s = _join(params[first:last], grads[first:last], state[first:last])
                new_p, _, new_s = self.step(implementation, [p], [g], (s,), config, **kwargs)
                new_params[first:last] = _split(new_p[0], params[first:last])
                new_states[first:last] = _split_states(new_s[0], params[first:last])
        return new_params, list(grads), tuple(new_states)


# `step_joined` joins consecutive parameters of fewer than `JOINED_SMALL` elements each into runs
# of at most `JOINED_RUN_ELEMENTS` elements, and steps any other parameter alone. A step's cost
# for a small parameter is Python's (about 60 us), which a run pays once; a large one gains
# nothing from joining, and a run's temporaries, a few tens of bytes an element, must stay about
# the size of a core's cache: Adam's native step on 1.06M elements in 51 tensors took 3.8x
# torch's time joined in one run, 2.6x-2.7x in runs of 2**16 elements or parameter by parameter
# (bench/reference_speed.py --optimizers-only, "native joined" against "native").
JOINED_SMALL = 1 << 12
JOINED_RUN_ELEMENTS = 1 << 16


def _runs(params: Any) -> list[tuple[int, int]]:
    """The parameters cut into runs ``[first, last)``: consecutive ones of fewer than
    `JOINED_SMALL` elements each, together at most `JOINED_RUN_ELEMENTS`; any other alone. A 0-d
    parameter is alone too: with a tensor lr its arithmetic is not a 1-element tensor's (rule 11:
    two 0-d tensors promote)."""
    runs, first, size = [], 0, 0
    joins = [np.ndim(x) > 0 and np.size(x) < JOINED_SMALL for x in params]
    for i, x in enumerate(params):
        n = np.size(x)
        if i > first and (not joins[i] or not joins[i - 1] or size + n > JOINED_RUN_ELEMENTS):
            runs.append((first, i))
            first, size = i, 0
        size += n
    runs.append((first, len(params)))
    return runs


def _joinable(row: OptimizerSpec, params: Any, grads: Any, state: Any, config: Any) -> bool:
    """`OptimizerSpec.step_joined`'s conditions (its docstring)."""
    if row.position_free is None or not row.position_free(config) or len(params) < 2:
        return False
    dtype = np.asarray(params[0]).dtype
    if any(g is None or np.asarray(p).dtype != dtype or np.asarray(g).dtype != dtype or np.shape(g) != np.shape(p)
           for p, g in zip(params, grads)):
        return False
    for f in dataclasses.fields(state[0]):
        got = [getattr(s, f.name) for s in state]
        if all(v is None for v in got):
            continue
        if isinstance(got[0], np.floating):
            if any(not isinstance(v, np.floating) or np.asarray(v).tobytes() != np.asarray(got[0]).tobytes()
                   for v in got):
                return False
        elif not all(isinstance(v, np.ndarray) and v.dtype == dtype and v.shape == np.shape(p)
                     for v, p in zip(got, params)):
            return False
    return True


def _join(params: Any, grads: Any, state: Any) -> tuple[Any, Any, Any]:
    """Parameters, gradients and states (`_joinable`) laid end to end as one of each."""
    values = {f.name: _laid([getattr(s, f.name) for s in state]) for f in dataclasses.fields(state[0])
              if isinstance(getattr(state[0], f.name), np.ndarray)}
    return _laid(params), _laid(grads), dataclasses.replace(state[0], **values)


def _laid(arrays: Any) -> np.ndarray:
    """The arrays' elements end to end, flat (one array: a view of it)."""
    flat = [np.asarray(a).reshape(-1) for a in arrays]
    return flat[0] if len(flat) == 1 else np.concatenate(flat)


def _split(joined: np.ndarray, params: Any) -> list[np.ndarray]:
    """``joined`` cut back into arrays of the parameters' shapes (views)."""
    out, at = [], 0
    for p in params:
        n = np.size(p)
        out.append(joined[at:at + n].reshape(np.shape(p)))
        at += n
    return out


def _split_states(joined: Any, params: Any) -> tuple[Any, ...]:
    """A joined state cut back into one per parameter: its arrays split, its scalars shared."""
    arrays = {f.name: _split(v, params) for f in dataclasses.fields(joined)
              if isinstance(v := getattr(joined, f.name), np.ndarray) and v.ndim == 1}
    return tuple(dataclasses.replace(joined, **{k: v[i] for k, v in arrays.items()}) for i in range(len(params)))


SPECS: dict[str, OptimizerSpec] = {}


def register(row: OptimizerSpec) -> OptimizerSpec:
    """Add a row (its name must be new)."""
    if row.name in SPECS:
        raise ValueError(f"an optimizer named {row.name!r} is already registered")
    SPECS[row.name] = row
    return row


def spec(name: str) -> OptimizerSpec:
    """The row of torch's class ``name``; a KeyError naming the registered ones otherwise."""
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not in the specification; registered: {', '.join(SPECS)}") from None


def spec_for(config: Any) -> OptimizerSpec:
    """The first row whose configuration type is ``config``'s (Adam and AdamW share theirs, and
    their steps): a ValueError for a configuration of no registered optimizer."""
    for row in SPECS.values():
        if isinstance(config, row.config_type):
            return row
    raise ValueError(f"{type(config).__name__} is not the configuration of a registered optimizer "
                     f"({', '.join(SPECS)})")


_PROBES: dict[tuple[str, np.dtype, Any], Any] = {}


def _probe(row: OptimizerSpec, dtype: np.dtype, config: Any) -> Any:
    """``row``'s state of an empty parameter of ``dtype`` under ``config``, made once: the audit's
    replay asks for it for every parameter at every step (its arrays are empty and read-only)."""
    key = (row.name, dtype, config)
    try:
        return _PROBES[key]
    except TypeError:  # a configuration that cannot be hashed: made each time
        return row.init_state(np.zeros(0, dtype), config)
    except KeyError:
        if len(_PROBES) > 256:  # a schedule that changes a hyperparameter every step: keep it bounded
            _PROBES.clear()
        probe = _PROBES[key] = row.init_state(np.zeros(0, dtype), config)
        return probe


def _with_values(init: Any, mapping: Mapping[str, Any]) -> Any:
    """``init`` with each field the mapping gives replaced by its value (a scalar field, such as
    the step counter, read as a float32 scalar)."""
    values = {}
    for f in dataclasses.fields(init):
        value = mapping.get(f.name)
        if value is None:
            continue
        base = getattr(init, f.name)
        values[f.name] = np.float32(np.asarray(value).reshape(())) if isinstance(base, np.floating) else value
    return dataclasses.replace(init, **values)


@functools.cache
def _defaults(config: Callable[..., Any]) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each parameter of a configuration's constructor. Cached: reading a
    signature is slow, and the audit's replay builds a configuration at every step."""
    return tuple((n, p.default) for n, p in inspect.signature(config).parameters.items())
