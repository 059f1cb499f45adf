"""Cross-validation folds of the Lee document-similarity ratings in the GLUE STS-B layout.

Data (fetched at run time from the ``gensim`` wheel on PyPI, never committed; gensim is
LGPL-2.1, the corpus is the one of Lee, Pincombe & Welsh 2005, "An empirical evaluation of
models of text document similarity", shipped by gensim for its tests):

* ``lee.cor``: 50 short news documents (Australian Broadcasting Corporation), one per line;
* ``similarities0-1.txt``: a 50 x 50 matrix whose upper triangle holds, for each of the
  1,225 document pairs, the mean of about ten human ratings on a 1-5 scale divided by 5.

This is document-pair similarity of news articles, not sentence-pair STS: documents are
~80 words (the STS task truncates each pair to ``--max-positions`` word pieces) and most
pairs are unrelated (median rating 1.4 of 5). Scores are written on the original 1-5 scale
(x 5), in the STS-B column layout, so ``--glue-task STS-B`` reads them.

Folds are over PAIRS (every document occurs in training pairs of every fold; there are
only 50 documents), seeded: fold k's test set is the k-th fifth of a random permutation;
``--dev-fraction`` of the remaining pairs is the dev set used for model selection.

    prepare-lee-sts --out-dir outputs/lee_sts [--folds 5] [--seed 1]

Bad data is named: a blank line between documents (it would shift the document numbering of
the ratings matrix; ``file:line``), a ratings file that is not a square matrix of numbers in
[0, 1] of the documents' size, a fold with an empty split. A line of ``lee.cor`` that is not
UTF-8 is decoded with U+FFFD for the bad bytes and named in a warning (``file:line``): gensim's
copy has one Latin-1 ``£`` on line 41, which earlier runs read the same way. Errors end the
command with one ``prepare-lee-sts: error: ...`` line and exit status 2.
"""

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

from latent_core.errors import command_error
from pipelines.data.registry import DataError, fetch_members

PROG = "prepare-lee-sts"
GENSIM = "gensim==4.4.0"
DOCUMENTS = "gensim/test/test_data/lee.cor"
RATINGS = "gensim/test/test_data/similarities0-1.txt"
STSB_HEADER = ["index", "genre", "filename", "year", "old_index", "source1", "source2",
               "sentence1", "sentence2", "score"]

Pair = Tuple[int, int, float]  # (document i, document j, score on 1-5)


def read_documents(path: Path, warn=None) -> List[str]:
    """One whitespace-normalised document per line (split on ``\\n``), in file order.

    A line that is not UTF-8 is decoded with U+FFFD for its bad bytes and reported through
    ``warn(message)`` (default: a ``prepare-lee-sts: warning: file:line: ...`` line on
    stderr). Trailing blank lines are ignored; a blank line before the last document raises
    DataError (``file:line``): document ``i`` is row ``i`` of the ratings matrix.
    """
    path = Path(path)
    if warn is None:
        def warn(message):
            print(f"{PROG}: warning: {message}", file=sys.stderr)
    docs = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            line = raw.decode("utf-8", errors="replace")
            warn(f"{path}:{number}: byte 0x{raw[error.start]:02x} at byte {error.start + 1} of the line is not "
                 f"UTF-8; read as U+FFFD (gensim's lee.cor has one Latin-1 byte, on line 41)")
        docs.append(" ".join(line.split()))
    while docs and not docs[-1]:
        docs.pop()
    if not docs:
        raise DataError(f"{path}: no documents (expected one document per line)")
    blank = [number for number, doc in enumerate(docs, 1) if not doc]
    if blank:
        raise DataError(f"{path}:{blank[0]}: blank line before the last document ({len(blank)} such line(s)); "
                        f"document i must be line i to match row i of the ratings matrix: remove the blank lines")
    return docs


def read_pairs(path: Path, num_documents: int) -> List[Pair]:
    """The upper triangle of the rating matrix as (i, j, 5 x rating) pairs, i < j.

    DataError (naming the file) unless it is a ``num_documents`` square matrix of numbers whose
    upper triangle lies in [0, 1].
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy's "empty input file": the shape check names it
            matrix = np.loadtxt(path, ndmin=2)
    except ValueError as error:  # UnicodeDecodeError is one too
        raise DataError(f"{path}: not a matrix of numbers ({error}); expected similarities0-1.txt: "
                        f"one whitespace-separated row of ratings in [0, 1] per document") from None
    if matrix.shape != (num_documents, num_documents):
        raise DataError(f"{path}: a {matrix.shape} matrix for {num_documents} documents")
    rows, cols = np.triu_indices(num_documents, 1)
    upper = matrix[rows, cols]
    bad = np.flatnonzero(~((upper >= 0.0) & (upper <= 1.0)))  # also NaN
    if bad.size:
        i, j = int(rows[bad[0]]), int(cols[bad[0]])
        raise DataError(f"{path}: {bad.size} rating(s) outside [0, 1], the first {float(matrix[i, j])!r} at "
                        f"row {i + 1}, column {j + 1}; the file holds mean ratings divided by 5")
    return [(int(i), int(j), round(5.0 * float(matrix[i, j]), 6)) for i, j in zip(rows, cols)]


def folds(pairs: Sequence[Pair], num_folds: int, dev_fraction: float, seed: int):
    """[(train, dev, test)] per fold, disjoint, covering all pairs; test sets partition the data."""
    if num_folds < 2:
        raise DataError(f"--folds={num_folds} must be >= 2")
    if not 0.0 < dev_fraction < 1.0:
        raise DataError(f"--dev-fraction={dev_fraction} must lie in (0, 1)")
    order = np.random.default_rng(seed).permutation(len(pairs))
    parts = np.array_split(order, num_folds)
    result = []
    for k, test_idx in enumerate(parts):
        rest = np.concatenate([p for m, p in enumerate(parts) if m != k])
        num_dev = max(1, int(round(dev_fraction * len(rest))))
        parts_k = ([pairs[i] for i in rest[num_dev:]], [pairs[i] for i in rest[:num_dev]],
                   [pairs[i] for i in test_idx])
        for name, part in zip(("train", "dev", "test"), parts_k):
            if not part:
                raise DataError(f"fold {k}: the {name} split would be empty ({len(pairs)} rated pairs for "
                                f"--folds={num_folds}, --dev-fraction={dev_fraction}); use fewer folds or more "
                                f"documents")
        result.append(parts_k)
    return result


def write_stsb(path: Path, pairs: Sequence[Pair], docs: Sequence[str]) -> None:
    """STS-B layout: 10 tab-separated columns, header, sentence1/2 in columns 8/9, score last."""
    lines = ["\t".join(STSB_HEADER)]
    for n, (i, j, score) in enumerate(pairs):
        lines.append("\t".join([str(n), "news", "lee.cor", "2005", f"{i}-{j}", str(i), str(j),
                                docs[i].replace("\t", " "), docs[j].replace("\t", " "), f"{score:g}"]))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def prepare(out_dir: Path, num_folds: int = 5, dev_fraction: float = 0.1, seed: int = 1,
            cache_dir: Path = None, documents: Path = None, ratings: Path = None) -> dict:
    cache_dir = cache_dir or out_dir / "raw"
    if documents is None or ratings is None:
        documents, ratings = fetch_members(GENSIM, [DOCUMENTS, RATINGS], cache_dir, binary=True,
                                           local_hint="--documents and --ratings")
    docs = read_documents(documents)
    pairs = read_pairs(ratings, len(docs))
    summary = {"documents": len(docs), "pairs": len(pairs), "folds": [], "seed": seed,
               "score_mean": float(np.mean([p[2] for p in pairs]))}
    for k, (train, dev, test) in enumerate(folds(pairs, num_folds, dev_fraction, seed)):
        fold_dir = out_dir / f"fold{k}"
        fold_dir.mkdir(parents=True, exist_ok=True)
        for name, part in (("train", train), ("dev", dev), ("test", test)):
            write_stsb(fold_dir / f"{name}.tsv", part, docs)
        summary["folds"].append({"train": len(train), "dev": len(dev), "test": len(test)})
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv=None) -> int:
    """Command line (``prepare-lee-sts``): 0, or 2 after one ``prepare-lee-sts: error: ...`` line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--dev-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--documents", type=Path, help="local lee.cor (skips the download)")
    parser.add_argument("--ratings", type=Path, help="local similarities0-1.txt (skips the download)")
    args = parser.parse_args(argv)
    try:
        summary = prepare(args.out_dir, args.folds, args.dev_fraction, args.seed,
                          documents=args.documents, ratings=args.ratings)
    except DataError as err:
        return command_error("prepare-lee-sts", err)
    print(f"{summary['documents']} documents, {summary['pairs']} rated pairs -> {len(summary['folds'])} folds "
          f"(train/dev/test {summary['folds'][0]['train']}/{summary['folds'][0]['dev']}/{summary['folds'][0]['test']}) "
          f"in {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
