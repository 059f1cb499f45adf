"""Optimus' label-conditional text generation (Sec. 5.2, Table 6) (command ``optimus-cond-gen``).

The paper: "We fine-tune OPTIMUS using the VAE objective on the dataset, then freeze backbone
weights. A conditional GAN (Mirza and Osindero, 2014) is trained on the fixed latent space. The
generation process is to first produce a latent vector z_y based on a given label y using
conditional GAN, then generate sentences conditioned on z_y using the decoder."

Here, with a frozen Optimus checkpoint and labelled sentences (``--data-dir``: ``train.tsv`` /
``test.tsv``, ``sentence<TAB>label``):

1. the training sentences' posterior means E_q[z|x] are the GAN's real samples;
2. :class:`LatentCGAN`: generator G(noise, y) -> z and discriminator D(z, y) -> real/fake,
   two-layer MLPs (LeakyReLU 0.2) with a label embedding concatenated to their input, trained
   with the non-saturating GAN loss, Adam(2e-4, betas (0.5, 0.999)) (Mirza & Osindero's setup
   with DCGAN's optimiser; the paper gives no sizes);
3. ``--samples-per-label`` z_y per label, decoded greedily by Optimus' decoder (fairseq's
   generator, :class:`~user_dir.sentence_vae.decoding.LatentDecoder`);
4. Table 6's metrics: **accuracy** = share of generated sentences that a separately trained
   classifier (TF-IDF word 1-2-grams + logistic regression fitted on train.tsv; its own test
   accuracy is reported beside it) assigns the intended label; **BLEU** = mean sentence BLEU of
   each generated sentence against the test sentences of its label as references (sacreBLEU,
   Texygen's protocol; at most ``--max-references`` of them); **G-score** = sqrt(accuracy x
   BLEU/100); **Self-BLEU** = mean sentence BLEU of each generated sentence against the other
   generated sentences of its label (lower = more diverse). As a reference point the same
   classifier labels sentences decoded from prior samples z ~ N(0, I) (``prior_label_rates``).

Output: ``--out`` JSON (metrics, per-label accuracy, samples, settings and estimators).
"""

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from latent_core.errors import command_error, option_flag
from latent_core.vae import VAEConfigError

from user_dir.sentence_vae.decoding import LatentDecoder, generation_args
from user_dir.tools.optimus.low_resource import OptimusEncoderFeatures, encode_all, read_labelled


class LatentCGAN(nn.Module):
    """Conditional GAN over a P-dimensional latent space with ``num_labels`` labels."""

    def __init__(self, latent_dim: int, num_labels: int, noise_dim: int = 32, hidden: int = 256):
        super().__init__()
        self.noise_dim = noise_dim
        self.generator_labels = nn.Embedding(num_labels, noise_dim)
        self.discriminator_labels = nn.Embedding(num_labels, latent_dim)
        self.generator = nn.Sequential(
            nn.Linear(2 * noise_dim, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, latent_dim))
        self.discriminator = nn.Sequential(
            nn.Linear(2 * latent_dim, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, 1))

    def generate(self, labels: Tensor, generator: torch.Generator = None) -> Tensor:
        """z_y = G(noise, y): ``labels [N]`` -> ``[N, P]``."""
        noise = torch.randn(labels.size(0), self.noise_dim, generator=generator)
        return self.generator(torch.cat([noise, self.generator_labels(labels)], dim=-1))

    def discriminate(self, z: Tensor, labels: Tensor) -> Tensor:
        """D(z, y) logits ``[N]``."""
        return self.discriminator(torch.cat([z, self.discriminator_labels(labels)], dim=-1)).squeeze(-1)


def train_cgan(z: Tensor, labels: Tensor, num_labels: int, steps: int, batch: int = 64, seed: int = 1,
               noise_dim: int = 32, hidden: int = 256, lr: float = 2e-4) -> LatentCGAN:
    """Fit a :class:`LatentCGAN` to real latents ``z [N, P]`` with labels ``[N]`` (non-saturating loss)."""
    if z.size(0) != labels.size(0) or z.size(0) < 2:
        raise VAEConfigError(f"the cGAN needs >= 2 labelled latents (got {z.size(0)} latents, {labels.size(0)} labels)")
    torch.manual_seed(seed)
    gan = LatentCGAN(z.size(1), num_labels, noise_dim, hidden)
    d_params = list(gan.discriminator.parameters()) + list(gan.discriminator_labels.parameters())
    g_params = list(gan.generator.parameters()) + list(gan.generator_labels.parameters())
    d_opt = torch.optim.Adam(d_params, lr=lr, betas=(0.5, 0.999))
    g_opt = torch.optim.Adam(g_params, lr=lr, betas=(0.5, 0.999))
    bce = nn.functional.binary_cross_entropy_with_logits
    rng = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randint(0, z.size(0), (min(batch, z.size(0)),), generator=rng)
        real, y = z[rows], labels[rows]
        fake = gan.generate(y, rng)
        d_real, d_fake = gan.discriminate(real, y), gan.discriminate(fake.detach(), y)
        d_loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
        d_opt.zero_grad()
        d_loss.backward()
        d_opt.step()
        g_out = gan.discriminate(fake, y)
        g_loss = bce(g_out, torch.ones_like(g_out))
        g_opt.zero_grad()
        g_loss.backward()
        g_opt.step()
    return gan.eval()


def text_classifier(sentences: Sequence[str], labels: Sequence[str]):
    """The separately trained judge: TF-IDF word 1-2-grams + logistic regression."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    return make_pipeline(TfidfVectorizer(ngram_range=(1, 2), min_df=1),
                         LogisticRegression(max_iter=5000)).fit(list(sentences), list(labels))


def mean_sentence_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    import sacrebleu

    if not hypotheses or not references:
        return float("nan")
    return float(np.mean([sacrebleu.sentence_bleu(h, list(references)).score for h in hypotheses]))


def self_bleu(sentences: Sequence[str]) -> float:
    import sacrebleu

    if len(sentences) < 2:
        return float("nan")
    return float(np.mean([sacrebleu.sentence_bleu(s, [o for j, o in enumerate(sentences) if j != i]).score
                          for i, s in enumerate(sentences)]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="optimus-cond-gen", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="Optimus checkpoint (--task optimus_lm)")
    p.add_argument("--optimus-data", type=Path, required=True, help="its prepare-optimus-data directory")
    p.add_argument("--data-dir", type=Path, required=True, help="train.tsv / test.tsv (sentence<TAB>label)")
    p.add_argument("--samples-per-label", type=int, default=100)
    p.add_argument("--gan-steps", type=int, default=5000)
    p.add_argument("--gan-batch", type=int, default=64)
    p.add_argument("--noise-dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--max-len", type=int, default=40, help="longest generated sentence (GPT-2 tokens)")
    p.add_argument("--max-references", type=int, default=500, help="test sentences per label used as BLEU references")
    p.add_argument("--print-samples", type=int, default=5, help="samples per label printed and kept in the JSON")
    p.add_argument("--out", type=Path, default=Path("outputs/optimus/conditional_generation.json"))
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    for name in ("samples_per_label", "gan_steps", "gan_batch", "noise_dim", "hidden", "max_len", "max_references"):
        if getattr(args, name) < 1:
            p.error(f"{option_flag(name)} must be >= 1")
    return args


def run(args) -> Dict:
    train_s, train_y = read_labelled(args.data_dir / "train.tsv")
    test_s, test_y = read_labelled(args.data_dir / "test.tsv")
    classes = sorted(set(train_y))
    if len(classes) < 2:
        raise VAEConfigError(f"{args.data_dir / 'train.tsv'}: one label only; conditional generation needs >= 2")
    optimus = OptimusEncoderFeatures(args.checkpoint, args.optimus_data)
    print(f"[optimus] E_q[z] of {len(train_s)} training sentences", flush=True)
    z = torch.from_numpy(encode_all(optimus, train_s, "z"))
    y = torch.tensor([classes.index(label) for label in train_y])
    print(f"[optimus] conditional GAN: {args.gan_steps} steps", flush=True)
    gan = train_cgan(z, y, len(classes), args.gan_steps, args.gan_batch, args.seed, args.noise_dim, args.hidden)
    decoder = LatentDecoder(optimus.model, optimus.task, generation_args(beam=1, max_len=args.max_len))
    rng = torch.Generator().manual_seed(args.seed)
    judge = text_classifier(train_s, train_y)
    judge_accuracy = float(np.mean(judge.predict(test_s) == np.asarray(test_y)))
    generated: Dict[str, List[str]] = {}
    per_label = {}
    for index, label in enumerate(classes):
        with torch.no_grad():
            z_y = gan.generate(torch.full((args.samples_per_label,), index, dtype=torch.long), rng)
        sentences = decoder.decode({"z": z_y})
        generated[label] = sentences
        references = [s for s, t in zip(test_s, test_y) if t == label][:args.max_references]
        per_label[label] = {
            "accuracy": float(np.mean(judge.predict(sentences) == label)),
            "bleu": mean_sentence_bleu(sentences, references),
            "self_bleu": self_bleu(sentences),
            "samples": sentences[:args.print_samples],
        }
    prior = decoder.decode(decoder.prior_samples(args.samples_per_label * len(classes), rng))
    prior_labels = judge.predict(prior)
    accuracy = float(np.mean([per_label[c]["accuracy"] for c in classes]))
    bleu = float(np.mean([per_label[c]["bleu"] for c in classes]))
    result = {
        "accuracy": accuracy, "bleu": bleu, "g_score": math.sqrt(max(accuracy, 0.0) * max(bleu, 0.0) / 100.0),
        "self_bleu": float(np.mean([per_label[c]["self_bleu"] for c in classes])),
        "per_label": per_label, "classifier_test_accuracy": judge_accuracy,
        "prior_label_rates": {c: float(np.mean(prior_labels == c)) for c in classes},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "estimators": {
            "accuracy": f"share of {args.samples_per_label} generated sentences per label that the judge (TF-IDF "
                        f"1-2-grams + logistic regression on train.tsv, test accuracy {judge_accuracy:.3f} on "
                        f"{len(test_s)} sentences) assigns the intended label; mean over labels",
            "bleu": "mean sacreBLEU sentence BLEU (x100) against the test sentences of the same label",
            "self_bleu": "mean sacreBLEU sentence BLEU (x100) against the other generated sentences of the label",
            "g_score": "sqrt(accuracy x BLEU/100) (Table 6's geometric mean)",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    random.seed(args.seed)
    try:
        result = run(args)
    except VAEConfigError as error:
        return command_error("optimus-cond-gen", error)
    print(f"accuracy {result['accuracy']:.3f}  BLEU {result['bleu']:.2f}  G-score {result['g_score']:.3f}  "
          f"Self-BLEU {result['self_bleu']:.2f}  (judge test accuracy {result['classifier_test_accuracy']:.3f})")
    for label, entry in result["per_label"].items():
        for sentence in entry["samples"]:
            print(f"label {label}\t{sentence}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
