"""QKVAE and ADVAE (Felhi et al., NAACL 2022, arXiv:2205.05943) as fairseq models.

* :mod:`.encoder` -- ADVAE's latent-query encoder (eq. 3), shared by both models;
* :mod:`.decoder` -- QKVAE's QKV decoder (Section 4.1) and ADVAE's decoder (Section 3.3);
* :mod:`.model` -- the ``qkvae`` / ``advae`` models and their architectures;
* :mod:`.bart_init` -- ``--bart-dir`` initialisation.

Tools (``user_dir.tools.qkvae``): the embedding-space test of Table 2 (``qkvae-probe``) and
BART-vocabulary data preparation (:mod:`pipelines.data.bart_data`).
"""

from . import model  # noqa: F401  (registers the models and architectures)
from .bart_init import BartInitError, initialise_from_bart
from .decoder import ADVAEDecoder, QKVAttention, QKVDecoder, QKVDecoderLayer
from .encoder import LatentGroup, LatentQueryEncoder
from .model import ADVAEModel, LatentAttentionVAE, QKVAEModel, count_parameters

__all__ = [
    "BartInitError", "initialise_from_bart", "ADVAEDecoder", "QKVAttention", "QKVDecoder",
    "QKVDecoderLayer", "LatentGroup", "LatentQueryEncoder", "ADVAEModel", "LatentAttentionVAE",
    "QKVAEModel", "count_parameters",
]
