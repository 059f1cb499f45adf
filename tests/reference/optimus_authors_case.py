"""One tiny Optimus on fixed weights, tokens and noise: the case that ``tests/reference/optimus_authors.py``
runs through the authors' code (ChunyuanLI/Optimus: ``VAE.forward`` with ``fb_mode == 1`` over
``BertForLatentConnector`` and ``GPT2ForLatentConnector``) and
``tests/unit/user_dir/test_optimus_authors_defaults.py`` through ours (model ``optimus`` with its
defaults: pooled [CLS], memory + embedding injection, key = value = h_Mem; the criterion's
defaults for it: KL hinge, loss averaged over sentences).

Float64, no dropout (evaluation mode). Three sentences of equal length (no padding). Ids: our
encoder reads ``<s> x </s>`` (fairseq indices, ``<s>`` as [CLS] and ``</s>`` as [SEP]) and the
decoder ``<s> x`` -> ``x </s>`` (``optimus_lm``'s ``--decoder-start bos``); the authors' GPT-2 reads
``<BOS> x <EOS>`` with ``<s>`` as ``<BOS>`` and ``</s>`` as ``<EOS>``, so both sides see the same ids (their BERT reserves id 0 for padding, which the generator
handles by swapping two rows of the embedding table, see there).
"""

import argparse
from typing import Dict, List

import torch
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY

import user_dir  # noqa: F401  (registers the architectures)
from latent_core.vae import DiagonalGaussian, KLRegularizer
from tests.reference.sentence_vae_case import (
    as_floats, fill_parameters, gradient_probes, sentence_log_likelihood, token_batch, word_dictionary,
)
from user_dir.optimus import OptimusModel

WORDS = "the a cat dog sat ran on under mat rug big small".split()
SENTENCES = ["the cat sat on the mat", "a dog ran under a rug", "the big dog sat on rug"]
HIDDEN, HEADS, LAYERS, BERT_FFN = 16, 2, 2, 32
GPT2_FFN = 4 * HIDDEN  # the authors' GPT-2 MLP is always 4 * n_embd (modeling_gpt2.py, Block)
LATENT = 8
POSITIONS = 16
THRESHOLD = 0.5  # lambda of the hinge (their --dim_target_kl), nats per dimension and sentence
BETA = 0.7
POSTERIOR_SCALE = 0.35  # W_E's scale: some KL dimensions fall below lambda, some above
# parameters whose gradients are compared (dot product with a fixed random tensor, our layout)
GRADIENT_PARAMETERS = (
    "encoder.bert.embeddings.word_embeddings.weight",
    "encoder.bert.embeddings.position_embeddings.weight",
    "encoder.bert.encoder.layer.0.attention.self.query.weight",
    "encoder.bert.encoder.layer.1.output.dense.weight",
    "encoder.bert.pooler.dense.weight",
    "encoder.posterior.weight",
    "decoder.memory_proj.weight",
    "decoder.embed_proj.weight",
    "decoder.gpt2.transformer.wte.weight",
    "decoder.gpt2.transformer.wpe.weight",
    "decoder.gpt2.transformer.h.0.attn.c_attn.weight",
    "decoder.gpt2.transformer.h.1.mlp.c_fc.weight",
    "decoder.gpt2.transformer.ln_f.weight",
)


def dictionary() -> Dictionary:
    return word_dictionary(WORDS)


def build_model(d: Dictionary) -> OptimusModel:
    """Our model in the case's size (architecture defaults otherwise) with every parameter drawn
    from a fixed generator."""
    args = argparse.Namespace(
        arch="optimus", latent_dim=LATENT, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_embed_dim=HIDDEN, decoder_embed_dim=HIDDEN, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_embed_dim=BERT_FFN, decoder_ffn_embed_dim=GPT2_FFN,
        max_encoder_positions=POSITIONS, max_decoder_positions=POSITIONS, dropout=0.0, attention_dropout=0.0,
    )
    ARCH_CONFIG_REGISTRY["optimus"](args)
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    model = OptimusModel.build_model(args, task).double().eval()
    fill_parameters(model, 17, lambda name: "LayerNorm" in name or ".ln_" in name,
                    lambda name: POSTERIOR_SCALE if name == "encoder.posterior.weight" else 0.3)
    return model


def inputs(d: Dictionary) -> Dict[str, torch.Tensor]:
    """The token batch (:func:`token_batch`) with the decoder started from ``<s>`` (``optimus_lm``'s default
    ``--decoder-start bos``, their ``<BOS>``), and the noise eps."""
    data = token_batch(d, SENTENCES)
    data["prev"] = data["prev"].clone()
    data["prev"][:, 0] = d.bos()
    g = torch.Generator().manual_seed(5)
    data["eps"] = torch.randn(len(SENTENCES), LATENT, generator=g, dtype=torch.float64)
    return data


def probes(model) -> Dict[str, torch.Tensor]:
    """The fixed random tensors the gradients are dotted with."""
    return gradient_probes(model, GRADIENT_PARAMETERS)


def authors_objective(log_px_given_z: torch.Tensor, mean: torch.Tensor, logvar: torch.Tensor,
                      variant: str = "hinge") -> Dict[str, torch.Tensor]:
    """The authors' loss (``VAE.forward``, ``fb_mode == 1``: per sentence loss_rec + beta * sum_d
    KL_d [KL_d > dim_target_kl], then ``.mean()`` over the batch), written with latent_core's KL
    regulariser (``variant`` = the criterion's ``--kl-variant``) so the shared code is scored."""
    regularizer = KLRegularizer(variant, THRESHOLD, "example", "dimension")
    kl_units = DiagonalGaussian(mean, logvar).kl_standard_normal()  # [B, P]
    term = regularizer(kl_units, BETA, "z")
    per_sentence = torch.stack([regularizer(kl_units[i:i + 1], 1.0, "z").penalty for i in range(len(kl_units))])
    batch = log_px_given_z.size(0)
    return {"loss": (-log_px_given_z.sum() + term.loss) / batch, "kl": per_sentence}


def posterior_and_likelihood(model, data):
    """(mu, logvar, z, log p(x|z) per sentence) of our model on the case with its noise."""
    means, logvars = model.encoder.posterior_parameters(data["src"], data["lengths"])
    mean, logvar = means["z"], logvars["z"]
    z = mean + torch.exp(0.5 * logvar) * data["eps"]
    logits = model(data["src"], data["lengths"], data["prev"], latents={"z": z})[0]
    log_px = sentence_log_likelihood(logits, data["target"])
    return mean, logvar, z, log_px


def run_ours(model, d: Dictionary, variant: str = "hinge") -> Dict:
    """The case through our model: posterior, log p(x|z) per sentence, hinge KL, loss, gradients."""
    data = inputs(d)
    model.zero_grad()
    mean, logvar, _, log_px = posterior_and_likelihood(model, data)
    objective = authors_objective(log_px, mean, logvar, variant)
    objective["loss"].backward()
    params = dict(model.named_parameters())
    probe = probes(model)
    return summary(mean, logvar, log_px, objective["kl"], objective["loss"],
                   {name: params[name].grad for name in probe}, probe)


def summary(mean, logvar, log_px, kl, loss, gradients, probe) -> Dict:
    values = as_floats
    return {
        "mu": values(mean), "logvar": values(logvar), "log_px_given_z": values(log_px),
        "kl_hinge": values(kl), "loss": float(loss.detach()),
        "gradients": {name: float((gradients[name] * probe[name]).sum()) for name in probe},
    }


# -- greedy generation from fixed latents (their run_latent_generation.py text_from_latent_code, top_k 1) --------
GREEDY_LENGTH = 8  # a cap on their loop, which runs until <EOS>


def greedy_latents() -> torch.Tensor:
    """z ``[3, LATENT]`` from the prior, three times the case's noise (a sharper decoder input)."""
    g = torch.Generator().manual_seed(23)
    return 3.0 * torch.randn(len(SENTENCES), LATENT, generator=g, dtype=torch.float64)


def run_ours_greedy(model, d: Dictionary) -> List[Dict]:
    """Their greedy rule (argmax of the last position's logits, from <s>, until </s> or ``GREEDY_LENGTH``
    tokens) on our decoder's incremental path (one new token per call, as fairseq's generator drives
    it): tokens and each chosen token's log-probability, per latent row."""
    model.eval()
    out = []
    with torch.no_grad():
        for z in greedy_latents():
            encoder_out = model.encoder(torch.empty(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                        latents={"z": z[None]})
            tokens = torch.full((1, 1), d.bos(), dtype=torch.long)
            incremental_state: Dict = {}
            scores = []
            for _ in range(GREEDY_LENGTH):
                logits = model.decoder(tokens, encoder_out, incremental_state=incremental_state)[0][0, -1]
                best = int(torch.argmax(logits))
                scores.append(float(torch.log_softmax(logits, dim=-1)[best]))
                tokens = torch.cat([tokens, torch.tensor([[best]])], dim=-1)
                if best == d.eos():
                    break
            out.append({"tokens": tokens[0, 1:].tolist(), "scores": scores})
    return out
