"""SDMA for Hugging Face models: semantic and disentangled mask attention in any transformers encoder or decoder
through the library's attention interface (``AttentionInterface``), fine-tuned from pretrained weights.

    from transformers_plugin import attach_sdma, sdma_loss

    model = attach_sdma(AutoModelForSequenceClassification.from_pretrained(path), mode="sdma", reading="paper")
    outputs = model(**batch)
    loss = outputs.loss + sdma_loss(model)       # eq. (24): the regularisers of this forward

The third adapter of the SDMA core (``latent_core.sdma``) beside ``user_dir/`` (fairseq) and ``espnet_plugin/``
(ESPnet); it imports neither toolkit. Its files: ``families`` (the attention modules SDMA knows), ``attach``
(attach_sdma, the schedule of g, reloading), ``attention`` (the registered attention function), ``losses`` (eq. 24),
``trainer`` (transformers' Trainer and Seq2SeqTrainer with the regularisers).
"""

from latent_core.sdma import SDMAConfigError  # noqa: F401
from transformers_plugin.attach import (  # noqa: F401
    attach_sdma,
    from_pretrained_with_sdma,
    register_sdma_attention,
    set_sdma_updates,
)
from transformers_plugin.attention import SDMA_ATTENTION  # noqa: F401
from transformers_plugin.losses import sdma_loss, sdma_records, sdma_terms  # noqa: F401

register_sdma_attention()
