"""Which framework's code made a call: the frameworks people train with, found on the stack.

A finding's call site may lie inside a framework's own code (Lightning's Trainer steps the
scheduler, Accelerate's ``backward`` calls ``loss.backward``, the HF ``Trainer`` clips). Then the
mistake is fixed by a setting of that framework, not by the line the user wrote. `attribute`
reads the frames between the user's innermost frame and the call: the framework the user's
code called into (the outermost framework frame inside the user's frame), its version, the
innermost framework frame (where the call was made) and the user's frame that led there.

A frame belongs to a framework when its file lies under the installed package's directory, as
the import system locates it (`importlib.util.find_spec`, without importing the package), never
by matching names in arbitrary paths. No torch here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from typing import Sequence

__all__ = ["FRAMEWORKS", "FrameworkCall", "Site", "attribute", "framework_of", "version_of"]

# (key, distribution that carries the version, the package's path from its top-level package).
# The key names the framework in reports and in a rule's ``framework_fixes``; the standalone
# ``pytorch_lightning`` and ``lightning_fabric`` distributions are the same frameworks.
FRAMEWORKS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("lightning.pytorch", "lightning", ("lightning", "pytorch")),
    ("lightning.fabric", "lightning", ("lightning", "fabric")),
    ("lightning.pytorch", "pytorch-lightning", ("pytorch_lightning",)),
    ("lightning.fabric", "lightning-fabric", ("lightning_fabric",)),
    ("accelerate", "accelerate", ("accelerate",)),
    ("transformers", "transformers", ("transformers",)),
    ("mmengine", "mmengine", ("mmengine",)),
    ("timm", "timm", ("timm",)),
)


@dataclass(frozen=True)
class FrameworkCall:
    """A call made by a framework's code: the framework the user's code called into (``name``,
    a key of `FRAMEWORKS`) with its installed ``version``, the innermost framework frame
    (``frame``, file:line: the call itself) and the user's innermost frame that led there
    (``user_frame``; None when no frame of the user's code is on the stack)."""

    name: str
    version: str
    frame: str
    user_frame: str | None


class Site(str):
    """A call site ``file:line`` as the reports show it, carrying the framework call it was made
    through (``via``); a plain ``str`` everywhere else, so that messages and comparisons are
    unchanged."""

    via: FrameworkCall | None = None

    def __new__(cls, shown: str, via: FrameworkCall | None) -> "Site":
        site = super().__new__(cls, shown)
        site.via = via
        return site

    def __reduce__(self) -> tuple:
        return (Site, (str(self), self.via))


_roots: list[tuple[str, str, str, str]] | None = None  # (directory + sep, key, distribution, site), longest first
_by_file: dict[str, tuple[str, str, str] | None] = {}
_versions: dict[str, str] = {}


def _package_dir(parts: tuple[str, ...]) -> tuple[str, str] | None:
    """The installed directory of ``parts[0]`` (found, not imported) joined with the rest, and the
    directory that holds ``parts[0]``."""
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return None
    top = os.path.realpath(locations[0])
    path = os.path.join(top, *parts[1:])
    return (path, os.path.dirname(top)) if os.path.isdir(path) else None


def _framework_roots() -> list[tuple[str, str, str, str]]:
    global _roots
    if _roots is None:
        found = [(d[0] + os.sep, key, dist, d[1]) for key, dist, parts in FRAMEWORKS
                 if (d := _package_dir(parts)) is not None]
        _roots = sorted(found, key=lambda r: -len(r[0]))  # a subpackage before its parent
    return _roots


def framework_of(filename: str) -> tuple[str, str, str] | None:
    """(key, distribution, the file's path from its top-level package) of the framework whose
    installed package holds ``filename``, else None."""
    if filename in _by_file:
        return _by_file[filename]
    found = None
    if not filename.startswith("<"):
        path = os.path.realpath(filename)
        found = next(((key, dist, os.path.relpath(path, site)) for root, key, dist, site in _framework_roots()
                      if path.startswith(root)), None)
    _by_file[filename] = found
    return found


def version_of(distribution: str) -> str:
    """The installed version of ``distribution`` ("unknown" when its metadata is missing)."""
    v = _versions.get(distribution)
    if v is None:
        try:
            v = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            v = "unknown"
        _versions[distribution] = v
    return v


def attribute(shown: str, library: Sequence[tuple[str, int]], user_frame: bool) -> str:
    """The call site ``shown``, attributed to a framework when one made the call.

    ``library``: (file name, line) of the library frames between the call and the user's
    innermost frame, innermost first (the frames of torch and of the audit left out);
    ``user_frame``: whether ``shown`` is a frame of the user's code. The framework is the one the
    user's code called into: the outermost framework frame of ``library``; the call is shown at
    the innermost one, as a path from its top-level package (``accelerate/accelerator.py:2889``)."""
    inside = [(fw, line) for name, line in library if (fw := framework_of(name)) is not None]
    if not inside:
        return shown
    key, dist, _ = inside[-1][0]
    (_, _, path), line = inside[0]
    return Site(shown, FrameworkCall(key, version_of(dist), f"{path}:{line}", shown if user_frame else None))
