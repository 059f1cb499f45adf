"""Prepare a parallel corpus for fairseq: (jieba) -> sentencepiece -> fairseq-preprocess.

Works from raw, line-aligned parallel text files the user already has; it never
downloads anything.  For every split ``{prefix}.{lang}`` must exist for both
languages with the same number of lines.

Pipeline (one ``[prepare] stage: ...`` line each)::

    check      the six raw files exist, are non-empty, UTF-8 (else file:line is named)
               and line-aligned per split
    normalise  whitespace; --lowercase; --jieba word segmentation of the zh side(s)
               -> OUT/text/{split}.{lang}; references -> OUT/spm/{valid,test}.{lang}.raw
    spm        train one joint (--joint) or one model per language on train text
               -> OUT/spm/spm.{joint|lang}.model
    encode     all splits to pieces -> OUT/spm/{split}.{lang}; train pairs that are
               empty or longer than --max-len pieces on either side are dropped
    length     every split against --max-positions (the model's limit, counted in
               pieces + the end-of-sentence token fairseq appends): refused, naming
               the count and the first file:line, unless --truncate or --skip
    binarise   fairseq-preprocess -> OUT/bin (with --joined-dictionary for --joint)

Two length limits, on purpose:  --max-len is data cleaning as in fairseq's recipes
(clean-corpus-n): train pairs that are empty or longer than it are dropped and counted,
valid/test are never touched.  --max-positions is the model's hard limit (fairseq's
--max-source-positions/--max-target-positions, 1024 for fairseq's transformer and every
sdma_transformer_* architecture): a longer sentence in any split cannot be trained on or
translated, so it is refused unless you choose --truncate (cut to max-positions - 1
pieces) or --skip (drop the pair from both sides and from the .raw references); how many
were cut or dropped is printed.  Nothing is dropped silently.

Every problem with the inputs ends the run before fairseq-preprocess with one line
``prepare-translation: error: ...`` (what, where, what to do) and exit status 2.

``OUT/spm/test.{lang}.raw`` is the detokenised reference for sacreBLEU: the raw
text with only whitespace normalisation and (with --lowercase) lowercasing, no
jieba segmentation.  Decode with ``fairseq-generate --remove-bpe sentencepiece``.

BERT source (BV-T / BSDMA-T, ``bert_fused_transformer``): ``--src-bert-dir DIR`` tokenises
the source with that local BERT's own tokenizer instead of sentencepiece and binarises it
with BERT's vocabulary as the fairseq source dictionary (``fairseq-preprocess --srcdict``,
written to ``OUT/spm/dict.bert.{src}.txt``); the target keeps its sentencepiece model
(``--tgt-vocab-size``). The source length limit is then also BERT's: at most
``max_position_embeddings - 1`` pieces with ``</s>`` (``[CLS]`` takes one position), under the
same refuse / --truncate / --skip rule (``pipelines.data.bert_source``).

Paper settings (SDMA, Table I):  IWSLT'14 De-En ``--src-vocab-size 6000
--tgt-vocab-size 8000``; WMT'14 En-De ``--joint --vocab-size 44000`` (train with
``--share-all-embeddings``); WMT'17 Zh-En ``--jieba --src-vocab-size 25000
--tgt-vocab-size 20000``.

Command ``prepare-translation`` (``python -m pipelines.data.translation`` is the same).

Python API::

    from pipelines.data.translation import parse_args, prepare
    bin_dir = prepare(parse_args(["--train-prefix", "raw/train", ..., "--out-dir", "data"]))
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from latent_core.errors import command_error
from pipelines.data import bert_source
from pipelines.data.preprocess import fairseq_preprocess

PROG = "prepare-translation"
SPLITS = ("train", "valid", "test")
REFERENCE_SPLITS = ("valid", "test")
# fairseq's DEFAULT_MAX_SOURCE_POSITIONS / DEFAULT_MAX_TARGET_POSITIONS; no architecture of
# the plugin (user_dir/sdma/model.py) or of the demo/recipes changes them.
MAX_POSITIONS = 1024
INPUT_SENTENCE_SIZE = 2_000_000
ENCODE_CHUNK = 10_000
JIEBA_PARALLEL_MIN_LINES = 20_000


class PrepareError(RuntimeError):
    """A problem with the inputs or a tool; the message says what to fix."""


# ----------------------------------------------------------------------------- helpers


def stage(message: str) -> None:
    """Print one progress line."""
    print(f"[prepare] stage: {message}", flush=True)


def is_chinese(lang: str) -> bool:
    """True for ``zh`` language codes (``zh``, ``zh_cn``, ``zh-Hans``...)."""
    return lang.lower().startswith("zh")


def character_coverage(langs: Iterable[str]) -> float:
    """sentencepiece character coverage: 0.9995 if any language is Chinese, else 1.0."""
    return 0.9995 if any(is_chinese(lang) for lang in langs) else 1.0


def normalise_whitespace(line: str) -> str:
    """Collapse all (Unicode) whitespace, including stray ``\\r``, to single spaces."""
    return " ".join(line.split())


def not_utf8_message(path: Path, number: int, raw: bytes, error: UnicodeDecodeError) -> str:
    """``file:line: ...`` for a line that is not UTF-8 (1-based line, 1-based byte in the line)."""
    return (f"{path}:{number}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at byte {error.start + 1} of "
            f"the line); convert the file to UTF-8 (e.g. iconv -f ISO-8859-1 -t UTF-8) or fix that line")


def read_lines(path: Path) -> Iterator[str]:
    """Lines of a UTF-8 file without their line ending (split on ``\\n`` only).

    Decoded line by line (strict), so a bad byte raises :class:`PrepareError` naming
    ``file:line``; nothing is replaced.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise PrepareError(not_utf8_message(path, number, raw, error)) from None
            yield line.rstrip("\n").rstrip("\r")


def count_lines(path: Path) -> int:
    """Number of lines of a UTF-8 text file."""
    return sum(1 for _ in read_lines(path))


def scan_lines(path: Path) -> Tuple[int, int]:
    """(lines, non-blank lines) of a UTF-8 text file; :class:`PrepareError` at a non-UTF-8 line."""
    lines = non_blank = 0
    for line in read_lines(path):
        lines += 1
        non_blank += bool(line.strip())
    return lines, non_blank


def raw_path(prefix: str, lang: str) -> Path:
    """``{prefix}.{lang}``."""
    return Path(f"{prefix}.{lang}")


def check_parallel(prefix: str, src: str, tgt: str, split: str) -> int:
    """Check ``prefix.src`` and ``prefix.tgt``: present, UTF-8, not empty, line-aligned; return the line count.

    Raises :class:`PrepareError` naming the file (and ``file:line`` for a non-UTF-8 line).
    """
    paths = [raw_path(prefix, src), raw_path(prefix, tgt)]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise PrepareError(f"{split}: missing input file(s) {', '.join(missing)} "
                           f"(expected {{prefix}}.{{lang}} for --{split}-prefix {prefix})")
    counts = []
    for path in paths:
        lines, non_blank = scan_lines(path)
        if lines == 0:
            raise PrepareError(f"{split}: {path} is empty (0 lines); every split needs sentence pairs: "
                               f"fill it or point --{split}-prefix at the right files")
        if non_blank == 0:
            raise PrepareError(f"{split}: {path} has {lines} line(s), all blank; every split needs sentence "
                               f"pairs: fill it or point --{split}-prefix at the right files")
        counts.append(lines)
    if counts[0] != counts[1]:
        raise PrepareError(
            f"{split}: {paths[0]} has {counts[0]} lines but {paths[1]} has {counts[1]}; the two sides of a "
            f"parallel corpus must be line-aligned (line i of one translates line i of the other): "
            f"find the missing or extra line(s) and fix one of the files"
        )
    return counts[0]


# ----------------------------------------------------------------------------- normalisation


def _quiet_jieba():
    import jieba

    jieba.setLogLevel(logging.WARNING)
    return jieba


def segment_zh(line: str) -> str:
    """Chinese word segmentation with jieba, words joined by single spaces."""
    jieba = _quiet_jieba()
    return " ".join(word for word in jieba.cut(line) if word.strip())


def _segment_batch(lines: List[str]) -> List[str]:
    return [segment_zh(line) for line in lines]


def _chunks(items: Iterable[str], size: int) -> Iterator[List[str]]:
    chunk: List[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def normalise_lines(lines: Iterable[str], lowercase: bool = False, jieba: bool = False,
                    workers: int = 1) -> Iterator[str]:
    """Whitespace-normalised (and optionally lowercased / jieba-segmented) lines, in order."""
    cleaned = (normalise_whitespace(line.lower() if lowercase else line) for line in lines)
    if not jieba:
        yield from cleaned
        return
    cleaned = list(cleaned)
    if workers <= 1 or len(cleaned) < JIEBA_PARALLEL_MIN_LINES:
        yield from _segment_batch(cleaned)
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for batch in pool.imap(_segment_batch, _chunks(cleaned, 2_000)):
            yield from batch


def write_lines(path: Path, lines: Iterable[str]) -> int:
    """Write lines (adding ``\\n``); return how many."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for line in lines:
            handle.write(line + "\n")
            count += 1
    return count


def normalise_file(in_path: Path, out_path: Path, lowercase: bool = False, jieba: bool = False,
                   workers: int = 1) -> int:
    """Normalise one raw file into ``out_path``; return the line count."""
    return write_lines(Path(out_path), normalise_lines(read_lines(Path(in_path)), lowercase, jieba, workers))


# ----------------------------------------------------------------------------- sentencepiece


@contextlib.contextmanager
def _stderr_to(handle) -> Iterator[None]:
    """Redirect file descriptor 2 (where sentencepiece's C++ trainer logs) to ``handle``.

    Works on the descriptor, so also when ``sys.stderr`` is replaced (pytest, notebooks),
    where sentencepiece's own ``logstream`` option fails.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        os.dup2(handle.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def train_spm(input_paths: Sequence[Path], model_prefix: Path, vocab_size: int, model_type: str = "bpe",
              coverage: float = 1.0, input_sentence_size: int = INPUT_SENTENCE_SIZE, workers: int = 1,
              hard_vocab_limit: bool = True) -> Path:
    """Train a sentencepiece model on ``input_paths``; return ``{model_prefix}.model``.

    The trainer's log goes to ``{model_prefix}.log``.  Default special ids are kept
    (unk=0, bos=1, eos=2); fairseq adds its own ``</s>`` when binarising.
    """
    import sentencepiece

    model_prefix = Path(model_prefix)
    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    log_path = model_prefix.with_name(model_prefix.name + ".log")
    options = dict(
        input=",".join(str(path) for path in input_paths),
        model_prefix=str(model_prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=coverage,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        num_threads=max(1, workers),
        hard_vocab_limit=hard_vocab_limit,
    )
    try:
        with open(log_path, "w", encoding="utf-8") as log, _stderr_to(log):
            sentencepiece.SentencePieceTrainer.train(**options)
    except RuntimeError as error:
        raise PrepareError(
            f"sentencepiece training of {model_prefix}.model failed: {error}. The vocabulary size must hold "
            f"every character kept by the character coverage and at most what the data supports; for a "
            f"small corpus adjust it or pass --soft-vocab-limit (log: {log_path})"
        ) from None
    return model_prefix.with_name(model_prefix.name + ".model")


def encode_lines(model_path: Path, lines: Iterable[str], workers: int = 1) -> Iterator[str]:
    """Encode lines to space-separated sentencepiece pieces."""
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
    for chunk in _chunks(lines, ENCODE_CHUNK):
        for pieces in processor.encode(chunk, out_type=str, num_threads=max(1, workers)):
            yield " ".join(pieces)


def encode_file(model_path: Path, in_path: Path, out_path: Path, workers: int = 1) -> int:
    """Encode a text file to pieces (one sentence per line); return the line count."""
    return write_lines(Path(out_path), encode_lines(model_path, read_lines(Path(in_path)), workers))


def filter_by_length(src_in: Path, tgt_in: Path, src_out: Path, tgt_out: Path,
                     max_len: int) -> Tuple[int, int]:
    """Keep pairs with 1..max_len tokens on both sides; return (kept, dropped).

    The pipeline applies the same rule to train in :func:`fit_split`.
    """
    kept = dropped = 0
    with open(src_out, "w", encoding="utf-8", newline="\n") as src_handle, \
            open(tgt_out, "w", encoding="utf-8", newline="\n") as tgt_handle:
        for src_line, tgt_line in zip(read_lines(src_in), read_lines(tgt_in)):
            lengths = (len(src_line.split()), len(tgt_line.split()))
            if min(lengths) < 1 or max(lengths) > max_len:
                dropped += 1
                continue
            src_handle.write(src_line + "\n")
            tgt_handle.write(tgt_line + "\n")
            kept += 1
    return kept, dropped


def fit_split(split: str, spm_dir: Path, langs: Sequence[str], raw_paths: Sequence[Path],
              max_positions: Union[int, Sequence[int]], policy: Optional[str] = None,
              max_len: Optional[int] = None) -> Dict[str, object]:
    """Write ``spm_dir/{split}.{lang}`` from the encoded ``spm_dir/{split}.{lang}.pieces`` (then removed).

    Pair by pair, line ``i`` of the pieces being line ``i`` of ``raw_paths`` (1-based):

    * ``max_len`` (train only): a pair that is empty or has more than ``max_len`` pieces on a
      side is dropped (counted in ``dropped``), the recipe's data cleaning;
    * a pair with a side of more than ``max_positions - 1`` pieces (fairseq appends ``</s>``;
      ``max_positions`` may be one value per side, e.g. a BERT source's smaller limit)
      is counted in ``too_long`` (``first``: raw file, line and length in tokens of the first)
      and, by ``policy``: kept as it is (None: the caller refuses the run), cut to
      ``max_positions - 1`` pieces (``"truncate"``) or dropped from both sides (``"skip"``;
      for valid/test also from the ``{split}.{lang}.raw`` references, which stay aligned).

    Returns ``{"passed": pairs after the max_len cleaning, "kept": pairs written,
    "dropped": ..., "too_long": ..., "first": (path, line, tokens) or None}``.
    """
    if policy not in (None, "truncate", "skip"):
        raise ValueError(f"policy must be None, 'truncate' or 'skip', not {policy!r}")
    spm_dir = Path(spm_dir)
    limits = [max_positions - 1] * len(langs) if isinstance(max_positions, int) else [m - 1 for m in max_positions]
    inputs = [spm_dir / f"{split}.{lang}.pieces" for lang in langs]
    stats: Dict[str, object] = {"passed": 0, "kept": 0, "dropped": 0, "too_long": 0, "first": None}
    skipped = set()
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(open(spm_dir / f"{split}.{lang}", "w", encoding="utf-8", newline="\n"))
                   for lang in langs]
        for number, sides in enumerate(zip(*(read_lines(path) for path in inputs)), 1):
            pieces = [side.split() for side in sides]
            lengths = [len(side) for side in pieces]
            if max_len is not None and (min(lengths) < 1 or max(lengths) > max_len):
                stats["dropped"] += 1
                continue
            stats["passed"] += 1
            over = [index for index, length in enumerate(lengths) if length > limits[index]]
            if over:
                stats["too_long"] += 1
                if stats["first"] is None:
                    stats["first"] = (Path(raw_paths[over[0]]), number, lengths[over[0]] + 1)
                if policy == "skip":
                    skipped.add(number)
                    continue
                if policy == "truncate":
                    sides = [" ".join(side[:limit]) for side, limit in zip(pieces, limits)]
            for handle, side in zip(handles, sides):
                handle.write(side + "\n")
            stats["kept"] += 1
    for path in inputs:
        path.unlink()
    if skipped and split in REFERENCE_SPLITS:
        for lang in langs:
            reference = spm_dir / f"{split}.{lang}.raw"
            if reference.exists():
                kept = [line for number, line in enumerate(read_lines(reference), 1) if number not in skipped]
                write_lines(reference, kept)
    return stats


def too_long_message(fitted: Dict[str, Dict[str, object]], max_positions: int,
                     bert_limit: Optional[int] = None) -> str:
    """The refusal for sentences over ``max_positions`` (count, first file:line, the two choices);
    ``bert_limit``: the source's own, smaller limit under ``--src-bert-dir``."""
    total = sum(stats["too_long"] for stats in fitted.values())
    per_split = ", ".join(f"{split} {stats['too_long']}" for split, stats in fitted.items())
    path, line, tokens = next(stats["first"] for stats in fitted.values() if stats["first"] is not None)
    return (f"{total} sentence pair(s) have a side longer than --max-positions {max_positions} tokens after "
            f"sentencepiece encoding, counting the end-of-sentence token fairseq appends ({per_split}); the first "
            f"is {path}:{line} with {tokens} tokens. fairseq cannot train on or translate them: pass --truncate "
            f"(cut them to {max_positions - 1} pieces) or --skip (drop those pairs from both sides), or raise "
            f"--max-positions together with the model's --max-source-positions/--max-target-positions"
            + (f" (the source side's limit is --src-bert-dir's BERT: {bert_limit} tokens with </s>, which "
               f"no option raises)" if bert_limit is not None else ""))


# ----------------------------------------------------------------------------- fairseq


def run_fairseq_preprocess(spm_dir: Path, bin_dir: Path, src: str, tgt: str, joint: bool = False,
                           workers: int = 1, srcdict: Optional[Path] = None) -> Path:
    """Binarise ``spm_dir/{train,valid,test}.{src,tgt}`` into ``bin_dir``; return ``bin_dir``.

    fairseq-preprocess runs in this process (:func:`pipelines.data.preprocess.fairseq_preprocess`); its own log is
    written to ``bin_dir/preprocess.log``, and a failure is a :class:`PrepareError` naming its cause.
    """
    spm_dir, bin_dir = Path(spm_dir), Path(bin_dir)
    argv = [
        "--source-lang", src, "--target-lang", tgt,
        "--trainpref", spm_dir / "train",
        "--validpref", spm_dir / "valid",
        "--testpref", spm_dir / "test",
        "--destdir", bin_dir,
        "--workers", max(1, workers),
    ]
    if joint:
        argv.append("--joined-dictionary")
    if srcdict is not None:
        argv += ["--srcdict", srcdict]
    fairseq_preprocess(argv, PrepareError)
    return bin_dir


# ----------------------------------------------------------------------------- pipeline


def check_destination(bin_dir: Path, langs: Sequence[str], overwrite: bool = False) -> None:
    """fairseq-preprocess refuses an existing dictionary: fail early, or clear ``bin_dir`` with ``overwrite``."""
    existing = [bin_dir / f"dict.{lang}.txt" for lang in langs if (bin_dir / f"dict.{lang}.txt").exists()]
    if not existing:
        return
    if not overwrite:
        raise PrepareError(f"{existing[0]} already exists (a previous run); pass --overwrite (OVERWRITE=1 for "
                           f"scripts/prepare_*.sh) to replace {bin_dir}, or choose another --out-dir")
    shutil.rmtree(bin_dir)


def vocab_plan(args: argparse.Namespace) -> Dict[str, Tuple[int, List[str]]]:
    """Model name -> (vocabulary size, languages it covers)."""
    if args.joint:
        return {"joint": (args.vocab_size, [args.src, args.tgt])}
    if getattr(args, "src_bert_dir", None):
        return {args.tgt: (args.tgt_vocab_size, [args.tgt])}
    return {args.src: (args.src_vocab_size, [args.src]), args.tgt: (args.tgt_vocab_size, [args.tgt])}


def prepare(args: argparse.Namespace) -> Path:
    """Run the whole pipeline for ``args`` (from :func:`parse_args`); return ``OUT/bin``."""
    out_dir = Path(args.out_dir)
    text_dir, spm_dir, bin_dir = out_dir / "text", out_dir / "spm", out_dir / "bin"
    langs = (args.src, args.tgt)
    prefixes = {"train": args.train_prefix, "valid": args.valid_prefix, "test": args.test_prefix}

    check_destination(bin_dir, langs, getattr(args, "overwrite", False))
    counts = {split: check_parallel(prefixes[split], args.src, args.tgt, split) for split in SPLITS}
    stage("check: " + ", ".join(f"{split} {count} pairs" for split, count in counts.items()))

    jieba_langs = [lang for lang in langs if args.jieba and is_chinese(lang)]
    stage(f"normalise (lowercase={args.lowercase}, jieba={','.join(jieba_langs) or 'none'}) -> {text_dir}")
    for split in SPLITS:
        for lang in langs:
            raw = raw_path(prefixes[split], lang)
            normalise_file(raw, text_dir / f"{split}.{lang}", args.lowercase, lang in jieba_langs, args.workers)
            if split in REFERENCE_SPLITS:
                normalise_file(raw, spm_dir / f"{split}.{lang}.raw", args.lowercase, False)

    models: Dict[str, Path] = {}
    for name, (size, model_langs) in vocab_plan(args).items():
        coverage = args.character_coverage or character_coverage(model_langs)
        stage(f"spm: train {args.model_type} model '{name}' (vocab {size}, coverage {coverage}) "
              f"-> {spm_dir}/spm.{name}.model")
        model = train_spm([text_dir / f"train.{lang}" for lang in model_langs], spm_dir / f"spm.{name}", size,
                          args.model_type, coverage, args.input_sentence_size, args.workers,
                          not args.soft_vocab_limit)
        for lang in model_langs:
            models[lang] = model

    bert_dir = getattr(args, "src_bert_dir", None)
    max_positions = getattr(args, "max_positions", MAX_POSITIONS)
    srcdict = bert_limit = None
    if bert_dir:
        try:
            tokenizer = bert_source.load_tokenizer(bert_dir)
            bert_limit = bert_source.max_source_pieces(bert_source.read_config(bert_dir))
            srcdict = spm_dir / f"dict.bert.{args.src}.txt"
            size = bert_source.write_dictionary(tokenizer, srcdict)
        except bert_source.BertSourceError as error:
            raise PrepareError(str(error)) from None
        stage(f"bert: {args.src} side with the tokenizer of {bert_dir} (dictionary of {size} symbols -> "
              f"{srcdict}; at most {bert_limit} pieces with </s>)")
        bert_limit = min(max_positions, bert_limit)
    side_limits = (bert_limit, max_positions) if bert_limit is not None else max_positions
    stage(f"encode: {', '.join(SPLITS)} -> {spm_dir}")
    for split in SPLITS:
        for lang in langs:
            pieces = spm_dir / f"{split}.{lang}.pieces"
            if bert_dir and lang == args.src:
                chunks = _chunks(read_lines(text_dir / f"{split}.{lang}"), ENCODE_CHUNK)
                write_lines(pieces, (line for chunk in chunks for line in bert_source.encode_pieces(tokenizer, chunk)))
            else:
                encode_file(models[lang], text_dir / f"{split}.{lang}", pieces, args.workers)
    policy = "truncate" if getattr(args, "truncate", False) else "skip" if getattr(args, "skip", False) else None
    fitted = {split: fit_split(split, spm_dir, langs, [raw_path(prefixes[split], lang) for lang in langs],
                               side_limits, policy, args.max_len if split == "train" else None)
              for split in SPLITS}
    train = fitted["train"]
    if train["passed"] == 0:
        raise PrepareError(f"no training pair has 1..{args.max_len} pieces on both sides; raise --max-len")
    stage(f"filter: kept {train['passed']} train pairs, dropped {train['dropped']} "
          f"(empty or > {args.max_len} pieces)")
    too_long = sum(stats["too_long"] for stats in fitted.values())
    if too_long and policy is None:
        raise PrepareError(too_long_message(fitted, max_positions, bert_limit))
    if too_long:
        done = "truncated to" if policy == "truncate" else "skipped (both sides) as longer than"
        source = f" (source: {bert_limit - 1})" if bert_limit is not None else ""
        stage(f"length: {too_long} pair(s) {done} {max_positions - 1}{source} pieces + </s> ("
              + ", ".join(f"{split} {stats['too_long']}" for split, stats in fitted.items()) + ")")
    else:
        stage(f"length: every sentence fits --max-positions {max_positions}"
              + (f" (source: {bert_limit}, BERT's)" if bert_limit is not None else ""))
    for split, stats in fitted.items():
        if stats["kept"] == 0:
            raise PrepareError(f"{split}: no pair left after --skip (all {stats['passed']} have a side longer "
                               f"than {max_positions - 1} pieces); use --truncate or raise --max-positions")

    stage(f"binarise: fairseq-preprocess{' --joined-dictionary' if args.joint else ''}"
          f"{' --srcdict ' + str(srcdict) if srcdict else ''} -> {bin_dir}")
    return run_fairseq_preprocess(spm_dir, bin_dir, args.src, args.tgt, args.joint, args.workers, srcdict)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    data = parser.add_argument_group("data")
    data.add_argument("--train-prefix", required=True, help="raw training files {prefix}.{src,tgt}")
    data.add_argument("--valid-prefix", required=True, help="raw validation files {prefix}.{src,tgt}")
    data.add_argument("--test-prefix", required=True, help="raw test files {prefix}.{src,tgt}")
    data.add_argument("--src", required=True, help="source language code (file suffix), e.g. de")
    data.add_argument("--tgt", required=True, help="target language code (file suffix), e.g. en")
    data.add_argument("--out-dir", required=True, type=Path, help="output directory (text/, spm/, bin/)")
    vocab = parser.add_argument_group("sentencepiece")
    vocab.add_argument("--joint", action="store_true",
                       help="one joint model for both languages (then train with --share-all-embeddings)")
    vocab.add_argument("--vocab-size", type=int, help="vocabulary size (joint, or both separate models)")
    vocab.add_argument("--src-vocab-size", type=int, help="source vocabulary size (separate models)")
    vocab.add_argument("--tgt-vocab-size", type=int, help="target vocabulary size (separate models)")
    vocab.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe",
                       help="sentencepiece model type (default: %(default)s)")
    vocab.add_argument("--character-coverage", type=float, default=None,
                       help="override the coverage (default: 1.0, or 0.9995 when a model covers zh)")
    vocab.add_argument("--input-sentence-size", type=int, default=INPUT_SENTENCE_SIZE,
                       help="sentences sampled for training the model (default: %(default)s)")
    vocab.add_argument("--soft-vocab-limit", action="store_true",
                       help="treat the vocabulary size as an upper bound (hard_vocab_limit=false; tiny corpora)")
    text = parser.add_argument_group("text")
    text.add_argument("--jieba", action="store_true", help="segment the zh side(s) into words with jieba first")
    text.add_argument("--lowercase", action="store_true", help="lowercase all text (and the references)")
    text.add_argument("--max-len", type=int, default=250,
                      help="data cleaning as in fairseq's recipes: drop (and count) train pairs that are empty or "
                           "have more pieces than this on either side; valid/test are kept whole "
                           "(default: %(default)s)")
    length = parser.add_argument_group(
        "model length limit",
        "unlike --max-len (cleaning of train only), --max-positions is the model's hard limit and applies "
        "to every split; a longer sentence is refused unless --truncate or --skip is given")
    length.add_argument("--max-positions", type=int, default=MAX_POSITIONS, metavar="N",
                        help="the model's --max-source-positions/--max-target-positions: at most N-1 pieces "
                             "per sentence, fairseq appends </s> (default: %(default)s, fairseq's and every "
                             "sdma_transformer_* architecture's)")
    too_long = length.add_mutually_exclusive_group()
    too_long.add_argument("--truncate", action="store_true",
                          help="cut longer sentences to N-1 pieces (the .raw references stay whole)")
    too_long.add_argument("--skip", action="store_true",
                          help="drop pairs with a longer side from both sides (and from the .raw references)")
    bert = parser.add_argument_group("BERT source (bert_fused_transformer: BV-T, BSDMA-T)")
    bert.add_argument("--src-bert-dir", metavar="DIR",
                      help="tokenise the source with this local Hugging Face BERT's tokenizer and binarise it "
                           "with BERT's vocabulary as the source dictionary (the target keeps sentencepiece, "
                           "--tgt-vocab-size); the source limit becomes BERT's positions minus [CLS]")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the binarised data of a previous run in OUT/bin")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="parallel workers for jieba, sentencepiece and fairseq (default: %(default)s)")
    return parser


def validate_args(args: argparse.Namespace, error: Callable[[str], None]) -> argparse.Namespace:
    """Check option combinations; call ``error(message)`` on a problem."""
    if args.src == args.tgt:
        error("--src and --tgt must differ")
    if args.src_bert_dir:
        if args.joint:
            error("--src-bert-dir: the source uses BERT's vocabulary, so no --joint sentencepiece model")
        if args.src_vocab_size is not None:
            error("--src-bert-dir: the source vocabulary is BERT's; drop --src-vocab-size")
        args.tgt_vocab_size = args.tgt_vocab_size or args.vocab_size
        if args.tgt_vocab_size is None:
            error("--src-bert-dir needs --tgt-vocab-size (or --vocab-size) for the target's sentencepiece model")
    elif args.joint:
        if args.vocab_size is None:
            error("--joint needs --vocab-size")
        if args.src_vocab_size is not None or args.tgt_vocab_size is not None:
            error("--joint uses one --vocab-size; drop --src-vocab-size/--tgt-vocab-size")
    else:
        args.src_vocab_size = args.src_vocab_size or args.vocab_size
        args.tgt_vocab_size = args.tgt_vocab_size or args.vocab_size
        if args.src_vocab_size is None or args.tgt_vocab_size is None:
            error("give --src-vocab-size and --tgt-vocab-size (or --vocab-size for both, or --joint --vocab-size)")
    sizes = [args.vocab_size, args.src_vocab_size, args.tgt_vocab_size]
    if any(size is not None and size < 8 for size in sizes):
        error("vocabulary sizes must be >= 8")
    if args.jieba and not any(is_chinese(lang) for lang in (args.src, args.tgt)):
        error("--jieba segments Chinese, but neither --src nor --tgt is zh")
    if args.max_len < 1 or args.workers < 1:
        error("--max-len and --workers must be >= 1")
    if getattr(args, "max_positions", MAX_POSITIONS) < 2:
        error("--max-positions must be >= 2 (one piece and fairseq's end-of-sentence token)")
    return args


def options(**values) -> argparse.Namespace:
    """:func:`prepare`'s options from Python: the flags' names as keywords (``train_prefix=``, ``vocab_size=``,
    ``joint=True``...), the command's defaults for the rest, and :func:`validate_args`' checks. An unknown or
    missing option, or a bad combination, raises :class:`PrepareError` naming the flag."""
    parser = build_parser()
    actions = {action.dest: action for action in parser._actions if action.dest != "help"}
    unknown = sorted(set(values) - set(actions))
    if unknown:
        raise PrepareError(f"unknown option(s) {', '.join(unknown)}; the options are {', '.join(sorted(actions))}")
    missing = [actions[dest].option_strings[0] for dest in actions if actions[dest].required and dest not in values]
    if missing:
        raise PrepareError(f"{', '.join(missing)} required")
    args = argparse.Namespace(**{dest: action.default for dest, action in actions.items()})
    for dest, value in values.items():
        setattr(args, dest, value)
    args.out_dir = Path(args.out_dir)

    def error(message: str) -> None:
        raise PrepareError(message)

    return validate_args(args, error)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate command-line style arguments (usable from Python)."""
    parser = build_parser()
    return validate_args(parser.parse_args(argv), parser.error)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command line (``prepare-translation``); a :class:`PrepareError` ends it with one ``prepare-translation: error: ...`` line on
    stderr and exit status 2 (as argparse does for usage errors)."""
    args = parse_args(argv)
    try:
        bin_dir = prepare(args)
    except PrepareError as error:
        raise SystemExit(command_error(PROG, error)) from None
    stage(f"done: {bin_dir}")


if __name__ == "__main__":
    raise SystemExit(main())
