"""``precision.fp32_modules``: named modules whose forward runs in an fp32 island.

1. Each pattern (``fnmatch``: ``blocks.*.mlp.fc2``, ``head``) is matched against the model's
   qualified module names; a pattern that matches no module is refused, naming the pattern and
   some of the model's module names, before any work.
2. A matched module's forward runs with autocast off on every device type (``fp32_island``)
   and its floating inputs narrower than 32 bits upcast to float32 (``upcast``): rule 6 of
   ``torchimpl.precision.plan`` (autocast off alone leaves an fp16 input in fp16). Parameters are
   untouched, so state dicts and checkpoints are the same with or without the setting.
3. The island is entered by a forward pre-hook and left by a forward hook that runs even when
   the forward raises, so autocast is never left off. Applying the same patterns twice adds
   nothing; the hooks are plain functions, so a deep copy of the model keeps them working.
"""

from __future__ import annotations

import contextlib
import fnmatch
import threading
from collections.abc import Iterable
from typing import Any

from torch import nn

from torchimpl.precision.plan import fp32_island, upcast

__all__ = ["FP32_MARK", "apply_fp32_modules", "matching_modules"]

FP32_MARK = "_ampspec_fp32_island"
_LOCAL = threading.local()  # each thread's open islands, innermost last


def _islands() -> list[contextlib.ExitStack]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


def matching_modules(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Rule 1: the qualified names matched by ``patterns``, in module order."""
    patterns = list(patterns)
    names = [n for n, _ in model.named_modules() if n]
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError(f"precision.fp32_modules: each entry must be a module name pattern, got {p!r}")
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(f"precision.fp32_modules: {p!r} matches no module of the model; its modules: {shown}")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _upcast_tree(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_upcast_tree(v) for v in value)
    if isinstance(value, list):
        return [_upcast_tree(v) for v in value]
    if isinstance(value, dict):
        return {k: _upcast_tree(v) for k, v in value.items()}
    return upcast(value)


def _enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    stack = contextlib.ExitStack()
    stack.enter_context(fp32_island())
    _islands().append(stack)
    return _upcast_tree(args), _upcast_tree(kwargs)


def _leave(module: nn.Module, args: tuple, output: Any) -> None:
    if _islands():
        _islands().pop().close()


setattr(_enter, FP32_MARK, True)


def apply_fp32_modules(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Rules 1-3 on ``model`` in place; returns the names of the modules now in fp32 islands."""
    names = matching_modules(model, patterns)
    modules = dict(model.named_modules())
    for name in names:
        m = modules[name]
        if any(getattr(h, FP32_MARK, False) for h in m._forward_pre_hooks.values()):
            continue
        m.register_forward_pre_hook(_enter, with_kwargs=True)
        m.register_forward_hook(_leave, always_call=True)
    return names
