"""``transformers-sdma-mt``: a BART-shaped model from scratch on the Ding pairs with ``SDMASeq2SeqTrainer``, V-T
against SDMA-T in both readings: sacreBLEU with paired bootstrap intervals, valid NLL, LR/HR of the encoder."""

import json

import numpy as np
import pytest

from conftest import DING_DE_EN
from experiments.bleu_bootstrap import corpus_bleu_of
from pipelines.runs import slug
from experiments.transformers import mt_runs


def test_three_systems_with_paired_bleu_and_encoder_lrhr(tmp_path, capsys):
    argv = ["--out-dir", str(tmp_path), "--source", str(DING_DE_EN), "--valid-size", "40", "--test-size", "40",
            "--max-train-pairs", "200", "--updates", "4", "--warmup", "2", "--seeds", "1", "--embed-dim", "32",
            "--ffn-dim", "64", "--vocab-size", "300", "--max-tokens-per-batch", "600", "--gen-max-len", "12",
            "--beam", "2", "--redundancy-sentences", "20", "--bootstrap-resamples", "50"]
    assert mt_runs.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["data"]["train"] == 200 and results["data"]["test"] == 40
    assert sorted(r["system"] for r in results["runs"]) == ["SDMA-T authors", "SDMA-T paper", "V-T"]
    references = (tmp_path / "data" / "prep" / "spm" / "test.en.raw").read_text().splitlines()
    for run in results["runs"]:
        hypotheses = (tmp_path / run["system"].replace(" ", "_") / "seed1" / "hypotheses.txt").read_text()
        assert len(hypotheses.splitlines()) == len(references) == 40
        assert run["bleu"] == pytest.approx(corpus_bleu_of(np.asarray(run["stats"])))
        assert 0 <= run["LR"] <= 1 and 0 <= run["HR"] <= 1 and run["valid_bits_per_token"] > 0
        assert run["updates"] == 4 and run["batch_pairs"] >= 1
    bleu = results["summary"]["bleu"]
    assert set(bleu["comparisons"]) == {"SDMA-T paper - V-T", "SDMA-T authors - V-T", "SDMA-T authors - SDMA-T paper"}
    for entry in bleu["systems"].values():
        assert entry["interval"][0] <= entry["bleu"] + 1e-9 and entry["bleu"] <= entry["interval"][1] + 1e-9
    # the two readings' encoders differ from V-T's (SDMA keeps its mask at inference): different attention
    lr = {r["system"]: r["LR"] for r in results["runs"]}
    assert lr["SDMA-T authors"] != lr["V-T"] and lr["SDMA-T paper"] != lr["V-T"]
    assert "SDMA-T authors - V-T" in capsys.readouterr().out
    assert mt_runs.main(argv) == 0  # finished runs are kept
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 3
    capsys.readouterr()

    # --fairseq-runs: an sdma-readings-runs folder's runs join the bootstrap; here a folder in its layout holding
    # these runs' own hypotheses, so each toolkit difference is exactly 0
    fairseq = tmp_path / "readings_runs"
    for run in results["runs"]:
        run_dir = fairseq / slug(run["system"]) / "seed1"
        run_dir.mkdir(parents=True)
        hypotheses = (tmp_path / run["system"].replace(" ", "_") / "seed1" / "hypotheses.txt").read_text()
        (run_dir / "evaluation.json").write_text(json.dumps({
            "hypotheses": hypotheses.splitlines(), "lr": {"encoder_self": 0.5}, "hr": {"encoder_self": 0.4}}))
        (run_dir / "train.json").write_text(json.dumps({
            "updates": 4, "measured": {"valid_nll": 7.5, "train_seconds_last_process": 1.0}}))
    assert mt_runs.main(argv + ["--fairseq-runs", str(fairseq)]) == 0
    summary = json.loads((tmp_path / "results.json").read_text())["summary"]
    for system in mt_runs.SYSTEMS:
        row = summary["bleu"]["comparisons"][f"{system} - fairseq {system}"]
        assert row["difference"] == 0 and row["interval"] == [0, 0] and row["seeds"] == [1]
        assert summary[f"fairseq {system}"]["LR"]["mean"] == 0.5
    assert "fairseq SDMA-T authors - fairseq V-T" in summary["bleu"]["comparisons"]
    assert "fairseq SDMA-T paper" in capsys.readouterr().out
    assert mt_runs.main(argv + ["--fairseq-runs", str(tmp_path / "nowhere")]) == 2
    assert "holds no sdma-readings-runs run of seeds [1]" in capsys.readouterr().err


def test_bad_input_exits_with_a_named_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        mt_runs.main(["--out-dir", str(tmp_path), "--embed-dim", "30", "--heads", "4"])
    assert stop.value.code == 2 and "--heads 4 must divide --embed-dim 30" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        mt_runs.main(["--out-dir", str(tmp_path), "--updates", "0"])
    assert stop.value.code == 2 and "must be positive" in capsys.readouterr().err
    assert mt_runs.main(["--out-dir", str(tmp_path), "--source", str(tmp_path / "missing")]) == 2
    assert "preparing the Ding pairs" in capsys.readouterr().err
