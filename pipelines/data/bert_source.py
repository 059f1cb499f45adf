"""The source side of a translation corpus in a BERT's own tokenization (BV-T / BSDMA-T).

Used by ``prepare-translation --src-bert-dir DIR`` (:mod:`pipelines.data.translation`) and
read back by the ``bert_fused_transformer`` model (``user_dir/sdma/bert_fused.py``):

* :func:`load_tokenizer`: the tokenizer of a local Hugging Face directory (never a download);
* :func:`encode_pieces`: a batch of raw sentences -> BERT's pieces (WordPiece ``##`` pieces
  for BERT, byte-level BPE for RoBERTa), space-separated, no special tokens;
* :func:`write_dictionary`: BERT's vocabulary as a fairseq dictionary file (``--srcdict``), in
  BERT's id order, without fairseq's own four specials (``<s> <pad> </s> <unk>``, which the
  model maps to BERT's CLS/PAD/SEP/UNK);
* :func:`max_source_pieces`: the most pieces (with fairseq's ``</s>``) a source may have:
  BERT's ``max_position_embeddings`` minus ``[CLS]`` (and RoBERTa's padding offset).
"""

import json
import os
from pathlib import Path
from typing import List, Sequence

from latent_core.errors import PluginConfigError

# position ids start after the padding index (RoBERTa's create_position_ids_from_input_ids)
PADDING_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "mpnet")
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")


class BertSourceError(PluginConfigError):
    """A BERT directory that cannot tokenise the source (the message names ``--src-bert-dir``)."""


def max_source_pieces(config: dict) -> int:
    """Source pieces + ``</s>`` that fit BERT's positions after ``[CLS]`` (config.json as a dict)."""
    offset = int(config.get("pad_token_id") or 0) + 1 if config.get("model_type") in PADDING_OFFSET_POSITIONS else 0
    return int(config["max_position_embeddings"]) - offset - 1


def read_config(bert_dir: os.PathLike, option: str = "--src-bert-dir") -> dict:
    path = Path(bert_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise BertSourceError(f"{option} {bert_dir}: no readable config.json ({error})") from None
    if "max_position_embeddings" not in config:
        raise BertSourceError(f"{option} {bert_dir}: config.json has no max_position_embeddings; "
                              "is it a BERT-family encoder?")
    return config


def load_tokenizer(bert_dir: os.PathLike, option: str = "--src-bert-dir"):
    """``AutoTokenizer.from_pretrained(bert_dir, local_files_only=True)``; BertSourceError otherwise."""
    from transformers import AutoTokenizer

    if not Path(bert_dir).is_dir():
        raise BertSourceError(f"{option} {bert_dir}: no such directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(bert_dir), local_files_only=True)
    except Exception as error:  # transformers raises many types for unreadable directories
        raise BertSourceError(f"{option} {bert_dir}: cannot load its tokenizer ({error})") from None
    missing = [name for name in ("cls_token", "sep_token", "pad_token", "unk_token")
               if getattr(tokenizer, name, None) is None]
    if missing:
        raise BertSourceError(f"{option} {bert_dir}: the tokenizer has no {', '.join(missing)}; a BERT-family "
                              f"tokenizer has [CLS]/[SEP]/[PAD]/[UNK] (or <s>/</s>/<pad>/<unk>)")
    return tokenizer


def encode_pieces(tokenizer, lines: Sequence[str]) -> List[str]:
    """Each line as BERT's pieces, space-separated (no [CLS]/[SEP]; the model adds them)."""
    return [" ".join(tokenizer.convert_ids_to_tokens(ids))
            for ids in tokenizer(list(lines), add_special_tokens=False)["input_ids"]]


def write_dictionary(tokenizer, path: os.PathLike) -> int:
    """BERT's vocabulary as a fairseq dictionary file (``symbol 1`` per line, id order); returns its size."""
    vocab = tokenizer.get_vocab()
    symbols = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])
               if token not in FAIRSEQ_SPECIALS]
    bad = [token for token in symbols if not token or any(c.isspace() for c in token)]
    if bad:
        raise BertSourceError(f"the tokenizer's vocabulary has {len(bad)} token(s) with whitespace "
                              f"(e.g. {bad[:3]!r}), which a fairseq dictionary cannot hold")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for token in symbols:
            handle.write(f"{token} 1\n")
    return len(symbols)
