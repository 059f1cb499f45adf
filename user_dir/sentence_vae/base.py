"""What every sentence VAE in this package looks like to fairseq, the criterion and the tools.

A sentence VAE is a ``FairseqEncoderDecoderModel`` whose

* **encoder** (:class:`SentenceVAEEncoder`) maps ``(src_tokens, src_lengths)`` to the
  posteriors q(z_name | x) of its named latents (QKVAE: ``z_syn`` and ``z_sem``; ADVAE:
  ``z``; Optimus: ``z``) and to the latent values the decoder reads. Its output is the
  dict of :func:`encoder_output`:

  ``{"posterior_mean": {name: [B, D]}, "posterior_logvar": {name: [B, D]},
  "latents": {name: [B, D]}}``

  In training the latents are reparameterised samples; in evaluation the posterior means
  (deterministic reconstruction), unless the caller passes ``latents=`` explicitly, which is
  how sampling from the prior, interpolation, analogy and syntax/semantics transfer decode
  arbitrary z through fairseq's own ``SequenceGenerator`` (its ``net_input`` may carry a
  ``latents`` entry, which fairseq forwards to ``encoder.forward``).

* **decoder** (a ``FairseqIncrementalDecoder``) conditions on ``encoder_out["latents"]`` only
  and returns ``(logits [B, T, V], extra)`` with ``extra["posteriors"]`` = the
  :class:`~latent_core.vae.DiagonalGaussian` of each latent (built by :func:`posteriors_of`), so
  the ``sentence_vae`` criterion gets everything from one ``model(**net_input)`` call, and
  ``extra["attn"]`` (``None``, or ``[attention [B, T, S]]``): fairseq's ``SequenceGenerator``
  reads ``extra["attn"]`` at every step and fails with ``KeyError: 'attn'`` without it.
  :func:`decoder_extra` builds both entries.
  Incremental decoding must equal full scoring (tests check it for every model).

* **model** (:class:`SentenceVAEModel`) declares what the ``sentence_vae`` task and criterion read of
  it: ``latent_sizes`` (an ordered ``{name: D}``) and its training defaults.
"""

from collections import OrderedDict
from typing import Dict, Mapping, Optional

import torch
from fairseq.models import FairseqEncoder, FairseqEncoderDecoderModel
from torch import Tensor

from user_dir.model_wrappers import unwrap_model

from latent_core.vae import DiagonalGaussian

EncoderOut = Dict[str, Dict[str, Tensor]]


def encoder_output(means: Mapping[str, Tensor], logvars: Mapping[str, Tensor], sample: bool,
                   latents: Optional[Mapping[str, Tensor]] = None) -> EncoderOut:
    """The encoder-output dict; ``latents`` given -> used as is, else sampled or the means."""
    if latents is None:
        latents = {
            name: DiagonalGaussian(means[name], logvars[name]).rsample() if sample else means[name]
            for name in means
        }
    return {"posterior_mean": dict(means), "posterior_logvar": dict(logvars), "latents": dict(latents)}


def posteriors_of(encoder_out: EncoderOut) -> Dict[str, DiagonalGaussian]:
    """q(z_name | x) of every latent, from an encoder output."""
    return {
        name: DiagonalGaussian(mean, encoder_out["posterior_logvar"][name])
        for name, mean in encoder_out["posterior_mean"].items()
    }


def decoder_extra(encoder_out: EncoderOut, attn: Optional[Tensor] = None) -> Dict[str, object]:
    """The decoder's ``extra`` output: ``{"attn": [attn] or None, "posteriors": posteriors_of(...)}``."""
    return {"attn": None if attn is None else [attn], "posteriors": posteriors_of(encoder_out)}


def reorder_encoder_output(encoder_out: EncoderOut, new_order: Tensor) -> EncoderOut:
    """Select batch rows (beam search); every tensor is batch-first."""
    return {
        key: {name: value.index_select(0, new_order) for name, value in group.items()}
        for key, group in encoder_out.items()
    }


def latents_for_batch(latents: Mapping[str, Tensor], batch_size: int) -> Dict[str, Tensor]:
    """Broadcast ``[D]`` or ``[1, D]`` latents to ``[B, D]`` (decoding one z for a batch)."""
    out = {}
    for name, z in latents.items():
        z = z.unsqueeze(0) if z.dim() == 1 else z
        out[name] = z.expand(batch_size, -1) if z.size(0) == 1 else z
    return out


class SentenceVAEEncoder(FairseqEncoder):
    """Base of the sentence-VAE encoders: subclasses implement :meth:`posterior_parameters`."""

    def posterior_parameters(self, src_tokens: Tensor, src_lengths: Tensor):
        """-> ``({name: mean [B, D]}, {name: logvar [B, D]})``."""
        raise NotImplementedError  # abstract

    def forward(self, src_tokens: Tensor, src_lengths: Tensor,
                latents: Optional[Mapping[str, Tensor]] = None, **unused) -> EncoderOut:
        if latents is not None:
            latents = latents_for_batch(latents, src_tokens.size(0))
            if src_tokens.numel() == 0 or src_tokens.size(1) == 0:  # decoding a given z only
                empty = {name: torch.zeros_like(z) for name, z in latents.items()}
                return encoder_output(empty, empty, sample=False, latents=latents)
        means, logvars = self.posterior_parameters(src_tokens, src_lengths)
        return encoder_output(means, logvars, sample=self.training, latents=latents)

    def reorder_encoder_out(self, encoder_out: EncoderOut, new_order: Tensor) -> EncoderOut:
        return reorder_encoder_output(encoder_out, new_order)

    def max_positions(self):
        return getattr(self, "max_source_positions", 1024)


def word_dropout(prev_output_tokens: Tensor, p: float, unk: int, keep_first: bool = True) -> Tensor:
    """Replace decoder-input tokens by ``unk`` with probability ``p`` (Bowman et al. 2016;
    QKVAE uses 0.4). The first position (BOS/EOS that starts decoding) is kept; padding is
    replaced like any token, which is harmless because padded positions are never scored."""
    if p <= 0:
        return prev_output_tokens
    drop = torch.rand(prev_output_tokens.shape, device=prev_output_tokens.device) < p
    if keep_first:
        drop[:, 0] = False
    return prev_output_tokens.masked_fill(drop, unk)


class UpdateCounter(torch.nn.Module):
    """Remembers fairseq's update counter (``BaseFairseqModel.set_num_updates`` reaches every
    submodule that has ``set_num_updates``); the ``sentence_vae`` task attaches one to the model it
    builds (``SentenceVAEModel.update_counter``). No parameters or buffers: the state dict of the
    model is unchanged, so checkpoints load with or without it."""

    def __init__(self):
        super().__init__()
        self.num_updates = 0

    def set_num_updates(self, num_updates: int) -> None:
        self.num_updates = int(num_updates)


class AutoEncodingPhase:
    """A criterion whose KL weights are zero for its first ``ae_steps`` updates (the ``sentence_vae``
    criterion's ``--ae-steps``); the task resets the optimizer where that phase ends for a model with
    ``reset_optimizer_after_ae``."""

    ae_steps: int = 0


class SentenceVAEModel(FairseqEncoderDecoderModel):
    """Base of every sentence VAE (QKVAE, ADVAE, Optimus): what the ``sentence_vae`` / ``optimus_lm``
    tasks and the ``sentence_vae`` criterion read of a model, set once by the constructor.

    Args:
        latent_sizes: ``{latent name: D}``, in the order of the latents.
        default_kl_variant: the ``--kl-variant`` the model trains with when none is given
            (``free_bits``: QKVAE's code and Optimus' eq. 9; ``hinge``: Optimus' code).
        default_decoder_start: the first decoder input under ``--decoder-start auto``
            (``bos`` = ``<s>``, ``eos`` = fairseq's ``</s>``).
        sentence_average_loss: the loss is averaged over sentences (sample size = sentences), as the
            authors' QKVAE and Optimus code do, not over target tokens.
        reset_optimizer_after_ae: the optimizer state is cleared when the auto-encoding phase
            (``--ae-steps``) ends (QKVAE's ``qkv_train.py``).

    ``update_counter`` is the task's :class:`UpdateCounter` (``None`` for a model built outside the
    ``sentence_vae`` task, whose criterion then counts with ``set_num_updates``).
    """

    latent_sizes: "OrderedDict[str, int]"
    default_kl_variant: str
    default_decoder_start: str
    sentence_average_loss: bool
    reset_optimizer_after_ae: bool
    update_counter: Optional[UpdateCounter]

    def __init__(self, encoder, decoder, latent_sizes: Mapping[str, int], *, default_kl_variant: str = "free_bits",
                 default_decoder_start: str = "eos", sentence_average_loss: bool = False,
                 reset_optimizer_after_ae: bool = False):
        super().__init__(encoder, decoder)
        self.latent_sizes = OrderedDict(latent_sizes)
        self.default_kl_variant = default_kl_variant
        self.default_decoder_start = default_decoder_start
        self.sentence_average_loss = sentence_average_loss
        self.reset_optimizer_after_ae = reset_optimizer_after_ae
        self.update_counter = None


def sentence_vae_model(model, user: str) -> SentenceVAEModel:
    """``model`` (a fairseq wrapper unwrapped) as a :class:`SentenceVAEModel`, or a TypeError naming
    ``user`` (the task or criterion that needs one)."""
    inner = unwrap_model(model)
    if not isinstance(inner, SentenceVAEModel):
        raise TypeError(f"{user} needs a sentence-VAE model (a user_dir.sentence_vae.base.SentenceVAEModel: "
                        f"--arch qkvae*, advae*, optimus*); {type(inner).__name__} is not one")
    return inner
