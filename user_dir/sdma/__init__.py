"""SDMA: semantic and disentangled mask attention (Chien & Huang, TPAMI 2024).

Importing this package registers the fairseq model ``sdma_transformer`` (and its
architectures), its BERT-fused variant ``bert_fused_transformer`` (BV-T, BSDMA-T) and the
criterion ``sdma_label_smoothed_cross_entropy``. The attention core (``latent_core.sdma``) is
plain PyTorch and is shared with the ESPnet plugin, which imports neither fairseq nor this package.
"""

from . import bert_fused, criterion, model  # noqa: F401  (registration)
