"""``sdma_label_smoothed_cross_entropy``: eq. (24) of the SDMA paper.

    L = L_CE + lambda_k (L_KL^z + L_KL^q) + lambda_q L_Dqq - lambda_x L_Dxq
          + lambda_d (L_DV^z + L_DV^q)

L_CE is fairseq's label-smoothed cross-entropy, summed over the batch's tokens (fairseq
divides the gradient by the sample size). Every regulariser is computed per sentence (a
mean over the sentence's tokens, the heads and the layers, eq. 20-23) and, by default
(``--sdma-regulariser-scale sentence``), SUMMED over the batch's sentences, as the
authors' fairseq criterion does (``.mean((1, 2)).sum()``): the whole loss is extensive in
the batch, like L_CE, and the lambdas of Table I weigh each sentence's regularisers
against its summed L_CE. ``batch`` adds the batch mean once instead (~``nsentences``
times weaker; this plugin's default in its first versions), ``token`` the batch mean times the
number of tokens (eq. 24 read with a per-token L_CE). Every logged value is a sum over
sentences or batches, so ``logging_outputs_can_be_summed()`` holds and DDP reduction is
exact (2 processes give the same update as one with ``--update-freq 2``); the ``sdma_*``
terms are logged per sentence.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, NamedTuple, Optional

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.logging import metrics

from fairseq.dataclass import ChoiceEnum
import torch
from torch import Tensor

from latent_core.errors import option_flag
from latent_core.sdma import (
    DIAGNOSTIC_SUMS,
    LOSS_NAMES,
    LOSS_WEIGHTS,
    REGULARISER_SCALES,
    SDMAConfigError,
    SDMALossWeights,
    check_finite,
    check_loss_weight,
    collect_sdma_losses,
    recording,
    diagnose_nonfinite,
    diagnostic_summary,
    scale_regulariser,
    weighted_regulariser,
)
from user_dir.model_wrappers import unwrap_model

from .model import SDMATransformerModel

FAIRSEQ_ADVICE = ("Lower the learning rate, enable --fp16-scale-tolerance / bf16, or check the input data; "
                  "the last checkpoint is intact.")


class LossParts(NamedTuple):
    """:meth:`SDMALabelSmoothedCrossEntropyCriterion.loss_parts` of one batch."""
    ce_loss: Tensor  # label-smoothed cross-entropy, summed over target tokens
    regulariser: Tensor  # the weighted SDMA terms of eq. (24), as they enter the loss
    nll_loss: Tensor
    net_output: tuple
    terms: Dict[str, Tensor]  # each SDMA term per sentence
    diagnostics: Dict[str, Tensor]


def weight_override(name: str):
    """A criterion override of one eq. (24) weight (a field of ``latent_core.sdma.SDMALossWeights``,
    whose help it takes); unset, the model architecture's value applies."""
    help_text = SDMALossWeights.__dataclass_fields__[name].metadata["help"]
    return field(default=None, metadata={"help": f"{help_text}; default: the model architecture's value"})


@dataclass
class SDMACriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    sdma_regulariser_scale: ChoiceEnum(REGULARISER_SCALES) = field(
        default="sentence",
        metadata={"help": "how the per-sentence regularisers enter the token-summed loss: 'sentence' sums "
                          "them over the batch's sentences (the authors' fairseq criterion; the Table I "
                          "lambdas), 'batch' adds their batch mean once, 'token' the batch mean times the "
                          "number of target tokens"},
    )
    sdma_kl_weight: Optional[float] = weight_override("kl_weight")
    sdma_dqq_weight: Optional[float] = weight_override("dqq_weight")
    sdma_dxq_weight: Optional[float] = weight_override("dxq_weight")
    sdma_diversity_weight: Optional[float] = weight_override("diversity_weight")


@register_criterion("sdma_label_smoothed_cross_entropy", dataclass=SDMACriterionConfig)
class SDMALabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 sdma_kl_weight=None, sdma_dqq_weight=None, sdma_dxq_weight=None, sdma_diversity_weight=None,
                 sdma_regulariser_scale="sentence"):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if str(sdma_regulariser_scale) not in REGULARISER_SCALES:
            raise SDMAConfigError(f"--sdma-regulariser-scale={sdma_regulariser_scale!r} is not one of "
                                  f"{', '.join(REGULARISER_SCALES)}")
        self.regulariser_scale = str(sdma_regulariser_scale)
        self.weight_overrides = {
            "sdma_kl_weight": sdma_kl_weight,
            "sdma_dqq_weight": sdma_dqq_weight,
            "sdma_dxq_weight": sdma_dxq_weight,
            "sdma_diversity_weight": sdma_diversity_weight,
        }
        for name, value in self.weight_overrides.items():
            if value is not None:
                check_loss_weight(name, value, option_flag(name))

    def loss_weights(self, model):
        inner = unwrap_model(model)
        model_defaults = inner.sdma_loss_weights if isinstance(inner, SDMATransformerModel) else {}
        weights = {}
        for name in LOSS_WEIGHTS:
            value = self.weight_overrides[name]
            weights[name] = value if value is not None else model_defaults.get(name, 0.0)
        return weights

    def loss_parts(self, model, sample, reduce=True) -> "LossParts":
        """The two parts of eq. (24) for one batch, apart: label-smoothed L_CE and the weighted regularisers
        (``forward`` adds them; ``sdma-learning-curves`` measures each part's gradient)."""
        with recording() as records:
            net_output = model(**sample["net_input"])
        ce_loss, nll_loss = self.compute_loss(model, net_output, sample, reduce=reduce)
        diagnostics = {}
        terms = collect_sdma_losses(model, records, diagnostics)
        check_finite(terms, FAIRSEQ_ADVICE,
                     diagnose=lambda: diagnose_nonfinite(model, lambda: model(**sample["net_input"])))
        per_sentence = weighted_regulariser(terms, self.loss_weights(model))  # [B]
        regulariser = scale_regulariser(per_sentence, self.regulariser_scale, sample["ntokens"]).to(ce_loss)
        return LossParts(ce_loss, regulariser, nll_loss, net_output, terms, diagnostics)

    def forward(self, model, sample, reduce=True):
        ce_loss, regulariser, nll_loss, net_output, terms, diagnostics = self.loss_parts(model, sample, reduce)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        loss = ce_loss + regulariser
        logging_output = {
            "loss": loss.data,
            "ce_loss": ce_loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
            "sdma_reg": regulariser.data,
        }
        # summed over sentences here, per sentence in reduce_metrics (all terms in one sum)
        logged = torch.stack([terms[name].detach().float() for name in LOSS_NAMES])
        logged = logged.sum(-1) if logged.dim() > 1 else logged * sample["target"].size(0)
        for name, term in zip(LOSS_NAMES, logged.unbind(0)):
            logging_output["sdma_" + name] = term
        for name, value in diagnostics.items():  # sums: the ratios are formed in reduce_metrics
            logging_output["sdma_diag_" + name] = value
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            logging_output["n_correct"] = n_correct.data
            logging_output["total"] = total.data
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        if not sample_size:
            return
        ce_sum = sum(log.get("ce_loss", 0) for log in logging_outputs)
        metrics.log_scalar("ce_loss", ce_sum / sample_size / math.log(2), sample_size, round=3)
        reg_sum = sum(log.get("sdma_reg", 0) for log in logging_outputs)
        metrics.log_scalar("sdma_reg", reg_sum / sample_size / math.log(2), sample_size, round=4)
        nsentences = sum(log.get("nsentences", 0) for log in logging_outputs)
        for name in LOSS_NAMES:
            total = sum(log.get("sdma_" + name, 0) for log in logging_outputs)
            metrics.log_scalar("sdma_" + name, total / max(nsentences, 1), nsentences, round=4)
        log_sdma_diagnostics(logging_outputs)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True


def log_sdma_diagnostics(logging_outputs) -> None:
    """``sdma_dqq_clamped`` (share of the authors' L_Dqq normalisers at their 1e-6 clamp),
    ``sdma_dqq_ratio`` (their L_Dqq / the exact one) and ``sdma_hardness`` (mean max_c p(c|z) of the
    feature GMMs over real tokens), each weighted by its denominator so that averages over log
    intervals and DDP workers are ratios of sums."""
    sums = {name: float(sum(log.get("sdma_diag_" + name, 0) for log in logging_outputs))
            for name in DIAGNOSTIC_SUMS}
    weights = {"dqq_clamped": sums["dqq_normalisers"], "dqq_ratio": sums["dqq_exact"],
               "hardness": sums["hardness_count"]}
    for name, value in diagnostic_summary(sums).items():
        metrics.log_scalar("sdma_" + name, value, weights[name], round=4)
