"""sdma-learning-curves end to end on a tiny budget: segments, the records of every checkpoint, the kept runs reused."""

import json
import math
import subprocess

import pytest

from conftest import run_checked, venv_bin

pytestmark = pytest.mark.integration

SMALL = ["--updates", 4, "--segment", 2, "--record-every", 2, "--seeds", 1, "--systems", "V-T", "SDMA-T authors",
         "--max-words", 4, "--vocab-size", 200, "--valid-size", 30, "--test-size", 30, "--gen-max-len", 8,
         "--diagnostic-sentences", 10, "--gradient-batches", 1, "--bootstrap-resamples", 20]


def test_learning_curves_record_every_segment_and_reuse_them(tmp_path):
    out = tmp_path / "curves"
    proc = run_checked([venv_bin("sdma-learning-curves"), "--out-dir", out, *SMALL], timeout=1800)
    results = json.loads((out / "results.json").read_text())
    assert sorted(results["table"]) == ["2", "4"]
    for system in ("V-T", "SDMA-T authors"):
        run = results["runs"][system]["1"]
        # validation cross-entropy every --record-every updates, from the logs of both segments
        assert sorted(run["valid_nll_bits"], key=int) == ["2", "4"]
        assert all(math.isfinite(v) and v > 0 for v in run["valid_nll_bits"].values())
        for update in ("2", "4"):
            at = run["at"][update]
            assert at["updates"] == int(update) and at["bleu"] >= 0
            encoder = at["attention"]["encoder_self"]
            assert len(encoder["entropy_bits_per_layer"]) == 2 and len(encoder["collapsed_share_per_layer"]) == 2
            assert all(0 <= share <= 1 for share in encoder["collapsed_share_per_layer"])
    sdma = results["runs"]["SDMA-T authors"]["1"]["at"]["4"]
    assert 0 < sdma["gradient"]["reg_share"] < 1 and -1 <= sdma["gradient"]["cosine"] <= 1
    assert all(0.25 <= h <= 1 for h in sdma["attention"]["encoder_self"]["hardness_per_layer"])  # 4 clusters
    assert results["runs"]["V-T"]["1"]["at"]["4"]["gradient"] is None  # no regularisers
    row = results["table"]["4"]["bleu"]["comparisons"]["SDMA-T authors - V-T"]
    assert row["interval"][0] <= row["difference"] <= row["interval"][1]
    assert (out / "learning_curves.png").stat().st_size > 10_000
    # the second segment resumed the first one's checkpoint
    logs = sorted((out / "SDMA-T-authors" / "seed1").glob("train-*.log"))
    assert len(logs) == 2 and "num_updates 4" in logs[1].read_text()
    assert "SDMA learning curves" in proc.stdout
    again = run_checked([venv_bin("sdma-learning-curves"), "--out-dir", out, *SMALL])
    assert "fairseq-train" not in again.stdout  # every segment kept: nothing retrained


@pytest.mark.parametrize("argv, message", [(["--updates", "10", "--segment", "3"], "--segment 3 must divide --updates 10"),
                                           (["--record-every", "0"], "--record-every must be >= 1")])
def test_bad_options_are_refused_with_one_line(argv, message):
    proc = subprocess.run([str(venv_bin("sdma-learning-curves")), *argv], capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr
