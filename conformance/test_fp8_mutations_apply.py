"""The float8 mutation check (`python -m conformance.fp8_mutations`) stays runnable as the spec
and torchao change: each spec mutant's edit must match reference/fp8.py exactly once, and each
production mutant must install into torchao or torchimpl and be removed again."""

from __future__ import annotations

import os

import pytest

from conformance.fp8_mutations import MUTANTS, PRODUCTION_MUTANTS
from conformance.mutations import ROOT
from conformance.torch_mutations import TorchMutant, _function, _resolve, install


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_fp8_mutant_edit_applies_exactly_once(mutant):
    count = (ROOT / mutant.file).read_text().count(mutant.old)
    assert count == 1, (f"mutant {mutant.name!r}: its edit matches {count} places in {mutant.file}; "
                        "update conformance/fp8_mutations.py to the current source")


def _codes(mutant: TorchMutant) -> list[object]:
    return [_function(_resolve(e.owner), e.func).__code__ for e in mutant.edits]


@pytest.mark.parametrize("mutant", PRODUCTION_MUTANTS, ids=[m.name for m in PRODUCTION_MUTANTS])
def test_each_fp8_production_mutant_installs_and_is_removed(mutant):
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    pytest.importorskip("torchao.float8", reason="torchao is not installed: pip install '.[fp8]' (torchao==0.18.0)")
    before = _codes(mutant)
    remove = install(mutant)
    try:
        assert all(a is not b for a, b in zip(before, _codes(mutant))), f"mutant {mutant.name!r} did not install"
    finally:
        remove()
    assert all(a is b for a, b in zip(before, _codes(mutant))), f"mutant {mutant.name!r} was not removed"


def test_every_group_of_the_float8_properties_has_a_production_mutant():
    groups = {m.bug.split(":", 1)[0] for m in PRODUCTION_MUTANTS}
    assert groups == {"mx layer", "rule 12", "3-d"}, groups
