"""The float8 mutation check (`python -m conformance.fp8_mutations`) stays runnable as the spec
changes: each mutant's edit must match reference/fp8.py exactly once."""

from __future__ import annotations

import pytest

from conformance.fp8_mutations import MUTANTS
from conformance.mutations import ROOT


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_fp8_mutant_edit_applies_exactly_once(mutant):
    count = (ROOT / mutant.file).read_text().count(mutant.old)
    assert count == 1, (f"mutant {mutant.name!r}: its edit matches {count} places in {mutant.file}; "
                        "update conformance/fp8_mutations.py to the current source")
