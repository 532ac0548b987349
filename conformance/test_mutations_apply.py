"""The mutation check (`python -m conformance.mutations`) stays runnable as the code changes.

Each mutant is an exact source edit; if the production code moves on, the edit stops applying
and the check would silently lose a mutant. This fast test names the mutant to update.
"""

from __future__ import annotations

import pytest

from conformance.mutations import MUTANTS, ROOT, SPEC_MUTANTS


@pytest.mark.parametrize("mutant", MUTANTS + SPEC_MUTANTS, ids=[m.name for m in MUTANTS + SPEC_MUTANTS])
def test_each_mutant_edit_applies_exactly_once(mutant):
    source = (ROOT / mutant.file).read_text()
    count = source.count(mutant.old)
    assert count == 1, (
        f"mutant {mutant.name!r}: its edit matches {count} places in {mutant.file}; "
        "update conformance/mutations.py to the current source"
    )
