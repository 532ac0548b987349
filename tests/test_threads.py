"""``ampspec doctor``'s thread report: torch's threads against the cores and the load."""

from __future__ import annotations

from torchimpl.cli.app import main
from torchimpl.train.threads import ThreadSituation, report_lines


def test_a_busy_machine_gets_the_advice_with_both_ways_to_set_the_count():
    lines = report_lines(ThreadSituation(threads=2, cores=2, load=7.5, omp_env=None))
    assert lines[0] == "threads: torch uses 2 on 2 usable cores; load average (1 min) 7.50; OMP_NUM_THREADS unset"
    assert len(lines) == 2 and "the cores are busy" in lines[1]
    assert "OMP_NUM_THREADS=1" in lines[1] and "torch.set_num_threads(1)" in lines[1]


def test_more_threads_than_usable_cores_is_named():
    (_, advice) = report_lines(ThreadSituation(threads=16, cores=4, load=0.5, omp_env=None))
    assert "more threads than cores: set OMP_NUM_THREADS=4" in advice


def test_an_idle_machine_or_one_thread_gets_no_advice():
    assert len(report_lines(ThreadSituation(threads=2, cores=2, load=1.0, omp_env=None))) == 1
    assert len(report_lines(ThreadSituation(threads=1, cores=2, load=9.0, omp_env="1"))) == 1
    assert len(report_lines(ThreadSituation(threads=8, cores=8, load=None, omp_env=None))) == 1


def test_doctor_prints_the_thread_line(capsys):
    import torch

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"threads: torch uses {torch.get_num_threads()} on " in out, out
