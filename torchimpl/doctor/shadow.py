"""The fp32 shadow's optimizer kept in step with the mixed model's (``inspect`` rule 2).

Each step the shadow starts from the mixed optimizer's state. ``load_state_dict(deepcopy(
state_dict()))`` does that by deep-copying every state tensor (two per parameter for Adam) each
step, a new allocation each; ``copy_optimizer`` does what it does into the shadow's own tensors
(``bench/doctor_cost.py``). ``module_pairs`` pairs the shadow's modules with the mixed
model's once a run, and ``RngState`` lets both draw the same random numbers.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from torchimpl._torch_compat import _foreach_copy_

__all__ = ["RngState", "Snapshot", "copy_all", "copy_optimizer", "module_pairs"]


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, in one foreach call where torch has it (the same copies, one
    dispatch for the step's hundred-odd tensors instead of one each)."""
    if not dst:
        return
    with torch.no_grad():
        if _foreach_copy_ is not None:
            _foreach_copy_(dst, src)
            return
        for d, s in zip(dst, src):
            d.copy_(s)


class Snapshot:
    """Copies of a list of tensors taken each step into buffers made once a run (a clone per
    tensor is an allocation and a dispatch each, sixty a step for the doctor's two snapshots).
    ``take``'s copies are valid until the next ``take``."""

    def __init__(self) -> None:
        self._copies: list[torch.Tensor] = []
        self._layout: list[tuple] = []

    def take(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The values of ``tensors`` now, in buffers of their shapes, dtypes and devices."""
        layout = [(t.shape, t.stride(), t.dtype, t.device) for t in tensors]
        if layout != self._layout:
            self._copies = [torch.empty_like(t) for t in tensors]
            self._layout = [(c.shape, c.stride(), c.dtype, c.device) for c in self._copies]
            if self._layout != layout:  # a layout empty_like does not keep: clones, every step
                self._layout = []
                return [t.detach().clone() for t in tensors]
        copy_all(self._copies, tensors)  # under no_grad: no detach needed
        return self._copies


def copy_optimizer(src: torch.optim.Optimizer, dst: torch.optim.Optimizer) -> None:
    """Rule 2: what ``dst.load_state_dict(copy.deepcopy(src.state_dict()))`` does, without a deep
    copy of every tensor each step: the groups' settings copied; each parameter's state (matched
    by position, as ``load_state_dict`` matches them) copied into ``dst``'s own tensors, cast as
    ``load_state_dict`` casts (to the parameter's dtype; ``step`` as it is, or float32 on the
    parameter's device for a fused or capturable group); a parameter without state left without.
    A state holding anything but tensors and plain numbers takes ``load_state_dict``'s path."""
    src_params = [p for g in src.param_groups for p in g["params"]]
    dst_params = [(p, g) for g in dst.param_groups for p in g["params"]]
    plain = (int, float, bool, str, type(None))
    if len(src_params) != len(dst_params) or any(not isinstance(v, (torch.Tensor, *plain))
                                                 for st in src.state.values() for v in st.values()):
        dst.load_state_dict(copy.deepcopy(src.state_dict()))
        return
    for sg, dg in zip(src.param_groups, dst.param_groups):
        dg.update({k: v if isinstance(v, (*plain, tuple)) and all(isinstance(x, plain) for x in _items(v))
                   else copy.deepcopy(v) for k, v in sg.items() if k not in ("params", "param_names")})
    into: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    with torch.no_grad():
        for sp, (dp, group) in zip(src_params, dst_params):
            state = src.state.get(sp)
            if not state:
                dst.state.pop(dp, None)
                continue
            mine, new = dst.state.get(dp, {}), {}
            for k, v in state.items():
                new[k] = _state_copy(v, dp, k, group, mine.get(k), into, values) if isinstance(v, torch.Tensor) else v
            dst.state[dp] = new
    copy_all(into, values)


def _items(v: Any) -> tuple:
    return v if isinstance(v, tuple) else (v,)


def _state_copy(v: torch.Tensor, param: torch.Tensor, key: str, group: dict, old: Any,
                into: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """One state tensor as ``load_state_dict`` casts it: ``old`` where it has that form (the copy
    into it queued on ``into``/``values`` for ``copy_all``), else a new copy."""
    if key == "step":
        special = group.get("fused") or group.get("capturable")
        dtype, device = (torch.float32, param.device) if special else (v.dtype, v.device)
    else:
        dtype, device = (param.dtype if param.is_floating_point() else v.dtype), param.device
    if isinstance(old, torch.Tensor) and old is not v and old.shape == v.shape and old.dtype == dtype \
            and old.device == device:
        into.append(old)
        values.append(v)
        return old
    return v.detach().to(dtype=dtype, device=device, copy=True)


@dataclass(frozen=True)
class RngState:
    """Every random generator's state (Python, NumPy, torch's CPU and CUDA generators), as the
    generators themselves return it: ``run.checkpoint.capture_rng_state`` converts them to tensors
    for a checkpoint file, which costs more than the step's own restores (three a step)."""

    python: Any
    numpy: Any
    torch: torch.Tensor
    cuda: list[torch.Tensor]

    @staticmethod
    def capture() -> RngState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return RngState(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        for i, state in enumerate(self.cuda):
            torch.cuda.set_rng_state(state, i)


def module_pairs(shadow: nn.Module, mixed: nn.Module) -> list[tuple[nn.Module, nn.Module]] | None:
    """Each shadow module beside the mixed module of the same name, in ``state_dict``'s order;
    None where a module shapes its ``state_dict`` itself (hooks, extra state, its own
    ``_save_to_state_dict``: torchao's float8 layers may) or the names differ: then the doctor's ``_align``
    walks ``state_dict`` each step, a walk that costs more than the copies it makes."""
    def plain(m: nn.Module) -> bool:
        return not (m._state_dict_hooks or m._state_dict_pre_hooks) \
            and type(m)._save_to_state_dict is nn.Module._save_to_state_dict \
            and type(m).get_extra_state is nn.Module.get_extra_state

    theirs = dict(mixed.named_modules(remove_duplicate=False))
    mine = list(shadow.named_modules(remove_duplicate=False))
    if len(mine) != len(theirs) or not all(plain(m) for m in (*shadow.modules(), *mixed.modules())):
        return None
    if any(name not in theirs for name, _ in mine):
        return None
    return [(m, theirs[name]) for name, m in mine]
