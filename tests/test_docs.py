"""The documentation keeps up with the code: the layout names every part and module, every cited
file exists, and the documentation site builds without a broken link or reference."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
_PARTS = ("reference", "torchimpl", "audit", "conformance", "tests", "bench", "docs")


def _layout_section() -> str:
    text = (_ROOT / "docs" / "architecture.md").read_text()
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, "docs/architecture.md has no '## Layout' section"
    return match.group(1)


def test_the_layout_names_every_part():
    layout = _layout_section()
    missing = [p for p in _PARTS if not re.search(rf"^{p}/", layout, re.M)]
    assert not missing, f"the layout in docs/architecture.md omits the parts {missing}"


def test_the_layout_names_every_module_of_torchimpl_and_audit():
    layout = _layout_section()
    missing = [f"{pkg}/{path.name}" for pkg in ("torchimpl", "audit")
               for path in sorted((_ROOT / pkg).glob("*.py"))
               if path.name != "__init__.py" and f"`{path.name}`" not in layout]
    assert not missing, f"the layout in docs/architecture.md omits {missing}: add a row saying what each holds"


_PATH_REF = re.compile(
    r"\b((?:reference|torchimpl|audit|conformance|tests|bench|docs|\.ci)/[\w./-]*\.(?:py|md|yml|txt|json|sh))\b")
_SKIP_DIRS = {"site", "build", "dist", "__pycache__", "ampspec-runs"}


def _tracked_text_files():
    for folder, dirs, files in os.walk(_ROOT):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")
                   and (not d.startswith(".") or d == ".ci")]
        for name in files:
            path = Path(folder, name)
            if path.suffix in (".py", ".md", ".toml", ".yml", ".sh") or name == "run":
                yield path.relative_to(_ROOT), path


def test_every_path_the_code_and_docs_cite_exists():
    """A comment or a page that points at a file points at one in the repository."""
    dangling = []
    for rel, path in _tracked_text_files():
        for ref in _PATH_REF.findall(path.read_text(errors="replace")):
            # bench/results/ holds what the benchmark scripts write: a script names its output
            # file before a run of it is committed.
            if not (_ROOT / ref).exists() and not ref.startswith("bench/results/"):
                dangling.append(f"{rel}: {ref}")
    assert not dangling, "references to files that do not exist:\n" + "\n".join(dangling)


def test_no_citation_of_documents_outside_the_repository():
    cites = [f"{rel}:{i}" for rel, path in _tracked_text_files()
             for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if re.search(r"DESIGN(\.md)?\s*(§|section|\d)|§\s*\d", line)]
    assert not cites, f"citations of a design document that is not in the repository: {cites}"


def test_the_docs_site_builds_strictly(tmp_path):
    """Every page, link, anchor and API reference resolves (``mkdocs build --strict``), where the
    ``docs`` extra is installed."""
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the documentation tools are not installed: pip install '.[docs]'")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=_ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout}{out.stderr}"


def _headings(text: str) -> list[str]:
    fence, out = False, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def _mkdocs_slug(title: str) -> str:  # Python-Markdown's toc slugify
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def _github_slug(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_the_readme_links_reach_their_pages_and_headings():
    """The README is not part of the site, so the strict build does not check its links."""
    readme = (_ROOT / "README.md").read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if target.startswith(("http://", "https://")):
            continue
        page, _, anchor = target.partition("#")
        if page and not (_ROOT / page).exists():
            broken.append(target)
        elif anchor and not page and anchor not in {_github_slug(h) for h in _headings(readme)}:
            broken.append(target)
        elif anchor and page.endswith(".md") and anchor not in {
                _mkdocs_slug(h) for h in _headings((_ROOT / page).read_text())}:
            broken.append(target)
    assert not broken, f"links in README.md that lead nowhere: {broken}"
