"""TensorBoard logging through the toolkits' own options: fairseq's
``--tensorboard-logdir`` writes event files with the plugin's loss terms in them.

* (a) an SDMA translation run (``sdma_transformer_iwslt_de_en_tiny`` shrunk to one layer, 400
  Ding dictionary pairs, tiny as in ``test_cli.py``): ``ce_loss``, ``sdma_reg`` and every
  ``sdma_*`` term under ``train_inner/``, ``train/`` and ``valid/``;
* (b) a sentence VAE run (``sentence_vae`` task, ``qkvae_small`` shrunk): the KL terms and the
  beta schedule per latent (``kl_z_syn``, ``beta_z_sem``, ...) under the same three tags.

fairseq writes through ``torch.utils.tensorboard`` (the ``tensorboard`` package; without it it
only warns "tensorboard not found") and imports ``tensorboardX`` for its TTS task (without it
every command logs "Please install tensorboardX"): both are in pyproject.toml. The ESPnet side
(``--use_tensorboard true``) is tested in ``test_espnet_pipeline.py`` on that file's data.
The event files are read back with TensorBoard's own ``EventAccumulator``.
"""

import math
import os
import re
from pathlib import Path

import pytest

from conftest import REPO, run_checked, venv_bin
from latent_core.sdma import LOSS_NAMES

DE_EN = Path("/usr/share/trans/de-en")
pytestmark = pytest.mark.skipif(not DE_EN.is_file(), reason="apt-get install trans-de-en (make install does)")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MISSING_PACKAGE_MESSAGES = ("Please install tensorboardX", "tensorboard not found")
TINY_SDMA = [
    "--arch", "sdma_transformer_iwslt_de_en_tiny",
    "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
]
TINY_QKVAE = [
    "--arch", "qkvae_small", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
    "--decoder-attention-heads", "4", "--encoder-layers", "1", "--decoder-layers", "1",
    "--posterior-layers", "1", "--syn-latent-dim", "8", "--num-latent-slots", "4", "--slot-latent-dim", "4",
    "--max-source-positions", "64", "--max-target-positions", "64",
]
COMMON = ["--optimizer", "adam", "--seed", "1", "--cpu", "--no-progress-bar", "--log-format", "simple",
          "--log-interval", "1", "--num-workers", "0", "--no-save"]
MAX_UPDATE = 6


def run(cmd, timeout=600):
    """The command's output (stdout + stderr); AssertionError when it fails."""
    proc = run_checked(cmd, timeout=timeout, env=ENV, cwd=REPO)
    return proc.stdout + proc.stderr


def read_scalars(logdir: Path):
    """{tag directory: {scalar name: [(step, value), ...]}} of the event files under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    out = {}
    subdirs = sorted(p for p in logdir.iterdir() if p.is_dir())
    assert subdirs, f"no tag directories under {logdir}"
    for sub in subdirs:
        assert list(sub.glob("events.out.tfevents.*")), f"no event file in {sub}"
        acc = EventAccumulator(str(sub), size_guidance={SCALARS: 0})  # 0: keep every event
        acc.Reload()
        out[sub.name] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()[SCALARS]}
    return out


def assert_logged(scalars, names, tags=("train_inner", "train", "valid")):
    assert set(tags) <= set(scalars), sorted(scalars)
    for tag in tags:
        missing = set(names) - set(scalars[tag])
        assert not missing, f"{tag}/: {sorted(missing)} missing from {sorted(scalars[tag])}"
        for name in names:
            assert all(math.isfinite(v) for _, v in scalars[tag][name]), (tag, name, scalars[tag][name])
    # one point per update (--log-interval 1), at fairseq's update counter
    assert [s for s, _ in scalars["train_inner"]["loss"]] == list(range(1, MAX_UPDATE + 1))


def assert_no_missing_package_message(log):
    found = [line for line in log.splitlines() if any(m in line for m in MISSING_PACKAGE_MESSAGES)]
    assert not found, f"install the packages of pyproject.toml (make install); the log says: {found}"


def logged_values(log, tag, name):
    """``name``'s values on the ``| tag |`` lines of fairseq's simple log format."""
    return [float(m) for line in log.splitlines() if f"| {tag} |" in line
            for m in re.findall(rf"\b{name}=([-0-9.e]+)", line)]


# ------------------------------------------------------------------ (a) SDMA translation
def test_fairseq_sdma_run_writes_the_sdma_terms_to_tensorboard(small_translation_bin, tmp_path):
    logdir = tmp_path / "tb"
    log = run([
        venv_bin("fairseq-train"), small_translation_bin, "--user-dir", REPO / "user_dir", *TINY_SDMA,
        "--task", "translation", "--criterion", "sdma_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--lr", "2e-3", "--max-tokens", "500", "--max-update", MAX_UPDATE, "--validate-interval-updates", "3",
        "--save-dir", tmp_path / "ckpt", "--tensorboard-logdir", logdir, *COMMON,
    ])
    assert_no_missing_package_message(log)
    scalars = read_scalars(logdir)
    terms = ["loss", "nll_loss", "ce_loss", "sdma_reg"] + ["sdma_" + name for name in LOSS_NAMES]
    assert_logged(scalars, terms)
    # the event files hold what the text log prints (rounded there)
    for name in ("ce_loss", "sdma_reg", "sdma_kl_z"):
        printed = logged_values(log, "train_inner", name)
        assert len(printed) == MAX_UPDATE
        assert [v for _, v in scalars["train_inner"][name]] == pytest.approx(printed, abs=1e-3), name
    assert len(scalars["valid"]["sdma_reg"]) >= 2  # --validate-interval-updates 3: at updates 3 and 6


# --------------------------------------------------------------------- (b) sentence VAE
def test_fairseq_sentence_vae_run_writes_kl_and_beta_to_tensorboard(small_vae_bin, tmp_path):
    logdir = tmp_path / "tb"
    log = run([
        venv_bin("fairseq-train"), small_vae_bin, "--user-dir", REPO / "user_dir", "--task", "sentence_vae", *TINY_QKVAE,
        "--criterion", "sentence_vae", "--beta-schedule", "linear:0:10:1.0", "--kl-variant", "free_bits",
        "--kl-threshold", "0.05", "--lr", "1e-3", "--batch-size", "16", "--max-update", MAX_UPDATE,
        "--validate-interval-updates", "3", "--save-dir", tmp_path / "ckpt", "--tensorboard-logdir", logdir,
        *COMMON,
    ])
    assert_no_missing_package_message(log)
    scalars = read_scalars(logdir)
    terms = ["loss", "nll_loss", "rec", "kl", "elbo", "ppl"] + [
        f"{kind}_{latent}" for kind in ("kl", "kl_penalty", "beta") for latent in ("z_syn", "z_sem")]
    assert_logged(scalars, terms)
    # beta = t / 10, the forward of update t sees t - 1 updates done
    for latent in ("z_syn", "z_sem"):
        assert scalars["train_inner"][f"beta_{latent}"] == [
            (t, pytest.approx((t - 1) / 10, abs=1e-4)) for t in range(1, MAX_UPDATE + 1)]
