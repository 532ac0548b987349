"""What ``torch.compile`` did while the audit ran, by torch's own counters.

Read at the audit's start and its end (`audit.Audit`): the graphs Dynamo compiled
(``counters["stats"]["unique_graphs"]``: a recompile compiles another), its graph breaks
(``counters["graph_break"]``) and, of those, the ones whose user stack passes through the
audit's own files (``torch._dynamo.utils.graph_break_reasons``). The audit's step hooks return
at once while Dynamo traces (`audit.instrument`), so that last count is 0 where the audit works
as designed; the report states the three numbers. Nothing is read where the audited program
never imported ``torch._dynamo``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["COMPILED_REPLAY", "CompileCounts", "compile_line"]

COMPILED_REPLAY = "compiled step, by reference.compile's rules"  # how a compiled step's replay verdict begins

_AUDIT = str(Path(__file__).resolve().parent)


def _read() -> tuple[int, int, int] | None:
    """(graphs compiled, graph breaks, of them in the audit's files) so far in this process."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    counters = utils.counters
    reasons = getattr(utils, "graph_break_reasons", [])
    ours = sum(1 for r in reasons if any(str(Path(f.filename).resolve()).startswith(_AUDIT)
                                         for f in getattr(r, "user_stack", []) or []))
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), ours


@dataclass
class CompileCounts:
    """The counters at the audit's start; ``since()`` the difference at its end (None: no compile)."""

    start: tuple[int, int, int] | None = None

    @classmethod
    def now(cls) -> "CompileCounts":
        return cls(_read())

    def since(self) -> dict[str, Any] | None:
        end = _read()
        if end is None:
            return None
        start = self.start or (0, 0, 0)
        # torch._dynamo.reset() inside the program clears the counters: never a negative count
        graphs, breaks, ours = (e - s if e >= s else e for e, s in zip(end, start))
        if graphs == 0 and breaks == 0:
            return None
        return {"graphs_compiled": graphs, "graph_breaks": breaks, "graph_breaks_in_audit": ours}


def compile_line(c: dict[str, Any]) -> str:
    """The report's line about torch.compile."""
    ours = c["graph_breaks_in_audit"]
    cause = "none of them in the audit's code" if ours == 0 else f"{ours} of them in the audit's code"
    g, b = c["graphs_compiled"], c["graph_breaks"]
    return (f"torch.compile during the audit (torch's counters): {g} graph{'s' if g != 1 else ''} compiled "
            f"(a recompile is another), {b} graph break{'s' if b != 1 else ''}, {cause}")
