"""Topic-informed discrete latents for semantic textual similarity (Yu et al., ``topic_vq_sts.txt``).

* :mod:`.ntm` Gaussian-softmax neural topic model (Section 3.1) and NPMI coherence;
* :mod:`.vqvae` topic-enhanced VQ-VAE (Section 3.2, eq. 1 and 6);
* :mod:`.semantic_attention` semantics-driven attention for Hugging Face encoders (eq. 4-5);
* :mod:`.vocabulary` the topic and VQ vocabularies built from a training split;
* :mod:`.task` the task ``topic_vq_sentence_prediction`` (hf_sentence_prediction + topic features);
* :mod:`.model` the fairseq model ``topic_vq_sts`` (task ``topic_vq_sentence_prediction``);
* tools: :mod:`.report` (``topic-report``) and the cross-validated sweep :mod:`.runs` (``topic-vq-runs``).
"""

from . import model, task  # noqa: F401  (registers topic_vq_sts and the topic_vq_sentence_prediction task)
