"""The fairseq model ``topic_vq_sts``: stages, tied codebook, ablations, pooling, errors, CLI.

A tiny random BERT (2 layers, hidden 32) and a pair task whose label is whether the two
sentences talk about the same topic (animals or vehicles) with no content word in common,
so that topic information is what the task needs.
"""

import argparse
import json
import os
import random
import re
import subprocess

import pytest
import torch
from fairseq import checkpoint_utils

from conftest import BF16_AUTOCAST, REPO, run_checked, save_tiny_bert, train_under_bf16_autocast, venv_bin
from user_dir.hf_sentence.model import HFSentenceConfigError
from user_dir.hf_sentence.task import HFSentencePredictionConfig, HFSentencePredictionTask
from user_dir.topic_vq.task import TopicSentencePredictionConfig, TopicSentencePredictionTask
from user_dir.topic_vq.model import ABLATIONS, TopicVQSTSModel

TOPICS = {"animal": "cat dog bird horse cow sheep goat mouse".split(),
          "vehicle": "car bus train plane boat bike truck ship".split()}
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = SPECIAL + "the and a with .".split() + TOPICS["animal"] + TOPICS["vehicle"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), WORDS)


def sentence(rng, topic, avoid=()):
    if rng.random() < 0.5:
        words = rng.sample([w for w in TOPICS[topic] if w not in avoid], 2)
        return f"the {words[0]} and a {words[1]} .", set(words)
    words = rng.sample([w for w in TOPICS[topic] if w not in avoid], 3)
    return f"the {words[0]} with the {words[1]} and a {words[2]} .", set(words)


def pair_rows(n, rng):
    rows = []
    for _ in range(n):
        first = rng.choice(sorted(TOPICS))
        same = rng.random() < 0.5
        second = first if same else next(t for t in TOPICS if t != first)
        s1, used = sentence(rng, first)
        s2, _ = sentence(rng, second, avoid=used)
        rows.append(f"{s1}\t{s2}\t{int(same)}")
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("topic_pairs")
    rng = random.Random(3)
    for split, n in (("train", 240), ("dev", 61), ("test", 20)):
        (path / f"{split}.tsv").write_text("s1\ts2\tlabel\n" + "\n".join(pair_rows(n, rng)) + "\n")
    return path


def make_task(data, tiny):
    cfg = TopicSentencePredictionConfig(data=str(data), hf_tokenizer_dir=str(tiny), train_subset="train",
                                     sentence1_column=0, sentence2_column=1, label_column=2, skip_header=True,
                                        num_classes=2, topic_features=True, max_positions=32)
    return TopicSentencePredictionTask.setup_task(cfg)


def make_model(task, tiny, *extra, seed=0):
    parser = argparse.ArgumentParser()
    TopicVQSTSModel.add_args(parser)
    args = parser.parse_args(["--hf-config", str(tiny), "--num-topics", "4", *extra])
    args.arch = "topic_vq_sts"
    torch.manual_seed(seed)
    return TopicVQSTSModel.build_model(args, task)


@pytest.fixture(scope="module")
def task(data, tiny):
    return make_task(data, tiny)


def batch(task, indices, split="valid"):
    dataset = task.load_dataset(split) if split not in task.datasets else task.dataset(split)
    return dataset.collater([dataset[i] for i in indices])


def trainable(model):
    return {name.split(".")[0] for name, p in model.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------------ structure
def test_stages_train_exactly_their_parts_and_the_codebook_is_phi(task, tiny):
    joint = make_model(task, tiny, "--topic-vq-stage", "vqvae")
    assert joint.vqvae.codebook is joint.ntm.topic_embeddings  # one tensor (Section 3.2)
    assert trainable(joint) == {"ntm", "vqvae"}
    assert trainable(make_model(task, tiny, "--topic-vq-stage", "ntm")) == {"ntm"}
    sts = make_model(task, tiny)
    assert trainable(sts) == {"backbone", "head", "semantic_scores", "enhancement"}
    multistage = make_model(task, tiny, "--topic-vq-stage", "vqvae", "--codebook", "multistage")
    assert not multistage.ntm.topic_embeddings.requires_grad and trainable(multistage) == {"vqvae"}

    # joint: L_VQ and gamma L_NTM both move phi; multistage: nothing reaches the NTM
    sample = batch(task, range(8), "train")
    for model, ntm_grad in ((joint, True), (multistage, False)):
        model.train()
        logits, extra = model(**sample["net_input"])
        assert logits is None
        assert set(extra["losses"]) == ({"vq", "ntm"} if ntm_grad else {"vq"})
        sum(v.sum() for v in extra["losses"].values()).backward()
        grads = [p.grad for p in model.ntm.parameters()]
        assert all(g is not None and g.abs().sum() > 0 for g in grads) if ntm_grad else all(g is None for g in grads)
        assert all(p.grad is not None for p in model.vqvae.parameters() if p.requires_grad)

    # eq. (6): the joint stage's objective is L_VQ + gamma L_NTM, the NTM loss of both sentences
    half = make_model(task, tiny, "--topic-vq-stage", "vqvae", "--ntm-gamma", "0.5").eval()
    with torch.no_grad():
        _, extra = half(**sample["net_input"])
        ntm_loss = sum(half.ntm(sample["net_input"][f"bow_{s}"]).loss for s in (1, 2))
        vq_loss = sum(half.quantised(sample["net_input"][f"words_{s}"], sample["net_input"][f"bow_{s}"])[0].loss
                      for s in (1, 2))
    assert torch.allclose(extra["losses"]["ntm"], 0.5 * ntm_loss) and torch.allclose(extra["losses"]["vq"], vq_loss)

    # stage sts: every trainable parameter gets a gradient (DDP needs no unused parameters)
    sts.train()
    logits, _ = sts(**sample["net_input"])
    torch.nn.functional.cross_entropy(logits, sample["target"]).backward()
    missing = [n for n, p in sts.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing and all(p.grad is None for p in list(sts.ntm.parameters()) + list(sts.vqvae.parameters()))
    assert not sts.ntm.training and not sts.vqvae.training  # frozen: deterministic codes

    top_only = make_model(task, tiny, "--freeze-layers", "1")  # CPU fine-tuning of the top layer
    layers = top_only.backbone.encoder.layer
    assert not any(p.requires_grad for p in layers[0].parameters())
    assert all(p.requires_grad for p in layers[1].parameters()) and top_only.semantic_scores.query.weight.requires_grad


@pytest.mark.parametrize("stage", ["ntm", "vqvae", "sts"])
def test_every_stage_trains_and_predicts_under_bf16_autocast(task, tiny, stage):
    """Mixed precision (bf16 autocast on the CPU): the stage's own losses (NTM ELBO, VQ + gamma
    NTM, STS cross-entropy) stay finite and fall; the STS head predicts finite logits."""
    model = make_model(task, tiny, "--topic-vq-stage", stage)
    sample = batch(task, range(8), "train")

    def loss_fn():
        logits, extra = model(**sample["net_input"])
        if logits is None:
            return sum(v.float().sum() for v in extra["losses"].values())
        return torch.nn.functional.cross_entropy(logits.float(), sample["target"])

    if stage == "sts":
        train_under_bf16_autocast(model, loss_fn, steps=6)
    else:  # the training losses sample (NTM reparameterisation): compare the deterministic eval loss
        model.eval()
        with torch.no_grad():
            before = float(loss_fn())
        train_under_bf16_autocast(model, loss_fn, steps=8, check_falls=False)
        model.eval()
        with torch.no_grad():
            assert float(loss_fn()) < before
    if stage == "sts":
        model.eval()
        with torch.autocast(**BF16_AUTOCAST), torch.no_grad():
            logits, _ = model(**batch(task, range(4))["net_input"])
        assert logits.shape == (4, 2) and torch.isfinite(logits.float()).all()


def test_semantic_scores_enter_the_attention_of_exactly_the_chosen_layers(task, tiny):
    sample = batch(task, range(4))
    for spec, layers in (("last", [1]), ("all", [0, 1]), ("0", [0])):
        model = make_model(task, tiny, "--semantic-attention-layers", spec).eval()
        assert model.semantic_layers == layers
        seen = []
        for index, layer in enumerate(model.backbone.encoder.layer):
            layer.attention.self.register_forward_pre_hook(
                lambda module, args, kwargs, index=index: seen.append((index, kwargs.get("attention_mask"))),
                with_kwargs=True, prepend=False)
        with torch.no_grad():
            model(**sample["net_input"])
        hooked = [i for i, mask in seen if mask is not None and mask.dim() == 4 and mask.size(-2) > 1
                  and not torch.all(mask == mask[..., :1, :])]  # a [B, 1, T, T] bias varying over queries
        assert hooked == layers, spec


def test_zero_semantic_bias_equals_the_plain_encoder(task, tiny):
    sample = batch(task, range(5))["net_input"]
    model = make_model(task, tiny, "--ablate", "output-enhancement").eval()
    plain = make_model(task, tiny, "--ablate", "output-enhancement,semantic-attention").eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("semantic_scores.")})
    with torch.no_grad():
        model.semantic_scores.query.weight.mul_(100.0)  # an untrained bias is small; make its effect visible
        biased = model(**sample)[1]["hidden_states"]
        model.semantic_scores.query.weight.zero_()
        zero = model(**sample)[1]["hidden_states"]
        reference = plain(**sample)[1]["hidden_states"]
    assert torch.allclose(zero, reference, atol=1e-6)
    assert (biased - reference).abs().max() > 1e-3


def test_sentence_two_codes_come_from_sentence_two(task, tiny):
    model = make_model(task, tiny).eval()
    sample = batch(task, range(3))["net_input"]
    captured = {}
    original = model.semantic_scores.forward
    model.semantic_scores.forward = lambda z: captured.setdefault("z", z) is not None and original(z)
    with torch.no_grad():
        model(**sample)
        codes_2 = model.quantised(sample["words_2"], sample["bow_2"])[0].z_q
    z = captured["z"]
    second = sample["piece_sentence"].eq(1)
    for b in range(3):
        words = sample["piece_word"][b][second[b]]
        assert torch.allclose(z[b][second[b]], codes_2[b, words])
    assert torch.all(z[sample["piece_sentence"].lt(0)] == 0)


def test_padding_never_changes_the_prediction(task, tiny):
    model = make_model(task, tiny, "--pooling", "mean").eval()
    dataset = task.dataset("valid") if "valid" in task.datasets else task.load_dataset("valid")
    short = min(range(len(dataset)), key=lambda i: dataset.num_tokens(i))
    long = max(range(len(dataset)), key=lambda i: dataset.num_tokens(i))
    assert dataset.num_tokens(short) < dataset.num_tokens(long)
    with torch.no_grad():
        alone, _ = model(**dataset.collater([dataset[short]])["net_input"])
        padded, _ = model(**dataset.collater([dataset[short], dataset[long]])["net_input"])
    assert torch.allclose(alone[0], padded[0], atol=1e-5)


@pytest.mark.parametrize("ablation", ABLATIONS)
def test_each_ablation_removes_its_part(task, tiny, ablation):
    model = make_model(task, tiny, "--ablate", ablation)
    full = make_model(task, tiny)
    if ablation == "topic-model":
        assert model.ntm is None and not model.vqvae.topic_sensitive
    elif ablation == "topic-sensitive-encoder":
        assert not model.vqvae.topic_sensitive and model.vqvae.codebook is model.ntm.topic_embeddings
    elif ablation == "topical-latent-embedding":
        assert model.vqvae.topic_sensitive and model.vqvae.codebook is not model.ntm.topic_embeddings
    elif ablation == "semantic-attention":
        assert model.semantic_scores is None and model.semantic_layers == []
    else:
        assert model.enhancement is None and model.head.dense.in_features == 32
        assert full.head.dense.in_features == 32 + 64
    names = {n for n, _ in model.named_parameters()}
    own_codebook = ablation in ("topic-model", "topical-latent-embedding")  # random, not the NTM's phi
    assert ("vqvae.codebook" in names) == own_codebook
    full_names = {n for n, _ in full.named_parameters()}
    assert names - {"vqvae.codebook"} <= full_names  # nothing else new
    if ablation in ("topic-model", "semantic-attention", "output-enhancement"):
        assert names - {"vqvae.codebook"} < full_names
    if ablation == "topic-sensitive-encoder":  # X^seq alone: E inputs instead of E + K
        assert model.vqvae.input_proj.in_features == 64 and full.vqvae.input_proj.in_features == 64 + 4
    sample = batch(task, range(4))
    model.eval()
    with torch.no_grad():
        logits, _ = model(**sample["net_input"])
    assert logits.shape == (4, 2) and torch.isfinite(logits).all()
    if ablation != "topic-model":
        stage = make_model(task, tiny, "--ablate", ablation, "--topic-vq-stage", "vqvae")
        _, extra = stage(**sample["net_input"])
        assert torch.isfinite(extra["losses"]["vq"]).all()


def test_bad_options_raise_clear_errors(task, tiny, data):
    with pytest.raises(HFSentenceConfigError, match="--ablate spam: unknown"):
        make_model(task, tiny, "--ablate", "spam")
    with pytest.raises(ValueError, match="--num-topics"):
        make_model(task, tiny, "--num-topics", "500")
    with pytest.raises(HFSentenceConfigError, match="--num-topics=0"):
        make_model(task, tiny, "--num-topics", "0")
    with pytest.raises(HFSentenceConfigError, match="--ntm-gamma -1"):
        make_model(task, tiny, "--ntm-gamma", "-1")
    with pytest.raises(ValueError, match="--semantic-attention-layers"):
        make_model(task, tiny, "--semantic-attention-layers", "7")
    with pytest.raises(HFSentenceConfigError, match="no topic model"):
        make_model(task, tiny, "--ablate", "topic-model", "--topic-vq-stage", "ntm")
    plain = HFSentencePredictionTask.setup_task(HFSentencePredictionConfig(
        data=str(data), hf_tokenizer_dir=str(tiny), train_subset="train", sentence1_column=0, sentence2_column=1,
        label_column=2, skip_header=True, num_classes=2, max_positions=32))
    with pytest.raises(HFSentenceConfigError, match="--topic-features"):
        make_model(plain, tiny)


# ---------------------------------------------------------------------------- CLI
def run(cmd):
    proc = run_checked(cmd, env=ENV, cwd=REPO)
    return proc.stdout + proc.stderr


def train(data, tiny, save_dir, *extra):
    return run([venv_bin("fairseq-train"), data, "--user-dir", REPO / "user_dir", "--task", "topic_vq_sentence_prediction",
                "--hf-tokenizer-dir", tiny, "--sentence1-column", "0", "--sentence2-column", "1", "--label-column", "2",
                "--skip-header", "--num-classes", "2", "--topic-features", "--max-positions", "32",
                "--arch", "topic_vq_sts", "--hf-config", tiny, "--num-topics", "4", "--criterion",
                "hf_sentence_prediction", "--optimizer", "adam", "--batch-size", "32", "--cpu", "--no-progress-bar",
                "--log-format", "simple", "--log-interval", "100", "--save-dir", save_dir, "--seed", "1",
                "--no-epoch-checkpoints", "--num-workers", "0", "--required-batch-size-multiple", "1", *extra])


def valid_values(log, key):
    return [float(v) for v in re.findall(rf"\| valid \| epoch \d+ \|.*? \| {key} (-?[0-9.]+)", log)]


def model_state(path):
    return checkpoint_utils.load_checkpoint_to_cpu(str(path))["model"]


def test_three_stages_through_fairseq_train(tmp_path, data, tiny, task):
    ntm_log = train(data, tiny, tmp_path / "ntm", "--topic-vq-stage", "ntm", "--lr", "3e-3", "--max-epoch", "25")
    ntm_loss = valid_values(ntm_log, "ntm")
    assert len(ntm_loss) == 25 and ntm_loss[-1] < ntm_loss[0]
    ntm_ckpt = tmp_path / "ntm" / "checkpoint_best.pt"

    train(data, tiny, tmp_path / "multi", "--topic-vq-stage", "vqvae", "--codebook", "multistage",
          "--topic-vq-init", ntm_ckpt, "--lr", "2e-3", "--max-epoch", "2")
    before, after = model_state(ntm_ckpt), model_state(tmp_path / "multi" / "checkpoint_last.pt")
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("ntm."))  # held fixed

    vq_log = train(data, tiny, tmp_path / "vq", "--topic-vq-stage", "vqvae", "--topic-vq-init", ntm_ckpt,
                   "--lr", "2e-3", "--max-epoch", "15")
    reconstruction = valid_values(vq_log, "vq_rec")  # -sum log p(x_i | z_i^q) of eq. (1)
    assert len(reconstruction) == 15 and reconstruction[-1] < 0.9 * reconstruction[0], reconstruction
    assert valid_values(vq_log, "code_perplexity")[-1] > 1.5  # more than one code in use
    vq_ckpt = tmp_path / "vq" / "checkpoint_last.pt"
    joint = model_state(vq_ckpt)
    assert not torch.equal(before["ntm.topic_embeddings"], joint["ntm.topic_embeddings"])  # joint: phi moves

    from user_dir.tools.topic_vq import report as topic_report

    assert topic_report.main(["--path", str(vq_ckpt), "--data", str(data), "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert 1.0 < result["ntm_perplexity"] < 2 * 16 and -1.0 <= result["coherence"] <= 1.0
    assert len(result["topics"]) == 4 and result["codes_used"] >= 2
    assert 1.0 < result["code_perplexity"] <= 4.0
    seen = {w for words in result["codes"].values() for w in words}
    assert seen <= set(task.topic_vocabulary.vq_words) and "cat" in seen

    sts_log = train(data, tiny, tmp_path / "sts", "--topic-vq-init", vq_ckpt, "--lr", "2e-3", "--max-epoch", "20",
                    "--best-checkpoint-metric", "accuracy", "--maximize-best-checkpoint-metric")
    accuracy = valid_values(sts_log, "accuracy")
    assert len(accuracy) == 20 and max(accuracy) >= max(75.0, accuracy[0] + 15), accuracy
    final = model_state(tmp_path / "sts" / "checkpoint_last.pt")
    assert all(torch.equal(joint[k], final[k]) for k in joint if k.startswith(("ntm.", "vqvae.")))  # frozen

    with pytest.raises(HFSentenceConfigError, match=r"ntm\.topic_embeddings has shape \(4, 64\) there"):
        make_model(task, tiny, "--num-topics", "5", "--topic-vq-init", str(ntm_ckpt))


def test_glue_recipe_runs_all_stages_on_mrpc_files(tmp_path, tiny):
    """examples/topic_vq_sts/run_glue.sh end to end (epochs overridden) with a tiny pre-trained
    directory (weights saved with save_pretrained) and MRPC-layout files."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    encoder = tmp_path / "encoder"
    BertTokenizerFast.from_pretrained(str(tiny)).save_pretrained(str(encoder))
    BertModel(BertConfig.from_pretrained(str(tiny))).save_pretrained(str(encoder))
    data = tmp_path / "MRPC"
    data.mkdir()
    rng = random.Random(5)
    for split, n in (("train", 120), ("dev", 30), ("test", 12)):
        first = "index" if split == "test" else "Quality"
        lines = [f"{first}\t#1 ID\t#2 ID\t#1 String\t#2 String"]
        for i, row in enumerate(pair_rows(n, rng)):
            s1, s2, label = row.split("\t")
            lines.append(f"{i if split == 'test' else label}\t{i}\t{i}\t{s1}\t{s2}")
        (data / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    env = {**ENV, "NUM_TOPICS": "4", "MAX_LEN": "32", "NTM_EPOCHS": "2", "VQ_EPOCHS": "1", "EPOCHS": "2", "FAIRSEQ_EXTRA": "--cpu --num-workers 0",
           "PYTHON": str(venv_bin("python"))}
    proc = subprocess.run(["bash", str(REPO / "examples" / "topic_vq_sts" / "run_glue.sh"), "MRPC", str(data),
                           str(encoder), str(tmp_path / "runs")], capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in ("ntm", "vqvae", "disbert", "base"):
        assert (tmp_path / "runs" / stage / "checkpoint_best.pt").is_file()
    lines = (tmp_path / "runs" / "MRPC.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 13


def test_ablated_vqvae_stage_initialises_from_the_full_ntm_checkpoint(task, tiny, tmp_path):
    """Stage 2 of the no-topic-sensitive-encoder ablation starts from the shared stage-1 (NTM)
    checkpoint, whose untrained VQ-VAE has tensors and shapes the ablated VQ-VAE lacks: only the
    NTM is taken from it; the task stage stays strict."""
    ntm_stage = make_model(task, tiny, "--topic-vq-stage", "ntm", seed=5)
    path = tmp_path / "ntm.pt"
    torch.save({"model": ntm_stage.state_dict(), "args": None,
                "cfg": {"model": argparse.Namespace(topic_vq_stage="ntm")},  # as fairseq saves it
                "extra_state": {},
                "last_optimizer_state": None, "optimizer_history": [
                    {"criterion_name": "HFSentencePredictionCriterion", "optimizer_name": "Adam",
                     "lr_scheduler_state": {"best": None}, "num_updates": 0}]}, str(path))
    extra = set(ntm_stage.state_dict()) - set(make_model(task, tiny, "--ablate", "topic-sensitive-encoder",
                                                          "--topic-vq-stage", "vqvae").state_dict())
    assert any(k.startswith("vqvae.") for k in extra)
    ablated = make_model(task, tiny, "--ablate", "topic-sensitive-encoder", "--topic-vq-stage", "vqvae")
    ablated.load_topic_vq(str(path))
    for key, value in ablated.state_dict().items():
        if key.startswith("ntm."):
            assert torch.equal(value, ntm_stage.state_dict()[key]), key
    sts = make_model(task, tiny, "--ablate", "topic-sensitive-encoder")
    with pytest.raises(HFSentenceConfigError, match="(does not exist in this model|has shape)"):
        sts.load_topic_vq(str(path))
