"""The private torch names the audit relies on, each with why it is needed.

The audit never imports torchimpl (it checks code it did not write, beside the trainer, not
through it), so it keeps its own list. The functions are resolved at import, so a torch that
moved one fails with the name and the torch version; the attributes, which only exist on
objects, are looked for by ``missing_names`` (``tests/test_torch_compat.py`` asserts that
nothing is missing).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

# (module, name, why) for every private function imported below.
IMPORTED: list[tuple[str, str, str]] = []


def _private(module: str, name: str, why: str) -> Any:
    IMPORTED.append((module, name, why))
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"torch {torch.__version__} has no {module}.{name}, a private torch name the audit "
                          f"needs ({why}); see audit/_torch_compat.py. ({type(e).__name__}: {e})") from None


_foreach_sqrt = _private("torch", "_foreach_sqrt",
                         "the replay takes Adam's square root with the kernel the foreach path uses")
eval_frame_callback = _private("torch._C._dynamo.eval_frame", "get_eval_frame_callback",
                               "a wrapper Dynamo skips runs its bookkeeping directly while no compiled "
                               "code runs (no callback set), without torch._disable_dynamo's per-call cost")
_set_code_exec_strategy = _private("torch._C._dynamo.eval_frame", "set_code_exec_strategy",
                                   "Dynamo never compiles the frame of such a wrapper itself (torch's skip_code)")
_FrameExecStrategy = _private("torch._C._dynamo.eval_frame", "_FrameExecStrategy", "skip_code's strategy")
_FrameAction = _private("torch._C._dynamo.eval_frame", "_FrameAction", "skip_code's actions")


def skip_code(code: Any) -> None:
    """``torch._dynamo.eval_frame.skip_code`` without importing ``torch._dynamo`` (an audit of a
    program that never compiles does not load it): a frame of ``code`` is never compiled,
    the frames it calls are treated as usual."""
    _set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))

GRAD_SCALER_ATTRIBUTES: dict[str, str] = {
    "_per_optimizer_states": "found_inf as the scaler recorded it for each optimizer",
    "_get_growth_tracker": "the growth counter before and after update, replayed through the spec",
    "_scale": "whether scale() ran (None before): the call sequence's first check, as torch makes it",
}
PER_OPTIMIZER_STATE_KEYS: dict[str, str] = {"found_inf_per_device": "the found_inf tensors of one optimizer"}
OPTIMIZER_FLAG = ("_step_supports_amp_scaling", "a fused optimizer unscales and skips inside its own kernel")
AUTOCAST_FLAG = ("_enabled", "whether a torch.autocast region the audited code entered is on")
SCHEDULER_COUNTER = ("_step_count", "the scheduler constructor's own first step (0) is not the user's call")
# How a DDP or FSDP2 module reduces gradients (audit.reductions), read from the live wrappers.
REDUCTION_ATTRIBUTES: dict[str, str] = {
    "DistributedDataParallel._comm_hooks": "the comm hooks registered on a DDP module (register_comm_hook keeps them)",
    "FSDPModule._get_fsdp_state": "an FSDP2 module's state, which holds its parameter groups",
    "FSDPState._fsdp_param_groups": "each group's MixedPrecisionPolicy, divide factor and force-sum flag",
}
# Mul/Div backward nodes keep a Python-scalar operand under these names: how the audit finds
# the constant a loss was multiplied by (a hand-made loss scale).
SAVED_OPERANDS = ("_saved_other", "_saved_self")


def missing_names() -> list[str]:
    """Every private name listed here that the installed torch does not have."""
    # On call: a torch without one of these names is reported here, not an ImportError at import.
    from torch.amp.grad_scaler import GradScaler, _refresh_per_optimizer_state

    missing = []
    for module, name, _ in IMPORTED:
        if getattr(importlib.import_module(module), name, None) is None:
            missing.append(f"{module}.{name}")
    missing += [f"GradScaler.{n}" for n in GRAD_SCALER_ATTRIBUTES if not hasattr(GradScaler("cpu"), n)]
    missing += [f"GradScaler._per_optimizer_states[...][{k!r}]" for k in PER_OPTIMIZER_STATE_KEYS
                if k not in _refresh_per_optimizer_state()]
    p = torch.nn.Parameter(torch.zeros(1))
    if getattr(torch.optim.Adam([p], fused=True), OPTIMIZER_FLAG[0], None) is not True:
        missing.append(f"torch.optim.Adam(fused=True).{OPTIMIZER_FLAG[0]}")
    if not hasattr(torch.autocast("cpu"), AUTOCAST_FLAG[0]):
        missing.append(f"torch.autocast.{AUTOCAST_FLAG[0]}")
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([p], lr=1.0), 1)
    if getattr(sched, SCHEDULER_COUNTER[0], None) != 1:
        missing.append(f"LRScheduler.{SCHEDULER_COUNTER[0]}")
    x = torch.ones(1, requires_grad=True)
    node = (x * 2.0).grad_fn
    missing += [f"MulBackward0.{n}" for n in SAVED_OPERANDS if not hasattr(node, n)]
    return missing
