"""Evaluation of a trained sentence VAE on a binarized split (the ``vae-eval`` command).

For every sentence x of the split (target = sentence + EOS):

* ``log p(x)`` >= L_k, the importance-weighted bound with k samples of q(z|x) (Burda et al.
  2015; Optimus eq. 15, k = 100 in Optimus' code), computed in chunks: each chunk of n samples
  is scored by ONE decoder pass over the ``[n * B]`` expanded batch;
* the one-sample ELBO, its reconstruction term log p(x|z) and the analytic KL of every latent
  (QKVAE eq. 1);
* the posterior means and log-variances, from which, over the whole split, the mutual
  information I_q(x, z) with the aggregate posterior (Optimus Appendix A, He et al. 2019) and
  the active units (Cov_x E_q[z] > 0.01, Optimus Appendix C.1) are computed per latent and for
  all latents together.

Reported (nats; "per sentence" = averaged over sentences):

* ``iw_ppl`` = exp(-sum_x L_k(x) / N_tok), N_tok = target tokens incl. EOS (fairseq's ntokens);
* ``elbo_ppl`` = exp(-sum_x ELBO(x) / N_tok) (>= iw_ppl in expectation);
* ``iw_ppl_word`` / ``elbo_ppl_word``: the same per word, N_word = whitespace words of the
  detokenised target + 1 (end of sentence), for tasks whose tokens are not words
  (``optimus_lm``: GPT-2 BPE); the LSTM-VAE literature's unit, not Optimus' (see below);
* ``ppl_qkvae_units`` and ``ppl_optimus_units``: the IW perplexity in the unit of each paper's
  tables, exp(-sum_x L_k(x) / (N_tok + N_sent)): every token of the model's sequence counted
  with the start token as well as the end token (QKVAE's ``get_perplexity`` counts all
  non-pad tokens of ``<s> x </s>``; Optimus' ``calc_iwnll`` divides by the GPT-2 length of
  ``<BOS> x <EOS>``, which its tables call "words"). The two papers count alike; the value
  is given under both names so a table can cite the paper it compares with. They compare
  with a paper's number only on that paper's tokenisation (BART BPE, GPT-2 BPE);
* ``nll`` = -mean L_k(x); ``elbo`` = mean ELBO(x); ``rec`` = mean -log p(x|z), z ~ q(z|x);
* ``kl`` / ``kl_<latent>`` = mean KL(q(z|x) || N(0, I)), all latents / one latent;
* ``mi`` / ``mi_<latent>``: I_q(x, z) of the joint / of one latent;
* ``au`` / ``au_<latent>``: active units, total / of one latent;
* ``rec_bleu``: corpus BLEU (sacrebleu; ``tokenize="none"`` on the data's own tokens for
  ``sentence_vae``, sacreBLEU's ``13a`` on detokenised text for ``optimus_lm``) of greedy
  reconstructions decoded from the posterior means against the input sentences (skipped with
  ``--no-bleu``);
* ``iw_seconds_per_sentence``: wall time of the IW estimate per sentence (with k, chunk size
  and batch size as given).

Random numbers come from one generator seeded with ``--seed``: the IW estimate draws all k
noise vectors of a batch before its first chunk, so it does not depend on ``--chunk-size``.
"""

import argparse
import json
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from fairseq import utils
import numpy as np
from fairseq.data import BaseWrapperDataset

from latent_core.errors import check_positive_int
from latent_core.vae import (
    VAEConfigError,
    active_units,
    elbo_terms,
    importance_weighted_log_likelihood,
    MIEstimate,
    mutual_information,
    perplexity,
    principal_variance_shares,
    standard_error,
)

from user_dir.sentence_vae.base import posteriors_of, reorder_encoder_output
from user_dir.sentence_vae.checkpoint import load_sentence_vae, model_device
from user_dir.sentence_vae.decoding import LatentDecoder, generation_args
from user_dir.tools.sentence_vae import console_entry

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------- scoring
def log_likelihood_fn(model, encoder_out, prev_output_tokens, target, pad: int):
    """The ``log_likelihood_fn`` of :mod:`latent_core.vae.evaluation` for one batch.

    Maps samples {latent: ``[n, B, D]``} to log p(x | z_i) ``[n, B]`` (summed over the target
    tokens) with one decoder pass over the ``[n * B]`` batch whose row i * B + b is sentence b
    with sample i.
    """
    batch = target.size(0)

    def fn(samples: Dict[str, torch.Tensor]) -> torch.Tensor:
        n = next(iter(samples.values())).size(0)
        rows = torch.arange(batch, device=target.device).repeat(n)  # [n * B]: 0..B-1, 0..B-1, ...
        expanded = reorder_encoder_output(encoder_out, rows)
        expanded["latents"] = {name: z.reshape(n * batch, -1) for name, z in samples.items()}
        net_output = model.decoder(prev_output_tokens.index_select(0, rows), encoder_out=expanded)
        lprobs = model.get_normalized_probs(net_output, log_probs=True)  # [n * B, T, V]
        tgt = target.index_select(0, rows)
        token_ll = lprobs.gather(-1, tgt.unsqueeze(-1)).squeeze(-1).masked_fill(tgt.eq(pad), 0.0)
        return token_ll.float().sum(-1).view(n, batch)

    return fn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SentenceSubset(BaseWrapperDataset):
    """The sentences ``indices`` of a dataset (fairseq's SubsampleDataset cannot order pair datasets)."""

    def __init__(self, dataset, indices):
        super().__init__(dataset)
        self.indices = np.sort(np.asarray(indices))

    def __getitem__(self, index):
        return self.dataset[int(self.indices[index])]

    def __len__(self):
        return len(self.indices)

    def num_tokens(self, index):
        return self.dataset.num_tokens(int(self.indices[index]))

    def size(self, index):
        return self.dataset.size(int(self.indices[index]))

    def ordered_indices(self):
        return np.argsort([self.num_tokens(i) for i in range(len(self))], kind="mergesort")

    def filter_indices_by_size(self, indices, max_sizes):
        return indices, []


@dataclass
class SplitRecords:
    """What :func:`evaluate_split` keeps of each batch: per-sentence values (float64, CPU) and the
    posteriors of every latent, from which every metric is computed at the end."""

    latents: List[str]
    log_px: List[torch.Tensor] = field(default_factory=list)  # L_k per sentence
    elbo: List[torch.Tensor] = field(default_factory=list)
    reconstruction: List[torch.Tensor] = field(default_factory=list)  # E_q log p(x|z)
    kl: Dict[str, List[torch.Tensor]] = field(default_factory=dict)  # per latent
    tokens: List[torch.Tensor] = field(default_factory=list)
    words: List[torch.Tensor] = field(default_factory=list)  # only where the task counts words
    means: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    logvars: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    num_tokens: int = 0
    num_words: int = 0
    iw_seconds: float = 0.0
    hypotheses: List[str] = field(default_factory=list)
    references: List[str] = field(default_factory=list)

    def __post_init__(self):
        for store in (self.kl, self.means, self.logvars):
            store.update({name: [] for name in self.latents})

    @property
    def num_sentences(self) -> int:
        return sum(len(t) for t in self.log_px)

    def cat(self, name: str) -> torch.Tensor:
        return torch.cat(getattr(self, name))

    def per_latent(self, store: Dict[str, List[torch.Tensor]]) -> Dict[str, torch.Tensor]:
        return {name: torch.cat(values) for name, values in store.items()}


def evaluation_batches(model, task, subset: str, batch_size: int, seed: int, max_sentences: Optional[int]):
    """The batches of ``subset`` (loaded here), in order; a random (``seed``) subset of
    ``max_sentences`` sentences when given."""
    task.load_dataset(subset, combine=False, epoch=1)
    dataset = task.dataset(subset)
    if max_sentences is not None:
        if max_sentences < 1:
            raise VAEConfigError(f"--max-sentences={max_sentences} must be >= 1")
        if max_sentences < len(dataset):
            chosen = np.random.default_rng(seed).choice(len(dataset), size=max_sentences, replace=False)
            dataset = SentenceSubset(dataset, chosen)
    return task.get_batch_iterator(
        dataset=dataset, max_tokens=None, max_sentences=batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=False, seed=seed, num_workers=0,
    ).next_epoch_itr(shuffle=False)


def record_batch(records: SplitRecords, model, task, sample, k: int, chunk_size: int, generator,
                 greedy: Optional["LatentDecoder"], device: torch.device) -> None:
    """The bounds, KLs and posteriors of one batch (and its greedy reconstructions for BLEU);
    ``device``: the model's, for the timing's synchronisation."""
    pad = task.target_dictionary.pad()
    net_input = dict(sample["net_input"])
    prev_output_tokens = net_input.pop("prev_output_tokens")
    encoder_out = model.encoder(**net_input)
    posteriors = posteriors_of(encoder_out)
    fn = log_likelihood_fn(model, encoder_out, prev_output_tokens, sample["target"], pad)
    _sync(device)
    start = time.perf_counter()
    log_px = importance_weighted_log_likelihood(fn, posteriors, k, chunk_size, generator)  # [B]
    _sync(device)
    records.iw_seconds += time.perf_counter() - start
    terms = elbo_terms(fn, posteriors, generator)
    records.log_px.append(log_px.double().cpu())
    records.elbo.append(terms.elbo.double().cpu())
    records.reconstruction.append(terms.reconstruction.double().cpu())
    records.tokens.append(sample["target"].ne(pad).sum(-1).double().cpu())
    for name in records.latents:
        records.kl[name].append(terms.kl[name].double().cpu())
        records.means[name].append(posteriors[name].mean.float().cpu())
        records.logvars[name].append(posteriors[name].logvar.float().cpu())
    records.num_tokens += int(sample["ntokens"])
    if greedy is not None:
        records.hypotheses += greedy.reconstruct_batch(net_input["src_tokens"], net_input["src_lengths"])
        records.references += [task.target_text(utils.strip_pad(t, pad).int().cpu()) for t in sample["target"]]
    words = [task.target_word_count(utils.strip_pad(t, pad).cpu()) for t in sample["target"]]
    if None not in words:  # no word unit: target_word_count -> None
        records.num_words += sum(words)
        records.words.append(torch.tensor(words, dtype=torch.float64))


def likelihood_metrics(records: SplitRecords, seed: int) -> "OrderedDict[str, float]":
    """Perplexities (per token, per word, in the papers' unit), per-sentence NLL, ELBO, reconstruction
    and KL, their standard errors and the bootstrap interval of the perplexity."""
    log_px, elbo = records.cat("log_px"), records.cat("elbo")
    kl = sum(records.per_latent(records.kl).values())
    iw_sum, elbo_sum = float(log_px.sum()), float(elbo.sum())
    num_tokens, num_words, num_sentences = records.num_tokens, records.num_words, records.num_sentences
    results = OrderedDict()
    results["iw_ppl"] = perplexity(iw_sum, num_tokens)
    results["elbo_ppl"] = perplexity(elbo_sum, num_tokens)
    if num_words:
        results["iw_ppl_word"] = perplexity(iw_sum, num_words)
        results["elbo_ppl_word"] = perplexity(elbo_sum, num_words)
    # both papers count the start token of every sentence too: one value, each paper's name
    results["ppl_qkvae_units"] = results["ppl_optimus_units"] = perplexity(iw_sum, num_tokens + num_sentences)
    results["nll"] = -iw_sum / num_sentences
    results["elbo"] = elbo_sum / num_sentences
    results["rec"] = float(-records.cat("reconstruction").sum()) / num_sentences
    results["kl"] = float(kl.sum()) / num_sentences
    results["nll_se"] = standard_error(log_px)
    results["elbo_se"] = standard_error(elbo)
    results["kl_se"] = standard_error(kl)
    low, high = bootstrap_perplexity_interval(log_px, records.cat("tokens"), seed=seed)
    results["iw_ppl_ci95_low"], results["iw_ppl_ci95_high"] = low, high
    if num_words:
        low, high = bootstrap_perplexity_interval(log_px, records.cat("words"), seed=seed)
        results["iw_ppl_word_ci95_low"], results["iw_ppl_word_ci95_high"] = low, high
    return results


def latent_space_metrics(records: SplitRecords, latent_sizes, mi_samples: int, au_threshold: float,
                         seed: int) -> "OrderedDict[str, float]":
    """MI, active units and the first principal component's share, of all latents together and of each."""
    means, logvars = records.per_latent(records.means), records.per_latent(records.logvars)
    kl = records.per_latent(records.kl)
    latents, num_sentences = records.latents, records.num_sentences
    mi_generator = torch.Generator().manual_seed(seed)
    joint_means = torch.cat([means[n] for n in latents], -1)  # every latent's posterior means, [N, sum D]
    joint_mi = mutual_information(joint_means, torch.cat([logvars[n] for n in latents], -1),
                                  num_samples=mi_samples, generator=mi_generator)
    au_counts = {name: active_units(means[name], au_threshold)[0] for name in latents}
    results = OrderedDict()
    results["mi"], results["mi_se"] = joint_mi.value, joint_mi.standard_error
    results["au"] = sum(au_counts.values())
    results["pc1_share"] = float(principal_variance_shares(joint_means)[0])
    for name in latents:
        results[f"kl_{name}"] = float(kl[name].sum()) / num_sentences
        latent_mi = mutual_information(means[name], logvars[name], num_samples=mi_samples, generator=mi_generator)
        results[f"mi_{name}"], results[f"mi_se_{name}"] = latent_mi.value, latent_mi.standard_error
        results[f"au_{name}"] = au_counts[name]
        results[f"pc1_share_{name}"] = float(principal_variance_shares(means[name])[0])
        results[f"dim_{name}"] = int(latent_sizes[name])
    results["mi_max_log_n"] = joint_mi.log_n
    return results


@torch.no_grad()
def evaluate_split(model, task, subset: str = "test", k: int = 100, chunk_size: int = 10,
                   batch_size: int = 32, seed: int = 1, mi_samples: int = 10,
                   au_threshold: float = 0.01, max_sentences: Optional[int] = None,
                   bleu: bool = True) -> "OrderedDict[str, float]":
    """All metrics of the module doc for ``subset`` (loaded here with ``task.load_dataset``).

    ``max_sentences``: evaluate a random (``seed``) subset of that many sentences instead.
    """
    for option, value in (("--k", k), ("--chunk-size", chunk_size), ("--batch-size", batch_size),
                          ("--mi-samples", mi_samples)):
        check_positive_int(option, value, VAEConfigError)
    model.eval()
    device = model_device(model)
    batches = evaluation_batches(model, task, subset, batch_size, seed, max_sentences)
    generator = torch.Generator(device=device).manual_seed(seed)
    greedy = LatentDecoder(model, task, generation_args(beam=1), batch_size=batch_size) if bleu else None
    records = SplitRecords(list(model.latent_sizes))
    for sample in batches:
        sample = utils.move_to_cuda(sample, device=device) if device.type == "cuda" else sample
        record_batch(records, model, task, sample, k, chunk_size, generator, greedy, device)
    if records.num_sentences < 2:
        raise ValueError(f"split {subset!r} has {records.num_sentences} sentence(s); MI and AU need at least 2")

    results = likelihood_metrics(records, seed)
    latent = latent_space_metrics(records, model.latent_sizes, mi_samples, au_threshold, seed)
    mi_max_log_n = latent.pop("mi_max_log_n")  # reported with the estimator settings below
    results.update(latent)
    if bleu:
        import sacrebleu

        results["rec_bleu"] = sacrebleu.corpus_bleu(records.hypotheses, [records.references],
                                                    tokenize=task.bleu_tokenize).score
    results["num_sentences"] = records.num_sentences
    results["num_tokens"] = records.num_tokens
    if records.num_words:
        results["num_words"] = records.num_words
    results["k"] = k
    results["chunk_size"] = chunk_size
    results["batch_size"] = batch_size
    results["mi_samples"] = mi_samples
    results["mi_max_log_n"] = mi_max_log_n
    results["iw_seconds_per_sentence"] = records.iw_seconds / records.num_sentences
    results["estimators"] = estimators(k, mi_samples, records.num_sentences, bool(records.num_words),
                                       task.bleu_tokenize)
    return results


def bootstrap_perplexity_interval(log_px: torch.Tensor, tokens: torch.Tensor, resamples: int = 1000,
                                  seed: int = 1, level: float = 0.95):
    """Percentile bootstrap interval over sentences of exp(-sum log p(x) / sum tokens)."""
    rng = np.random.default_rng(seed)
    log_px, tokens = log_px.numpy(), tokens.numpy()
    picks = rng.integers(0, len(log_px), size=(resamples, len(log_px)))
    values = np.exp(-log_px[picks].sum(1) / tokens[picks].sum(1))
    tail = 100 * (1 - level) / 2
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


def estimators(k: int, mi_samples: int, num_sentences: int, per_word: bool = False,
               bleu_tokenize: str = "none") -> Dict[str, str]:
    """What each reported number estimates and from how many samples (written to the JSON)."""
    described = {
        "iw_ppl": f"importance-weighted bound L_k, k={k} samples of q(z|x) per sentence (Burda et al.; "
                  f"Optimus eq. 15), {num_sentences} sentences; 95% interval: percentile bootstrap over "
                  "sentences, 1,000 resamples",
        "elbo": "one reparameterised sample of q(z|x) per sentence for log p(x|z), analytic KL",
        "kl": "analytic KL(q(z|x) || N(0, I)), mean over sentences",
        "mi": f"{MIEstimate.ESTIMATOR}; {mi_samples} sample(s) per sentence, N={num_sentences}; cannot "
              f"exceed log N = {math.log(num_sentences):.2f} nats, so values from sets of other sizes "
              "(e.g. the papers') do not compare",
        "au": "Cov_x(E_q[z]) per dimension (unbiased) >= threshold, over the evaluated sentences",
        "pc1_share": "share of the total variance of E_q[z] over the evaluated sentences along its first "
                     "principal direction (1: the means vary along one line, however many units are active)",
        "standard_errors": "*_se: std over sentences / sqrt(N)",
        "ppl_unit": "iw_ppl/elbo_ppl: per target token incl. the end token (fairseq's ntokens)"
                    + ("; *_ppl_word: per word = whitespace words of the detokenised target + 1 for the end "
                       "of the sentence (the LSTM-VAE literature's unit, He et al. 2019; not Optimus' tables', "
                       "see ppl_optimus_units)" if per_word else ""),
        "rec_bleu": f"sacreBLEU corpus BLEU, tokenize={bleu_tokenize!r}, greedy reconstructions from the "
                    "posterior means",
        "ppl_qkvae_units": f"iw_ppl's bound (k={k}) per token of <s> x </s>: target tokens incl. the end "
                           "token + 1 start token per sentence, as QKVAE's get_perplexity counts (models.py); "
                           "compares with QKVAE's tables only on BART's BPE",
        "ppl_optimus_units": f"iw_ppl's bound (k={k}) per token of <BOS> x <EOS> (Optimus' calc_iwnll "
                             "report_num_words = GPT-2 length incl. both; its tables' 'per word' unit); "
                             "compares with Optimus' tables only on GPT-2's BPE (task optimus_lm)",
    }
    return described


# ----------------------------------------------------------------------------- CLI
DESCRIPTIONS = OrderedDict([
    ("iw_ppl", "perplexity of the IW bound, exp(-sum L_k / tokens)"),
    ("elbo_ppl", "perplexity of the ELBO, exp(-sum ELBO / tokens)"),
    ("iw_ppl_word", "perplexity of the IW bound per word, exp(-sum L_k / words)"),
    ("elbo_ppl_word", "perplexity of the ELBO per word, exp(-sum ELBO / words)"),
    ("ppl_qkvae_units", "IW perplexity per token incl. start and end (QKVAE's tables' unit)"),
    ("ppl_optimus_units", "IW perplexity per token incl. BOS and EOS (Optimus' tables' unit)"),
    ("num_words", "words of the evaluated targets (whitespace words + 1 end token each)"),
    ("nll", "-L_k per sentence (nats)"),
    ("elbo", "ELBO per sentence (nats)"),
    ("rec", "reconstruction NLL per sentence (nats)"),
    ("kl", "KL(q(z|x) || p(z)) per sentence (nats)"),
    ("mi", "mutual information I_q(x, z) (nats; at most log N)"),
    ("au", "active units (Cov_x E[z] >= threshold)"),
    ("pc1_share", "share of the variance of E[z] along its first principal direction"),
    ("rec_bleu", "BLEU of greedy reconstructions from the posterior means"),
    ("mi_samples", "z samples per sentence of the MI estimate"),
])


def describe(key: str) -> str:
    """What a result key means (the per-latent keys are ``<metric>_<latent>``)."""
    if key in DESCRIPTIONS:
        return DESCRIPTIONS[key]
    if key.startswith("mi_se"):
        latent = key[len("mi_se_"):]
        return "standard error of the MI estimate" + (f", latent {latent}" if latent else "")
    if key.endswith("_se") and key[:-3] in DESCRIPTIONS:
        return f"standard error of: {DESCRIPTIONS[key[:-3]]}"
    if key.startswith("iw_ppl_word_ci95"):
        return "95% bootstrap interval of iw_ppl_word over sentences"
    if key.startswith("iw_ppl_ci95"):
        return "95% bootstrap interval of iw_ppl over sentences"
    if key == "mi_max_log_n":
        return "log N: the largest MI this estimator can return on N sentences"
    metric, _, latent = key.partition("_")
    if metric in ("kl", "mi", "au") and latent:
        return f"{DESCRIPTIONS[metric]}, latent {latent}"
    if metric == "dim" and latent:
        return f"size of latent {latent}"
    return ""


def format_table(results: Dict[str, float]) -> str:
    """A text table of the results, one metric a line: key, value, meaning."""
    lines = [f"{'metric':<26} {'value':>14}  meaning"]
    for key, value in results.items():
        if isinstance(value, dict):
            continue
        text = f"{value:.6g}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<26} {text:>14}  {describe(key)}".rstrip())
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Importance-weighted perplexity, ELBO, KL, MI and active units of a sentence-VAE "
                    "checkpoint (any model of user_dir/sentence_vae/base.py's interface)."
    )
    parser.add_argument("data", metavar="DATA_BIN",
                        help="directory binarized with `fairseq-preprocess --only-source` (dict.txt, SPLIT.bin)")
    parser.add_argument("--path", required=True, metavar="CKPT", help="fairseq checkpoint of a sentence VAE")
    parser.add_argument("--subset", default="test", help="split to evaluate (default: test)")
    parser.add_argument("--k", type=int, default=100, help="importance samples per sentence (Optimus: 100)")
    parser.add_argument("--chunk-size", type=int, default=10,
                        help="samples scored per decoder pass (memory ~ chunk x batch decoder passes)")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per batch")
    parser.add_argument("--mi-samples", type=int, default=10,
                        help="z samples per sentence of the MI estimate (default 10; each costs one N x N density)")
    parser.add_argument("--au-threshold", type=float, default=0.01, help="active-unit variance threshold")
    parser.add_argument("--max-sentences", type=int, default=None,
                        help="evaluate a random subset of this many sentences (default: all)")
    parser.add_argument("--no-bleu", action="store_true",
                        help="skip the reconstruction BLEU (greedy decoding of every sentence)")
    parser.add_argument("--seed", type=int, default=1, help="seed of every sample drawn")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is available")
    return parser


def main(argv: Optional[List[str]] = None) -> "OrderedDict[str, float]":
    args = build_parser().parse_args(argv)
    torch.manual_seed(args.seed)
    model, task, _ = load_sentence_vae(args.path, data=args.data, cpu=args.cpu)
    results = evaluate_split(model, task, args.subset, k=args.k, chunk_size=args.chunk_size,
                             batch_size=args.batch_size, seed=args.seed, mi_samples=args.mi_samples,
                             au_threshold=args.au_threshold, max_sentences=args.max_sentences,
                             bleu=not args.no_bleu)
    results["checkpoint"] = args.path
    results["subset"] = args.subset
    print(format_table(results))
    for name, text in results["estimators"].items():
        print(f"estimator {name}: {text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


cli_main = console_entry("vae-eval", main)


if __name__ == "__main__":
    raise SystemExit(cli_main())
