"""One tiny QKVAE on fixed weights, tokens and noise: the case that ``tests/reference/qkvae_authors.py``
runs through the authors' code (ghazi-f/QKVAE: ``CoattentiveBARTTransformerLink`` for the two
posteriors, ``QKVBartTransformerLink`` for the decoder, ``Categorical.rep`` for the decoder inputs)
and ``tests/unit/user_dir/test_qkvae_authors_reading.py`` through ours (``--qkvae-reading authors``).

Float64, evaluation mode (dropout off; the authors' word dropout then scales every decoder-input
embedding by 1 - p = 0.6). Three sentences of equal length: the authors call BART without an
attention mask, so an unpadded batch compares directly; :data:`PADDED_SENTENCES` is compared with their
modules given the mask, and as they run (padding is masked here, a deliberate fix). Further cases: their
``criteria.py`` ELBo in training mode (:data:`CRITERION_STEPS`) and greedy generation from fixed latents.
"""

import argparse
from typing import Dict, List

import torch
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY
from fairseq.modules import FairseqDropout

import user_dir  # noqa: F401  (registers the architectures)
from latent_core.vae import DiagonalGaussian, KLRegularizer
from tests.reference.sentence_vae_case import (
    as_floats, fill_parameters, gradient_probes, sentence_log_likelihood, token_batch, word_dictionary,
)
from user_dir.qkvae import QKVAEModel

WORDS = "the a cat dog sat ran on under mat rug big small quickly slowly".split()
SENTENCES = ["the cat sat on the mat", "a dog ran under a rug", "the big dog sat on rug"]
EMBED, HEADS, FFN, LAYERS, SLOTS, SLOT_DIM = 16, 2, 32, 2, 4, 4
SYN_DIM = SLOTS * SLOT_DIM  # the authors' key network reads a z_syn of z_sem's total size
WORD_DROPOUT = 0.4
BETAS = {"z_syn": 0.3, "z_sem": 0.6}
FREE_BITS = 0.05  # lambda, nats per dimension and sentence
# parameters whose gradients are compared (dot product with a fixed random tensor, our layout)
GRADIENT_PARAMETERS = (
    "encoder.sentence_encoder.embed_tokens.weight",
    "encoder.input_projections.z_syn.weight",
    "encoder.input_projections.z_sem.weight",
    "encoder.latent_queries",
    "encoder.query_positions.weight",
    "encoder.query_layers.0.self_attn.q_proj.weight",
    "encoder.mean_heads.z_sem.weight",
    "encoder.sigma_heads.z_syn.weight",
    "decoder.key_mlp.0.weight",
    "decoder.key_mlp.2.weight",
    "decoder.value_proj.weight",
    "decoder.slot_ids",
    "decoder.layers.1.encoder_attn.q_proj.weight",
    "decoder.output_hidden.weight",
)


def dictionary() -> Dictionary:
    return word_dictionary(WORDS)


def build_model(d: Dictionary, reading: str = "authors") -> QKVAEModel:
    """Our model in the case's size with every parameter drawn from a fixed generator."""
    args = argparse.Namespace(
        arch="qkvae_small", qkvae_reading=reading, encoder_embed_dim=EMBED, decoder_embed_dim=EMBED,
        encoder_ffn_embed_dim=FFN, decoder_ffn_embed_dim=FFN, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_layers=LAYERS, decoder_layers=LAYERS, posterior_layers=LAYERS,
        syn_latent_dim=SYN_DIM, num_latent_slots=SLOTS, slot_latent_dim=SLOT_DIM, key_mlp_layers=2,
        word_dropout=WORD_DROPOUT, max_source_positions=32, max_target_positions=32,
    )
    ARCH_CONFIG_REGISTRY["qkvae_small"](args)
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    model = QKVAEModel.build_model(args, task).double().eval()
    fill_parameters(model, 11, lambda name: "layer_norm" in name or "layernorm" in name)
    return model


# a padded batch (right-padded, as the sentence_vae task collates): the first sentence is the longest
PADDED_SENTENCES = ["the big dog sat on the mat", "a cat ran", "the small dog sat on rug"]


def inputs(d: Dictionary, sentences=SENTENCES) -> Dict[str, torch.Tensor]:
    """The token batch (:func:`token_batch`) and the noise of each latent."""
    data = token_batch(d, sentences)
    g = torch.Generator().manual_seed(5)
    data["eps"] = {name: torch.randn(len(sentences), size, generator=g, dtype=torch.float64)
                   for name, size in (("z_syn", SYN_DIM), ("z_sem", SLOTS * SLOT_DIM))}
    return data


def probes(model) -> Dict[str, torch.Tensor]:
    """The fixed random tensors the gradients are dotted with (the paper's reading lacks some)."""
    return gradient_probes(model, GRADIENT_PARAMETERS)


def authors_objective(log_px_given_z: torch.Tensor, means: Dict, sigmas: Dict) -> Dict[str, torch.Tensor]:
    """The authors' loss (``components/criteria.py``: tokens summed, sentences averaged, free
    bits max(KL_d, lambda) per dimension and sentence, one beta per latent), written with
    latent_core's KL so that the same code scores both sides."""
    kl = {}
    penalty = 0.0
    for name in ("z_syn", "z_sem"):
        q = DiagonalGaussian(means[name], 2.0 * torch.log(sigmas[name]))
        kl_units = q.kl_standard_normal()
        kl[name] = kl_units.sum(-1)
        term = KLRegularizer("free_bits", FREE_BITS, "example", "dimension")(kl_units, BETAS[name], name)
        penalty = penalty + term.loss
    batch = log_px_given_z.size(0)
    return {"loss": (-log_px_given_z.sum() + penalty) / batch, "kl": kl}


def run_ours(model, d: Dictionary, sentences=SENTENCES) -> Dict:
    """The case through our model: posteriors, log p(x|z) per sentence, the loss and gradients."""
    data = inputs(d, sentences)
    model.zero_grad()
    means, logvars = model.encoder.posterior_parameters(data["src"], data["lengths"])
    sigmas = {name: torch.exp(0.5 * logvars[name]) for name in means}
    z = {name: means[name] + sigmas[name] * data["eps"][name] for name in means}
    encoder_out = model.encoder(data["src"], data["lengths"], latents=z)
    log_px = sentence_log_likelihood(model.decoder(data["prev"], encoder_out)[0], data["target"], d.pad())
    objective = authors_objective(log_px, means, sigmas)
    objective["loss"].backward()
    params = dict(model.named_parameters())
    probe = probes(model)
    return summary(means, sigmas, log_px, objective, {name: params[name].grad for name in probe}, probe)


def summary(means, sigmas, log_px, objective, gradients, probe) -> Dict:
    values = as_floats
    return {
        "mu_z_syn": values(means["z_syn"]), "mu_z_sem": values(means["z_sem"]),
        "sigma_z_syn": values(sigmas["z_syn"]), "sigma_z_sem": values(sigmas["z_sem"]),
        "log_px_given_z": values(log_px),
        "kl_z_syn": values(objective["kl"]["z_syn"]), "kl_z_sem": values(objective["kl"]["z_sem"]),
        "loss": float(objective["loss"].detach()),
        "gradients": {name: float((gradients[name] * probe[name]).sum()) for name in probe},
    }


# -- the case scored by the authors' criterion (components/criteria.py ELBo) -------------------------
# qkv_train.py's defaults, as examples/sentence_vae/train_qkvae_authors.sh passes them to ours
AUTHORS_RECIPE = {"kl_threshold": 0.01, "ae_steps": 3000,
                  "beta_schedule": "z_sem=linear:3000:6000:0.6,z_syn=linear:7000:20000:0.3"}
# updates: the AE phase, both ends and the middle of each ramp, after both
CRITERION_STEPS = (0, 2999, 3000, 4500, 6000, 7000, 13500, 20000, 30000)


def word_dropout_keep(d: Dictionary) -> torch.Tensor:
    """The training-mode word-dropout draw of the decoder inputs, ``[B, T]`` (True = kept): fixed, so
    that both sides drop the same words (theirs: ``Categorical.rep``'s dropout of a ones tensor)."""
    prev = token_batch(d, SENTENCES)["prev"]
    g = torch.Generator().manual_seed(17)
    return torch.rand(prev.shape, generator=g, dtype=torch.float64) >= WORD_DROPOUT


def criterion_summary(loss: torch.Tensor, gradients: Dict[str, torch.Tensor], probe: Dict) -> Dict:
    return {"loss": float(loss.detach()),
            "gradients": {name: float((gradients[name] * probe[name]).sum()) for name in probe}}


def run_ours_criterion(model, d: Dictionary, step: int, recipe: Dict = AUTHORS_RECIPE) -> Dict:
    """The case through our ``sentence_vae`` criterion with the authors' recipe at update ``step``, in
    training mode with the fixed word dropout (z from the case's noise, passed to the model)."""
    from user_dir.sentence_vae.criterion import SentenceVAECriterion, SentenceVAECriterionConfig

    data = inputs(d)
    model.train()
    for module in model.modules():  # the case's BART has dropout 0 on their side
        if isinstance(module, (torch.nn.Dropout, FairseqDropout)):
            module.p = 0.0
    model.zero_grad()
    keep = word_dropout_keep(d)
    model.decoder.token_embedding_scale = lambda tokens, like: keep.to(like.dtype).unsqueeze(-1)
    means, logvars = model.encoder.posterior_parameters(data["src"], data["lengths"])
    latents = {name: means[name] + torch.exp(0.5 * logvars[name]) * data["eps"][name] for name in means}
    task = argparse.Namespace(target_dictionary=d, source_dictionary=d, latent_sizes=model.latent_sizes)
    cfg = SentenceVAECriterionConfig(kl_variant="free_bits", kl_threshold=str(recipe["kl_threshold"]),
                                     ae_steps=recipe["ae_steps"], beta_schedule=recipe["beta_schedule"],
                                     sentence_avg=False, max_update=0)
    criterion = SentenceVAECriterion(task, cfg)
    criterion.set_num_updates(step)
    sample = {"net_input": {"src_tokens": data["src"], "src_lengths": data["lengths"],
                            "prev_output_tokens": data["prev"], "latents": latents},
              "target": data["target"], "ntokens": int(data["target"].ne(d.pad()).sum())}
    loss, sample_size, _ = criterion(model, sample)
    (loss / sample_size).backward()
    params = dict(model.named_parameters())
    probe = probes(model)
    return criterion_summary(loss / sample_size, {name: params[name].grad for name in probe}, probe)


# -- greedy generation from fixed latents (their DisentanglementTransformerVAE.generate_from_z2, beam 1) ----------
GREEDY_LENGTH = 8  # their gen_len: decoding steps after <s> (their loop does not stop at </s>)


def greedy_latents(d: Dictionary) -> Dict[str, torch.Tensor]:
    """z_syn and z_sem ``[3, 16]`` drawn from the prior (the case's noise)."""
    return {name: eps.clone() for name, eps in inputs(d)["eps"].items()}


def run_ours_greedy(model, d: Dictionary) -> List[Dict]:
    """Their greedy rule (argmax of the logits times the unk mask, ``GREEDY_LENGTH`` steps from <s>) on our
    decoder's incremental path, the one fairseq's generator drives (one new token per call, cached
    self-attention, keys and values from the latents): tokens and each chosen token's log-probability."""
    model.eval()
    latents = greedy_latents(d)
    rows = latents["z_syn"].size(0)
    encoder_out = model.encoder(torch.empty(rows, 0, dtype=torch.long), torch.zeros(rows, dtype=torch.long),
                                latents=latents)
    tokens = torch.full((rows, 1), d.bos(), dtype=torch.long)
    incremental_state: Dict = {}
    scores = []
    with torch.no_grad():
        for _ in range(GREEDY_LENGTH):
            logits = model.decoder(tokens, encoder_out, incremental_state=incremental_state)[0][:, -1]
            unk_mask = torch.ones_like(logits)
            unk_mask[:, d.unk()] = 0
            best = torch.argmax(logits * unk_mask, dim=-1)
            scores.append(torch.log_softmax(logits, dim=-1).gather(-1, best[:, None])[:, 0])
            tokens = torch.cat([tokens, best[:, None]], dim=-1)
    scores = torch.stack(scores, 1)
    return [{"tokens": tokens[row, 1:].tolist(), "scores": scores[row].tolist()} for row in range(rows)]
