"""``python -m benchmarks.plugin_overhead``: fairseq's own transformer with and without the plugin
loaded, one short round on real data; its JSON holds both runs, their ratio and equal losses."""

import json
import subprocess
import sys

from conftest import REPO, run_checked


def test_plugin_overhead_runs_both_and_reports_equal_losses(small_translation_bin, tmp_path):
    out = tmp_path / "overhead.json"
    proc = run_checked([sys.executable, "-m", "benchmarks.plugin_overhead", "--data", small_translation_bin,
                        "--epochs", "2", "--rounds", "1", "--out-dir", tmp_path, "--json", out], cwd=REPO)
    assert "plugin / plain wall time: median" in proc.stdout and "validation losses identical" in proc.stdout
    result = json.loads(out.read_text())
    assert result["same_valid_loss"] and result["plain"][0]["valid_loss"] == result["plugin"][0]["valid_loss"]
    assert result["updates"] > 0 and result["ratio_plugin_over_plain"]["median"] > 0


def test_impossible_counts_are_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.plugin_overhead", "--rounds", "0"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--rounds=0 must be >= 1" in proc.stderr
