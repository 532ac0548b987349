"""The user's task failing while it trains: the exception the command line ends on with exit 1
(``torchimpl.cli.errors`` rule 3). Apart from ``torchimpl.task.checks`` (which imports torch) so
that the command line's error handler knows it without importing torch."""

__all__ = ["TaskFailed"]


class TaskFailed(Exception):
    """The user's task raised while it trained (``torchimpl.cli.errors`` rule 3: exit 1)."""
