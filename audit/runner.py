"""Run a user's script in-process under the audit: ``ampspec audit SCRIPT.py [ARGS...]``.

The script runs as ``__main__`` (``runpy``), with ``sys.argv`` set to ``[SCRIPT, *ARGS]`` and its
folder first on ``sys.path``, exactly as ``python SCRIPT.py ARGS`` would run it; both are
restored afterwards. Exit status: 0 when no finding is an error, 1 when one is (``--strict``:
when there is any finding), 2 when the script raised (its traceback is printed as Python would,
without the audit's frames) or could not be run; a script that ends with ``sys.exit(N)`` exits
with its own N. The report is printed (and written) in every case; a process the script forked
prints none (its parent's report covers it).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any, Sequence

from audit import Audit
from audit.report import AuditReport
from audit.sampling import parse_every, parse_fraction

__all__ = ["run_script", "split_audit_options", "main"]

_OWN = ("--report", "--steps", "--replay-every", "--replay-sample", "--replay-seed")
_FLAGS = ("--no-replay", "--strict")


def run_script(script: str | os.PathLike, args: Sequence[str] = (), *, steps: int | None = None,
               replay: bool = True, strict: bool = False, **sampling: Any) -> AuditReport:
    """Audit one run of ``script`` with ``args``; raises FileNotFoundError when it does not exist.

    ``sys.exit(N)`` in the script ends the run like its end, with ``script_status`` N (1 with
    a message, which goes to stderr as Python prints it); it is not a failure of the audit."""
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"no such script: {script}")
    session = Audit(replay=replay, steps=steps, target=str(script), strict=strict, **sampling)
    session.argv = [str(script), *args]
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    error: BaseException | None = None
    status: int | None = None
    session.start()
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except BaseException as exc:  # the script's failure, or the step limit: both end the run
        error = exc
    finally:
        report = session.stop(_trim(error))
        sys.argv = saved_argv
        sys.path[:] = saved_path
    report.script_status = status
    return report


def _exit_status(code: Any) -> int | None:
    """The status Python exits with for ``sys.exit(code)`` (None for 0); a message is printed."""
    if code is None or code == 0:
        return None
    if isinstance(code, int) and not isinstance(code, bool):
        return (code & 0xFF) or None
    print(code, file=sys.stderr)
    return 1


def _trim(error: BaseException | None) -> BaseException | None:
    """The traceback as the script would show it: from its own first frame on, without runpy's
    frames or the audit's wrappers around torch's functions."""
    if error is None:
        return None
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep

    def noise(tb: Any) -> bool:
        name = tb.tb_frame.f_code.co_filename
        return name.startswith(here) or name == runpy.__file__ or "<frozen runpy>" in name

    frames = []
    tb = error.__traceback__
    while tb is not None:
        if not noise(tb):
            frames.append(tb)
        tb = tb.tb_next
    for a, b in zip(frames, frames[1:] + [None]):
        a.tb_next = b
    # No frame of the script (a SyntaxError raised while compiling it): Python shows only the
    # error, with its file, line and caret.
    error.__traceback__ = frames[0] if frames else None
    return error


def split_audit_options(rest: Sequence[str]) -> tuple[list[str], dict[str, str | bool]]:
    """The script's arguments and the audit's own options found among them.

    ``--report FILE``, ``--steps N``, ``--replay-every N``, ``--replay-sample F|auto|all``,
    ``--replay-seed S`` (also ``--report=FILE``), ``--no-replay`` and ``--strict`` are the audit's
    wherever they appear after the script, until a ``--``; everything after ``--`` goes to the
    script verbatim (for a script with options of the same names).
    """
    script_args: list[str] = []
    own: dict[str, str | bool] = {}
    i = 0
    rest = list(rest)
    while i < len(rest):
        a = rest[i]
        if a == "--":
            script_args.extend(rest[i + 1:])
            break
        name, eq, value = a.partition("=")
        if name in _OWN:
            if not eq:
                if i + 1 >= len(rest):
                    raise ValueError(f"{name} needs a value")
                value = rest[i + 1]
                i += 1
            own[name[2:].replace("-", "_")] = value
        elif a in _FLAGS:
            own[a[2:].replace("-", "_")] = True
        else:
            script_args.append(a)
        i += 1
    return script_args, own


def _sampling_options(own: dict[str, Any], every: Any, sample: Any, seed: Any) -> dict[str, Any]:
    """``--replay-every``, ``--replay-sample`` and ``--replay-seed`` checked (audit.sampling) before the script runs."""
    every, sample, seed = own.get("replay_every", every), own.get("replay_sample", sample), own.get("replay_seed", seed)
    try:
        seed = int(seed)
    except ValueError:
        raise ValueError(f"--replay-seed needs an integer >= 0, got {seed!r}") from None
    parse_fraction(sample)
    interval = parse_every(every)
    return {"replay_every": "auto" if interval is None else interval, "replay_sample": sample, "replay_seed": seed}


def _check_report_path(path: Path) -> None:
    """``--report`` refused before the script runs, not after it trained."""
    if path.is_dir():
        raise ValueError(f"--report {path} is a folder; give a file path such as {path / 'audit.json'}")
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--report {path}: cannot write in {folder}; choose a writable folder")


def main(script: str, rest: Sequence[str], *, report: str | None = None, steps: int | None = None,
         no_replay: bool = False, strict: bool = False, replay_every: str | int = "auto",
         replay_sample: str = "auto", replay_seed: str | int = 0) -> int:
    """The ``ampspec audit`` subcommand: run, print the text report, write the JSON one."""
    args, own = split_audit_options(rest)
    sampling = _sampling_options(own, replay_every, replay_sample, replay_seed)
    report = own.get("report", report)  # type: ignore[assignment]
    if "steps" in own:
        try:
            steps = int(own["steps"])  # type: ignore[arg-type]
        except ValueError:
            raise ValueError(f"--steps needs an integer, got {own['steps']!r}") from None
    if steps is not None and steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    no_replay = bool(own.get("no_replay", no_replay))
    strict = bool(own.get("strict", strict))
    if not Path(script).is_file():
        raise FileNotFoundError(f"no such script: {script}")
    if report:
        _check_report_path(Path(report))
    pid = os.getpid()
    result = run_script(script, args, steps=steps, replay=not no_replay, strict=strict, **sampling)
    if os.getpid() != pid:  # a child the script forked came back here: its parent reports
        return result.script_status or 0
    sys.stdout.flush()
    print(result.text(include_error=False))
    if result.error is not None:
        print(result.error.rstrip(), file=sys.stderr)
    if report:
        path = result.write_json(report)
        print(f"report: {path}")
    return result.exit_status
