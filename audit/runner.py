"""Run a user's script in-process under the audit: ``ampspec audit SCRIPT.py [ARGS...]``.

The script runs as ``__main__`` (``runpy``), with ``sys.argv`` set to ``[SCRIPT, *ARGS]`` and its
folder first on ``sys.path``, exactly as ``python SCRIPT.py ARGS`` would run it; both are
restored afterwards. Exit status: 0 when no finding is an error, 1 when one is (``--strict``:
when there is any finding), 2 when the script raised (its traceback is printed as Python would,
without the audit's frames) or could not be run, or the report could not be written; a script
that ends with ``sys.exit(N)`` or ``os._exit(N)`` exits with its own N (0: as the findings say);
SIGINT and SIGTERM stop it with 130 and 143. The report is printed (and written) in every one
of these cases, marked incomplete when a signal cut the run short; a process the script forked
prints none (its parent's report covers it).

``--report`` is made absolute and checked before the script runs (`audit.report_file`: never
the script, a source file, a link, or another program's file unless ``--force``), so a script
that changes its working folder still writes it where it was asked.
"""

from __future__ import annotations

import contextlib
import functools
import os
import reprlib
import runpy
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from audit import Audit
from audit.report import EXIT_FAILED, AuditReport
from audit.report_file import ReportWriteError, check_report_path
from audit.sampling import parse_every, parse_fraction

__all__ = ["run_script", "split_audit_options", "main"]

_OWN = ("--report", "--steps", "--replay-every", "--replay-sample", "--replay-seed")
_FLAGS = ("--no-replay", "--strict", "--force")


class ScriptInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM while the audited script runs (a KeyboardInterrupt, as Ctrl-C is to
    it); ``signal`` is the signal's name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"interrupted by {name}")
        self.signal = name


def run_script(script: str | os.PathLike, args: Sequence[str] = (), *, steps: int | None = None,
               replay: bool = True, strict: bool = False,
               on_os_exit: Callable[[AuditReport], int] | None = None, **sampling: Any) -> AuditReport:
    """Audit one run of ``script`` with ``args``; raises FileNotFoundError when it does not exist.

    ``sys.exit(N)`` in the script ends the run like its end, with ``script_status`` N (1 with
    a message, which goes to stderr as Python prints it); it is not a failure of the audit.
    SIGINT and SIGTERM (main thread) end it with the report marked ``interrupted``.
    ``on_os_exit``: called with the report when the script calls ``os._exit`` (in this process,
    not a child it forked), which then exits with the status it returns."""
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
    ended: str | None = None
    interrupted: str | None = None
    session.start()
    try:
        with _interrupts(), _os_exit_hook(session, on_os_exit):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        status = _exit_status(exc.code)
        ended = f"the script left by sys.exit({reprlib.repr(exc.code) if exc.code is not None else ''})"
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM (ScriptInterrupted), or the command's own handler's
        interrupted = getattr(exc, "signal", None) or "SIGINT"
    except BaseException as exc:  # the script's failure, or the step limit: both end the run
        error = exc
    finally:
        report = session.stop(_trim(error), interrupted=interrupted)
        sys.argv = saved_argv
        sys.path[:] = saved_path
    report.script_status = status
    report.ended = ended
    return report


@contextlib.contextmanager
def _interrupts() -> Iterator[None]:
    """While the script runs: SIGINT and SIGTERM raise `ScriptInterrupted` in it (a script's own
    handlers, installed later, take precedence); the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        raise ScriptInterrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _os_exit_hook(session: Audit, finish: Callable[[AuditReport], int] | None) -> Iterator[None]:
    """While the script runs, ``os._exit(n)`` in this process first stops the audit and hands
    the report to ``finish``, then exits with its status; in a process the script forked (the
    replay worker, a DataLoader's, ``multiprocessing``'s) it is the real ``os._exit``, at once."""
    real = os._exit
    if finish is None:
        yield
        return

    def leave(n: int) -> None:
        if os.getpid() != session.pid or not isinstance(n, int):
            real(n)  # a child's exit is its own; a bad argument raises as Python's does
        code = 2
        try:
            report = session.stop()
            report.script_status = _exit_status(n)
            report.ended = f"the script left by os._exit({n})"
            code = finish(report)
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            real(code)

    os._exit = leave
    try:
        yield
    finally:
        os._exit = real


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
    ``--replay-seed S`` (also ``--report=FILE``), ``--no-replay``, ``--strict`` and ``--force`` are the audit's
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


def main(script: str, rest: Sequence[str], *, report: str | None = None, steps: int | None = None,
         no_replay: bool = False, strict: bool = False, force: bool = False, replay_every: str | int = "auto",
         replay_sample: str = "auto", replay_seed: str | int = 0) -> int:
    """The ``ampspec audit`` subcommand: run, print the text report, write the JSON one.

    Every option, ``--report`` included, is checked before the script runs."""
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
    force = bool(own.get("force", force))
    if not Path(script).is_file():
        raise FileNotFoundError(f"no such script: {script}")
    target = None
    if report:
        target = Path(os.path.abspath(report))  # now: the script may change the working folder
        check_report_path(target, script=Path(script), force=force, given=report)
    pid = os.getpid()
    finish = functools.partial(_finish, report=report, target=target, script=Path(script).absolute(), force=force)
    result = run_script(script, args, steps=steps, replay=not no_replay, strict=strict, on_os_exit=finish,
                        **sampling)
    if os.getpid() != pid:  # a child the script forked came back here: its parent reports
        return result.script_status or 0
    return finish(result)


def _finish(result: AuditReport, *, report: str | None, target: Path | None, script: Path, force: bool) -> int:
    """Print the text report (the script's traceback to stderr), write the JSON one; the exit
    status (2 when the report cannot be written: the message says why, the old one is kept)."""
    sys.stdout.flush()
    print(result.text(include_error=False))
    if result.error is not None:
        print(result.error.rstrip(), file=sys.stderr)
    if target is not None:
        try:
            result.write_json(target, force=force, script=script)
        except (ValueError, ReportWriteError) as exc:  # something appeared there while the script ran; a full disk
            sys.stdout.flush()
            print(f"ampspec audit: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        print(f"report: {report}")
    return result.exit_status
