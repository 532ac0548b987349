"""The ``ampspec`` command, and the one place where torchimpl's parts meet the other packages.

Holds: the command line (``app``: ``compare``, ``train``, ``export``, ``config``, ``doctor``,
``replay``, ``audit``), its wiring to the other packages (``bridges``: ``replay`` through
``torchimpl.spec_bridge`` to ``reference``, ``audit`` to the ``audit`` package), how it ends on
an error (``errors``), its messages (``messages``),
``ampspec compare`` and its band (``compare``, ``agreement``), ``ampspec doctor --task``
(``doctor``) and ``ampspec export`` (``export``).

May import every torchimpl part; ``bridges`` alone imports ``reference`` and ``audit``. The
torch-importing parts, ``reference`` and ``audit`` are imported inside the functions of the
commands that use them, so that ``ampspec --help`` starts without torch.
"""

from torchimpl.cli.app import main

__all__ = ["main"]
