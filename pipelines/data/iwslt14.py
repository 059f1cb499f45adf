"""Plain parallel text from the IWSLT'14 De-En release (and from WMT ``.sgm`` files).

``iwslt14 RAW OUT`` reproduces the split of fairseq's
``examples/translation/prepare-iwslt14.sh`` from the ``de-en`` folder of the
IWSLT 2014 release (``RAW`` is that folder or its parent):

* train: ``train.tags.de-en.{de,en}``; lines holding ``<url>``, ``<talkid>`` or
  ``<keywords>`` are dropped, ``<title>``/``<description>`` tags are removed but
  their text kept (as fairseq does); any other line starting with ``<`` (e.g.
  ``<speaker>``, ``<reviewer>``, ``<translator>``) is dropped as well.  Pairs are
  filtered jointly, so both sides stay aligned.  fairseq then runs Moses'
  ``clean-corpus-n.perl`` (1..175 tokens, length ratio <= 1.5) on the Moses-
  tokenised text; this is approximated here with a punctuation-splitting token
  count, so the train/valid split matches fairseq's closely but not line-exactly;
* valid: every 23rd line of the cleaned training text, train: the others;
* test: the ``<seg>`` contents of ``IWSLT14.TED.dev2010``, ``IWSLT14.TEDX.dev2012``,
  ``IWSLT14.TED.tst2010``, ``tst2011``, ``tst2012`` (in fairseq's order, 6750 lines),
  with ``’`` replaced by ``'`` as fairseq does.

No tokenisation or lowercasing happens here (``prepare-translation``, ``pipelines.data.translation``, does
sentencepiece and, with ``--lowercase``, lowercasing).  Writes
``OUT/{train,valid,test}.{de,en}``.

``sgm IN OUT`` writes the ``<seg>`` contents of one SGML/XML file (e.g. WMT's
``newstest2017-zhen-ref.en.sgm``), one per line.

Command ``extract-iwslt14`` (``python -m pipelines.data.iwslt14`` is the same).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from latent_core.errors import command_error

LANGS = ("de", "en")
TEST_SETS = ("IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
             "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012")
DROP_MARKERS = ("<url>", "<talkid>", "<keywords>")
KEEP_TEXT_TAGS = re.compile(r"</?(?:title|description)>")
SEGMENT = re.compile(r"<seg[^>]*>\s*(.*?)\s*</seg>")
TOKEN = re.compile(r"\w+|[^\w\s]")
VALID_EVERY = 23
MAX_TOKENS = 175
MAX_RATIO = 1.5

Pair = Tuple[str, str]


class ExtractError(RuntimeError):
    """Missing or inconsistent IWSLT/WMT input files."""


def read_lines(path: Path) -> List[str]:
    """Lines of a UTF-8 file, without line endings (split on ``\\n`` only)."""
    with open(path, encoding="utf-8", newline="\n") as handle:
        return [line.rstrip("\n").rstrip("\r") for line in handle]


def train_tags_line(line: str) -> Optional[str]:
    """The text of one ``train.tags`` line, or None for a metadata line."""
    if any(marker in line for marker in DROP_MARKERS):
        return None
    text = KEEP_TEXT_TAGS.sub("", line).strip()
    if text.startswith("<"):
        return None
    return text


def extract_segments(path: Path, fix_apostrophes: bool = False) -> List[str]:
    """The ``<seg ...>text</seg>`` contents of an IWSLT ``.xml`` or WMT ``.sgm`` file."""
    segments = []
    for line in read_lines(path):
        match = SEGMENT.search(line)
        if match:
            text = match.group(1)  # entities are kept, as sacreBLEU does for its references
            segments.append(text.replace("’", "'") if fix_apostrophes else text)
    if not segments:
        raise ExtractError(f"no <seg ...>...</seg> lines in {path}")
    return segments


def token_count(text: str) -> int:
    """Approximate Moses token count (words and punctuation marks)."""
    return len(TOKEN.findall(text))


def keep_clean(de: str, en: str) -> bool:
    """clean-corpus-n.perl's rule: 1..175 tokens per side and length ratio <= 1.5."""
    lengths = (token_count(de), token_count(en))
    if min(lengths) < 1 or max(lengths) > MAX_TOKENS:
        return False
    return max(lengths) / min(lengths) <= MAX_RATIO


def find_release_dir(raw: Path) -> Path:
    """``raw`` itself or ``raw/de-en``, whichever holds ``train.tags.de-en.de``."""
    for candidate in (raw, raw / "de-en"):
        if (candidate / "train.tags.de-en.de").is_file():
            return candidate
    raise ExtractError(
        f"train.tags.de-en.de not found in {raw} or {raw / 'de-en'}; pass the 'de-en' folder of the "
        f"IWSLT 2014 release (de-en.tgz from the IWSLT 2014 evaluation campaign, extracted)"
    )


def required_files(release: Path) -> List[Path]:
    """Every file the IWSLT'14 extraction reads."""
    files = [release / f"train.tags.de-en.{lang}" for lang in LANGS]
    files += [release / f"{name}.de-en.{lang}.xml" for name in TEST_SETS for lang in LANGS]
    return files


def train_pairs(release: Path) -> List[Pair]:
    """Aligned, cleaned (de, en) training pairs from ``train.tags``."""
    de_lines, en_lines = (read_lines(release / f"train.tags.de-en.{lang}") for lang in LANGS)
    if len(de_lines) != len(en_lines):
        raise ExtractError(f"train.tags.de-en.de has {len(de_lines)} lines but train.tags.de-en.en has "
                           f"{len(en_lines)} in {release}; the release files must be line-aligned")
    pairs = []
    for de_line, en_line in zip(de_lines, en_lines):
        de, en = train_tags_line(de_line), train_tags_line(en_line)
        if de is not None and en is not None and keep_clean(de, en):
            pairs.append((de, en))
    return pairs


def test_pairs(release: Path) -> List[Pair]:
    """The concatenated IWSLT'14 test sets (fairseq's order)."""
    pairs: List[Pair] = []
    for name in TEST_SETS:
        de, en = (extract_segments(release / f"{name}.de-en.{lang}.xml", fix_apostrophes=True) for lang in LANGS)
        if len(de) != len(en):
            raise ExtractError(f"{name}: {len(de)} German but {len(en)} English segments in {release}")
        pairs.extend(zip(de, en))
    return pairs


def iwslt14_split(release: Path) -> Dict[str, List[Pair]]:
    """``{"train": ..., "valid": ..., "test": ...}`` as in fairseq's prepare-iwslt14.sh."""
    missing = [str(path) for path in required_files(release) if not path.is_file()]
    if missing:
        raise ExtractError("missing IWSLT'14 file(s): " + ", ".join(missing))
    cleaned = train_pairs(release)
    valid = [pair for index, pair in enumerate(cleaned, 1) if index % VALID_EVERY == 0]
    train = [pair for index, pair in enumerate(cleaned, 1) if index % VALID_EVERY != 0]
    return {"train": train, "valid": valid, "test": test_pairs(release)}


def write_pairs(splits: Dict[str, List[Pair]], out_dir: Path, langs: Sequence[str] = LANGS) -> Dict[str, int]:
    """Write ``out_dir/{split}.{lang}``; return pair counts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, pairs in splits.items():
        for index, lang in enumerate(langs):
            with open(out_dir / f"{split}.{lang}", "w", encoding="utf-8", newline="\n") as handle:
                handle.writelines(pair[index] + "\n" for pair in pairs)
    return {split: len(pairs) for split, pairs in splits.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    iwslt = commands.add_parser("iwslt14", help="IWSLT'14 de-en release -> OUT/{train,valid,test}.{de,en}")
    iwslt.add_argument("raw", type=Path, help="the release's 'de-en' folder (or its parent)")
    iwslt.add_argument("out", type=Path, help="output directory")
    sgm = commands.add_parser("sgm", help="<seg> contents of one .sgm/.xml file -> plain text")
    sgm.add_argument("input", type=Path, help="SGML/XML file with <seg> lines")
    sgm.add_argument("output", type=Path, help="plain text output, one segment per line")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command line (``extract-iwslt14``); an :class:`ExtractError` ends it with ``error: ...`` and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "iwslt14":
            counts = write_pairs(iwslt14_split(find_release_dir(args.raw)), args.out)
            print("[extract] iwslt14: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f" -> {args.out}")
        else:
            if not args.input.is_file():
                raise ExtractError(f"{args.input} not found")
            segments = extract_segments(args.input)
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text("".join(segment + "\n" for segment in segments), encoding="utf-8")
            print(f"[extract] sgm: {len(segments)} segments {args.input} -> {args.output}")
    except (ExtractError, UnicodeDecodeError) as error:
        raise SystemExit(command_error("extract-iwslt14", error)) from None


if __name__ == "__main__":
    raise SystemExit(main())
