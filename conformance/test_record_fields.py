"""The step record: torchimpl writes exactly the fields the specification's contract names.

The data is duplicated on purpose (each implementation has its own ``StepRecord``, no shared
code); this property is what keeps the two lists one list. The trace, ``replay`` and the
trainer property read records by field name, so a field renamed, added or reordered on one
side only fails here first, with both lists.
"""

from __future__ import annotations

import dataclasses
import json

import reference.step as ref_step
import torchimpl.run.records as ti_records

REPRO = "PYTHONPATH=. python -m pytest conformance/test_record_fields.py"


def test_record_fields_equal_the_spec_by_name_and_order():
    spec = tuple(f.name for f in dataclasses.fields(ref_step.StepRecord))
    ours = ti_records.FIELDS
    assert ours == spec, (
        f"torchimpl.run.records.FIELDS differ from reference.step.StepRecord's fields:\n"
        f"  torchimpl: {ours}\n  reference: {spec}\n"
        f"  only in torchimpl: {sorted(set(ours) - set(spec))}; only in reference: {sorted(set(spec) - set(ours))}\n"
        f"{REPRO}"
    )
    assert ours == tuple(f.name for f in dataclasses.fields(ti_records.StepRecord)), \
        "torchimpl.run.records.FIELDS is not StepRecord's own field list"


def test_a_trace_line_reads_back_as_the_specs_record():
    rec = ti_records.StepRecord(step=3, microbatches=2, scale_before=1024.0, found_inf=True, applied=False,
                                grad_norm=float("inf"), clip_coef=0.0, scale_after=512.0, growth_tracker=0, lr=1e-3)
    line = rec.to_json()
    spec = ref_step.StepRecord.from_dict(json.loads(line))
    for name in ti_records.FIELDS:
        assert getattr(spec, name) == getattr(rec, name), f"field {name}: spec {getattr(spec, name)!r}, " \
                                                           f"torchimpl {getattr(rec, name)!r}\n{REPRO}"
