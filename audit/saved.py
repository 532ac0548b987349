"""What an object given to ``torch.save`` holds: optimizer state, loss-scaler state.

Read by content, at any depth and under any key, so that a framework's layout is recognised
without knowing its names: a scaler's state saved inside an optimizer wrapper's state
(MMEngine's ``AmpOptimWrapper.state_dict()`` adds ``loss_scaler`` beside ``state`` and
``param_groups``), under a precision plugin's class name (Lightning's ``MixedPrecision``), in a
file of its own (Accelerate's and the HF Trainer's ``scaler.pt``), or pickled as an object
(DeepSpeed's ZeRO optimizers keep their ``loss_scaler`` object in their state).

Scaler state, as each shape is written:

- a ``torch.amp.GradScaler`` itself;
- a mapping (or an object's attributes) with ``scale`` and a growth tracker (``_growth_tracker``:
  ``GradScaler.state_dict()``; ``growth_tracker``: Megatron's scaler), with ``cur_scale`` and
  ``cur_iter`` (DeepSpeed's loss scalers and FP16 optimizer), or with ``loss_scale`` and
  ``unskipped`` (apex's ``amp.state_dict()``);
- a number or one-element tensor under ``loss_scale`` or ``cur_scale`` (the scale alone, as
  fairseq's FP16 optimizers add it to their state): the scale a resumed run needs most.

The walk is breadth first and bounded (`MAX_DEPTH`, `MAX_NODES`), visits each object once, and
calls no code of the program: mappings, lists and tuples are read as they are, other objects
through their instance ``__dict__`` read directly (no ``state_dict()``, no ``__getattr__``).
Tensors, modules and an optimizer's per-parameter ``state`` and ``param_groups`` are not
entered (no scaler lives there). When a limit stops the walk before it found scaler state, the
answer is "not known" (None), not "absent".
"""

from __future__ import annotations

import types
from collections import deque
from typing import Any, Iterable

import torch

__all__ = ["classify", "MAX_DEPTH", "MAX_NODES"]

MAX_DEPTH = 12
MAX_NODES = 20000

# Keys that, together, are a loss scaler's state (any one of these sets present).
SCALER_SHAPES = (frozenset({"scale", "_growth_tracker"}), frozenset({"scale", "growth_tracker"}),
                 frozenset({"cur_scale", "cur_iter"}), frozenset({"loss_scale", "unskipped"}))
# Keys whose number alone is a loss scale.
SCALE_KEYS = ("loss_scale", "cur_scale")
# An optimizer's state_dict: its per-parameter state and groups hold no scaler.
OPTIMIZER_KEYS = frozenset({"state", "param_groups"})
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType, types.FunctionType,
           types.BuiltinFunctionType, types.MethodType, torch.Tensor, torch.nn.Module, torch.dtype, torch.device)


def _is_number(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _holds_scale(fields: dict[Any, Any]) -> bool:
    """A mapping (or an object's attributes) that is a loss scaler's state, or holds a loss scale."""
    keys = {k for k in fields if isinstance(k, str)}
    return any(shape <= keys for shape in SCALER_SHAPES) or \
        any(k in fields and _is_number(fields[k]) for k in SCALE_KEYS)


def _attributes(x: Any) -> dict[str, Any] | None:
    """An object's instance dictionary, read without calling its code (None: it has none)."""
    try:
        d = object.__getattribute__(x, "__dict__")
    except (AttributeError, TypeError):
        return None
    return d if isinstance(d, dict) else None


def _push(queue: deque[tuple[Any, int]], values: Iterable[Any], depth: int) -> bool:
    """Queue the values that can hold state (not leaves), up to `MAX_NODES` waiting; False
    when some were left out."""
    for v in values:
        if isinstance(v, _LEAVES):
            continue
        if len(queue) >= MAX_NODES:
            return False
        queue.append((v, depth))
    return True


def classify(obj: Any) -> tuple[bool, bool | None]:
    """(holds optimizer state, holds scaler state) of an object given to torch.save; the second
    is None when the walk reached a limit before it found scaler state (not known)."""
    holds_opt = holds_scaler = False
    queue: deque[tuple[Any, int]] = deque()
    complete = _push(queue, [obj], 0)
    seen: set[int] = set()
    while queue and not (holds_opt and holds_scaler):
        x, depth = queue.popleft()
        if id(x) in seen:
            continue
        if depth > MAX_DEPTH or len(seen) >= MAX_NODES:
            complete = False
            break
        seen.add(id(x))
        if isinstance(x, torch.amp.GradScaler):
            holds_scaler = True
            continue
        if isinstance(x, (list, tuple, set, frozenset)):
            complete &= _push(queue, x, depth + 1)
            continue
        fields = x if isinstance(x, dict) else _attributes(x)
        if fields is None:
            continue
        optimizer = isinstance(x, torch.optim.Optimizer) or OPTIMIZER_KEYS <= fields.keys()
        holds_opt = holds_opt or optimizer
        holds_scaler = holds_scaler or _holds_scale(fields)
        # An optimizer's per-parameter state and groups hold no scaler: not entered.
        complete &= _push(queue, (v for k, v in fields.items() if not (optimizer and k in OPTIMIZER_KEYS)), depth + 1)
    return holds_opt, (None if not complete and not holds_scaler else holds_scaler)
