"""A new user's first runs: their own task from the command line, seeded; ``compare`` on it;
the weights out of a checkpoint; ``--version``, the help, and the messages they meet."""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from torchimpl.run.checkpoint import CheckpointError, save_checkpoint
from torchimpl.config.schema import TaskConfig, load_config
from torchimpl.cli.export import export_weights, load_weights
from torchimpl.precision.plan import PrecisionDowngradeWarning
from torchimpl.task.builtin import build_task
from torchimpl.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]

# A user's task: random initialisation (torch), a data order (Python's random) and noise
# (NumPy) all drawn when make() runs, so an unseeded make() differs from process to process.
USER_TASK = textwrap.dedent("""
    import random
    import numpy as np
    import torch
    from torch import nn

    CALLS = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, y):
            return ((self.lin(x) - y) ** 2).mean()

    def make():
        model = Net()
        CALLS.append(model.lin.weight.detach().clone())
        xs = torch.linspace(-1, 1, 64).reshape(16, 4)
        order = list(range(16))
        random.shuffle(order)
        noise = torch.from_numpy(np.random.standard_normal(16).astype("float32"))
        batches = [(xs[i:i + 1], xs[i:i + 1].sum(1, keepdim=True) + 0.1 * noise[i]) for i in order]
        return model, batches, batches[:4]
""")


def _console_script(folder: Path) -> Path:
    """A stand-in for the installed ``ampspec`` script: run as a file, it puts its own folder on
    sys.path (not the working directory), as console scripts do; ``python -m`` would add the cwd."""
    script = folder / "bin" / "ampspec_script.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("import sys\nfrom torchimpl.cli.app import main\nsys.exit(main())\n")
    return script


def ampspec(*args, cwd: Path, script: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    entry = [str(script)] if script is not None else ["-m", "torchimpl.cli"]
    return subprocess.run([sys.executable, *entry, *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``<unique name>.py`` in a folder that is the working directory; yields the module name."""
    name = f"usertask_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    sys.modules.pop(name, None)


# ---------------------------------------------------------------- a user's task from the CLI


def test_console_script_runs_a_task_from_the_working_directory_bit_for_bit_three_times(tmp_path):
    (tmp_path / "mymodule.py").write_text(USER_TASK)
    script = _console_script(tmp_path / "elsewhere")
    losses = []
    for _ in range(3):
        r = ampspec("train", "--set", "task.name=mymodule:make", "--set", "device=cpu", "--set", "train.steps=6",
                    "--set", "train.clip_norm=null", cwd=tmp_path, script=script)
        assert r.returncode == 0, r.stderr
        losses.append(json.loads(r.stdout)["final_train_loss"])
    assert losses[0] == losses[1] == losses[2], losses


def test_build_task_seeds_every_generator_before_make(user_module):
    task = build_task(TaskConfig(name=f"{user_module}:make"), seed=123, batch_size=1)
    module = sys.modules[user_module]
    torch.manual_seed(123)
    assert torch.equal(module.CALLS[-1], torch.nn.Linear(4, 1).weight.detach())  # initialisation seeded
    random.seed(123)
    order = list(range(16))
    random.shuffle(order)
    np.random.seed(123)
    noise = torch.from_numpy(np.random.standard_normal(16).astype("float32"))
    xs = torch.linspace(-1, 1, 64).reshape(16, 4)
    first = order[0]
    x, y = task.train_data[0]
    assert torch.equal(x, xs[first:first + 1])  # data order seeded
    assert torch.equal(y, xs[first:first + 1].sum(1, keepdim=True) + 0.1 * noise[first])  # NumPy seeded


def test_the_working_directory_goes_first_on_sys_path_once(user_module):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.getcwd()]
    for _ in range(2):
        build_task(TaskConfig(name=f"{user_module}:make"), seed=0, batch_size=1)
    assert sys.path[0] == os.getcwd()
    assert sum(os.path.abspath(p or os.curdir) == os.getcwd() for p in sys.path) == 1


def test_a_missing_module_and_a_failing_import_say_which_and_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ValueError, match=r"no module 'nosuchmod' in the working directory .*; run from the folder "
                                         r"holding nosuchmod\.py, or add its folder to PYTHONPATH"):
        build_task(TaskConfig(name="nosuchmod:make"), seed=0, batch_size=1)
    (tmp_path / "brokenmod.py").write_text("import not_installed_anywhere\n")
    with pytest.raises(ValueError, match=r"importing 'brokenmod' failed: No module named 'not_installed_anywhere'"):
        build_task(TaskConfig(name="brokenmod:make"), seed=0, batch_size=1)
    sys.modules.pop("brokenmod", None)


# ---------------------------------------------------------------- compare on the user's task


def test_compare_runs_the_users_task_in_every_precision_from_a_fresh_seeded_task(user_module, tmp_path):
    from torchimpl.cli.compare import run_compare

    res = run_compare(steps=4, device="cpu", out=tmp_path / "cmp", task=f"{user_module}:make", window=2)
    labels = [r["precision"] for r in res.rows]
    assert labels[:3] == ["fp32", "bf16", "bf16+scaler"]
    inits = sys.modules[user_module].CALLS
    assert len(inits) == len(labels) + len(res.left_out) and all(torch.equal(w, inits[0]) for w in inits)
    report = json.loads((tmp_path / "cmp" / "report.json").read_text())
    assert report["task"] == f"{user_module}:make" and report["torch"] == str(torch.__version__)


def test_compare_cli_takes_a_task_from_the_working_directory_and_explains_max_gap(tmp_path):
    (tmp_path / "mymodule.py").write_text(USER_TASK)
    r = ampspec("compare", "--task", "mymodule:make", "--steps", "3", "--device", "cpu", "--out", tmp_path / "o",
                cwd=tmp_path, script=_console_script(tmp_path / "elsewhere"))
    assert r.returncode in (0, 1), r.stderr
    assert "bf16+scaler" in r.stdout
    from torchimpl.precision.fp8 import torchao_available

    if torchao_available():  # the task's 4x1 layer cannot run in float8: that row is left out, with why
        assert "note (fp8): left out: precision.mode 'fp8' found no linear layer" in r.stdout
    assert "max gap: the largest absolute difference, in loss units, between a run's 20-step moving average" in r.stdout
    r = ampspec("compare", "--task", "nocolon", cwd=tmp_path)
    assert r.returncode == 2 and "'nocolon' is not a task: use 'lm', 'mlp' or module:function" in r.stderr


def test_compare_report_has_validation_curves_skips_and_a_visible_scale_history(tmp_path):
    from torchimpl.cli.compare import run_compare

    run_compare(steps=20, device="cpu", out=tmp_path, task="mlp", window=5)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [step for step, _ in report["val_curves"]["fp32"]] == list(range(1, 21))  # every max(20 // 20, 1) steps
    assert report["skipped_steps"]["bf16+scaler"] == []
    scale = report["scale_history"]["bf16+scaler"]
    assert scale[0] == 65536.0 and scale[-1] == 65536.0 * 2 ** 10  # growth every 20 // 10 clean steps
    assert set(report["scale_history"]["bf16"]) == {1.0}
    assert "in loss units" in report["max_gap"]


def test_the_plot_marks_skipped_steps_and_leaves_out_the_scale_panel_without_a_scaler(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the 'plot' extra)")
    import matplotlib.pyplot as plt

    from torchimpl.cli import compare
    from torchimpl.cli.agreement import Band

    n = 30
    base = [2.0 - i / n for i in range(n)]
    curves = {"fp32": compare._Curves(base, [(10, 1.5), (20, 1.2)], [1.0] * n, [], False),
              "fp16": compare._Curves(base, [(10, 1.5)], [65536.0] * n, [3, 7], True)}
    rows = [{"precision": k, "steps_skipped": len(c.skipped)} for k, c in curves.items()]
    compare._judge(rows, curves, Band(5))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    path, note = compare._plot(curves, rows, Band(5), "title", tmp_path / "a.png")
    assert path and note is None
    loss_ax, _, scale_ax = figures[0].axes
    marks = [line for line in loss_ax.lines if line.get_marker() == "x" and line.get_linestyle() == "None"]
    assert [list(m.get_xdata()) for m in marks] == [[3, 7]]
    assert any(list(line.get_xdata()) == [3, 7] for line in scale_ax.lines)
    assert any("max gap: the largest absolute difference, in loss units" in t.get_text() for t in figures[0].texts)
    without = {k: compare._Curves(c.train, c.val, [1.0] * n, [], False) for k, c in curves.items()}
    compare._plot(without, rows, Band(5), "title", tmp_path / "b.png")
    assert len(figures[1].axes) == 2  # loss and difference, no scale panel


# ---------------------------------------------------------------- getting the weights out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    cfg = load_config(overrides=["device=cpu", "task.name=mlp", "task.size=tiny", "train.steps=3",
                                 "train.batch_size=8", f"checkpoint.folder={folder / 'ck'}"])
    task = build_task(cfg.task, seed=0, batch_size=8)
    trainer = Trainer(cfg)
    trainer.fit(task.model, task.train_data, task.val_data)
    return folder, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_load_weights_gives_the_trained_state_dict_from_a_file_or_its_folder(trained):
    folder, expected = trained
    assert _same(load_weights(folder / "ck" / "step-00000003.ckpt"), expected)
    assert _same(load_weights(folder / "ck"), expected)  # the newest good checkpoint


def test_export_pt_round_trips_bit_for_bit(trained, tmp_path):
    folder, expected = trained
    res = export_weights(folder / "ck" / "step-00000003.ckpt", tmp_path / "model.pt")
    assert res.tensors == len(expected)
    assert _same(torch.load(tmp_path / "model.pt", weights_only=True), expected)
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary left


def test_export_safetensors_round_trips_bit_for_bit(trained, tmp_path):
    pytest.importorskip("safetensors", reason="the safetensors package (the 'safetensors' extra) is not installed")
    from safetensors.torch import load_file

    folder, expected = trained
    export_weights(folder / "ck", tmp_path / "model.safetensors")
    assert _same(load_file(str(tmp_path / "model.safetensors")), expected)
    assert _same(load_weights(tmp_path / "model.safetensors"), expected)


def test_export_without_safetensors_names_the_extra(trained, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'ampspec[safetensors]'")):
        export_weights(trained[0] / "ck", tmp_path / "model.safetensors")
    assert not any(tmp_path.iterdir())


def test_export_refuses_an_unknown_suffix_and_an_existing_file_unless_forced(trained, tmp_path):
    ckpt = trained[0] / "ck"
    with pytest.raises(ValueError, match=r"unknown format '\.bin'; name it OUT\.pt .* or OUT\.safetensors"):
        export_weights(ckpt, tmp_path / "model.bin")
    out = tmp_path / "model.pt"
    out.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="exists; choose another name, or pass --force"):
        export_weights(ckpt, out)
    assert out.read_bytes() == b"keep me"
    export_weights(ckpt, out, force=True)
    assert _same(torch.load(out, weights_only=True), trained[1])


def test_export_reads_a_sharded_checkpoint_folder(trained, tmp_path):
    import torch.distributed.checkpoint as dcp

    expected = trained[1]
    folder = tmp_path / "step-00000003.dcp"  # the layout torchimpl.distributed writes for FSDP2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saving without a process group
        dcp.save({"model": {k: v.clone() for k, v in expected.items()}}, checkpoint_id=str(folder))
    save_checkpoint({"format": 1}, folder / "meta.ckpt")
    export_weights(folder, tmp_path / "model.pt")
    assert _same(torch.load(tmp_path / "model.pt", weights_only=True), expected)
    (folder / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="not a complete sharded checkpoint"):
        load_weights(folder)


def test_export_cli(trained, tmp_path):
    ckpt = trained[0] / "ck" / "step-00000003.ckpt"
    r = ampspec("export", ckpt, tmp_path / "m.pt", cwd=tmp_path)
    assert r.returncode == 0 and f"wrote {tmp_path / 'm.pt'}" in r.stdout, r.stderr
    r = ampspec("export", ckpt, tmp_path / "m.pt", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("ampspec export: error: output") and "--force" in r.stderr
    r = ampspec("export", tmp_path / "nothing.ckpt", tmp_path / "n.pt", cwd=tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr


# ---------------------------------------------------------------- version, help, messages


def test_version_names_ampspec_and_torch(tmp_path):
    r = ampspec("--version", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"ampspec {importlib.metadata.version('ampspec')} (torch {torch.__version__}")


def test_version_falls_back_to_the_package_version_when_not_installed(monkeypatch):
    import torchimpl
    from torchimpl.run.state import ampspec_version

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert ampspec_version() == torchimpl.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == torchimpl.__version__


@pytest.mark.parametrize("command, shown", [
    ("compare", ["(default: 200)", "(default: lm)", "(default: auto)", "(default: ampspec-compare)", "MODULE:FUNCTION"]),
    ("train", ["--set KEY=VALUE", "(default: [])", "values are YAML"]),
])
def test_help_shows_what_each_option_does_and_its_default(command, shown):
    from torchimpl.cli.app import _parser

    sub = _parser()._subparsers._group_actions[0].choices[command]
    text = sub.format_help()
    for fragment in shown:
        assert fragment in text, f"{fragment!r} missing from {command} --help:\n{text}"


def test_momentum_with_adamw_is_one_complete_sentence_naming_the_fix(tmp_path):
    r = ampspec("train", "--set", "optimizer.momentum=0.9", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "ampspec train: error: invalid configuration: optimizer.momentum: only the 'sgd' and 'rmsprop' optimizers use "
        "momentum, and this one is 'adamw' (got momentum=0.9); remove momentum, or set the optimizer's name to 'sgd' or "
        "'rmsprop'")


def test_nesterov_without_momentum_on_sgd_is_blamed_on_the_right_field(tmp_path):
    r = ampspec("train", "--set", "optimizer.name=sgd", "--set", "optimizer.nesterov=true", cwd=tmp_path)
    assert r.returncode == 2
    assert "optimizer.nesterov: Nesterov momentum needs momentum > 0" in r.stderr and "adamw" not in r.stderr


def test_fp16_on_cpu_warns_once_on_one_clean_line(tmp_path):
    r = ampspec("train", "--set", "device=cpu", "--set", "precision.mode=fp16", "--set", "task.size=tiny",
                "--set", "train.steps=2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "was requested on the CPU" in line]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ampspec: warning: precision: precision mode 'fp16' was requested on the CPU")
    assert ".py:" not in r.stderr and "PrecisionDowngradeWarning" not in r.stderr, r.stderr


def test_fp16_on_cpu_warns_python_users_once_at_their_fit_call():
    cfg = load_config(overrides=["device=cpu", "precision.mode=fp16", "task.name=mlp", "task.size=tiny",
                                 "train.steps=1", "train.batch_size=4"])
    task = build_task(cfg.task, seed=0, batch_size=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Trainer(cfg).fit(task.model, task.train_data, task.val_data)
    downgrades = [w for w in seen if issubclass(w.category, PrecisionDowngradeWarning)]
    assert len(downgrades) == 1, [str(w.message) for w in seen]
    assert str(downgrades[0].message).startswith("precision: precision mode 'fp16' was requested on the CPU")
    assert downgrades[0].filename == __file__


def test_the_cli_shows_its_own_warnings_plainly_and_others_as_python_does(monkeypatch, capsys):
    import torchimpl.cli.app as cli

    passed_on = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, lineno, *rest:
                        passed_on.append((str(message), filename, lineno)))
    cli._plain_warnings()
    inside = str(Path(cli.__file__).resolve().parent / "trainer.py")
    warnings.showwarning(UserWarning("ours"), UserWarning, inside, 12)
    warnings.showwarning(UserWarning("theirs"), UserWarning, "/somewhere/user_code.py", 34)
    assert capsys.readouterr().err == "ampspec: warning: ours\n"
    assert passed_on == [("theirs", "/somewhere/user_code.py", 34)]  # file:line kept for code not ours


def test_compare_prints_one_line_per_run_and_no_step_lines_when_stderr_is_not_a_terminal(tmp_path):
    r = ampspec("compare", "--task", "mlp", "--steps", "4", "--device", "cpu", "--out", tmp_path / "o", cwd=tmp_path)
    assert r.returncode in (0, 1), r.stderr
    lines = r.stderr.splitlines()
    assert not [line for line in lines if line.startswith("step ")], r.stderr
    # Never silent for minutes: each run says when it starts and ends.
    assert any(line.startswith("compare: run 1 of ") and ", fp32, 4 steps of task mlp" in line for line in lines), lines
    assert any(line.startswith("compare: fp32 done in ") for line in lines), lines
    r = ampspec("-q", "compare", "--task", "mlp", "--steps", "2", "--device", "cpu", "--out", tmp_path / "q",
                cwd=tmp_path)
    assert not [line for line in r.stderr.splitlines() if line.startswith("compare:")], r.stderr
