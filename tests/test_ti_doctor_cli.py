"""ampspec doctor: the picture a person reads (rows, colours, both headrooms, the verdicts written
on it), and bad input refused before the diagnosis (output paths, a task that exits or raises,
signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from torchimpl import inspect_precision

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))
from doctor_models.models import CATALOGUE  # noqa: E402

matplotlib = pytest.importorskip("matplotlib", reason="the picture needs the plot extra: pip install 'ampspec[plot]'")
matplotlib.use("Agg")
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from torchimpl.doctor.plot import COLORS, PANELS, doctor_figure  # noqa: E402


def _catalogue(name: str):
    case = CATALOGUE[name]
    model, train, _ = case.make()
    return inspect_precision(model, train, precision=case.precision, steps=case.steps, **case.options)


@pytest.fixture(scope="module")
def sick():
    """An error (forward-overflow in fc2) and a warning (gradient-underflow in fc1)."""
    return [_catalogue("forward_overflow"), _catalogue("gradient_underflow")]


def _nested():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(block=nn.Sequential(nn.Linear(8, 16), nn.ReLU()), head=nn.Linear(16, 1)))
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(2)]
    return inspect_precision(model, data, loss_fn=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), precision="bf16",
                             steps=1)


def _rows(ax) -> list[str]:
    """The row names of a panel (its block's first panel carries the labels; the others share them)."""
    first = next(a for a in ax.get_shared_y_axes().get_siblings(ax) if a.get_title() == PANELS[0])
    return [t.get_text() for t in first.get_yticklabels()]


def _panel_axes(fig) -> list:
    return [ax for ax in fig.get_axes() if ax.get_title() in PANELS]


def test_one_row_per_leaf_module_with_containers_folded():
    report = _nested()
    assert {s.name for s in report.layers} >= {"block", "block.0", "block.1", "head"}  # the container is recorded
    axes = _panel_axes(doctor_figure([report]))
    assert [ax.get_title() for ax in axes] == list(PANELS)
    for ax in axes:
        assert _rows(ax) == ["block.0", "block.1", "head"], ax.get_title()
        assert [round(b.get_y() + b.get_height() / 2) for b in ax.patches] == [0, 1, 2]


def test_rows_with_an_error_are_red_and_with_a_warning_orange(sick):
    fig = doctor_figure(sick)
    axes = _panel_axes(fig)
    assert len(axes) == 4 * len(sick)
    for k, (report, marked, colour) in enumerate(zip(sick, ("fc2", "fc1"), ("error", "warning"))):
        assert any(v.module == marked and v.severity == colour for v in report.verdicts), report.text()
        for ax in axes[4 * k:4 * k + 4]:
            for name, bar in zip(_rows(ax), ax.patches):
                want = COLORS[colour] if name == marked else COLORS[None]
                assert bar.get_facecolor() == to_rgba(want), (report.precision, ax.get_title(), name)


def test_forward_and_gradient_headroom_both_drawn(sick):
    from torchimpl.precision import health

    report = sick[0]
    axes = _panel_axes(doctor_figure([report]))
    titles = [ax.get_title() for ax in axes]
    for side in ("forward", "gradient"):
        assert any(t.startswith(side) and "overflow" in t for t in titles)
        assert any(t.startswith(side) and "underflow" in t for t in titles)
    rows = {s.name: s for s in report.layers}
    fwd, fwd_under, grad, grad_under = axes
    for name, bar in zip(_rows(grad), grad.patches):
        s = rows[name]
        assert bar.get_width() == pytest.approx(health.headroom_bits(s.grad_amax_scaled, getattr(torch, s.dtype)))
    for name, bar in zip(_rows(fwd), fwd.patches):
        assert bar.get_width() == pytest.approx(rows[name].headroom_bits)
    for name, bar in zip(_rows(grad_under), grad_under.patches):
        assert bar.get_width() == pytest.approx(100 * rows[name].grad_underflow_at_scale)
    assert rows["fc2"].headroom_bits < 0  # the overflow is drawn left of the 0-bit line


def test_the_verdicts_are_written_on_the_figure(sick):
    healthy = _nested()
    fig = doctor_figure([*sick, healthy])
    texts = [t.get_text() for t in fig.findobj(Text)]
    joined = "\n".join(texts)
    for report in sick:
        for v in report.verdicts:
            assert f"[{v.severity}] {v.kind} in {v.module}" in joined
            assert "fix:" in joined and v.fix.split()[0] in joined
    assert "precision.fp32_modules: ['fc2']" in joined
    assert "no verdict: healthy in this precision" in joined
    written = [t for t in fig.findobj(Text) if t.get_text().startswith("[error] forward-overflow")]
    assert written and written[0].get_color() == COLORS["error"]


def test_fonts_are_readable_at_the_default_size(sick):
    fig = doctor_figure(sick)
    assert fig.dpi == 100
    for ax in _panel_axes(fig):
        assert ax.title.get_fontsize() >= 10
        assert all(t.get_fontsize() >= 10 for t in ax.get_yticklabels() + ax.get_xticklabels())
    assert min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text().startswith("[")) >= 10


# ---------------------------------------------------------------- bad input, before the diagnosis

TASK = textwrap.dedent("""
    import os, pathlib, signal, sys, torch
    from torch import nn

    CALLS = {"forward": 0}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, y):
            CALLS["forward"] += 1
            if CALLS["forward"] == int(os.environ.get("KILL_AT_FORWARD", "0")):
                os.kill(os.getpid(), getattr(signal, os.environ["KILL_SIGNAL"]))
            if os.environ.get("FORWARD_EXITS"):
                sys.exit(int(os.environ["FORWARD_EXITS"]))
            if os.environ.get("FORWARD_RAISES"):
                raise RuntimeError("the model broke")
            return ((self.lin(x) - y) ** 2).mean()

    def make():
        pathlib.Path("make-was-called").write_text("")
        if os.environ.get("MAKE_EXITS"):
            sys.exit(int(os.environ["MAKE_EXITS"]))
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
        return Model(), data, None
""")


@pytest.fixture
def user(tmp_path, monkeypatch):
    (tmp_path / "doctask.py").write_text(TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("doctask", None)
    yield tmp_path
    sys.modules.pop("doctask", None)


def _doctor(capsys, *extra: str, precision: str = "bf16") -> tuple[int, str, str]:
    from torchimpl.cli.app import main

    code = main(["doctor", "--task", "doctask:make", "--precision", precision, "--steps", "2", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def _refused_before_work(result, user: Path, *names: str) -> str:
    code, out, err = result
    assert code == 2, (code, out, err)
    for name in names:
        assert name in err, (name, err)
    assert "precision bf16" not in out and "took" not in out, out  # no diagnosis
    assert not (user / "make-was-called").exists(), "the task was built before its output paths were checked"
    assert "Traceback" not in err
    assert not any(word in err for word in ("resume", "checkpoint", "train ")), err  # no training advice
    return err


def test_report_and_plot_naming_one_file_are_refused_before_work(user, capsys):
    _refused_before_work(_doctor(capsys, "--report", "out.x", "--plot", "./out.x"), user,
                         "--report out.x and --plot ./out.x name the same file")
    assert not (user / "out.x").exists()


def test_an_output_path_that_is_the_tasks_module_is_refused(user, capsys):
    before = (user / "doctask.py").read_text()
    _refused_before_work(_doctor(capsys, "--report", "doctask.py"), user, "--report doctask.py",
                         "is the module of --task doctask:make")
    assert (user / "doctask.py").read_text() == before


def test_a_folder_that_cannot_be_written_in_is_refused_before_work(user, capsys, monkeypatch):
    import tempfile

    (user / "locked").mkdir()
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):  # what a read-only folder answers (root is not refused by chmod)
        if dir is not None and Path(dir).name == "locked":
            raise PermissionError(13, "Permission denied")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    _refused_before_work(_doctor(capsys, "--report", "locked/d.json"), user, "--report locked/d.json",
                         "cannot write in the folder", "Permission denied")


@pytest.mark.parametrize("option", ["--report", "--plot"])
def test_a_link_at_an_output_path_is_refused_before_work(user, capsys, option):
    (user / "notes.txt").write_text("mine")
    (user / "link.out").symlink_to("notes.txt")
    _refused_before_work(_doctor(capsys, option, "link.out"), user, f"{option} link.out", "symbolic link")
    assert (user / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("env,named", [
    ({"MAKE_EXITS": "0"}, "called sys.exit(0) while it was built"),
    ({"MAKE_EXITS": "3"}, "called sys.exit(3) while it was built"),
    ({"FORWARD_EXITS": "0"}, "called sys.exit(0) during the bf16 diagnosis"),
    ({"FORWARD_RAISES": "1"}, "raised RuntimeError: the model broke"),
])
def test_a_task_that_exits_or_raises_is_an_error_naming_it(user, capsys, monkeypatch, env, named):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, out, err = _doctor(capsys, "--report", "d.json")
    assert code == 2, (code, out, err)
    assert "--task doctask:make" in err and named in err and "no diagnosis was made" in err, err
    assert "Traceback" not in err and not (user / "d.json").exists()
    assert "no verdict" not in out


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_during_the_diagnosis_exits_with_its_code_and_one_line(user, sig, code):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KILL_AT_FORWARD": "3", "KILL_SIGNAL": sig}
    # SIGINT back to Python's default in the child: a suite started in the background inherits it ignored
    proc = subprocess.run([sys.executable, "-m", "torchimpl.cli", "doctor", "--task", "doctask:make", "--precision",
                           "bf16", "--steps", "4", "--report", "d.json"], cwd=user, env=env, capture_output=True,
                          text=True, timeout=240, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and f"interrupted by {sig}" in proc.stderr, proc.stderr[-3000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (user / "d.json").exists() and "no verdict" not in proc.stdout


def test_a_write_that_fails_after_the_diagnosis_names_the_file_without_training_advice(user, capsys, monkeypatch):
    import torchimpl.safe_files

    def fails(path, text, *, what="run file"):
        with torchimpl.safe_files.writing(path, what):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(torchimpl.safe_files, "replace_text", fails)
    code, out, err = _doctor(capsys, "--report", "d.json")
    assert code == 1 and "precision bf16" in out, (code, err)
    assert "--report d.json: cannot write: No space left on device" in err, err
    assert not any(word in err for word in ("resume", "checkpoint", "train ")), err
