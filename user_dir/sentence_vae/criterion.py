"""``sentence_vae`` criterion: the beta-weighted negative ELBO of a sentence VAE.

    loss = NLL(x | z) + sum_latent beta_latent(t) * KL_term_latent,       z ~ q(z | x)

(QKVAE eq. 1 with one beta per latent, Section 4.3; Optimus eq. 5-6 and 9.) NLL is the
reconstruction cross-entropy summed over the target tokens (sentence + EOS), optionally
label-smoothed (``--label-smoothing``, default 0); KL_term is the KL of each latent's
posterior from N(0, I) through :class:`latent_core.vae.KLRegularizer` (``--kl-variant``
beta|free_bits|hinge with threshold lambda ``--kl-threshold``, ``--kl-scope``,
``--kl-granularity``), summed over the batch. beta_latent(t) comes from ``--beta-schedule``
(``--ae-steps``: beta = 0 before that update) as a pure function of fairseq's update counter t.

**Sample size.** fairseq's token convention: the gradient is divided by the number of target
tokens ``ntokens`` (sentence + EOS, no padding), so the optimised quantity is the negative
(beta-)ELBO per token; ``--sentence-avg`` divides by the number of sentences instead, and so
does a model whose ``sentence_average_loss`` is true (QKVAE's ``--qkvae-reading authors``).

**Where t comes from.** fairseq passes the update count to models only, never to criterions:
``task.train_step`` calls ``model.set_num_updates(update_num)``, and so do checkpoint resume
(``Trainer.load_checkpoint``) and ``checkpoint_utils.load_model_ensemble_and_task``. The
``sentence_vae`` task attaches an :class:`~user_dir.sentence_vae.base.UpdateCounter` to its
models, and this criterion reads t from it, so a resumed run continues its schedule and
``fairseq-validate`` uses the checkpoint's beta. For a model not built by the task, t is the
value given to :meth:`SentenceVAECriterion.set_num_updates` (0 by default).

**Training vs. validation.** In training the model's forward samples z (reparameterised); in
evaluation mode a sentence-VAE encoder returns the posterior means, so the criterion draws
z ~ q(z|x) itself and decodes it: validation reports a one-sample ELBO, not the
deterministic (mean) reconstruction.

**Logged keys** (all logging outputs are sums, so ``logging_outputs_can_be_summed()`` holds
and DDP reduction is exact):

* ``loss``: the objective above per sample-size unit, base 2 (fairseq's convention);
* ``nll_loss``: reconstruction NLL per target token, base 2 (fairseq's convention);
* ``rec``: reconstruction NLL per target token, nats;
* ``kl``, ``kl_<latent>``: raw KL(q(z|x) || p(z)) per sentence (summed over dimensions,
  averaged over sentences), nats; ``kl`` sums the latents;
* ``kl_penalty_<latent>``: the thresholded KL (what beta multiplies) per sentence, nats;
* ``beta_<latent>``: the latent's beta at the current update (averaged over the logged batches);
* ``elbo``: the ELBO, -(NLL + sum KL), per sentence, nats (unsmoothed, unthresholded, beta = 1);
* ``neg_elbo_tok``: -ELBO per target token, nats;
* ``ppl``: the ELBO-based perplexity exp(-sum ELBO / sum ntokens) = exp(neg_elbo_tok), an upper
  bound of the true perplexity (evaluate the IW bound with ``vae-eval``).
"""

import math
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence

from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import metrics
from omegaconf import II

from latent_core.vae import (
    KL_GRANULARITIES,
    KL_SCOPES,
    KL_VARIANTS,
    KLRegularizer,
    VAEConfigError,
    parse_beta_schedules,
    parse_schedule,
)
from latent_core.vae.kl import DEFAULT_KL_THRESHOLD, THRESHOLD_OPTION, parse_kl_thresholds
from user_dir.model_wrappers import unwrap_model

from .base import AutoEncodingPhase, posteriors_of, sentence_vae_model
from .task import SentenceVAETask, model_num_updates

DEFAULT_KL_VARIANT = "free_bits"  # QKVAE's (and Optimus' eq. 9); a model may name another


@dataclass
class SentenceVAECriterionConfig(FairseqDataclass):
    beta_schedule: str = field(
        default="constant:1.0",
        metadata={"help": "beta of every latent as a function of the update: comma-separated "
                          "[LATENT=]SCHEDULE with SCHEDULE constant:BETA | linear:START:END:BETA_MAX | "
                          "cyclical:N_CYCLES:ZERO:INCREASE:CONSTANT[:BETA_MAX[:TOTAL_STEPS]]; e.g. QKVAE "
                          "z_sem=linear:3000:6000:0.6,z_syn=linear:7000:20000:0.3 (with --ae-steps 3000), "
                          "Optimus cyclical:10:0.5:0.25:0.25"},
    )
    ae_steps: int = field(
        default=0, metadata={"help": "auto-encoder phase: beta = 0 for every latent before this update"}
    )
    kl_variant: Optional[ChoiceEnum(KL_VARIANTS)] = field(
        default=None,
        metadata={"help": "beta: beta*KL; free_bits: beta*sum max(lambda, KL_u) (QKVAE, Optimus eq. 9); "
                          "hinge: beta*sum KL_u [KL_u > lambda] (Optimus' code). Default: the model's "
                          "(hinge for optimus, free_bits otherwise)"},
    )
    kl_threshold: str = field(
        default=str(DEFAULT_KL_THRESHOLD),
        metadata={"help": "lambda in nats per unit (QKVAE: 0.05): a number, or comma-separated "
                          "[LATENT=]NUMBER, e.g. z_syn=0.05,z_sem=0.05"},
    )
    kl_scope: ChoiceEnum(KL_SCOPES) = field(
        default="example", metadata={"help": "threshold each example's KL, or the batch-mean KL"}
    )
    kl_granularity: ChoiceEnum(KL_GRANULARITIES) = field(
        default="dimension", metadata={"help": "threshold unit: each latent dimension, or a whole latent"}
    )
    total_updates: Optional[int] = field(
        default=None,
        metadata={"help": "length of cyclical schedules without TOTAL_STEPS (default: --max-update; set it "
                          "when a resumed run changes --max-update, so the cycles stay put)"},
    )
    label_smoothing: float = field(
        default=0.0, metadata={"help": "label smoothing of the reconstruction loss (0: none)"}
    )
    sentence_avg: bool = II("optimization.sentence_avg")
    max_update: int = II("optimization.max_update")


@register_criterion("sentence_vae", dataclass=SentenceVAECriterionConfig)
class SentenceVAECriterion(FairseqCriterion, AutoEncodingPhase):
    def __init__(self, task, cfg: SentenceVAECriterionConfig):
        super().__init__(task)
        self.cfg = cfg
        if not (0.0 <= cfg.label_smoothing < 1.0):
            raise VAEConfigError(f"--label-smoothing={cfg.label_smoothing} must lie in [0, 1)")
        self.sentence_avg = bool(cfg.sentence_avg)
        self.total_updates = cfg.total_updates
        if self.total_updates is None and cfg.max_update and cfg.max_update > 0:
            self.total_updates = int(cfg.max_update)
        if self.total_updates is not None and self.total_updates < 1:
            raise VAEConfigError(f"--total-updates={self.total_updates} must be >= 1")
        # Fail at start-up, before any data is read: every schedule and threshold must parse.
        if isinstance(cfg.ae_steps, bool) or not isinstance(cfg.ae_steps, int) or cfg.ae_steps < 0:
            raise VAEConfigError(f"--ae-steps={cfg.ae_steps} must be an integer number of updates >= 0")
        self.ae_steps = cfg.ae_steps
        for entry in cfg.beta_schedule.split(","):
            parse_schedule(entry.rpartition("=")[2], self.total_updates)
        self.thresholds = parse_kl_thresholds(cfg.kl_threshold)
        # --kl-variant, else the model's default_kl_variant (known here when the task built the model first)
        built = task.built_model_defaults if isinstance(task, SentenceVAETask) else None
        self.kl_variant = cfg.kl_variant or (built.default_kl_variant if built else DEFAULT_KL_VARIANT)
        for latent, value in self.thresholds.items():
            KLRegularizer(self.kl_variant, value, cfg.kl_scope, cfg.kl_granularity)
        self.num_updates = 0
        self._latents: Optional[tuple] = None
        self.schedules: Dict[str, object] = {}
        self.regularizers: Dict[str, KLRegularizer] = {}
        if built:
            self.configure_latents(tuple(built.latent_sizes))

    # ------------------------------------------------------------ configuration
    def configure_latents(self, latents: Sequence[str], kl_variant: Optional[str] = None) -> None:
        """Build the per-latent schedules and regularisers (checks latent names in the specs);
        ``kl_variant``: the model's default, used unless ``--kl-variant`` was given."""
        latents = tuple(latents)
        variant = self.cfg.kl_variant or kl_variant or self.kl_variant
        if latents == self._latents and variant == self.kl_variant:
            return
        self.kl_variant = variant
        self.schedules = parse_beta_schedules(self.cfg.beta_schedule, latents, self.cfg.ae_steps,
                                              self.total_updates)
        unknown = [name for name in self.thresholds if name is not None and name not in latents]
        if unknown:
            raise VAEConfigError(
                f"{THRESHOLD_OPTION}: unknown latent(s) {', '.join(unknown)}; the latents are {', '.join(latents)}"
            )
        missing = [name for name in latents if name not in self.thresholds and None not in self.thresholds]
        if missing:
            raise VAEConfigError(f"{THRESHOLD_OPTION}: no threshold for latent(s) {', '.join(missing)}")
        self.regularizers = {
            name: KLRegularizer(self.kl_variant, self.thresholds.get(name, self.thresholds.get(None)),
                                self.cfg.kl_scope, self.cfg.kl_granularity)
            for name in latents
        }
        self._latents = latents

    def set_num_updates(self, num_updates: int) -> None:
        """The update count for models that carry no task counter (see the module doc)."""
        self.num_updates = int(num_updates)

    def current_num_updates(self, model) -> int:
        counted = model_num_updates(model)
        return self.num_updates if counted is None else counted

    def betas(self, num_updates: int) -> Dict[str, float]:
        """beta of every latent at update ``num_updates``."""
        return {name: float(schedule(num_updates)) for name, schedule in self.schedules.items()}

    # ------------------------------------------------------------------ forward
    def net_output(self, model, sample):
        """(logits, extra) with z ~ q(z|x) also in evaluation mode (see the module doc)."""
        if model.training:
            return model(**sample["net_input"])
        inner = unwrap_model(model)
        net_input = dict(sample["net_input"])
        prev_output_tokens = net_input.pop("prev_output_tokens")
        encoder_out = inner.encoder(**net_input)
        encoder_out["latents"] = {name: q.rsample() for name, q in posteriors_of(encoder_out).items()}
        return inner.decoder(prev_output_tokens, encoder_out=encoder_out)

    def forward(self, model, sample, reduce=True):
        """-> (loss, sample_size, logging_output); loss is summed over the batch."""
        inner = sentence_vae_model(model, "the sentence_vae criterion")
        self.configure_latents(tuple(inner.latent_sizes), inner.default_kl_variant)
        net_output = self.net_output(model, sample)
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        target = model.get_targets(sample, net_output)
        rec_loss, nll_loss = label_smoothed_nll_loss(
            lprobs.view(-1, lprobs.size(-1)), target.view(-1), self.cfg.label_smoothing,
            ignore_index=self.padding_idx, reduce=True,
        )
        posteriors = net_output[1]["posteriors"]
        num_updates = self.current_num_updates(model)
        betas = self.betas(num_updates)
        kl_loss, terms = self.kl_terms(posteriors, betas, num_updates)
        loss = rec_loss + kl_loss
        nsentences = sample["target"].size(0)
        sentence_avg = self.sentence_avg or inner.sentence_average_loss
        sample_size = nsentences if sentence_avg else sample["ntokens"]
        kl_total = sum(term.kl.sum() for term in terms.values())
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": nsentences,
            "sample_size": sample_size,
            "vae_neg_elbo": (nll_loss + kl_total).data,  # nats, summed over sentences
            "kl": kl_total.data,
        }
        for name, term in terms.items():
            logging_output[f"kl_{name}"] = term.kl.sum().data
            logging_output[f"kl_penalty_{name}"] = term.penalty.detach()
            logging_output[f"beta_{name}"] = betas[name] * nsentences  # divided by nsentences in reduce
        return loss, sample_size, logging_output

    def kl_terms(self, posteriors: Mapping, betas: Mapping[str, float], num_updates: int):
        """Sum over latents of beta * KL_term, and the per-latent :class:`KLTerm`."""
        if set(posteriors) != set(self.regularizers):
            raise KeyError(f"the decoder returned posteriors of {sorted(posteriors)}, "
                           f"but model.latent_sizes names {sorted(self.regularizers)}")
        terms = {}
        for name, reg in self.regularizers.items():
            try:
                terms[name] = reg(posteriors[name].kl_standard_normal(), betas[name], name)
            except FloatingPointError as err:
                raise FloatingPointError(
                    f"{err} at update {num_updates} (sentence_vae criterion): training stopped. Lower the "
                    "learning rate, check the encoder's log-variance and the input data; the last "
                    "checkpoint is intact"
                ) from err
        return sum(term.loss for term in terms.values()), terms

    # ------------------------------------------------------------------ logging
    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        def total(key):
            return sum(float(log.get(key, 0)) for log in logging_outputs)

        sample_size, ntokens, nsentences = total("sample_size"), total("ntokens"), total("nsentences")
        if not sample_size or not ntokens or not nsentences:
            return
        metrics.log_scalar("loss", total("loss") / sample_size / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", total("nll_loss") / ntokens / math.log(2), ntokens, round=3)
        metrics.log_scalar("rec", total("nll_loss") / ntokens, ntokens, round=3)
        metrics.log_scalar("kl", total("kl") / nsentences, nsentences, round=3)
        metrics.log_scalar("elbo", -total("vae_neg_elbo") / nsentences, nsentences, round=3)
        metrics.log_scalar("neg_elbo_tok", total("vae_neg_elbo") / ntokens, ntokens, round=5)
        metrics.log_derived("ppl", lambda meters: _safe_exp(meters["neg_elbo_tok"].avg))
        latents = sorted({key[len("beta_"):] for log in logging_outputs for key in log if key.startswith("beta_")})
        for name in latents:
            metrics.log_scalar(f"kl_{name}", total(f"kl_{name}") / nsentences, nsentences, round=3)
            metrics.log_scalar(f"kl_penalty_{name}", total(f"kl_penalty_{name}") / nsentences, nsentences,
                               round=3)
            metrics.log_scalar(f"beta_{name}", total(f"beta_{name}") / nsentences, nsentences, round=5)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True


def _safe_exp(x: float) -> float:
    try:
        return round(math.exp(x), 2)
    except OverflowError:
        return float("inf")
