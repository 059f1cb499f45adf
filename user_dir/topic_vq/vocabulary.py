"""The two word vocabularies of the topic-informed VQ model, built from the training sentences.

* **topic vocabulary** (the neural topic model's bag of words, size V_topic): lower-cased
  words that are alphabetic (``^[a-z]+$``), at least 2 letters long, not stop words, and seen
  at least ``min_count`` times in the training sentences;
* **VQ vocabulary** (the VQ-VAE's word ids, size V_vq): every lower-cased word seen in the
  training sentences, after ``0 = <pad>`` and ``1 = <unk>``.

Both are ordered by count (descending), then alphabetically, so the same training data give
the same ids on every machine (every DDP rank builds its own copy). :meth:`state_dict` holds
plain Python lists only, so the vocabulary can be stored in a fairseq checkpoint and read by
torch's safe loader (``weights_only=True``).
"""

import re
from collections import Counter
from typing import AbstractSet, Dict, Iterable, List, Sequence

import torch

PAD, UNK = "<pad>", "<unk>"
PAD_ID, UNK_ID = 0, 1
TOPIC_WORD = re.compile(r"^[a-z]+$")
MIN_TOPIC_WORD_LENGTH = 2


def _ordered(counts: Counter) -> List[str]:
    """Words by count (descending), ties alphabetically: deterministic ids."""
    return sorted(counts, key=lambda word: (-counts[word], word))


class TopicVocabulary:
    """Topic (bag-of-words) vocabulary and VQ word vocabulary; see the module docstring.

    Build with :meth:`build`; restore with :meth:`from_state_dict`.
    """

    def __init__(self, topic_words: Sequence[str], vq_words: Sequence[str], min_count: int = 1):
        """``topic_words``: the topic vocabulary in id order; ``vq_words``: the VQ words in id
        order *without* the two specials (they get ids 2, 3, ...)."""
        self.topic_words: List[str] = [str(w) for w in topic_words]
        self.vq_words: List[str] = [PAD, UNK] + [str(w) for w in vq_words]
        self.min_count = int(min_count)
        self.topic_index: Dict[str, int] = {w: i for i, w in enumerate(self.topic_words)}
        self.vq_index: Dict[str, int] = {w: i for i, w in enumerate(self.vq_words)}
        if len(self.topic_index) != len(self.topic_words) or len(self.vq_index) != len(self.vq_words):
            raise ValueError("TopicVocabulary: duplicate words (or a word spelled <pad>/<unk>)")
        missing = [w for w in self.topic_words if w not in self.vq_index]
        if missing:
            raise ValueError(f"TopicVocabulary: topic words missing from the VQ vocabulary: {missing[:5]}")

    # ---------------------------------------------------------------- building
    @classmethod
    def build(cls, sentences: Iterable[Iterable[str]], min_count: int = 3,
              stop_words: AbstractSet[str] = frozenset()) -> "TopicVocabulary":
        """Count the words of ``sentences`` (each an iterable of words; lower-cased here).

        Raises ValueError when no word qualifies for the topic vocabulary (the message gives the
        counts and what to change); ``min_count`` (``--topic-min-count``) is checked by the task.
        """
        stop = frozenset(w.lower() for w in stop_words)
        counts: Counter = Counter()
        for words in sentences:
            counts.update(w.lower() for w in words)
        counts.pop(PAD, None)
        counts.pop(UNK, None)
        counts.pop("", None)
        candidates = Counter({w: c for w, c in counts.items()
                              if len(w) >= MIN_TOPIC_WORD_LENGTH and TOPIC_WORD.match(w) and w not in stop})
        topic = Counter({w: c for w, c in candidates.items() if c >= min_count})
        if not topic:
            raise ValueError(
                f"the topic vocabulary is empty: the training sentences hold {sum(counts.values())} "
                f"words ({len(counts)} distinct), {len(candidates)} of them alphabetic, at least "
                f"{MIN_TOPIC_WORD_LENGTH} letters long and not stop words, but none seen at least "
                f"min_count={min_count} times (most frequent: "
                f"{[(w, candidates[w]) for w in _ordered(candidates)[:3]]}). Lower the minimum count "
                f"(--topic-min-count), use fewer stop words (--topic-stop-words none) or train on "
                f"more data"
            )
        return cls(_ordered(topic), _ordered(counts), min_count)

    # ------------------------------------------------------------------ lookups
    @property
    def topic_size(self) -> int:
        """V_topic, the length of :meth:`bow` vectors."""
        return len(self.topic_words)

    @property
    def vq_size(self) -> int:
        """V_vq, the VQ vocabulary size including ``<pad>`` (0) and ``<unk>`` (1)."""
        return len(self.vq_words)

    def topic_ids(self, words: Iterable[str]) -> List[int]:
        """Topic-vocabulary ids of the words that are in it (others dropped), in order."""
        index = self.topic_index
        return [index[w] for w in (w.lower() for w in words) if w in index]

    def bow(self, words: Iterable[str]) -> torch.Tensor:
        """Bag-of-words counts over the topic vocabulary: FloatTensor ``[V_topic]``."""
        out = torch.zeros(self.topic_size)
        ids = self.topic_ids(words)
        if ids:
            out.index_add_(0, torch.tensor(ids, dtype=torch.long), torch.ones(len(ids)))
        return out

    def vq_ids(self, words: Iterable[str]) -> torch.Tensor:
        """VQ ids of ``words`` (``<unk>`` = 1 for unseen words): LongTensor ``[len(words)]``."""
        index = self.vq_index
        return torch.tensor([index.get(w.lower(), UNK_ID) for w in words], dtype=torch.long)

    def vq_to_topic(self) -> torch.Tensor:
        """LongTensor ``[V_vq]``: the topic id of each VQ word, -1 outside the topic vocabulary
        (``<pad>`` and ``<unk>`` included)."""
        return torch.tensor([self.topic_index.get(w, -1) if i > UNK_ID else -1
                             for i, w in enumerate(self.vq_words)], dtype=torch.long)

    # --------------------------------------------------------------- persisting
    def state_dict(self) -> dict:
        """Plain lists and ints (safe for ``torch.load(weights_only=True)``)."""
        return {"topic_words": list(self.topic_words), "vq_words": list(self.vq_words[UNK_ID + 1:]),
                "min_count": self.min_count}

    @classmethod
    def from_state_dict(cls, state: dict) -> "TopicVocabulary":
        try:
            return cls(state["topic_words"], state["vq_words"], state.get("min_count", 1))
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a TopicVocabulary state dict ({error!r})") from error

    def __eq__(self, other) -> bool:
        return isinstance(other, TopicVocabulary) and self.state_dict() == other.state_dict()

    def __repr__(self) -> str:
        return f"TopicVocabulary(topic_size={self.topic_size}, vq_size={self.vq_size}, min_count={self.min_count})"


def check_num_topics(num_topics: int, vocabulary: TopicVocabulary) -> None:
    """Refuse a number of topics K larger than the topic vocabulary (``validate_topic_args`` of
    ``user_dir.topic_vq.model`` refuses K < 1)."""
    if num_topics > vocabulary.topic_size:
        raise ValueError(
            f"--num-topics {num_topics} exceeds the {vocabulary.topic_size}-word topic vocabulary "
            f"(words seen >= {vocabulary.min_count} times in the training data, stop words removed); "
            f"use fewer topics, or enlarge the vocabulary with a lower --topic-min-count or "
            f"--topic-stop-words none"
        )
