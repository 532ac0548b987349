"""Every command checks what it can before it starts work (no "run 1 of 3" before a bad
``--task`` is named, no trained script before a bad ``--report`` is refused)."""

from __future__ import annotations

import logging

import pytest

from torchimpl.cli.app import main
from torchimpl.train.reporting import PROGRESS_LOGGER


@pytest.fixture(autouse=True)
def _progress_level():
    logger = logging.getLogger(PROGRESS_LOGGER)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(old)


@pytest.mark.parametrize("task, named", [
    ("nosuchmodule_xyz:make", "no module 'nosuchmodule_xyz'"),
    ("module_without_it:nosuchfunction", "module 'module_without_it' has no function 'nosuchfunction'"),
])
def test_compare_names_a_bad_task_before_the_first_run(task, named, tmp_path, monkeypatch, capsys):
    (tmp_path / "module_without_it.py").write_text("def make():\n    raise SystemExit(9)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "cmp"
    assert main(["compare", "--steps", "2", "--device", "cpu", "--task", task, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "ampspec compare: error:" in err and named in err, err
    assert "run 1 of" not in err, err
    assert not out.exists(), "the refused comparison made its --out folder"


def test_train_refuses_resume_without_a_folder_before_calling_make(tmp_path, monkeypatch, capsys):
    (tmp_path / "counted_make_task.py").write_text(
        "import pathlib\n\ndef make():\n    pathlib.Path('make-was-called').write_text('')\n    raise SystemExit(9)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "--set", "task.name=counted_make_task:make", "--resume"]) == 2
    assert "--resume needs checkpoint.folder" in capsys.readouterr().err
    assert not (tmp_path / "make-was-called").exists()


def test_audit_refuses_a_report_path_that_is_a_folder_before_running_the_script(tmp_path, capsys):
    script = tmp_path / "loop.py"
    script.write_text("import pathlib\npathlib.Path(__file__).with_name('ran').write_text('')\n")
    assert main(["audit", "--report", str(tmp_path), str(script)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()
