"""SDMA for Hugging Face models: semantic and disentangled mask attention in any transformers encoder through the
library's attention interface (``AttentionInterface``), fine-tuned from pretrained weights.

    from transformers_plugin import attach_sdma, sdma_loss

    model = attach_sdma(AutoModel.from_pretrained(path), mode="sdma", reading="paper")
    outputs = model(**batch)
    loss = task_loss(outputs) + sdma_loss(model)       # eq. (24) without L_CE, after each forward

The third adapter of the SDMA core (``latent_core.sdma``) beside ``user_dir/`` (fairseq) and ``espnet_plugin/``
(ESPnet); it imports neither toolkit.
"""

from transformers_plugin.attention import (  # noqa: F401
    SDMA_ATTENTION,
    attach_sdma,
    from_pretrained_with_sdma,
    sdma_loss,
    sdma_records,
    set_sdma_updates,
)
