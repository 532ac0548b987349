"""The audit's shortcuts that keep its overhead down give what the general code gives.

- the replay evaluates a built-in optimizer's magnitudes (``x_abs``) only at the elements a
  comparison asks for: equal, bit for bit, to the whole-parameter magnitudes at those elements;
- the clipping wrappers bind their arguments without `inspect`'s general binding: the same
  arguments, in the same order, and the same TypeError for a call torch would refuse;
- the replay process copies tensors of one dtype back to back in one call: each copy is the
  tensor, bit for bit, and reads back so in the worker.
"""

from __future__ import annotations

import inspect
import pickle
import types

import numpy as np
import pytest
import torch

from reference.optim import SPECS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _two_steps(spec, cfg, rng):
    """A parameter, its gradient and the states before and after a second step (moments non-zero)."""
    p = rng.standard_normal((6, 7)).astype(np.float32)
    g = rng.standard_normal((6, 7)).astype(np.float32)
    impl = "for-loop" if "for-loop" in spec.steps else next(iter(spec.steps))
    (p1,), _, (s1,) = spec.step(impl, [p], [g], (spec.init_state(p, cfg),), cfg)
    (_,), _, (s2,) = spec.step(impl, [p1], [g * np.float32(0.5)], (s1,), cfg)
    return p1, g * np.float32(0.5), s1, s2


def _elementwise() -> list[str]:
    return sorted(n for n, row in SPECS.items() if row.elementwise)


@pytest.mark.parametrize("name", _elementwise())
def test_magnitudes_at_some_elements_are_the_whole_parameters_at_them(name):
    from audit.replay import _magnitudes

    spec = SPECS[name]
    rng = np.random.default_rng(7)
    for options in ({}, {"weight_decay": 0.1}):
        try:
            cfg = spec.make_config(**options)
        except ValueError:
            continue
        values = _two_steps(spec, cfg, rng)
        full = spec.magnitudes(cfg, *values)
        at = _magnitudes(types.SimpleNamespace(spec=spec, builtin=True), cfg, values, exact=False)
        ix = np.sort(rng.choice(values[0].size, 9, replace=False))
        for fld, whole in full.items():
            got = at(fld)(ix)
            want = np.asarray(whole, np.float64).reshape(-1)[ix]
            assert got.dtype == np.float64 and np.array_equal(got.view(np.uint64), want.view(np.uint64)), \
                f"{name} {options} {fld}: {got} against {want}"


@pytest.mark.parametrize("name, builtin", [("Adam", False), ("Adafactor", True)])
def test_other_magnitudes_are_taken_over_the_whole_parameter(name, builtin):
    """A row the user registered need not be element-wise, and Adafactor's are not (its factored
    means): their magnitudes see the whole parameter, and are read at the elements asked for."""
    from audit.replay import _magnitudes

    spec = SPECS[name]
    cfg = spec.make_config()
    values = _two_steps(spec, cfg, np.random.default_rng(3))
    seen = []

    def whole_only(cfg, p, g, old, new):
        seen.append(p.shape)
        return spec.magnitudes(cfg, p, g, old, new)

    row = types.SimpleNamespace(spec=types.SimpleNamespace(magnitudes=whole_only, name=spec.name,
                                                         elementwise=spec.elementwise), builtin=builtin)
    ix = np.array([1, 5])
    got = _magnitudes(row, cfg, values, exact=False)("param")(ix)
    assert seen == [values[0].shape]
    assert np.array_equal(got, np.asarray(spec.magnitudes(cfg, *values)["param"], np.float64).reshape(-1)[ix])


def _bind_reference(signature, args, kwargs):
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


@pytest.mark.parametrize("name", ["clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"])
def test_the_clipping_wrappers_bind_as_inspect_does(name):
    from audit.instrument import _binder, _impl_cell

    public = getattr(torch.nn.utils, name)
    cell = _impl_cell(public)
    signature = inspect.signature(cell.cell_contents if cell is not None else public)
    bind = _binder(signature)
    names = list(signature.parameters)
    required = [n for n, p in signature.parameters.items() if p.default is p.empty]
    values = {n: ["p"] if n == "parameters" else 0.5 for n in names}
    need = tuple(values[n] for n in required)
    calls = [(need, {}), (need[:1], {n: values[n] for n in required[1:]}), ((), {n: values[n] for n in required}),
             (need, {"foreach": True}), (tuple(values[n] for n in names), {})]
    for args, kwargs in calls:
        got = bind(args, kwargs)
        assert got == _bind_reference(signature, args, kwargs) and list(got) == names, (args, kwargs)
    refused = [(need[:-1], {}), (need, {required[1]: 1.0}), (need, {"bogus": 1}),
               (tuple(values[n] for n in names) + (1,), {})]
    for args, kwargs in refused:
        with pytest.raises(TypeError) as ours:
            bind(args, kwargs)
        with pytest.raises(TypeError) as theirs:
            signature.bind(*args, **kwargs)
        assert str(ours.value) == str(theirs.value)


def test_the_replay_process_keeps_one_view_a_place_and_forgets_a_slabs_views_before_unmapping_it():
    """A step's arrays are found by place (slab, offset, dtype, shape), not made anew; a slab
    mapped again under its number, or dropped, leaves no view of the old mapping behind, and
    its mapping closes (a kept view would hold its buffer open)."""
    import mmap

    from audit import worker

    f32 = np.dtype(np.float32)
    first, second = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096)
    np.frombuffer(first, np.float32)[:4] = [1, 2, 3, 4]
    np.frombuffer(second, np.float32)[:4] = [5, 6, 7, 8]
    try:
        worker._map(0, first)
        a = worker._attach(0, 0, f32, (2, 2))
        assert worker._attach(0, 0, f32, (2, 2)) is a, "the same place gives the view made before"
        assert worker._attach(0, 4, f32, (3,)) is not a and not a.flags.writeable
        assert a.tolist() == [[1, 2], [3, 4]]
        worker._map(0, second)  # the number 0 now names another mapping
        assert worker._attach(0, 0, f32, (2, 2)).tolist() == [[5, 6], [7, 8]]
        del a
        worker._drop(0)
        assert second.closed and not any(k[0] == 0 for k in worker._WORKER_VIEWS), "the dropped slab's views are kept"
    finally:
        worker._WORKER_SLABS.clear()
        worker._WORKER_VIEWS.clear()
        first.close()
        if not second.closed:
            second.close()


@pytest.mark.skipif("not __import__('audit.worker').worker.available()")
def test_the_replay_process_copies_are_the_tensors_bit_for_bit():
    from audit import worker
    from audit.replay import Replayer

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 3, generator=g), torch.randn(4, generator=g).to(torch.bfloat16),
               torch.randn(3, 3, generator=g, dtype=torch.float64), torch.tensor(7.0), torch.zeros(0),
               torch.randn(6, 4, generator=g).t(), torch.arange(5), torch.tensor([True, False, True]),
               torch.randn(2, 2, generator=g).to(torch.bfloat16), torch.randn(7, generator=g)]

    class Owner:  # the step data the copies belong to (the pool holds it weakly)
        pass

    proc = worker.ReplayProcess(2, lambda: Replayer(mode="inline"))
    owner, copies = Owner(), None

    def as_read(arrays):
        """Each array's bytes as the worker reads them: its place, in the slabs the worker maps."""
        for slabs in proc._open.values():
            for slab in slabs[0]:
                worker._WORKER_SLABS[slab.id] = slab.map
        try:
            return [a.tobytes() for a in pickle.loads(pickle.dumps(arrays))]
        finally:
            worker._WORKER_SLABS.clear()
            worker._WORKER_VIEWS.clear()

    try:
        copies = proc.copy(tensors, owner)
        assert copies is not None
        for t, a, b in zip(tensors, copies, as_read(copies)):
            want = np.ascontiguousarray(t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy())
            a16 = a.view(np.int16) if t.dtype == torch.bfloat16 else a
            assert a.shape == tuple(t.shape) and a16.dtype == want.dtype, f"{t.dtype} {tuple(t.shape)}"
            assert a16.tobytes() == want.tobytes() == b, f"{t.dtype} {tuple(t.shape)}"
        del t, a, b, want, a16
    finally:
        proc.finish()
    # The pool is closed; an array still held keeps its mapping readable (no use after unmap).
    assert copies is not None and copies[0].tobytes() == tensors[0].numpy().tobytes()
