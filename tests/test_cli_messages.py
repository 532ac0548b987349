"""The command line's one message format (torchimpl.cli.messages): ``ampspec: warning: ...``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from torchimpl.cli.app import main
from torchimpl.cli.messages import CliFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORD = {"step": 0, "microbatches": 1, "scale_before": 65536.0, "found_inf": False, "applied": True,
          "grad_norm": 1.0, "clip_coef": None, "scale_after": 65536.0, "growth_tracker": 1, "lr": 0.001}


def test_a_logged_warning_prints_as_ampspec_warning(tmp_path):
    trace = tmp_path / "old.jsonl"
    trace.write_text(json.dumps(RECORD) + "\n")  # no header: replay warns that it uses the defaults
    # In a process of its own, as a user runs it (in pytest's process its log handler takes the records).
    r = subprocess.run([sys.executable, "-m", "torchimpl.cli", "replay", str(trace)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr
    err = r.stderr
    lines = [ln for ln in err.splitlines() if "has no header" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"ampspec: warning: {trace} has no header"), err
    assert "WARNING" not in err and "torchimpl.cli" not in err, err


def test_the_format_by_level_and_under_torchrun(monkeypatch):
    def fmt(level: int, msg: str) -> str:
        return CliFormatter().format(logging.LogRecord("torchimpl.train.trainer", level, __file__, 1, msg, (), None))

    monkeypatch.delenv("RANK", raising=False)
    assert fmt(logging.WARNING, "precision: bf16 unsupported") == "ampspec: warning: precision: bf16 unsupported"
    assert fmt(logging.ERROR, "x") == "ampspec: error: x"
    assert fmt(logging.INFO, "saved checkpoint c") == "ampspec: saved checkpoint c"
    monkeypatch.setenv("RANK", "1")
    assert fmt(logging.WARNING, "y") == "[rank 1] ampspec: warning: y"


def test_a_failed_run_says_error_in_the_same_format(tmp_path, monkeypatch, capsys):
    (tmp_path / "always_inf_task.py").write_text(
        "import math, torch\nfrom torch import nn\n\n"
        "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.lin = nn.Linear(2, 1)\n\n"
        "    def forward(self, x, y):\n        return ((self.lin(x) - y) ** 2).mean() * math.inf\n\n"
        "def make():\n    data = [(torch.ones(4, 2), torch.zeros(4, 1))] * 4\n    return M(), data, None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--set", "device=cpu", "--set", "task.name=always_inf_task:make", "--set", "train.steps=2",
                 "--set", "logging.dir=null", "-q"])
    err = capsys.readouterr().err
    assert code == 3
    assert any(ln.startswith("ampspec train: error: no step was applied") for ln in err.splitlines()), err
