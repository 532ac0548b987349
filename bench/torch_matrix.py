"""The torch version matrix: the unit tests, the conformance suite and every keyed fact, per version.

    python bench/torch_matrix.py --versions 2.11.0 2.12.1 2.13.0 2.14.1 [--keep]

For each version: a fresh virtual environment outside the checkout (``--root``, by default
``~/.cache/ampspec/torch-matrix``), ``pip install torch==X ".[test,fp8]"`` (``.[test]`` where
torchao does not install beside that torch), then ``pytest tests`` and ``pytest conformance`` and
``python -m conformance.expectations`` in it. The checkout is copied first (tracked and untracked
files, not ignored ones), so every version measures the same code even if the checkout changes
meanwhile. Writes ``bench/results/torch_matrix.json`` and ``bench/results/torch_matrix.md`` (after
every version, so an interrupted run keeps what it measured). ``--jobs N`` measures N versions at
a time and ``--suites-together`` runs a version's two suites at once (on a machine with cores to
spare); ``--merge`` keeps the rows of versions not measured in this run, each with its own date
and commit; ``--find-links DIR`` installs from wheels downloaded beforehand.

PyPI's Linux torch wheels pull several GB of CUDA libraries each: expect long downloads and
about 5-8 GB of disk per environment. Each environment is removed after its version unless
``--keep``; a kept one is reused by the next run. Not part of CI: run it when upgrading torch.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_VERSIONS = ("2.11.0", "2.12.1", "2.13.0", "2.14.1")
DEFAULT_ENV_ROOT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ampspec" / "torch-matrix"
SUITES = ("tests", "conformance")
# The facts the table shows, in this order (conformance/expectations.py keys each by version).
FACT_COLUMNS = ("e4m3fn_saturates", "clip_grad_value_raises_without_grads", "clip_coef_in_grad_dtype",
                "clip_one_element_l2_norm_is_abs", "fused_sgd_fails_on_late_first_gradient",
                "fused_sgd_skipped_first_step_stores_a_buffer")


def log(message: str) -> None:
    print(f"[{_dt.datetime.now(_dt.timezone.utc):%H:%M:%S}] {message}", flush=True)


def snapshot(dest: Path) -> str:
    """Copy the checkout's tracked and untracked, not ignored, files to ``dest``; return its commit."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    return commit + ("+changes" if dirty.strip() else "")


# When set (--stop-at), the wall-clock time at which running suites are interrupted.
STOP_AT: _dt.datetime | None = None


def run(cmd: list[str], cwd: Path, logfile: Path, env: dict[str, str] | None = None) -> tuple[int, float]:
    """Run ``cmd`` with its output appended to ``logfile``; return (exit status, seconds).

    Past STOP_AT the command gets SIGINT (pytest then writes its report of the tests run so far
    and exits with 2); SIGINT is restored to its default in the child, since a shell may have
    started this script with it ignored."""
    start = time.monotonic()
    with logfile.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        while proc.poll() is None:
            if STOP_AT is not None and _dt.datetime.now(_dt.timezone.utc) >= STOP_AT:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    proc.kill()
                break
            time.sleep(2)
        rc = proc.wait()
    return rc, round(time.monotonic() - start, 1)


def installed_torch(python: Path) -> str | None:
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def make_env(version: str, venv: Path, project: Path, logfile: Path, find_links: list[Path]) -> dict[str, Any]:
    """Create (or reuse a kept) environment with torch ``version`` and the project; say what installed."""
    python = venv / "bin" / "python"
    reused = (installed_torch(python) or "").split("+")[0] == version
    if not reused:
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", *(f"--find-links={d}" for d in find_links)]
    # torchao is tried first; where it does not install beside this torch, the test extra alone.
    rc, seconds = run(pip + [f"torch=={version}", f"{project}[test,fp8]"], project, logfile)
    extras = "test,fp8"
    if rc != 0:
        extras = "test"
        rc, more = run(pip + [f"torch=={version}", f"{project}[test]"], project, logfile)
        seconds += more
    if rc == 0 and reused:
        # A kept environment already holds an ampspec of the same version: put this code in.
        rc, more = run(pip + ["--no-deps", "--force-reinstall", str(project)], project, logfile)
        seconds += more
    if rc != 0:
        return {"installed": False, "install_seconds": seconds, "reused_env": reused}
    freeze = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True)
    packages = {p["name"].lower(): p["version"] for p in json.loads(freeze.stdout or "[]")}
    return {"installed": True, "install_seconds": seconds, "reused_env": reused, "extras": extras,
            "torch": installed_torch(python), "torchao": packages.get("torchao"),
            "numpy": packages.get("numpy"), "ml_dtypes": packages.get("ml-dtypes"),
            "hypothesis": packages.get("hypothesis")}


def junit_counts(path: Path) -> dict[str, Any]:
    """passed/failed/errors/skipped from a JUnit XML file, with the failing test ids and skip reasons."""
    if not path.exists():
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": ["no junit report"], "skips": {}}
    failures: list[str] = []
    messages: dict[str, str] = {}
    skips: dict[str, int] = {}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure")
        bad = case.find("error") if bad is None else bad
        if bad is not None:
            counts["failed" if bad.tag == "failure" else "errors"] += 1
            failures.append(name)
            messages[name] = re.sub(r"\s+", " ", bad.get("message", ""))[:200]
        elif (skip := case.find("skipped")) is not None:
            counts["skipped"] += 1
            reason = re.sub(r"\s+", " ", skip.get("message", ""))[:160]
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures, "messages": messages, "skips": skips}


def run_suite(suite: str, python: Path, project: Path, logfile: Path, work: Path, select: str) -> dict[str, Any]:
    xml = work / f"{python.parent.parent.name}-{suite}.xml"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={xml}", suite]
    cmd += ["-k", select] if select else []
    rc, seconds = run(cmd, project, logfile, env)
    return {"exit_status": rc, "seconds": seconds, **junit_counts(xml)}


def measure_facts(python: Path, project: Path, logfile: Path) -> dict[str, Any]:
    out = subprocess.run([str(python), "-m", "conformance.expectations"], cwd=project, capture_output=True, text=True)
    with logfile.open("a") as f:
        f.write(out.stderr)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:] or ["probe failed"]}
    return json.loads(out.stdout)["facts"]


def measure_version(version: str, args: argparse.Namespace, project: Path, work: Path) -> dict[str, Any]:
    venv = args.root / f"torch-{version}"
    logfile = args.root / f"torch-{version}.log"
    logfile.write_text("")
    log(f"torch {version}: environment {venv} (log {logfile})")
    record: dict[str, Any] = {"version": version, "commit": args.commit,
                              "date": f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
                              **make_env(version, venv, project, logfile, args.find_links)}
    if record["installed"]:
        python = venv / "bin" / "python"
        log(f"torch {version}: installed {record['torch']} with [{record['extras']}] in {record['install_seconds']} s")
        record["facts"] = measure_facts(python, project, logfile)

        def suite(name: str) -> None:
            # Each suite logs to its own file when the two run at the same time.
            out = logfile.with_suffix(f".{name}.log") if args.suites_together else logfile
            record[name] = r = run_suite(name, python, project, out, work, args.select)
            log(f"torch {version}: {name}: {r['passed']} passed, {r['failed']} failed, {r['errors']} errors, "
                f"{r['skipped']} skipped in {r['seconds']} s")

        with concurrent.futures.ThreadPoolExecutor(max_workers=2 if args.suites_together else 1) as pool:
            for future in [pool.submit(suite, name) for name in args.suites]:
                future.result()
    else:
        log(f"torch {version}: did not install (see {logfile})")
    if not args.keep:
        shutil.rmtree(venv, ignore_errors=True)
        log(f"torch {version}: removed {venv}")
    return record


def _fact(value: Any) -> str:
    return {True: "yes", False: "no", None: "-"}.get(value, str(value)) if isinstance(value, (bool, type(None))) else str(value)


def _suite_cell(r: dict[str, Any] | None) -> str:
    if not r:
        return "not run"
    if r.get("failures") == ["no junit report"]:
        p = r.get("progress")
        if not p:
            return f"**not measured** (stopped after {r.get('seconds')} s, before its report)"
        return (f"**stopped for time** after {sum(p.values())} tests: {p['passed']} passed, {p['skipped']} skipped, "
                f"{p['failed']} failed, {p['errors']} errors (counted from pytest's progress line; "
                "the rest did not run)")
    cell = f"{r['passed']} passed, {r['skipped']} skipped"
    if r["failed"] or r["errors"]:
        cell += f", **{r['failed']} failed, {r['errors']} errors**"
        rerun = r.get("rerun")
        if rerun:
            cell += f" ({len(rerun['passed'])} of them passed when rerun alone)"
    if r.get("exit_status") == 2:
        cell += " (**interrupted** for time: the tests after these did not run)"
    if r.get("commit"):  # measured in another run than the row's
        cell += f" [run of {r.get('date')}, {r['commit']}]"
    return cell


def changes(previous: dict[str, Any] | None, record: dict[str, Any]) -> str:
    """The keyed facts that differ from the previous measured version's."""
    if previous is None or "facts" not in previous or "facts" not in record:
        return "-"
    keys = [*FACT_COLUMNS, "e4m3fn_cpu_bits", "torchao"]
    diff = [k for k in keys if previous["facts"].get(k) != record["facts"].get(k)]
    if not diff:
        return "none"
    parts = []
    for k in diff:
        if k == "e4m3fn_cpu_bits":
            old, new = previous["facts"].get(k) or {}, record["facts"].get(k) or {}
            parts.append("e4m3fn CPU bits " + ", ".join(f"{v}: {old.get(v)}->{new.get(v)}" for v in new
                                                        if old.get(v) != new.get(v)))
        else:
            parts.append(f"{k}: {_fact(previous['facts'].get(k))} -> {_fact(record['facts'].get(k))}")
    return "; ".join(parts)


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# torch version matrix",
        "",
        f"Measured on {m['platform']}, {m['cpu_count']} CPUs (shared with other work), Python {m['python']}, "
        "on the CPU only (each row gives its date and the code's commit), with",
        "",
        f"    {report['command']}",
        "",
        "Facts are measured by `python -m conformance.expectations` in each environment and keyed in "
        "`conformance/expectations.py`. \"e4m3fn sat.\": float32 -> float8_e4m3fn on the CPU saturates "
        "to ±448 (else NaN); \"clip value raises\": clip_grad_value_ with no gradient raises; \"coef in "
        "grad dtype\": the clip multiply rounds the coefficient to a bfloat16 gradient's dtype; \"1-elt "
        "norm \\|x\\|\": the clipping path's norm of one element is \\|x\\|; \"fused SGD late/skip\": the "
        "two fused-SGD faults.",
        "",
        "| torch | measured | extras | conformance | unit tests | e4m3fn sat. (464, 480, inf) | clip value raises | "
        "coef in grad dtype | 1-elt norm \\|x\\| | fused SGD late / skip | torchao 0.18 internals | what changed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    previous = None
    for r in report["versions"]:
        if not r.get("installed"):
            lines.append(f"| {r['version']} | {r.get('date')} | did not install | not run | not run | | | | | | | |")
            continue
        f = r.get("facts", {})
        bits = f.get("e4m3fn_cpu_bits", {})
        ao = f.get("torchao")
        ao_cell = "not installed" if ao is None else ("as keyed" if ao.get("matches_key") else str(ao))
        lines.append(
            f"| {r['torch']} | {r.get('date')}, {r.get('commit')} | {r['extras']} | {_suite_cell(r.get('conformance'))} | {_suite_cell(r.get('tests'))} | "
            f"{_fact(f.get('e4m3fn_saturates'))} ({bits.get('464.0')}, {bits.get('480.0')}, {bits.get('inf')}) | "
            f"{_fact(f.get('clip_grad_value_raises_without_grads'))} | {_fact(f.get('clip_coef_in_grad_dtype'))} | "
            f"{_fact(f.get('clip_one_element_l2_norm_is_abs'))} | "
            f"{_fact(f.get('fused_sgd_fails_on_late_first_gradient'))} / "
            f"{_fact(f.get('fused_sgd_skipped_first_step_stores_a_buffer'))} | {ao_cell} | {changes(previous, r)} |")
        previous = r
    skipped_any = [(r["version"], s, reason) for r in report["versions"] for s in SUITES
                   for reason in (r.get(s) or {}).get("skips", {})]
    lines += ["", "Skip reasons, per version and suite:", ""]
    lines += [f"- {v} {s}: {reason}" for v, s, reason in skipped_any] or ["- none"]
    failed = [(r["version"], s, t, r[s]) for r in report["versions"] for s in SUITES
              for t in (r.get(s) or {}).get("failures", []) if t != "no junit report"]
    if failed:
        lines += ["", "Failures:", ""]
        for v, s, t, r in failed:
            rerun = r.get("rerun") or {}
            again = (" - passed when rerun alone" if t in rerun.get("passed", ()) else
                     " - failed again when rerun alone" if t in rerun.get("failed", ()) else "")
            why = f" ({r['messages'][t]})" if r.get("messages", {}).get(t) else ""
            lines.append(f"- {v} {s}: {t}{why}{again}")
    if report.get("select"):
        lines += ["", f"**Only the tests matching `-k {report['select']}` ran** (a check of the command, not a measurement)."]
    if report.get("not_measured"):
        lines += ["", f"Not measured here: {report['not_measured']}"]
    return "\n".join(lines) + "\n"


def mark_torchao(record: dict[str, Any]) -> None:
    """Note whether the measured torchao internals equal the ones keyed for that torchao release."""
    ao = record.get("facts", {}).get("torchao")
    if not ao:
        return
    sys.path.insert(0, str(ROOT))
    import ast

    # expectations.py imports torch; read its TORCHAO_KEYED literal without importing it.
    source = (ROOT / "conformance" / "expectations.py").read_text()
    tree = ast.parse(source)
    keyed = next(ast.literal_eval(n.value) for n in ast.walk(tree)
                 if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "TORCHAO_KEYED")
    expected = keyed.get(ao.get("version"))
    ao["matches_key"] = expected is not None and all(ao.get(k) == v for k, v in expected.items())


def progress_counts(logfile: Path, suite: str) -> dict[str, int] | None:
    """Outcomes counted from the last ``pytest -q`` progress lines for ``suite`` in ``logfile``
    (for a run stopped before pytest wrote its report): '.' passed, 'F' failed, 'E' error, 's' skipped."""
    if not logfile.exists():
        return None
    text = logfile.read_text(errors="replace")
    start = text.rfind(f" {suite}\n")
    if start < 0:
        return None
    marks = "".join(m.group(1) for m in re.finditer(r"^([.FEsxX]+)(?:\s+\[\s*\d+%\])?$", text[start:], re.M))
    return {"passed": marks.count("."), "failed": marks.count("F"), "errors": marks.count("E"),
            "skipped": marks.count("s") + marks.count("x") + marks.count("X")}


def salvage_stopped(report: dict[str, Any], root: Path) -> None:
    """For suites stopped before their report, the outcomes their progress lines show."""
    for record in report["versions"]:
        for suite in SUITES:
            r = record.get(suite)
            if r and r.get("failures") == ["no junit report"] and "progress" not in r:
                v = record["version"]
                for log_name in (f"torch-{v}.{suite}.log", f"torch-{v}.log"):
                    counts = progress_counts(root / log_name, suite)
                    if counts and sum(counts.values()):
                        r["progress"] = counts
                        break


def merge_suites(report: dict[str, Any], other: dict[str, Any]) -> None:
    """Put the suite results of ``other`` (a report of another run) into ``report``'s rows, each
    with the commit and date it was measured at; versions ``report`` lacks are added whole."""
    rows = {r["version"]: r for r in report["versions"]}
    for record in other["versions"]:
        row = rows.get(record["version"])
        if row is None:
            report["versions"].append(record)
            continue
        for suite in SUITES:
            if record.get(suite) and "commit" not in record[suite]:
                row[suite] = {**record[suite], "commit": record.get("commit"), "date": record.get("date")}
    report["versions"].sort(key=lambda r: tuple(int(x) for x in re.findall(r"\d+", r["version"])))
    report["command"] += f"; then {other['command']}"


def node_id(name: str, project: Path) -> str:
    """A pytest node id from a JUnit ``classname::name`` (``tests.test_x.TestCase::test_y[p]``)."""
    classname, test = name.split("::", 1)
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        module = "/".join(parts[:cut]) + ".py"
        if (project / module).exists():
            return "::".join([module, *parts[cut:], test])
    return name


def rerun_failed(report: dict[str, Any], args: argparse.Namespace, project: Path) -> None:
    """Run each recorded failure of the given versions again, alone, in the kept environment."""
    for record in report["versions"]:
        if record["version"] not in args.versions:
            continue
        python = args.root / f"torch-{record['version']}" / "bin" / "python"
        if not python.exists():
            log(f"torch {record['version']}: no kept environment at {python.parent.parent}; not rerun")
            continue
        for suite in SUITES:
            r = record.get(suite) or {}
            if not r.get("failures"):
                continue
            r["rerun"] = {"commit": args.commit, "passed": [], "failed": []}
            for name in r["failures"]:
                cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", node_id(name, project)]
                rc, seconds = run(cmd, project, args.root / f"torch-{record['version']}.rerun.log")
                r["rerun"]["passed" if rc == 0 else "failed"].append(name)
                log(f"torch {record['version']}: rerun {name}: {'passed' if rc == 0 else 'failed'} in {seconds} s")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", default=list(DEFAULT_VERSIONS), help="torch releases to measure")
    parser.add_argument("--keep", action="store_true", help="keep each environment (and reuse it next time)")
    parser.add_argument("--root", type=Path, default=DEFAULT_ENV_ROOT, help="where the environments go (outside the checkout)")
    parser.add_argument("--out", type=Path, default=RESULTS / "torch_matrix.json")
    parser.add_argument("--find-links", type=Path, action="append", default=[],
                        help="a folder of already downloaded wheels for pip (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="versions measured at the same time (default 1)")
    parser.add_argument("--suites-together", action="store_true",
                        help="run the unit tests and the conformance suite of a version at the same time")
    parser.add_argument("--select", default="",
                        help="only the tests matching this pytest -k expression (a quick check of the command itself)")
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=list(SUITES),
                        help="which suites to run (with --merge, a version's other suite keeps its earlier result)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other versions already in --out (each record names its own commit and date)")
    parser.add_argument("--rerun-failed", action="store_true",
                        help="rerun, one at a time, the failures --out records for --versions (kept environments)")
    parser.add_argument("--table-only", action="store_true", help="rewrite the markdown table from --out")
    parser.add_argument("--merge-from", type=Path, action="append", default=[],
                        help="with --table-only or --rerun-failed: take the suites measured in this report of "
                             "another run into --out (repeatable)")
    parser.add_argument("--stop-at", default="",
                        help="UTC time HH:MM at which running suites are interrupted (their results so far are kept)")
    parser.add_argument("--not-measured", default="", help="a line for the table: versions this machine cannot install")
    return parser


def _from_report(args: argparse.Namespace) -> None:
    """--table-only and --rerun-failed: work on the report in --out (and --merge-from), write it back."""
    report = json.loads(args.out.read_text())
    for other in args.merge_from:
        merge_suites(report, json.loads(other.read_text()))
    salvage_stopped(report, args.root)
    if args.rerun_failed:
        with tempfile.TemporaryDirectory(prefix="ampspec-matrix-") as tmp:
            args.commit = snapshot(Path(tmp))
            rerun_failed(report, args, Path(tmp))
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    log(f"wrote {args.out} and {args.out.with_suffix('.md')}")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.root = args.root.expanduser().resolve()
    if args.root.is_relative_to(ROOT):
        parser.error(f"--root {args.root} is inside the checkout; the environments must live outside it")
    args.root.mkdir(parents=True, exist_ok=True)
    if args.stop_at:
        global STOP_AT
        now = _dt.datetime.now(_dt.timezone.utc)
        hour, minute = (int(x) for x in args.stop_at.split(":"))
        STOP_AT = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
        STOP_AT += _dt.timedelta(days=1) if STOP_AT <= now else _dt.timedelta(0)
    if args.table_only or args.rerun_failed:
        _from_report(args)
        return 0
    log(f"PyPI's Linux torch wheels pull several GB of CUDA libraries per version (5-8 GB of disk per "
        f"environment under {args.root}); environments are {'kept' if args.keep else 'removed after each version'}.")
    sys.path.insert(0, str(ROOT / "bench"))
    from _harness import machine  # noqa: E402  (bench's own helper; needs torch in this interpreter)

    with tempfile.TemporaryDirectory(prefix="ampspec-matrix-") as tmp:
        project, work = Path(tmp) / "project", Path(tmp) / "work"
        project.mkdir()
        work.mkdir()
        args.commit = snapshot(project)
        earlier: dict[str, dict[str, Any]] = {}
        if args.merge and args.out.exists():
            earlier = {r["version"]: r for r in json.loads(args.out.read_text())["versions"]}
        kept = [r for v, r in earlier.items() if v not in args.versions]
        report: dict[str, Any] = {
            "command": "python bench/torch_matrix.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": {**machine(), "platform": platform.platform()},
            "not_measured": args.not_measured, "select": args.select, "versions": kept,
        }
        lock = threading.Lock()

        def one(version: str) -> None:
            record = measure_version(version, args, project, work)
            for name in set(SUITES) - set(args.suites):  # not run now: the earlier result, with its commit
                if name in earlier.get(version, {}):
                    record[name] = {**earlier[version][name], "commit": earlier[version].get("commit")}
            mark_torchao(record)
            with lock:  # written after every version, so an interrupted matrix keeps what it measured
                report["versions"].append(record)
                report["versions"].sort(key=lambda r: tuple(int(x) for x in re.findall(r"\d+", r["version"])))
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=1) + "\n")
                args.out.with_suffix(".md").write_text(markdown(report))

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for future in [pool.submit(one, v) for v in args.versions]:
                future.result()
    log(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    bad = [r["version"] for r in report["versions"] if not r.get("installed") or any(
        (r.get(s) or {}).get("exit_status", 1) != 0 for s in SUITES)]
    if bad:
        log(f"not green: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
