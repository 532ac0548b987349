"""A usage error that lists several problems (:class:`ProblemList`), and the configuration's
(:class:`ConfigError`): the exceptions that the configuration's sections raise, here where
every section (``precision``, ``optimizer``, ``scaler``, ...) can import them; imports nothing."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ConfigError", "ProblemList"]


class ProblemList(ValueError):
    """A usage error whose text is a heading line, then one problem per line (``torchimpl.cli.errors`` rule 2)."""


class ConfigError(ProblemList):
    """A configuration with one or more bad fields; ``errors`` lists ``(dotted_path, message)``.
    Several are written one per line (the command line prints them so, ``torchimpl.cli.errors``)."""

    def __init__(self, errors: Sequence[tuple[str, str]]):
        self.errors = list(errors)
        lines = [f"{path}: {msg}" if path else msg for path, msg in self.errors]
        if len(lines) == 1:
            text = f"invalid configuration: {lines[0]}"
        else:
            text = "invalid configuration (%d errors):\n  %s" % (len(lines), "\n  ".join(lines))
        super().__init__(text)
