"""The ``sentence_vae`` task and criterion and the tools ``vae-eval`` and ``vae-generate``
(``user_dir.tools.sentence_vae.evaluate`` / ``.generate``), with the TEST DOUBLE model ``test_gru_vae``
(``tests/sentence_vae_toy_model/``), so that nothing here depends on the real models.

Data: 240 short English phrases from the English side of Debian's trans-de-en dictionary
(``/usr/share/trans/de-en``: ``German :: English``, first alternative before ``|``/``;``,
annotations in brackets dropped, lower-cased), 200 for training and 40 for valid and test; if
that file is absent, 240 sentences of a small seeded grammar. Binarized with fairseq's own
``fairseq-preprocess --only-source`` (its ``main``). ``fairseq-train`` runs as a subprocess with
the test double's package as ``--user-dir`` (it imports the plugin ``user_dir`` itself);
``fairseq-validate`` and the two tools run in-process through their own entry points.
"""

import json
import logging
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.logging import metrics

import sentence_vae_toy_model  # noqa: F401  (registers test_gru_vae)
from conftest import REPO, english_phrases, venv_bin
from pipelines.data.preprocess import fairseq_preprocess
from user_dir.sentence_vae import decoding
from user_dir.tools.sentence_vae import evaluate, generate
from user_dir.sentence_vae.checkpoint import load_sentence_vae
from latent_core.errors import PluginConfigError
from user_dir.sentence_vae.criterion import SentenceVAECriterion
from latent_core.vae import DiagonalGaussian, VAEConfigError

TOY_USER_DIR = Path(sentence_vae_toy_model.__file__).resolve().parent  # fairseq --user-dir of the test double

DE_EN = Path("/usr/share/trans/de-en")
LATENTS = ("z_syn", "z_sem")  # the test double's default latents
SCHEDULE = "linear:0:40:1.0"  # beta = t / 40
MAX_UPDATE_1, MAX_UPDATE_2 = 12, 40


# --------------------------------------------------------------------------- data
def grammar_sentences(n: int, seed: int = 0):
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the old man", "a child", "the teacher"]
    verbs = ["sees", "likes", "finds", "carries", "follows", "paints"]
    objects = ["the ball", "a red house", "the river", "an apple", "the small boat", "a letter"]
    tails = ["", "today", "in the garden", "every morning", "near the station"]
    return [" ".join(filter(None, [rng.choice(subjects), rng.choice(verbs), rng.choice(objects), rng.choice(tails)]))
            for _ in range(n)]


def binarize_splits(destdir: Path, **splits):
    """fairseq-preprocess --only-source of ``splits`` (split name -> text file) into ``destdir``."""
    args = ["--only-source", "--destdir", destdir, "--workers", "1"]
    for split, path in splits.items():
        args += [f"--{split}pref", path]
    fairseq_preprocess(args, AssertionError)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("sentence_vae")
    lines = english_phrases(240) if DE_EN.is_file() else grammar_sentences(240)
    assert len(lines) == 240
    (root / "train.txt").write_text("\n".join(lines[:200]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[200:]) + "\n")
    binarize_splits(root / "bin", train=root / "train.txt", valid=root / "valid.txt", test=root / "valid.txt")
    return root


# -------------------------------------------------------------- subprocess runners
def fairseq_train(*args):
    """fairseq-train's console script in a subprocess; ``args`` name the test double's package as
    ``--user-dir`` (:func:`train_args` with ``user_dir=TOY_USER_DIR``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([venv_bin("fairseq-train"), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"fairseq-train failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc.stdout + proc.stderr


def run_command(entry_point, *args):
    """A console command's entry point (``vae-eval``: ``evaluate.cli_main``, ...) on ``args``, in this process."""
    entry_point([str(a) for a in args])


def train_args(data, save_dir, max_update, *extra, user_dir="user_dir"):
    return [data, "--user-dir", user_dir, "--task", "sentence_vae", "--criterion", "sentence_vae",
            "--arch", "test_gru_vae", "--optimizer", "adam", "--lr", "0.003", "--batch-size", "16",
            "--max-update", max_update, "--beta-schedule", SCHEDULE, "--log-interval", "1",
            "--log-format", "json", "--save-dir", save_dir, "--no-epoch-checkpoints", "--cpu",
            "--num-workers", "0", "--seed", "1", *extra]


def json_records(output: str, tag: str):
    """The ``--log-format json`` records of logger ``tag`` in fairseq-train's output
    (``DATE TIME | INFO | train_inner | {...}``)."""
    marker = f" | INFO | {tag} | "
    return [json.loads(line.split(marker, 1)[1]) for line in output.splitlines() if f"{marker}{{" in line]


@pytest.fixture(scope="module")
def trained(corpus):
    """Train 12 updates, stop, resume to 40: (checkpoint, train_inner records, valid records)."""
    save = corpus / "ckpt"
    out = fairseq_train(*train_args(corpus / "bin", save, MAX_UPDATE_1, user_dir=TOY_USER_DIR))
    out += fairseq_train(*train_args(corpus / "bin", save, MAX_UPDATE_2, user_dir=TOY_USER_DIR))
    return save / "checkpoint_last.pt", json_records(out, "train_inner"), json_records(out, "valid")


# -------------------------------------------------------------- in-process builders
def build(data, *extra, arch_args=()):
    argv = [str(data), "--task", "sentence_vae", "--criterion", "sentence_vae", "--arch", "test_gru_vae",
            "--optimizer", "adam", "--lr", "0.001", *arch_args, *extra]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return task, model, criterion, cfg


def first_batch(task, split="valid", size=4):
    task.load_dataset(split)
    dataset = task.dataset(split)
    return dataset.collater([dataset[i] for i in range(size)])


def kl_per_dim(mean, logvar):  # 0.5 (mu^2 + sigma^2 - log sigma^2 - 1), by hand
    return 0.5 * (mean ** 2 + math.exp(logvar) - logvar - 1.0)


# ================================================================== task and data
def test_task_pairs_sentence_with_itself(corpus):
    task, _, _, _ = build(corpus / "bin")
    task.load_dataset("valid")
    dataset, d = task.dataset("valid"), task.source_dictionary
    lines = (corpus / "valid.txt").read_text().splitlines()
    sample = dataset.collater([dataset[0], dataset[1]])
    for row, index in enumerate(sample["id"].tolist()):
        words = lines[index].split()
        length = len(words) + 1
        src = sample["net_input"]["src_tokens"][row]
        assert src[:length].tolist() == d.encode_line(lines[index], add_if_not_exist=False).tolist()  # words + EOS
        assert src[length:].eq(d.pad()).all()  # right padding
        assert sample["target"][row, :length].tolist() == src[:length].tolist()
        prev = sample["net_input"]["prev_output_tokens"][row, :length].tolist()
        assert prev == [d.eos()] + src[:length - 1].tolist()
    assert sample["ntokens"] == sum(len(lines[i].split()) + 1 for i in sample["id"].tolist())


QKVAE_TINY_ARGS = ["--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
                   "--decoder-ffn-embed-dim", "64", "--encoder-layers", "2", "--decoder-layers", "2",
                   "--posterior-layers", "2", "--syn-latent-dim", "8", "--num-latent-slots", "4",
                   "--slot-latent-dim", "4"]


@pytest.mark.parametrize("arch, extra, start", [
    ("test_gru_vae", [], "eos"), ("test_gru_vae", ["--decoder-start", "bos"], "bos"),
    ("qkvae_small", [], "bos"),  # the authors reading: <s>, as their qkv_train.py
    ("qkvae_small", ["--qkvae-reading", "paper"], "eos"), ("qkvae_small", ["--decoder-start", "eos"], "eos"),
])
def test_decoder_start_in_training_and_generation(corpus, arch, extra, start):
    arch_args = ["--arch", arch, *(QKVAE_TINY_ARGS if arch.startswith("qkvae") else [])]
    task, model, _, _ = build(corpus / "bin", *extra, arch_args=arch_args)
    d = task.target_dictionary
    expected = d.bos() if start == "bos" else d.eos()
    sample = first_batch(task)
    prev, target = sample["net_input"]["prev_output_tokens"], sample["target"]
    words = target[:, :-1].ne(d.pad()) & target[:, :-1].ne(d.eos())
    assert prev[:, 0].eq(expected).all() and torch.equal(prev[:, 1:][words], target[:, :-1][words])
    calls = {}

    class Generator:
        def generate(self, models, sample, **kwargs):
            calls.update(kwargs)
            return []

    task.inference_step(Generator(), [model], sample)
    assert calls["bos_token"] == expected


def test_unknown_decoder_start_is_refused(corpus):
    with pytest.raises(PluginConfigError, match="--decoder-start='sos': choose from auto, bos, eos"):
        build(corpus / "bin", "--decoder-start", "sos")


def test_missing_or_empty_split_and_dictionary_are_named(corpus, tmp_path):
    task, _, _, _ = build(corpus / "bin")
    with pytest.raises(FileNotFoundError, match=re.escape(str(corpus / "bin" / "nosuch.bin"))):
        task.load_dataset("nosuch")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "some.txt").write_text("a b c\n")
    binarize_splits(tmp_path / "bin", train=tmp_path / "some.txt", valid=tmp_path / "empty.txt")
    task, _, _, _ = build(tmp_path / "bin")
    with pytest.raises(ValueError, match=r"valid\.bin holds no sentences"):
        task.load_dataset("valid")
    (tmp_path / "nodict").mkdir()
    with pytest.raises(FileNotFoundError, match="fairseq-preprocess --only-source"):
        build(tmp_path / "nodict")


# ====================================================================== criterion
def fixed_posteriors(model, means, logvars):
    """Make the test double's encoder return the given [B, D] parameters (one per latent)."""
    def posterior_parameters(src_tokens, src_lengths):
        return ({k: torch.tensor(v, dtype=torch.float) for k, v in means.items()},
                {k: torch.tensor(v, dtype=torch.float) for k, v in logvars.items()})
    model.encoder.posterior_parameters = posterior_parameters


@pytest.mark.parametrize("num_updates, beta_syn, beta_sem", [(15, 0.0, 0.3), (40, 0.15, 0.6), (60, 0.3, 0.6)])
def test_kl_terms_and_betas_by_hand(corpus, num_updates, beta_syn, beta_sem):
    task, model, criterion, _ = build(
        corpus / "bin", "--beta-schedule", "z_sem=linear:10:20:0.6,z_syn=linear:30:50:0.3",
        "--kl-variant", "free_bits", "--kl-threshold", "z_syn=0.1,z_sem=0.05",
        arch_args=("--toy-latents", "z_syn:2,z_sem:3"))
    sample = first_batch(task, size=2)
    means = {"z_syn": [[1.0, 0.0], [0.2, -2.0]], "z_sem": [[0.0, 0.0, 0.1], [1.0, -1.0, 0.0]]}
    logvars = {"z_syn": [[0.0, 0.0], [math.log(2.0), 0.0]], "z_sem": [[0.0, 0.0, 0.0], [0.0, -1.0, 0.5]]}
    fixed_posteriors(model, means, logvars)
    model.set_num_updates(num_updates)  # fairseq's channel: task.train_step / checkpoint loading
    model.eval()
    loss, sample_size, log = criterion(model, sample)
    lam = {"z_syn": 0.1, "z_sem": 0.05}
    betas = {"z_syn": beta_syn, "z_sem": beta_sem}
    expected_loss = float(log["nll_loss"])  # no label smoothing: reconstruction term = NLL
    for name in ("z_syn", "z_sem"):
        kl = [[kl_per_dim(m, v) for m, v in zip(mr, vr)] for mr, vr in zip(means[name], logvars[name])]
        assert float(log[f"kl_{name}"]) == pytest.approx(sum(map(sum, kl)), rel=1e-5)
        penalty = sum(max(lam[name], k) for row in kl for k in row)  # free bits per dim and example
        assert float(log[f"kl_penalty_{name}"]) == pytest.approx(penalty, rel=1e-5)
        assert log[f"beta_{name}"] / log["nsentences"] == pytest.approx(betas[name])
        expected_loss += betas[name] * penalty
    assert float(loss) == pytest.approx(expected_loss, rel=1e-5)
    assert sample_size == sample["ntokens"]  # fairseq's token convention


def test_sentence_avg_cyclical_default_length_and_hinge(corpus):
    task, model, criterion, _ = build(corpus / "bin", "--beta-schedule", "cyclical:2:0.5:0.25:0.25",
                                      "--max-update", "100", "--sentence-avg", "--kl-variant", "hinge",
                                      "--kl-threshold", "0.2", arch_args=("--toy-latents", "z:2"))
    # period 50; update 30 is at phase 0.6 of the first cycle -> beta = (0.6 - 0.5) / 0.25
    assert criterion.betas(30) == {"z": pytest.approx(0.4)}
    sample = first_batch(task, size=2)
    fixed_posteriors(model, {"z": [[1.0, 0.1], [0.0, 0.0]]}, {"z": [[0.0, 0.0], [0.0, 0.0]]})
    model.set_num_updates(30)
    model.eval()
    loss, sample_size, log = criterion(model, sample)
    assert sample_size == 2
    assert float(log["kl_penalty_z"]) == pytest.approx(kl_per_dim(1.0, 0.0))  # 0.005 and 0s masked
    assert float(loss) == pytest.approx(float(log["nll_loss"]) + 0.4 * kl_per_dim(1.0, 0.0), rel=1e-5)


def test_a_model_asking_for_sentence_averages_gets_them(corpus):
    """QKVAE's authors reading sets ``sentence_average_loss``: sentences, not tokens, without --sentence-avg."""
    task, model, criterion, _ = build(corpus / "bin", arch_args=("--toy-latents", "z:2"))
    sample = first_batch(task, size=3)
    model.eval()
    assert criterion(model, sample)[1] == sample["ntokens"]
    model.sentence_average_loss = True
    assert criterion(model, sample)[1] == 3


def test_optimizer_state_is_reset_when_the_ae_phase_ends(corpus):
    """A model with ``reset_optimizer_after_ae`` (QKVAE's authors reading) starts the KL phase
    with a fresh optimizer state, as their re-created Adafactor; other updates keep it."""
    from fairseq.optim import build_optimizer

    task, model, criterion, cfg = build(corpus / "bin", "--ae-steps", "2", arch_args=("--toy-latents", "z:2"))
    model.reset_optimizer_after_ae = True
    optimizer = build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])
    sample = first_batch(task, "train", size=4)
    model.train()
    steps = []
    for update in range(4):
        optimizer.zero_grad()
        task.train_step(sample, model, criterion, optimizer, update)
        optimizer.step()
        steps.append(max(int(state["step"]) for state in optimizer.optimizer.state.values()))
    assert steps == [1, 2, 1, 2]
    model.reset_optimizer_after_ae = False
    task.train_step(sample, model, criterion, optimizer, 2)
    assert optimizer.optimizer.state  # kept


TINY_TRANSFORMER = ("--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
                    "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2")
DDP_MODELS = {
    "qkvae-authors": ("--arch", "qkvae_small", "--qkvae-reading", "authors", "--syn-latent-dim", "8",
                      "--slot-latent-dim", "4", *TINY_TRANSFORMER),
    "qkvae-paper": ("--arch", "qkvae_small", "--qkvae-reading", "paper", "--syn-latent-dim", "8",
                    "--slot-latent-dim", "4", *TINY_TRANSFORMER),
    "advae": ("--arch", "advae_small", "--slot-latent-dim", "4", *TINY_TRANSFORMER),
    "optimus": ("--arch", "optimus_small", "--latent-dim", "8", "--encoder-embed-dim", "32", "--decoder-embed-dim",
                "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--encoder-ffn-embed-dim",
                "64", "--decoder-ffn-embed-dim", "64"),
}


@pytest.mark.parametrize("num_updates", [10, 75, 400])  # auto-encoding (beta 0), annealing, constant
@pytest.mark.parametrize("name", sorted(DDP_MODELS))
def test_every_trained_parameter_gets_a_gradient_for_ddp(corpus, name, num_updates):
    """fairseq's GPU DDP runs with find_unused_parameters off: in every phase of the beta schedule
    (KL switched off, annealed, constant) every trained parameter gets a gradient from the loss."""
    task, model, criterion, _ = build(corpus / "bin", "--beta-schedule", "linear:50:100:0.6", "--ae-steps", "50",
                                      arch_args=DDP_MODELS[name])
    model.set_num_updates(num_updates)
    model.train()
    loss, _, log = criterion(model, first_batch(task, "train", size=6))
    betas = [float(log[k]) for k in log if k.startswith("beta_")]
    assert betas and all((beta == 0.0) == (num_updates < 50) for beta in betas)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing


def reduced(logging_outputs):
    with metrics.aggregate(new_root=True) as agg:
        SentenceVAECriterion.reduce_metrics(logging_outputs)
        return agg.get_smoothed_values()


def test_logging_outputs_sum_over_half_batches(corpus, monkeypatch):
    task, model, criterion, _ = build(corpus / "bin", "--beta-schedule", "z_syn=constant:0.5,z_sem=linear:0:10:1")
    monkeypatch.setattr(DiagonalGaussian, "rsample", lambda self, num_samples=None, generator=None: self.mean)
    assert SentenceVAECriterion.logging_outputs_can_be_summed()
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    items = [dataset[i] for i in range(6)]
    model.set_num_updates(4)
    model.eval()
    _, full_size, full = criterion(model, dataset.collater(items))
    halves = [criterion(model, dataset.collater(part)) for part in (items[:3], items[3:])]
    assert sum(h[1] for h in halves) == full_size
    for key, value in full.items():
        assert sum(float(h[2][key]) for h in halves) == pytest.approx(float(value), rel=1e-4, abs=1e-5), key
    whole, split = reduced([full]), reduced([h[2] for h in halves])
    assert set(whole) >= {"loss", "nll_loss", "rec", "kl", "elbo", "ppl", "kl_z_syn", "kl_penalty_z_sem",
                          "beta_z_syn", "beta_z_sem"}
    for key in whole:
        assert split[key] == pytest.approx(whole[key], rel=1e-3, abs=1e-3), key
    assert whole["beta_z_syn"] == 0.5 and whole["beta_z_sem"] == pytest.approx(0.4)
    assert whole["ppl"] == pytest.approx(math.exp(-whole["elbo"] * full["nsentences"] / full["ntokens"]), rel=1e-2)


def test_nan_kl_stops_training_naming_the_latent(corpus, tmp_path):
    from fairseq.trainer import Trainer

    task, model, criterion, cfg = build(corpus / "bin", "--save-dir", str(tmp_path), "--cpu")
    original = model.encoder.posterior_parameters

    def nan_sem(src_tokens, src_lengths):
        means, logvars = original(src_tokens, src_lengths)
        means["z_sem"] = means["z_sem"] * float("nan")
        return means, logvars

    model.encoder.posterior_parameters = nan_sem
    trainer = Trainer(cfg, task, model, criterion)
    with pytest.raises(FloatingPointError, match=r"KL of latent z_sem is nan at update 0"):
        trainer.train_step([first_batch(task)])


@pytest.mark.parametrize("option, value, message", [
    ("--beta-schedule", "sigmoid:1", r"--beta-schedule 'sigmoid:1': unknown schedule 'sigmoid'"),
    ("--beta-schedule", "constant:-0.5", r"--beta-schedule 'constant:-0.5'.*>= 0"),
    ("--beta-schedule", "linear:100:50:1", r"--beta-schedule 'linear:100:50:1': end=50 must be > start=100"),
    ("--beta-schedule", "z_bogus=constant:1", r"--beta-schedule: unknown latent 'z_bogus'"),
    ("--kl-threshold", "-0.1", r"--kl-threshold '-0.1': lambda=-0.1 must be a finite number >= 0"),
    ("--kl-threshold", "z_syn=0.05", r"--kl-threshold: no threshold for latent\(s\) z_sem"),
    ("--kl-threshold", "z_syn=x", r"--kl-threshold 'z_syn=x': 'x' is not a number"),
])
def test_bad_options_fail_at_startup(corpus, option, value, message):
    with pytest.raises(VAEConfigError, match=message):
        build(corpus / "bin", option, value)


def test_bad_schedule_stops_fairseq_train_before_training(corpus, tmp_path, monkeypatch, restore_logging):
    """fairseq-train's own entry point, in-process: the error surfaces at start-up."""
    from fairseq_cli import train

    argv = train_args(corpus / "bin", tmp_path, 5)
    argv[argv.index("--beta-schedule") + 1] = "linear:5:5:1"
    monkeypatch.setattr(sys, "argv", ["fairseq-train", *map(str, argv)])
    with pytest.raises(VAEConfigError, match=r"--beta-schedule 'linear:5:5:1': end=5 must be > start=5"):
        train.cli_main()
    assert not list(tmp_path.glob("*.pt"))


# ======================================================= fairseq-train / validate
def test_training_lowers_the_loss_and_resume_continues_the_schedule(trained):
    _, train, valid = trained
    updates = [int(r["num_updates"]) for r in train]
    assert updates == list(range(1, MAX_UPDATE_2 + 1))  # phase 2 went on from update 13
    for record in train:  # the forward of update t sees t - 1 completed updates
        t = int(record["num_updates"])
        for name in LATENTS:
            assert float(record[f"beta_{name}"]) == pytest.approx((t - 1) / 40, abs=1e-5)
    for record in valid:  # validation after t updates: beta(t), as fairseq-validate on that checkpoint
        for name in LATENTS:
            assert float(record[f"valid_beta_{name}"]) == pytest.approx(int(record["valid_num_updates"]) / 40)
    first = sum(float(r["loss"]) for r in train[:3]) / 3
    last = sum(float(r["loss"]) for r in train[-5:]) / 5
    assert last < first - 0.8, (first, last)
    assert float(valid[-1]["valid_rec"]) < float(train[0]["rec"])


@pytest.fixture
def restore_logging():
    """fairseq's command-line mains replace the root logger's handlers (``reset_logging``)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_fairseq_validate(trained, corpus, monkeypatch, capsys, restore_logging):
    """fairseq-validate's own entry point (in-process) on the checkpoint of update 40."""
    from fairseq_cli import validate

    monkeypatch.setattr(sys, "argv", ["fairseq-validate", str(corpus / "bin"), "--user-dir", "user_dir",
                                      "--task", "sentence_vae", "--path", str(trained[0]), "--valid-subset", "test",
                                      "--batch-size", "16", "--cpu", "--log-format", "json"])
    validate.cli_main()
    line = next(l for l in capsys.readouterr().out.splitlines() if '"test_loss"' in l)
    values = {k: float(v) for k, v in json.loads(line[line.index("{"):]).items()}
    assert values["test_beta_z_syn"] == 1.0 and values["test_beta_z_sem"] == 1.0  # schedule at update 40
    assert values["test_rec"] > 0 and values["test_kl"] >= 0 and values["test_ppl"] > 1
    assert values["test_elbo"] < 0


# ============================================================================ eval
def test_evaluate_and_generate_do_not_import_each_other():
    """Both tools share .checkpoint (loading) and .decoding (LatentDecoder); no import cycle."""
    import ast
    import inspect

    for module, other in ((evaluate, "generate"), (generate, "evaluate")):
        names = set()
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ImportFrom):
                names |= {node.module or ""} | {f"{node.module or ''}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        assert not [n for n in names if n.split(".")[-1] == other], (module.__name__, sorted(names))


def test_vae_eval_command(trained, corpus, tmp_path):
    checkpoint = trained[0]
    out = tmp_path / "eval.json"
    run_command(evaluate.cli_main, "--path", checkpoint, corpus / "bin", "--subset", "test", "--k", "24",
                "--chunk-size", "5", "--batch-size", "16", "--json", out, "--cpu")
    result = json.loads(out.read_text())
    for key in ("iw_ppl", "elbo_ppl", "kl", "mi", "au", "rec", "nll", "iw_seconds_per_sentence"):
        assert key in result, key
    for name in LATENTS:
        for metric in ("kl", "mi", "au"):
            assert f"{metric}_{name}" in result
    assert result["num_sentences"] == 40
    assert result["num_tokens"] == sum(len(l.split()) + 1 for l in (corpus / "valid.txt").read_text().splitlines())
    assert result["iw_ppl"] <= result["elbo_ppl"]  # L_k >= ELBO on average
    assert result["kl"] == pytest.approx(sum(result[f"kl_{n}"] for n in LATENTS))
    assert result["au"] == sum(result[f"au_{n}"] for n in LATENTS)
    assert result["elbo"] == pytest.approx(-result["rec"] - result["kl"])
    assert result["elbo_ppl"] == pytest.approx(math.exp(-result["elbo"] * 40 / result["num_tokens"]), rel=1e-6)
    # every estimate says what it is, how many samples it rests on, and how uncertain it is
    assert result["iw_ppl_ci95_low"] < result["iw_ppl"] < result["iw_ppl_ci95_high"]
    assert result["nll_se"] > 0 and result["kl_se"] >= 0 and result["mi_se"] >= 0
    assert result["mi_max_log_n"] == pytest.approx(math.log(40))
    for name in LATENTS:  # no MI estimate can exceed its latent's average KL by more than its noise
        assert result[f"mi_{name}"] <= result[f"kl_{name}"] + 3 * result[f"mi_se_{name}"] + 1e-9
        assert result[f"mi_{name}"] <= math.log(40) + 1e-9
    assert "k=24" in result["estimators"]["iw_ppl"] and "N=40" in result["estimators"]["mi"]
    # the papers' unit: the start token counted too (QKVAE's get_perplexity, Optimus' calc_iwnll)
    for key in ("ppl_qkvae_units", "ppl_optimus_units"):
        assert math.log(result[key]) * (result["num_tokens"] + 40) == pytest.approx(
            math.log(result["iw_ppl"]) * result["num_tokens"], rel=1e-9)
        assert "k=24" in result["estimators"][key]

    again = evaluate.main(["--path", str(checkpoint), str(corpus / "bin"), "--subset", "test", "--k", "24",
                           "--chunk-size", "24", "--batch-size", "16", "--cpu"])
    assert again["iw_ppl"] == pytest.approx(result["iw_ppl"], rel=1e-4)  # same noise, other chunking
    assert again["elbo_ppl"] == pytest.approx(result["elbo_ppl"], rel=1e-4)
    assert again["rec_bleu"] == pytest.approx(result["rec_bleu"])  # greedy decoding is deterministic


def test_reconstruction_bleu_scores_greedy_reconstructions(trained, corpus):
    """rec_bleu == sacrebleu of LatentDecoder.reconstruct on the same sentences, in any order."""
    import sacrebleu

    model, task, _ = load_sentence_vae(str(trained[0]), cpu=True)
    result = evaluate.evaluate_split(model, task, "test", k=2, chunk_size=2, batch_size=7)
    sentences = (corpus / "valid.txt").read_text().splitlines()
    decoder = decoding.LatentDecoder(model, task, decoding.generation_args(beam=1), batch_size=5)
    expected = sacrebleu.corpus_bleu(decoder.reconstruct(sentences), [sentences], tokenize="none").score
    assert result["rec_bleu"] == pytest.approx(expected)
    assert "rec_bleu" not in evaluate.evaluate_split(model, task, "test", k=2, chunk_size=2, bleu=False)


def test_iw_scores_the_expanded_batch_like_single_samples(trained, corpus):
    """The [n * B] decoder pass equals scoring each sample separately."""
    model, task, _ = load_sentence_vae(str(trained[0]), cpu=True)
    sample = first_batch(task, "test", size=3)
    net_input = dict(sample["net_input"])
    prev = net_input.pop("prev_output_tokens")
    encoder_out = model.encoder(**net_input)
    fn = evaluate.log_likelihood_fn(model, encoder_out, prev, sample["target"], task.target_dictionary.pad())
    z = {name: torch.randn(4, 3, size) for name, size in model.latent_sizes.items()}
    with torch.no_grad():
        batched = fn(z)
        single = torch.stack([fn({name: v[i:i + 1] for name, v in z.items()})[0] for i in range(4)])
    assert batched.shape == (4, 3)
    assert torch.allclose(batched, single, atol=1e-4)


# ======================================================================= generate
def gen(checkpoint, *args, stdin=None, monkeypatch=None):
    if stdin is not None:
        import io
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    return generate.main([args[0], "--path", str(checkpoint), "--cpu", *args[1:]], out=open(os.devnull, "w"))


@pytest.mark.parametrize("strategy", [[], ["--beam", "3"], ["--sampling-topk", "5"], ["--sampling-topp", "0.9"]])
def test_vae_generate_subcommands(trained, corpus, strategy, monkeypatch):
    checkpoint = trained[0]
    lines = (corpus / "valid.txt").read_text().splitlines()
    a, b, c = lines[:3]
    assert len(gen(checkpoint, "reconstruct", *strategy, stdin="\n".join(lines[:5]) + "\n",
                   monkeypatch=monkeypatch)) == 5
    assert len(gen(checkpoint, "sample", "--num", "4", *strategy)) == 4
    interpolation = gen(checkpoint, "interpolate", a, b, "--steps", "5", *strategy)
    assert [l.split("\t")[0] for l in interpolation] == ["0.00", "0.25", "0.50", "0.75", "1.00"]
    assert len(gen(checkpoint, "analogy", a, b, c, *strategy)) == 1
    assert len(gen(checkpoint, "transfer", "--latent", "z_syn", a, b, *strategy)) == 1


def test_latent_paths_agree_under_greedy_decoding(trained, corpus):
    """Latents passed through net_input decode like the sentence itself (greedy is deterministic)."""
    model, task, _ = load_sentence_vae(str(trained[0]), cpu=True)
    decoder = decoding.LatentDecoder(model, task, decoding.generation_args())
    a, b, c = (corpus / "valid.txt").read_text().splitlines()[:3]
    rec = decoder.reconstruct([a, b, c])
    assert decoder.decode(decoder.encode([a, b, c])) == rec
    za, zb, zc = decoder.one(a), decoder.one(b), decoder.one(c)
    taus, z = generate.interpolate_latents(za, zb, 3)
    ends = decoder.decode({n: v[[0, 2]] for n, v in z.items()})
    assert taus == [0.0, 0.5, 1.0] and ends == [rec[0], rec[1]]
    assert torch.allclose(z["z_syn"][1], (za["z_syn"] + zb["z_syn"]) / 2)
    d = generate.analogy_latents(za, zb, zc)
    assert torch.allclose(d["z_sem"], zb["z_sem"] - za["z_sem"] + zc["z_sem"])
    same = generate.analogy_latents(za, za, zc)
    assert decoder.decode({n: v.unsqueeze(0) for n, v in same.items()}) == [rec[2]]
    swapped = generate.transfer_latents(za, zb, ["z_syn"])
    assert torch.equal(swapped["z_syn"], zb["z_syn"]) and torch.equal(swapped["z_sem"], za["z_sem"])
    everything = generate.transfer_latents(za, zb, list(LATENTS))
    assert decoder.decode({n: v.unsqueeze(0) for n, v in everything.items()}) == [rec[1]]
    with pytest.raises(VAEConfigError, match="--latent z_style: the model's latents are z_syn, z_sem"):
        generate.transfer_latents(za, zb, ["z_style"])
    beam = decoding.LatentDecoder(model, task, decoding.generation_args(beam=4))
    assert len(beam.decode(decoder.prior_samples(3, torch.Generator().manual_seed(0)))) == 3


def test_vae_generate_command(trained, capsys):
    run_command(generate.cli_main, "interpolate", "--path", trained[0], "--cpu", "the nuts and bolts",
                "rate of mining advance", "--steps", "3", "--beam", "2")
    assert [l.split("\t")[0] for l in capsys.readouterr().out.splitlines()] == ["0.00", "0.50", "1.00"]
    with pytest.raises(SystemExit) as exit_info:
        run_command(generate.cli_main, "transfer", "--path", trained[0], "--cpu", "--latent", "z_x",
                    "a b", "c d")
    assert exit_info.value.code == 2
    assert "--latent z_x: the model's latents are z_syn, z_sem" in capsys.readouterr().err


def test_the_kl_threshold_has_one_default_and_one_validator():
    from latent_core.vae.kl import DEFAULT_KL_THRESHOLD, KLRegularizer, check_threshold
    from user_dir.sentence_vae.criterion import SentenceVAECriterionConfig

    assert float(SentenceVAECriterionConfig().kl_threshold) == KLRegularizer().threshold == DEFAULT_KL_THRESHOLD
    for bad in (-0.1, float("nan"), float("inf"), True):
        with pytest.raises(VAEConfigError, match="must be a finite number >= 0"):
            check_threshold(bad)
        with pytest.raises(VAEConfigError, match="must be a finite number >= 0"):
            KLRegularizer(threshold=bad)
