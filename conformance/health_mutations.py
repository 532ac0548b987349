"""Mutation check of the doctor's statistics and verdicts: deliberate bugs in a copy of
torchimpl/precision/health.py (each caught against reference/health.py) and of the doctor's
verdict rules (each caught by the property that the doctor never says healthy against its numbers),
all run against conformance/test_health.py.

    PYTHONPATH=. python -m conformance.health_mutations            # every mutant (about 2 minutes)
    PYTHONPATH=. python -m conformance.health_mutations overflow_tie_ignored

One plausible misreading per statistic (amax, headroom, overflow twice, underflow, flushed and
subnormal fractions, SQNR, lost updates twice, the scale range twice, the two masses) and two of the doctor's old verdict logic (no
``degraded``, every skipped step the scaler's): all 16 killed. Same machinery as ``conformance.mutations`` (an
unmutated baseline first; an edit that no longer applies stops the run).
"""

from __future__ import annotations

import sys

from conformance import mutations
from conformance.mutations import Mutant

HEALTH = "torchimpl/precision/health.py"
VERDICTS = "torchimpl/doctor/verdicts.py"
SCALING = "torchimpl/doctor/scaling.py"
TESTS = ("conformance/test_health.py",)

MUTANTS = (
    Mutant("amax_nan_propagates", "amax over all elements: a NaN makes amax NaN", HEALTH,
           "    return float(torch.where(torch.isnan(a), torch.zeros_like(a), a).max())\n",
           "    return float(a.max())\n", TESTS),
    Mutant("headroom_whole_bits", "headroom truncated to whole bits", HEALTH,
           "    return math.log2(_facts(dtype)[0] / value)\n",
           "    return float(math.floor(math.log2(_facts(dtype)[0] / value)))\n", TESTS),
    Mutant("overflow_tie_ignored", "the tie at max + half a spacing never overflows (RNE ignored)", HEALTH,
           "    past = (y >= threshold) if tie_overflows else (y > threshold)\n",
           "    past = y > threshold\n", TESTS),
    Mutant("overflow_at_max", "anything above max counts as overflow (no rounding down to max)", HEALTH,
           "    return top + spacing / 2, odd\n", "    return top, odd\n", TESTS),
    Mutant("underflow_counts_zeros", "zeros of the input count as underflowed", HEALTH,
           "    live = torch.isfinite(xd) & (xd != 0)\n", "    live = torch.isfinite(xd)\n", TESTS),
    Mutant("flushed_counts_subnormals", "a subnormal in the mixed run counts as flushed", HEALTH,
           "    return int((live & (o == 0)).sum()), int(live.sum())\n",
           "    return int((live & (o.abs() < torch.finfo(o.dtype).tiny)).sum()), int(live.sum())\n", TESTS),
    Mutant("subnormal_includes_normal", "the smallest normal counted as subnormal", HEALTH,
           "(a < _facts(dtype)[1])", "(a <= _facts(dtype)[1])", TESTS),
    Mutant("sqnr_in_float32", "SQNR sums in float32", HEALTH,
           "    r = reference.detach().double().reshape(-1)\n    o = observed.detach().double().reshape(-1)\n",
           "    r = reference.detach().float().reshape(-1)\n    o = observed.detach().float().reshape(-1)\n", TESTS),
    Mutant("lost_update_no_direction", "the gap above the weight used for downward updates too", HEALTH,
           "    gap = torch.where(outward, up, down)\n", "    gap = up\n", TESTS),
    Mutant("lost_update_tie_counted", "an update of exactly half a gap counted as lost", HEALTH,
           "    lost = live & (u.abs() < gap / 2)\n", "    lost = live & (u.abs() <= gap / 2)\n", TESTS),
    Mutant("scale_low_tie", "the tie at half the smallest subnormal taken as representable", HEALTH,
           "    low = p - e + (2 if f == 0.5 else 1)\n", "    low = p - e + 1\n", TESTS),
    Mutant("scale_keep_floor", "keep rounded down: one gradient fewer must survive", HEALTH,
           "    needed = math.ceil(keep * g.numel())\n", "    needed = max(math.floor(keep * g.numel()), 1)\n", TESTS),
    Mutant("underflow_mass_unscaled", "the mass lost weighed without the scale (the cast of x itself)", HEALTH,
           "    lost = finite & (xd != 0) & (_scaled(xd, scale).to(dtype) == 0)\n",
           "    lost = finite & (xd != 0) & (xd.to(dtype) == 0)\n", TESTS),
    Mutant("flushed_mass_subnormals", "a subnormal in the mixed run weighed as flushed", HEALTH,
           "    lost = finite & (r != 0) & (o == 0)\n",
           "    lost = finite & (r != 0) & (o.abs() < torch.finfo(o.dtype).tiny)\n", TESTS),
    Mutant("doctor_no_degraded", "the doctor's old verdicts: a collapsed SQNR with no cause found says healthy",
           VERDICTS, "        out += _degraded(obs)\n", "        out += []\n", TESTS),
    Mutant("doctor_skips_are_the_scalers", "the doctor's old verdicts: every skipped step is the scaler's business",
           SCALING, "    scaled = [k for k in skipped if obs.step_high.get(k) is not None and obs.scales[k] > "
           "2.0 ** obs.step_high[k]]\n", "    scaled = list(skipped)\n", TESTS),
)


def main(argv: list[str] | None = None) -> int:
    return mutations.cli("python -m conformance.health_mutations", __doc__ or "", MUTANTS, argv)


if __name__ == "__main__":
    sys.exit(main())
