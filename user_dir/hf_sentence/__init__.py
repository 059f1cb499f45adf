"""Sentence(-pair) classification and regression with Hugging Face encoders in fairseq.

* task ``hf_sentence_prediction`` (:mod:`.task`, data in :mod:`.data`): GLUE-style TSV files
  (MRPC, STS-B, QQP, SST-2, CoLA layouts or custom columns), a local Hugging Face fast
  tokenizer, the piece -> word alignment in every batch and, with ``--topic-features``, the
  words and bags of words of the topic-VQ model;
* criterion ``hf_sentence_prediction`` (:mod:`.criterion`): cross-entropy / MSE, with GLUE
  metrics over the whole validation set (:mod:`.metrics`);
* model ``hf_sentence_classifier`` (:mod:`.model`): ``transformers.AutoModel`` encoder +
  classification head, meant to be subclassed.

Tools: ``glue-predict`` (:mod:`user_dir.tools.hf_sentence.predict`) writes GLUE submission files
from a checkpoint; ``hans-eval`` (:mod:`.hans`) scores an NLI checkpoint on HANS.
"""

from . import criterion, model, task  # noqa: F401  (registration)
from .model import HFSentenceClassifier, HFSentenceConfigError  # noqa: F401
from .task import HFSentencePredictionTask  # noqa: F401
