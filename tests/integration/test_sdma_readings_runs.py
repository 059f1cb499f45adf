"""sdma-readings-runs end to end on a tiny budget (the controlled comparison driver)."""

import json
import math

import pytest

from conftest import run_checked, venv_bin

pytestmark = pytest.mark.integration

SMALL = ["--updates", 2, "--seeds", 1, 2, "--max-words", 4, "--vocab-size", 200, "--valid-size", 30,
         "--test-size", 30, "--gen-max-len", 8,
         "--redundancy-sentences", 10, "--bootstrap-resamples", 20]


def test_readings_driver_trains_scores_compares_and_resumes(tmp_path):
    out = tmp_path / "readings"
    proc = run_checked([venv_bin("sdma-readings-runs"), "--out-dir", out, *SMALL], timeout=1800)
    results = json.loads((out / "results.json").read_text())
    systems = ["V-T", "SDMA-T paper", "SDMA-T authors"]
    assert sorted(results["runs"]) == sorted(systems)
    for system in systems:
        assert sorted(results["runs"][system]) == ["1", "2"]
        for run in results["runs"][system].values():
            assert run["updates"] == 2 and run["bleu"] >= 0 and math.isfinite(run["valid_nll"])
            assert set(run["lr"]) == {"encoder_self", "decoder_self", "decoder_cross"}
    assert "--sdma-reading" in results["runs"]["SDMA-T authors"]["1"]["model_args"]
    assert math.isnan(results["runs"]["V-T"]["1"]["hardness"])  # no GMM in V-T
    assert 0.25 <= results["runs"]["SDMA-T authors"]["1"]["hardness"] <= 1.0
    comparisons = results["summary"]["comparisons"]
    assert set(comparisons) == {"SDMA-T paper - V-T", "SDMA-T authors - V-T", "SDMA-T authors - SDMA-T paper"}
    for c in comparisons.values():
        assert c["interval"][0] <= c["difference"] <= c["interval"][1]
    assert "SDMA-T authors - V-T" in proc.stdout
    again = run_checked([venv_bin("sdma-readings-runs"), "--out-dir", out, *SMALL])
    assert again.stdout.count("reusing the trained model") == 6
