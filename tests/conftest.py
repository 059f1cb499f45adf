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


DING_DE_EN = Path("/usr/share/trans/de-en")  # the Debian Ding dictionary (apt-get install trans-de-en)


def english_phrases(n: int, min_words: int = 4, max_words: int = 10):
    """The first ``n`` English sides of the Ding dictionary with ``min_words``..``max_words`` words:
    first alternative, annotations dropped, lower-cased (the sentence-VAE tests' corpus)."""
    import re

    out = []
    with open(DING_DE_EN, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#") or "::" not in line:
                continue
            first = re.split(r"[|;]", line.split("::", 1)[1])[0]
            first = re.sub(r"\[[^\]]*\]|\{[^}]*\}|<[^>]*>|\([^)]*\)", " ", first).lower()
            words = re.findall(r"[a-z]+", first)
            if min_words <= len(words) <= max_words:
                out.append(" ".join(words))
                if len(out) == n:
                    break
    return out
