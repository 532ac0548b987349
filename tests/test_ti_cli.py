"""Each ``ampspec`` command end to end in a subprocess, with a small number of steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ampspec(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "torchimpl.cli", *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=180)


def test_compare_prints_a_table_and_writes_the_report(tmp_path):
    r = ampspec("compare", "--steps", "30", "--device", "cpu", "--task", "mlp", "--out", tmp_path)
    assert r.returncode in (0, 1), r.stderr
    assert "precision" in r.stdout and "fp32" in r.stdout and "bf16" in r.stdout, r.stdout
    assert "The curves" in r.stdout and "rule:" in r.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    from torchimpl.precision.fp8 import torchao_available

    assert [row["precision"] for row in report["rows"]] == (["fp32", "bf16", "bf16+scaler"]
                                                            + (["fp8"] if torchao_available() else []))
    assert len(report["loss_curves"]["fp32"]) == 30


def test_train_with_overrides_resume_and_replay(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"device: cpu\ntask: {{name: mlp, size: tiny}}\ntrain: {{steps: 4, batch_size: 8, "
                   f"force_scaler: true, trace_file: {tmp_path / 'trace.jsonl'}}}\n"
                   f"checkpoint: {{folder: {tmp_path / 'ck'}}}\n")
    r = ampspec("train", "--config", cfg, "--set", "train.log_interval=2")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["steps"] == 4
    r = ampspec("train", "--config", cfg, "--set", "train.steps=6", "--resume")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["steps"] == 6
    r = ampspec("replay", tmp_path / "trace.jsonl", "--config", cfg)
    assert r.returncode == 0 and "matches the reference" in r.stdout, r.stdout + r.stderr


def test_replay_names_the_first_divergent_step(tmp_path):
    rec = {"step": 0, "microbatches": 1, "scale_before": 65536.0, "found_inf": True, "applied": False,
           "grad_norm": None, "clip_coef": None, "scale_after": 65536.0, "growth_tracker": 0, "lr": 0.001}
    (tmp_path / "t.jsonl").write_text(json.dumps(rec) + "\n")
    r = ampspec("replay", tmp_path / "t.jsonl")
    assert r.returncode == 1 and "first divergent step 0: scale_after" in r.stdout, r.stdout + r.stderr


def test_doctor_reports_the_environment():
    r = ampspec("doctor")
    assert r.returncode == 0, r.stderr
    for text in ("torch ", "devices:", "CPU capability:", "precision on cpu:", "fused AdamW:", "TF32:"):
        assert text in r.stdout, f"{text!r} missing from doctor output:\n{r.stdout}"


def test_user_mistakes_print_one_line_per_problem_and_exit_nonzero(tmp_path):
    cases = [  # (the command, the lines: a configuration's two bad fields come below a heading)
        (("train", "--set", "train.steps=0", "--set", "train.bogus=1"), 3),
        (("train", "--config", tmp_path / "missing.yaml"), 1),
        (("replay", tmp_path / "missing.jsonl"), 1),
        (("compare", "--device", "cuda", "--steps", "2"), 1),
    ]
    for args, count in cases:
        r = ampspec(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (args, r.stderr)
        assert len(lines) == count and lines[0].startswith("ampspec "), (args, r.stderr)
        assert all(line.startswith("  ") for line in lines[1:]), r.stderr
        assert "Traceback" not in r.stderr
