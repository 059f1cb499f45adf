"""fairseq on the GPU: 20 updates of ``fairseq-train`` per model family in ``--fp16`` and ``--amp``
(fairseq 0.12's ``--bf16`` is its TPU mode); fairseq's FP16Optimizer loss scaling and overflow skip;
``fairseq-generate`` on CUDA equals the CPU; ``--ddp-backend pytorch_ddp`` (find_unused_parameters off, fairseq's GPU default) with two
processes sharing the GPU.

Every run must exit 0 with finite losses in every logged interval and write a checkpoint that
the safe loader reads back.
"""

import json
import math
import os
import random
import re
import subprocess

import pytest
import torch

from conftest import (REPO, english_phrases, free_port, prepare_bert_ding_bin, prepare_ding_bin, run_checked, save_tiny_bert,
                      venv_bin)
from gpu_support import FAIRSEQ_PRECISION, ON_CPU, fairseq_device_flags, needs_cuda_for

UPDATES = 20
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
COMMON = ["--user-dir", str(REPO / "user_dir"), "--optimizer", "adam", "--seed", "1", "--no-progress-bar",
          "--log-format", "json", "--log-interval", "1", "--no-epoch-checkpoints", "--num-workers", "0",
          "--max-update", str(UPDATES), "--max-epoch", "1000"]
SDMA_TINY = ["--task", "translation", "--arch", "sdma_transformer_iwslt_de_en_tiny", "--encoder-layers", "2",
             "--decoder-layers", "2", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
             "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
             "--criterion", "sdma_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
             "--lr", "1e-3", "--max-tokens", "1000"]
VAE_SMALL = ["--task", "sentence_vae", "--criterion", "sentence_vae", "--lr", "1e-3", "--batch-size", "32"]
TOPICS = {"animal": "cat dog bird horse cow sheep goat mouse".split(),
          "vehicle": "car bus train plane boat bike truck ship".split()}
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"the and a with .".split(), *TOPICS["animal"],
         *TOPICS["vehicle"]]


@pytest.fixture(scope="module")
def english_bert(tmp_path_factory):
    """A tiny random BERT (2 layers, hidden 32) whose WordPiece vocabulary holds the English Ding words:
    the stand-in for MiniLM of the BERT-fused and Optimus runs (precision and device are what is
    tested here; the MiniLM runs are the integration tests')."""
    from transformers import BertConfig, BertModel

    words = sorted({w for line in english_phrases(3000, min_words=1) for w in line.split()})
    path = save_tiny_bert(tmp_path_factory.mktemp("gpu_english_bert"), ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                                                         *words])
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(str(path))).save_pretrained(str(path))  # random weights
    return path


# ---------------------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def translation_bin(tmp_path_factory):
    return prepare_ding_bin(tmp_path_factory.mktemp("gpu_ding"), train_pairs=2000, vocab_size=500)


@pytest.fixture(scope="module")
def vae_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_vae")
    lines = english_phrases(1100)
    (root / "train.txt").write_text("\n".join(lines[:1000]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[1000:]) + "\n")
    run_checked([venv_bin("fairseq-preprocess"), "--only-source", "--trainpref", root / "train.txt", "--validpref",
                 root / "valid.txt", "--destdir", root / "bin", "--workers", "1"])
    return root / "bin"


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("gpu_tiny_bert"), WORDS)


def _sentence(rng, topic, avoid=()):
    words = rng.sample([w for w in TOPICS[topic] if w not in avoid], 2)
    return f"the {words[0]} and a {words[1]} .", set(words)


@pytest.fixture(scope="module")
def pair_tsv(tmp_path_factory):
    """Sentence pairs labelled 1 when both talk about the same topic (the topic_vq integration tests' task)."""
    path = tmp_path_factory.mktemp("gpu_pairs")
    rng = random.Random(3)
    for split, n in (("train", 320), ("dev", 40), ("test", 10)):
        rows = []
        for _ in range(n):
            first = rng.choice(sorted(TOPICS))
            same = rng.random() < 0.5
            s1, used = _sentence(rng, first)
            s2, _ = _sentence(rng, first if same else next(t for t in TOPICS if t != first), avoid=used)
            rows.append(f"{s1}\t{s2}\t{int(same)}")
        (path / f"{split}.tsv").write_text("s1\ts2\tlabel\n" + "\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def optimus_data(tmp_path_factory, english_bert):
    root = tmp_path_factory.mktemp("gpu_optimus")
    lines = english_phrases(700)
    for name, part in (("train", lines[:600]), ("valid", lines[600:650]), ("test", lines[650:])):
        (root / f"{name}.txt").write_text("\n".join(part) + "\n")
    run_checked([venv_bin("prepare-optimus-data"), "--out-dir", root / "data", "--train", root / "train.txt",
                 "--valid", root / "valid.txt", "--test", root / "test.txt", "--bert-dir", english_bert,
                 "--train-bpe", root / "bpe", "--bpe-vocab-size", "600"])
    return root / "data"


@pytest.fixture(scope="module")
def bert_bin(tmp_path_factory, english_bert):
    return prepare_bert_ding_bin(tmp_path_factory.mktemp("gpu_bert_ding"), english_bert, pairs=1000)


# ------------------------------------------------------------------------------------ families
def _pair_task(data, tiny, *, pairs):
    columns = ["--sentence1-column", "0", "--sentence2-column", "1", "--label-column", "2"] if pairs else \
        ["--sentence1-column", "0", "--label-column", "2"]
    return [str(data), "--task", "hf_sentence_prediction", "--hf-tokenizer-dir", str(tiny), *columns,
            "--skip-header", "--num-classes", "2", "--max-positions", "32", "--hf-config", str(tiny),
            "--criterion", "hf_sentence_prediction", "--batch-size", "32", "--lr", "1e-3",
            "--required-batch-size-multiple", "1"]


FAMILIES = {
    # name: (fixtures it needs, argv builder)
    "sdma_authors": (("translation_bin",), lambda f: [f["translation_bin"], *SDMA_TINY, "--sdma-reading", "authors"]),
    "sdma_paper": (("translation_bin",), lambda f: [f["translation_bin"], *SDMA_TINY, "--sdma-reading", "paper"]),
    "sma": (("translation_bin",), lambda f: [f["translation_bin"], *SDMA_TINY, "--sdma-mode", "sma"]),
    # the Triton kernels (clustering and masked mixture) under fairseq's trainer
    "sdma_triton": (("translation_bin",), lambda f: [f["translation_bin"], *SDMA_TINY,
                                                     "--sdma-attention-kernel", "triton"]),
    "vanilla": (("translation_bin",), lambda f: [f["translation_bin"], *SDMA_TINY, "--sdma-mode", "none"]),
    "bert_fused": (("bert_bin", "english_bert"), lambda f: [
        f["bert_bin"], "--task", "translation", "--arch", "bert_fused_transformer_tiny",
        "--bert-dir", f["english_bert"],
        "--bert-fusion", "attention", "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "64",
        "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
        "--criterion", "sdma_label_smoothed_cross_entropy", "--lr", "1e-3", "--max-tokens", "800"]),
    "qkvae": (("vae_bin",), lambda f: [f["vae_bin"], *VAE_SMALL, "--arch", "qkvae_small"]),
    "advae": (("vae_bin",), lambda f: [f["vae_bin"], *VAE_SMALL, "--arch", "advae_small"]),
    "optimus_lm": (("optimus_data", "english_bert"), lambda f: [
        f["optimus_data"], "--task", "optimus_lm", "--criterion", "sentence_vae", "--arch", "optimus_small",
        "--bert-dir", f["english_bert"], "--decoder-layers", "2", "--decoder-embed-dim", "64",
        "--decoder-attention-heads", "2", "--decoder-ffn-embed-dim", "128", "--latent-dim", "8",
        "--beta-schedule", "cyclical:2:0.5:0.25:0.25", "--kl-threshold", "0.5", "--lr", "3e-4", "--batch-size", "16"]),
    "topic_vq_sts": (("pair_tsv", "tiny_bert"), lambda f: [
        *_pair_task(f["pair_tsv"], f["tiny_bert"], pairs=True), "--task", "topic_vq_sentence_prediction",
        "--topic-features", "--arch", "topic_vq_sts", "--num-topics", "4"]),
    "tpr_classifier": (("pair_tsv", "tiny_bert"), lambda f: [
        *_pair_task(f["pair_tsv"], f["tiny_bert"], pairs=False), "--arch", "tpr_classifier", "--tpr-symbols", "6",
        "--tpr-roles", "4", "--tpr-symbol-dim", "4", "--tpr-role-dim", "4", "--tpr-heads", "2"]),
    "hf_sentence_classifier": (("pair_tsv", "tiny_bert"), lambda f: [
        *_pair_task(f["pair_tsv"], f["tiny_bert"], pairs=True), "--arch", "hf_sentence_classifier"]),
}


def fairseq_train(argv, save_dir, *extra, timeout=600):
    cmd = [venv_bin("fairseq-train"), *map(str, argv), *COMMON, *fairseq_device_flags(), "--save-dir", str(save_dir),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=timeout)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{log[-6000:]}"
    return log


def train_records(log):
    return [json.loads(line.split(" | train_inner | ", 1)[1]) for line in log.splitlines()
            if " | train_inner | {" in line]


def check_run(log, save_dir, min_updates=UPDATES):
    records = train_records(log)
    assert records, log[-3000:]
    for record in records:
        assert math.isfinite(float(record["loss"])), record
    assert int(records[-1]["num_updates"]) >= min_updates - 1, records[-1]
    from fairseq import checkpoint_utils  # the project's safe loader is installed by user_dir

    state = checkpoint_utils.load_checkpoint_to_cpu(str(save_dir / "checkpoint_last.pt"))
    assert all(torch.isfinite(t.float()).all() for t in state["model"].values() if torch.is_tensor(t))
    return records


# fairseq 0.12's --bf16 implies --tpu (fairseq/options.py: "use bfloat16; implies --tpu"), on a GPU
# as on a CPU: its GPU mixed-precision modes are --fp16 and --amp. A CPU run of the tier trains in fp32.
@pytest.mark.parametrize("precision", ["fp32"] if ON_CPU else ["fp16", "amp"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_twenty_updates_in_mixed_precision(request, tmp_path, family, precision):
    fixtures, argv = FAMILIES[family]
    values = {name: request.getfixturevalue(name) for name in fixtures}
    log = fairseq_train(argv(values), tmp_path / "ckpt", *FAIRSEQ_PRECISION[precision], "--disable-validation")
    records = check_run(log, tmp_path / "ckpt")
    if precision == "fp16":  # FP16Optimizer: a dynamic loss scale in every record
        assert all("loss_scale" in r for r in records), records[-1]


@pytest.mark.parametrize("family", ["sdma_authors", "qkvae"])
def test_fp16_overflow_is_skipped_and_the_scale_comes_down(request, tmp_path, family):
    """A loss scale of 2^40 overflows fp16 gradients at once: fairseq's FP16Optimizer must skip those
    updates, halve the scale, then train with finite losses."""
    needs_cuda_for("fp16")
    fixtures, argv = FAMILIES[family]
    values = {name: request.getfixturevalue(name) for name in fixtures}
    log = fairseq_train(argv(values), tmp_path / "ckpt", "--fp16", "--fp16-init-scale", str(2 ** 40),
                        "--fp16-scale-window", "1000", "--disable-validation")
    assert re.search(r"overflow detected, ignoring gradient, setting loss scale to", log), log[-3000:]
    records = check_run(log, tmp_path / "ckpt", min_updates=1)
    assert float(records[-1]["loss_scale"]) < 2 ** 40


def _generate(data_bin, checkpoint, *extra):
    proc = run_checked([venv_bin("fairseq-generate"), data_bin, "--user-dir", REPO / "user_dir", "--path", checkpoint,
                        "--gen-subset", "test", "--beam", "5", "--batch-size", "16", "--max-len-b", "20",
                        # fairseq's default multiple of 8 drops the last 2 of the 50 test sentences (fairseq#5036)
                        "--required-batch-size-multiple", "1", *extra],
                       env=ENV, cwd=REPO)
    hyps = {}
    for line in proc.stdout.splitlines():
        if line.startswith("H-"):
            key, score, text = line.split("\t")
            hyps[int(key[2:])] = (float(score), text)
    return hyps


@pytest.mark.skipif(ON_CPU, reason="compares CUDA with the CPU")
@pytest.mark.parametrize("family", ["sdma_authors", "sdma_paper", "sma"])
def test_generate_on_cuda_equals_the_cpu(translation_bin, tmp_path, family):
    """The same fp32 checkpoint decoded with beam 5 on CUDA and on the CPU: every hypothesis equal
    (TF32 matrix products are off in fairseq-generate's fp32) and scores within 1e-3."""
    _, argv = FAMILIES[family]
    fairseq_train(argv({"translation_bin": translation_bin}), tmp_path / "ckpt", "--disable-validation")
    checkpoint = tmp_path / "ckpt" / "checkpoint_last.pt"
    on_gpu = _generate(translation_bin, checkpoint)
    on_cpu = _generate(translation_bin, checkpoint, "--cpu")
    assert on_gpu.keys() == on_cpu.keys() and len(on_gpu) == 50
    same = sum(on_gpu[k][1] == on_cpu[k][1] for k in on_gpu)
    assert same >= 49, f"{same}/50 hypotheses agree"
    assert max(abs(on_gpu[k][0] - on_cpu[k][0]) for k in on_gpu if on_gpu[k][1] == on_cpu[k][1]) < 1e-3


@pytest.mark.skipif(ON_CPU, reason="the CPU stand-in (legacy_ddp over gloo) is tests/integration/test_cli.py's")
@pytest.mark.parametrize("family", ["sdma_authors", "sdma_paper", "sma", "qkvae", "bert_fused"])
def test_pytorch_ddp_two_processes_on_one_gpu(request, tmp_path, family):
    """fairseq's GPU trainer as users run it (``--ddp-backend pytorch_ddp``, find_unused_parameters
    off: DDP raises if any trained parameter gets no gradient), two ranks on the one GPU over gloo."""
    fixtures, argv = FAMILIES[family]
    values = {name: request.getfixturevalue(name) for name in fixtures}
    port = free_port()
    precision, device = ["--fp16"], ["--device-id", "0", "--distributed-backend", "gloo"]
    procs = []
    for rank in range(2):
        cmd = [venv_bin("fairseq-train"), *map(str, argv(values)), *COMMON, "--save-dir", str(tmp_path / "ckpt"),
               "--max-update", "10", *precision, *device, "--ddp-backend", "pytorch_ddp",
               "--distributed-world-size", "2", "--distributed-rank", str(rank), "--distributed-no-spawn",
               "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--disable-validation"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                                      cwd=REPO))
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-6000:]
    check_run(logs[0], tmp_path / "ckpt", min_updates=10)
