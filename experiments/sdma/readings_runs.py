"""The controlled comparison of the two SDMA readings (command ``sdma-readings-runs``).

V-T, SDMA-T in the ``paper`` reading and SDMA-T in the ``authors`` reading, each trained from
``--seeds`` seeds for the same number of updates with the demo's model size and optimisation
(``quickstart.py``: Table I's tiny width, 2+2 layers, joint 2k sentencepiece) on Ding de->en.

Stages (one ``[sdma]`` line each; every finished stage is reused when the command runs again, and
an interrupted training run resumes from its ``checkpoint_last.pt``, so the runs may span days):

1. the quickstart's data (``prepare-ding``, ``prepare-translation``);
2. per seed, then per system: ``fairseq-train`` to ``--updates``, watched by a CPU-contention
   monitor; ``fairseq-generate`` (beam 5) of the test split; LR/HR of the three attention types
   (``sdma-redundancy``'s measure);
3. BLEU per run (sacreBLEU, 13a, detokenised) and, over the seeds, the mean BLEU of each system
   with a percentile bootstrap over test sentences, and paired bootstrap intervals of the
   differences (each reading - V-T, authors - paper): one resample of sentences is applied to
   every run, and a system's BLEU in it is the mean over its seeds;

then a table and ``OUT/results.json``: per run ``bleu``, ``valid_nll`` (bits per target token at
the last update), ``lr``/``hr`` per attention type, ``hardness`` (the last validation's
``sdma_hardness``: mean max_c p(c|z) of the feature GMMs), ``train_wps`` over the intervals during
which other processes used at most 0.25 cores (and over all intervals); per system the seed means;
``comparisons`` the paired intervals.
"""

import argparse
import json
from pathlib import Path
from typing import Dict

import numpy as np

from latent_core.redundancy import ATTENTION_TYPES
from pipelines.data import ding
from pipelines.runs import (
    USER_DIR,
    console_script,
    generate,
    last_num_updates,
    print_table,
    resumed_update,
    run_streaming,
    slug,
    stage,
    trained_parameters,
    uncontended_words_per_second,
    valid_metric,
    write_json,
)
from experiments.sdma import quickstart
from experiments.bleu_bootstrap import corpus_bleu_of, paired_bootstrap, sentence_statistics

SYSTEMS = {
    "V-T": ["--sdma-mode", "none"],
    "SDMA-T paper": ["--sdma-reading", "paper"],
    "SDMA-T authors": ["--sdma-reading", "authors"],
}
COMPARISONS = (("SDMA-T paper", "V-T"), ("SDMA-T authors", "V-T"), ("SDMA-T authors", "SDMA-T paper"))
ARCH = ["--arch", "sdma_transformer_iwslt_de_en_tiny", "--criterion", "sdma_label_smoothed_cross_entropy"]


def train(system: str, seed: int, data_bin: Path, save_dir: Path, updates: int) -> Dict:
    """``fairseq-train`` to ``updates`` (resuming ``checkpoint_last.pt`` if there is one); its
    measurements are kept in ``save_dir/train.json`` and reused by a later call."""
    model_args = [*ARCH, *SYSTEMS[system]]
    done_path = save_dir / "train.json"
    if done_path.exists():
        done = json.loads(done_path.read_text())
        if done.get("updates") == updates and done.get("model_args") == model_args:
            stage(f"{system} seed {seed}: reusing the trained model in {save_dir}")
            return done["measured"]
    previous_logs = sorted(save_dir.glob("train-*.log"))
    log_path = save_dir / f"train-{len(previous_logs) + 1}.log"
    cmd = [console_script("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--task", "translation",
           *model_args, *quickstart.MODEL_SIZE, *quickstart.OPTIMIZATION, "--seed", seed, "--cpu",
           "--save-dir", save_dir, "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", 25,
           "--no-progress-bar", "--max-update", updates, "--max-epoch", "10000"]
    stage(f"{system} seed {seed}: fairseq-train to {updates} updates -> {save_dir} (log {log_path})")
    run = run_streaming(cmd, log_path, echo_filter=r"\| valid \||num\. (shared )?model params", monitor_cpu=True)
    reached = last_num_updates(run["log"])
    if reached != updates:
        raise SystemExit(f"{log_path}: training stopped at update {reached}, expected {updates} (a checkpoint "
                         f"with more updates in {save_dir}? remove it or raise --updates)")
    speed = uncontended_words_per_second(run, start_update=resumed_update(run["log"]))
    measured = {
        "train_wps": speed["words_per_second"], "train_wps_all_intervals": speed["all_words_per_second"],
        "wps_intervals": speed["intervals"], "wps_all_intervals": speed["all_intervals"],
        "wps_per_interval": speed["per_interval"],
        "trained_params": trained_parameters(run["log"]),
        "valid_nll": valid_metric(run["log"], "nll_loss"), "hardness": valid_metric(run["log"], "sdma_hardness"),
        "dqq_clamped": valid_metric(run["log"], "sdma_dqq_clamped"),
        "dqq_ratio": valid_metric(run["log"], "sdma_dqq_ratio"),
        "resumed_from": resumed_update(run["log"]), "train_seconds_last_process": run["seconds"],
    }
    write_json(done_path, {"updates": updates, "model_args": model_args, "measured": measured})
    return measured


def evaluate(system: str, seed: int, data_bin: Path, save_dir: Path, max_sentences: int, gen_max_len: int) -> Dict:
    from user_dir.tools.sdma.redundancy import attention_redundancy

    done_path = save_dir / "evaluation.json"
    if done_path.exists():
        return json.loads(done_path.read_text())
    checkpoint = save_dir / "checkpoint_last.pt"
    stage(f"{system} seed {seed}: fairseq-generate (beam 5) of the test split")
    result = generate(data_bin, checkpoint, save_dir, extra=["--max-len-b", gen_max_len])
    stage(f"{system} seed {seed}: LR/HR of the three attention types on the first {max_sentences} test sentences")
    redundancy = attention_redundancy(str(checkpoint), data=str(data_bin), subset="test",
                                      max_sentences=max_sentences, device="cpu", user_dir=str(USER_DIR))
    evaluation = {
        "hypotheses": result["hypotheses"],
        "lr": {kind: redundancy[kind]["LR"] for kind in ATTENTION_TYPES},
        "hr": {kind: redundancy[kind]["HR"] for kind in ATTENTION_TYPES},
        "redundancy_sentences": redundancy["sentences"],
    }
    write_json(done_path, evaluation)
    return evaluation


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("outputs") / "sdma_readings")
    p.add_argument("--updates", type=int, default=1400,
                   help="training updates of every run (default 1400: g = 1 - exp(-5e-4 t) passes 0.5)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    p.add_argument("--max-words", type=int, default=10, help="keep Ding pairs of at most N words per side")
    p.add_argument("--vocab-size", type=int, default=2000, help="joint sentencepiece vocabulary")
    p.add_argument("--valid-size", type=int, default=ding.VALID_SIZE,
                   help="Ding validation pairs (default: %(default)s)")
    p.add_argument("--test-size", type=int, default=ding.TEST_SIZE, help="Ding test pairs (default: %(default)s)")
    p.add_argument("--gen-max-len", type=int, default=200, help="longest hypothesis, in tokens (fairseq's 200)")
    p.add_argument("--redundancy-sentences", type=int, default=500, help="test sentences for LR/HR (default 500)")
    p.add_argument("--bootstrap-resamples", type=int, default=1000)
    p.add_argument("--train-only", action="store_true", help="train the runs, skip evaluation and the summary")
    args = p.parse_args(argv)
    if min(args.updates, args.redundancy_sentences, args.gen_max_len, args.bootstrap_resamples, *args.seeds) < 1:
        p.error("--updates, --seeds, --redundancy-sentences, --gen-max-len and --bootstrap-resamples must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out: Path = args.out_dir
    data_bin = ding.prepare_fairseq_data(out / "data", args.max_words, args.vocab_size, valid_size=args.valid_size,
                                         test_size=args.test_size, stage=stage)
    references = (out / "data" / "raw" / "test.en").read_text(encoding="utf-8").splitlines()
    runs: Dict[str, Dict[int, Dict]] = {system: {} for system in args.systems}
    for seed in args.seeds:  # every system at seed 1 first: a partial run already compares the readings
        for system in args.systems:
            save_dir = out / slug(system) / f"seed{seed}"
            entry = {"seed": seed, "updates": args.updates, "model_args": [*ARCH, *SYSTEMS[system]]}
            entry.update(train(system, seed, data_bin, save_dir, args.updates))
            if not args.train_only:
                evaluation = evaluate(system, seed, data_bin, save_dir, args.redundancy_sentences, args.gen_max_len)
                entry["stats"] = sentence_statistics(evaluation["hypotheses"], references)
                entry["bleu"] = corpus_bleu_of(entry["stats"])
                entry.update({k: evaluation[k] for k in ("lr", "hr", "redundancy_sentences")})
            runs[system][seed] = entry
    if args.train_only:
        return 0
    summary = paired_bootstrap({system: [r["stats"] for r in by_seed.values()] for system, by_seed in runs.items()},
                               args.bootstrap_resamples, seed=1, comparisons=COMPARISONS)
    results = {
        "runs": {system: {str(seed): {k: v for k, v in r.items() if k != "stats"} for seed, r in by_seed.items()}
                 for system, by_seed in runs.items()},
        "summary": summary,
        "seeds": args.seeds, "updates": args.updates, "test_sentences": len(references),
        "estimators": {
            "bleu": f"sacreBLEU (13a, detokenised) of beam-5 checkpoint_last hypotheses on the {len(references)} "
                    "Ding test pairs; a system's BLEU is the mean over its seeds",
            "intervals": f"{int(100 * summary['level'])}% percentile bootstrap over test sentences "
                         f"({summary['resamples']} resamples, one resample shared by every run: paired)",
            "valid_nll": "fairseq's nll_loss of the last validation (bits per target token)",
            "lr_hr": "latent_core.redundancy on the paper's [0, 1] scale, mean over the first "
                     f"{args.redundancy_sentences} test sentences",
            "hardness": "sdma_hardness of the last validation: mean over real tokens, heads and layers of "
                        "max_c p(c|z) of the feature GMMs",
            "train_wps": "target tokens per second over fairseq's logged intervals (first skipped) during which "
                         "other processes used at most 0.25 cores (CpuContentionMonitor)",
        },
    }
    write_json(out / "results.json", results)
    rows = []
    for system, by_seed in runs.items():
        mean = lambda key: float(np.mean([r[key] for r in by_seed.values()]))  # noqa: E731
        s = summary["systems"][system]
        rows.append({"system": system, "BLEU": s["bleu"], "BLEU 95%": f"{s['interval'][0]:.2f}-{s['interval'][1]:.2f}",
                     "per seed": " ".join(f"{r['bleu']:.2f}" for r in by_seed.values()),
                     "valid NLL": mean("valid_nll"), "LR enc": float(np.mean([r["lr"]["encoder_self"] for r in by_seed.values()])),
                     "HR enc": float(np.mean([r["hr"]["encoder_self"] for r in by_seed.values()])),
                     "hardness": mean("hardness"), "train wps": mean("train_wps")})
    print_table(rows, list(rows[0]), f"Ding de->en, {args.updates} updates, seeds {args.seeds} ({out / 'results.json'})")
    for name, c in summary["comparisons"].items():
        print(f"  {name}: {c['difference']:+.2f} BLEU (95% paired interval {c['interval'][0]:+.2f} to "
              f"{c['interval'][1]:+.2f})")
    return 0
