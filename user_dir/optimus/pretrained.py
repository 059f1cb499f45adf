"""Pre-trained Hugging Face directories for Optimus and the fairseq-dictionary -> vocabulary maps.

Optimus initialises its encoder from BERT and its decoder from GPT-2 (Li et al., EMNLP 2020,
Sec. 4.2). Here both are *local* Hugging Face directories (``save_pretrained`` output:
``config.json``, ``model.safetensors`` or ``pytorch_model.bin``, and the tokenizer's
vocabulary file), given as ``--bert-dir`` / ``--gpt2-dir``.

**One dictionary, two vocabularies.** The original Optimus reads WordPiece ids into BERT and
scores GPT-2 BPE ids at the output (the Optimus paper, Li et al., EMNLP 2020, Sec. 4.2, "Tokenization"). fairseq's
``sentence_vae`` task has ONE dictionary for the source and the target, so in this
integration the encoder input and the decoder output are the same symbols. A pre-trained
side can only be used when the dictionary's symbols are that model's tokens, i.e. the data
was tokenised with that model's tokenizer (BERT: WordPiece pieces such as ``##ing``; GPT-2:
byte-level BPE strings such as ``Ġthe``). The dictionary is then mapped onto the model's
vocabulary symbol by symbol (:func:`map_dictionary`): a fairseq dictionary always starts with
its own four specials ``<s> <pad> </s> <unk>`` (and may end with ``madeupwordNNNN`` fillers),
so its indices can never be the vocabulary file's line numbers; the map makes index
equality unnecessary and lets the dictionary be any subset of the vocabulary (e.g. the one
``fairseq-preprocess`` builds from the training data, or the whole ``vocab.txt``). The
specials map to the model's own: BERT ``<s> -> [CLS]``, ``</s> -> [SEP]``, ``<pad> ->
[PAD]``, ``<unk> -> [UNK]``; GPT-2 ``</s> -> <|endoftext|>`` (its eos) and, as the Optimus
authors did when they added ``<BOS>``/``<PAD>`` to GPT-2 (vocabulary 50257 -> 50260), the
specials GPT-2 lacks get new embedding rows. If both sides are pre-trained with different
vocabularies, one dictionary cannot index both: :func:`check_one_dictionary` refuses.
"""

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from latent_core.vae import VAEConfigError

from ..hf_pretrained import inspect_hf_directory

logger = logging.getLogger(__name__)

MODEL_TYPES = {"bert": "a BERT-architecture encoder", "gpt2": "a GPT-2-architecture decoder"}
VOCAB_FILES = {"bert": ("vocab.txt", "tokenizer.json"), "gpt2": ("vocab.json", "tokenizer.json")}
# symbols fairseq's Dictionary.finalize(padding_factor=...) appends; they never occur in data
FILLER_SYMBOL = re.compile(r"^madeupword\d{4}$")


class OptimusConfigError(VAEConfigError):
    """An impossible Optimus option or pre-trained directory (the message names which)."""


@dataclass
class PretrainedDirectory:
    """A checked Hugging Face directory: its raw ``config.json`` and its vocabulary."""

    path: str
    option: str  # the command-line option that named it, for error messages
    model_type: str
    config: dict
    vocab: Dict[str, int]  # token -> id
    vocab_file: str

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding matrix (``vocab_size`` of config.json)."""
        return int(self.config["vocab_size"])


def inspect_pretrained_directory(path: str, option: str, expected_type: str) -> PretrainedDirectory:
    """Check ``path`` before loading: config.json, ``model_type``, weights, vocabulary.

    Raises :class:`OptimusConfigError` naming ``option``, the directory and what is wrong
    (missing config.json or weights, wrong ``model_type`` -- e.g. a GPT-2 directory given
    as ``--bert-dir`` --, missing vocabulary file, vocabulary larger than the embedding).
    """
    def check_type(config: dict, config_path: str) -> None:
        model_type = config.get("model_type")
        if model_type != expected_type:
            raise OptimusConfigError(
                f"{option} {path}: config.json has model_type {model_type!r}, expected {expected_type!r} "
                f"({MODEL_TYPES[expected_type]}); check that --bert-dir names a BERT directory and "
                f"--gpt2-dir a GPT-2 directory"
            )

    config = inspect_hf_directory(path, option, OptimusConfigError, validate=check_type)
    model_type = config["model_type"]
    config_path = os.path.join(path, "config.json")
    if not isinstance(config.get("vocab_size"), int):
        raise OptimusConfigError(f"{option} {config_path}: config.json has no integer vocab_size")
    vocab, vocab_file = read_vocabulary(path, option, expected_type)
    largest = max(vocab.values())
    if largest >= config["vocab_size"]:
        raise OptimusConfigError(
            f"{option}: {vocab_file} has {len(vocab)} entries with ids up to {largest}, but "
            f"config.json's vocab_size is {config['vocab_size']}: the vocabulary does not belong "
            f"to these weights"
        )
    return PretrainedDirectory(path, option, model_type, config, vocab, vocab_file)


def read_vocabulary(path: str, option: str, model_type: str) -> Tuple[Dict[str, int], str]:
    """``({token: id}, file)`` from ``vocab.txt`` (BERT: line number = id), ``vocab.json``
    (GPT-2) or, failing those, ``tokenizer.json`` (``model.vocab`` plus ``added_tokens``)."""
    for name in VOCAB_FILES[model_type]:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if name == "vocab.txt":
            vocab: Dict[str, int] = {}
            with open(file, encoding="utf-8") as f:
                for index, line in enumerate(f):
                    vocab.setdefault(line.rstrip("\n"), index)
        elif name == "vocab.json":
            with open(file, encoding="utf-8") as f:
                vocab = {str(token): int(index) for token, index in json.load(f).items()}
        else:
            with open(file, encoding="utf-8") as f:
                tokenizer = json.load(f)
            entries = (tokenizer.get("model") or {}).get("vocab")
            if isinstance(entries, list):  # Unigram: [[piece, score], ...], id = position
                vocab = {str(entry[0]): index for index, entry in enumerate(entries)}
            elif isinstance(entries, dict):
                vocab = {str(token): int(index) for token, index in entries.items()}
            else:
                raise OptimusConfigError(f"{option} {file}: no model.vocab in tokenizer.json")
            for added in tokenizer.get("added_tokens") or []:
                vocab.setdefault(str(added["content"]), int(added["id"]))
        if not vocab:
            raise OptimusConfigError(f"{option} {file}: empty vocabulary")
        return vocab, file
    raise OptimusConfigError(
        f"{option} {path}: no vocabulary file (looked for {' or '.join(VOCAB_FILES[model_type])}); "
        f"it is needed to map the fairseq dictionary onto the model's token ids"
    )


def _special_token(directory: PretrainedDirectory, key: str, default: str) -> str:
    """A BERT special token's string from special_tokens_map.json / tokenizer_config.json."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = os.path.join(directory.path, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                value = json.load(f).get(key)
        except (OSError, ValueError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return default


def bert_special_ids(directory: PretrainedDirectory, dictionary) -> Dict[str, Optional[int]]:
    """fairseq specials -> BERT ids: ``<s>`` [CLS], ``</s>`` [SEP], ``<pad>`` [PAD], ``<unk>`` [UNK]."""
    wanted = {
        dictionary.bos_word: ("cls_token", "[CLS]"),
        dictionary.eos_word: ("sep_token", "[SEP]"),
        dictionary.pad_word: ("pad_token", "[PAD]"),
        dictionary.unk_word: ("unk_token", "[UNK]"),
    }
    ids = {}
    for symbol, (key, default) in wanted.items():
        token = _special_token(directory, key, default)
        if token not in directory.vocab:
            raise OptimusConfigError(
                f"{directory.option}: the {key} {token!r} (for fairseq's {symbol}) is not in {directory.vocab_file}"
            )
        ids[symbol] = directory.vocab[token]
    return ids


def gpt2_special_ids(directory: PretrainedDirectory, dictionary) -> Dict[str, Optional[int]]:
    """fairseq specials -> GPT-2 ids: ``</s>`` -> eos (``<|endoftext|>``); ``<s>`` and
    ``<pad>`` -> GPT-2's own bos / pad when it has distinct ones; else (and ``<unk>``, which a
    byte-level BPE never needs) ``None``: a new embedding row."""
    config = directory.config
    eos = config.get("eos_token_id")
    ids: Dict[str, Optional[int]] = {dictionary.eos_word: eos, dictionary.unk_word: None}
    used = {eos}
    for symbol, key in ((dictionary.bos_word, "bos_token_id"), (dictionary.pad_word, "pad_token_id")):
        value = config.get(key)
        ids[symbol] = value if isinstance(value, int) and value not in used else None
        used.add(ids[symbol])
    return ids


def map_dictionary(dictionary, directory: PretrainedDirectory, special_ids: Mapping[str, Optional[int]],
                   distinct_rows: bool, unknown_id: Optional[int] = None) -> Tuple[List[int], int]:
    """Map every fairseq dictionary index to a row of the pre-trained embedding matrix.

    Returns ``(rows, num_new_rows)``: ``rows[i]`` is the model's id for fairseq symbol ``i``;
    ids ``>= directory.vocab_size`` are ``num_new_rows`` rows to append to the embedding.

    * ordinary symbols must be tokens of the vocabulary (else an error naming the file, the
      number and a few examples); the dictionary cannot have more of them than the vocabulary;
    * fairseq's specials map through ``special_ids`` (``None``: a new row); other special
      symbols (extra specials, ``madeupwordNNNN`` fillers) map to the same token if the
      vocabulary has it, else to a new row (``distinct_rows``, the decoder's output side) or to
      ``unknown_id`` (the encoder's input side);
    * with ``distinct_rows`` (symbols scored by a softmax), two symbols never share a row: a
      later symbol that would (e.g. ``<|endoftext|>`` listed as an ordinary symbol besides
      ``</s>``) gets a new row, with a warning, so no probability mass is split between them.
    """
    symbols: Sequence[str] = dictionary.symbols
    num_special = dictionary.nspecial
    is_special = [i < num_special or bool(FILLER_SYMBOL.match(s)) for i, s in enumerate(symbols)]
    ordinary = [s for s, special in zip(symbols, is_special) if not special]
    vocab = directory.vocab
    if len(ordinary) > len(vocab):
        raise OptimusConfigError(
            f"{directory.option}: the fairseq dictionary has {len(symbols)} symbols "
            f"({len(ordinary)} besides fairseq's specials) but {directory.vocab_file} has only "
            f"{len(vocab)} entries; the dictionary must consist of this model's tokens "
            f"(tokenise the data with its tokenizer, build the dictionary from its vocabulary)"
        )
    missing = [s for s in ordinary if s not in vocab]
    if missing:
        raise OptimusConfigError(
            f"{directory.option}: {len(missing)} of the {len(ordinary)} symbols of the fairseq "
            f"dictionary are not in {directory.vocab_file} (e.g. {missing[:8]}); the data must be "
            f"tokenised with this model's tokenizer (dictionary size {len(symbols)}, vocabulary "
            f"size {len(vocab)})"
        )
    rows: List[int] = []
    next_new = directory.vocab_size
    for symbol, special in zip(symbols, is_special):
        row = vocab[symbol] if not special else special_ids.get(symbol, vocab.get(symbol))
        if row is None:
            if distinct_rows:
                row, next_new = next_new, next_new + 1
            elif unknown_id is not None:
                row = unknown_id
            else:
                raise OptimusConfigError(
                    f"{directory.option}: fairseq symbol {symbol!r} has no counterpart in {directory.vocab_file}"
                )
        rows.append(row)
    if distinct_rows:
        seen: Dict[int, str] = {}
        moved = []
        for index, row in enumerate(rows):
            if row in seen:
                moved.append(f"{symbols[index]!r} (shares {seen[row]!r}'s id {row})")
                rows[index], next_new = next_new, next_new + 1
            else:
                seen[row] = symbols[index]
        if moved:
            logger.warning(
                "%s: %d fairseq symbols map to a token already used by another symbol and get new "
                "embedding rows instead: %s", directory.option, len(moved), ", ".join(moved[:8]),
            )
    return rows, next_new - directory.vocab_size


def check_one_dictionary(encoder_dictionary, decoder_dictionary,
                         bert: PretrainedDirectory, gpt2: PretrainedDirectory) -> None:
    """Refuse BERT and GPT-2 weights with different vocabularies over one fairseq dictionary."""
    if list(encoder_dictionary.symbols) != list(decoder_dictionary.symbols):
        return  # two dictionaries: each side is mapped onto its own vocabulary
    if bert.vocab == gpt2.vocab:
        return
    raise OptimusConfigError(
        f"--bert-dir and --gpt2-dir have different vocabularies ({bert.vocab_file}: "
        f"{len(bert.vocab)} tokens; {gpt2.vocab_file}: {len(gpt2.vocab)} tokens), but this task "
        f"has one fairseq dictionary for the encoder input and the decoder output, and one "
        f"dictionary cannot index both (the original Optimus feeds WordPiece to BERT and scores "
        f"BPE from GPT-2). Initialise only one side from pre-trained weights -- drop --bert-dir "
        f"or --gpt2-dir; the other side is then trained from scratch over the same dictionary -- "
        f"and tokenise the data with the pre-trained side's tokenizer."
    )


def load_pretrained(model_class, directory: PretrainedDirectory, allowed_missing: Sequence[str] = (),
                    **kwargs):
    """``model_class.from_pretrained(directory.path, **kwargs)``, refusing a checkpoint that
    leaves weights uninitialised (other than those whose names start with ``allowed_missing``,
    which are only warned about)."""
    model, info = model_class.from_pretrained(directory.path, output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys") or [])
    tolerated = [key for key in missing if key.startswith(tuple(allowed_missing))]
    fatal = [key for key in missing if key not in tolerated]
    if fatal:
        raise OptimusConfigError(
            f"{directory.option} {directory.path}: {len(fatal)} weights of {model_class.__name__} are "
            f"not in the checkpoint (e.g. {fatal[:5]}); is it the right architecture?"
        )
    if tolerated:
        logger.warning("%s %s: %s not in the checkpoint, randomly initialised",
                       directory.option, directory.path, ", ".join(tolerated))
    if info.get("mismatched_keys"):
        raise OptimusConfigError(
            f"{directory.option} {directory.path}: weights with mismatched shapes: "
            f"{sorted(map(str, info['mismatched_keys']))[:5]}"
        )
    return model
