"""What a user's task (``task.name: module:function``) must be, checked before it trains.

1. The module is the user's own: a module of Python's standard library (``os``, ``json``) is
   refused, and so is a ``module.py`` in the working directory that an installed module of the
   same name shadows; a module that fails to import (a syntax error, an exception at import)
   is named with the file and line, as Python would report them.
2. The function is a plain Python function taking no required argument (a builtin such as
   ``os.system``, a class, or a function that needs arguments is refused by name), and it is
   called once; an exception it raises is named with the task and the line.
3. It returns ``(model, train_data, val_data[, loss_fn])``: an ``nn.Module``, re-iterable
   batches (not a string, not a one-shot iterator), validation batches or None, a callable
   or None. When the data is a sequence, its first batch must hold tensors.
4. An exception raised while the task trains (its model, its loss, its data) is reported as the
   task's failure (:class:`TaskFailed`, exit 1), naming the task and the line.
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchimpl.task.failure import TaskFailed

__all__ = ["TaskFailed", "call_task", "check_imported", "check_module", "check_result", "holds_tensor", "import_failure",
           "task_failure"]


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _stdlib() -> frozenset[str]:
    return frozenset(getattr(sys, "stdlib_module_names", ())) | frozenset(sys.builtin_module_names)


def check_module(entry: str, module_name: str) -> None:
    """Rule 1, before the import."""
    top = module_name.split(".")[0]
    if top in _stdlib():
        own = Path.cwd() / f"{top}.py"
        mine = f"; {own} can never be imported under that name: rename it (e.g. {top}_task.py)" if own.exists() else ""
        raise ValueError(f"task.name {entry!r}: {top!r} is a module of Python's standard library, not a task "
                         f"module{mine}")


def check_imported(entry: str, module: Any) -> None:
    """Rule 1, after the import: the module came from the working directory's file when there is one."""
    top = module.__name__.split(".")[0]
    own = Path.cwd() / f"{top}.py"
    found = getattr(sys.modules.get(top), "__file__", None)
    if own.exists() and found is not None and Path(found).resolve() != own.resolve():
        raise ValueError(f"task.name {entry!r}: {own} is shadowed by the installed module {top!r} at {found}; "
                         f"rename your file (e.g. {top}_task.py)")


def import_failure(entry: str, module_name: str, exc: BaseException) -> ValueError:
    """Rule 1: what to say when importing the task's module raised ``exc``."""
    if isinstance(exc, SyntaxError):
        return ValueError(f"task.name {entry!r}: {exc.filename}:{exc.lineno}: {type(exc).__name__}: {exc.msg}")
    return ValueError(f"task.name {entry!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
                      f"{_where(exc)}")


def call_task(entry: str, func: Any) -> Any:
    """Rule 2: ``func()``, once it is known to be a plain function taking no required argument."""
    name = entry.partition(":")[2]
    if not inspect.isfunction(func):
        raise ValueError(f"task.name {entry!r}: {name} is a {type(func).__name__}, not a Python function; a task is "
                         "a function of yours, def make(): ... return model, train_data, val_data")
    required = [p.name for p in inspect.signature(func).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise ValueError(f"task.name {entry!r}: {name}() needs the arguments {required}; a task function is called "
                         "with none")
    try:
        return func()
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure is named, never a traceback
        raise ValueError(f"task.name {entry!r}: {name}() raised {type(exc).__name__}: {exc}{_where(exc)}") from None


def holds_tensor(batch: Any, depth: int = 0) -> bool:
    if isinstance(batch, torch.Tensor):
        return True
    if depth > 4 or isinstance(batch, (str, bytes)):
        return False
    if isinstance(batch, Mapping):
        return any(holds_tensor(v, depth + 1) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return any(holds_tensor(v, depth + 1) for v in batch)
    return False


def _check_data(entry: str, what: str, data: Any) -> None:
    if isinstance(data, (str, bytes)) or isinstance(data, Iterator) or not hasattr(data, "__iter__"):
        raise ValueError(f"task.name {entry!r}: {what} is a {type(data).__name__}; give re-iterable batches "
                         "(a list of batches, a DataLoader)")
    if isinstance(data, Sequence) and len(data) and not holds_tensor(data[0]):
        raise ValueError(f"task.name {entry!r}: {what}[0] is a {type(data[0]).__name__} holding no tensor; a batch "
                         "is a tensor, or a tuple, list or dict of tensors")


def check_result(entry: str, result: Any) -> None:
    """Rule 3."""
    if not isinstance(result, tuple) or len(result) not in (3, 4) or not isinstance(result[0], nn.Module):
        raise ValueError(
            f"task.name {entry!r}: the function must return (model, train_data, val_data[, loss_fn]) "
            f"with an nn.Module first, got {type(result).__name__}")
    _check_data(entry, "train_data", result[1])
    if result[2] is not None:
        _check_data(entry, "val_data", result[2])
    if len(result) == 4 and result[3] is not None and not callable(result[3]):
        raise ValueError(f"task.name {entry!r}: loss_fn is a {type(result[3]).__name__}, not a function "
                         "(model, batch) -> loss")


def task_failure(entry: str, exc: BaseException) -> TaskFailed | None:
    """Rule 4: ``exc`` as the task's failure, or None when ampspec's own code raised it (a
    refusal that already names its field)."""
    frames = traceback.extract_tb(exc.__traceback__)
    package = str(Path(__file__).resolve().parent.parent) + os.sep  # torchimpl/, above task/
    if frames and frames[-1].filename.startswith(package):
        return None
    text = " ".join(str(exc).split())[:500]
    return TaskFailed(f"task.name {entry!r} failed while training: {type(exc).__name__}: {text}{_where(exc)}")
