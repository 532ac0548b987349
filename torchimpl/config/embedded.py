"""The embedded tasks' names and the training settings that come with them; imports no torch.

``lm`` and ``mlp`` (built by :mod:`torchimpl.task.builtin`) train well with a larger learning rate
than the general default of ``optimizer.lr`` (1e-3, meant for a user's model) and a short
warmup. These settings are the one source for ``ampspec train`` and ``ampspec compare``:
``load_config(..., task_defaults=True)`` (what both commands call) lays them under the
configuration file and ``--set`` when ``task.name`` is an embedded task, so a value the user
writes always wins, and a user's ``module:function`` task gets none of them; nor does a
configuration loaded without the flag to train one's own model from Python.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["EMBEDDED_TASKS", "TASK_DEFAULTS", "is_task_name", "with_task_defaults"]

EMBEDDED_TASKS = ("lm", "mlp")

# Chosen from runs of both tasks in fp32, bf16 and fp8 over 200 steps (the default train.steps):
# with lr 1e-3 the transformer is still far from the task at step 200 (loss about 1.3, and
# fp8 looked broken); with 3e-3 and 10 warmup steps every precision reaches about 0.02-0.03.
TASK_DEFAULTS: Mapping[str, Mapping[str, Mapping[str, Any]]] = MappingProxyType({
    "lm": MappingProxyType({"optimizer": {"lr": 3.0e-3}, "schedule": {"warmup_steps": 10}}),
    "mlp": MappingProxyType({"optimizer": {"lr": 3.0e-3}, "schedule": {"warmup_steps": 10}}),
})


def is_task_name(text: object) -> bool:
    """``lm``, ``mlp`` or ``module:function`` (a module's import name, a function name after the colon)."""
    if not isinstance(text, str):
        return False
    if text in EMBEDDED_TASKS:
        return True
    # A module by its import name (dotted identifiers), never a path: ``../x:make`` would reach
    # outside the working directory and importlib cannot import it anyway.
    module, sep, func = text.partition(":")
    return bool(sep) and all(part.isidentifier() for part in module.split(".")) and func.isidentifier()


def with_task_defaults(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` (a configuration as nested dicts) over the embedded task's settings, when
    ``task.name`` (default ``lm``) names one; the fields ``tree`` sets are kept as they are."""
    task = tree.get("task")
    name = task.get("name", "lm") if isinstance(task, Mapping) else "lm"
    defaults = TASK_DEFAULTS.get(name) if isinstance(name, str) else None
    out = dict(tree)
    if not defaults:
        return out
    for section, values in defaults.items():
        given = out.get(section)
        if given is None:
            out[section] = dict(values)
        elif isinstance(given, Mapping):  # anything else is left for the validation to name
            out[section] = {**values, **given}
    return out
