"""The audit's optimizer registry: a torch optimizer class -> the specification's row.

The replay (`audit.replay`) asks `lookup` for the class of each optimizer it meets. The lookup
walks the class's ``__mro__`` and takes the first class that is registered, so a subclass is
replayed as its parent when its ``step`` is the parent's or calls it (``super().step(...)`` or
``Parent.step(self, ...)``; a detection framework's generated subclass that clips gradients
first is one). A class in between that overrides ``step`` without calling its parent's is not
replayed: its numbers are its own. Any other optimizer is not replayed either ("CLASS is not in
the specification"); the scaler stages of its steps are checked all the same.

Rows: torch.optim's classes that `reference.optim` specifies (one per spec row, by class name,
with the row's own bounds on native kernels, ``native_ulp``), and the user's own, added with
`register_optimizer`. This module keeps no table of its own: a new spec row is replayed as is.

A user's own optimizer, worked example: Lion (Chen et al. 2023), a torch class whose groups
hold ``lr``, ``betas`` and ``weight_decay`` and whose ``step`` does, per parameter with a
gradient, ``c = m * b1 + g * (1 - b1)``, ``p.mul_(1 - lr * wd).add_(c.sign(), alpha=-lr)``,
``m.mul_(b2).add_(g * (1 - b2))``, with ``m = state["exp_avg"]`` (zeros at first). Its spec,
operation by operation (``f`` rounds to the parameter's dtype, as torch rounds a Python float
that meets a tensor)::

    from dataclasses import dataclass
    import numpy as np
    from reference.optim import OptimizerSpec

    @dataclass(frozen=True)
    class LionConfig:
        lr: float = 1e-4
        betas: tuple = (0.9, 0.99)
        weight_decay: float = 0.0

    @dataclass(frozen=True)
    class LionState:
        exp_avg: np.ndarray

    def lion_init(p, cfg):
        return LionState(np.zeros_like(p))

    def lion_step(params, grads, state, cfg, *, lr=None, **_):
        out_p, out_s = [], []
        for p, g, s in zip(params, grads, state):
            if g is not None:
                f, (b1, b2) = p.dtype.type, cfg.betas
                c = s.exp_avg * f(b1) + g * f(1 - b1)
                p = p * f(1 - cfg.lr * cfg.weight_decay) + f(-cfg.lr) * np.sign(c)
                s = LionState(s.exp_avg * f(b2) + g * f(1 - b2))
            out_p.append(p)
            out_s.append(s)
        return out_p, list(grads), tuple(out_s)

    LION = OptimizerSpec("Lion", LionConfig, LionConfig, lion_init, {"for-loop": lion_step})
    audit.register_optimizer(Lion, LION)

The spec's arithmetic must be the torch class's, operation by operation, for the replay to
agree bit for bit (``ulp``: each field's bound on native kernels, in ULPs of the spec's
``magnitudes`` or else of the value; 0, the default, is bit for bit everywhere: native kernels
fuse ``add_(x, alpha=a)`` into a multiply-add, which is why this Lion multiplies first). The replay process is forked before the audited script runs, so a spec
it replays must be importable by name: define it in a module of its own (not in the script) and
import that, or replay on a thread (``AMPSPEC_AUDIT_REPLAY=thread``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from reference import optim

__all__ = ["AuditOptimizer", "OptimizerRef", "lookup", "optimizer_ref", "register_optimizer", "registered"]

@dataclass(frozen=True)
class AuditOptimizer:
    """One row: the spec's row and, per compared field, its bound on native kernels (in ULPs of
    the spec's ``magnitudes`` where the row has them, else of the value). ``builtin``: one of
    torch.optim's classes (False: registered by the user)."""

    spec: optim.OptimizerSpec
    ulp: Mapping[str, int] = field(default_factory=dict)
    builtin: bool = True

    def config(self, group: Mapping[str, Any]) -> Any:
        """The spec's configuration for one torch parameter group: every hyperparameter the
        spec's row names, read from the group (a list of betas becomes a tuple of floats, None
        kept)."""
        values = {}
        for name in self.spec.hyperparameters():
            if name in group:
                v = group[name]
                # A pair may hold None (Adafactor's eps1: the dtype's epsilon).
                values[name] = tuple(b if b is None else float(b) for b in v) if isinstance(v, (list, tuple)) else v
        key = (self.spec.name, tuple((k, type(v), v) for k, v in values.items()))
        try:
            return _CONFIGS[key]
        except TypeError:  # a value that cannot be hashed: built each time
            return self.spec.make_config(**values)
        except KeyError:
            if len(_CONFIGS) > 256:  # a schedule that changes a hyperparameter every step: keep it bounded
                _CONFIGS.clear()
            config = _CONFIGS[key] = self.spec.make_config(**values)
            return config

    def bound(self, field_name: str) -> int:
        return int(self.ulp.get(field_name, 0))


_ROWS: dict[type, AuditOptimizer] = {}
# The spec's configurations made so far, by row and hyperparameter values: a configuration is
# immutable, and the replay builds one for every parameter group at every step.
_CONFIGS: dict[tuple[str, tuple], Any] = {}


def _builtin_rows() -> None:
    for name, row in optim.SPECS.items():
        cls = getattr(torch.optim, name, None)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls not in _ROWS:
            _ROWS[cls] = AuditOptimizer(row, dict(row.native_ulp))


def register_optimizer(cls: type, spec: Any, *, ulp: Mapping[str, int] | None = None) -> None:
    """Replay ``cls`` (and its subclasses that keep or call its ``step``) through ``spec``, a
    `reference.optim.OptimizerSpec` whose hyperparameters are named as ``cls``'s parameter-group
    keys and whose state fields as its ``optimizer.state[p]`` keys. ``ulp``: per field
    (``"param"`` for the parameter) the bound on native kernels, 0 where not given."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"register_optimizer takes a torch.optim.Optimizer subclass, got {cls!r}")
    if not isinstance(spec, optim.OptimizerSpec):
        raise ValueError(f"the spec of {cls.__qualname__} must be a reference.optim.OptimizerSpec, got "
                         f"{type(spec).__name__} (see the worked example in audit.optimizers)")
    bad = {k: v for k, v in (ulp or {}).items() if isinstance(v, bool) or not isinstance(v, int) or v < 0}
    if bad:
        raise ValueError(f"ulp bounds must be ints >= 0, got {bad}")
    _ROWS[cls] = AuditOptimizer(spec, dict(ulp or {}), builtin=False)


def registered() -> dict[type, AuditOptimizer]:
    """Every registered class and its row."""
    _builtin_rows()
    return dict(_ROWS)


def _calls_parent_step(cls: type) -> bool:
    """Whether ``cls.step`` is a parent's (as torch's step hook leaves it) or calls one."""
    own = inspect.unwrap(cls.__dict__["step"])
    parents = cls.__mro__[1:]
    if any(own is inspect.unwrap(p.__dict__["step"]) for p in parents if "step" in p.__dict__):
        return True
    code = getattr(own, "__code__", None)
    if code is None:
        return False
    names = set(code.co_names)
    return "step" in names and ("super" in names or any(p.__name__ in names for p in parents))


def lookup(cls: type) -> tuple[AuditOptimizer | None, str | None]:
    """The row ``cls`` is replayed by, or ``None`` and the reason it is not replayed."""
    _builtin_rows()
    name = f"{cls.__module__}.{cls.__qualname__}"
    for c in cls.__mro__:
        row = _ROWS.get(c)
        if row is not None:
            return row, None
        if "step" in c.__dict__ and not _calls_parent_step(c):
            parent = next((p for p in c.__mro__[1:] if p in _ROWS), None)
            if parent is not None:
                return None, (f"{name} is not in the specification: {c.__qualname__}.step neither is "
                              f"{parent.__qualname__}.step nor calls it")
            break
    return None, f"{name} is not in the specification"


STOCHASTIC = ("{name} with bf16_stochastic_round=True: its optimizer state is quantized, which the "
              "specification does not model, and its stochastic rounding draws random bits the audit cannot "
              "observe; update-lost-to-rounding does not apply (an update smaller than the gap changes the "
              "weight with probability |update|/gap, and is kept in expectation)")
"""Why an optimizer that rounds stochastically with quantized state (torchao's ``AdamW8bit``, ...) is not replayed."""

STOCHASTIC_ROWS = {"torchao.optim.adam._AdamW": "AdamW"}
"""torchao's optimizers whose state is as torch's for the spec row named (bf16 arrays and a float32
``step``), with ``bf16_stochastic_round=True``: each step computes the row's update in float32
and rounds the weight stochastically (torchao 0.18, ``torchao/optim/adam.py``
``single_param_adam``). The replay checks such a step by envelope (`audit.lost.stochastic_envelope`):
its random bits are not observable, so no stored weight can be recomputed bit for bit."""


@dataclass(frozen=True)
class OptimizerRef:
    """What the replay needs of a torch optimizer: its label in the report, its class's
    qualified name, and its row in this module's registry (None: ``refused`` says why not)."""

    label: str
    kind: str
    entry: AuditOptimizer | None = None
    refused: str | None = None
    stochastic: bool = False  # rounds its parameters stochastically: checked by envelope (audit.lost)


def optimizer_ref(o: Any, in_process: bool = False) -> OptimizerRef:
    """The replay's view of the optimizer track ``o`` (``in_process``: replayed in the forked
    worker, which cannot load a spec defined in the audited script)."""
    cls = type(o.obj)
    entry, refused = lookup(cls)
    stochastic = getattr(o.obj, "bf16_stochastic_round", False) is True
    if stochastic:
        row = STOCHASTIC_ROWS.get(f"{cls.__module__}.{cls.__qualname__}")
        entry, refused = (None, STOCHASTIC.format(name=f"{cls.__module__}.{cls.__qualname__}")) if row is None else \
            (AuditOptimizer(optim.spec(row)), None)
    if entry is not None and in_process and not entry.builtin and _in_main(entry.spec):
        entry, refused = None, (f"the spec of {cls.__qualname__} is defined in the audited script, which the replay "
                                "process (started before the script) cannot load: define it in a module of its own "
                                "and import it, or set AMPSPEC_AUDIT_REPLAY=thread")
    return OptimizerRef(o.label, f"{cls.__module__}.{cls.__qualname__}", entry, refused, stochastic)


def _in_main(spec: Any) -> bool:
    parts = [spec.config, spec.init_state, *spec.steps.values()]
    return any(getattr(f, "__module__", None) == "__main__" for f in parts)
