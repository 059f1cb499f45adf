import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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


def run_checked(cmd, timeout=600, **kwargs):
    """Run a command (paths allowed); AssertionError with the output's tail when it fails."""
    import subprocess

    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="session")
def small_translation_bin(tmp_path_factory):
    """400 training pairs of the Ding dictionary (at most 8 words; 50 valid, 50 test),
    sentencepiece (joint, 300), binarized by ``prepare-translation``."""
    work = tmp_path_factory.mktemp("ding_small")
    run_checked([venv_bin("prepare-ding"), "--out-dir", work / "all",
                 "--max-words", "8", "--valid-size", "50", "--test-size", "50"])
    (work / "raw").mkdir()
    for split, n in (("train", 400), ("valid", 50), ("test", 50)):
        for lang in ("de", "en"):
            lines = (work / "all" / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(True)[:n]
            (work / "raw" / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    run_checked([venv_bin("prepare-translation"), "--train-prefix", work / "raw/train",
                 "--valid-prefix", work / "raw/valid", "--test-prefix", work / "raw/test", "--src", "de",
                 "--tgt", "en", "--joint", "--vocab-size", "300", "--out-dir", work / "prep", "--workers", "1"])
    return work / "prep" / "bin"


@pytest.fixture(scope="session")
def small_vae_bin(tmp_path_factory):
    """240 English Ding phrases (200 train, 40 valid), binarized with ``fairseq-preprocess --only-source``."""
    root = tmp_path_factory.mktemp("vae_small")
    lines = english_phrases(240)
    (root / "train.txt").write_text("\n".join(lines[:200]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[200:]) + "\n")
    run_checked([venv_bin("fairseq-preprocess"), "--only-source", "--trainpref", root / "train.txt", "--validpref",
                 root / "valid.txt", "--destdir", root / "bin", "--workers", "1"])
    return root / "bin"
