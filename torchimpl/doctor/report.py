"""The doctor's result: verdicts first, then the per-layer table, as text or JSON (the picture:
``torchimpl.doctor.plot``).

``to_dict()`` is the JSON report's contract: ``precision``, ``device``, ``steps``,
``healthy``, ``verdicts`` (each ``kind`` from ``torchimpl.doctor.verdicts.KINDS``, ``module``,
``severity``, ``message``, ``fix``, ``numbers``), ``layers``, ``parameters``, ``fp8_layers``,
``first_low_sqnr`` (the first layer, in hook order, whose SQNR against the fp32 shadow fell
below ``sqnr_threshold_db``, or null), ``loss_scales`` (each step's loss scale),
``skipped_steps`` (the steps skipped on non-finite gradients), ``sqnr_floor_db`` (the floor a
16-bit layer is held to, by dtype) and ``notes``.
"""

from __future__ import annotations

import math
from typing import Any

from torchimpl.doctor.kinds import FLUSH_FRACTION, SQNR_FLOOR_DB, Verdict, sqnr_floor_db

__all__ = ["PrecisionReport"]

def _num(x: float, fmt: str = ".3g") -> str:
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if math.isnan(x):
        return "nan"
    return format(x, fmt)


class PrecisionReport:
    """What ``inspect_precision`` found: ``verdicts`` (ranked), ``layers`` (per-module numbers,
    hook order), ``parameters``, ``fp8_layers``, ``notes``; ``healthy`` when no verdict."""

    def __init__(self, obs: Any, verdicts: list[Verdict], notes: list[str], sqnr_threshold_db: float) -> None:
        self.precision, self.device, self.steps = obs.precision, obs.device, obs.steps
        self.verdicts = verdicts
        self.layers = list(obs.layers.values())
        self.parameters = list(obs.params.values())
        self.fp8_layers = list(obs.fp8.values())
        self.notes = notes
        self.sqnr_threshold_db = sqnr_threshold_db
        self.first_low_sqnr = next((s.name for s in self.layers if s.sqnr_db < sqnr_threshold_db), None)
        self.loss_scales, self.skipped_steps = list(obs.scales), list(obs.skipped)
        self.sqnr_floor_db = {d: sqnr_floor_db(d, obs.precision) for d in SQNR_FLOOR_DB}

    @property
    def healthy(self) -> bool:
        return not self.verdicts

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "device": self.device, "steps": self.steps, "healthy": self.healthy,
                "verdicts": [v.to_dict() for v in self.verdicts], "layers": [s.to_dict() for s in self.layers],
                "parameters": [p.to_dict() for p in self.parameters],
                "fp8_layers": [f.to_dict() for f in self.fp8_layers],
                "sqnr_threshold_db": self.sqnr_threshold_db, "first_low_sqnr": self.first_low_sqnr,
                "loss_scales": self.loss_scales, "skipped_steps": self.skipped_steps,
                "sqnr_floor_db": self.sqnr_floor_db, "notes": self.notes}

    def text(self) -> str:
        head = f"precision {self.precision} on {self.device}, {self.steps} steps beside an fp32 shadow"
        lines = [head, ""]
        if self.healthy:
            floors = ", ".join(f"{d} {f:g} dB" for d, f in self.sqnr_floor_db.items())
            lines.append("no verdict: healthy in this precision (every step applied or skipped by the loss "
                         f"scaler's backoff, see the notes; every 16-bit layer's SQNR at or above its floor: {floors}; "
                         f"no layer flushing more than {FLUSH_FRACTION:.0%} of its outputs beyond that floor's noise)")
        for v in self.verdicts:
            where = v.module if v.module is not None else "<model>"
            lines += [f"[{v.severity}] {v.kind} in {where}: {v.message}", f"    fix: {v.fix}"]
        lines += ["", _table(self.layers)]
        if self.first_low_sqnr is not None:
            lines.append(f"first layer below {self.sqnr_threshold_db:g} dB SQNR: {self.first_low_sqnr}")
        low = [p for p in self.parameters if p.lost[1]]
        if low:
            worst = max(low, key=lambda p: p.lost_update_fraction)
            lines.append(f"lost updates (rule 12): largest {worst.lost_update_fraction:.1%} in "
                         f"{worst.name} ({worst.dtype})")
        for f in self.fp8_layers:
            d = f.to_dict()
            lines.append(f"float8 {f.name}: amax in/w/grad {_num(d['input_amax'])}/{_num(d['weight_amax'])}/"
                         f"{_num(d['grad_output_amax'])}, underflow {d['input_underflow_fraction']:.2%}/"
                         f"{d['weight_underflow_fraction']:.2%}/{d['grad_output_underflow_fraction']:.2%}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _table(layers: list[Any]) -> str:
    rows = [("layer", "dtype", "amax", "headroom bits", "underflow %", "SQNR dB", "grad underflow %")]
    for s in layers:
        if s.same_as is not None and not s.dtype:
            rows.append((s.name, f"= {s.same_as}", "", "", "", "", ""))
            continue
        rows.append((s.name, s.dtype, _num(s.shadow_amax), _num(s.headroom_bits, ".1f"), _num(100 * s.underflow, ".2f"),
                     _num(s.sqnr_db, ".1f"), _num(100 * s.grad_underflow, ".2f")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
