"""A whole SDMA-T speech recogniser on fixed weights, a padded batch and fixed noise: the case that
``tests/reference/sdma_espnet_model.py`` runs through the authors' ESPnet1 ``E2E``
(``e2e_asr_disentangled_transformer.py``, their Aishell-1 settings: ``var_estimation``, ``mu_grad 5``,
``mtlalpha 0.3``, ``lsm_weight 0.1``, ``kl_weight 0.001``, ``div_weight 1``, ``mi_weight 1``) and
``tests/unit/espnet_plugin/test_sdma_espnet_authors_model.py`` through ours (ESPnet2 ``model: sdma`` with
``sdma_transformer`` encoder and decoder, ``reading: authors``).

Conv2d subsampling, two encoder and two decoder blocks of width 8 with 2 heads, 3 clusters, no
dropout, 20-dimensional features (no frontend), 13 tokens. Weights are named as in our model;
:func:`authors_name` gives the authors' name of each.
"""

import zlib
from typing import Dict, List

import torch

from tests.reference.sdma_model_case import (  # noqa: F401  (shared with the fairseq case)
    NoiseStream, gradient_reference, pack_gradients, renamed, unpack_gradients,
)

FEATURES, WIDTH, HEADS, UNITS, BLOCKS, CLUSTERS = 20, 8, 2, 16, 2, 3
TOKENS = ["<blank>", "<unk>"] + [f"t{i}" for i in range(10)] + ["<sos/eos>"]
NUM_UPDATES = 1000
CTC_WEIGHT, LSM_WEIGHT = 0.3, 0.1
TERMS = ("ctc", "att", "kl", "diversity", "dqq", "dxq")
PREFIX = [12, 4, 9, 6]  # <sos> t2 t7 t4: the decoder-step case


def authors_argv() -> List[str]:
    return ["--adim", str(WIDTH), "--aheads", str(HEADS), "--eunits", str(UNITS), "--elayers", str(BLOCKS),
            "--dlayers", str(BLOCKS), "--dunits", str(UNITS), "--enc_clusters", str(CLUSTERS),
            "--dec_clusters", str(CLUSTERS), "--var_estimation", "True", "--mu_grad", "5", "--kl_weight", "0.001",
            "--div_weight", "1", "--mi_weight", "1", "--dropout-rate", "0.0", "--transformer-attn-dropout-rate",
            "0.0", "--transformer-length-normalized-loss", "False", "--transformer-init", "pytorch"]


def our_args():
    """The ESPnet2 task arguments that build our model for this case."""
    from espnet_plugin.tasks.sdma_asr import SDMAASRTask

    args = SDMAASRTask.get_parser().parse_args([])
    args.token_list = list(TOKENS)
    args.input_size, args.frontend, args.frontend_conf = FEATURES, None, {}
    args.specaug, args.normalize, args.normalize_conf = None, None, {}
    sdma_conf = {"reading": "authors", "clusters": CLUSTERS, "query_clusters": CLUSTERS}
    args.encoder = "sdma_transformer"
    args.encoder_conf = dict(output_size=WIDTH, attention_heads=HEADS, linear_units=UNITS, num_blocks=BLOCKS,
                             dropout_rate=0.0, positional_dropout_rate=0.0, attention_dropout_rate=0.0,
                             sdma_conf=sdma_conf)
    args.decoder = "sdma_transformer"
    args.decoder_conf = dict(attention_heads=HEADS, linear_units=UNITS, num_blocks=BLOCKS, dropout_rate=0.0,
                             positional_dropout_rate=0.0, self_attention_dropout_rate=0.0,
                             src_attention_dropout_rate=0.0, sdma_conf=sdma_conf)
    args.model = "sdma"
    args.model_conf = dict(ctc_weight=CTC_WEIGHT, lsm_weight=LSM_WEIGHT, length_normalized_loss=False)
    args.ctc_conf = {}
    return args


def batch() -> Dict[str, torch.Tensor]:
    """Three utterances of 31 / 24 / 17 frames (7 / 5 / 3 after subsampling) and 5 / 3 / 4 tokens,
    padded (features with zeros, tokens with -1, as ESPnet collates them)."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([31, 24, 17])
    speech = torch.randn(3, 31, FEATURES, generator=g, dtype=torch.float64)
    for i, n in enumerate(lengths):
        speech[i, n:] = 0.0
    text = torch.tensor([[4, 9, 6, 2, 11], [3, 3, 10, -1, -1], [7, 5, 8, 2, -1]])
    return {"speech": speech, "speech_lengths": lengths, "text": text, "text_lengths": text.ne(-1).sum(1)}


AUTHORS_PARTS = [
    (".sdma.feature_gmm.means", ".semantic_mu"), (".sdma.feature_gmm.log_vars", ".semantic_log_var"),
    (".sdma.feature_gmm.prior_logits", ".semantic_log_prior"), (".sdma.query_gmm.means", ".head_mu"),
    (".sdma.query_gmm.log_vars", ".head_log_var"), (".sdma.query_gmm.prior_logits", ".head_log_prior"),
    (".sdma.noise_log_var.", ".linear_semantic_var."), (".sdma.key_noise_log_var.", ".linear_semantic_var_k."),
    (".sdma.query_noise_log_var.", ".linear_head_var."),
]


def authors_name(ours: str) -> str:
    return renamed(ours, AUTHORS_PARTS)


def our_name(theirs: str) -> str:
    return renamed(theirs, AUTHORS_PARTS, to_authors=False)


def weight(name: str, shape) -> torch.Tensor:
    """A float64 value for our parameter ``name`` from a generator seeded by the name: layer-norm gains
    1 + N(0, 0.01), biases N(0, 0.01), mixtures as the fairseq case draws them, the variance heads
    (log-variances of the reparameterisation) near -3 as their module case, the rest ~ N(0, 1/fan_in)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    z = torch.randn(*shape, generator=g, dtype=torch.float64)
    if "noise_log_var" in name:
        return z / 20 if name.endswith("weight") else z / 10 - 3.0
    if "norm" in name:
        return 1.0 + z / 10 if name.endswith("weight") else z / 10
    if ".sdma." in name:
        scale = {"prior_logits": 0.5, "log_vars": 0.2, "means": 0.5}[name.rsplit(".", 1)[1]]
        return z * scale - (1.0 if "query_gmm" in name and name.endswith("log_vars") else 0.0)
    if name.endswith("bias"):
        return z / 10
    if name == "decoder.embed.0.weight":
        return z
    fan_in = shape[1] * (shape[2] * shape[3] if len(shape) == 4 else 1) if len(shape) > 1 else shape[0]
    return z / fan_in ** 0.5

