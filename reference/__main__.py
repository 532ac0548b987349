"""`python -m reference [--preset NAME]`: the rules of a dynamic loss-scale schedule, and an example.

The rules are the opening lines of the rule functions' docstrings in reference.scaling; the
example table is computed by update_scale.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap

from reference import scaling

# The torch E1 overflow pattern: growth, a backoff, regrowth, two backoffs in a row.
EXAMPLE_PATTERN = (0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0)
EXAMPLE_OVERRIDES = {"init_scale": 1024.0, "growth_interval": 3}


def rule_lines() -> list[str]:
    """The first paragraph of each rule function's docstring, numbered."""
    out = []
    for i, fn in enumerate(scaling.RULES, 1):
        first = (fn.__doc__ or "").strip().split("\n\n")[0]
        text = " ".join(line.strip() for line in first.splitlines())
        out.append(textwrap.fill(f"{i:2d}. {text}", width=96, subsequent_indent="    "))
    return out


def example_rows(config: scaling.ScalerConfig, pattern: tuple[int, ...]) -> list[tuple[int, bool, float, int, int]]:
    """(step, found_inf, scale, growth_tracker, hysteresis_left) after each update."""
    state = scaling.initial_state(config)
    rows = []
    for step, flag in enumerate(pattern, 1):
        state = scaling.update_scale(state, bool(flag), config)
        rows.append((step, bool(flag), float(state.scale), int(state.growth_tracker), state.hysteresis_left))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="torch", choices=sorted(scaling.PRESETS), help="scaling policy (default: torch)")
    args = parser.parse_args(argv)

    config = scaling.ScalerConfig.preset(args.preset)
    print(f"Dynamic loss scaling, preset {args.preset!r}:")
    print("  " + ", ".join(f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)))
    print("\nRules, in the order a training step meets them:")
    print("\n".join(rule_lines()))

    small = scaling.ScalerConfig.preset(args.preset, **EXAMPLE_OVERRIDES)
    print(f"\nExample: preset {args.preset!r} with init_scale=1024, growth_interval=3")
    show_left = small.hysteresis > 1  # with hysteresis 1 every overflow backs off: the column says nothing
    print(f"{'step':>4}  {'found_inf':>9}  {'scale':>8}  {'tracker':>7}" + ("  hysteresis_left" if show_left else ""))
    for step, flag, scale, tracker, left in example_rows(small, EXAMPLE_PATTERN):
        print(f"{step:>4}  {str(flag):>9}  {scale:>8g}  {tracker:>7}" + (f"  {left:>15}" if show_left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
