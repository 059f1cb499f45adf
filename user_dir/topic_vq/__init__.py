"""Topic-informed discrete latents for semantic textual similarity (DisBert: Yu et al., *Learning
Semantic Textual Similarity via Topic-informed Discrete Latent Variables*, EMNLP 2022, arXiv:2211.03616).

* :mod:`.ntm` Gaussian-softmax neural topic model (Section 3.1) and NPMI coherence;
* :mod:`.vqvae` topic-enhanced VQ-VAE (Section 3.2, eq. 1 and 6);
* :mod:`.semantic_attention` semantics-driven attention for Hugging Face encoders (eq. 4-5);
* :mod:`.vocabulary` the topic and VQ vocabularies built from a training split;
* :mod:`.task` the task ``topic_vq_sentence_prediction`` (hf_sentence_prediction + topic features);
* :mod:`.model` the fairseq model ``topic_vq_sts`` (task ``topic_vq_sentence_prediction``);
* tools (``user_dir.tools.topic_vq``): ``topic-report`` and the cross-validated sweep ``topic-vq-runs``.
"""

from . import model, task  # noqa: F401  (registers topic_vq_sts and the topic_vq_sentence_prediction task)
