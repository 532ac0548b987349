"""The ``ampspec`` command: ``compare``, ``train``, ``export``, ``config``, ``doctor``, ``replay``, ``audit``.

User mistakes (a bad configuration, a missing file, an unavailable device, a refused resume)
print one line to stderr and exit with status 2. ``train`` exits 0 when the run completed (or a
callback stopped it), 1 when a fault stopped it (a non-finite loss or gradient under
``on_nonfinite: stop``, a collapsed loss scale), 3 when it applied no step or ended with a
non-finite loss, and 130 or 143 when SIGINT or SIGTERM stopped it (after a checkpoint); every
code but 0 comes with a line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

# Nothing here imports torch at module level (nor does torchimpl/__init__.py): --help, --version
# and argument errors answer without it; each command imports what it needs when it runs.
from torchimpl.cli.bridges import audit_command, replay_command
from torchimpl.cli.errors import run_command
from torchimpl.cli.messages import configure_logging, launch_rank, plain_warnings, rank_prefix
from torchimpl.cli.messages import line as message_line
from torchimpl.config.embedded import is_task_name
from torchimpl.run.lifecycle import EXIT_CODES, command_interrupts, restore_handlers

__all__ = ["main"]

log = logging.getLogger("torchimpl.cli")

_plain_warnings = plain_warnings


def _version_text() -> str:
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl import __version__

    return f"ampspec {__version__} (torch {_torch_version()}, python {sys.version.split()[0]})"


def _torch_version() -> str:
    """torch's version from its ``torch/version.py``, read as text: importing torch takes
    seconds, and importlib.metadata's search of every installed distribution most of one."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
        if found:
            return found.group(1)
    import torch  # a layout without version.py

    return str(torch.__version__)


class _VersionAction(argparse.Action):
    """``--version``, computed only when asked (it imports torch)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001 - argparse's signature
        print(_version_text())
        parser.exit()


def _task_name(text: str) -> str:
    """argparse type for ``--task``: ``lm``, ``mlp`` or ``module:function``."""
    if not is_task_name(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a task: use 'lm', 'mlp' or module:function (a function in a module in the "
            "working directory or on PYTHONPATH that returns (model, train_data, val_data))")
    return text


def _compare(args: argparse.Namespace) -> int:
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.cli.compare import check_inputs, format_table, run_compare
    from torchimpl.run.folder import claim_compare_folder
    from torchimpl.run.lock import hold

    _plain_warnings()
    # A bad --task, device or setting is named before --out is made, locked or claimed.
    check_inputs(steps=args.steps, device=args.device, task=args.task, seed=args.seed, out=args.out)
    _warn_busy_cores("compare", None, args.device)
    with hold(Path(args.out), f"--out {args.out}"):
        claim_compare_folder(args.out, overwrite=args.overwrite)
        res = run_compare(steps=args.steps, device=args.device, out=args.out, task=args.task, seed=args.seed)
    if res.interrupted is not None:
        return _compare_interrupted(res)
    print(format_table(res.rows))
    print()
    print(f"max gap: {res.gap_note}.")
    verdict = "agree" if res.agree else "DO NOT agree"
    print(f"The curves {verdict} with fp32 (rule: {res.rule}).")
    for row in res.rows:
        for d in row["downgrades"]:
            print(f"note ({row['precision']}): {d}")
    for label, why in res.left_out.items():
        print(f"note ({label}): left out: {why}")
    print(f"report: {res.report_path}")
    print(f"plot: {res.png_path}" if res.png_path else res.png_note)
    print(f"took {res.seconds:.1f} s")
    return 0 if res.agree else 1


def _compare_interrupted(res: Any) -> int:
    """What an interrupted comparison says: the runs that finished, the one cut short; no verdict."""
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.run.lifecycle import EXIT_CODES

    finished = ", ".join(res.finished) or "none"
    cut = "; ".join(f"{label} stopped after {n} steps" for label, n in res.cut_short.items())
    print(f"ampspec compare: interrupted by {res.interrupted}: runs finished: {finished}"
          f"{'; ' + cut if cut else ''}; no verdict (report: {res.report_path})", file=sys.stderr)
    return EXIT_CODES[f"interrupted:{res.interrupted}"]


def _train(args: argparse.Namespace) -> int:
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.config.schema import load_config
    from torchimpl.run.folder import claim_run_folder
    from torchimpl.task.checks import task_failure
    from torchimpl.task.builtin import build_task
    from torchimpl.train.trainer import Trainer

    _plain_warnings()
    cfg = load_config(args.config, args.set, task_defaults=True)
    if args.resume and cfg.checkpoint.folder is None:  # before make() runs
        raise ValueError("--resume needs checkpoint.folder in the configuration")
    _warn_busy_cores("train", cfg.train.threads, cfg.device)
    with _run_locks(cfg):
        if launch_rank() == 0:
            claim_run_folder(cfg, resume=args.resume, overwrite=args.overwrite)
        task = build_task(cfg.task, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
        try:
            summary = Trainer(cfg).fit(task.model, task.train_data, task.val_data, loss_fn=task.loss_fn,
                                       resume="latest" if args.resume else None)
        except Exception as exc:
            # An exception from a user's task while it trains names the task (torchimpl.task.checks).
            failed = task_failure(cfg.task.name, exc) if cfg.task.name not in ("lm", "mlp") else None
            if failed is None:
                raise
            raise failed from exc
    # Under torchrun rank 0 alone prints; every rank's exit status still reports a stop (the
    # stop decision is the same on every rank).
    if launch_rank() == 0:
        print(json.dumps(summary.to_dict(), indent=2, allow_nan=False))
        problem = _outcome_message(summary)
        if problem:  # a stop on a signal is not an error: the run can go on with --resume
            level = None if summary.outcome.startswith("interrupted") else "error"
            print(message_line(level, problem, "train"), file=sys.stderr)
    return EXIT_CODES[summary.outcome]


def _warn_busy_cores(command: str, threads: int | None, device: str) -> None:
    """The warning of ``torchimpl.train.threads.busy_warning``, once, for a run on the CPU."""
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.precision.device import resolve_device
    from torchimpl.train.threads import busy_warning, current

    try:
        on_cpu = resolve_device(device).type == "cpu"
    except (ValueError, RuntimeError):  # the run itself names a device it cannot use
        return
    text = busy_warning(current(), command, threads) if on_cpu and launch_rank() == 0 else None
    if text is not None:
        log.warning("%s", text)


def _run_locks(cfg: Any) -> contextlib.ExitStack:
    """The locks on this run's folders and trace (``torchimpl.run.lock``), held by rank 0 alone."""
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.run.lock import run_locks

    return run_locks(cfg) if launch_rank() == 0 else contextlib.ExitStack()


def _outcome_message(summary) -> str | None:
    """What stderr says about a run that did not complete (None when it did)."""
    where = f"; last checkpoint {summary.last_checkpoint}" if summary.last_checkpoint else ""
    if summary.outcome == "failed":
        report = f"; diagnosis in {summary.diagnosis_report}" if summary.diagnosis_report else ""
        return f"the run failed: {summary.stopped}{report}{where}"
    if summary.outcome == "no_progress":
        if summary.steps_applied == 0:
            return (f"no step was applied: all {summary.steps} steps were skipped for non-finite values "
                    "(see the trace, or rerun with train.on_nonfinite=stop for a diagnosis)")
        return f"the run ended with a non-finite training loss ({summary.final_train_loss}){where}"
    if summary.outcome.startswith("interrupted"):
        return f"{summary.stopped}{where}; continue with --resume"
    return None


def _config(args: argparse.Namespace) -> int:
    """Print the configuration ``train`` would run with (the defaults, ``--config``, ``--set``)
    as YAML that ``train --config`` reads back to the same configuration."""
    # imported when the command runs: `ampspec --help` starts without yaml or torch
    import yaml

    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.config.schema import load_config

    cfg = load_config(args.config, args.set, task_defaults=True)
    print("# ampspec train's configuration; every field is documented in torchimpl/config/schema.py")
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False), end="")
    return 0


def _export(args: argparse.Namespace) -> int:
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.cli.export import export_weights

    _plain_warnings()
    res = export_weights(args.checkpoint, args.out, force=args.force)
    print(f"wrote {res.path}: the model's state_dict from {res.source}, "
          f"{res.tensors} tensors, {res.bytes / 2**20:.2f} MiB")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    if args.task is not None:
        # imported when the command runs: `ampspec --help` starts without torch
        from torchimpl.cli.doctor import run_doctor

        _plain_warnings()
        return run_doctor(args)
    # imported when the command runs: `ampspec --help` starts without torch
    import torch

    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.precision.device import available_devices
    from torchimpl.train.optim import supports_fused_adamw
    from torchimpl.precision.plan import PrecisionConfig, resolve_precision, tf32_settings

    print(f"torch {torch.__version__}, python {sys.version.split()[0]}")
    devices = available_devices()
    print(f"devices: {', '.join(devices)}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"  cuda:{i} {torch.cuda.get_device_name(i)}, bf16 supported: {torch.cuda.is_bf16_supported()}")
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    flags = _cpu_flags()
    if flags is not None:
        feats = {f: (f in flags) for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")}
        print("CPU features: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in feats.items()))
    print(f"TF32: {tf32_settings()}")
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.train.threads import current, report_lines

    print("\n".join(report_lines(current())))
    for dev in devices:
        print(f"precision on {dev}:")
        for mode in ("auto", "fp32", "bf16", "fp16"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the downgrade is printed on this line instead
                plan = resolve_precision(PrecisionConfig(mode=mode), dev)
            extra = f" ({plan.reason})" if plan.reason else ""
            print(f"  {mode:5} -> {plan.mode}, scaler={'yes' if plan.use_scaler else 'no'}, "
                  f"autocast={'yes' if plan.autocast_enabled else 'no'}{extra}")
        print(f"  fp8   -> {_fp8_line(dev)}")
        print(f"  fused AdamW: {'yes' if supports_fused_adamw(dev) else 'no'}")
    return 0


def _fp8_line(dev: str) -> str:
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.precision.plan import PrecisionConfig, resolve_precision

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = resolve_precision(PrecisionConfig(mode="fp8"), dev)
    except RuntimeError as exc:  # torchao missing
        return str(exc)
    return plan.note or f"{plan.mode} ({plan.reason})"


def _cpu_flags() -> set[str] | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after an option's help wherever the default says something: not for an
    option that is off or unset unless given (a default of None or False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _verbosity(parser: argparse.ArgumentParser, default: object) -> None:
    """``-v``/``-q`` on ``parser``; the subcommands' default is SUPPRESS so that a flag given
    before the subcommand is not reset by the subcommand's own default."""
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="log INFO messages too")
    parser.add_argument("-q", "--quiet", action="store_true", default=default,
                        help="warnings and errors only: no progress lines or bar")


def _add_compare(sub: Any, common: argparse.ArgumentParser) -> None:
    c = sub.add_parser(
        "compare", parents=[common], help="train one model in every precision this device supports and compare the curves",
        formatter_class=_Defaults,
        description="Train the same model from the same seed and data in every precision this device "
                    "supports (on a CPU also bf16 with a loss scaler, to show the scaler at work), print a "
                    "table, write OUT/report.json and OUT/compare.png. Exit status 1 when a curve does not "
                    "agree with fp32's.")
    c.add_argument("--task", default="lm", type=_task_name, metavar="lm|mlp|MODULE:FUNCTION",
                   help="the embedded transformer (lm), the embedded MLP (mlp), or your own task: a function "
                        "returning (model, train_data, val_data), looked up in the working directory first")
    c.add_argument("--steps", type=int, default=200, help="optimizer steps per precision")
    c.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    c.add_argument("--seed", type=int, default=0, help="train.seed of every run (model initialisation, data, dropout)")
    c.add_argument("--out", default="ampspec-compare", help="folder for report.json, compare.png and the traces")
    c.add_argument("--overwrite", action="store_true",
                   help="replace the comparison already in --out (without it such a folder is refused)")
    c.set_defaults(func=_compare)


def _add_train(sub: Any, common: argparse.ArgumentParser) -> None:
    t = sub.add_parser("train", parents=[common], help="train the embedded task or your own model",
                       formatter_class=_Defaults,
                       description="Train the embedded task or your own (task.name: module:function) and print "
                                   "the run summary as JSON. Every field is documented in torchimpl/config/schema.py.")
    t.add_argument("--config", metavar="FILE", help="YAML configuration file (none: every field at its default)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. train.steps=100 (repeatable; values are YAML)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in checkpoint.folder")
    t.add_argument("--overwrite", action="store_true",
                   help="train afresh into folders that hold another run's files, removing those files first "
                        "(without it such a run is refused)")
    t.set_defaults(func=_train)


def _add_config(sub: Any, common: argparse.ArgumentParser) -> None:
    c = sub.add_parser("config", parents=[common], help="print the configuration train would use, as YAML",
                       formatter_class=_Defaults,
                       description="Print the configuration `ampspec train` would run with, every field: the "
                                   "defaults (with the embedded task's own), or with --config and --set the "
                                   "resolved one. `ampspec train --config` reads the output back.")
    c.add_argument("--config", metavar="FILE", help="YAML configuration file to resolve")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. train.steps=100 (repeatable; values are YAML)")
    c.set_defaults(func=_config)


def _add_export(sub: Any, common: argparse.ArgumentParser) -> None:
    e = sub.add_parser("export", parents=[common], help="write a checkpoint's model weights as a plain state_dict",
                       formatter_class=_Defaults,
                       description="Write the model's state_dict from CKPT (a step-NNNNNNNN.ckpt file, an FSDP2 "
                                   ".dcp folder, or a checkpoint folder: its newest good checkpoint) to OUT: "
                                   "OUT.pt (torch.save; torch.load(OUT, weights_only=True) reads it) or "
                                   "OUT.safetensors (needs pip install 'ampspec[safetensors]').")
    e.add_argument("checkpoint", metavar="CKPT")
    e.add_argument("out", metavar="OUT")
    e.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    e.set_defaults(func=_export)


def _add_audit(sub: Any, common: argparse.ArgumentParser) -> None:
    a = sub.add_parser("audit", parents=[common],
                       help="run your own training script and check it against the specification",
                       formatter_class=_Defaults,
                       description="Run SCRIPT.py as __main__ in the ampspec process itself (runpy, not a subprocess) "
                                   "under instrumentation of torch's AMP calls; "
                                   "report order-rule findings and numeric divergences from the specification. "
                                   "The audit's options may also follow the script's arguments; after '--' "
                                   "everything goes to the script. Exit status: 0 no error-level finding, 1 errors "
                                   "(with --strict: any finding), 2 the script raised or the report could not be "
                                   "written, 130/143 SIGINT/SIGTERM (the report is still written), or the script's "
                                   "own sys.exit or os._exit status.")
    a.add_argument("--report", metavar="FILE.json",
                   help="also write the report as JSON (never over the script, a source file or a link; over "
                        "another existing file only with --force)")
    a.add_argument("--force", action="store_true",
                   help="let --report replace an existing file that is not an ampspec audit report")
    a.add_argument("--steps", type=int, metavar="N", help="stop the script after N optimizer steps")
    a.add_argument("--no-replay", action="store_true", help="order rules only: copy no numbers, replay nothing")
    a.add_argument("--strict", action="store_true", help="warnings and info fail the audit too (exit status 1)")
    a.add_argument("--replay-every", default="auto", metavar="N|auto", help="replay steps 0, N, 2N, ... (the order "
                   "rules still see every step); auto: every step up to 2**21 parameter elements, then every Nth")
    a.add_argument("--replay-sample", default="auto", metavar="F|auto|all",
                   help="of a replayed step's optimizer stage, the share of the elements replayed; auto: whole up "
                        "to 2**19 elements, then that many (found_inf, unscale, clipping and the scale update stay "
                        "whole)")
    a.add_argument("--replay-seed", default="0", metavar="S", help="the seed of the replay's sample")
    a.add_argument("script", metavar="SCRIPT.py")
    a.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    a.set_defaults(func=audit_command)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ampspec", description="Mixed-precision training that explains itself.")
    _verbosity(p, False)
    p.add_argument("--version", action=_VersionAction, help="print ampspec's and torch's versions and exit")
    common = argparse.ArgumentParser(add_help=False)
    _verbosity(common, argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)
    _add_compare(sub, common)
    _add_train(sub, common)
    _add_export(sub, common)
    _add_config(sub, common)
    d = sub.add_parser("doctor", parents=[common], help="what this machine supports; with --task, a model's precision",
                       formatter_class=_Defaults,
                       description="Without --task: what this machine supports. With --task: run the model in each "
                                   "precision beside an fp32 shadow and give verdicts with fixes (exit status 1 when "
                                   "a verdict is an error).")
    # imported when the command runs: `ampspec --help` starts without torch
    from torchimpl.cli.doctor import add_options

    add_options(d, _task_name)
    d.set_defaults(func=_doctor)
    r = sub.add_parser("replay", parents=[common], help="recompute a trace's scale history with the reference",
                       formatter_class=_Defaults,
                       description="Recompute the scale history of TRACE (a train.trace_file, JSON Lines) from its "
                                   "found_inf bits with the reference specification and name the first step whose "
                                   "scale or growth tracker differs. Exit status 1 when a step differs.")
    r.add_argument("trace", metavar="TRACE")
    r.add_argument("--config", metavar="FILE", help="the scaler settings to replay with (default: those the trace's header records)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change one field of the policy replayed, e.g. scaler.growth_interval=7 (repeatable): of "
                        "the trace's recorded policy, or of --config's when given")
    r.set_defaults(func=replay_command)
    _add_audit(sub, common)
    return p


_AUDIT_VALUED = ("--report", "--steps", "--replay-every", "--replay-sample", "--replay-seed")


def _audit_split(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """For ``audit``: the command line up to SCRIPT, and what follows SCRIPT verbatim (None for
    another command). argparse would drop a ``--`` right after the script, which the audit's
    own parsing needs (after it, everything goes to the script)."""
    i = next((k for k, a in enumerate(argv) if not a.startswith("-")), None)
    if i is None or argv[i] != "audit":
        return argv, None
    j = i + 1
    while j < len(argv):
        a = argv[j]
        if a == "--":
            j += 1
            break
        if a.startswith("-"):
            j += 2 if a in _AUDIT_VALUED else 1
            continue
        break
    if j >= len(argv):
        return argv, None
    return argv[:j + 1], argv[j + 1:]


def main(argv: Sequence[str] | None = None) -> int:
    # First, so that a Ctrl-C or SIGTERM during the start-up (parsing, imports) ends with a line,
    # not a traceback or a silent kill (torchimpl.run.lifecycle, rule 2).
    previous = command_interrupts()
    try:
        return _main(argv)
    finally:
        restore_handlers(previous)


def _missing_working_directory() -> str | None:
    """The message for a working directory deleted under the shell, else None: checked before
    any work, because torch's libraries then fail to load with a fatal error naming neither."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return ("the working directory no longer exists (it was deleted or moved while this shell was in it); "
                "cd to an existing folder and run the command again")
    return None


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    head, tail = _audit_split(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(head)
    if tail is not None:
        args.args = tail
    if args.verbose and args.quiet:
        parser.error("-v/--verbose and -q/--quiet contradict each other; give one")
    gone = _missing_working_directory()
    if gone is not None:
        print(message_line("error", gone, args.command), file=sys.stderr)
        return 2
    if getattr(args, "resume", False) and getattr(args, "overwrite", False):
        parser.error("--resume and --overwrite contradict each other: --resume continues the run in the folder, "
                     "--overwrite replaces it; give one")
    # Under torchrun, the ranks other than 0 log warnings and errors only, each line naming its rank.
    level = logging.INFO if args.verbose and launch_rank() == 0 else logging.WARNING
    configure_logging(level)
    # The progress lines have their own handler (torchimpl.train.reporting): -q silences them here.
    logging.getLogger("torchimpl.progress").setLevel(logging.WARNING if args.quiet else logging.INFO)
    return run_command(args.func, args, f"{rank_prefix()}ampspec {args.command}", verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
