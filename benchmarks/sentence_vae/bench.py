"""Benchmark the sentence VAEs against plain fairseq models of the same size, in one run.

Training words/s (fairseq's ``wps``, mean over the logged intervals after the first) of

* QKVAE and ADVAE (``qkvae_small`` / ``advae_small``: 2 + 2 layers, d 256, 4 heads, FFN 1024)
  vs fairseq's ``transformer`` encoder-decoder of the same geometry trained as an
  auto-encoder (``translation`` task over a src = tgt view of the same binarized files,
  same batches) with ``cross_entropy``;
* Optimus (``optimus_small``: BERT 4 x 256 + GPT-2 4 x 256) vs fairseq's ``transformer``
  encoder-decoder of the same geometry (4 + 4 layers, d 256, 4 heads, FFN 1024), auto-encoding
  the same sentences (a ``transformer_lm`` baseline is not runnable here: fairseq-fixed's
  ``language_modeling`` task uses ``np.compat``, removed in numpy 2);

each trained ``--updates`` updates with identical optimiser settings, interleaved over
``--repeats`` rounds (medians), plus the IW-PPL evaluation time per sentence of every VAE
with k = ``--k`` samples (``vae-eval``, batched: one decoder pass per chunk of
samples). Prints a table and writes ``outputs/bench/vae.json`` (``*_wps_ratio`` and
``iw_seconds_per_sentence``). Target of the issue: wps ratio >= 0.8.

    vae-bench --data outputs/english_vae/bin
"""

import argparse
import json
import shutil
import statistics
from pathlib import Path

from pipelines.runs import (
    USER_DIR,
    console_script,
    model_parameters,
    print_table,
    run_streaming,
    stage,
    train_words_per_second,
    write_json,
)

GEOMETRY = ["--encoder-embed-dim", "256", "--decoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024",
            "--decoder-ffn-embed-dim", "1024", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
VAE_CRITERION = ["--criterion", "sentence_vae", "--kl-variant", "free_bits", "--kl-threshold", "0.05"]
MODELS = {
    # name: (task, arguments, baseline name or None)
    "transformer": ("translation", ["--arch", "transformer", "-s", "src", "-t", "tgt", *GEOMETRY, "--encoder-layers", "2",
                                     "--decoder-layers", "2", "--share-decoder-input-output-embed",
                                     "--criterion", "cross_entropy"], None),
    "qkvae": ("sentence_vae", ["--arch", "qkvae_small", *VAE_CRITERION,
                               "--beta-schedule", "z_sem=constant:0.6,z_syn=constant:0.3"], "transformer"),
    "advae": ("sentence_vae", ["--arch", "advae_small", *VAE_CRITERION, "--beta-schedule", "constant:0.6"],
              "transformer"),
    # fairseq-fixed's language_modeling task fails with numpy 2 (TokenBlockDataset uses the
    # removed np.compat), so Optimus' baseline is the encoder-decoder of its size instead.
    "transformer_4x4": ("translation", ["--arch", "transformer", "-s", "src", "-t", "tgt", *GEOMETRY,
                                        "--encoder-layers", "4", "--decoder-layers", "4",
                                        "--share-decoder-input-output-embed", "--criterion", "cross_entropy"], None),
    "optimus": ("sentence_vae", ["--arch", "optimus_small", *VAE_CRITERION, "--beta-schedule", "constant:1.0"],
                "transformer_4x4"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("outputs") / "english_vae" / "bin",
                   help="fairseq-preprocess --only-source directory (prepare-english-vae-data)")
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--k", type=int, default=100, help="importance samples for the IW-PPL timing")
    p.add_argument("--eval-sentences", type=int, default=100, help="test sentences timed for IW-PPL")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--gpu", action="store_true", help="train and evaluate on the GPU (fairseq without --cpu)")
    p.add_argument("--fp16", action="store_true", help="train with fairseq's --fp16 (needs --gpu)")
    p.add_argument("--out", type=Path, default=Path("outputs") / "bench" / "vae.json")
    args = p.parse_args(argv)
    if args.fp16 and not args.gpu:
        p.error("--fp16 needs --gpu")
    if args.updates < 20:
        p.error("--updates must be >= 20 (the first logged interval is warm-up)")
    if not (args.data / "dict.txt").is_file():
        p.error(f"--data {args.data}: no dict.txt; run prepare-english-vae-data first")
    return args


def pair_view(data: Path, work: Path) -> Path:
    """The monolingual split files seen as a src = tgt translation corpus (symbolic links)."""
    view = work / "pair_data"
    view.mkdir(parents=True, exist_ok=True)
    for side in ("src", "tgt"):
        link = view / f"dict.{side}.txt"
        if not link.exists():
            link.symlink_to((data / "dict.txt").resolve())
        for split in ("train", "valid", "test"):
            for ext in ("bin", "idx"):
                link = view / f"{split}.src-tgt.{side}.{ext}"
                if not link.exists() and (data / f"{split}.{ext}").exists():
                    link.symlink_to((data / f"{split}.{ext}").resolve())
    return view


def device_flags(args) -> list:
    if not args.gpu:
        return ["--cpu"]
    return ["--fp16"] if args.fp16 else []


def device_name(args) -> str:
    if not args.gpu:
        return "CPU"
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "GPU"


def train(args, name: str, save_dir: Path) -> dict:
    task, model_args, _ = MODELS[name]
    data = pair_view(args.data, save_dir.parent) if task == "translation" else args.data
    shutil.rmtree(save_dir, ignore_errors=True)
    stage(f"train {name} for {args.updates} updates")
    batching = ["--batch-size", str(args.batch_size)]
    run = run_streaming([
        console_script("fairseq-train"), data, "--user-dir", USER_DIR, "--task", task, *model_args,
        *batching, "--optimizer", "adam", "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "50", "--max-update", args.updates, "--seed", "1", *device_flags(args),
        "--log-interval", "10", "--log-format", "simple", "--no-progress-bar", "--disable-validation",
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--num-workers", "0",
        "--required-batch-size-multiple", "1",
    ], save_dir / "train.log", echo_filter=r"num\. (shared )?model params")
    return {"train_wps": train_words_per_second(run["log"]), "params": model_parameters(run["log"])}


def iw_seconds_per_sentence(args, save_dir: Path) -> float:
    """Seconds per sentence of ``vae-eval`` with k samples on the first test sentences (its output in
    ``eval.log`` of ``save_dir``)."""
    out = save_dir / "eval.json"
    run_streaming([console_script("vae-eval"), "--path", save_dir / "checkpoint_last.pt", args.data,
                   "--subset", "test", "--k", args.k, *([] if args.gpu else ["--cpu"]), "--json", out,
                   "--max-sentences", args.eval_sentences], save_dir / "eval.log", echo=False)
    return json.loads(out.read_text())["iw_seconds_per_sentence"]


def main(argv=None):
    args = parse_args(argv)
    work = args.out.parent / "vae"
    runs = {name: [] for name in args.models}
    for round_index in range(args.repeats):
        for name in args.models:
            runs[name].append(train(args, name, work / name))
            stage(f"round {round_index + 1}/{args.repeats} {name}: {runs[name][-1]['train_wps']:.0f} words/s")
    raw = {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
           for name, results in runs.items()}
    payload, rows = {"updates": args.updates, "batch_size": args.batch_size, "k": args.k, "raw": raw,
                     "runs": runs, "device": device_name(args), "fp16": args.fp16}, []
    for name in args.models:
        baseline = MODELS[name][2]
        row = {"model": name, "params": raw[name]["params"], "train words/s": raw[name]["train_wps"]}
        if baseline in raw:
            row["wps ratio"] = raw[name]["train_wps"] / raw[baseline]["train_wps"]
            payload[f"{name}_wps_ratio"] = row["wps ratio"]
            stage(f"time IW-PPL of {name} (k={args.k}, {args.eval_sentences} sentences)")
            row["IW s/sentence"] = iw_seconds_per_sentence(args, work / name)
            payload.setdefault("iw_seconds_per_sentence", {})[name] = row["IW s/sentence"]
        else:
            row["wps ratio"], row["IW s/sentence"] = 1.0, float("nan")
        rows.append(row)
    print_table(rows, list(rows[0].keys()), f"sentence-VAE benchmark ({args.updates} updates, {device_name(args)}"
                                            f"{', fp16' if args.fp16 else ''})")
    write_json(args.out, payload)
    stage(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
