"""``tpr-transfer-runs`` (``experiments.tpr.transfer_runs``): the HUBERT transfer protocol (Table 2)
through fairseq-train, and ``prepare-pattern3`` (``pipelines.data.pattern3``: the real sets of
the README run)."""

import json
import random
import subprocess

import pytest
import torch

from conftest import REPO, save_tiny_bert, venv_bin
from pipelines.data import pattern3 as p3
from experiments.tpr import transfer_runs as protocol

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "and", ".", "cat", "dog", "horse", "bird",
         "car", "train", "boat", "plane", "red", "blue", "big", "small"]
ANIMALS, VEHICLES = ["cat", "dog", "horse", "bird"], ["car", "train", "boat", "plane"]
TINY_TPR = "--tpr-symbols 6 --tpr-roles 4 --tpr-symbol-dim 4 --tpr-role-dim 4 --tpr-heads 2"


def write_task(path, label_of, seed):
    """A tiny SST-2-layout task: 'the X and a Y .' labelled by ``label_of(X, Y)``."""
    rng = random.Random(seed)
    path.mkdir()
    for split, n in (("train", 96), ("dev", 32), ("test", 16)):
        rows = []
        for _ in range(n):
            x, y = rng.choice(ANIMALS + VEHICLES), rng.choice(["red", "blue", "big", "small"])
            rows.append(f"the {x} and a {y} .\t{label_of(x, y)}")
        (path / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    return path


def test_parse_combos_and_transfer_parts():
    assert len(protocol.COMBOS) == 7 and protocol.parse_combos(None, None) == protocol.COMBOS
    assert protocol.parse_combos(["fillers+encoder", "roles"], None) == [("encoder", "fillers"), ("roles",)]
    assert protocol.transfer_parts(("encoder", "roles"), True) == ["encoder", "roles", "role_selector"]
    assert protocol.transfer_parts(("fillers",), False) == ["fillers"]

    def error(message):
        raise ValueError(message)

    with pytest.raises(ValueError, match="--combos 'bert'"):
        protocol.parse_combos(["bert"], error)


def test_protocol_runs_baselines_bert_and_tpr_transfer_and_resumes(tmp_path):
    from transformers import BertConfig, BertModel

    encoder = save_tiny_bert(tmp_path / "tiny_bert", WORDS)
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(str(encoder)), add_pooling_layer=False).save_pretrained(str(encoder))
    source = write_task(tmp_path / "animals", lambda x, y: int(x in ANIMALS), 1)
    target = write_task(tmp_path / "colours", lambda x, y: int(y in ("red", "blue")), 2)
    cmd = [venv_bin("tpr-transfer-runs"), "--source", str(source), "--target",
           str(target), "--encoder-dir", str(encoder), "--run-dir", str(tmp_path / "runs"), "--seeds", "1",
           "--tpr-args=" + TINY_TPR, "--combos", "roles", "encoder+fillers", "--lr", "2e-3", "--optimizer", "adam",
           "--epochs", "2", "--batch-size", "16", "--max-positions", "16", "--fairseq-extra=--cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "runs" / "transfer.json").read_text())
    assert len(report) == 1 and (report[0]["source"], report[0]["target"]) == ("animals", "colours")
    rows = {r["run"]: r for r in report[0]["rows"]}
    assert list(rows) == ["cls", "cls+encoder", "tpr", "tpr+roles", "tpr+encoder+fillers"]
    assert rows["tpr+encoder+fillers"]["transfer"] == ["encoder", "fillers", "filler_selector"]
    for row in rows.values():
        assert row["seeds"] == [1] and 0 <= row["test_mean"] <= 100 and 0 <= row["dev_mean"] <= 100
    table2 = report[0]["table2"]
    assert table2["HUBERT"]["best_run"] in ("tpr+roles", "tpr+encoder+fillers")
    assert table2["HUBERT"]["gain_dev"] == pytest.approx(table2["HUBERT"]["finetuned_dev"]
                                                         - table2["HUBERT"]["baseline_dev"])
    pair = tmp_path / "runs" / "animals-to-colours" / "seed1"
    # the HUBERT runs moved exactly the named parts from the source HUBERT checkpoint
    # ... trained with its own seed (1 + 100), not the target's
    source_tpr = tmp_path / "runs" / "animals" / "seed101" / "tpr" / "checkpoint_best.pt"
    assert json.loads((pair / "tpr+roles.result.json").read_text())["source_seed"] == 101
    assert not (tmp_path / "runs" / "animals" / "seed1").exists()

    def transferred(run):
        lines = [line for line in (pair / f"{run}.log").read_text().splitlines() if "transferred from" in line]
        assert len(lines) == 1, lines
        return lines[0].split(f"transferred from {source_tpr}: ")[1]

    # R and S move with their selectors (the default, as the authors' code)
    moved = transferred("tpr+encoder+fillers")
    assert moved.startswith("encoder (") and ", fillers (1 tensors), filler_selector (" in moved
    assert "role" not in moved
    assert transferred("tpr+roles").startswith("roles (1 tensors), role_selector (")
    # the moved R (trained from seed 101) is far from the target run's own R (seed 1)
    source_state = torch.load(source_tpr, map_location="cpu", weights_only=True)["model"]
    target_init = torch.load(tmp_path / "runs" / "colours" / "seed1" / "tpr" / "checkpoint_best.pt",
                             map_location="cpu", weights_only=True)["model"]
    assert (source_state["tpr.R"] - target_init["tpr.R"]).norm() > 0.5 * target_init["tpr.R"].norm()
    # the BERT row starts from the source [CLS] model's fine-tuned encoder, exported for --hf-model-dir
    source_cls = torch.load(tmp_path / "runs" / "animals" / "seed101" / "cls" / "checkpoint_best.pt",
                            map_location="cpu", weights_only=True)["model"]
    exported = BertModel.from_pretrained(str(pair / "cls-encoder"), add_pooling_layer=False).state_dict()
    for name, value in exported.items():
        assert torch.equal(value, source_cls[f"backbone.{name}"]), name
    assert f"--hf-model-dir {pair / 'cls-encoder'}" in (pair / "cls+encoder.log").read_text() or \
        str(pair / "cls-encoder") in (pair / "cls+encoder.log").read_text()
    # finished runs are skipped: a second call trains nothing and reports the same table
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").rglob("*.result.json")}
    assert stamps, "no finished runs recorded"
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert json.loads((tmp_path / "runs" / "transfer.json").read_text()) == report


def test_report_only_pairs_gains_by_seed_and_writes_markdown(tmp_path, capsys):
    source, target = tmp_path / "src", tmp_path / "tgt"
    for task in (source, target):
        task.mkdir()
        for split in ("train", "dev", "test"):
            (task / f"{split}.tsv").write_text("sentence\tlabel\na b\t1\n")
    runs = tmp_path / "runs"
    args = ["--source", str(source), "--target", str(target), "--encoder-dir", "unused", "--run-dir", str(runs)]
    assert protocol.main(args + ["--report-only"]) == 1  # nothing finished yet: says so, trains nothing

    def result(folder, run, model, transfer, seed, dev, test):
        (folder / f"seed{seed}").mkdir(parents=True, exist_ok=True)
        row = {"task": "tgt", "model": model, "transfer": transfer, "run": run, "seed": seed,
               "dev_accuracy": dev, "test_accuracy": test}
        (folder / f"seed{seed}" / f"{run}.result.json").write_text(json.dumps(row))

    for seed, (base_dev, base_test, dev, test) in {1: (70.0, 60.0, 75.0, 61.0), 2: (72.0, 64.0, 73.0, 62.0)}.items():
        result(runs / "tgt", "tpr", "HUBERT", [], seed, base_dev, base_test)
        result(runs / "src-to-tgt", "tpr+encoder", "HUBERT", ["encoder"], seed, dev, test)
    result(runs / "src", "tpr", "HUBERT", [], 1, 99.0, 99.0)  # the source task's own run is not a target row
    assert protocol.main(args + ["--report-only"]) == 0
    assert not (runs / "src-to-tgt" / "seed1" / "tpr+encoder").exists()  # nothing was trained
    rows = {r["run"]: r for r in json.loads((runs / "transfer.json").read_text())[0]["rows"]}
    assert list(rows) == ["tpr", "tpr+encoder"]
    assert rows["tpr"]["dev_mean"] == pytest.approx(71.0) and rows["tpr"]["dev_sd"] == pytest.approx(2 ** 0.5)
    assert rows["tpr+encoder"]["dev_gain_mean"] == pytest.approx(3.0)  # (+5, +1) paired by seed
    assert rows["tpr+encoder"]["test_gain_mean"] == pytest.approx(-0.5)  # (+1, -2)
    md = (runs / "transfer.md").read_text()
    assert "| tpr | 1,2 | 71.00 ± 1.41 | 62.00 ± 2.83 |" in md
    assert "| tpr+encoder | 1,2 | 74.00 ± 1.41 (+3.00) | 61.50 ± 0.71 (-0.50) |" in md
    assert "HUBERT: baseline dev 72.00 -> fine-tuned dev 75.00 (tpr+encoder, seed 1" in capsys.readouterr().out


def test_pattern3_csv_becomes_deduplicated_stratified_sst2_splits(tmp_path):
    rows = [f'"{1 if i % 2 else -1}","sentence number {i} ."' for i in range(40)]
    rows += ['"1","sentence number 1 ."', '"1","a repeated  title"', '"-1","a repeated title"']
    csv = tmp_path / "uncertainty.csv"
    csv.write_text("\ufeff" + "\n".join(rows) + "\n", encoding="utf-8")
    stats = p3.prepare(tmp_path / "out", ["uncertainty"], dev=0.1, test=0.2, seed=3, files={"uncertainty": csv})
    assert stats["uncertainty"]["examples"] == 40  # the exact repeat kept once, the conflicting pair dropped
    splits = {s: (tmp_path / "out" / "uncertainty" / f"{s}.tsv").read_text().splitlines() for s in
              ("train", "dev", "test")}
    assert all(lines[0] == "sentence\tlabel" for lines in splits.values())
    sentences = [line.split("\t")[0] for lines in splits.values() for line in lines[1:]]
    assert len(sentences) == len(set(sentences)) == 40 and "a repeated title" not in sentences
    assert stats["uncertainty"]["test"]["labels"] == {"0": 4, "1": 4}  # stratified: 20% of each label
    assert stats["uncertainty"]["dev"]["labels"] == {"0": 2, "1": 2}
    again = p3.prepare(tmp_path / "again", ["uncertainty"], dev=0.1, test=0.2, seed=3, files={"uncertainty": csv})
    assert again == stats  # seeded

    csv.write_text('"2","a sentence"\n', encoding="utf-8")
    with pytest.raises(p3.DataError, match=r"uncertainty.csv:1: label '2'"):
        p3.read_corpus(csv, p3.CORPORA["uncertainty"][1])
    with pytest.raises(ValueError, match="--dev"):
        p3.stratified_split([("a", "1")], dev=0.6, test=0.5, seed=1)
