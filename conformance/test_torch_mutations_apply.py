"""The torch-level mutation check (`python -m conformance.torch_mutations`) stays runnable.

Each mutant is an exact edit of torch's source or a replacement of one of its attributes; if
torch moves on, an edit stops applying and the check would lose a mutant. This fast test
installs and removes every mutant and names the one to update.
"""

from __future__ import annotations

import pytest

from conformance.torch_mutations import MUTANTS, Edit, MutantDoesNotApply, TorchMutant, _resolve, install


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


def _one_edit(old: str) -> TorchMutant:
    return TorchMutant("anchor_check", "an edit for this test", (), edits=(
        Edit("torch.nn.utils.clip_grad", "_clip_grads_with_norm_", old, "pass\n"),))


def test_an_anchor_that_matches_nowhere_names_itself_the_torch_version_and_the_line_to_read():
    import torch

    with pytest.raises(MutantDoesNotApply) as e:
        install(_one_edit("    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)  # moved in torch 9\n"))
    message = str(e.value)
    assert "'anchor_check'" in message and f"torch {torch.__version__}" in message
    assert "# moved in torch 9" in message and "clip_grad.py, line " in message and "nearest line" in message


def test_an_anchor_that_matches_twice_names_both_lines():
    import inspect

    from torch.nn.utils import clip_grad

    with pytest.raises(MutantDoesNotApply, match=r"matches \d+ places") as e:
        install(_one_edit("device"))
    assert int(str(e.value).split(" matches ")[1].split()[0]) > 1
    lines, first = inspect.getsourcelines(inspect.unwrap(clip_grad._clip_grads_with_norm_))
    first_match = first + next(i for i, ln in enumerate(lines) if "device" in ln)
    assert f"clip_grad.py, lines {first_match}, " in str(e.value)
