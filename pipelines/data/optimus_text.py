"""One sentence in two tokenizations for Optimus (``prepare-optimus-data``; read by the
``optimus_lm`` task of ``user_dir/optimus/task.py``).

Optimus feeds BERT WordPiece pieces and scores GPT-2 byte-level BPE tokens (Li et al., EMNLP 2020,
Sec. 4.2, "Tokenization": "the input of encoder is WPE, and the output of decoder is BPE").
For every sentence of raw text this module writes both, and binarises them as one fairseq
language pair ``bert -> gpt2``:

    OUT/dict.bert.txt, OUT/dict.gpt2.txt        BERT's and GPT-2's vocabularies (id order,
                                                without fairseq's <s> <pad> </s> <unk>)
    OUT/{split}.bert-gpt2.{bert,gpt2}.{bin,idx}  fairseq-preprocess output
    OUT/bert_tokenizer/, OUT/gpt2_tokenizer/     the two tokenizers (save_pretrained), which the
                                                task uses to tokenise input text and detokenise
                                                GPT-2 output back to text
    OUT/text/{split}.{bert,gpt2}                 the pieces, space-separated (one line each)
    OUT/optimus_data.json                        counts, limits and where everything came from

Tokenizers come from local directories only (``AutoTokenizer.from_pretrained(dir,
local_files_only=True)``; never a download): ``--bert-dir`` any BERT-family tokenizer,
``--gpt2-dir`` a byte-level BPE tokenizer (``vocab.json`` + ``merges.txt`` as GPT-2 ships it,
or a ``tokenizer.json``). :func:`train_gpt2_tokenizer` trains such a tokenizer on local text
(``tokenizers``' ``ByteLevelBPETokenizer``) and saves it in GPT-2's own format, so the same
code path reads it and the real ``gpt2`` directory.

Lengths: a sentence must fit BERT's positions after [CLS] (pieces + [SEP] <=
``max_position_embeddings - 1``) and GPT-2's after the memory slot (BPE tokens + the end
token <= ``n_positions - 1``). A longer one stops the preparation with its ``file:line``
(``--skip-too-long`` drops and counts it instead); empty lines are dropped and counted.
"""

import argparse
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from latent_core.errors import command_error
from pipelines.data.bert_source import (
    FAIRSEQ_SPECIALS,
    BertSourceError,
    encode_pieces,
    load_tokenizer,
    max_source_pieces,
    read_config,
    write_dictionary,
)
from pipelines.data.preprocess import fairseq_preprocess
from pipelines.data.registry import DataError

PROG = "prepare-optimus-data"
SOURCE_LANG, TARGET_LANG = "bert", "gpt2"
SPLITS = ("train", "valid", "test")
DEFAULT_GPT2_POSITIONS = 1024  # GPT-2's n_positions (and the optimus model's default)
SUMMARY = "optimus_data.json"


class OptimusDataError(DataError):
    """Bad tokenizer directory or text for Optimus data (the message names the option or file)."""


# ----------------------------------------------------------------------------- GPT-2 side
def load_gpt2_tokenizer(gpt2_dir, option: str = "--gpt2-dir"):
    """The byte-level BPE tokenizer of a local directory: ``tokenizer.json`` (via
    ``AutoTokenizer``), else ``vocab.json`` + ``merges.txt`` (GPT-2's files, read into
    ``GPT2TokenizerFast``). OptimusDataError for a missing directory, a vocabulary without
    merges, or a tokenizer that is not BPE."""
    from transformers import AutoTokenizer, GPT2TokenizerFast

    path = Path(gpt2_dir)
    if not path.is_dir():
        raise OptimusDataError(f"{option} {gpt2_dir}: no such directory")
    if (path / "tokenizer.json").is_file():
        try:
            backend = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))["model"]
        except (OSError, ValueError, KeyError) as error:
            raise OptimusDataError(f"{option} {path / 'tokenizer.json'}: unreadable ({error})") from None
        if backend.get("type") != "BPE" or not backend.get("merges"):
            raise OptimusDataError(f"{option} {path / 'tokenizer.json'}: not a BPE tokenizer with merges "
                                   f"(model type {backend.get('type')!r}); GPT-2 uses byte-level BPE")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as error:  # transformers raises many types for unreadable directories
            raise OptimusDataError(f"{option} {gpt2_dir}: cannot load its tokenizer ({error})") from None
    elif (path / "vocab.json").is_file():
        if not (path / "merges.txt").is_file():
            raise OptimusDataError(
                f"{option} {gpt2_dir}: vocab.json without merges.txt; a GPT-2 byte-level BPE tokenizer "
                f"needs both (or a tokenizer.json)"
            )
        try:
            vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
            merges = [tuple(line.split(" ")) for line in
                      (path / "merges.txt").read_text(encoding="utf-8").splitlines()
                      if line and not line.startswith("#version")]
        except (OSError, ValueError) as error:
            raise OptimusDataError(f"{option} {gpt2_dir}: unreadable vocab.json/merges.txt ({error})") from None
        bad = [m for m in merges if len(m) != 2]
        if bad or not merges:
            raise OptimusDataError(f"{option} {path / 'merges.txt'}: expected one 'left right' pair per line "
                                   f"(found {bad[:2] if bad else 'no merges'})")
        tokenizer = GPT2TokenizerFast(vocab=vocab, merges=merges)
    else:
        raise OptimusDataError(f"{option} {gpt2_dir}: no tokenizer (looked for tokenizer.json, or vocab.json "
                               f"+ merges.txt)")
    if tokenizer.eos_token is None:
        raise OptimusDataError(f"{option} {gpt2_dir}: the tokenizer has no end-of-text token")
    return tokenizer


def train_gpt2_tokenizer(files: Sequence[Path], out_dir: Path, vocab_size: int = 8000,
                         min_frequency: int = 2) -> Path:
    """Train a byte-level BPE (GPT-2's algorithm, ``<|endoftext|>`` as its one special token) on
    ``files`` and save it as GPT-2 does (``vocab.json``, ``merges.txt``) plus ``tokenizer.json``."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    if vocab_size < 257:
        raise OptimusDataError(f"--bpe-vocab-size {vocab_size}: a byte-level BPE needs >= 257 entries "
                               f"(256 bytes + <|endoftext|>)")
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise OptimusDataError(f"no such text file(s) for the BPE: {', '.join(missing)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()  # GPT-2: no prefix space, no lower-casing
    bpe.train([str(f) for f in files], vocab_size=vocab_size, min_frequency=min_frequency,
              special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(out_dir))
    tokenizer = load_gpt2_tokenizer(out_dir, "--bpe-out")
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def gpt2_pieces(tokenizer, lines: Sequence[str]) -> List[str]:
    """Each line as GPT-2 byte-level BPE tokens (``Ġthe``), space-separated, no special tokens."""
    return [" ".join(tokenizer.convert_ids_to_tokens(ids))
            for ids in tokenizer(list(lines), add_special_tokens=False)["input_ids"]]


def write_gpt2_dictionary(tokenizer, path: Path) -> int:
    """GPT-2's vocabulary as a fairseq dictionary file (id order), without fairseq's four
    specials and the tokenizer's own special tokens (``<|endoftext|>`` is fairseq's ``</s>``
    in the model, see ``user_dir/optimus/pretrained.py``); returns its size."""
    special = set(tokenizer.all_special_tokens) | set(FAIRSEQ_SPECIALS)
    symbols = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
               if token not in special]
    bad = [token for token in symbols if not token or any(c.isspace() for c in token)]
    if bad:
        raise OptimusDataError(f"the GPT-2 vocabulary has {len(bad)} token(s) with whitespace (e.g. {bad[:3]!r}); "
                               f"is it a byte-level BPE?")
    Path(path).write_text("".join(f"{token} 1\n" for token in symbols), encoding="utf-8")
    return len(symbols)


def gpt2_positions(gpt2_dir: Path, default: int = DEFAULT_GPT2_POSITIONS) -> int:
    """``n_positions`` of the directory's config.json, or ``default`` for a tokenizer-only directory."""
    config = Path(gpt2_dir) / "config.json"
    if config.is_file():
        try:
            return int(json.loads(config.read_text(encoding="utf-8"))["n_positions"])
        except (OSError, ValueError, KeyError, TypeError):
            raise OptimusDataError(f"--gpt2-dir {config}: no integer n_positions") from None
    return default


# ----------------------------------------------------------------------------- preparation
def read_sentences(path: Path) -> List[str]:
    """Lines of a UTF-8 text file, stripped (OptimusDataError naming ``file:line`` otherwise)."""
    if not path.is_file():
        raise OptimusDataError(f"{path}: no such file")
    lines = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                lines.append(raw.decode("utf-8").strip())
            except UnicodeDecodeError:
                raise OptimusDataError(f"{path}:{number}: not UTF-8 text") from None
    return lines


def tokenize_split(path: Path, bert, gpt2, bert_limit: int, gpt2_limit: int, skip_too_long: bool,
                   batch: int = 1000) -> Dict[str, object]:
    """Both tokenizations of one text file: ``{"bert": [...], "gpt2": [...], "empty": n,
    "too_long": n}``; a sentence over a limit raises (``file:line``) unless ``skip_too_long``."""
    lines = read_sentences(path)
    kept_bert: List[str] = []
    kept_gpt2: List[str] = []
    empty = too_long = 0
    for first in range(0, len(lines), batch):
        chunk = lines[first:first + batch]
        for offset, (bert_line, gpt2_line) in enumerate(zip(encode_pieces(bert, chunk), gpt2_pieces(gpt2, chunk))):
            if not bert_line or not gpt2_line:
                empty += 1
                continue
            bert_len, gpt2_len = len(bert_line.split()) + 1, len(gpt2_line.split()) + 1  # + [SEP] / end token
            if bert_len > bert_limit or gpt2_len > gpt2_limit:
                if skip_too_long:
                    too_long += 1
                    continue
                raise OptimusDataError(
                    f"{path}:{first + offset + 1}: {bert_len} BERT pieces (limit {bert_limit}) and {gpt2_len} "
                    f"GPT-2 tokens (limit {gpt2_limit}) with the end token; shorten it or pass --skip-too-long"
                )
            kept_bert.append(bert_line)
            kept_gpt2.append(gpt2_line)
    return {"bert": kept_bert, "gpt2": kept_gpt2, "empty": empty, "too_long": too_long}


def binarize(text_dir: Path, out_dir: Path, splits: Sequence[str], workers: int = 1) -> None:
    argv = ["--source-lang", SOURCE_LANG, "--target-lang", TARGET_LANG,
            "--srcdict", out_dir / f"dict.{SOURCE_LANG}.txt", "--tgtdict", out_dir / f"dict.{TARGET_LANG}.txt",
            "--destdir", out_dir, "--workers", workers]
    for split in splits:
        argv += [f"--{split}pref", text_dir / split]
    fairseq_preprocess(argv, OptimusDataError)


def prepare(out_dir: Path, texts: Dict[str, Path], bert_dir: Path, gpt2_dir: Path,
            skip_too_long: bool = False, gpt2_max_positions: Optional[int] = None, workers: int = 1) -> dict:
    """Tokenise ``texts`` ({split: raw text file}; ``train`` required) with both tokenizers and
    binarise them into ``out_dir`` (layout in the module doc). Returns the summary."""
    if "train" not in texts:
        raise OptimusDataError("a train text file is required (--train)")
    unknown = [s for s in texts if s not in SPLITS]
    if unknown:
        raise OptimusDataError(f"unknown split(s) {unknown}; use {SPLITS}")
    try:
        bert = load_tokenizer(bert_dir, "--bert-dir")
        bert_limit = max_source_pieces(read_config(bert_dir, "--bert-dir"))
    except BertSourceError as error:
        raise OptimusDataError(str(error)) from None
    gpt2 = load_gpt2_tokenizer(gpt2_dir)
    positions = gpt2_max_positions or gpt2_positions(gpt2_dir)
    gpt2_limit = positions - 1  # the memory slot of Optimus takes position 0
    out_dir = Path(out_dir)
    text_dir = out_dir / "text"
    text_dir.mkdir(parents=True, exist_ok=True)
    counts: Dict[str, dict] = {}
    for split, path in texts.items():
        result = tokenize_split(Path(path), bert, gpt2, bert_limit, gpt2_limit, skip_too_long)
        if not result["bert"]:
            raise OptimusDataError(f"{path}: no sentences left for the {split} split "
                                   f"({result['empty']} empty, {result['too_long']} too long)")
        for lang in (SOURCE_LANG, TARGET_LANG):
            (text_dir / f"{split}.{lang}").write_text("".join(line + "\n" for line in result[lang]), encoding="utf-8")
        counts[split] = {"sentences": len(result["bert"]), "dropped_empty": result["empty"],
                         "dropped_too_long": result["too_long"], "source": str(path),
                         "bert_pieces": sum(len(s.split()) for s in result["bert"]),
                         "gpt2_tokens": sum(len(s.split()) for s in result["gpt2"])}
    bert_size = write_dictionary(bert, out_dir / f"dict.{SOURCE_LANG}.txt")
    gpt2_size = write_gpt2_dictionary(gpt2, out_dir / f"dict.{TARGET_LANG}.txt")
    binarize(text_dir, out_dir, list(texts), workers)
    bert.save_pretrained(str(out_dir / "bert_tokenizer"))
    gpt2.save_pretrained(str(out_dir / "gpt2_tokenizer"))
    summary = {"bert_dir": str(bert_dir), "gpt2_dir": str(gpt2_dir), "splits": counts,
               "dict_bert_symbols": bert_size, "dict_gpt2_symbols": gpt2_size,
               "bert_limit_with_sep": bert_limit, "gpt2_limit_with_end": gpt2_limit}
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Raw sentences -> BERT WordPiece source + GPT-2 byte-level BPE target, binarised for "
                    "`fairseq-train --task optimus_lm` (optionally training the BPE first).",
    )
    parser.add_argument("--out-dir", type=Path, required=True)
    for split in SPLITS:
        parser.add_argument(f"--{split}", type=Path, required=split == "train", metavar="TXT",
                            help=f"{split} sentences, one per line (raw text)")
    parser.add_argument("--bert-dir", type=Path, required=True, help="local Hugging Face BERT-family directory")
    parser.add_argument("--gpt2-dir", type=Path,
                        help="local GPT-2 tokenizer directory (vocab.json + merges.txt, or tokenizer.json)")
    parser.add_argument("--train-bpe", type=Path, metavar="DIR",
                        help="instead of --gpt2-dir: train a byte-level BPE on --train, save it in DIR "
                             "(GPT-2's vocab.json/merges.txt) and use it")
    parser.add_argument("--bpe-vocab-size", type=int, default=8000, help="entries of the trained BPE (default 8000)")
    parser.add_argument("--gpt2-max-positions", type=int,
                        help="GPT-2 positions (default: n_positions of --gpt2-dir's config.json, else 1024)")
    parser.add_argument("--skip-too-long", action="store_true",
                        help="drop (and count) sentences over either model's positions instead of stopping")
    parser.add_argument("--workers", type=int, default=1, help="fairseq-preprocess workers")
    args = parser.parse_args(argv)
    if (args.gpt2_dir is None) == (args.train_bpe is None):
        parser.error("give exactly one of --gpt2-dir and --train-bpe")
    return args


def main(argv=None) -> int:
    """Command line (``prepare-optimus-data``): 0, or 2 after one ``prepare-optimus-data: error:`` line."""
    args = parse_args(argv)
    try:
        gpt2_dir = args.gpt2_dir
        if args.train_bpe is not None:
            gpt2_dir = train_gpt2_tokenizer([args.train], args.train_bpe, args.bpe_vocab_size)
        texts = {split: getattr(args, split) for split in SPLITS if getattr(args, split) is not None}
        summary = prepare(args.out_dir, texts, args.bert_dir, gpt2_dir, args.skip_too_long,
                          args.gpt2_max_positions, args.workers)
    except DataError as error:
        return command_error(PROG, error)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
