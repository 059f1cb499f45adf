import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "2")

import user_dir  # noqa: E402,F401  (registers models, criterions, safe globals)


def venv_bin(name: str) -> str:
    """A console script of the running interpreter's environment (fairseq-train, ...)."""
    return str(Path(sys.executable).with_name(name))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def save_tiny_bert(path: Path, words) -> Path:
    """A tiny random BERT config (2 layers, hidden 32, no dropout) and a WordPiece tokenizer over
    ``words`` (specials first) saved in ``path``: the stand-in encoder of the hf_sentence tests."""
    from transformers import BertConfig, BertTokenizerFast

    BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(str(path))
    BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0).save_pretrained(str(path))  # no dropout: learns in few epochs
    return path
