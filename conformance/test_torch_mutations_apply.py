"""The torch-level mutation check (`python -m conformance.torch_mutations`) stays runnable.

Each mutant is an exact edit of torch's source or a replacement of one of its attributes; if
torch moves on, an edit stops applying and the check would lose a mutant. This fast test
installs and removes every mutant and names the one to update.
"""

from __future__ import annotations

import pytest

from conformance.torch_mutations import MUTANTS, TorchMutant, _resolve, install


def _targets(mutant: TorchMutant) -> list[tuple[object, str, object]]:
    found = []
    for edit in mutant.edits:
        owner = _resolve(edit.owner)
        fn = owner.__dict__[edit.func] if isinstance(owner, type) else getattr(owner, edit.func)
        found.append((fn, "code", getattr(fn, "__wrapped__", fn).__code__))
    for dotted, _ in mutant.wraps:
        owner_path, attr = dotted.rsplit(".", 1)
        owner = _resolve(owner_path)
        found.append((owner, attr, getattr(owner, attr)))
    return found


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_torch_mutant_installs_and_is_removed(mutant):
    before = _targets(mutant)
    assert before, f"mutant {mutant.name!r} changes nothing"
    remove = install(mutant)
    try:
        during = _targets(mutant)
        assert all(a[2] is not b[2] for a, b in zip(before, during)), f"mutant {mutant.name!r} did not install"
    finally:
        remove()
    assert all(a[2] is b[2] for a, b in zip(before, _targets(mutant))), f"mutant {mutant.name!r} was not removed"


def test_the_catalogue_is_large_and_its_names_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    real = [m for m in MUTANTS if not m.control and not m.equivalent]
    assert len(real) >= 40, f"the catalogue has {len(real)} non-equivalent mutants"
    assert all(m.equivalent or m.control or m.bug for m in MUTANTS)
