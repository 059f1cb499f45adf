"""HANS evaluation (McCoy et al., 2019) of an ``hf_sentence_prediction`` NLI checkpoint.

    hans-eval --path CKPT --hans heuristics_evaluation_set.txt
        [--out hans.json] [--predictions hans_predictions.tsv] [--entailment-label entailment]
        [--batch-size 32] [--max-tokens N] [--hf-tokenizer-dir TOK] [--data DIR] [--cpu]

The checkpoint is a sentence-pair classifier trained on an NLI task (e.g. ``--glue-task MNLI``).
Every HANS pair is encoded exactly as the task encodes its own examples (the task's tokenizer,
``--max-positions`` and, with topic features, the checkpoint's topic vocabulary) and
classified; a prediction of ``--entailment-label`` counts as ``entailment``, every other class
(MNLI: neutral, contradiction) as ``non-entailment`` (the HUBERT paper, Section 4.6).

**HANS file** (``heuristics_evaluation_set.txt``): tab-separated, a header line naming the
columns ``gold_label sentence1_binary_parse sentence2_binary_parse sentence1_parse
sentence2_parse sentence1 sentence2 pairID heuristic subcase template`` (found by name; every
row has the header's column count); gold labels ``entailment`` / ``non-entailment``;
heuristics ``lexical_overlap``, ``subsequence``, ``constituent``.

**Report** (accuracies in %, as the paper's Table 3): the 6 cells heuristic x gold label, the
per-subcase accuracies, ``average`` (the mean of the cells' accuracies: the paper's "Acc.")
and ``overall`` (over all examples; equal to ``average`` when the cells are equally large, as
in HANS: 5,000 each). A table goes to stdout, the same as JSON to ``--out``;
``--predictions`` writes ``pairID<TAB>prediction<TAB>class`` (binary label, model class).

``--data`` only has to be an existing directory (the task wants one; no split is read from it);
it defaults to the HANS file's directory.
"""

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from latent_core.errors import command_error
from user_dir.hf_sentence.data import Examples, HFSentenceDataset, tsv_rows
from user_dir.tools.hf_sentence.predict import load, predict_dataset  # (also registers the task and models)

ENTAILMENT, NON_ENTAILMENT = "entailment", "non-entailment"
GOLD_LABELS = (ENTAILMENT, NON_ENTAILMENT)
HEURISTICS = ("lexical_overlap", "subsequence", "constituent")
HANS_COLUMNS = ("gold_label", "sentence1_binary_parse", "sentence2_binary_parse", "sentence1_parse",
                "sentence2_parse", "sentence1", "sentence2", "pairID", "heuristic", "subcase", "template")
NEEDED_COLUMNS = ("gold_label", "sentence1", "sentence2", "pairID", "heuristic", "subcase")


# ----------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class HansRecord:
    """One HANS pair: its fields and the physical line (1-based) it was read from."""

    gold_label: str
    sentence1: str
    sentence2: str
    pair_id: str
    heuristic: str
    subcase: str
    template: str
    line: int


def _header_columns(path: str, line: int, header: Sequence[str]) -> Dict[str, int]:
    """Column name -> index of a HANS header; ValueError when it is not one."""
    names = [h.strip() for h in header]
    if names[0] not in HANS_COLUMNS:
        raise ValueError(f"{path}:{line}: no header line: expected the HANS header "
                         f"{' '.join(HANS_COLUMNS)!r} (tab-separated), got {' | '.join(names[:4])!r}...")
    missing = [c for c in NEEDED_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{path}:{line}: the header lacks the column(s) {missing}; a HANS file has "
                         f"{list(HANS_COLUMNS)}")
    return {name: i for i, name in enumerate(names)}


def read_hans(path: str) -> List[HansRecord]:
    """The pairs of a HANS file, in file order.

    Raises ValueError naming ``file:line`` for a missing header, a row whose column count is
    not the header's, an unknown gold label or heuristic, and for a file without pairs.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"HANS file {path} not found (heuristics_evaluation_set.txt of "
                                f"https://github.com/tommccoy1/hans)")
    rows = tsv_rows(path)
    try:
        line, header = next(rows)
    except StopIteration:
        raise ValueError(f"{path}: empty file, no HANS pairs") from None
    col = _header_columns(path, line, header)
    records = []
    for line, row in rows:
        if len(row) != len(header):
            raise ValueError(f"{path}:{line}: {len(row)} tab-separated columns, expected {len(header)} "
                             f"(as the header: {' '.join(h.strip() for h in header)})")
        gold, heuristic = row[col["gold_label"]].strip(), row[col["heuristic"]].strip()
        if gold not in GOLD_LABELS:
            raise ValueError(f"{path}:{line}: gold label {gold!r} is not one of {list(GOLD_LABELS)}")
        if heuristic not in HEURISTICS:
            raise ValueError(f"{path}:{line}: heuristic {heuristic!r} is not one of {list(HEURISTICS)}")
        records.append(HansRecord(gold, row[col["sentence1"]], row[col["sentence2"]], row[col["pairID"]].strip(),
                                  heuristic, row[col["subcase"]].strip(),
                                  row[col["template"]].strip() if "template" in col else "", line))
    if not records:
        raise ValueError(f"{path}: no HANS pairs (only a header line)")
    return records


# ---------------------------------------------------------------------------- encoding
def hans_examples(path: str, records: Sequence[HansRecord]) -> Examples:
    """The pairs as the task's :class:`Examples` (premise = sentence 1; no labels: the model
    is never told HANS's two-way gold labels); indices are the pairIDs."""
    return Examples(path, [r.sentence1 for r in records], [r.sentence2 for r in records], None,
                    [r.line for r in records], [r.pair_id for r in records])


def check_task(task, entailment_label: str) -> int:
    """The class id of ``entailment_label``; ValueError when the checkpoint's task is not a
    sentence-pair classification or has no such class."""
    if task.is_regression or not task.is_pair:
        raise ValueError(f"the checkpoint's task ({task.cfg.glue_task}) is not a sentence-pair classification "
                         f"(is_pair={task.is_pair}, regression={task.is_regression}); HANS needs an NLI model, "
                         f"e.g. one trained with --glue-task MNLI")
    names = list(task.label_names)
    if entailment_label not in names:
        raise ValueError(f"--entailment-label {entailment_label!r} is not one of the model's classes {names}; "
                         f"name the class that means entailment")
    return names.index(entailment_label)


def hans_dataset(task, examples: Examples) -> HFSentenceDataset:
    """The examples encoded as the task encodes a split (``task.build_dataset``), unlabelled."""
    return task.build_dataset(examples)


def predict_classes(model, task, dataset: HFSentenceDataset, batch_size: int = 32,
                    max_tokens: Optional[int] = None) -> np.ndarray:
    """Class ids ``[N]`` (int64) of every example of ``dataset``, in dataset order."""
    return predict_dataset(model, task, dataset, batch_size, max_tokens, "the HANS pairs")


def binary_labels(class_ids: Sequence[int], entailment_id: int) -> List[str]:
    """Class ids -> ``entailment`` (the entailment class) / ``non-entailment`` (any other)."""
    return [ENTAILMENT if int(c) == entailment_id else NON_ENTAILMENT for c in class_ids]


# ----------------------------------------------------------------------------- scoring
def _stats(correct: int, total: int) -> dict:
    return {"correct": correct, "total": total, "accuracy": 100.0 * correct / total if total else None}


def score(records: Sequence[HansRecord], predicted: Sequence[str]) -> dict:
    """Accuracies (%) of binary predictions (one per record, ``entailment``/``non-entailment``).

    Returns ``{"cells": {heuristic: {gold_label: stats}}`` (all 3 x 2 cells, empty ones with
    total 0 and accuracy None), ``"subcases": {heuristic: {gold_label: {subcase: stats}}}``
    (subcases in file order), ``"average"`` (mean accuracy of the non-empty cells: the paper's
    Acc.), ``"overall": stats`` over all records}``; stats = ``{"correct", "total", "accuracy"}``.
    """
    if len(records) != len(predicted):
        raise ValueError(f"{len(predicted)} predictions for {len(records)} HANS pairs")
    bad = sorted({p for p in predicted if p not in GOLD_LABELS})
    if bad:
        raise ValueError(f"predictions {bad} are not HANS labels {list(GOLD_LABELS)}")
    cells = {h: {g: [0, 0] for g in GOLD_LABELS} for h in HEURISTICS}
    subcases: Dict[str, Dict[str, Dict[str, list]]] = {h: {g: {} for g in GOLD_LABELS} for h in HEURISTICS}
    for record, prediction in zip(records, predicted):
        hit = int(prediction == record.gold_label)
        for counts in (cells[record.heuristic][record.gold_label],
                       subcases[record.heuristic][record.gold_label].setdefault(record.subcase, [0, 0])):
            counts[0] += hit
            counts[1] += 1
    cell_stats = {h: {g: _stats(*cells[h][g]) for g in GOLD_LABELS} for h in HEURISTICS}
    accuracies = [s["accuracy"] for by_gold in cell_stats.values() for s in by_gold.values() if s["total"]]
    correct = sum(c[0] for by_gold in cells.values() for c in by_gold.values())
    return {
        "cells": cell_stats,
        "subcases": {h: {g: {name: _stats(*c) for name, c in subcases[h][g].items()} for g in GOLD_LABELS}
                     for h in HEURISTICS},
        "average": sum(accuracies) / len(accuracies) if accuracies else None,
        "nonempty_cells": len(accuracies),
        "overall": _stats(correct, len(records)),
    }


def _pct(stats: dict) -> str:
    return "    -" if stats["accuracy"] is None else f"{stats['accuracy']:6.2f} ({stats['total']})"


def format_report(result: dict) -> str:
    """The result of :func:`score` as a text table (cells, then subcases)."""
    lines = [f"{'HANS accuracy (%)':<20}{'entailment':>20}{'non-entailment':>20}"]
    for h in HEURISTICS:
        lines.append(f"{h:<20}" + "".join(f"{_pct(result['cells'][h][g]):>20}" for g in GOLD_LABELS))
    average, overall = result["average"], result["overall"]
    lines.append(f"average of the {result['nonempty_cells']} cells (paper's Acc.): "
                 + ("-" if average is None else f"{average:.2f}")
                 + f"; overall {overall['accuracy']:.2f} ({overall['correct']}/{overall['total']} pairs)")
    lines.append("per subcase:")
    for h in HEURISTICS:
        for g in GOLD_LABELS:
            for name, stats in result["subcases"][h][g].items():
                lines.append(f"  {h:<16} {g:<15} {name:<40} {_pct(stats)}")
    return "\n".join(lines)


def write_predictions(path: str, records: Sequence[HansRecord], predicted: Sequence[str],
                      classes: Sequence[str]) -> None:
    """``pairID<TAB>prediction<TAB>class`` with a header line, in file order."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("pairID\tprediction\tclass\n")
        for record, label, name in zip(records, predicted, classes):
            f.write(f"{record.pair_id}\t{label}\t{name}\n")


# -------------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="checkpoint of an NLI model (e.g. checkpoint_best.pt)")
    parser.add_argument("--hans", required=True, help="HANS file (heuristics_evaluation_set.txt)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--predictions", default=None, help="write pairID<TAB>prediction<TAB>class here (TSV)")
    parser.add_argument("--entailment-label", default=ENTAILMENT,
                        help="the model's class meaning entailment; all others count as non-entailment")
    parser.add_argument("--data", default=None,
                        help="an existing directory for the task (default: the HANS file's directory)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--hf-tokenizer-dir", default=None,
                        help="tokenizer directory, if it moved since training (default: the checkpoint's)")
    parser.add_argument("--cpu", action="store_true", help="do not use a GPU")
    return parser.parse_args(argv)


def run(args) -> dict:
    """The whole evaluation of parsed ``args``; returns the result (also printed and written)."""
    records = read_hans(args.hans)  # before the (slower) checkpoint
    data = args.data or os.path.dirname(os.path.abspath(args.hans))
    model, task = load(args.path, data, args.hf_tokenizer_dir, args.cpu)
    entailment_id = check_task(task, args.entailment_label)
    dataset = hans_dataset(task, hans_examples(args.hans, records))
    class_ids = predict_classes(model, task, dataset, args.batch_size, args.max_tokens)
    predicted = binary_labels(class_ids, entailment_id)
    result = {"checkpoint": args.path, "hans": args.hans, "entailment_label": args.entailment_label,
              "classes": list(task.label_names), **score(records, predicted)}
    print(format_report(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.predictions:
        write_predictions(args.predictions, records, predicted, [task.label_names[int(c)] for c in class_ids])
        print(f"wrote {len(records)} predictions to {args.predictions}", file=sys.stderr)
    return result


def main(argv=None) -> int:
    """The ``hans-eval`` command: 0, or 2 after a one-line error for a bad option, file or checkpoint."""
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError) as error:  # bad option, file or checkpoint
        return command_error("hans-eval", error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
