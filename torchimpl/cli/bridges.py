"""Where the command line meets the other packages: ``ampspec replay`` (the specification,
``reference``, through ``torchimpl.spec_bridge``) and ``ampspec audit`` (the ``audit`` package).

Both are imported inside the commands' functions: importing torchimpl never imports
``reference`` or ``audit``, and ``ampspec --help`` starts without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from torchimpl.cli.messages import own_loggers_only

__all__ = ["audit_command", "replay_command"]

log = logging.getLogger("torchimpl.cli")


def replay_command(args: argparse.Namespace) -> int:
    """``ampspec replay TRACE``: the recorded scale history judged by the specification."""
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.run.records import check_step_order, read_numbered_trace, read_trace_header
    from torchimpl.spec_bridge import scaler_config

    # The CLI's boundary with the specification: the spec judges the recorded run.
    from reference.step import replay

    _check_replay_sets(args.set)
    numbered = read_numbered_trace(args.trace)
    if not numbered:
        raise ValueError(f"{args.trace} holds no step records")
    check_step_order(args.trace, numbered)
    records = [record for _, record in numbered]
    if all(r.scale_before == r.scale_after == 1.0 for r in records):
        print(f"{len(records)} steps with the scale fixed at 1 (no loss scaler): nothing to replay")
        return 0
    ref_cfg = scaler_config(_replay_policy(args, read_trace_header(args.trace)))
    result = replay([dataclasses.asdict(r) for r in records], ref_cfg)
    if result.ok:
        print(f"{result.steps_checked} steps replayed: the scale history matches the reference")
        return 0
    print(f"first divergent {result.describe()}")
    return 1


def _check_replay_sets(sets: list[str]) -> None:
    """A replay recomputes the loss scale alone: a ``--set`` of a field outside the scaler
    section, which would change nothing, is refused with the fields it can change."""
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.config.scale_policy import ScalerConfig

    for item in sets:
        key = item.partition("=")[0].strip()
        if key != "scaler" and not key.startswith("scaler."):
            can = ", ".join(f"scaler.{f.name}" for f in dataclasses.fields(ScalerConfig))
            raise ValueError(f"--set {item}: a replay recomputes the loss scale only, so {key} would change "
                             f"nothing; it can change {can}")


def _replay_policy(args: argparse.Namespace, header: dict | None) -> object:
    """The scaler policy to replay with: ``--config``'s (with its ``--set``s), else the trace
    header's with the fields ``--set`` names changed, else the defaults; a warning when the
    choice is not the trace's own."""
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.config.schema import load_config

    recorded = _header_policy(args.trace, header) if header is not None else None
    if args.config is None and not args.set:
        if recorded is not None:
            return recorded
        default = load_config().scaler.resolved()
        log.warning("%s has no header (written before traces recorded their scaler policy): replaying with "
                    "the default policy (%s); pass the run's --config if it set the scaler", args.trace,
                    _policy_text(default))
        return default
    if args.config is None and recorded is not None:
        given = _recorded_with_sets(recorded, args.set)
    else:
        given = load_config(args.config, args.set).scaler.resolved()
    if recorded is not None and given != recorded:
        log.warning("the scaler policy given by --config/--set differs from the one %s records; replaying with "
                    "the given one: %s (given) vs %s (recorded)", args.trace,
                    _policy_text(given, recorded), _policy_text(recorded, given))
    return given


def _recorded_with_sets(recorded: object, sets: list[str]) -> object:
    """The recorded policy with the fields ``--set scaler.NAME=VALUE`` names changed, and only
    those (``--set`` without ``--config`` edits the run's policy, it does not start from the
    defaults); every ``--set`` is still validated as a configuration override."""
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.config.schema import apply_overrides, load_config
    from torchimpl.config.scale_policy import with_fields

    checked = load_config(None, sets).scaler
    section = apply_overrides({}, sets).get("scaler") or {}
    return with_fields(recorded, {name: getattr(checked, name) for name in section})


def _header_policy(trace: str, header: dict) -> object:
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.config.scale_policy import ResolvedScalerConfig

    fields = {f.name for f in dataclasses.fields(ResolvedScalerConfig)}
    policy = header.get("scaler")
    if not isinstance(policy, dict) or set(policy) - fields or not set(policy) >= {"preset", "init_scale"}:
        raise ValueError(f"{trace}: the header's scaler policy is malformed ({policy!r}); pass the run's --config")
    try:
        return ResolvedScalerConfig(**policy)
    except TypeError as exc:
        raise ValueError(f"{trace}: the header's scaler policy is malformed ({exc}); pass the run's --config") from None


def _policy_text(policy: object, other: object | None = None) -> str:
    """``name=value`` for each field (only those that differ from ``other``'s when given)."""
    items = dataclasses.asdict(policy).items()
    if other is not None:
        theirs = dataclasses.asdict(other)
        items = [(k, v) for k, v in items if theirs.get(k) != v]
    return ", ".join(f"{k}={v!r}" for k, v in items)


def audit_command(args: argparse.Namespace) -> int:
    """``ampspec audit SCRIPT.py``: the user's own script run under the audit."""
    # The audit compares torch with the specification, so it lives in its own package, which
    # imports both; imported here, lazily, like replay's spec_bridge.
    from audit.runner import main as audit_main

    # The script's logging and warnings print as under `python SCRIPT.py`: once, in their own format.
    with own_loggers_only():
        return audit_main(args.script, args.args, report=args.report, steps=args.steps, no_replay=args.no_replay,
                          strict=args.strict, force=args.force, replay_every=args.replay_every,
                          replay_sample=args.replay_sample, replay_seed=args.replay_seed)
