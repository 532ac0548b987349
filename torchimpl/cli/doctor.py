"""``ampspec doctor --task``: the doctor on a task, as text, JSON and a picture.

1. The task (``lm``, ``mlp`` or ``module:make``) is built as ``ampspec train`` builds it
   (seeded from ``--seed``); its training batches feed the doctor, its loss function (the
   task's fourth element, or the model's own loss) is the loss.
2. ``--precision all`` runs bf16, fp16 and (with torchao) fp8, one report each; without torchao
   fp8 is left out with a note, and an explicit ``--precision fp8`` fails naming the extra. A
   model with no linear layer float8 can run gets a note for fp8 under ``all`` (the exit status
   is the other modes'), an error under ``--precision fp8``.
3. ``--report FILE.json`` writes ``{"reports": [...]}``, each report's ``to_dict()``, whole
   (``torchimpl.safe_files``); ``--plot FILE.png`` needs matplotlib (``pip install
   'ampspec[plot]'``), written to a temporary file and renamed into place. Both are checked
   before any work, with the numbers: a folder that does not exist or cannot be written in, a
   link, a folder, the task's own module file, the two options naming one file, and an
   existing file that is not an earlier report (or PNG) are refused, never overwritten.
4. The user's task is the user's code: an exception it raises, or a ``sys.exit`` it calls
   (with any status, 0 included), while it is built or while the doctor runs it, ends the
   command with an error naming the task and exit 2; there is then no diagnosis. SIGINT and
   SIGTERM end it with 130 and 143 and one line (``torchimpl.cli.errors``).
5. Exit status: 0 when no verdict is an error (healthy, or warnings only), 1 when one is, 2
   for bad input (rules 3-4).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_doctor"]


def _precisions(requested: str) -> tuple[list[str], list[str]]:
    # imported when the doctor runs: the parser is built without torch
    from torchimpl.precision.fp8 import torchao_available

    if requested != "all":
        if requested == "fp8" and not torchao_available():
            raise RuntimeError("--precision fp8 needs torchao: pip install 'ampspec[fp8]'")
        return [requested], []
    if torchao_available():
        return ["bf16", "fp16", "fp8"], []
    return ["bf16", "fp16"], ["fp8 left out: torchao is not installed (pip install 'ampspec[fp8]')"]


def _is_own(path: Path, option: str) -> bool:
    """Whether an existing ``path`` is a file this command wrote (a report, a PNG), so replaceable."""
    with open(path, "rb") as f:
        head = f.read(1 << 20)
    if option == "--plot":
        return head.startswith(b"\x89PNG")
    try:
        data = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "reports" in data


def _check_inputs(args: Any) -> None:
    """Every option checked before any work (rule 3, and the numbers)."""
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.master_weights != "none" and args.precision != "bf16-true":
        raise ValueError(f"--master-weights {args.master_weights} applies to --precision bf16-true (parameters held "
                         f"in bf16), got --precision {args.precision}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if not math.isfinite(args.lr) or args.lr < 0:
        raise ValueError(f"--lr must be a finite number >= 0, got {args.lr}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ImportError("--plot needs matplotlib, the optional 'plot' extra: pip install 'ampspec[plot]'")
    # imported when the doctor runs: the parser is built without torch
    from torchimpl.safe_files import refuse_link

    outputs = [(option, path) for option, path in (("--report", args.report), ("--plot", args.plot)) if path]
    task_file = _task_file(args.task)
    for option, path in outputs:
        folder = Path(path).resolve().parent
        if not folder.is_dir():
            raise ValueError(f"{option} {path}: the folder {folder} does not exist")
        refuse_link(path, option)
        if Path(path).is_dir():
            raise ValueError(f"{option} {path} is a folder; give a file path")
        if task_file is not None and Path(path).resolve() == task_file:
            raise ValueError(f"{option} {path} is the module of --task {args.task}; choose another path")
        if Path(path).is_file() and Path(path).stat().st_size and not _is_own(Path(path), option):
            raise ValueError(f"{option} {path} exists and is not a doctor {'plot' if option == '--plot' else 'report'}; "
                             "ampspec overwrites only its own files: choose another path")
        _check_writable(option, path, folder)
    if len(outputs) == 2 and Path(outputs[0][1]).resolve() == Path(outputs[1][1]).resolve():
        raise ValueError(f"--report {args.report} and --plot {args.plot} name the same file; give each its own path")


def _check_writable(option: str, path: str, folder: Path) -> None:
    """A file can be made in ``folder`` (made and removed at once: nothing of it is left)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".ampspec-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot write in the folder {folder}: {exc.strerror or exc}; "
                         "choose a writable folder") from None


def _task_file(task: str) -> Path | None:
    """The file of a ``module:function`` task's module, found as the import will find it (the
    working directory first) without importing it; None for an embedded task or a module that
    is not found (building the task names that)."""
    module, sep, _ = task.partition(":")
    if not sep:
        return None
    path: list[str] | None = [os.getcwd(), *sys.path]
    spec = None
    for part in module.split("."):
        try:
            spec = importlib.machinery.PathFinder.find_spec(part, path)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or [])
    origin = getattr(spec, "origin", None)
    return Path(origin).resolve() if origin and origin not in ("built-in", "frozen") else None


def _task_call(task: str, what: str, call: Callable[[], Any]) -> Any:
    """Rule 4: ``call()``, the user's task failing or exiting in it named with exit 2."""
    # imported when the doctor runs: the parser is built without torch
    from torchimpl.cli.errors import where
    from torchimpl.task.checks import task_failure

    try:
        return call()
    except SystemExit as exc:
        raise ValueError(f"--task {task} called sys.exit({exc.code!r}) {what}; a task returns (model, "
                         "train_data, val_data) and its model and loss return values: no diagnosis was made") from None
    except Exception as exc:  # noqa: BLE001 - the user's code: named, never a traceback
        if task in ("lm", "mlp") or task_failure(task, exc) is None:
            raise  # ampspec's own refusal, which names its field
        text = " ".join(str(exc).split())[:500]
        raise ValueError(f"--task {task} raised {type(exc).__name__}: {text} (at {where(exc)}) {what}; "
                         "no diagnosis was made") from None


def run_doctor(args: Any) -> int:
    """Rules 1-4 for the parsed ``ampspec doctor`` options."""
    # imported when the command runs: `ampspec --help` starts without torch
    import torch

    # imported when the doctor runs: the parser is built without torch
    from torchimpl.config.schema import TaskConfig
    from torchimpl.precision.device import resolve_device
    from torchimpl.doctor.inspect import inspect_precision
    from torchimpl.doctor.plot import save_plot
    from torchimpl.precision.fp8 import Fp8NotApplicable
    from torchimpl.safe_files import replace_text
    from torchimpl.task.builtin import build_task

    _check_inputs(args)
    precisions, notes = _precisions(args.precision)
    task = _task_call(args.task, "while it was built", lambda: build_task(
        TaskConfig(name=args.task, size=args.size), seed=args.seed, batch_size=args.batch_size))
    device = resolve_device(args.device)
    reports = []
    start = time.perf_counter()
    for precision in precisions:
        try:
            report = _task_call(args.task, f"during the {precision} diagnosis", lambda: inspect_precision(
                task.model, task.train_data, task.loss_fn, precision=precision, steps=args.steps, device=device,
                init_scale=args.init_scale, fp32_modules=args.fp32_module,
                optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr), master_weights=args.master_weights))
        except Fp8NotApplicable as exc:
            if args.precision != "all":
                raise
            notes.append(f"fp8 does not apply to this model, left out: {exc}")
            continue
        reports.append(report)
        print(report.text())
        print()
    for n in notes:
        print(f"note: {n}")
    if args.report:
        data = {"task": args.task, "steps": args.steps, "reports": [r.to_dict() for r in reports], "notes": notes}
        _write("--report", args.report, lambda: replace_text(args.report, json.dumps(data, indent=2, allow_nan=False),
                                                             what="--report"))
        print(f"report: {args.report}")
    if args.plot:
        _write("--plot", args.plot, lambda: save_plot(reports, args.plot))
        print(f"plot: {args.plot}")
    print(f"took {time.perf_counter() - start:.1f} s")
    return 1 if any(v.severity == "error" for r in reports for v in r.verdicts) else 0


def _write(option: str, path: str, write: Callable[[], Any]) -> None:
    """An output that fails after the diagnosis (the folder changed under it, a full disk): the
    file and the reason, as a failed run (exit 1); the diagnosis is printed above."""
    # imported when the doctor runs: the parser is built without torch
    from torchimpl.safe_files import RunFileWriteError

    try:
        write()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        if isinstance(exc, RunFileWriteError) and exc.__cause__ is not None:
            reason = getattr(exc.__cause__, "strerror", None) or str(exc.__cause__)
        raise RunFileWriteError(f"{option} {path}: cannot write: {reason}; the diagnosis is printed above: rerun "
                                "with a path in a writable folder", exc.errno, path) from None


def add_options(d: Any, task_type: Any) -> None:
    """The ``--task`` options on the ``doctor`` subparser."""
    d.add_argument("--task", type=task_type, metavar="lm|mlp|MODULE:FUNCTION",
                   help="diagnose this task's model (without --task: this machine's environment report)")
    d.add_argument("--precision", default="all", choices=("bf16", "fp16", "fp8", "bf16-true", "all"),
                   help="the precision to diagnose (all: bf16, fp16 and, with torchao, fp8; bf16-true: "
                        "parameters held in bf16)")
    d.add_argument("--master-weights", default="none", choices=("none", "fp32", "kahan", "stochastic"),
                   help="precision.master_weights of --precision bf16-true")
    d.add_argument("--steps", type=int, default=20, help="steps beside the fp32 shadow")
    d.add_argument("--report", metavar="FILE.json", help="also write the reports as JSON")
    d.add_argument("--plot", metavar="FILE.png", help="per-layer headroom and underflow bars (needs ampspec[plot])")
    d.add_argument("--init-scale", type=float, default=2.0**16, help="the fp16 loss scale to measure at")
    d.add_argument("--fp32-module", action="append", default=[], metavar="PATTERN",
                   help="run modules matching PATTERN in fp32 (precision.fp32_modules); repeatable")
    d.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate for the doctor's steps")
    d.add_argument("--seed", type=int, default=0, help="the task's seed (model initialisation and data)")
    d.add_argument("--batch-size", type=int, default=16, help="batch size of the embedded tasks")
    d.add_argument("--size", default="small", choices=("tiny", "small"), help="size of the embedded tasks")
    d.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N")
