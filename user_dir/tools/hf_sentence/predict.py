"""Predict a split with an ``hf_sentence_prediction`` checkpoint and write a GLUE submission file.

    glue-predict --path CKPT --data DIR [--split test] --out FILE.tsv
        [--batch-size 32] [--max-tokens N] [--hf-tokenizer-dir TOK] [--cpu]

The output has the header ``index<TAB>prediction`` and one line per example, in file order:
the index is the file's index column (GLUE test files) or the 0-based row number; the
prediction is the class label as written in the data (e.g. ``0``/``1``) or, for regression,
the score clipped to the task's label range. When the split has labels, the metrics
(accuracy/F1/MCC or Pearson/Spearman, x100) are printed as one JSON line on stdout.
"""

import argparse
import json
import sys

import numpy as np
import torch
from fairseq import checkpoint_utils, utils

from latent_core.errors import command_error
import user_dir  # noqa: F401  (registers the task, criterion and model)
from user_dir.hf_sentence.metrics import compute_metrics, metric_names
from user_dir.hf_sentence.task import HFSentencePredictionTask


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="checkpoint (e.g. checkpoint_best.pt)")
    parser.add_argument("--data", required=True, help="directory with the split's TSV file")
    parser.add_argument("--split", default="test", help="test (test.tsv), valid/dev (dev.tsv), train, or X (X.tsv)")
    parser.add_argument("--out", required=True, help="submission file to write (TSV)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--hf-tokenizer-dir", default=None,
                        help="tokenizer directory, if it moved since training (default: the checkpoint's)")
    parser.add_argument("--report-mcc", action="store_true", help="also print Matthews' correlation")
    parser.add_argument("--cpu", action="store_true", help="do not use a GPU")
    return parser.parse_args(argv)


def load(path: str, data: str, tokenizer_dir=None, cpu: bool = False):
    """(model in eval mode, task) of a checkpoint, reading data from ``data``."""
    overrides = {"data": data}
    if tokenizer_dir:
        overrides["hf_tokenizer_dir"] = tokenizer_dir
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    if not isinstance(task, HFSentencePredictionTask):
        raise ValueError(f"{path} was trained with --task {type(task).__name__}, not hf_sentence_prediction")
    device = torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")
    return models[0].to(device).eval(), task


def predict(model, task, split: str, batch_size: int = 32, max_tokens=None) -> np.ndarray:
    """Model outputs for every example of ``split`` in file order: class ids ``[N]`` (int64)
    or scores ``[N]`` (float64, unclipped)."""
    return predict_dataset(model, task, task.load_dataset(split), batch_size, max_tokens, split)


@torch.no_grad()
def predict_dataset(model, task, dataset, batch_size: int = 32, max_tokens=None, name: str = "the dataset") -> np.ndarray:
    """:func:`predict` for a dataset built by the caller (``HFSentenceDataset``), in its order."""
    iterator = task.get_batch_iterator(
        dataset=dataset, max_tokens=max_tokens, max_sentences=batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=False, required_batch_size_multiple=1, num_workers=0,
    ).next_epoch_itr(shuffle=False)
    device = next(model.parameters()).device
    out = np.full(len(dataset), np.nan)
    for sample in iterator:
        sample = utils.move_to_cuda(sample, device=device) if device.type == "cuda" else sample
        logits, _ = model(**sample["net_input"])
        values = logits.float().view(-1) if task.is_regression else logits.argmax(-1)
        out[sample["id"].cpu().numpy()] = values.cpu().numpy()
    if np.isnan(out).any():
        raise RuntimeError(f"{int(np.isnan(out).sum())} examples of {name} were not predicted")
    return out if task.is_regression else out.astype(np.int64)


def submission_values(task, predictions: np.ndarray):
    """Class labels as written in the data, or scores clipped to the label range."""
    if not task.is_regression:
        return [task.label_names[int(p)] for p in predictions]
    if task.label_range is not None:
        predictions = np.clip(predictions, *task.label_range)
    return [float(p) for p in predictions]


def write_submission(path: str, indices, values) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("index\tprediction\n")
        for index, value in zip(indices, values):
            f.write(f"{index}\t{value:.6f}\n" if isinstance(value, float) else f"{index}\t{value}\n")


def run(args) -> None:
    """Predict ``args.split``, write the submission file and print the metrics (if labelled)."""
    model, task = load(args.path, args.data, args.hf_tokenizer_dir, args.cpu)
    predictions = predict(model, task, args.split, args.batch_size, args.max_tokens)
    examples = task.examples[args.split]
    values = submission_values(task, predictions)
    write_submission(args.out, examples.indices, values)
    print(f"wrote {len(values)} predictions to {args.out}", file=sys.stderr)
    dataset = task.datasets[args.split]
    if dataset.targets is not None:
        names = metric_names(task.num_classes, task.report_mcc or args.report_mcc)
        scored = np.asarray(values, dtype=np.float64) if task.is_regression else predictions
        result = compute_metrics(names, scored, dataset.targets)
        print(json.dumps({"split": args.split, "examples": len(values),
                          **{k: round(v, 2) for k, v in result.items()}}))


def main(argv=None) -> int:
    """The ``glue-predict`` command: 0, or 2 after a one-line error for a bad option, data or checkpoint."""
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError) as error:  # bad option, data or checkpoint
        return command_error("glue-predict", error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
