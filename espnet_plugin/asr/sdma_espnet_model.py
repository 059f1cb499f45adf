"""Joint CTC/attention ASR model with the SDMA regularisers (ESPnet2 ``model: sdma``)."""

from typing import Dict, List, Optional, Tuple

import torch
from espnet2.asr.espnet_model import ESPnetASRModel
from espnet2.torch_utils.device_funcs import force_gatherable
from typeguard import typechecked

from espnet_plugin.asr.sdma_attention import ESPnetConfigError
from latent_core.sdma import (
    LOSS_NAMES,
    REGULARISER_SCALES,
    SDMACore,
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

ESPNET_ADVICE = "Lower the learning rate or check the input features."
# sdma_dqq_clamped, sdma_dqq_ratio, sdma_hardness (latent_core.sdma.diagnostic_summary), in every step's stats
DIAGNOSTICS = ("dqq_clamped", "dqq_ratio", "hardness")
# The paper's Aishell-1 weights of eq. (24) (lambda_d keeps the core default, 1)
AISHELL_LOSS_WEIGHTS = SDMALossWeights(kl_weight=0.001, dqq_weight=30.0, dxq_weight=4.0)
# The authors' Aishell-1 config (kl_weight 0.001, div_weight 1, mi_weight 1): their mi loss is
# 10 L_Dqq - L_Dxq, so lambda_q = 10, lambda_x = 1
AUTHORS_AISHELL_LOSS_WEIGHTS = SDMALossWeights(kl_weight=0.001, dqq_weight=10.0, dxq_weight=1.0)
READING_LOSS_WEIGHTS = {"authors": AUTHORS_AISHELL_LOSS_WEIGHTS, "paper": AISHELL_LOSS_WEIGHTS}


class ESPnetSDMAASRModel(ESPnetASRModel):
    """``ESPnetASRModel`` plus the SDMA regularisers of eq. (24).

        loss = ESPnet's CTC/attention loss + lambda_k (L_KL^z + L_KL^q) + lambda_q L_Dqq
               - lambda_x L_Dxq + lambda_d (L_DV^z + L_DV^q)

    Each regulariser is computed per utterance (a mean over its tokens, the heads and the
    layers of one attention type, summed over encoder self-, decoder self- and
    cross-attention; :func:`latent_core.sdma.collect_sdma_losses`). The regulariser
    total is built exactly as in the fairseq criterion (``sdma_regulariser_scale``:
    ``sentence`` = sum over the batch's utterances, default; ``batch``; ``token``; see
    :func:`latent_core.sdma.scale_regulariser`) and divided by the normaliser ESPnet
    uses for its attention loss: the batch size (``length_normalized_loss: false``,
    ESPnet's default; with ``sentence`` this is the batch MEAN added to the per-utterance
    loss, as the authors' ESPnet code does) or the number of target tokens
    (``length_normalized_loss: true``). So a lambda weighs an utterance's regularisers
    against that utterance's summed CE in both toolkits. Defaults: the Aishell-1 weights of the
    attentions' reading (``READING_LOSS_WEIGHTS``: the authors' config, or the paper's).

    In the ``authors`` reading the regularisers are averaged over every SDMA module of every type
    (their ``torch.cat(loss_kl, dim=1).mean()``) instead of summed over the three types, and the
    update counter advances once per ``forward`` call, training and validation alike, after the
    call (their ``m.num_updates += 1``), not per optimizer step.

    Every term is reported as its own stat (``sdma_kl_z`` ... ``sdma_dv_q``, the weighted
    sum ``sdma_reg`` and the mixing weight ``sdma_mix``) on every step, zero when a term
    does not apply, so ESPnet's distributed stat averaging always sees the same keys; so are the
    clustering diagnostics ``sdma_dqq_clamped`` (share of the authors' L_Dqq normalisers at their
    1e-6 clamp), ``sdma_dqq_ratio`` (their L_Dqq / the exact one) and ``sdma_hardness`` (mean
    max_c p(c|z) of the feature GMMs), NaN where they do not apply (no query GMM).

    The update counter that drives the mixing weight g of eq. (11) is the persistent
    buffer ``num_updates``: :class:`espnet_plugin.tasks.sdma_asr.SDMAASRTask` advances it
    after every optimizer step, so it survives ``--resume`` and counts ``accum_grad``
    correctly. Outside ESPnet's trainer call :meth:`set_num_updates`.
    """

    @typechecked
    def __init__(self, *args, sdma_kl_weight: Optional[float] = None,
                 sdma_dqq_weight: Optional[float] = None,
                 sdma_dxq_weight: Optional[float] = None,
                 sdma_diversity_weight: Optional[float] = None,
                 sdma_regulariser_scale: str = "sentence", **kwargs):
        ctc_weight, interctc_weight = kwargs.get("ctc_weight", 0.5), kwargs.get("interctc_weight", 0.0)
        if not 0.0 <= ctc_weight <= 1.0:  # ESPnet asserts both without a message
            raise ESPnetConfigError(f"model_conf.ctc_weight={ctc_weight!r} must lie in [0, 1]")
        if not 0.0 <= interctc_weight < 1.0:
            raise ESPnetConfigError(f"model_conf.interctc_weight={interctc_weight!r} must lie in [0, 1)")
        super().__init__(*args, **kwargs)
        if sdma_regulariser_scale not in REGULARISER_SCALES:
            raise SDMAConfigError(
                f"model_conf.sdma_regulariser_scale={sdma_regulariser_scale!r} is not one of "
                f"{', '.join(REGULARISER_SCALES)}"
            )
        self.sdma_regulariser_scale = sdma_regulariser_scale
        self.sdma_cores: List[SDMACore] = [m for m in self.modules() if isinstance(m, SDMACore)]
        if not self.sdma_cores:
            raise SDMAConfigError(
                "model: sdma needs an SDMA encoder or decoder (encoder: sdma_transformer and/or "
                "decoder: sdma_transformer); use model: espnet for a vanilla transformer"
            )
        readings = sorted({core.options.reading for core in self.sdma_cores})
        if len(readings) > 1:
            raise ESPnetConfigError(
                f"encoder_conf.sdma_conf.reading and decoder_conf.sdma_conf.reading differ ({' vs '.join(readings)}): "
                "the reading decides how the model adds the regularisers and counts updates; use one")
        self.sdma_reading = readings[0]
        defaults = READING_LOSS_WEIGHTS[self.sdma_reading].as_options()
        given = {"sdma_kl_weight": sdma_kl_weight, "sdma_dqq_weight": sdma_dqq_weight,
                 "sdma_dxq_weight": sdma_dxq_weight, "sdma_diversity_weight": sdma_diversity_weight}
        self.sdma_loss_weights = {name: defaults[name] if value is None else value for name, value in given.items()}
        for name, value in self.sdma_loss_weights.items():
            check_loss_weight(name, value, f"model_conf.{name}")
        # the authors count forward calls (training and validation), not optimizer steps
        self.counts_forward_calls = self.sdma_reading == "authors"
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.long), persistent=True)

    def set_num_updates(self, num_updates: int) -> None:
        """Set the update counter (and with it the mixing weight g of every SDMA attention)."""
        self.num_updates.fill_(int(num_updates))
        for core in self.sdma_cores:
            core.set_num_updates(int(num_updates))

    def increment_num_updates(self) -> None:
        """Called after every optimizer step (``SDMAASRTask``); the authors reading counts forward
        calls instead (see :meth:`forward`)."""
        if not self.counts_forward_calls:
            self.set_num_updates(int(self.num_updates) + 1)

    def forward(self, speech: torch.Tensor, speech_lengths: torch.Tensor, text: torch.Tensor,
                text_lengths: torch.Tensor, **kwargs) -> Tuple[torch.Tensor, Dict[str, Optional[torch.Tensor]], torch.Tensor]:
        """Shapes: speech (B, L) or (B, L, D), speech_lengths (B,), text (B, U), text_lengths (B,)."""
        with recording() as records:
            loss, stats, weight = super().forward(speech, speech_lengths, text, text_lengths, **kwargs)
        diagnostics = {}
        terms = collect_sdma_losses(self, records, diagnostics,
                                    combine="module_mean" if self.sdma_reading == "authors" else "sum")
        check_finite(terms, ESPNET_ADVICE, diagnose=lambda: diagnose_nonfinite(
            self, lambda: ESPnetASRModel.forward(self, speech, speech_lengths, text, text_lengths, **kwargs)))
        per_utterance = weighted_regulariser(terms, self.sdma_loss_weights)  # (B,)
        num_tokens = float((text_lengths + 1).sum())  # the attention targets, <eos> included
        total = scale_regulariser(per_utterance, self.sdma_regulariser_scale, num_tokens)
        normaliser = num_tokens if self.criterion_att.normalize_length else float(text.size(0))
        regulariser = (total / normaliser).to(loss.dtype)
        loss = loss + regulariser
        sdma_stats = {f"sdma_{name}": _utterance_mean(terms[name]).detach() for name in LOSS_NAMES}
        sdma_stats["sdma_reg"] = regulariser.detach()
        sdma_stats["sdma_mix"] = self.sdma_cores[0].mix_weight.detach().clone()
        # the clustering diagnostics (the fairseq criterion's keys): NaN when a term does not apply
        summary = diagnostic_summary(diagnostics)
        for name in DIAGNOSTICS:
            value = summary.get(name)
            sdma_stats[f"sdma_{name}"] = loss.new_tensor(float("nan")) if value is None else value.to(loss.dtype)
        stats.update(sdma_stats)
        stats["loss"] = loss.detach()
        if self.counts_forward_calls:  # after the call, as their m.num_updates += 1
            self.set_num_updates(int(self.num_updates) + 1)
        return force_gatherable((loss, stats, weight), loss.device)


def _utterance_mean(per_utterance: torch.Tensor) -> torch.Tensor:
    """(B,) -> the batch mean (ESPnet's reporter weights stats by the batch size)."""
    return per_utterance.mean() if per_utterance.dim() else per_utterance
