"""`python -m reference [--preset NAME | --fp8]`: the rules of a dynamic loss-scale schedule, or of
scaled float8 training, each with a worked example.

The loss-scaling rules are the numbered list of reference.scaling's docstring (the numbering its
functions' docstrings refer to) and the example table is computed by update_scale; the float8 rules are the
numbered list of reference.fp8's docstring and the examples are computed by its functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import textwrap

from reference import fp8, scaling

# The torch E1 overflow pattern: growth, a backoff, regrowth, two backoffs in a row.
EXAMPLE_PATTERN = (0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0)
EXAMPLE_OVERRIDES = {"init_scale": 1024.0, "growth_interval": 3}


def rule_lines() -> list[str]:
    """The numbered rules of reference.scaling's docstring, as written there (the numbering the
    functions' docstrings refer to: "(rule 11)"), each joined into one wrapped paragraph."""
    doc = scaling.__doc__ or ""
    start = doc.index("\n1. ")
    end = doc.index("\nThe defaults of ScalerConfig", start)
    items = re.split(r"\n(?=\d+\. )", doc[start:end].strip())
    out = []
    for item in items:
        number, _, text = item.partition(". ")
        text = " ".join(line.strip() for line in text.split())
        out.append(textwrap.fill(f"{int(number):2d}. {text}", width=96, subsequent_indent="    "))
    return out


def example_rows(config: scaling.ScalerConfig, pattern: tuple[int, ...]) -> list[tuple[int, bool, float, int, int]]:
    """(step, found_inf, scale, growth_tracker, hysteresis_left) after each update."""
    state = scaling.initial_state(config)
    rows = []
    for step, flag in enumerate(pattern, 1):
        state = scaling.update_scale(state, bool(flag), config)
        rows.append((step, bool(flag), float(state.scale), int(state.growth_tracker), state.hysteresis_left))
    return rows


def fp8_rule_lines() -> list[str]:
    """The numbered rules of reference.fp8's docstring, as written there."""
    doc = fp8.__doc__ or ""
    start = doc.index("\n1. ")
    end = doc.index("\n\n", start + 1)
    return doc[start + 1:end].splitlines()


# amax just above 448 / 2^8: the float32 scale is 2 ULPs below 2^8, float32 log2 rounds to 8.
FP8_POW2_AMAX = float.fromhex("0x1.c00002p+0")


def _f(x) -> str:
    return f"{float(x):.9g}"


def fp8_example_lines() -> list[str]:
    """A worked example of rules 2-7 and 13, computed by reference.fp8."""
    import numpy as np

    x = np.array([[0.1, -2.5, 3.0], [1e-3, 0.75, -0.2]], np.float32)
    w = np.array([[1.0, 0.5, -0.25], [-2.0, 0.125, 4.0]], np.float32)
    out = ["", "Example: x (2x3) and w (2x3), float32, tensorwise e4m3fn (torchao's tensorwise forward)"]
    for name, t in (("x", x), ("w", w)):
        a = fp8.amax(t)
        q = fp8.quantize(t, "float8_e4m3fn")
        out.append(f"  {name}: amax {_f(a)}, scale f32(448 / {_f(a)}) = {_f(q.scale)}, "
                   f"fp8 values {[float(v) for v in q.data.astype(np.float32).ravel()]}")
    qx, qw = fp8.quantize(x, "float8_e4m3fn"), fp8.quantize(w.T, "float8_e4m3fn")
    y = fp8.scaled_mm(qx, qw, np.float32)
    out.append(f"  y = x @ w.T from the pre-scaled operands q / s: {y.tolist()}")
    out.append(f"  the same in float32 without float8:           {(x @ w.T).tolist()}")
    a = np.array(np.float32(FP8_POW2_AMAX))
    s = fp8.amax_to_scale(a, "float8_e4m3fn")
    p, e = fp8.round_scale_down_to_power_of_2(s), fp8.exact_power_of_2_floor(s)
    out.append(f"Rule 4: amax {_f(a)} gives the scale {_f(s)}; torchao's power of two is {_f(p)}, the exact "
               f"floor {_f(e)}; amax * {_f(p)} = {_f(np.float32(a * p))} saturates to 448")
    cfg = fp8.DelayedScaling(amax_history_len=3)
    state = fp8.delayed_initial_state(cfg)
    out.append("Rule 13: delayed scaling, e4m3, amax_history_len=3, max over the history")
    out.append(f"  {'step':>4}  {'amax':>8}  {'scale used':>10}  {'history after':>24}  {'next scale':>10}")
    for step, amax_value in enumerate((2.0, 8.0, 0.0, float("nan"), 1.0, 1.0), 1):
        t = np.array([amax_value, -amax_value / 2], np.float32)
        _, recorded = fp8.delayed_cast(t, state, "float8_e4m3fn")
        state = fp8.delayed_update(recorded, cfg, "float8_e4m3fn")
        hist = ", ".join(_f(h) for h in state.amax_history)
        out.append(f"  {step:>4}  {_f(amax_value):>8}  {_f(recorded.scale):>10}  {hist:>24}  {_f(state.scale):>10}")
    return out


def fp8_lines() -> list[str]:
    """What ``--fp8`` prints: the title, the rules, the worked example."""
    title = (fp8.__doc__ or "").strip().splitlines()[0]
    return [title, "", *fp8_rule_lines(), *fp8_example_lines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference", description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--preset", default="torch", choices=sorted(scaling.PRESETS), help="scaling policy (default: torch)")
    parser.add_argument("--fp8", action="store_true", help="the rules of scaled float8 training instead")
    args = parser.parse_args(argv)
    if args.fp8:
        print("\n".join(fp8_lines()))
        return 0

    config = scaling.ScalerConfig.preset(args.preset)
    print(f"Dynamic loss scaling, preset {args.preset!r}:")
    print("  " + ", ".join(f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)))
    print("\nRules (the numbered list of reference/scaling.py; \"rule N\" in its functions refers to these):")
    print("\n".join(rule_lines()))

    small = scaling.ScalerConfig.preset(args.preset, **EXAMPLE_OVERRIDES)
    print(f"\nExample: preset {args.preset!r} with init_scale=1024, growth_interval=3")
    show_left = small.hysteresis > 1  # with hysteresis 1 every overflow backs off: the column says nothing
    print(f"{'step':>4}  {'found_inf':>9}  {'scale':>8}  {'tracker':>7}" + ("  hysteresis_left" if show_left else ""))
    for step, flag, scale, tracker, left in example_rows(small, EXAMPLE_PATTERN):
        print(f"{step:>4}  {str(flag):>9}  {scale:>8g}  {tracker:>7}" + (f"  {left:>15}" if show_left else ""))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        # The reader stopped early (`| head`): what it wanted was printed. Point stdout at devnull
        # so the interpreter's final flush does not raise again, as Python's signal docs advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
