"""pipelines.runs: the CPU-contention monitor and words/s over uncontended intervals."""

import math
import subprocess
import sys
import time

import pytest

from pipelines.runs import CpuContentionMonitor, uncontended_words_per_second

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


class FakeMonitor:
    """Other processes used ``cores[i]`` cores during second i."""

    def __init__(self, cores):
        self.cores = cores

    def other_cores(self, start, end):
        seconds = [self.cores[int(t)] for t in range(int(start), int(math.ceil(end)))]
        return sum(seconds) / len(seconds)


def fake_run(wps_and_arrival):
    """A run_streaming result: start-up at t=0, then one train_inner line per (wps, arrival), 10
    updates of 1000 words each."""
    lines, seconds = ["| INFO | fairseq.trainer | begin training epoch 1\n"], [0.0]
    for i, (wps, arrival) in enumerate(wps_and_arrival, start=1):
        lines.append(f"| INFO | train | train_inner | epoch 001: loss=5.0, wps={wps}, wpb=1000, num_updates={10 * i}\n")
        seconds.append(arrival)
    return {"lines": lines, "line_seconds": seconds}


def test_contended_intervals_are_left_out():
    # intervals: [0, 2) warm-up (skipped), [2, 4) quiet, [4, 6) another process on a whole core, [6, 8) quiet
    run = fake_run([(5000, 2.0), (5000, 4.0), (2500, 6.0), (5000, 8.0)])
    run["cpu_monitor"] = FakeMonitor([0, 0, 0, 0, 1, 1, 0, 0])
    speed = uncontended_words_per_second(run)
    assert speed["intervals"] == 2 and speed["all_intervals"] == 3
    assert speed["words_per_second"] == pytest.approx(5000.0)
    assert speed["all_words_per_second"] == pytest.approx(30000 / (2 + 4 + 2))
    assert [i["other_cores"] for i in speed["per_interval"]] == [0.0, 1.0, 0.0]
    run["cpu_monitor"] = None  # no monitor: every interval counts
    assert uncontended_words_per_second(run)["intervals"] == 3


def test_other_cores_is_machine_minus_tree_over_the_span():
    monitor = CpuContentionMonitor(pid=-1, period=1.0)
    # (seconds, machine busy CPU-s, tree busy CPU-s): the tree uses 1 core throughout, another
    # process a second core from t = 4 on
    monitor.samples = [(t, t + max(0, t - 4), t) for t in range(0, 9)]
    assert monitor.other_cores(1, 3) == pytest.approx(0.0)
    assert monitor.other_cores(5, 7) == pytest.approx(1.0)
    assert math.isnan(monitor.other_cores(20, 30))  # no samples there


def test_proc_readers_count_the_watched_tree():
    """A busy child (and its own child) is the watched tree: its CPU time shows in the tree's
    count, which never exceeds the machine's."""
    code = ("import subprocess, sys, time\n"
            "grandchild = subprocess.Popen([sys.executable, '-c', 'import time\\nt = time.time()\\n"
            "while time.time() - t < 2: pass'])\n"
            "t = time.time()\nwhile time.time() - t < 2: pass\ngrandchild.wait()")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        with CpuContentionMonitor(child.pid, period=0.25) as monitor:
            time.sleep(1.5)
    finally:
        child.wait()
    assert monitor.available and len(monitor.samples) >= 4
    (t0, machine0, tree0), (t1, machine1, tree1) = monitor.samples[0], monitor.samples[-1]
    assert tree1 - tree0 >= 0.3 * (t1 - t0)  # at least some of a core, even on a loaded machine
    assert machine1 - machine0 >= tree1 - tree0 - 0.05
