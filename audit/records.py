"""What the recorder keeps: call sites, the records of steps, the per-object tracks and the copies.

Pure bookkeeping, no rules: `audit.recorder` and its parts (`audit.track_scaler`,
`audit.track_optimizer`, `audit.track_program`) fill these as the instrumented calls arrive.
"""

from __future__ import annotations

import gc
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from audit import windows
from audit.frameworks import attribute, framework_of
from audit.findings import Finding, _jsonable
from audit.saved import classify as _classify  # noqa: F401  (audit.recorder re-exports it)
from audit.schedules import ScheduleWatch
from audit.windows import Backward

class StepLimitReached(BaseException):
    """Raised into the audited program when the step limit is reached.

    A BaseException, so that a loop's ``except Exception`` does not swallow it.
    """


# ---------------------------------------------------------------------------------- call sites

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_AUDIT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_DIRS = tuple(sorted({p + os.sep for p in (sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")) if p}))
_site_cache: dict[str, int] = {}


def _frame_class(filename: str) -> int:
    """0: the user's code; 1: a library (stdlib, site-packages, a framework wherever it is
    installed: an editable install too); 2: torch or this package."""
    c = _site_cache.get(filename)
    if c is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_TORCH_DIR) or path.startswith(_AUDIT_DIR):
            c = 2
        elif (path.startswith("<frozen") or any(path.startswith(d) for d in _LIBRARY_DIRS)
              or framework_of(filename) is not None):
            c = 1
        else:
            c = 0
        _site_cache[filename] = c
    return c


def call_site() -> str:
    """``file:line`` of the innermost frame of the user's code; else of the innermost library frame
    outside torch and this package (a loop driven by an installed framework). When a framework's
    code made the call, a `audit.frameworks.Site` naming it (`audit.frameworks.attribute`)."""
    f = sys._getframe(1)
    library: list[tuple[str, int]] = []  # the library frames inside the user's innermost one
    first = None  # the innermost library frame
    classes = _site_cache
    while f is not None:
        name = f.f_code.co_filename
        try:  # a subscript, not .get: a few frames a call, nine calls a step; a miss once per file
            c = classes[name]
        except KeyError:
            c = _frame_class(name)
        if c == 0:
            if library:
                return attribute(_fmt(f), library, True)
            code = f.f_code
            hit = _places.get((id(code), f.f_lasti))  # `_place`'s cache, read here: eight call sites a step
            return hit[2] if hit is not None and hit[0] is code else _place(f)[1]
        if c == 1:
            first = first or f
            library.append((name, _place(f)[0]))
        f = f.f_back
    return attribute(_fmt(first), library, False) if library else "<unknown>"


_shown: dict[str, str] = {}
# (id(code), offset of its instruction) -> (code, line, "file:line"). The code object is kept, so
# that its id is not reused while its entry stands; one entry per place the audit was called from.
_places: dict[tuple[int, int], tuple[Any, int, str]] = {}


def _place(f: Any) -> tuple[int, str]:
    """The line of frame ``f`` and its ``file:line``, cached per instruction: Python 3.11 finds a
    frame's line by scanning its code's line table from the start, thousands of instructions a
    call in a long script, and a training loop calls from the same few places every step."""
    code, lasti = f.f_code, f.f_lasti
    try:
        hit = _places[id(code), lasti]
        if hit[0] is code:
            return hit[1], hit[2]
    except KeyError:
        pass
    name = code.co_filename
    shown = _shown.get(name)
    if shown is None:
        try:
            rel = os.path.relpath(name)
            shown = rel if not rel.startswith("..") else name
        except ValueError:
            shown = name
        _shown[name] = shown
    line = f.f_lineno
    _places[(id(code), lasti)] = (code, line, f"{shown}:{line}")
    return line, f"{shown}:{line}"


def _fmt(f: Any) -> str:
    return _place(f)[1]


# ---------------------------------------------------------------------------------- records


@dataclass
class StepRecord:
    """One optimizer step as the audit saw it (the JSON report's ``steps``).

    The spec's ``StepRecord`` fields (``step, microbatches, scale_before, found_inf, applied,
    grad_norm, clip_coef, scale_after, growth_tracker, lr``) where the loop makes them known, plus
    the optimizer, the order of calls and each group's hyperparameters. ``scale_before`` is the
    scale the window's losses were scaled by, None without a scaler; ``found_inf`` is the
    scaler's flag, None when no scaler checked; ``grad_norm`` the first ``clip_grad_norm_``'s
    returned norm (``clip_coef`` is not returned by torch: the replay computes it).
    """

    step: int
    optimizer: str
    microbatches: int
    calls: list[str]
    scale_before: float | None = None
    found_inf: bool | None = None
    applied: bool = True
    grad_norm: float | None = None
    max_norm: float | None = None
    clip_coef: float | None = None
    scale_after: float | None = None
    growth_tracker: int | None = None
    lr: float | None = None
    hyperparameters: list[dict[str, Any]] = field(default_factory=list)
    replay: str = "off"

    def to_dict(self) -> dict[str, Any]:
        return {k: _jsonable(v) for k, v in self.__dict__.items()}


@dataclass
class ClipStage:
    """One clipping call on an optimizer's parameters: the replay's clip stage."""

    kind: str
    indices: list[int]
    arguments: dict[str, Any]
    where: str
    grads_in: list[Any] | None = None
    total_norm: Any = None
    threads: int = 1  # torch's intra-op threads at the call: its CPU norm's summation split follows them
    before_unscale: bool = False  # on gradients an enabled scaler had not unscaled yet


@dataclass
class StepData:
    """The numbers of one step for the replay (NumPy copies, bit for bit)."""

    scaled: list[Any] | None = None  # gradients at the window's first step-phase call
    scale: Any = None  # the float32 scale then, None without an enabled scaler
    first_stage: str = ""  # which call that was
    backward: list[Any] | None = None  # the gradients as the window's last scaled backward left them
    hooks: str | None = None  # the optimizer's own step hooks, which may change what it computes
    versions: list[Any] | None = None  # the gradients' (id, version counter) when ``backward`` was copied
    unscaled: bool = False  # whether scaler.unscale_ ran (explicitly or inside scaler.step)
    clips: list[ClipStage] = field(default_factory=list)
    step_grads: list[Any] | None = None
    params_before: list[Any] | None = None
    state_before: list[dict[str, Any]] | None = None
    groups: list[dict[str, Any]] | None = None
    group_of: list[int] | None = None
    params_after: list[Any] | None = None
    state_after: list[dict[str, Any]] | None = None
    torch_found_inf: float | None = None
    kernel_unscale: bool = False  # an amp-aware (fused) optimizer received scaled gradients
    amp_aware: bool = False
    on_cpu: bool = True
    unsupported: str | None = None  # why nothing of this step is copied (the replay names it)
    unsampled: bool = False  # a step the replay's sampling leaves out (audit.sampling): nothing copied
    sample: Any = None  # the optimizer stage's sample (an audit.sampling.StepSample), None: whole
    compiled: bool = False  # a compiled step: replayed through reference.compile's rules

    @property
    def copying(self) -> bool:
        return self.unsupported is None and not self.unsampled


@dataclass
class Window:
    backwards: list[Backward] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    data: StepData | None = None
    scaler: "ScalerTrack | None" = None  # the enabled scaler that scaled this window's losses
    zero_flagged: bool = False
    clip_flagged: bool = False
    autocast_flagged: bool = False
    clip_norms: list[tuple[float, float | None]] = field(default_factory=list)  # (total_norm, max_norm)
    versions: list[int] | None = None  # the parameters' version counters after the last backward
    state: list[Any] | None = None  # the optimizer state's signature after the last backward (`audit.track_optimizer`)
    hooked: bool = False  # a step hook fired, of an optimizer sharing these parameters, since the last backward


class ScalerTrack:
    def __init__(self, obj: Any, label: str, where: str | None) -> None:
        self.obj = obj
        self.label = label
        self.where = where
        self.used = False
        self.loaded = False
        self.updates = 0
        # id(optimizer) -> its place in the call sequence, the spec's (`audit.sequence`); READY when absent.
        self.stage: dict[int, Any] = {}
        self.call: dict[int, Any] = {}  # id(optimizer) -> its unscale_ or step in progress (a StageCall)
        self.bypass: dict[int, tuple["OptTrack", str]] = {}
        self.reported_no_update: set[int] = set()
        self.pending: list[tuple["OptTrack", StepData | None, StepRecord]] = []
        self.update_before: tuple[Any, int] | None = None
        self.expected_after: Any = None  # the spec's scale after this scaler's last checked update
        # The parameters of every optimizer it unscaled or stepped (weakly: a finished training's
        # model may go, and a new parameter may then reuse an old one's id).
        self.params: dict[int, Any] = {}
        self.driven: dict[int, "OptTrack"] = {}  # id(optimizer) -> those optimizers
        # At its first scale(), after other enabled scalers completed updates: (those scalers, where
        # it began, whether its state was loaded first); read when it first drives an optimizer.
        self.mid_run: tuple[list["ScalerTrack"], str, bool] | None = None
        # GradScaler's own is_enabled reads ``_enabled``: read here directly, without the call
        # (nine a step); an override of it is called.
        self._own_flag = getattr(type(obj), "is_enabled", None) is _SCALER_IS_ENABLED

        self._own_scale = getattr(type(obj), "get_scale", None) is _SCALER_GET_SCALE
        self._scale_read: tuple[Any, int, float] | None = None  # (its scale tensor, version, value)

    @property
    def enabled(self) -> bool:
        return bool(self.obj._enabled if self._own_flag else self.obj.is_enabled())

    def scale(self) -> float:
        """``get_scale()``, read from the scale tensor once per change of it: while the tensor
        and its version counter are those of the last read (every in-place write of torch's,
        update's, load_state_dict's, advances it), the value is that read's. A host read each
        time saved (a sync on a GPU; the clipping check and the step's record each read it)."""
        obj = self.obj
        t = getattr(obj, "_scale", None) if self._own_scale and obj._enabled else None
        last = self._scale_read
        if last is not None and last[0] is t:  # a tensor read before: not an inference tensor (no version)
            if last[1] == t._version:
                return last[2]
        elif t is None or t.is_inference():
            return obj.get_scale()
        value = obj.get_scale()
        self._scale_read = (t, t._version, value)
        return value


_SCALER_IS_ENABLED = torch.amp.GradScaler.is_enabled
_SCALER_GET_SCALE = torch.amp.GradScaler.get_scale


class OptTrack:
    def __init__(self, obj: Any, label: str, where: str | None) -> None:
        self.obj = obj
        self.label = label
        self.where = where
        self.meta: dict[int, tuple[Any, Any, Any]] = {}  # id(p) -> (p, device, dtype) when received
        self.param_ids: frozenset[int] = frozenset()
        self.steps = 0
        self.window = Window()
        self.last_record: StepRecord | None = None
        self.applied_steps = 0
        self.moved_flagged = False
        self.threshold: tuple[float, float, int] | None = None  # (max_norm / scale, scale, first step)
        self.threshold_flagged = False
        self.threshold_finding: Finding | None = None
        self.hook_fired = False
        self.eager_seen = False  # a step hook of its ran outside torch.compile
        self.compiled_steps = 0  # its steps seen by their effects only (compiled: audit.track_optimizer)
        self.scaler_step_where: str | None = None
        self.schedule = ScheduleWatch()
        self.skipped = 0
        self.closure: Any = None  # the step in progress that received a closure (audit.closures.ClosureStep)
        self.stepping = False  # between its step's pre- and post-hook
        self.runs: str | None = None  # the optimizer whose step its step in progress ran (a wrapper's base)
        self.names: list[str] | None = None  # its parameters' names, found once it holds 16-bit ones (lost updates)

    def params(self) -> list[Any]:
        return [p for g in self.obj.param_groups for p in g["params"]]

    def refresh_ids(self) -> None:
        self.param_ids = frozenset(id(p) for p in self.params())


def parameter_names(opt: Any, params: list[Any]) -> list[str]:
    """Each of ``params``' names (``opt``'s parameters in ``param_groups`` order): the group's
    ``param_names`` (an optimizer built from ``named_parameters()``), else the parameter's name
    in the live ``nn.Module`` with the most parameters that holds it (the model, not a layer),
    else "" (the report then names its index)."""
    names: list[str] = []
    for g in opt.param_groups:
        given = g.get("param_names")
        names += [str(n) for n in given] if given and len(given) == len(g["params"]) else [""] * len(g["params"])
    wanted = {id(p): i for i, p in enumerate(params) if i < len(names) and not names[i]}
    if not wanted:
        return names
    best: dict[int, int] = {}  # index -> parameters of the module its name comes from
    for obj in gc.get_objects():  # once per optimizer that holds 16-bit parameters: the modules are live now
        if not issubclass(type(obj), torch.nn.Module):  # type(), not isinstance: no proxy's __class__ is read
            continue
        try:
            named = list(obj.named_parameters())
        except Exception:  # a module whose parameters cannot be listed names nothing
            continue
        for name, p in named:
            i = wanted.get(id(p))
            if i is not None and len(named) > best.get(i, 0):
                names[i], best[i] = name, len(named)
    return names


# ---------------------------------------------------------------------------------- snapshots


def plain_tensor(t: torch.Tensor) -> bool:
    """A tensor NumPy can copy: not a subclass such as DTensor (a Parameter is plain)."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def to_numpy(t: torch.Tensor) -> Any:
    """A NumPy (ml_dtypes for bfloat16) copy of ``t`` with exactly its bits."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes  # here: an audit without bfloat16 copies never loads it

        return t.cpu().contiguous().view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return t.cpu().numpy().copy()


class Snapshots:
    """Bit-exact NumPy copies of tensors, taken when the recorder needs them, for the step data
    ``owner`` they belong to.

    Every copy is a new one: torch's in-place version counter cannot tell whether a tensor
    changed since an earlier copy (the scaler's unscale kernel, for one, leaves it as it was).
    ``pool``: where the copies go (the replay process's shared memory, `audit.worker`), None
    for ordinary arrays.
    """

    def __init__(self, pool: Any = None) -> None:
        self.pool = pool

    def __call__(self, t: torch.Tensor, owner: Any) -> Any:
        return self.many([t], owner)[0]

    def many(self, tensors: list[torch.Tensor], owner: Any, sample: Any = None) -> list[Any]:
        """Copies of ``tensors`` (one per parameter when ``sample``, an `audit.sampling.StepSample`,
        is given: of each only its sampled elements, flat, and None for a tensor left out)."""
        if sample is not None:
            if not _fits(sample, tensors):
                return [None] * len(tensors)  # the replay names the step not replayed
            return self._sampled(list(enumerate(tensors)), owner, sample)
        if self.pool is not None and tensors:
            out = self.pool.copy(tensors, owner)
            if out is not None:
                return out
        return [to_numpy(t) for t in tensors]

    def grads(self, params: list[Any], owner: Any, sample: Any = None) -> list[Any]:
        if sample is not None:
            return self.many([p.grad for p in params], owner, sample)
        present = [p.grad for p in params if p.grad is not None]
        copies = iter(self.many(present, owner))
        return [None if p.grad is None else next(copies) for p in params]

    def state(self, opt: Any, params: list[Any], owner: Any, sample: Any = None) -> list[dict[str, Any]]:
        """Each parameter's optimizer state; with ``sample``, of a tensor of the parameter's shape
        only the sampled elements (a step counter or a factored statistic whole), and an empty
        state for a parameter left out."""
        states = [opt.state.get(p, {}) for p in params]
        placed = [(i, v) for i, s in enumerate(states) for v in s.values() if isinstance(v, torch.Tensor)]
        if sample is not None:
            if not _fits(sample, params):
                return [{} for _ in params]
            shaped = [(i, v if v.shape == params[i].shape else _Whole(v)) for i, v in placed]
            copies = iter(self._sampled(shaped, owner, sample))
        else:
            copies = iter(self.many([v for _, v in placed], owner))
        # Every state's copies are taken from the iterator in order, a left-out parameter's (None) too.
        out = [{k: (next(copies) if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for s in states]
        return out if sample is None else [{} if sample.omitted(i) else st for i, st in enumerate(out)]

    def _sampled(self, placed: list[tuple[int, Any]], owner: Any, sample: Any) -> list[Any]:
        """Of each tensor of ``placed`` (with the index of its parameter): None when that
        parameter is left out (or the tensor is None), else its sampled elements (gathered by
        index: exactly its bits) or the whole tensor (a `_Whole` one, or a parameter taken whole)."""
        picked: list[Any] = []
        for i, t in placed:
            if t is None or sample.omitted(i):
                picked.append(None)
            elif isinstance(t, _Whole) or sample.whole(i):
                picked.append(t.tensor if isinstance(t, _Whole) else t)
            else:
                picked.append(t.detach().reshape(-1).index_select(0, _index_tensor(sample, i)))
        present = [t for t in picked if t is not None]
        copies = iter(self.many(present, owner))
        return [None if t is None else next(copies) for t in picked]


def _fits(sample: Any, tensors: list[Any]) -> bool:
    """Whether the sample was made for tensors of these shapes (one per parameter; None: no gradient):
    parameters added or reshaped since it was made leave the step's optimizer stage uncopied."""
    return len(tensors) == len(sample.shapes) and all(t is None or tuple(t.shape) == s
                                                      for t, s in zip(tensors, sample.shapes))


@dataclass(frozen=True)
class _Whole:
    """A state tensor not of its parameter's shape: copied whole under a sample."""

    tensor: torch.Tensor


def _index_tensor(sample: Any, i: int) -> torch.Tensor:
    """The sampled flat indices of tensor ``i`` as a torch index (made once per run, kept in the sample's memo)."""
    ix = sample.memo.get(("torch", i))
    if ix is None:
        ix = sample.memo[("torch", i)] = torch.from_numpy(np.array(sample.indices(i)))
    return ix



def _step_call(rec: StepRecord) -> str:
    """Where the step of ``rec`` was taken (its scaler.step or optimizer.step)."""
    return next((c.split("@", 1)[1] for c in reversed(rec.calls) if c.startswith(("scaler.step@", "optimizer.step@"))),
                "?")


def s_where(o: OptTrack) -> str:
    """Where the optimizer's latest scaler.step was called."""
    return o.scaler_step_where or "?"


def _unwrap_optimizer(obj: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Accelerate's and Lightning's keep it in
    ``.optimizer``), else ``obj``."""
    for _ in range(4):
        inner = getattr(obj, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is obj:
            return obj
        obj = inner
    return obj


def _pairs(inputs: Any, out: Any) -> list[tuple[Any, Any]]:
    if isinstance(inputs, torch.Tensor) and isinstance(out, torch.Tensor):
        return [(inputs, out)]
    if isinstance(inputs, (list, tuple)) and isinstance(out, (list, tuple)) and len(inputs) == len(out):
        return [p for a, b in zip(inputs, out) for p in _pairs(a, b)]
    return []


def _loss_factor(t: Any) -> float | None:
    """The product of the constant multiplications and divisions between ``t`` and the loss
    (rule loss-not-divided in the module docstring); None when it cannot be read."""
    return windows.describe(t, False, False)[0]


def _signature(o: OptTrack) -> list[tuple[Any, int]]:
    # Each gradient read once: torch's ``.grad`` getter costs a few hundred nanoseconds a call.
    return [(None, -1) if (g := p.grad) is None else (id(g), g._version) for p in o.params()]


def _touched(o: OptTrack, before: list[tuple[Any, int]] | None) -> list[int]:
    """The ids of ``o``'s parameters whose gradient a backward pass changed (all with one, when
    the state before is unknown)."""
    params = o.params()
    if before is None or len(before) != len(params):
        return [id(p) for p in params if p.grad is not None]
    return [id(p) for p, s in zip(params, before)
            if (g := p.grad) is not None and (id(g), g._version) != s]


def _found_inf(scaler: Any, opt: Any) -> float | None:
    state = scaler._per_optimizer_states.get(id(opt)) if hasattr(scaler, "_per_optimizer_states") else None
    if not state or not state.get("found_inf_per_device"):
        return None
    return float(sum(float(v.item()) for v in state["found_inf_per_device"].values()))


def _f32(x: Any) -> Any:
    return np.float32(x)


def _num(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError, RuntimeError):
        return None


_PLAIN = frozenset((bool, int, float, str, type(None)))


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings as the record keeps them (JSON values), its parameters left
    out; the plain values as they are, without a call each (a dozen a group, every step)."""
    plain = _PLAIN
    return {k: v if type(v) in plain else _jsonish(v) for k, v in group.items() if k != "params"}


def _jsonish(v: Any) -> Any:
    if type(v) in _PLAIN:  # most of a group's settings, every step: no isinstance chain
        return v
    if isinstance(v, torch.Tensor):
        return float(v) if v.numel() == 1 else str(v)
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonish(x) for x in v]
    return str(v)
