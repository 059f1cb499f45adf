"""Resume is bit-identical: N updates in one run == M updates, stop, resume to N.

For each training stack of the plugin, on CPU, through the real command-line tools and with
dropout (and SDMA's sampling noise) ON, the checkpoint of the continuous run and that of the
resumed run must hold exactly (``torch.equal``) the same model parameters and buffers (the
SDMA mixing weight is a buffer), the same optimizer state and learning-rate schedule, and the
same update counter; the logged training statistics after the resume point (the VAE's beta
schedule values, losses) must be equal too.

* (a) SDMA translation (fairseq's ``translation`` task, ``sdma_transformer_iwslt_de_en_tiny``
  shrunk to one layer, 400 Ding dictionary pairs): 60 == 40 + 20, resumed from the mid-epoch
  checkpoint that ``--max-update 40`` writes;
* (a') fairseq's own ``--arch transformer`` with the plugin loaded: a continuous run equals the same
  run without the plugin, and resumes exactly;
* (b) sentence VAE (``sentence_vae`` task, ``qkvae_small`` shrunk, a linear KL schedule
  active throughout, 200 English phrases): 60 == 40 + 20;
* (c) ``hf_sentence_prediction`` (MRPC layout, a tiny random BERT): 60 == 40 + 20;
* (d) ESPnet SDMA ASR (``SDMAASRTask``, synthetic Mandarin speech): 2 epochs == 1 epoch +
  ``--resume true`` to 2 (ESPnet resumes at epoch boundaries only). This one held before the
  fix too (ESPnet reseeds everything per epoch); it guards the update counter ``num_updates``
  and its optimizer hook.

The fix for (a)-(c) is described in ``user_dir/exact_resume.py``. Checkpoints are read with
``torch.load(weights_only=True)`` (``import user_dir`` allow-lists fairseq's extra types).
"""

import datetime
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_checked, save_tiny_bert, venv_bin
from latent_core.sdma import mixing_weight

DE_EN = Path("/usr/share/trans/de-en")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
needs_ding = pytest.mark.skipif(not DE_EN.is_file(), reason="apt-get install trans-de-en (make install does)")
N_UPDATES, M_UPDATES = 60, 40


def run(cmd, timeout=600):
    """The command's output (stdout + stderr); AssertionError when it fails."""
    proc = run_checked(cmd, timeout=timeout, env=ENV, cwd=REPO)
    return proc.stdout + proc.stderr


# ------------------------------------------------------------------------ comparison
def flatten(value, prefix=""):
    """{path: leaf} of nested dicts / lists / tuples (tensors and plain values are leaves)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, (list, tuple)):
        out = {}
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def differences(a, b):
    """(number of differing leaves, largest absolute difference of a differing tensor, names)."""
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys(), sorted(set(fa) ^ set(fb))
    differing, largest = [], 0.0
    for key, x in fa.items():
        y = fb[key]
        if isinstance(x, torch.Tensor):
            same = isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
            if not same:
                differing.append(key)
                if isinstance(y, torch.Tensor) and x.shape == y.shape:
                    largest = max(largest, (x.double() - y.double()).abs().max().item())
        elif x != y:
            differing.append(key)
    return len(differing), largest, differing


def assert_identical(a, b, what):
    count, largest, names = differences(a, b)
    assert count == 0, f"{what}: {count} of {len(flatten(a))} entries differ (max abs diff {largest:.3g}): {names[:5]}"


def train_inner(log):
    """The per-update records of fairseq's json log (``--log-format json --log-interval 1``)."""
    out = {}
    for line in log.splitlines():
        match = re.search(r"\| train_inner \| (\{.*\})$", line) or re.search(r"train_inner:(\{.*\})$", line)
        if match:
            record = json.loads(match.group(1))
            out[int(record["num_updates"])] = record
    return out


STATS_SKIPPED = {"wps", "ups", "wall", "train_wall", "gb_free"}  # speed and wall-clock time


def assert_same_logged_stats(continuous_log, resumed_log, first, last):
    """Every logged statistic of updates first..last (losses, KL terms, betas, gradient norm,
    words and sentences per batch, ...) equal in both runs, except speed and wall-clock fields."""
    a, b = train_inner(continuous_log), train_inner(resumed_log)
    for update in range(first, last + 1):
        assert update in a and update in b, f"update {update} not logged"
        keys = set(a[update]) - STATS_SKIPPED
        assert keys == set(b[update]) - STATS_SKIPPED
        assert {k: a[update][k] for k in keys} == {k: b[update][k] for k in keys}, update


def fairseq_resume(train, tmp_path):
    """``train(save_dir, max_update) -> log`` run N updates in one go and M then N in another
    directory; returns (continuous, resumed) checkpoint_last.pt states and their logs."""
    continuous, resumed = tmp_path / "continuous", tmp_path / "resumed"
    log_c = train(continuous, N_UPDATES)
    train(resumed, M_UPDATES)
    first = torch.load(resumed / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert first["optimizer_history"][-1]["num_updates"] == M_UPDATES
    log_r = train(resumed, N_UPDATES)
    assert f"@ {M_UPDATES} updates)" in log_r and "Loaded checkpoint" in log_r, log_r[-2000:]
    a = torch.load(continuous / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    b = torch.load(resumed / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    return a, b, log_c, log_r


def assert_fairseq_states_identical(a, b):
    history_a, history_b = a["optimizer_history"][-1], b["optimizer_history"][-1]
    assert history_a["num_updates"] == history_b["num_updates"] == N_UPDATES
    assert_identical(a["model"], b["model"], "model parameters and buffers")
    assert_identical(a["last_optimizer_state"], b["last_optimizer_state"], "optimizer state")
    assert history_a["lr_scheduler_state"] == history_b["lr_scheduler_state"]
    assert a["extra_state"]["train_iterator"] == b["extra_state"]["train_iterator"]


# ------------------------------------------------------------- (a) SDMA translation
@needs_ding
@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_sdma_translation_resume_is_bit_identical(small_translation_bin, tmp_path, reading):
    def train(save_dir, max_update):
        return run([
            venv_bin("fairseq-train"), small_translation_bin, "--user-dir", REPO / "user_dir",
            "--arch", "sdma_transformer_iwslt_de_en_tiny", "--encoder-layers", "1", "--decoder-layers", "1",
            "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
            "--decoder-ffn-embed-dim", "64", "--dropout", "0.1", "--sdma-noise-var", "0.01",
            "--task", "translation", "--criterion", "sdma_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--optimizer", "adam", "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
            "--max-tokens", "500", "--max-update", max_update, "--max-epoch", "100", "--seed", "1", "--cpu",
            "--no-progress-bar", "--log-format", "json", "--log-interval", "1", "--save-dir", save_dir,
            "--no-epoch-checkpoints", "--num-workers", "0", "--sdma-reading", reading,
        ])

    a, b, log_c, log_r = fairseq_resume(train, tmp_path)
    itr = b["extra_state"]["train_iterator"]
    assert itr["epoch"] >= 2 and itr["iterations_in_epoch"] > 0  # several epochs, a mid-epoch resume
    assert_fairseq_states_identical(a, b)
    mix = [v.item() for k, v in b["model"].items() if k.endswith("mix_weight")]
    assert mix and all(g == pytest.approx(mixing_weight(N_UPDATES - 1), abs=1e-7) for g in mix)
    assert_same_logged_stats(log_c, log_r, M_UPDATES + 1, N_UPDATES)


# ------------------------------------------- (a') fairseq's own transformer under the plugin
@needs_ding
def test_the_plugin_leaves_a_plain_transformer_run_unchanged_and_resumes_it_exactly(small_translation_bin, tmp_path):
    """``--arch transformer`` (nothing of the plugin's) with ``--user-dir user_dir``: the continuous run
    is bit-identical to the same run without the plugin (fairseq's cached epoch-1 batches, reshuffled
    each epoch; fairseq's default data-loader worker), and its resume is exact."""
    def train(save_dir, max_update, plugin=True):
        return run([
            venv_bin("fairseq-train"), small_translation_bin, *(["--user-dir", REPO / "user_dir"] if plugin else []),
            "--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
            "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
            "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
            "--dropout", "0.1", "--task", "translation", "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", "--optimizer", "adam", "--lr", "2e-3", "--max-tokens", "500",
            "--max-update", max_update, "--max-epoch", "100", "--seed", "1", "--cpu", "--no-progress-bar",
            "--log-format", "json", "--log-interval", "1", "--save-dir", save_dir, "--no-epoch-checkpoints",
        ])

    a, b, log_c, log_r = fairseq_resume(train, tmp_path)
    assert b["extra_state"]["train_iterator"]["epoch"] >= 2
    assert_fairseq_states_identical(a, b)
    assert_same_logged_stats(log_c, log_r, M_UPDATES + 1, N_UPDATES)

    log_plain = train(tmp_path / "plain", N_UPDATES, plugin=False)
    plain = torch.load(tmp_path / "plain" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert_identical(plain["model"], a["model"], "plain fairseq vs the same run with the plugin loaded")
    assert_same_logged_stats(log_plain, log_c, 1, N_UPDATES)
    assert log_c.count("creating new batches") == log_plain.count("creating new batches") == 2  # train, valid


# -------------------------------------------------------------------- (b) sentence VAE
@needs_ding
def test_sentence_vae_resume_is_bit_identical(small_vae_bin, tmp_path):
    schedule = "linear:0:100:1.0"  # beta = t / 100: changes at every update of both runs

    def train(save_dir, max_update):
        return run([
            venv_bin("fairseq-train"), small_vae_bin, "--user-dir", REPO / "user_dir", "--task", "sentence_vae",
            "--arch", "qkvae_small", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
            "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
            "--decoder-attention-heads", "4", "--encoder-layers", "1", "--decoder-layers", "1",
            "--posterior-layers", "1", "--syn-latent-dim", "8", "--num-latent-slots", "4", "--slot-latent-dim", "4",
            "--max-source-positions", "64", "--max-target-positions", "64", "--dropout", "0.1",
            "--criterion", "sentence_vae", "--beta-schedule", schedule, "--kl-variant", "free_bits",
            "--kl-threshold", "0.05", "--optimizer", "adam", "--lr", "1e-3", "--batch-size", "16",
            "--max-update", max_update, "--max-epoch", "100", "--seed", "1", "--cpu", "--no-progress-bar",
            "--log-format", "json", "--log-interval", "1", "--save-dir", save_dir, "--no-epoch-checkpoints",
            "--num-workers", "0",
        ])

    a, b, log_c, log_r = fairseq_resume(train, tmp_path)
    assert b["extra_state"]["train_iterator"]["iterations_in_epoch"] > 0  # 13 batches an epoch
    assert_fairseq_states_identical(a, b)
    # the KL schedule's clock: fairseq's update counter, restored from the checkpoint; the
    # logged beta of every latent at every update after the resume point is the same in both
    # runs and is the schedule's value there (the forward of update u sees u - 1 done)
    assert_same_logged_stats(log_c, log_r, M_UPDATES + 1, N_UPDATES)
    records = train_inner(log_r)
    for update in range(M_UPDATES + 1, N_UPDATES + 1):
        betas = {k: v for k, v in records[update].items() if k.startswith("beta_")}
        assert set(betas) == {"beta_z_syn", "beta_z_sem"}
        assert all(float(v) == pytest.approx((update - 1) / 100, abs=1e-3) for v in betas.values()), (update, betas)


# ------------------------------------------------------------------ (c) hf_sentence task
FIRST = ["alpha", "bravo", "charlie"]
OTHER = "red green blue cat dog bird sits runs jumps fast slow high".split()
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + FIRST + OTHER


def write_mrpc(directory, rng, sizes=(("train", 200), ("dev", 30), ("test", 10))):
    """GLUE MRPC layout; label 1 iff both sentences start with the same word."""
    directory.mkdir(parents=True)
    for split, n in sizes:
        lines = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
        for i in range(n):
            a = rng.choice(FIRST)
            same = rng.random() < 0.5
            b = a if same else rng.choice([f for f in FIRST if f != a])
            s1, s2 = " ".join([a] + rng.sample(OTHER, rng.randint(1, 4))), " ".join([b] + rng.sample(OTHER, 2))
            lines.append(f"{int(same)}\t{i}\t{i}\t{s1}\t{s2}")
        (directory / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory


def test_hf_sentence_resume_is_bit_identical(tmp_path):
    tiny = save_tiny_bert(tmp_path / "tiny_bert", WORDS)
    data = write_mrpc(tmp_path / "data", random.Random(3))

    def train(save_dir, max_update):
        return run([
            venv_bin("fairseq-train"), data, "--user-dir", REPO / "user_dir", "--task", "hf_sentence_prediction",
            "--glue-task", "MRPC", "--hf-tokenizer-dir", tiny, "--arch", "hf_sentence_classifier", "--hf-config",
            tiny, "--criterion", "hf_sentence_prediction", "--optimizer", "adam", "--lr", "2e-3",
            "--batch-size", "16", "--max-positions", "32", "--pooler-dropout", "0.1", "--max-update", max_update,
            "--max-epoch", "100", "--seed", "1", "--cpu", "--no-progress-bar", "--log-format", "json",
            "--log-interval", "1", "--save-dir", save_dir, "--no-epoch-checkpoints", "--num-workers", "0",
        ])

    a, b, log_c, log_r = fairseq_resume(train, tmp_path)
    assert b["extra_state"]["train_iterator"]["iterations_in_epoch"] > 0  # 13 batches an epoch
    assert_fairseq_states_identical(a, b)
    assert_same_logged_stats(log_c, log_r, M_UPDATES + 1, N_UPDATES)


# --------------------------------------------------------------------- (d) ESPnet SDMA ASR
RECIPE = REPO / "examples" / "aishell_sdma" / "asr1"
SDMA_CONFIG = "train_asr_sdma_transformer.yaml"  # the synthetic recipe's: paper reading
AUTHORS_CONFIG = "train_asr_sdma_transformer_authors.yaml"


def espnet_available():
    try:
        import espnet2  # noqa: F401
    except ImportError:
        return False
    return shutil.which("espeak-ng") is not None and shutil.which("sox") is not None


@pytest.fixture(scope="module")
def asr_work(tmp_path_factory):
    """Synthetic Mandarin corpus (12 sentences x 2 voices), token list and feature statistics,
    by the recipe driver's own stages; a tiny SDMA config (1 + 1 blocks, d 32) with dropout."""
    import yaml

    root = tmp_path_factory.mktemp("asr_resume")
    conf = root / "conf"
    conf.mkdir()
    for name in (SDMA_CONFIG, "train_asr_transformer.yaml", "decode_asr.yaml"):
        config = yaml.safe_load((RECIPE / "conf" / "synthetic" / name).read_text(encoding="utf-8"))
        if name == SDMA_CONFIG:
            config["encoder_conf"].update(output_size=32, attention_heads=2, linear_units=64, num_blocks=1)
            config["decoder_conf"].update(attention_heads=2, linear_units=64, num_blocks=1)
            config["frontend_conf"]["n_mels"] = 40
            config.update(batch_size=4, keep_nbest_models=1, num_att_plot=0)
            authors = yaml.safe_load(yaml.safe_dump(config))  # the same model in the authors reading
            for side in ("encoder_conf", "decoder_conf"):
                authors[side]["sdma_conf"]["reading"] = "authors"
            for weight in ("sdma_kl_weight", "sdma_dqq_weight", "sdma_dxq_weight", "sdma_diversity_weight"):
                authors["model_conf"].pop(weight, None)  # the authors' config's weights
            (conf / AUTHORS_CONFIG).write_text(yaml.safe_dump(authors), encoding="utf-8")
        (conf / name).write_text(yaml.safe_dump(config), encoding="utf-8")
    work = root / "work"
    run([sys.executable, RECIPE / "run_synthetic.py", "--work-dir", work, "--conf-dir", conf, "--num-sentences", "12",
         "--stop-stage", "stats", "--jobs", "1"], timeout=900)
    return work, conf


def espnet_train(work, conf, out, max_epoch, config=SDMA_CONFIG):
    data, stats = work / "corpus" / "data", work / "stats"
    command = [sys.executable, "-m", "espnet_plugin.bin.asr_train", "--use_preprocessor", "true", "--token_type",
               "char", "--token_list", work / "tokens.txt", "--non_linguistic_symbols", "none", "--cleaner", "none",
               "--g2p", "none", "--ngpu", "0", "--num_workers", "0", "--seed", "0", "--use_tensorboard", "false",
               "--config", conf / config, "--output_dir", out, "--frontend_conf", "fs=16k",
               "--normalize", "global_mvn", "--normalize_conf", f"stats_file={stats / 'train' / 'feats_stats.npz'}",
               "--train_shape_file", stats / "train" / "speech_shape",
               "--train_shape_file", stats / "train" / "text_shape.char",
               "--valid_shape_file", stats / "valid" / "speech_shape",
               "--valid_shape_file", stats / "valid" / "text_shape.char",
               "--fold_length", "80000", "--fold_length", "150", "--resume", "true", "--max_epoch", max_epoch]
    for split, prefix in (("train", "train"), ("dev", "valid")):
        command += [f"--{prefix}_data_path_and_name_and_type", f"{data / split / 'wav.scp'},speech,sound",
                    f"--{prefix}_data_path_and_name_and_type", f"{data / split / 'text'},text,text"]
    return run(command)


def load_espnet_checkpoint(path):
    # checkpoint.pth: the reporter's statistics add numpy scalars (allow-listed by user_dir)
    # and a datetime.timedelta to the tensors
    with torch.serialization.safe_globals([datetime.timedelta]):
        return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.skipif(not espnet_available(), reason="needs espnet2, espeak-ng and sox (make install)")
@pytest.mark.parametrize("config", [SDMA_CONFIG, AUTHORS_CONFIG])
def test_espnet_sdma_asr_resume_is_bit_identical(asr_work, tmp_path, config):
    """Both readings; the authors' counts forward calls (training and validation), the paper's
    optimizer steps: either way the counter and g are restored exactly."""
    import espnet_plugin  # noqa: F401  (the SDMA classes)

    work, conf = asr_work
    continuous, resumed = tmp_path / "continuous", tmp_path / "resumed"
    espnet_train(work, conf, continuous, 2, config)
    espnet_train(work, conf, resumed, 1, config)
    after_one = load_espnet_checkpoint(resumed / "checkpoint.pth")
    log = espnet_train(work, conf, resumed, 2, config)
    assert "The training was resumed using" in log, log[-2000:]
    a = load_espnet_checkpoint(continuous / "checkpoint.pth")
    b = load_espnet_checkpoint(resumed / "checkpoint.pth")
    per_epoch = int(after_one["model"]["num_updates"])
    assert per_epoch > 0 and int(a["model"]["num_updates"]) == int(b["model"]["num_updates"]) == 2 * per_epoch
    assert_identical(a["model"], b["model"], "model parameters and buffers (num_updates, mixing weights)")
    assert_identical(a["optimizers"], b["optimizers"], "optimizer state")
    assert_identical(a["schedulers"], b["schedulers"], "learning-rate scheduler state")
    mix = [v.item() for k, v in b["model"].items() if k.endswith("mix_weight")]
    assert mix and all(g == pytest.approx(mixing_weight(2 * per_epoch), abs=1e-7) for g in mix)  # after the hook
