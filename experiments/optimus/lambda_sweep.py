"""Optimus' Table 1 (and Tables 8-11) on one corpus: fine-tune a pre-trained Optimus once per KL
threshold lambda, evaluate it, print the table (command ``optimus-lambda-sweep``).

The fine-tuning is the paper's language-modelling stage (Sec. 5.1: "We load the pre-trained
OPTIMUS, and update the model with one additional beta scheduling cycle for one epoch"), with
the authors' settings (``doc/optimus_finetune_language_models.md`` of their code: ``--beta 1.0
--ratio_zero 0.5 --ratio_increase 0.25 --fb_mode 1 --dim_target_kl LAMBDA
--num_train_epochs 1``, AdamW, linearly decaying learning rate 5e-5, gradient norm 1):

    fairseq-train DATA --task optimus_lm --criterion sentence_vae <the checkpoint's model flags>
        --restore-file PRETRAINED --reset-optimizer --reset-lr-scheduler --reset-meters --reset-dataloader
        --beta-schedule cyclical:1:0.5:0.25:0.25:1.0 --kl-variant hinge --kl-threshold LAMBDA
        --optimizer adam --adam-betas "(0.9, 0.999)" --lr 5e-5 --lr-scheduler polynomial_decay
        --total-num-update U --max-update U --clip-norm 1.0 --batch-size B

with U = epochs x ceil(train sentences / B). ``--kl-variant hinge`` is the authors' code
(dimensions whose KL is below lambda contribute nothing); ``--kl-variant free_bits`` gives the
paper's eq. 9 (max(lambda, KL)). lambda = 0 is the plain KL. The model flags are read from the
pre-trained checkpoint (safe loader), so the fine-tuned model is the pre-trained one.

Each lambda is then evaluated with ``vae-eval`` on ``--eval-subset`` (IW bound with ``--k``
samples, ELBO, KL, MI, AU, reconstruction BLEU). ``OUT/lambda_sweep.json`` has one entry per
lambda (key: lambda as written, e.g. ``"0.05"``) with ``iw_ppl`` in the paper's unit (vae-eval's
``ppl_optimus_units``: per GPT-2 token of ``<BOS> x <EOS>``, what Optimus' tables call per word),
``iw_ppl_word`` / ``elbo_ppl_word`` (whitespace words + 1), ``*_token`` (per GPT-2 token incl. the
end token, fairseq's), ``kl``, ``mi``, ``au``, ``rec_bleu``,
``updates``, ``train_wps`` and the estimators. Finished lambdas are reused when the command is
run again with the same settings; progress is printed as ``[optimus]`` lines.
"""

import argparse
import json
import math
import subprocess
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from pipelines.runs import (
    USER_DIR,
    console_script,
    finished,
    fairseq_train,
    print_table,
    resumed_update,
    segment_words_per_second,
    write_json,
)
from latent_core.safe_loading import model_config, register_checkpoint_types

from user_dir.optimus.model import OptimusModel

LAMBDAS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0)  # Table 1 / Tables 8-11, and lambda = 0


def stage(message: str) -> None:
    print(f"[optimus] {message}", flush=True)


def model_flags(checkpoint: Path) -> List[str]:
    """``--arch`` and every Optimus model option saved in ``checkpoint`` (read with
    ``torch.load(weights_only=True)``), as command-line flags."""
    register_checkpoint_types()
    state = torch.load(str(checkpoint), map_location="cpu", weights_only=True)
    config = model_config(state)
    if config is None:
        raise SystemExit(f"{checkpoint}: no model configuration in the checkpoint")
    get = (lambda key: getattr(config, key, None)) if isinstance(config, argparse.Namespace) else config.get
    arch = get("arch") or get("_name")
    if arch is None or not str(arch).startswith("optimus"):
        raise SystemExit(f"{checkpoint}: holds a {arch!r} model, not an Optimus model (--arch optimus*)")
    parser = argparse.ArgumentParser()
    OptimusModel.add_args(parser)
    flags = ["--arch", str(arch)]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = get(action.dest)
        if value is not None:
            flags += [action.option_strings[0], str(value)]
    return flags


def count_sentences(data: Path, split: str = "train") -> int:
    """Sentences of a binarised ``optimus_lm`` split (its GPT-2 side's index)."""
    from fairseq.data import data_utils

    dataset = data_utils.load_indexed_dataset(str(data / f"{split}.bert-gpt2.gpt2"), None)
    if dataset is None:
        raise SystemExit(f"{data}: no {split}.bert-gpt2.gpt2 split; prepare it with prepare-optimus-data")
    return len(dataset)


def finetune_arguments(args, flags: Sequence[str], lam: float, save_dir: Path, updates: int) -> List[str]:
    """fairseq-train's arguments for one lambda; ``flags``: :func:`model_flags` of the pre-trained model."""
    return [
        str(args.data), "--user-dir", str(USER_DIR), "--task", "optimus_lm", "--criterion", "sentence_vae",
        *flags,
        "--restore-file", str(args.pretrained.resolve()), "--reset-optimizer", "--reset-lr-scheduler",
        "--reset-meters", "--reset-dataloader",
        "--beta-schedule", f"cyclical:1:0.5:0.25:0.25:{args.beta_max}", "--kl-variant", args.kl_variant,
        "--kl-threshold", str(lam), "--optimizer", "adam", "--adam-betas", "(0.9, 0.999)",
        "--weight-decay", "0.0", "--lr", str(args.lr), "--lr-scheduler", "polynomial_decay",
        "--total-num-update", str(updates), "--end-learning-rate", "0.0", "--max-update", str(updates),
        "--clip-norm", "1.0", "--batch-size", str(args.batch_size), "--seed", str(args.seed),
        "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--disable-validation", "--num-workers", "0",
        "--log-format", "simple", "--log-interval", str(args.log_interval), "--no-progress-bar",
        *(["--cpu"] if args.cpu else []),
    ]


def evaluate(args, checkpoint: Path, out: Path) -> Dict:
    cmd = [console_script("vae-eval"), str(args.data), "--path", str(checkpoint), "--subset", args.eval_subset,
           "--k", str(args.k), "--mi-samples", str(args.mi_samples), "--seed", str(args.seed), "--json", str(out),
           *(["--max-sentences", str(args.max_eval_sentences)] if args.max_eval_sentences else []),
           *(["--cpu"] if args.cpu else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"vae-eval failed on {checkpoint}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def sweep_entry(results: Dict, log: str, updates: int, lam: float, settings: Dict) -> Dict:
    return {
        **settings,
        "lambda": lam,
        "iw_ppl": results["ppl_optimus_units"],
        "iw_ppl_word": results.get("iw_ppl_word"), "elbo_ppl_word": results.get("elbo_ppl_word"),
        "iw_ppl_token": results["iw_ppl"], "elbo_ppl_token": results["elbo_ppl"],
        "kl": results["kl"], "mi": results["mi"], "mi_se": results["mi_se"], "au": results["au"],
        "pc1_share": results.get("pc1_share"),
        "latent_dim": results.get("dim_z"), "rec": results["rec"], "rec_bleu": results.get("rec_bleu"),
        "nll": results["nll"], "elbo": results["elbo"], "num_sentences": results["num_sentences"],
        "updates": updates,
        "train_wps": segment_words_per_second(log, start_update=resumed_update(log))["words_per_second"],
        "estimators": {**results["estimators"],
                       "ppl_unit_here": "iw_ppl: ppl_optimus_units (Optimus' tables); *_word: whitespace words + 1; "
                                        "*_token: GPT-2 tokens incl. the end token",
                       "train_wps": "GPT-2 target tokens per second of fairseq's logged intervals (first skipped)"},
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="optimus-lambda-sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="the fine-tuning corpus (prepare-optimus-data output)")
    p.add_argument("--pretrained", type=Path, required=True, help="the pre-trained Optimus checkpoint (stage 1)")
    p.add_argument("--out-dir", type=Path, default=Path("outputs/optimus"))
    p.add_argument("--lambdas", type=float, nargs="+", default=list(LAMBDAS),
                   help="KL thresholds (default: 0 0.05 0.1 0.25 0.5 1)")
    p.add_argument("--epochs", type=float, default=1.0, help="fine-tuning epochs (paper: 1)")
    p.add_argument("--batch-size", type=int, default=16, help="sentences per update (authors: 5 per GPU)")
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate, linearly decayed to 0 (authors: 5e-5)")
    p.add_argument("--beta-max", type=float, default=1.0, help="beta of the schedule's constant part (authors: 1.0)")
    p.add_argument("--kl-variant", choices=("hinge", "free_bits"), default="hinge",
                   help="hinge: the authors' code (default); free_bits: the paper's eq. 9")
    p.add_argument("--k", type=int, default=100, help="importance samples of the IW bound (authors: 100)")
    p.add_argument("--mi-samples", type=int, default=10)
    p.add_argument("--eval-subset", default="test")
    p.add_argument("--max-eval-sentences", type=int, help="evaluate a random subset of this many sentences")
    p.add_argument("--log-interval", type=int, default=25)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cpu", action="store_true", help="train and evaluate on CPU")
    args = p.parse_args(argv)
    if not args.pretrained.is_file():
        p.error(f"--pretrained {args.pretrained}: no such checkpoint")
    if args.batch_size < 1 or args.epochs <= 0 or args.lr <= 0 or args.k < 1 or args.beta_max < 0:
        p.error("--batch-size, --epochs, --lr and --k must be positive, --beta-max >= 0")
    if any(lam < 0 or math.isnan(lam) for lam in args.lambdas):
        p.error(f"--lambdas {args.lambdas}: KL thresholds must be >= 0")
    return args


def lambda_key(lam: float) -> str:
    return f"{lam:g}"


def main(argv=None) -> int:
    args = parse_args(argv)
    out: Path = args.out_dir
    results_path = out / "lambda_sweep.json"
    table = json.loads(results_path.read_text()) if results_path.exists() else {}
    updates = max(1, math.ceil(args.epochs * count_sentences(args.data) / args.batch_size))
    flags = None  # the pre-trained checkpoint is read once, when the first lambda needs training
    for lam in args.lambdas:
        key = lambda_key(lam)
        save_dir = out / f"lambda_{key}"
        settings = {"pretrained": str(args.pretrained), "data": str(args.data), "epochs": args.epochs,
                    "batch_size": args.batch_size, "lr": args.lr, "kl_variant": args.kl_variant,
                    "beta_max": args.beta_max, "k": args.k, "eval_subset": args.eval_subset, "seed": args.seed,
                    "max_eval_sentences": args.max_eval_sentences, "ppl_unit": "optimus"}
        previous = table.get(key)
        if previous and all(previous.get(k) == v for k, v in settings.items()):
            stage(f"lambda {key}: reusing the finished run in {save_dir}")
            continue
        log_path = save_dir / "train.log"
        if finished(log_path) and (save_dir / "checkpoint_last.pt").is_file():
            stage(f"lambda {key}: reusing the fine-tuned model in {save_dir}")
            log = log_path.read_text()
        else:
            stage(f"lambda {key}: fine-tuning {updates} updates from {args.pretrained} -> {save_dir} (log {log_path})")
            flags = flags or model_flags(args.pretrained)
            log = fairseq_train(finetune_arguments(args, flags, lam, save_dir, updates), log_path)["log"]
        stage(f"lambda {key}: vae-eval on {args.eval_subset} (k={args.k})")
        results = evaluate(args, save_dir / "checkpoint_last.pt", save_dir / "eval.json")
        table[key] = sweep_entry(results, log, updates, lam, settings)
        write_json(results_path, table)
    rows = [{"lambda": key, "IW-PPL (Optimus unit)": r["iw_ppl"], "IW-PPL/word": r["iw_ppl_word"],
             "IW-PPL/token": r["iw_ppl_token"],
             "KL": r["kl"], "MI": r["mi"], "AU": r["au"], "rec BLEU": r["rec_bleu"], "updates": r["updates"]}
            for key, r in sorted(table.items(), key=lambda item: float(item[0]))]
    print_table(rows, list(rows[0]), f"Optimus lambda sweep ({results_path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
