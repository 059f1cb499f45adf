"""Build a small real German-English sentence-pair corpus from the Ding dictionary.

Source: the Debian/Ubuntu package ``trans-de-en`` (``/usr/share/trans/de-en``), the
Ding dictionary of TU Chemnitz (Frank Richter), licensed GPL-2+.  Install it with
``apt-get install trans-de-en``.  The resulting corpus inherits that licence.

File format, one entry per line::

    German side :: English side

Both sides are split by `` | `` into sub-entries that are aligned (same count on
both sides); a sub-entry holds alternatives separated by ``;``; ``{...}``
(grammar), ``[...]`` (usage/domain) and ``<...>`` (search keywords) are
annotations; lines starting with ``#`` are comments.

A pair of aligned sub-entries is kept as a sentence pair when, after the
annotations ``{...}``, ``[...]`` and ``<...>`` are stripped and whitespace is
normalised:

* both sides end in ``.``, ``?`` or ``!`` and have at least 4 words;
* neither side contains ``;`` (a list of alternatives, not one sentence);
* neither side contains ``/`` (spaced or not: ``dir / euch`` and ``excuse/pardon``
  are alternatives), ``(`` or ``)`` (optional words).  Such pairs are **dropped**,
  not cleaned: choosing one alternative could make the two sides disagree;
* neither side contains the dictionary placeholders ``etw.``, ``jdm.``, ``jdn.``,
  ``jds.``, ``sth.``, ``sb.`` or an ellipsis (``…``/``...``): those are phrase
  templates such as ``to be followed by sth.``, not sentences.

Exact duplicate pairs are removed (first occurrence kept).  Nothing is dropped
silently: lines without exactly one `` :: `` (``malformed``) or with a different number of
sub-entries on the two sides (``misaligned``) are counted with the filter rejections and
printed.  A line that is not UTF-8 stops the run naming ``file:line``; errors end the
command line with one ``prepare-ding: error: ...`` line and exit status 2.  The pairs are
shuffled with ``--seed`` and split deterministically into test, valid and train
(in that order), written as ``OUT/{train,valid,test}.{de,en}``.

Usage::

    prepare-ding --out-dir data/ding_de_en [--max-words 15]

Python API::

    from pipelines.data.ding import build_corpus
    counts = build_corpus(out_dir="data/ding_de_en", max_words=15)
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from latent_core.errors import command_error, option_flag

PROG = "prepare-ding"
DEFAULT_SOURCE = Path("/usr/share/trans/de-en")
SPLITS = ("train", "valid", "test")
LANGS = ("de", "en")
MIN_WORDS = 4
VALID_SIZE, TEST_SIZE = 500, 1000  # the split's default sizes (pairs)

Pair = Tuple[str, str]

_ANNOTATION = re.compile(r"\{[^}]*\}|\[[^\]]*\]|<[^>]*>")
_SPACE_BEFORE_PUNCT = re.compile(r" ([.?!,;:])")
_PLACEHOLDER = re.compile(r"(?<!\w)(?:etw|jdm|jdn|jds|sth|sb)\.")
_SENTENCE_END = (".", "?", "!")

# rejection reasons, in the order the filters are applied (used in messages)
FILTERS = {
    "not_sentence": "both sides must end in '.', '?' or '!'",
    "semicolon": "no ';' (lists of alternatives)",
    "too_short": f"at least {MIN_WORDS} words per side",
    "slash": "no '/' alternatives",
    "parenthesis": "no '(' ... ')' optional words",
    "template": "no placeholders (etw./jdm./sth./sb.) or ellipses",
    "too_long": "at most --max-words words per side",
}
# lines that give no sub-entry pairs at all (counted, never dropped silently)
LINE_REJECTIONS = {
    "malformed": "lines without exactly one ' :: '",
    "misaligned": "lines with a different number of ' | ' sub-entries on the two sides",
}


class MissingSourceError(FileNotFoundError):
    """The Ding dictionary file is not installed."""


class DingDataError(ValueError):
    """The Ding file (or the options) cannot give a corpus; the message says where and what to do."""


class EmptyCorpusError(DingDataError):
    """No sentence pair survived the filters."""


def clean_text(text: str) -> str:
    """Strip ``{...}``, ``[...]``, ``<...>`` annotations and normalise whitespace."""
    text = _ANNOTATION.sub(" ", text)
    text = " ".join(text.split())
    return _SPACE_BEFORE_PUNCT.sub(r"\1", text)


def sentence_rejection(text: str, max_words: Optional[int] = None) -> Optional[str]:
    """The first filter (a key of :data:`FILTERS`) that rejects one cleaned side, or None."""
    if not text.endswith(_SENTENCE_END):
        return "not_sentence"
    if ";" in text:
        return "semicolon"
    words = len(text.split())
    if words < MIN_WORDS:
        return "too_short"
    if "/" in text:
        return "slash"
    if "(" in text or ")" in text:
        return "parenthesis"
    if _PLACEHOLDER.search(text) or "…" in text or "..." in text:
        return "template"
    if max_words is not None and words > max_words:
        return "too_long"
    return None


def rejection_reason(de: str, en: str, max_words: Optional[int] = None) -> Optional[str]:
    """The first filter (a key of :data:`FILTERS`) that rejects a cleaned pair, or None
    (filters in :data:`FILTERS` order, each applied to both sides)."""
    order = list(FILTERS)
    reasons = [r for r in (sentence_rejection(de, max_words), sentence_rejection(en, max_words)) if r]
    return min(reasons, key=order.index) if reasons else None


def english_paraphrase_groups(lines: Iterable[str], stats: Optional[Counter] = None) -> List[List[str]]:
    """Groups of English paraphrases: the ``;``-separated alternative translations of one
    German sub-entry ("Good to see you!; You're a sight for sore eyes!"), each alternative
    kept when it passes the sentence filters of :data:`FILTERS` (whole sentence, at least
    :data:`MIN_WORDS` words, no ``/`` alternatives, optional ``(...)`` words or sb./sth.
    placeholders). A group needs at least two distinct kept alternatives. These sub-entries
    never enter the translation corpus (the ``semicolon`` filter); an alternative may still
    occur there as a stand-alone entry elsewhere in the dictionary. ``stats`` counts ``groups`` and the rejected alternatives per filter.
    """
    stats = Counter() if stats is None else stats
    groups: List[List[str]] = []
    seen = set()
    for line in lines:
        for _, english in classify_line(line)[1]:
            alternatives = [" ".join(a.split()) for a in english.split(";")]
            if len(alternatives) < 2:
                continue
            kept = []
            for text in alternatives:
                reason = sentence_rejection(text)
                if reason is not None:
                    stats[f"alternative_{reason}"] += 1
                elif text not in kept:
                    kept.append(text)
            key = tuple(sorted(kept))
            if len(kept) >= 2 and key not in seen:
                seen.add(key)
                groups.append(kept)
    stats["groups"] = len(groups)
    return groups


def classify_line(line: str) -> Tuple[str, List[Pair]]:
    """(kind, cleaned (German, English) sub-entry pairs) of one dictionary line.

    ``kind`` is ``"blank"``, ``"comment"`` (``#...``), ``"malformed"`` (not exactly one
    `` :: ``) or ``"misaligned"`` (different numbers of `` | `` sub-entries), all without
    pairs, or ``"entry"``.
    """
    line = line.rstrip("\r\n")
    if not line.strip():
        return "blank", []
    if line.startswith("#"):
        return "comment", []
    sides = line.split(" :: ")
    if len(sides) != 2:
        return "malformed", []
    german, english = (side.split(" | ") for side in sides)
    if len(german) != len(english):
        return "misaligned", []
    return "entry", [(clean_text(de), clean_text(en)) for de, en in zip(german, english)]


def aligned_subentries(line: str) -> List[Pair]:
    """The cleaned (German, English) sub-entry pairs of one dictionary line.

    Comment lines, lines without exactly one `` :: `` and lines whose sides have a
    different number of `` | `` sub-entries give no pairs.
    """
    return classify_line(line)[1]


def parse_lines(lines: Iterable[str], max_words: Optional[int] = None,
                stats: Optional[Counter] = None) -> List[Pair]:
    """Sentence pairs from dictionary lines, filtered and deduplicated (order kept).

    ``stats`` counts every rejection: per filter (:data:`FILTERS`), ``duplicate``, and the
    lines without pairs of :data:`LINE_REJECTIONS`; ``kept`` is the number of pairs.
    """
    stats = Counter() if stats is None else stats
    seen = set()
    pairs: List[Pair] = []
    for line in lines:
        kind, subentries = classify_line(line)
        if kind in LINE_REJECTIONS:
            stats[kind] += 1
        for pair in subentries:
            reason = rejection_reason(*pair, max_words=max_words)
            if reason is not None:
                stats[reason] += 1
            elif pair in seen:
                stats["duplicate"] += 1
            else:
                seen.add(pair)
                pairs.append(pair)
    stats["kept"] = len(pairs)
    return pairs


def check_source(source: Path) -> Path:
    """Return ``source`` or raise :class:`MissingSourceError` saying how to install it."""
    source = Path(source)
    if not source.is_file():
        raise MissingSourceError(
            f"Ding dictionary not found at {source}. Install it with "
            f"'apt-get install trans-de-en' (Debian/Ubuntu) or pass --source PATH."
        )
    return source


def read_lines(path: Path) -> Iterator[str]:
    """The lines of ``path`` (split on ``\\n``), each decoded as strict UTF-8.

    A line that is not UTF-8 raises :class:`DingDataError` naming ``file:line``; no byte
    is replaced.
    """
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DingDataError(
                    f"{path}:{number}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at byte {error.start + 1} of "
                    f"the line); the Ding file is UTF-8: reinstall trans-de-en, or convert the file "
                    f"(iconv -t UTF-8) or fix that line"
                ) from None


def read_pairs(source: Path = DEFAULT_SOURCE, max_words: Optional[int] = None,
               stats: Optional[Counter] = None, lines: Optional[Iterable[str]] = None) -> List[Pair]:
    """All kept sentence pairs of the Ding file ``source`` (or of its ``lines``, when a caller
    has already read them with :func:`read_lines`).

    Raises :class:`MissingSourceError` if the file is absent, :class:`DingDataError`
    naming ``file:line`` at a line that is not UTF-8, and :class:`EmptyCorpusError`
    (naming the filter that removed the last pairs) if nothing is left.
    """
    stats = Counter() if stats is None else stats
    if lines is None:
        lines = read_lines(check_source(source))
    pairs = parse_lines(lines, max_words=max_words, stats=stats)
    if not pairs:
        raise EmptyCorpusError(_empty_message(source, stats, max_words))
    return pairs


def _empty_message(source: Path, stats: Counter, max_words: Optional[int]) -> str:
    rejected = {reason: stats[reason] for reason in FILTERS if stats[reason]}
    if not rejected:
        lines = "; ".join(f"{stats[kind]} {text}" for kind, text in LINE_REJECTIONS.items() if stats[kind])
        return (f"no aligned 'German :: English' sub-entries found in {source}"
                + (f" ({lines})" if lines else "") + "; is it a Ding dictionary file?")
    last = [reason for reason in FILTERS if stats[reason]][-1]
    rule = FILTERS[last] + (f" (--max-words {max_words})" if last == "too_long" else "")
    summary = ", ".join(f"{reason}={count}" for reason, count in rejected.items())
    return (f"no sentence pair left in {source}: the last filter to reject pairs was '{last}' "
            f"({rule}); rejected per filter: {summary}. Relax that option (e.g. a larger --max-words).")


def split_pairs(pairs: Sequence[Pair], valid_size: int = VALID_SIZE, test_size: int = TEST_SIZE,
                seed: int = 1) -> Dict[str, List[Pair]]:
    """Shuffle with ``seed`` and cut test, then valid, then train (deterministic)."""
    if valid_size < 0 or test_size < 0:
        raise DingDataError("--valid-size and --test-size must be >= 0")
    if valid_size + test_size >= len(pairs):
        raise DingDataError(
            f"only {len(pairs)} pairs for --valid-size {valid_size} + --test-size {test_size}; "
            f"at least one training pair is needed: lower the sizes or relax --max-words"
        )
    order = list(pairs)
    random.Random(seed).shuffle(order)
    return {
        "test": order[:test_size],
        "valid": order[test_size:test_size + valid_size],
        "train": order[test_size + valid_size:],
    }


def write_split(splits: Dict[str, List[Pair]], out_dir: Path) -> Dict[str, int]:
    """Write ``out_dir/{split}.{de,en}``, one sentence per line; return pair counts."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, pairs in splits.items():
        for index, lang in enumerate(LANGS):
            with open(out_dir / f"{split}.{lang}", "w", encoding="utf-8") as handle:
                handle.writelines(pair[index] + "\n" for pair in pairs)
    return {split: len(pairs) for split, pairs in splits.items()}


def build_corpus(out_dir: Path, source: Path = DEFAULT_SOURCE, max_words: Optional[int] = None,
                 valid_size: int = VALID_SIZE, test_size: int = TEST_SIZE, seed: int = 1,
                 report: bool = False) -> Dict[str, int]:
    """Read, filter, split and write the corpus; return ``{"train": n, "valid": n, "test": n}``. ``report``:
    print the two lines of ``prepare-ding`` (the split sizes and the rejections)."""
    stats: Counter = Counter()
    pairs = read_pairs(source, max_words=max_words, stats=stats)
    counts = write_split(split_pairs(pairs, valid_size, test_size, seed), out_dir)
    if report:
        print(f"[prepare_ding] pairs: {sum(counts.values())} (train {counts['train']}, valid {counts['valid']}, "
              f"test {counts['test']}) -> {out_dir}")
        print(f"[prepare_ding] rejected: {rejection_summary(stats)}")
    return counts


def prepare_fairseq_data(out_dir: Path, max_words: int, vocab_size: int, seed: int = 1, valid_size: int = VALID_SIZE,
                         test_size: int = TEST_SIZE, source: Optional[Path] = None,
                         stage: Callable[[str], None] = print) -> Path:
    """The SDMA demo's data under ``out_dir``: Ding pairs (``raw/``, as ``prepare-ding``), one joint sentencepiece
    model of ``vocab_size`` pieces and ``fairseq-preprocess`` (``prep/``, as ``prepare-translation --joint``).
    Reuses a finished earlier run whatever its sizes (put the sizes in ``out_dir``'s name); ``source`` None: the
    trans-de-en package's file. Returns ``prep/bin``."""
    from pipelines.data import translation

    raw, prep = Path(out_dir) / "raw", Path(out_dir) / "prep"
    bin_dir = prep / "bin"
    if (bin_dir / "train.de-en.de.bin").exists() and (raw / "test.en").exists():
        stage(f"data: reusing {bin_dir}")
        return bin_dir
    stage("data 1/2: German-English sentence pairs from the Ding dictionary (trans-de-en)")
    build_corpus(raw, source or DEFAULT_SOURCE, max_words, valid_size, test_size, seed, report=True)
    stage("data 2/2: joint sentencepiece vocabulary + fairseq-preprocess")
    translation.prepare(translation.options(
        train_prefix=str(raw / "train"), valid_prefix=str(raw / "valid"), test_prefix=str(raw / "test"),
        src="de", tgt="en", joint=True, vocab_size=vocab_size, out_dir=prep, workers=2))
    return bin_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE,
                        help="Ding dictionary file (package trans-de-en; default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, required=True,
                        help="output directory for {train,valid,test}.{de,en}")
    parser.add_argument("--max-words", type=int, default=None, metavar="N",
                        help="keep pairs with at most N words on both sides (default: no limit)")
    parser.add_argument("--valid-size", type=int, default=VALID_SIZE, help="validation pairs (default: %(default)s)")
    parser.add_argument("--test-size", type=int, default=TEST_SIZE, help="test pairs (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="shuffling seed of the split (default: %(default)s)")
    return parser


def rejection_summary(stats: Counter) -> str:
    """``reason=count`` for every rejection in ``stats`` (lines and sub-entry pairs), or ``none``."""
    reasons = list(LINE_REJECTIONS) + list(FILTERS) + ["duplicate"]
    return ", ".join(f"{reason}={stats[reason]}" for reason in reasons if stats[reason]) or "none"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line (``prepare-ding``); every error ends it with one ``prepare-ding: error: ...`` line
    on stderr and exit status 2 (argparse's convention). Returns 0 (the split sizes are printed; the Python API
    :func:`build_corpus` returns them)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_words is not None and args.max_words < MIN_WORDS:
        parser.error(f"--max-words must be >= {MIN_WORDS} (the minimum sentence length)")
    for option in ("valid_size", "test_size"):
        if getattr(args, option) < 1:
            parser.error(f"{option_flag(option)} must be >= 1: an empty split would reach "
                         f"fairseq-preprocess, which writes an empty (unusable) binary file")
    try:
        build_corpus(args.out_dir, args.source, args.max_words, args.valid_size, args.test_size, args.seed,
                     report=True)
    except (MissingSourceError, DingDataError) as error:
        raise SystemExit(command_error(PROG, error)) from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
