"""The documentation keeps up with the code: the layout names every part and module, every cited
file exists, and the documentation site builds without a broken link or reference."""

import importlib
import importlib.util
import json
import os
import re
import shlex
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
    missing = [f"{pkg}/{name}" for pkg, pattern in (("torchimpl", "**/*.py"), ("audit", "*.py"))
               for path in sorted((_ROOT / pkg).glob(pattern))
               if path.name not in ("__init__.py", "__main__.py")
               and f"`{(name := path.relative_to(_ROOT / pkg).as_posix())}`" not in layout]
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


def test_every_page_links_reach_their_pages_and_headings():
    """What the strict site build checks, without the documentation tools: a link between or
    within the pages of docs/ leads to a page and a heading there."""
    broken = []
    for page in sorted((_ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")) or target.endswith((".png", ".svg")):
                continue
            name, _, anchor = target.partition("#")
            linked = (page.parent / name) if name else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in {
                    _mkdocs_slug(h) for h in _headings(linked.read_text())}):
                broken.append(f"{page.name}: {target}")
    assert not broken, f"links in docs/ that lead nowhere: {broken}"


# ---------------------------------------------------------------- the snippets a user runs

_README = _ROOT / "README.md"
_TRAINING = _ROOT / "docs" / "training.md"


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.DOTALL | re.MULTILINE)


def _task_examples(path: Path) -> dict[str, str]:
    """The ``# NAME.py`` blocks of a page: the files a user is told to write."""
    return {m.group(1): code for code in _python_blocks(path) if (m := re.match(r"# (\w+)\.py", code))}


def _block_after(path: Path, lead: str, lang: str = "") -> str:
    """The fenced block that follows the sentence ``lead`` on a page."""
    text = path.read_text()
    start = text.index(lead)
    return re.search(rf"^```{lang}\n(.*?)^```", text[start:], re.DOTALL | re.MULTILINE).group(1)


def _elided_matches(documented: str, actual: str) -> bool:
    """Whether ``actual`` shows every part of ``documented`` between its ``...`` elisions, in order."""
    at = 0
    for part in (p.strip() for p in " ".join(documented.split()).split("...")):
        found = actual.find(part, at)
        if found < 0:
            return False
        at = found + len(part)
    return True


def test_the_readme_and_the_training_page_show_the_same_task_examples():
    readme, training = _task_examples(_README), _task_examples(_TRAINING)
    assert set(readme) == {"mymodule", "classify"}, sorted(readme)
    assert readme == training, "README.md and docs/training.md show different task examples"


@pytest.fixture
def task_examples(tmp_path, monkeypatch):
    """The README's task examples written as the user writes them, each under a module name no
    other test imported; the working directory is their folder."""
    names = {}
    for name, code in _task_examples(_README).items():
        names[name] = f"{name}_{tmp_path.name.replace('-', '_')}"
        (tmp_path / f"{names[name]}.py").write_text(
            code + "\n\ndef make_without_loss_fn():\n    return make()[:3]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return names


def _train(capsys, *sets: str) -> tuple[int, str, str]:
    from torchimpl.cli.app import main

    args = ["train", "-q", "--set", "device=cpu"]
    for s in sets:
        args += ["--set", s]
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_task_examples_train_and_the_logits_one_is_refused_without_its_loss_fn(task_examples, capsys):
    for name in ("mymodule", "classify"):
        code, out, err = _train(capsys, f"task.name={task_examples[name]}:make", "train.steps=3", "logging.dir=null")
        assert code == 0, f"the README's {name}.py does not train: {err}"
        assert json.loads(out)["steps_applied"] == 3
    code, _, err = _train(capsys, f"task.name={task_examples['classify']}:make_without_loss_fn", "train.steps=3",
                          "logging.dir=null")
    documented = re.search(r"Without it, the first batch is refused[^`]*`(ampspec train: error: [^`]*)`",
                           _README.read_text()).group(1)
    (line,) = [ln for ln in err.splitlines() if "error" in ln]
    assert code == 2 and _elided_matches(documented, line), f"documented:\n{documented}\nprinted:\n{line}"


def test_the_training_pages_commands_train_resume_export_and_load(task_examples, capsys):
    """README's train, resume and export commands, and docs/training.md's exports and
    ``load_weights`` snippet, on the README's own task."""
    import torch

    from torchimpl.cli.app import main

    task = f"task.name={task_examples['mymodule']}:make"
    readme = _block_after(_README, "From Python, `Trainer(...).fit(model, data, loss_fn=loss_fn)`.")
    first, second = (shlex.split(ln)[1:] for ln in readme.strip().splitlines())
    for args, steps in ((first, 100), (second, 200)):
        args[args.index("task.name=mymodule:make")] = task
        code, out = main(["-q", *args]), capsys.readouterr()
        assert code == 0 and json.loads(out.out)["steps_applied"] == steps, out.err
    export = re.search(r"after the runs above, `ampspec (export [^`]+)`", _README.read_text()).group(1)
    assert main(shlex.split(export)) == 0, capsys.readouterr().err
    assert torch.load(shlex.split(export)[-1], weights_only=True)["lin.weight"].shape == (1, 8)
    os.remove(shlex.split(export)[-1])  # docs/training.md's export below writes the same name
    # docs/training.md names the checkpoint the default 200 steps write.
    assert main(["train", "-q", "--set", task, "--set", "checkpoint.folder=checkpoints", "--set", "device=cpu"]) == 0
    for line in _block_after(_TRAINING, "To get the trained model's plain `state_dict`:").strip().splitlines():
        args = shlex.split(line.split("#")[0])[1:]
        if args[-1].endswith(".safetensors") and importlib.util.find_spec("safetensors") is None:
            continue  # its own test names the extra: tests/test_ti_user_task.py
        assert main(args) == 0, capsys.readouterr().err
    assert set(torch.load("model.pt", weights_only=True)) == {"lin.weight", "lin.bias"}
    module = importlib.import_module(task_examples["mymodule"])
    namespace = {"model": module.Net()}
    exec(_block_after(_TRAINING, "so it is never half written.", "python"), namespace)  # noqa: S102 - the page's own snippet
    assert torch.equal(namespace["model"].lin.weight, torch.load("model.pt", weights_only=True)["lin.weight"])


def test_the_bad_configuration_example_prints_what_the_page_shows(tmp_path, monkeypatch, capsys):
    from torchimpl.cli.app import main

    monkeypatch.chdir(tmp_path)
    command, *documented = _block_after(_TRAINING, "A bad configuration names every bad field at once, one per "
                                                   "line:").strip().split("\n")
    assert main(shlex.split(command.removeprefix("$ "))[1:]) == 2
    printed = capsys.readouterr().err.strip().splitlines()
    assert len(printed) == len(documented) == 3, printed
    for doc, line in zip(documented, printed):
        assert _elided_matches(doc, line), f"documented:\n{doc}\nprinted:\n{line}"


def test_the_python_api_snippets_run(task_examples):
    """docs/training.md's ``Trainer`` snippets on the README's task, in the page's order (the
    second uses the first's import): the built-in optimizer, and your own with its scheduler.
    Two steps each instead of the page's 200."""
    import warnings

    import torch

    from torchimpl.precision.plan import PrecisionDowngradeWarning

    make = importlib.import_module(task_examples["mymodule"]).make
    namespace = {"torch": torch}
    for lead in ("### From Python", "Your own optimizer and learning-rate scheduler go to `fit`:"):
        code = _block_after(_TRAINING, lead, "python")
        assert "max_steps=200" in code, code
        model, train_data, val_data = make()
        namespace.update(model=model, train_data=train_data, val_data=val_data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrecisionDowngradeWarning)  # 16-mixed on a CPU runs in fp32
            exec(code.replace("max_steps=200", "max_steps=2"), namespace)  # noqa: S102 - the page's own snippet
        summary = namespace.pop("summary")
        assert summary.outcome == "completed" and summary.steps_applied == 2, summary


def test_the_flat_keywords_the_training_page_lists_are_the_trainers():
    from torchimpl.config.schema import KEYWORDS

    text = " ".join(_TRAINING.read_text().split())
    listed = re.search(r"The flat keywords are (.*?); any other field", text).group(1)
    assert set(re.findall(r"`(\w+)`", listed)) == set(KEYWORDS)


def test_the_audit_pages_python_snippets_run(tmp_path, monkeypatch):
    """docs/audit.md's ``with audit()`` block on a correct GradScaler loop, and its pytest
    example as a test file defines (the fixture itself: tests/test_audit.py)."""
    import contextlib
    import io

    import torch

    def train(steps: int = 3) -> None:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(steps):
            x = torch.randn(8, 4)
            scaler.scale(((model(x) - x.sum(1, keepdim=True)) ** 2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    audit_page = _ROOT / "docs" / "audit.md"
    with_block, pytest_block = _python_blocks(audit_page)
    printed = io.StringIO()
    namespace = {"train": train}
    with contextlib.redirect_stdout(printed):
        exec(with_block, namespace)  # noqa: S102 - the page's own snippet
    assert namespace["session"].report.ok and "0 findings" in printed.getvalue(), printed.getvalue()
    tests = {"train": train}
    exec(pytest_block, tests)  # noqa: S102 - the page's own snippet
    assert [n for n in tests if n.startswith("test_")] == ["test_training_step_follows_the_contract",
                                                           "test_not_even_a_warning"]


def test_every_commands_help_shows_each_options_default_as_the_readme_says():
    """README: "`ampspec COMMAND --help` every option with its default" (an option that is off or
    unset unless given, default None or False, has none to show)."""
    import argparse

    from torchimpl.cli.app import _parser

    missing = []
    for name, sub in _parser()._subparsers._group_actions[0].choices.items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if (action.option_strings and action.help not in (None, argparse.SUPPRESS)
                    and action.default is not None and action.default is not False
                    and action.default != argparse.SUPPRESS
                    and f"(default: {action.default})" not in text):
                missing.append(f"{name} {action.option_strings[-1]}")
    assert not missing, f"options whose --help does not show the default: {missing}"


def test_the_run_summarys_keys_are_the_ones_docs_training_lists():
    import dataclasses

    from torchimpl.train.trainer import RunSummary

    text = " ".join(_TRAINING.read_text().split())
    listed = re.search(r"Its keys: (.*?)\.(?: |$)", text).group(1)
    names = re.findall(r"`(\w+)`", listed)
    assert names == [f.name for f in dataclasses.fields(RunSummary)]
