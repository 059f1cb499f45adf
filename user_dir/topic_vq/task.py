"""``topic_vq_sentence_prediction``: ``hf_sentence_prediction`` plus the topic features of the
topic-VQ model (``--topic-features``, ``--topic-min-count``, ``--topic-stop-words``).

The task builds a :class:`~.vocabulary.TopicVocabulary` from the words of ``train.tsv``
(deterministic: every DDP rank builds the same one) and keeps it in its checkpointed state
(``task.state_dict()["topic_vocabulary"]``), so a reloaded model sees the vocabulary it was
trained with even when the data directory changes; batches then also carry ``words_s`` and
``bow_s`` (:class:`~user_dir.hf_sentence.data.HFSentenceDataset`).

The shared base (:mod:`user_dir.hf_sentence`) knows nothing of topics: this package extends it
through the hooks ``keep_words`` / ``extra_features`` and a task-state factory.
Without ``--topic-features`` it is exactly ``hf_sentence_prediction``.
"""

import logging
import os
from dataclasses import dataclass, field
from typing import FrozenSet, List

import numpy as np
from fairseq.tasks import register_task

from ..hf_sentence.data import Encoded, Ragged
from ..hf_sentence.task import HFSentencePredictionConfig, HFSentencePredictionTask
from .vocabulary import TopicVocabulary

logger = logging.getLogger(__name__)

TASK_NAME = "topic_vq_sentence_prediction"
TOPIC_STATE = "topic_vocabulary"


@dataclass
class TopicSentencePredictionConfig(HFSentencePredictionConfig):
    topic_features: bool = field(
        default=False, metadata={"help": "add words_s / bow_s (topic-VQ models) to every batch"})
    topic_min_count: int = field(
        default=3, metadata={"help": "topic vocabulary: words seen at least this often in train.tsv"})
    topic_stop_words: str = field(
        default="sklearn", metadata={"help": "stop words left out of the topic vocabulary: sklearn (its "
                                             "English list), none, or a file with one word per line"})


@dataclass
class TopicArrays:
    """Per sentence s: VQ ids (``vq[s]``) and topic ids (``topic[s]``, -1 = not a topic word)
    of every word; ``topic_size`` V_topic."""

    vq: List[Ragged]
    topic: List[Ragged]
    topic_size: int


def topic_arrays(encoded: Encoded, vocabulary: TopicVocabulary) -> TopicArrays:
    """Look the encoded words (``encode(..., keep_words=True)``) up in ``vocabulary``."""
    vq_of = np.array([int(vocabulary.vq_ids([w])[0]) for w in encoded.lexicon] or [0], dtype=np.int32)
    topic_of = np.array([vocabulary.topic_index.get(w, -1) for w in encoded.lexicon] or [-1], dtype=np.int32)
    vq = [Ragged(vq_of[r.values], r.offsets) for r in encoded.words]
    topic = [Ragged(topic_of[r.values], r.offsets) for r in encoded.words]
    return TopicArrays(vq, topic, vocabulary.topic_size)


def stop_words(spec: str) -> FrozenSet[str]:
    """--topic-stop-words: 'sklearn', 'none' or a file with one word per line."""
    if spec == "sklearn":
        from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

        return frozenset(ENGLISH_STOP_WORDS)
    if spec == "none":
        return frozenset()
    if not os.path.isfile(spec):
        raise ValueError(f"--topic-stop-words {spec!r}: expected sklearn, none or an existing file")
    with open(spec, encoding="utf-8") as f:
        return frozenset(line.strip().lower() for line in f if line.strip())


@register_task(TASK_NAME, dataclass=TopicSentencePredictionConfig)
class TopicSentencePredictionTask(HFSentencePredictionTask):
    """Sentence(-pair) prediction with the topic-VQ features; see the module docstring."""

    def __init__(self, cfg: TopicSentencePredictionConfig, tokenizer, labels):
        super().__init__(cfg, tokenizer, labels)
        self._topic_vocabulary = None
        self.state.add_factory(TOPIC_STATE, self._build_topic_vocabulary_state)

    @classmethod
    def setup_task(cls, cfg: TopicSentencePredictionConfig, **kwargs):
        if cfg.topic_min_count < 1:
            raise ValueError(f"--topic-min-count {cfg.topic_min_count} must be >= 1")
        task = super().setup_task(cfg, **kwargs)
        if cfg.topic_features and not kwargs.get("from_checkpoint", False):
            task.topic_vocabulary  # noqa: B018  (built now, from train.tsv; a checkpoint brings its own)
        return task

    @property
    def topic_vocabulary(self):
        """The :class:`~.vocabulary.TopicVocabulary` (None without --topic-features): from the
        checkpoint's task state, else built from train.tsv."""
        if not self.cfg.topic_features:
            return None
        if self._topic_vocabulary is None:
            self._topic_vocabulary = TopicVocabulary.from_state_dict(getattr(self.state, TOPIC_STATE))
        return self._topic_vocabulary

    @property
    def keep_words(self) -> bool:
        return bool(self.cfg.topic_features)

    def extra_features(self, encoded: Encoded):
        return topic_arrays(encoded, self.topic_vocabulary) if self.cfg.topic_features else None

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._topic_vocabulary = None

    def _build_topic_vocabulary_state(self) -> dict:
        examples, encoded = self._read_encoded("train", keep_words=True)
        self._train_cache = (examples, encoded)
        sentences = (words for s in range(encoded.num_sentences) for words in encoded.word_lists(s))
        try:
            vocabulary = TopicVocabulary.build(sentences, self.cfg.topic_min_count,
                                               stop_words(self.cfg.topic_stop_words))
        except ValueError as error:
            raise ValueError(f"{examples.path}: {error}") from error
        logger.info("topic vocabulary from %s: %d topic words (min count %d, stop words %s), %d VQ words",
                    examples.path, vocabulary.topic_size, self.cfg.topic_min_count,
                    self.cfg.topic_stop_words, vocabulary.vq_size)
        return vocabulary.state_dict()

