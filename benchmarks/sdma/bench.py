"""Benchmark (``make bench``, command ``sdma-bench``): vanilla transformer vs SMA-T vs SDMA-T, identical size, one run.

Three parts, every ratio taken against V-T in the same run:

1. FLOPs (below), and the paper's base configurations' FLOPs per token and training memory
   at a 4096-token batch (``scale.py``; ``--skip-scale``);
2. **update timing** (``step_timing.py``): the three models in one process on one fixed batch,
   taking turns over ``--step-rounds`` rounds (default 7); wall-clock and process CPU time per
   update, the speed ratio per round as min / median / max, and the FLOPs ratio of the same
   update next to it; at the tiny configuration (6+6 layers) and at 2+2 layers, 256-d
   (``--step-configs``). This is the measure that resolves a 5% difference on a shared machine;
3. **end to end**: ``fairseq-train`` and ``fairseq-generate`` as users run them (``--config``),
   interleaved over ``--repeats`` rounds (default 5).

End to end, each model is trained with ``fairseq-train`` on the same data (the quickstart's Ding
de-en split) for the same number of updates, then decoded with ``fairseq-generate``.
Measured per model:

* training words/s: mean of fairseq's ``wps`` over the logged intervals after the first;
* peak memory: peak resident memory of the training process (CPU), or
  ``torch.cuda.max_memory_allocated`` on a GPU (``--gpu``);
* ``fairseq-generate`` sentences/s (beam 5) on the test split.

Ratios are to vanilla, measured in the same run; the models are interleaved over
``--repeats`` rounds and each number is the model's median (the per-round ratios' min / median /
max are kept too). Prints tables, writes ``outputs/bench/sdma.json`` with ``train_wps_ratio``,
``peak_mem_ratio`` and ``generate_speed_ratio`` (SDMA-T / vanilla), ``step`` (the update
timing per configuration) plus every raw number.

FLOPs (first, well under a minute on a CPU; ``--flops-only`` stops there): counted by PyTorch's
``FlopCounterMode`` (``benchmarks/sdma/flops.py`` over ``benchmarks/op_counts.py``; matrix products only, elementwise ops
not counted) for V-T, SMA-T and SDMA-T at the tiny and base IWSLT'14 configurations on a
fixed synthetic batch: one training step (forward with the SDMA regularisers + backward)
per target token, and one eval-mode forward per sentence (the paper's FLOPs column reads
like the latter). Printed as a table; ``flops_ratio`` (SDMA-T / V-T, base, training per
target token) and the whole table (``flops``) go into the JSON (``--flops-only`` updates
only those two keys of an existing file).
"""

import argparse
import json
import shutil
import statistics
from pathlib import Path

import torch

from pipelines.runs import (
    USER_DIR,
    console_script,
    generate,
    model_parameters,
    print_table,
    run_streaming,
    stage,
    train_inner_intervals,
    train_words_per_second,
    write_json,
)
from latent_core.sdma import READINGS
from benchmarks.sdma import scale, step_timing
from benchmarks.sdma.flops import describe_setting, flops_table, table_rows
from pipelines.data.ding import prepare_fairseq_data

CONFIGS = {
    # the paper's tiny setting (Table I, IWSLT'14 tiny: 256/512, 6+6 layers, 4 heads, 4/4 clusters)
    "tiny": ["--arch", "sdma_transformer_iwslt_de_en_tiny"],
    "base": ["--arch", "sdma_transformer_iwslt_de_en"],
}
MODELS = {"V-T": "none", "SMA-T": "sma", "SDMA-T": "sdma"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--updates", type=int, default=40, help="training updates per model (default 40)")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5,
                   help="end-to-end rounds of (V-T, SMA-T, SDMA-T), medians reported (default 5)")
    p.add_argument("--step-configs", default="tiny,tiny2x2",
                   help=f"configurations of the update timing, comma-separated, from "
                        f"{', '.join(step_timing.STEP_CONFIGS)}; empty: skip (default tiny,tiny2x2)")
    p.add_argument("--step-rounds", type=int, default=step_timing.StepSetting.rounds,
                   help="interleaved rounds of the update timing (default %(default)s)")
    p.add_argument("--skip-scale", action="store_true",
                   help="skip the base-configuration FLOPs/memory table (about 2.5 minutes on a 2-core CPU)")
    p.add_argument("--skip-train", action="store_true",
                   help="FLOPs and update timing only, no fairseq-train / fairseq-generate runs")
    p.add_argument("--gen-length", type=int, default=12,
                   help="tokens per hypothesis when decoding the test set (default 12)")
    p.add_argument("--reading", choices=READINGS, default=step_timing.StepSetting.reading,
                   help="--sdma-reading of SMA-T and SDMA-T in the update timing and the fairseq-train runs "
                        "(default %(default)s, the models' default)")
    p.add_argument("--gpu", action="store_true", help="train/decode on the GPU (also add --fp16)")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--out", type=Path, default=Path("outputs") / "bench" / "sdma.json")
    p.add_argument("--data-dir", type=Path, default=Path("outputs") / "quickstart" / "data")
    p.add_argument("--flops-only", action="store_true",
                   help="count and print the FLOPs table only (under a minute on a CPU), no training or decoding")
    args = p.parse_args(argv)
    if args.updates < 10:
        p.error("--updates must be >= 10 (the first logged interval is warm-up)")
    if args.repeats < 1 or args.step_rounds < 1:
        p.error("--repeats and --step-rounds must be >= 1")
    args.step_configs = [c for c in args.step_configs.split(",") if c]
    for config in args.step_configs:
        if config not in step_timing.STEP_CONFIGS:
            p.error(f"--step-configs: unknown configuration {config!r} "
                    f"(one of {', '.join(step_timing.STEP_CONFIGS)})")
    return args


def measure(args, data_bin, save_dir, name, mode, device, precision):
    """Train one model for ``--updates`` updates and decode the test set; return its numbers."""
    shutil.rmtree(save_dir, ignore_errors=True)  # never resume an earlier run's checkpoint
    stage(f"train {name} ({args.config}, --sdma-mode {mode}) for {args.updates} updates")
    # "none" builds fairseq's own MultiheadAttention everywhere: the vanilla transformer
    train = run_streaming([
        console_script("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--task", "translation",
        *CONFIGS[args.config], "--sdma-mode", mode, "--sdma-reading", args.reading, "--share-all-embeddings",
        "--criterion", "sdma_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--optimizer", "adam", "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
        "--max-tokens", args.max_tokens, "--max-update", args.updates, "--seed", "1",
        "--log-interval", "10", "--log-format", "simple", "--no-progress-bar", "--disable-validation",
        "--save-dir", save_dir, "--no-epoch-checkpoints", *device, *precision,
    ], save_dir / "train.log", echo_filter=r"num\. (shared )?model params", wrap_rss=True)
    stage(f"decode {name}: fairseq-generate, beam 5, test set, {args.gen_length} tokens per hypothesis")
    # Briefly trained models stop at different lengths; fixing the output length
    # (min = max) makes every model do the same decoding work.
    gen = generate(data_bin, save_dir / "checkpoint_last.pt", save_dir,
                   extra=["--batch-size", "64", "--min-len", str(args.gen_length),
                          "--max-len-a", "0", "--max-len-b", str(args.gen_length),
                          *(["--fp16"] if args.fp16 else [])], cpu=not args.gpu)
    return {
        "train_wps": train_words_per_second(train["log"]),
        # the typical interval: robust to a slow one
        "train_wps_median_interval": statistics.median(
            interval["wps"] for interval in train_inner_intervals(train["log"])[1:] or [{"wps": float("nan")}]),
        "peak_mem_mb": train.get("peak_cuda_mb" if args.gpu else "peak_rss_mb", float("nan")),
        "generate_sentences_per_second": gen["sentences_per_second"],
        "params": model_parameters(train["log"]),
        "train_seconds": train["seconds"],
    }


def measure_flops():
    """Count, print and return the FLOPs table (tiny and base, V-T / SMA-T / SDMA-T)."""
    stage("FLOPs: FlopCounterMode, one training step and one eval forward per model (tiny, base)")
    table = flops_table(("tiny", "base"))
    rows = table_rows(table)
    print_table(rows, list(rows[0].keys()), "SDMA FLOPs (torch.utils.flop_counter; training step = forward "
                                            "with the SDMA regularisers + backward)")
    print(describe_setting(table))
    print("paper, for comparison (Table II, IWSLT'14 De-En base, FLOPs column, sentence length not given): "
          "V-T 2.2G, SMA-T / SDMA-T 2.3G (+4.5% at the printed precision)", flush=True)
    return {"flops_ratio": table["configs"]["base"]["SDMA-T"]["ratio_to_vt"], "flops": table}


def measure_scale(reading: str = "authors"):
    """FLOPs per token and training memory of the paper's base configurations, SDMA-T in ``reading``
    (printed, returned)."""
    stage("scale: IWSLT'14 / WMT'14 base, one training batch of ~4096 target tokens each, FLOPs and "
          "parameter / saved-activation memory")
    rows = scale.scale_table(reading)
    printable = scale.table_rows(rows)
    print_table(printable, list(printable[0].keys()),
                f"Base configurations per GPU (fp32; activations = tensors saved for backward; SDMA-T {reading} "
                "reading)")
    return rows


def measure_steps(args):
    """The interleaved update timing at every ``--step-configs`` configuration (printed, returned)."""
    setting = step_timing.StepSetting(rounds=args.step_rounds, reading=args.reading)
    timings, rows = {}, []
    for config in args.step_configs:
        stage(f"update timing, {config}, {setting.reading} reading: V-T / SMA-T / SDMA-T in one process, "
              f"{setting.rounds} interleaved "
              f"rounds of {setting.updates_per_round} updates, batch {setting.sentences} x {setting.tokens} tokens")
        timings[config] = step_timing.time_updates(config, setting)
        rows += step_timing.table_rows(timings[config])
    if rows:
        print_table(rows, list(rows[0].keys()), "Update timing (speed ratio = V-T time / model time, per round; "
                                                "FLOPs bound = V-T FLOPs / model FLOPs of the same update)")
    return timings


def main(argv=None):
    args = parse_args(argv)
    flops = measure_flops()
    if args.flops_only:
        _update_json(args.out, flops)
        stage(f"flops_ratio (SDMA-T / V-T, base) = {flops['flops_ratio']:.4f}; updated {args.out}")
        return
    if not args.skip_scale:
        flops["scale"] = measure_scale(args.reading)
    steps = measure_steps(args)
    if args.skip_train:
        _update_json(args.out, {**flops, "step": steps})
        stage(f"wrote {args.out} (FLOPs and update timing)")
        return
    data_bin = prepare_fairseq_data(args.data_dir, max_words=10, vocab_size=2000, stage=stage)
    work = args.out.parent / args.config
    device = [] if args.gpu else ["--cpu"]
    precision = ["--fp16"] if args.fp16 else []
    rows, runs = [], {name: [] for name in MODELS}
    # Interleave the models over --repeats rounds and keep each model's median: this VM's
    # speed drifts by ~10% over minutes, which a single sequential pass would attribute
    # to whichever model ran at the wrong moment.
    for round_index in range(args.repeats):
        for name, mode in MODELS.items():
            runs[name].append(measure(args, data_bin, work / name.replace(" ", "-"), name, mode, device, precision))
            stage(f"round {round_index + 1}/{args.repeats} {name}: " + ", ".join(
                f"{k}={v:.1f}" for k, v in runs[name][-1].items() if k != "params"))
    raw = {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
           for name, results in runs.items()}
    base = raw["V-T"]
    spread = {name: {key: _round_ratios(runs["V-T"], results, key)
                     for key in ("train_wps", "generate_sentences_per_second", "peak_mem_mb")}
              for name, results in runs.items()}
    for name, r in raw.items():
        rows.append({
            "model": name,
            "params": r["params"],
            "train words/s": r["train_wps"],
            "wps ratio": r["train_wps"] / base["train_wps"],
            "per round min-max": "{min:.3f}-{max:.3f}".format(**spread[name]["train_wps"]),
            "peak MB": r["peak_mem_mb"],
            "mem ratio": r["peak_mem_mb"] / base["peak_mem_mb"],
            "gen sent/s": r["generate_sentences_per_second"],
            "gen ratio": r["generate_sentences_per_second"] / base["generate_sentences_per_second"],
        })
    print_table(rows, list(rows[0].keys()), f"SDMA benchmark ({args.config}, {args.updates} updates, "
                                            f"{'GPU' if args.gpu else 'CPU'}{' fp16' if args.fp16 else ''})")
    sdma = raw["SDMA-T"]
    payload = {
        "train_wps_ratio": sdma["train_wps"] / base["train_wps"],
        "peak_mem_ratio": sdma["peak_mem_mb"] / base["peak_mem_mb"],
        "generate_speed_ratio": sdma["generate_sentences_per_second"] / base["generate_sentences_per_second"],
        "sma": {
            "train_wps_ratio": raw["SMA-T"]["train_wps"] / base["train_wps"],
            "peak_mem_ratio": raw["SMA-T"]["peak_mem_mb"] / base["peak_mem_mb"],
            "generate_speed_ratio": raw["SMA-T"]["generate_sentences_per_second"]
            / base["generate_sentences_per_second"],
        },
        "config": args.config,
        "updates": args.updates,
        "device": "gpu" if args.gpu else "cpu",
        "device_name": torch.cuda.get_device_name() if args.gpu and torch.cuda.is_available() else "cpu",
        "fp16": args.fp16,
        "raw": raw,
        "runs": runs,
        "round_ratios": spread,
        "step": steps,
        "repeats": args.repeats,
        **flops,
    }
    write_json(args.out, payload)
    stage(f"wrote {args.out}")


def _update_json(path: Path, values: dict) -> None:
    """Write ``values`` into the JSON at ``path``, keeping the keys of an earlier full run."""
    payload = json.loads(path.read_text()) if path.exists() else {}
    payload.update(values)
    write_json(path, payload)


def _round_ratios(vanilla, results, key):
    """min / median / max over rounds of (model / V-T of the same round)."""
    ratios = [r[key] / v[key] for v, r in zip(vanilla, results)]
    return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}


if __name__ == "__main__":
    raise SystemExit(main())
