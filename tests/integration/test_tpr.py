"""HUBERT's TPR head (``tpr_classifier``), its transfer options and the BERT-LSTM baseline.

A tiny random BERT (2 layers, hidden 32, 2 heads) with a WordPiece vocabulary built here,
tiny TPR sizes, and a single-sentence task: is the sentence about animals or vehicles.
"""

import argparse
import logging
import os
import random
import re

import pytest
import torch
from fairseq import checkpoint_utils

from conftest import BF16_AUTOCAST, REPO, run_checked, save_tiny_bert, train_under_bf16_autocast, venv_bin
from user_dir.hf_sentence.task import HFSentencePredictionConfig, HFSentencePredictionTask
from user_dir.tpr.head import AGGREGATIONS, Aggregation, TPRLayer, bind, check_orthogonality, role_orthogonality
from user_dir.tpr.head import warn_unreachable_orthogonality
from user_dir.tpr.model import BertLSTMClassifier, TPRClassifier
from user_dir.tpr.transfer import PARTS, TPRTransferError, part_of

TOPICS = {"animal": "cat dog bird horse cow sheep goat mouse".split(),
          "vehicle": "car bus train plane boat bike truck ship".split()}
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = SPECIAL + "the and a with .".split() + TOPICS["animal"] + TOPICS["vehicle"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
TINY_TPR = ["--tpr-symbols", "6", "--tpr-roles", "4", "--tpr-symbol-dim", "4", "--tpr-role-dim", "4"]
MAX_POS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), WORDS)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("topic_sentences")
    rng = random.Random(3)
    for split, n in (("train", 160), ("dev", 60), ("test", 10)):
        rows = []
        for _ in range(n):
            topic = rng.choice(sorted(TOPICS))
            words = rng.sample(TOPICS[topic], 2)
            rows.append(f"the {words[0]} and a {words[1]} .\t{int(topic == 'animal')}")
        (path / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def task(data, tiny):
    cfg = HFSentencePredictionConfig(data=str(data), hf_tokenizer_dir=str(tiny), train_subset="train",
                                     sentence1_column=0, label_column=1, skip_header=True, num_classes=2,
                                     max_positions=MAX_POS)
    return HFSentencePredictionTask.setup_task(cfg)


def make_model(task, tiny, *extra, seed=0, cls=TPRClassifier, arch="tpr_classifier"):
    parser = argparse.ArgumentParser()
    cls.add_args(parser)
    tpr = TINY_TPR if cls is TPRClassifier else []
    args = parser.parse_args(["--hf-config", str(tiny), *tpr, *extra])
    args.arch = arch
    if arch == "tpr_classifier_lstm":
        from user_dir.tpr.model import tpr_classifier_lstm
        tpr_classifier_lstm(args)
    torch.manual_seed(seed)
    return cls.build_model(args, task)


def batch(task, indices, split="valid"):
    dataset = task.load_dataset(split) if split not in task.datasets else task.dataset(split)
    return dataset.collater([dataset[i] for i in indices])


def pad_more(net_input, extra, pad):
    """Append ``extra`` padding positions to every tensor of the batch."""
    out = dict(net_input)
    for key, value in net_input.items():
        if torch.is_tensor(value) and value.dim() == 2:
            fill = pad if key == "src_tokens" else 0
            out[key] = torch.cat([value, value.new_full((value.size(0), extra), fill)], dim=1)
    return out


# ---------------------------------------------------------------------- the algebra
def test_binding_is_rank_one_and_unbinds_with_orthonormal_roles():
    torch.manual_seed(0)
    d_S, n_S, d_R = 5, 7, 4
    S = torch.randn(d_S, n_S)
    R = torch.linalg.qr(torch.randn(d_R, d_R)).Q  # orthonormal columns
    for i in range(n_S):
        for j in range(d_R):
            a_S, a_R = torch.eye(n_S)[i], torch.eye(d_R)[j]
            x, f, r = bind(S, R, a_S, a_R)
            X = x.view(d_S, d_R)
            assert torch.linalg.matrix_rank(X) == 1
            assert torch.allclose(f, S[:, i]) and torch.allclose(r, R[:, j])
            assert torch.allclose(X @ r, S[:, i], atol=1e-5)  # unbinding recovers the filler
            assert torch.allclose(X, S @ torch.outer(a_S, a_R) @ R.t(), atol=1e-6)  # S a_S a_R^T R^T
    a_S = torch.softmax(torch.randn(n_S), 0)  # a soft filler is recovered too
    x, f, _ = bind(S, R, a_S, torch.eye(d_R)[2])
    assert torch.allclose(x.view(d_S, d_R) @ R[:, 2], S @ a_S, atol=1e-5)
    assert torch.linalg.matrix_rank(x.view(d_S, d_R)) == 1


def test_regulariser_zero_for_orthogonal_and_equals_hand_computation(caplog):
    Q = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64)).Q
    t1, t2 = role_orthogonality(Q)
    assert t1.item() == pytest.approx(0, abs=1e-12) and t2.item() == pytest.approx(0, abs=1e-12)
    R = torch.tensor([[1.0, 2.0, 0.0], [0.5, -1.0, 1.0]])  # d_R 2, n_R 3
    rrt = [[sum(R[a, k] * R[b, k] for k in range(3)).item() for b in range(2)] for a in range(2)]
    rtr = [[sum(R[k, a] * R[k, b] for k in range(2)).item() for b in range(3)] for a in range(3)]
    hand1 = sum((rrt[a][b] - (a == b)) ** 2 for a in range(2) for b in range(2))
    hand2 = sum((rtr[a][b] - (a == b)) ** 2 for a in range(3) for b in range(3))
    t1, t2 = role_orthogonality(R)
    assert t1.item() == pytest.approx(hand1) and t2.item() == pytest.approx(hand2)
    # n_R > d_R: R R^T reaches I for orthonormal rows, R^T R stops at n_R - d_R
    semi = torch.nn.init.orthogonal_(torch.empty(4, 7, dtype=torch.float64))
    t1, t2 = role_orthogonality(semi)
    assert t1.item() == pytest.approx(0, abs=1e-10) and t2.item() == pytest.approx(3.0)
    with caplog.at_level(logging.WARNING):
        message = warn_unreachable_orthogonality(35, 32, 0.1)
    assert "R^T R (35 x 35)" in message and ">= 3" in message and message in caplog.text
    assert warn_unreachable_orthogonality(35, 32, 0.0) is None and warn_unreachable_orthogonality(8, 8, 1.0) is None


def test_temperature_to_zero_gives_one_hot_selections():
    torch.manual_seed(0)
    h, mask = torch.randn(3, 5, 8), torch.zeros(3, 5, dtype=torch.bool)
    layer = TPRLayer(8, 6, 4, 3, 3, temperature=1e-6, heads=2, dropout=0.0).eval()
    out = layer(h, mask)
    for a in (out.a_S, out.a_R):
        assert torch.allclose(a.max(-1).values, torch.ones(3, 5))
    warm = TPRLayer(8, 6, 4, 3, 3, temperature=100.0, heads=2, dropout=0.0).eval()(h, mask)
    assert warm.a_S.max() < 0.5  # high temperature: spread selections


def test_bad_sizes_temperature_and_lambda_raise_naming_the_option(task, tiny):
    for kwargs, option in (({"temperature": 0.0}, "--tpr-temperature"), ({"temperature": -1.0}, "--tpr-temperature"),
                           ({"n_symbols": 0}, "--tpr-symbols"), ({"n_roles": 0}, "--tpr-roles"),
                           ({"d_symbol": 0}, "--tpr-symbol-dim"), ({"d_role": 0}, "--tpr-role-dim")):
        with pytest.raises(ValueError, match=option):
            TPRLayer(8, **kwargs)
    with pytest.raises(ValueError, match="--tpr-orthogonality"):
        check_orthogonality(-0.1)
    with pytest.raises(ValueError, match="--tpr-orthogonality"):
        make_model(task, tiny, "--tpr-orthogonality", "-1")
    with pytest.raises(ValueError, match="--tpr-temperature"):
        make_model(task, tiny, "--tpr-temperature", "0")
    with pytest.raises(ValueError, match="--tpr-roles"):
        make_model(task, tiny, "--tpr-roles", "0")


# ------------------------------------------------------------------------- the model
@pytest.mark.parametrize("encoder", ["transformer", "lstm"])
def test_padding_never_changes_the_output(task, tiny, encoder):
    sample = batch(task, range(6))
    for aggregation in AGGREGATIONS:
        model = make_model(task, tiny, "--tpr-encoder", encoder, "--tpr-aggregation", aggregation).eval()
        with torch.no_grad():
            logits, extra = model(**sample["net_input"])
            T = sample["net_input"]["src_tokens"].size(1)
            padded = pad_more(sample["net_input"], MAX_POS - T, task.padding_idx)
            logits2, extra2 = model(**padded)
        assert torch.allclose(logits, logits2, atol=1e-5), (encoder, aggregation)
        assert extra2["tpr"].x[extra2["padding_mask"]].abs().max() == 0  # padded positions zeroed
    # the paper's concat needs a fixed length: longer than --max-positions is refused
    model = make_model(task, tiny).eval()
    with pytest.raises(ValueError, match="--max-positions"):
        model(**pad_more(sample["net_input"], MAX_POS, task.padding_idx))


@pytest.mark.parametrize("arch", ["tpr_classifier", "tpr_classifier_lstm", "bert_lstm_classifier"])
def test_forward_backward_every_trainable_parameter_gets_a_gradient(task, tiny, arch):
    cls = BertLSTMClassifier if arch == "bert_lstm_classifier" else TPRClassifier
    model = make_model(task, tiny, cls=cls, arch=arch).train()
    if arch == "tpr_classifier_lstm":
        assert model.tpr.encoder == "lstm"
    sample = batch(task, range(8), "train")
    logits, extra = model(**sample["net_input"])
    assert logits.shape == (8, 2)
    loss = torch.nn.functional.cross_entropy(logits, sample["target"])
    if cls is TPRClassifier:
        reg = extra["losses"]["role_orthogonality"]
        assert reg.dim() == 0
        stats = extra["stats"]
        assert torch.allclose(reg, 0.1 * (stats["role_orth_rrt"] + stats["role_orth_rtr"]))
        loss = loss + reg
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing


@pytest.mark.parametrize("arch", ["tpr_classifier", "bert_lstm_classifier"])
def test_trains_and_predicts_under_bf16_autocast(task, tiny, arch):
    """Mixed precision (bf16 autocast on the CPU): cross-entropy + the role-orthogonality
    regulariser stay finite and fall; prediction gives finite logits."""
    cls = BertLSTMClassifier if arch == "bert_lstm_classifier" else TPRClassifier
    model = make_model(task, tiny, cls=cls, arch=arch)
    sample = batch(task, range(8), "train")

    def loss_fn():
        logits, extra = model(**sample["net_input"])
        loss = torch.nn.functional.cross_entropy(logits.float(), sample["target"])
        return loss + sum(v.float() for v in extra.get("losses", {}).values())

    train_under_bf16_autocast(model, loss_fn, steps=6)
    model.eval()
    with torch.autocast(**BF16_AUTOCAST), torch.no_grad():
        logits, _ = model(**batch(task, range(4))["net_input"])
    assert torch.isfinite(logits.float()).all()


def test_footnote_5_extra_layer_is_on_for_the_papers_architecture_only(task, tiny):
    from user_dir.tpr.model import HFSentenceConfigError, tpr_classifier_plain

    hubert = make_model(task, tiny)
    assert isinstance(hubert.extra_layer, torch.nn.TransformerEncoderLayer)
    assert hubert.extra_layer.self_attn.embed_dim == 16  # d_S * d_R
    assert make_model(task, tiny, arch="tpr_classifier_lstm").extra_layer is None
    parser = argparse.ArgumentParser()
    TPRClassifier.add_args(parser)
    args = parser.parse_args(["--hf-config", str(tiny), *TINY_TPR])
    tpr_classifier_plain(args)
    plain = TPRClassifier.build_model(args, task)
    assert plain.extra_layer is None
    assert make_model(task, tiny, "--tpr-extra-layer", "false").extra_layer is None
    # the layer changes the output (it is in the forward path) and gets gradients (test above)
    sample = batch(task, range(4))
    torch.manual_seed(0)
    with torch.no_grad():
        x = hubert.tpr(*hubert.encode(sample["net_input"])).x
        assert not torch.allclose(hubert.eval()(**sample["net_input"])[0],
                                  hubert.classify(hubert.aggregate(x, hubert.encode(sample["net_input"])[1])))
    # a checkpoint without the layer is refused with the override that loads it
    with pytest.raises(HFSentenceConfigError, match="tpr_extra_layer': False"):
        hubert.load_state_dict(plain.state_dict())


# ---------------------------------------------------------------------- transfer
def save_state(state, path):
    """A checkpoint in fairseq's layout (what checkpoint_utils.load_checkpoint_to_cpu reads)."""
    torch.save({"model": state, "args": None, "cfg": None, "extra_state": {}, "last_optimizer_state": None,
                "optimizer_history": [{"criterion_name": "HFSentencePredictionCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {"best": None}, "num_updates": 0}]}, str(path))
    return str(path)


def save_source(model, path):
    return save_state(model.state_dict(), path)


@pytest.fixture(scope="module")
def source(task, tiny, tmp_path_factory):
    model = make_model(task, tiny, seed=123)
    with torch.no_grad():  # make every tensor differ from any fresh init
        for p in model.parameters():
            p.add_(0.01)
    return model, save_source(model, tmp_path_factory.mktemp("src") / "source.pt")


@pytest.mark.parametrize("parts", ["encoder", "roles", "fillers", "role_selector", "filler_selector",
                                   "selectors", "encoder,roles,fillers"])
def test_each_transfer_option_moves_exactly_its_parameters(task, tiny, source, parts):
    src_model, ckpt = source
    src = src_model.state_dict()
    fresh = make_model(task, tiny, seed=5).state_dict()
    model = make_model(task, tiny, "--tpr-transfer-from", ckpt, "--tpr-transfer", parts, "--tpr-freeze", parts, seed=5)
    named = [p for name in parts.split(",") for p in (("role_selector", "filler_selector") if name == "selectors"
                                                        else (name,))]
    moved = 0
    for key, value in model.state_dict().items():
        if any(part_of(key, p) for p in named):
            assert torch.equal(value, src[key]), key
            moved += 1
        else:
            assert torch.equal(value, fresh[key]), key
    assert moved > 0 and all(f"{p}:" in model.args.tpr_transferred for p in named)
    # frozen: no gradient and unchanged by an optimizer step; everything else moves
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if any(part_of(n, p) for p in named)}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sample = batch(task, range(8), "train")
    logits, extra = model(**sample["net_input"])
    (torch.nn.functional.cross_entropy(logits, sample["target"])
     + sum(extra.get("losses", {}).values(), torch.tensor(0.0))).backward()
    optimizer.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (n in frozen), n
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)


def test_transfer_errors_name_the_parameter_and_shapes(task, tiny, tmp_path):
    other = make_model(task, tiny, "--tpr-roles", "5", seed=1)
    ckpt = save_source(other, tmp_path / "other.pt")
    with pytest.raises(TPRTransferError, match=r"tpr\.R has shape \(4, 5\) .* but \(4, 4\)"):
        make_model(task, tiny, "--tpr-transfer-from", ckpt, "--tpr-transfer", "roles")
    plain = {k: v for k, v in other.state_dict().items() if not k.startswith("tpr.")}  # e.g. a plain BERT run
    ckpt = save_state(plain, tmp_path / "plain.pt")
    with pytest.raises(TPRTransferError, match=r"has no parameter tpr\.S"):
        make_model(task, tiny, "--tpr-transfer-from", ckpt, "--tpr-transfer", "fillers")
    lstm = save_source(make_model(task, tiny, "--tpr-encoder", "lstm"), tmp_path / "lstm.pt")
    with pytest.raises(TPRTransferError, match=r"has no parameter tpr\.role_encoder\."):
        make_model(task, tiny, "--tpr-transfer-from", lstm, "--tpr-transfer", "role_selector")
    with pytest.raises(TPRTransferError, match="unknown part"):
        make_model(task, tiny, "--tpr-transfer-from", lstm, "--tpr-transfer", "head")
    with pytest.raises(TPRTransferError, match="--tpr-transfer-from"):
        make_model(task, tiny, "--tpr-transfer", "roles")
    assert set(PARTS) == {"encoder", "roles", "fillers", "role_selector", "filler_selector"}


# ----------------------------------------------------------------- fairseq-train
def run(cmd):
    proc = run_checked(cmd, env=ENV, cwd=REPO)
    return proc.stdout + proc.stderr


def test_fairseq_train_tpr_classifier_learns(tmp_path, data, tiny):
    log = run([venv_bin("fairseq-train"), data, "--user-dir", REPO / "user_dir", "--task", "hf_sentence_prediction",
               "--hf-tokenizer-dir", tiny, "--sentence1-column", "0", "--label-column", "1", "--skip-header",
               "--num-classes", "2", "--max-positions", str(MAX_POS), "--arch", "tpr_classifier", "--hf-config", tiny,
               *TINY_TPR, "--tpr-heads", "2", "--criterion", "hf_sentence_prediction", "--optimizer", "adam",
               "--lr", "2e-3", "--batch-size", "16", "--max-epoch", "10", "--cpu", "--no-progress-bar",
               "--log-format", "simple", "--log-interval", "100", "--save-dir", tmp_path / "ckpt", "--seed", "1",
               "--no-epoch-checkpoints", "--num-workers", "0", "--required-batch-size-multiple", "1"])
    accuracy = [float(v) for v in re.findall(r"\| valid \| epoch \d+ \|.*? \| accuracy (-?[0-9.]+)", log)]
    print("dev accuracy per epoch:", accuracy)
    assert len(accuracy) == 10 and max(accuracy[1:]) > accuracy[0] and max(accuracy) >= 90, accuracy
    assert re.search(r"\| valid \| epoch 010 \|.*role_orthogonality", log)
    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "ckpt" / "checkpoint_last.pt"))
    assert state["model"]["tpr.R"].shape == (4, 4)


def test_concat_aggregation_equals_projecting_the_zero_padded_flattening():
    torch.manual_seed(0)
    aggregate = Aggregation("concat", 6, max_len=9, output_size=5)
    x = torch.randn(3, 4, 6)
    padding_mask = torch.tensor([[False] * 4, [False] * 3 + [True], [False, False, True, True]])
    expected = x * (~padding_mask).unsqueeze(-1)
    expected = aggregate.project(torch.nn.functional.pad(expected, (0, 0, 0, 5)).reshape(3, 54))
    assert torch.allclose(aggregate(x, padding_mask), expected, atol=1e-6)
