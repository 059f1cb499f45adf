"""How strongly should the SDMA regularisers weigh? Learning speed and cluster usage per scaling.

Command ``sdma-regulariser-scales``.

Trains the quickstart's model (Ding de-en, 2+2 layers, 256-d, 4 heads, the IWSLT'14 tiny
SDMA options and Table I weights) four times for the same number of updates on the same
batches: V-T, and SDMA-T with each ``--sdma-regulariser-scale``:

* ``sentence``: per-sentence regularisers summed over the batch (the authors' criterion, default);
* ``batch``: their batch mean added once (this plugin's default in its first versions);
* ``token``: the batch mean times the number of target tokens.

Reports the validation perplexity after every ``--validate-every`` updates and, for each
SDMA-T model, the cluster usage on the test split (perplexity of the average
responsibilities per head, in [1, n_c]; 1 = every token in one cluster), averaged per
attention type, plus the head the demo's Fig. 6 shows (last encoder layer, head 0).
Each model writes ``OUT_DIR/<model>/result.json`` when it finishes, so models can run in
separate processes (``--only``) and a finished model is not trained again; the table and
``OUT_DIR/results.json`` collect every finished model.

    sdma-regulariser-scales --updates 400 --validate-every 100
    sdma-regulariser-scales --report-only
"""

import argparse
import json
import re
import shutil
import statistics
from pathlib import Path
from typing import Dict, List

from pipelines.runs import USER_DIR, console_script, print_table, run_streaming, stage, write_json
from experiments.sdma.quickstart import MODEL_SIZE, OPTIMIZATION
from pipelines.data.ding import prepare_fairseq_data

SCALES = ("sentence", "batch", "token")
_VALID = re.compile(r"valid on 'valid' subset.*?\| ppl ([0-9.]+).*?\| num_updates (\d+)")


def runs() -> Dict[str, List[str]]:
    """Model name -> its architecture/criterion arguments."""
    out = {"V-T": ["--arch", "transformer", "--criterion", "label_smoothed_cross_entropy"]}
    for scale in SCALES:
        out[f"SDMA-T {scale}"] = ["--arch", "sdma_transformer_iwslt_de_en_tiny",
                                  "--criterion", "sdma_label_smoothed_cross_entropy",
                                  "--sdma-regulariser-scale", scale]
    return out


def validation_perplexities(log: str) -> Dict[int, float]:
    """``{num_updates: valid ppl}`` from a fairseq-train log."""
    return {int(updates): float(ppl) for ppl, updates in _VALID.findall(log)}


def train(data_bin: Path, save_dir: Path, model_args: List[str], updates: int, every: int, seed: int) -> Dict:
    shutil.rmtree(save_dir, ignore_errors=True)
    cmd = [
        console_script("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--task", "translation",
        *model_args, *MODEL_SIZE, *OPTIMIZATION, "--seed", seed, "--cpu", "--max-update", updates,
        "--validate-interval-updates", every, "--validate-interval", "100000", "--save-interval", "100000",
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "50",
        "--no-progress-bar",
    ]
    return run_streaming(cmd, save_dir / "train.log", echo_filter=r"\| valid \||done training")


def usage_summary(checkpoint: Path, data_bin: Path, max_sentences: int) -> Dict:
    """Cluster usage per attention type (mean over layers and heads) and of the Fig. 6 head."""
    from user_dir.tools.sdma.analysis import model_cluster_usage, num_clusters
    from user_dir.tools.sdma.redundancy import load_models

    models, _, task = load_models(checkpoint, str(data_bin))
    usage = model_cluster_usage(models[0], task, "test", max_sentences=max_sentences, device="cpu")
    summary = {kind: statistics.mean(v for layer in per_layer for v in layer) for kind, per_layer in usage.items()}
    summary["fig6_head"] = usage["encoder_self"][-1][0]
    return {"mean_per_type": summary, "per_head": usage, "num_clusters": num_clusters(models[0])}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=400)
    p.add_argument("--validate-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--usage-sentences", type=int, default=1000, help="test sentences for the cluster usage")
    p.add_argument("--only", nargs="+", choices=sorted(runs()), help="train only these models")
    p.add_argument("--report-only", action="store_true", help="train nothing; print the finished models")
    p.add_argument("--out-dir", type=Path, default=Path("outputs") / "regulariser_scales")
    p.add_argument("--data-dir", type=Path, default=Path("outputs") / "quickstart" / "data")
    args = p.parse_args(argv)
    if args.updates < 1 or args.validate_every < 1 or args.validate_every > args.updates:
        p.error("need 1 <= --validate-every <= --updates")
    return args


def run_dir(out_dir: Path, name: str) -> Path:
    return out_dir / name.replace(" ", "_")


def finished_runs(out_dir: Path) -> Dict[str, Dict]:
    """Every model with a ``result.json``, in the order of :func:`runs`."""
    out = {}
    for name in runs():
        path = run_dir(out_dir, name) / "result.json"
        if path.exists():
            entry = json.loads(path.read_text())
            entry["valid_ppl"] = {int(u): v for u, v in entry["valid_ppl"].items()}
            out[name] = entry
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.report_only:
        data_bin = prepare_fairseq_data(args.data_dir, max_words=10, vocab_size=2000, seed=args.seed, stage=stage)
        done = finished_runs(args.out_dir)
        for name, model_args in runs().items():
            if (args.only and name not in args.only) or name in done:
                continue
            save_dir = run_dir(args.out_dir, name)
            stage(f"train {name} for {args.updates} updates")
            log = train(data_bin, save_dir, model_args, args.updates, args.validate_every, args.seed)["log"]
            entry = {"updates": args.updates, "seed": args.seed, "valid_ppl": validation_perplexities(log)}
            if name != "V-T":
                stage(f"cluster usage of {name} on the test split")
                entry["cluster_usage"] = usage_summary(save_dir / "checkpoint_last.pt", data_bin,
                                                       args.usage_sentences)
            write_json(save_dir / "result.json", entry)
    results = finished_runs(args.out_dir)
    if not results:
        stage(f"no finished model under {args.out_dir}")
        return 1
    write_json(args.out_dir / "results.json", {"runs": results})
    checkpoints = sorted({u for r in results.values() for u in r["valid_ppl"]})
    rows = []
    for name, entry in results.items():
        row = {"model": name, **{f"ppl@{u}": entry["valid_ppl"].get(u, float("nan")) for u in checkpoints}}
        for kind, value in entry.get("cluster_usage", {}).get("mean_per_type", {}).items():
            row[f"usage {kind}"] = value
        rows.append(row)
    columns = list(dict.fromkeys(c for row in rows for c in row))
    print_table([{c: row.get(c, "") for c in columns} for row in rows], columns,
                "SDMA regulariser scale: valid ppl after N updates (Ding de-en); cluster usage = "
                "perplexity of the mean responsibilities per head, in [1, n_c]")
    stage(f"wrote {args.out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
