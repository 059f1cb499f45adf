"""``transformers-sdma-lm``: a tiny GPT-2 from scratch on the Ding English side, vanilla vs SDMA, in a plain loop."""

import json

import pytest

from conftest import DING_DE_EN
from experiments.transformers import lm_runs

ding_source = DING_DE_EN


def test_vanilla_and_sdma_with_perplexity_intervals_and_lrhr(tmp_path, capsys):
    argv = ["--out-dir", str(tmp_path), "--source", str(ding_source), "--max-sentences", "400", "--valid", "50",
            "--test", "50", "--updates", "6", "--seeds", "1", "2", "--batch-size", "16", "--embed-dim", "32",
            "--layers", "2", "--warmup", "2", "--validate-interval-updates", "2", "--lr", "0.05"]
    assert lm_runs.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["data"]["test"] == 50 and results["data"]["train"] == 300
    assert sorted((r["system"], r["seed"]) for r in results["runs"]) == [("SDMA", 1), ("SDMA", 2), ("vanilla", 1),
                                                                          ("vanilla", 2)]
    for run in results["runs"]:
        low, high = run["perplexity_ci95"]
        assert 1 < low <= run["perplexity"] <= high < results["data"]["vocabulary"] * 2
        assert 0 <= run["LR"] <= 1 and 0 <= run["HR"] <= 1 and run["updates"] == 6
        # the reported weights are the best-valid ones among updates 2, 4, 6; the last update's test beside them
        valid = {point["update"]: point["valid_perplexity"] for point in run["curve"]}
        assert sorted(valid) == [2, 4, 6] and run["valid_perplexity"] == min(valid.values())
        assert valid[run["best_update"]] == run["valid_perplexity"]
        if run["best_update"] == 6:
            assert run["last"]["perplexity"] == pytest.approx(run["perplexity"])
        else:
            assert run["last"]["perplexity"] != pytest.approx(run["perplexity"])
    sdma, vanilla = results["summary"]["SDMA"], results["summary"]["vanilla"]
    assert sdma["perplexity"]["n"] == vanilla["perplexity"]["n"] == 2
    difference = results["summary"]["SDMA_minus_vanilla_perplexity"]
    runs = {(r["system"], r["seed"]): r["perplexity"] for r in results["runs"]}
    assert difference["seeds"] == [1, 2] and difference["mean"] == pytest.approx(
        (runs["SDMA", 1] - runs["vanilla", 1] + runs["SDMA", 2] - runs["vanilla", 2]) / 2)
    assert "perplexity" in capsys.readouterr().out
    assert lm_runs.main(argv) == 0  # finished runs are kept
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 4


def test_bad_input_exits_with_a_named_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        lm_runs.main(["--out-dir", str(tmp_path), "--embed-dim", "30", "--heads", "4"])
    assert stop.value.code == 2 and "--heads 4 must divide --embed-dim 30" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        lm_runs.main(["--out-dir", str(tmp_path), "--valid", "0"])
    assert stop.value.code == 2 and "best valid perplexity" in capsys.readouterr().err
    assert lm_runs.main(["--out-dir", str(tmp_path), "--source", str(ding_source), "--max-sentences", "100"]) == 2
    assert "leave none for training" in capsys.readouterr().err
    assert lm_runs.main(["--out-dir", str(tmp_path), "--source", str(tmp_path / "missing")]) == 2
    assert "reading the Ding sentences" in capsys.readouterr().err
