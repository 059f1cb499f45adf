"""``make gpu-speed`` (``python -m benchmarks.sdma.gpu_speed``) end to end on the CPU: its ``--cpu`` mode, one
kernel, the synthetic IWSLT-like regime, a model of 1+1 layers; one training run gets a 1-second deadline."""

import json
import math
import os
import sys

import pytest

from conftest import run_checked

pytestmark = pytest.mark.integration

CUT = "iwslt_like/train/SMA-T/explicit"


@pytest.fixture(scope="module")
def speed(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_speed") / "speed.json"
    proc = run_checked([sys.executable, "-m", "benchmarks.sdma.gpu_speed", "--cpu", "--config", "micro",
                        "--kernels", "explicit", "--regimes", "iwslt_like", "--updates", 4, "--max-tokens", 512,
                        "--decode-sentences", 2, "--decode-rounds", 1, "--run-timeout", f"{CUT}=1", "--out", out],
                       timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})  # the runs are sequential
    return json.loads(out.read_text()), proc.stdout


def test_a_row_per_training_run_with_ratios_to_vt(speed):
    report, stdout = speed
    assert report["device"] == "cpu" and report["torch"] and "triton" in report
    rows = {row["model"]: row for row in report["rows"]}
    assert list(rows) == ["V-T", "SMA-T/explicit", "SDMA-T/explicit"]
    vt = rows["V-T"]
    for name in ("V-T", "SDMA-T/explicit"):
        row = rows[name]
        assert row["status"] == "ok"
        assert math.isfinite(row["train_wps"]) and row["train_wps"] > 0 and row["peak_mem_mb"] > 0
        assert row["train_wps_vs_vt"] == pytest.approx(row["train_wps"] / vt["train_wps"])
        assert row["peak_mem_vs_vt"] == pytest.approx(row["peak_mem_mb"] / vt["peak_mem_mb"])
    for row in rows.values():  # profiled and decoded from the profile run's checkpoints, the cut model too
        assert row["host_ms_per_update"] > 0 and row["launches_per_update"] > 0
        assert row["cuda_kernels_per_update"] is None and row["gpu_busy_fraction"] is None  # no GPU columns
        assert row["launches_vs_vt"] == pytest.approx(row["launches_per_update"] / vt["launches_per_update"])
        assert row["decode_sentences_per_second"] > 0
        assert row["decode_vs_vt"] == pytest.approx(row["decode_sentences_per_second"]
                                                     / vt["decode_sentences_per_second"])
    assert rows["SDMA-T/explicit"]["launches_per_update"] > vt["launches_per_update"]
    runs = {run["name"]: run for run in report["runs"]}
    decoded = [r for r in runs["iwslt_like/decode"]["records"] if not r["warmup"]]
    assert [r["label"] for r in decoded] == ["V-T", "SMA-T/explicit", "SDMA-T/explicit"]  # one interleaved round
    assert runs["iwslt_like/train/V-T"]["intervals"] == 3 and runs["iwslt_like/train/V-T"]["updates_reached"] == 4
    assert "wps vs V-T" in stdout and "decode vs V-T" in stdout


def test_a_run_over_its_deadline_is_timed_out_and_the_command_goes_on(speed):
    report, stdout = speed
    runs = {run["name"]: run for run in report["runs"]}
    assert list(runs) == ["iwslt_like/data", "iwslt_like/train/V-T", CUT, "iwslt_like/train/SDMA-T/explicit",
                          "iwslt_like/profile", "iwslt_like/decode"]
    cut = runs[CUT]
    assert cut["status"] == "timed_out" and cut["deadline_s"] == 1 and cut["seconds"] < 10
    assert math.isnan(cut["train_wps"]) and cut["updates_reached"] == 0
    assert {name: run["status"] for name, run in runs.items() if name != CUT} == dict.fromkeys(
        [name for name in runs if name != CUT], "ok")
    row = next(row for row in report["rows"] if row["model"] == "SMA-T/explicit")
    assert row["status"].startswith("timed_out") and row["train_wps_vs_vt"] is None
    assert f"{CUT}: timed_out" in stdout
