"""``make gpu-speed``'s plan and deadlines (benchmarks/sdma/gpu_speed.py): the runs of the defaults, the equal
shares that cannot exceed the total, per-run ``--run-timeout`` entries, and a run stopped at its deadline with its
process group. The command end to end: tests/integration/test_sdma_gpu_speed.py."""

import argparse
import json
import sys
import time

import pytest

from benchmarks.sdma import gpu_speed


def test_default_plan_is_sixteen_runs_ten_of_them_training():
    args = gpu_speed.parse_args([])
    runs = gpu_speed.plan_runs(args.regimes, args.kernels)
    assert (args.config, args.updates, args.kernels, args.total_timeout) == ("base", 300, ["auto", "triton"], 480)
    assert len(runs) == 16 and sum(r.kind == "train" for r in runs) == 10
    assert [r.name for r in runs[:8]] == ["ding/data", "ding/train/V-T", "ding/train/SMA-T/auto",
                                          "ding/train/SDMA-T/auto", "ding/train/SMA-T/triton",
                                          "ding/train/SDMA-T/triton", "ding/profile", "ding/decode"]


def test_equal_shares_fit_the_total_and_pass_on_what_is_left():
    runs = gpu_speed.plan_runs(["ding", "iwslt_like"], ["auto", "triton"])
    total = 480.0
    for needs in ([1000.0] * len(runs), [10.0 if r.kind == "data" else 1000.0 for r in runs],
                  [5.0, 20.0, 90.0, 90.0, 90.0, 90.0, 40.0, 60.0] * 2):
        left, deadlines, used = total, [], []
        for index, (run, need) in enumerate(zip(runs, needs)):
            deadlines.append(gpu_speed.run_deadline(run, left, len(runs) - index, {}))
            used.append(min(need, deadlines[-1]))
            left -= used[-1]
        assert min(deadlines) >= total / len(runs) - 1e-9  # 30 s each at least: 16 x 30 s = the total
        assert sum(used) <= total + 1e-9
    assert deadlines[1] > deadlines[0]  # what the quick data run left goes to the next run


def test_run_timeout_entries():
    timeouts = gpu_speed.parse_run_timeouts(["90", "ding/train/SDMA-T/*=40"])
    assert timeouts == {"*": 90.0, "ding/train/SDMA-T/*": 40.0}
    runs = {r.name: r for r in gpu_speed.plan_runs(["ding"], ["triton"])}
    assert gpu_speed.run_deadline(runs["ding/train/SDMA-T/triton"], 400, 5, timeouts) == 40
    assert gpu_speed.run_deadline(runs["ding/train/V-T"], 400, 5, timeouts) == 90
    assert gpu_speed.run_deadline(runs["ding/train/V-T"], 30, 5, timeouts) == 30  # never more than is left
    with pytest.raises(ValueError):
        gpu_speed.parse_run_timeouts(["ding/data=0"])
    with pytest.raises(SystemExit):
        gpu_speed.parse_args(["--run-timeout", "ding/data=soon"])


def test_unknown_kernel_and_config_are_usage_errors():
    with pytest.raises(SystemExit):
        gpu_speed.parse_args(["--kernels", "warp"])
    with pytest.raises(SystemExit):
        gpu_speed.parse_args(["--config", "huge"])


@pytest.mark.integration  # starts fresh interpreters
def test_a_run_over_its_deadline_is_stopped_with_its_children(tmp_path):
    child = tmp_path / "child.pid"
    # the run starts a child that would outlive it: stopping the process group stops both
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    start = time.monotonic()
    outcome = gpu_speed.run_with_deadline([sys.executable, "-c", script], tmp_path / "run.log", 3.0)
    assert outcome["status"] == "timed_out" and time.monotonic() - start < 10
    assert "stopped after" in (tmp_path / "run.log").read_text()
    pid = int(child.read_text())
    for _ in range(50):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":  # killed, not yet reaped by init
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {pid} still runs after its run was stopped")
    ok = gpu_speed.run_with_deadline([sys.executable, "-c", "print('done')"], tmp_path / "ok.log", 30.0)
    assert ok["status"] == "ok" and ok["returncode"] == 0


def test_gpu_check_step_runs_the_command_and_reads_its_report(tmp_path, monkeypatch):
    from benchmarks import gpu_check

    assert "gpu_speed" in gpu_check.STEPS and "gpu_speed" not in gpu_check.DEFAULT_STEPS
    commands = []

    def fake_run(cmd, log, timeout):  # what the command writes when a kernel's run failed
        commands.append([str(c) for c in cmd])
        report = {"runs": [{"name": "ding/train/V-T", "status": "ok"},
                           {"name": "ding/train/SDMA-T/triton", "status": "failed"}],
                  "rows": [{"regime": "ding", "model": "V-T", "train_wps_vs_vt": 1.0},
                           {"regime": "ding", "model": "SDMA-T/triton", "train_wps_vs_vt": 0.5}]}
        (tmp_path / "sdma_gpu_speed.json").write_text(json.dumps(report))
        return 1

    monkeypatch.setattr(gpu_check, "run", fake_run)
    result = gpu_check.step_gpu_speed(argparse.Namespace(step_timeout=1800.0), tmp_path)
    args = gpu_speed.parse_args(commands[0][3:])
    assert args.total_timeout == 480 and args.out == tmp_path / "sdma_gpu_speed.json"
    assert result["returncode"] == 1 and result["ding SDMA-T/triton wps_ratio"] == 0.5
    assert result["runs"]["ding/train/SDMA-T/triton"] == "failed"
