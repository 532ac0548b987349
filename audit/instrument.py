"""Instrumentation of torch's public AMP surface, installed for the length of an audit and removed after.

What is wrapped (each wrapper calls the original unchanged and reports to a `Recorder`):

- ``torch.amp.GradScaler``: ``__init__``, ``scale``, ``unscale_``, ``step``, ``update``,
  ``state_dict``, ``load_state_dict`` (class attributes: every scaler, whenever it was built),
  and the same methods where FSDP's ``ShardedGradScaler`` overrides them (its own ``scale``,
  ``unscale_`` and ``update``);
- ``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_``, ``clip_grads_with_norm_``: these are
  module functions that a loop may have bound by name before the audit began (``from
  torch.nn.utils import clip_grad_norm_``). Each public function is a thin ``torch.no_grad``
  wrapper around its implementation held in a closure cell; the audit swaps that cell, so every
  reference to the public object is seen. Where a torch version lays the function out
  otherwise, the module attributes are replaced instead;
- optimizer steps through torch's global step hooks (``register_optimizer_step_pre_hook`` and
  ``..._post_hook``; the pre-hook returns the step's arguments with a given closure wrapped, so
  that the recorder knows when it has run, `audit.closures`; both return at once while
  ``torch.compile`` traces a step, which the recorder then sees by its effects), ``Optimizer.zero_grad``,
  ``Optimizer.add_param_group`` (where an optimizer is built, and what device and dtype its
  parameters had), ``nn.Module.zero_grad``;
- ``LRScheduler.step`` and every torch scheduler that overrides it;
- ``torch.autocast`` entry and exit;
- ``Tensor.backward`` and ``torch.autograd.backward``;
- ``torch.save``.

Inside a compiled function (a whole compiled train step) the wrappers of calls Dynamo does not
trace (``Tensor.backward``, ``torch.autograd.backward``, ``Optimizer.zero_grad``, GradScaler's
methods) are functions Dynamo skips, run eagerly at torch's own graph break; the others run their
original alone while traced: the audit adds no graph break and no recompile (`_skipped_by_dynamo`).
Each wrapped method is one function: a call reports from it directly, with no layer between.

Nothing else of the user's program is touched. ``uninstall`` restores every original object.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable

import torch
import torch.nn.utils.clip_grad as _clip_mod
import torch.optim.lr_scheduler as _sched_mod
from torch.optim import optimizer as _optim_mod

from audit import _torch_compat

_frame_callback = _torch_compat.eval_frame_callback  # Dynamo's frame callback: None while no compiled code runs

__all__ = ["Instrumentation"]

_CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")


def _scaler_subclasses() -> list[type]:
    """The GradScaler subclasses in torch that override its methods (a torch built without
    distributed support has none)."""
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    except Exception:  # any import failure: no such scaler to audit
        return []
    return [ShardedGradScaler]


class Instrumentation:
    """Installs the wrappers that feed ``recorder``; one at a time per process."""

    _active: "Instrumentation | None" = None

    def __init__(self, recorder: Any) -> None:
        self.rec = recorder
        self._patches: list[tuple[Any, str, Any]] = []
        self._cells: list[tuple[Any, Any]] = []
        self._handles: list[Any] = []

    # ------------------------------------------------------------------ install / uninstall

    def install(self) -> None:
        if Instrumentation._active is not None:
            raise RuntimeError("an audit is already active in this process: audits do not nest")
        Instrumentation._active = self
        try:
            self._install_scaler()
            self._install_clipping()
            self._install_optimizers()
            self._install_schedulers()
            self._install_autocast()
            self._install_backward()
            self._install_save()
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        for cell, original in reversed(self._cells):
            cell.cell_contents = original
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._handles.clear()
        self._cells.clear()
        self._patches.clear()
        if Instrumentation._active is self:
            Instrumentation._active = None

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        wrapper = make(original)
        if callable(original) and callable(wrapper) and not isinstance(original, (staticmethod, classmethod)):
            functools.update_wrapper(wrapper, original)
        setattr(owner, name, wrapper)
        self._patches.append((owner, name, original))

    # ------------------------------------------------------------------ the wrappers

    def _install_scaler(self) -> None:
        cls = torch.amp.GradScaler
        self._patch(cls, "__init__", _scaler_init(self.rec))
        active: set[tuple[int, str]] = set()
        methods = _scaler_methods(self.rec, active)
        for owner in (cls, *_scaler_subclasses()):
            for name, make in methods.items():
                if name in owner.__dict__:
                    # Dynamo-skipped as torch skips GradScaler's own methods: inside a compiled
                    # function the scaler's calls, with their reports, run eagerly.
                    self._patch(owner, name, lambda orig, make=make, outer=owner is not cls: make(orig, outer))

    def _install_clipping(self) -> None:
        rec = self.rec
        for name in _CLIP_FUNCTIONS:
            public = getattr(torch.nn.utils, name, None)
            if public is None:
                continue  # a torch without this function
            kind = name
            cell = _impl_cell(public)
            impl = cell.cell_contents if cell is not None else public
            bind = _binder(inspect.signature(impl))

            def make(impl, kind=kind, bind=bind):
                def wrapper(*args, **kwargs):
                    if rec.in_clip or torch.compiler.is_compiling():
                        return impl(*args, **kwargs)  # traced: the original alone (`_skipped_by_dynamo`)
                    arguments = bind(args, kwargs)
                    parameters = arguments["parameters"]
                    if isinstance(parameters, torch.Tensor):
                        tensors = [parameters]
                    else:
                        tensors = list(parameters)
                        # An empty generator stays a generator, which keeps torch's own "empty
                        # generator" warning intact; torch reads any other as a list.
                        parameters = (t for t in tensors) if not tensors and isinstance(parameters, types.GeneratorType) \
                            else tensors
                        arguments["parameters"] = parameters
                    rec.on_clip_begin(kind, tensors, arguments)
                    ok = False
                    result = None
                    try:
                        result = impl(**arguments)
                        ok = True
                        return result
                    finally:
                        rec.on_clip_end(kind, result, ok)
                return wrapper

            wrapped = make(impl)
            functools.update_wrapper(wrapped, impl)
            if cell is not None:
                self._cells.append((cell, impl))
                cell.cell_contents = wrapped
            else:
                for owner in (torch.nn.utils, _clip_mod):
                    if getattr(owner, name, None) is public:
                        setattr(owner, name, wrapped)
                        self._patches.append((owner, name, public))

    def _install_optimizers(self) -> None:
        rec = self.rec
        # A step traced by torch.compile (``torch.compile(opt.step)``, a compiled train step) runs
        # these hooks while Dynamo traces it: there they return at once, so the audit adds no graph
        # break and no recompile, and the compiled step is seen afterwards (`audit.track_optimizer`).
        def pre_hook(opt, args, kwargs):
            if torch.compiler.is_compiling():
                return None
            return rec.on_optimizer_step_begin(opt, args, kwargs)

        def post_hook(opt, args, kwargs):
            if torch.compiler.is_compiling():
                return None
            return rec.on_optimizer_step_end(opt)

        self._handles.append(_optim_mod.register_optimizer_step_pre_hook(pre_hook))
        self._handles.append(_optim_mod.register_optimizer_step_post_hook(post_hook))

        def zero_grad(orig):
            def wrapper(self, *args, **kwargs):
                if _frame_callback() is not None:  # compiled code runs: Dynamo-skipped (`_skipped_by_dynamo`)
                    return eager(self, *args, **kwargs)
                rec.on_zero_grad(self)
                return orig(self, *args, **kwargs)
            eager = _skipped_by_dynamo(wrapper)
            return wrapper

        def module_zero_grad(orig):
            def wrapper(self, *args, **kwargs):
                if torch.compiler.is_compiling():  # Dynamo traces Module.zero_grad: the original alone
                    return orig(self, *args, **kwargs)
                rec.on_zero_grad(self)
                return orig(self, *args, **kwargs)
            return wrapper

        def add_param_group(orig):
            def wrapper(self, param_group):
                out = orig(self, param_group)
                rec.on_params_added(self)
                return out
            return wrapper

        self._patch(torch.optim.Optimizer, "zero_grad", zero_grad)
        self._patch(torch.optim.Optimizer, "add_param_group", add_param_group)
        self._patch(torch.nn.Module, "zero_grad", module_zero_grad)

    def _install_schedulers(self) -> None:
        rec = self.rec
        classes = [c for c in vars(_sched_mod).values()
                   if isinstance(c, type) and issubclass(c, _sched_mod.LRScheduler) and "step" in c.__dict__]

        def step(orig):
            def wrapper(self, *args, **kwargs):
                # The constructor's own first step runs with _step_count == 0: not the user's call.
                initial = getattr(self, "_step_count", None) == 0
                rec.on_scheduler_step_begin(self, initial)
                try:
                    return orig(self, *args, **kwargs)
                finally:
                    rec.on_scheduler_step_end(self, initial)
            return wrapper

        for c in classes:
            self._patch(c, "step", step)

    def _install_autocast(self) -> None:
        rec = self.rec
        cls = torch.amp.autocast_mode.autocast

        def enter(orig):
            def wrapper(self):
                out = orig(self)
                if not torch.compiler.is_compiling():  # traced: the original alone (`_skipped_by_dynamo`)
                    rec.on_autocast_enter(self)
                return out
            return wrapper

        def exit_(orig):
            def wrapper(self, *exc):
                if not torch.compiler.is_compiling():
                    rec.on_autocast_exit(self)
                return orig(self, *exc)
            return wrapper

        self._patch(cls, "__enter__", enter)
        self._patch(cls, "__exit__", exit_)

    def _install_backward(self) -> None:
        rec = self.rec

        def tensor_backward(orig):
            def wrapper(self, gradient=None, retain_graph=None, create_graph=False, *args, **kwargs):
                if _frame_callback() is not None:  # compiled code runs: Dynamo-skipped (`_skipped_by_dynamo`)
                    return eager(self, gradient, retain_graph, create_graph, *args, **kwargs)
                rec.on_backward_begin(self, gradient, retain_graph if retain_graph is not None else create_graph)
                args = (gradient, retain_graph, create_graph, *args)
                ok = False
                try:
                    out = orig(self, *args, **kwargs)
                    ok = True
                    return out
                finally:
                    rec.on_backward_end(ok)
            eager = _skipped_by_dynamo(wrapper)
            return wrapper

        def autograd_backward(orig):
            def wrapper(tensors, *args, **kwargs):
                if _frame_callback() is not None:
                    return eager(tensors, *args, **kwargs)
                if rec._bw_depth:
                    # Inside a backward the recorder saw begin (Tensor.backward calls this one): a
                    # nested pass is not reported (the recorder would only count its depth).
                    return orig(tensors, *args, **kwargs)
                grads = args[0] if args else kwargs.get("grad_tensors", kwargs.get("grad_variables"))
                retain = args[1] if len(args) > 1 else kwargs.get("retain_graph")
                create = args[2] if len(args) > 2 else kwargs.get("create_graph", False)
                rec.on_backward_begin(tensors, grads, retain if retain is not None else create)
                ok = False
                try:
                    out = orig(tensors, *args, **kwargs)
                    ok = True
                    return out
                finally:
                    rec.on_backward_end(ok)
            eager = _skipped_by_dynamo(wrapper)
            return wrapper

        self._patch(torch.Tensor, "backward", tensor_backward)
        self._patch(torch.autograd, "backward", autograd_backward)

    def _install_save(self) -> None:
        rec = self.rec
        original = torch.save

        def save(orig):
            def wrapper(obj, *args, **kwargs):
                rec.on_save(obj)
                return orig(obj, *args, **kwargs)
            return wrapper

        wrapped = save(original)
        functools.update_wrapper(wrapped, original)
        for owner in (torch, torch.serialization):
            if getattr(owner, "save", None) is original:
                setattr(owner, "save", wrapped)
                self._patches.append((owner, "save", original))


def _skipped_by_dynamo(wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """Makes ``wrapper``, the audit's wrapper of a call Dynamo does not trace (``Tensor.backward``,
    ``torch.autograd.backward``, ``Optimizer.zero_grad``: torch breaks the graph at it; GradScaler's
    methods: torch skips them), a function Dynamo skips, and returns the version of it that runs
    with Dynamo off (``torch._disable_dynamo``, as torch itself makes ``Optimizer.zero_grad``).

    Inside a compiled function (a whole compiled train step) Dynamo does not inline ``wrapper``
    (``_torchdynamo_disable``): the graph breaks at the same call as without the audit, and there,
    or wherever compiled code calls it, Dynamo's frame callback is set and ``wrapper`` calls the
    returned version, which unsets it: the call, with its report, runs eagerly, and Dynamo never
    traces the audit's bookkeeping. Its own frame is never compiled (`audit._torch_compat.skip_code`,
    torch's ``skip_code``). Where no callback is set (no compiled code runs: an eager loop)
    ``wrapper`` reports directly, without the disabled version's cost (it sets and restores the
    callback, 1-2 us a call, seven calls a step). (``torch._dynamo`` is imported at the disabled
    version's first call, as torch's own ``zero_grad`` imports it.) A call Dynamo does trace
    (``Module.zero_grad``, the clipping functions, autocast's entry and exit) runs its original
    alone while traced: the audit's bookkeeping would break the graph, so that call is not seen."""
    wrapper._torchdynamo_disable = True  # type: ignore[attr-defined]
    _torch_compat.skip_code(wrapper.__code__)
    return torch._disable_dynamo(wrapper)


def _scaler_init(rec: Any) -> Callable[[Any], Any]:
    """The wrapper maker of GradScaler's ``__init__``: the scaler is made, then reported."""

    def make(orig):
        def wrapper(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            rec.on_scaler_created(self)
            return out
        return wrapper

    return make


def _scaler_methods(rec: Any, active: set[tuple[int, str]]) -> dict[str, Callable[[Any, bool], Any]]:
    """The wrapper makers of GradScaler's reported methods, feeding ``rec``: ``make(orig, outer)``,
    one function per method, Dynamo-skipped (`_skipped_by_dynamo`).

    An override may call the base's (``super().update()``): one call of the program reports once,
    from the outermost wrapper. ``outer``: the wrapper of an override, which marks its call
    ``active`` while it runs; the base class's wrapper (``outer`` False) only reads the mark (no
    override wraps it from outside: nothing to mark, every step)."""
    return {"scale": functools.partial(_scale, rec, active),
            "unscale_": functools.partial(_unscale, rec, active),
            "step": functools.partial(_step, rec, active),
            "update": functools.partial(_update, rec, active),
            "state_dict": functools.partial(_after, rec.on_scaler_state_dict, "state_dict", active),
            "load_state_dict": functools.partial(_after, rec.on_scaler_loaded, "load_state_dict", active)}


def _scale(rec: Any, active: set[tuple[int, str]], orig: Any, outer: bool) -> Any:
    """``scale(outputs)``: the call, then ``rec.on_scale`` with what it returned."""

    def wrapper(self, outputs, *args, **kwargs):
        if _frame_callback() is not None:
            return eager(self, outputs, *args, **kwargs)
        if active and (id(self), "scale") in active:  # inside an override's call, which reports it
            return orig(self, outputs, *args, **kwargs)
        if outer:
            active.add((id(self), "scale"))
        try:
            out = orig(self, outputs, *args, **kwargs)
            rec.on_scale(self, outputs, out)
            return out
        finally:
            if outer:
                active.discard((id(self), "scale"))
    eager = _skipped_by_dynamo(wrapper)
    return wrapper


def _unscale(rec: Any, active: set[tuple[int, str]], orig: Any, outer: bool) -> Any:
    """``unscale_(optimizer)`` between ``rec.on_unscale_begin`` and ``on_unscale_end`` (with whether it returned)."""

    def wrapper(self, optimizer):
        if _frame_callback() is not None:
            return eager(self, optimizer)
        if active and (id(self), "unscale_") in active:  # inside an override's call, which reports it
            return orig(self, optimizer)
        if outer:
            active.add((id(self), "unscale_"))
        try:
            rec.on_unscale_begin(self, optimizer)
            ok = False
            try:
                out = orig(self, optimizer)
                ok = True
                return out
            finally:
                rec.on_unscale_end(self, optimizer, ok)
        finally:
            if outer:
                active.discard((id(self), "unscale_"))
    eager = _skipped_by_dynamo(wrapper)
    return wrapper


def _step(rec: Any, active: set[tuple[int, str]], orig: Any, outer: bool) -> Any:
    """``step(optimizer, ...)`` between ``rec.on_scaler_step_begin`` and ``on_scaler_step_end``."""

    def wrapper(self, optimizer, *args, **kwargs):
        if _frame_callback() is not None:
            return eager(self, optimizer, *args, **kwargs)
        if active and (id(self), "step") in active:  # inside an override's call, which reports it
            return orig(self, optimizer, *args, **kwargs)
        if outer:
            active.add((id(self), "step"))
        try:
            rec.on_scaler_step_begin(self, optimizer, closure="closure" in kwargs)
            ok = False
            try:
                out = orig(self, optimizer, *args, **kwargs)
                ok = True
                return out
            finally:
                rec.on_scaler_step_end(self, optimizer, ok)
        finally:
            if outer:
                active.discard((id(self), "step"))
    eager = _skipped_by_dynamo(wrapper)
    return wrapper


def _update(rec: Any, active: set[tuple[int, str]], orig: Any, outer: bool) -> Any:
    """``update(new_scale)`` between ``rec.on_update_begin`` and ``on_update_end``."""

    def wrapper(self, new_scale=None):
        if _frame_callback() is not None:
            return eager(self, new_scale)
        if active and (id(self), "update") in active:  # inside an override's call, which reports it
            return orig(self, new_scale)
        if outer:
            active.add((id(self), "update"))
        try:
            rec.on_update_begin(self, new_scale)
            ok = False
            try:
                out = orig(self, new_scale)
                ok = True
                return out
            finally:
                rec.on_update_end(self, new_scale, ok)
        finally:
            if outer:
                active.discard((id(self), "update"))
    eager = _skipped_by_dynamo(wrapper)
    return wrapper


def _after(report: Callable[[Any], None], name: str, active: set[tuple[int, str]], orig: Any, outer: bool) -> Any:
    """``state_dict``/``load_state_dict``: the call, then ``report(scaler)``."""

    def wrapper(self, *args, **kwargs):
        if _frame_callback() is not None:
            return eager(self, *args, **kwargs)
        if active and (id(self), name) in active:  # inside an override's call, which reports it
            return orig(self, *args, **kwargs)
        if outer:
            active.add((id(self), name))
        try:
            out = orig(self, *args, **kwargs)
            report(self)
            return out
        finally:
            if outer:
                active.discard((id(self), name))
    eager = _skipped_by_dynamo(wrapper)
    return wrapper


def _binder(signature: inspect.Signature) -> Callable[[tuple, dict], dict[str, Any]]:
    """``signature.bind`` with its defaults applied, as a dict: for the plain case (positional or
    keyword parameters, every one given or defaulted, no name twice) without the cost of
    `inspect`'s general binding, which a clipping call per step would pay; any other call goes
    through ``signature.bind`` (and its TypeError)."""
    params = signature.parameters
    names = tuple(params)
    defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}
    plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params.values())

    def general(args: tuple, kwargs: dict) -> dict[str, Any]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def bind(args: tuple, kwargs: dict) -> dict[str, Any]:
        if not plain or len(args) > len(names) or any(k not in params or k in names[:len(args)] for k in kwargs):
            return general(args, kwargs)
        arguments = {**defaults, **dict(zip(names, args)), **kwargs}
        if len(arguments) != len(names):  # a required argument missing
            return general(args, kwargs)
        return {n: arguments[n] for n in names}  # in the signature's order, as bind gives them

    return bind


def _impl_cell(public: Any) -> Any:
    """The closure cell holding a clipping function's implementation, or None when the public
    function is not laid out as torch 2.x's ``_no_grad`` wrapper (one free variable ``func``)."""
    code = getattr(public, "__code__", None)
    closure = getattr(public, "__closure__", None)
    if code is None or not closure or code.co_freevars != ("func",):
        return None
    cell = closure[0]
    return cell if callable(cell.cell_contents) else None
