"""How the command line ends on an error or a signal: one line on stderr, never a traceback.

1. :class:`~torchimpl.run.lifecycle.Interrupted` (SIGINT, SIGTERM): ``<command>: interrupted by
   SIGINT ...``, exit 130 or 143; a bare ``KeyboardInterrupt`` is a SIGINT.
2. A user mistake found before work (``ValueError`` and its kinds: a bad configuration, a
   refused resume, a damaged file; ``OSError``; ``ImportError``): ``<command>: error: ...``,
   exit 2. A usage error listing several problems (:class:`ProblemList`, such as a configuration
   with several bad fields) prints its heading on that line and each problem on its own
   indented line below it, so that no two problems run together.
3. The user's task failing while it trains (:class:`TaskFailed`):
   ``<command>: error: task.name '...' failed while training: ...``, exit 1.
3a. A run file that cannot be written once work has begun (a full disk, a folder turned
   read-only: :class:`~torchimpl.safe_files.RunFileWriteError`): the environment, not the
   input, stopped a run, so it exits 1 like any failed run; its one line names the file and fix.
4. Anything else (an unexpected fault):
   ``<command>: error: <type>: <message> (at file:line)``, exit 1; ``-v`` adds the traceback.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable

from torchimpl.config.problems import ProblemList
from torchimpl.run.lifecycle import Interrupted
from torchimpl.safe_files import RunFileWriteError
from torchimpl.task.failure import TaskFailed

__all__ = ["ProblemList", "TaskFailed", "USAGE_ERRORS", "run_command", "where"]

USAGE_ERRORS = (ValueError, OSError, ImportError)
"""Exceptions that are the input's fault, found before work: exit status 2."""


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def where(exc: BaseException) -> str:
    """``file:line`` of the innermost frame that raised ``exc`` ('' without a traceback)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def run_command(func: Callable[[Any], int], args: Any, name: str, *, verbose: bool = False) -> int:
    """``func(args)``'s status, or the status of the error or signal that ended it (rules 1-4)."""
    try:
        try:
            return func(args)
        finally:
            sys.stdout.flush()
    except Interrupted as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        print(f"{name}: {_one_line(str(exc)) or 'interrupted by SIGINT'}", file=sys.stderr)
        return 130
    except RecursionError as exc:  # a subclass of RuntimeError, but never the input's fixable mistake
        print(f"{name}: error: nesting too deep ({exc}) at {where(exc)}", file=sys.stderr)
        return 2
    except RunFileWriteError as exc:  # before USAGE_ERRORS: an OSError, but a failed run (rule 3a)
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1
    except ProblemList as exc:
        heading, *problems = [_one_line(text) for text in str(exc).splitlines() if text.strip()] or [""]
        print("\n".join([f"{name}: error: {heading}", *(f"  {p}" for p in problems)]), file=sys.stderr)
        return 2
    except USAGE_ERRORS + (RuntimeError,) as exc:
        print(f"{name}: error: {_one_line(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return 2
    except TaskFailed as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the last resort: a line, and the traceback on request
        if verbose:
            traceback.print_exc()
        text = _one_line(str(exc))
        print(f"{name}: error: {type(exc).__name__}{': ' + text if text else ''} (at {where(exc)}; "
              "rerun with -v for the traceback)", file=sys.stderr)
        return 1
