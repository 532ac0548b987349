"""``ampspec audit`` leaves the user's files and the script's output alone.

1. ``--report`` is checked before the script runs: never the script, a source file, a link
   (a dangling one too), a folder, or another program's file (unless ``--force``); a relative
   path means the folder the command started in, whatever the script's ``os.chdir``; the report
   is written whole or not at all (a full disk keeps the old one).
2. However the script leaves (``sys.exit``, ``os._exit``, SIGINT, SIGTERM) the report is
   written, says how, and the exit status is the script's or the signal's.
3. The script's logging and warnings print as under ``python SCRIPT.py``: once, unrelabelled.
4. The summary counts the steps that matched the specification, and prints no meaningless
   ``expected: nan / got: nan`` pair.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import torchimpl.cli.app as cli
from audit.report import AuditReport
from audit.rules import Finding
from audit.runner import run_script

ROOT = Path(__file__).resolve().parents[1]
LOOPS = ROOT / "tests" / "audit_loops"

# Two optimizer steps of a GradScaler loop on the CPU, then the body given.
LOOP = textwrap.dedent("""
    import os, sys, time, pathlib
    import torch
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(torch.ones(4, 2)).sum()).backward()
        scaler.step(opt)
        scaler.update()
""")


def checksums(folder: Path) -> dict[str, str]:
    """``relative path -> sha256`` of every file under ``folder`` (a link: ``-> target``)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def audit_here(capsys, *args: str) -> tuple[int, str, str]:
    """``ampspec audit ARGS`` in this process, in the current folder: (status, stdout, stderr)."""
    status = cli.main(["audit", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def audit_child(tmp_path: Path, *args: str, wait: str | None = None, send: int | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m torchimpl.cli audit ARGS`` in ``tmp_path``; with ``send``, the signal sent once
    the file ``wait`` exists. SIGINT is restored to Python's default in the child: a suite started
    in the background inherits it ignored."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torchimpl.cli", "audit", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if send is not None:
        deadline = time.monotonic() + timeout
        while not (tmp_path / wait).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(send)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# ------------------------------------------------------------------ 1. where the report may go


@pytest.fixture
def user_folder(tmp_path, monkeypatch) -> Path:
    """A folder holding the script (which leaves a mark when it runs), a helper module, notes, a
    link to the notes, a dangling link, a sub-folder; the working folder of the test."""
    (tmp_path / "train.py").write_text("open('ran', 'w').write('the script ran')\n")
    (tmp_path / "helper.py").write_text("X = 1\n")
    (tmp_path / "notes.json").write_text('{"my": "notes"}\n')
    (tmp_path / "link.json").symlink_to("notes.json")
    (tmp_path / "dangling.json").symlink_to("nowhere.json")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("report, force, names", [
    ("train.py", False, ["--report train.py is the script being audited", "train-audit.json"]),
    ("./sub/../train.py", True, ["is the script being audited"]),
    ("helper.py", True, ["--report helper.py is a source file (.py)", "even with --force"]),
    ("notes.json", False, ["--report notes.json exists and is not an ampspec audit report", "--force"]),
    ("link.json", True, ["--report link.json is a symbolic link (to notes.json)"]),
    ("dangling.json", True, ["--report dangling.json is a symbolic link (to nowhere.json)"]),
    ("notes.json/audit.json", False, ["notes.json is a file, not a folder"]),
])
def test_a_report_path_that_would_harm_a_file_is_refused_before_the_script_runs(user_folder, capsys, report,
                                                                                  force, names):
    before = checksums(user_folder)
    status, out, err = audit_here(capsys, *(["--force"] if force else []), "--report", report, "train.py")
    assert status == 2, out + err
    assert err.startswith("ampspec audit: error: ") and all(n in err for n in names), err
    assert checksums(user_folder) == before  # the script never ran; no file, link or target changed
    assert not (user_folder / "nowhere.json").exists()


def test_force_overwrites_a_file_that_is_not_a_report_and_a_report_is_replaced_without_it(user_folder, capsys):
    (user_folder / "train.py").write_text("print('trained')\n")
    notes = (user_folder / "notes.json").read_bytes()
    assert audit_here(capsys, "train.py", "--report", "notes.json")[0] == 2
    assert (user_folder / "notes.json").read_bytes() == notes
    assert audit_here(capsys, "train.py", "--report", "notes.json", "--force")[0] == 0
    data = json.loads((user_folder / "notes.json").read_text())
    assert data["target"] == "train.py" and data["status"] == "ok"
    (user_folder / "notes.json").write_text(json.dumps({**data, "target": "an older audit"}))
    status, out, _ = audit_here(capsys, "train.py", "--report", "notes.json")
    assert status == 0 and out.rstrip().endswith("report: notes.json")
    assert json.loads((user_folder / "notes.json").read_text())["target"] == "train.py"
    assert sorted(p.name for p in user_folder.iterdir() if p.name.startswith(".")) == []  # no temporary file left


def test_a_relative_report_path_lands_where_it_was_asked_whatever_the_script_chdirs_to(user_folder, capsys):
    (user_folder / "train.py").write_text("import os\nos.chdir('sub')\n")
    assert audit_here(capsys, "train.py", "--report", "audit.json")[0] == 0
    assert (user_folder / "audit.json").is_file() and not (user_folder / "sub" / "audit.json").exists()


def test_a_full_disk_keeps_the_old_report_and_exits_2_with_the_reason(user_folder, capsys, monkeypatch):
    (user_folder / "train.py").write_text("print('trained')\n")
    assert audit_here(capsys, "train.py", "--report", "audit.json")[0] == 0
    old = (user_folder / "audit.json").read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    status, out, err = audit_here(capsys, "train.py", "--report", "audit.json")
    assert status == 2 and "report: " not in out
    assert "ampspec audit: error: cannot write the report" in err and "No space left on device" in err, err
    assert "the report already there is unchanged" in err and "free space" in err, err
    assert (user_folder / "audit.json").read_bytes() == old
    assert sorted(p.name for p in user_folder.iterdir() if p.name.startswith(".")) == []


# ------------------------------------------------------------------ 2. however the script leaves


def test_sys_exit_writes_the_report_saying_so_and_exits_with_the_status(user_folder, capsys):
    (user_folder / "train.py").write_text(LOOP + "sys.exit(3)\n")
    status, out, _ = audit_here(capsys, "--no-replay", "train.py", "--report", "audit.json")
    assert status == 3 and "the script left by sys.exit(3)" in out
    data = json.loads((user_folder / "audit.json").read_text())
    assert (data["exit_status"], data["ended"], data["complete"], len(data["steps"])) == \
        (3, "the script left by sys.exit(3)", True, 2)


@pytest.mark.parametrize("code, status", [(0, 0), (3, 3)])
def test_os_exit_still_writes_the_report_and_exits_with_the_scripts_status(tmp_path, code, status):
    """A forked child's ``os._exit`` is its own: one report, the parent's."""
    (tmp_path / "train.py").write_text(LOOP + textwrap.dedent(f"""
        pid = os.fork()
        if pid == 0:
            os._exit(5)
        assert os.waitpid(pid, 0)[1] >> 8 == 5
        print('leaving', flush=True)
        os._exit({code})
    """))
    r = audit_child(tmp_path, "--no-replay", "train.py", "--report", "audit.json")
    assert r.returncode == status, r.stdout + r.stderr
    assert r.stdout.count("ampspec audit of") == 1 and "os._exit(5)" not in r.stdout, r.stdout
    assert f"the script left by os._exit({code})" in r.stdout and "report: audit.json" in r.stdout
    data = json.loads((tmp_path / "audit.json").read_text())
    assert (data["exit_status"], data["ended"], len(data["steps"])) == (status, f"the script left by os._exit({code})", 2)
    assert data["script_status"] == (code or None)


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_writes_the_report_marked_incomplete_and_exits_with_its_code(tmp_path, sig, status):
    (tmp_path / "train.py").write_text(LOOP + "pathlib.Path('ready').write_text('x')\ntime.sleep(60)\n")
    r = audit_child(tmp_path, "train.py", "--report", "audit.json", wait="ready", send=sig)
    assert r.returncode == status, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "the audited program failed" not in r.stdout, r.stderr
    assert f"interrupted by {sig.name}: the report is incomplete" in r.stdout
    data = json.loads((tmp_path / "audit.json").read_text())
    assert (data["status"], data["complete"], data["interrupted"], data["exit_status"], len(data["steps"])) == \
        ("interrupted", False, sig.name, status, 2)


def test_run_script_turns_sigterm_into_an_interrupted_report_in_any_process(tmp_path, monkeypatch):
    """Without the command's handlers too (the Python entry point): SIGTERM ends the script with
    a report, not the process. The handler set here would fail the script if the audit had none."""
    def not_the_audits(signum, frame):
        raise RuntimeError("the audit installed no SIGTERM handler")

    previous = signal.signal(signal.SIGTERM, not_the_audits)
    try:
        (tmp_path / "train.py").write_text(LOOP + "import signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
        report = run_script(tmp_path / "train.py", replay=False)
        assert signal.getsignal(signal.SIGTERM) is not_the_audits  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (report.interrupted, report.error, report.exit_status, len(report.steps)) == ("SIGTERM", None, 143, 2)
    assert not report.complete and report.to_dict()["status"] == "interrupted"


# ------------------------------------------------------------------ 3. the script's own output


def test_the_scripts_logging_and_a_librarys_warnings_print_once_and_unrelabelled(tmp_path):
    (tmp_path / "noisy_lib.py").write_text(textwrap.dedent("""
        import logging, warnings
        warnings.warn("noisy_lib is deprecated", UserWarning)
        logging.getLogger("noisy_lib").warning("noisy_lib: no GPU found")
    """))
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import logging
        import noisy_lib
        logging.basicConfig(level=logging.INFO)
        logging.info("epoch 1 done")
        log = logging.getLogger("train")
        log.warning("loss is high")
    """))
    plain = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    r = audit_child(tmp_path, "--no-replay", "train.py")
    assert r.returncode == 0, r.stderr
    assert r.stderr == plain.stderr  # exactly what Python prints: once, in the script's own format
    for line in ("INFO:root:epoch 1 done", "WARNING:train:loss is high", "noisy_lib: no GPU found",
                 "UserWarning: noisy_lib is deprecated"):
        assert r.stderr.count(line) == 1, r.stderr
    assert "ampspec" not in r.stderr, r.stderr


# ------------------------------------------------------------------ 4. the summary


def _summary(steps_replayed: int, exact: int, verdicts: list[str]) -> str:
    class Step:
        def __init__(self, replay: str) -> None:
            self.replay = replay

    replay = {"steps_replayed": steps_replayed, "steps_bit_exact": exact, "updates_checked": steps_replayed,
              "exactness": "E", "not_replayed": {}}
    text = AuditReport(findings=[], steps=[Step(v) for v in verdicts], replay=replay, target="t.py").text()
    return text.splitlines()[1]


def test_the_summary_counts_the_steps_that_matched():
    assert _summary(4, 4, ["bit for bit"] * 4) == ("numeric replay: 4 of 4 steps and 4 scaler updates replayed; all 4 "
                                                   "replayed steps matched the specification bit for bit; compared at: E")
    assert "; 2 of the 4 replayed steps matched the specification bit for bit, 1 within the stated bounds, " \
           "1 diverged (see the findings);" in _summary(4, 2, ["bit for bit", "within the bounds (largest 3.0 ULP)",
                                                              "diverged: param", "bit for bit"])


def test_a_finding_between_two_identical_non_finite_values_prints_no_pair():
    message = "the clip measured the scaled gradients' norm nan"
    for expected, got, pair in [(math.nan, math.nan, False), (math.inf, math.inf, False), (math.inf, 1.0, True),
                                (-math.inf, math.inf, True), (2.0, 2.5, True)]:
        f = Finding("clip-before-unscale", 0, "train.py:3", message, expected=expected, got=got)
        text = AuditReport(findings=[f], steps=[], replay=None).text()
        assert ("    expected: " in text) == pair and ("    got: " in text) == pair, text


def test_an_overflowing_step_clipped_before_unscale_reads_right():
    """The real output that read wrong: ``expected: nan / got: nan`` and "N of the steps bit for bit"."""
    report = run_script(LOOPS / "scaler_loop.py", ["--bug", "clip-before-unscale", "--inf-at", "0", "--steps", "3"])
    text = report.text()
    assert "clip-before-unscale (error)" in text and "expected: nan" not in text and "got:      nan" not in text, text
    assert "of the steps bit for bit" not in text
    assert "3 of 3 steps" in text and "matched the specification bit for bit" in text, text
