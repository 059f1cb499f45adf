"""The SDMA quickstart (``make demo``, command ``sdma-demo``): real German->English data, end to end on a CPU.

Stages (one ``[sdma]`` line each, with its estimated duration and finish time):

1. German-English sentence pairs from the Ding dictionary (Debian ``trans-de-en``),
   deterministic train/valid/test split (``prepare-ding``, ``pipelines.data.ding``);
2. a joint sentencepiece vocabulary and ``fairseq-preprocess``
   (``prepare-translation``, ``pipelines.data.translation``);
3. a vanilla fairseq ``transformer`` (V-T) and SDMA-T of identical size, trained for the
   same fixed number of updates on the same batches, interleaved: each model runs in
   ``--segments`` segments (``fairseq-train --max-update END`` resuming its own
   ``checkpoint_last.pt``), V-T then SDMA-T in every round, so that both see the same load
   when their words/s are measured; the per-round ratio SDMA-T / V-T is reported;
4. ``fairseq-generate`` (beam 5) and sacreBLEU for both;
5. attention redundancy LR/HR (encoder self, decoder self, cross) for both;
6. the Fig. 6-style picture of one test sentence;

then a side-by-side table, also written to ``outputs/quickstart/results.json``.

The number of updates is a pure function of ``--minutes`` (``make demo DEMO_MINUTES=60``
for a longer run), calibrated on an idle 2-core machine, so the trained models and their
BLEU do not depend on how busy the machine is; a busy machine only takes longer.
``--updates N`` sets it directly. How much longer is measured before the plan is printed: a few
training updates of the demo's model size in this process (about 10 s), against the same
measurement on the idle calibration machine (:func:`measure_load`); every duration and ETA the demo
prints is the idle calibration times that load factor, corrected by each finished segment.
"""

import argparse
import datetime
import os
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from pipelines.data import ding
from user_dir.tools.sdma.bleu import sacrebleu_score
from pipelines.runs import (
    USER_DIR,
    console_script,
    generate,
    last_num_updates,
    model_parameters,
    print_table,
    ratio_stats,
    resumed_update,
    run_streaming,
    segment_words_per_second,
    stage,
    train_inner_intervals,
    valid_metric,
    write_json,
)

# The demo model: the paper's "tiny" width (256/512, 4 heads) with 2+2 layers so that
# it learns something in minutes on 2 cores; joint 2k sentencepiece vocabulary.
MODEL_SIZE = [
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
    "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--share-all-embeddings",
]
OPTIMIZATION = [
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "2e-3",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "400", "--weight-decay", "1e-4",
    "--dropout", "0.1", "--label-smoothing", "0.1", "--max-tokens", "4096",
]
MODELS = {
    "V-T": ("vanilla", ["--arch", "transformer", "--criterion", "label_smoothed_cross_entropy"]),
    "SDMA-T": ("sdma", ["--arch", "sdma_transformer_iwslt_de_en_tiny",
                        "--criterion", "sdma_label_smoothed_cross_entropy"]),
}

# Calibration: `make demo` on an idle 2-core machine (2026-11-27; 303 updates per model in 4 interleaved
# segments, 10.9 minutes from the load probe to the figure). Per fairseq-train process about 10 s of start-up,
# final validation and checkpoint; V-T then trained at 0.705 s per update and SDMA-T at 0.943 s (1.34x, the
# authors reading: the second noise draw and the keys' terms); the other stages took 74 s together.
VT_SECONDS_PER_UPDATE = 0.705
SDMA_SLOWDOWN = 1.34  # SDMA-T / V-T time per update in the demo (authors reading; see make bench)
SECONDS_PER_UPDATE = {"V-T": VT_SECONDS_PER_UPDATE, "SDMA-T": VT_SECONDS_PER_UPDATE * SDMA_SLOWDOWN}
# One fairseq-train process: start-up (imports, data, model, checkpoint) and the validation
# and checkpoint at its end; each segment beyond the first costs one more per model.
PROCESS_SECONDS = 10.0
# The other stages (idle): the load probe, data, decoding, redundancy analysis and the figure.
STAGE_SECONDS = {"probe": 10.0, "data": 10.0, "decode": 16.0, "analysis": 7.0, "figure": 10.0}
FIXED_SECONDS = (STAGE_SECONDS["probe"] + STAGE_SECONDS["data"] + 2 * PROCESS_SECONDS + 2 * STAGE_SECONDS["decode"]
                 + 2 * STAGE_SECONDS["analysis"] + STAGE_SECONDS["figure"])  # 96 s
DEFAULT_MINUTES = 11.0
SEGMENTS = 4
MIN_UPDATES = 10
# The load probe (measure_load): seconds per training update of the demo's model size on one fixed batch
# (step_timing's tiny2x2 V-T, 300 x 12 tokens), on the idle calibration machine.
LOAD_PROBE_IDLE_SECONDS = 0.97
LOAD_PROBE_UPDATES = 3


def measure_load(updates: int = LOAD_PROBE_UPDATES) -> Tuple[float, float]:
    """(seconds per update of the load probe here and now, its ratio to :data:`LOAD_PROBE_IDLE_SECONDS`): a
    V-T of the demo's size (``step_timing``'s tiny2x2) trained in this process on one fixed batch, one warm-up
    update then the median of ``updates`` timed ones. The ratio scales every idle duration the demo prints."""
    import torch

    from benchmarks.sdma import step_timing

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() or 1))  # as fairseq-train will run
    try:
        model, criterion, optimizer, sample = step_timing.build_for_updates(
            "tiny2x2", "none", step_timing.StepSetting())
        step_timing.training_update(model, criterion, optimizer, sample)
        times = []
        for _ in range(updates):
            began = time.perf_counter()
            step_timing.training_update(model, criterion, optimizer, sample)
            times.append(time.perf_counter() - began)
    finally:
        torch.set_num_threads(threads)
    seconds = sorted(times)[len(times) // 2]
    return seconds, seconds / LOAD_PROBE_IDLE_SECONDS


def updates_for_minutes(minutes: float, segments: int = SEGMENTS) -> int:
    """Updates per model that fill ``minutes`` on an idle 2-core machine (V-T + SDMA-T per update,
    after the fixed stages and the start-ups of the extra segments); never depends on the load."""
    training = minutes * 60.0 - FIXED_SECONDS - 2 * (segments - 1) * PROCESS_SECONDS
    return max(0, round(training / sum(SECONDS_PER_UPDATE.values())))


def idle_minutes(updates: int, segments: int = SEGMENTS, data: bool = True) -> float:
    """The inverse: estimated minutes of a whole demo of ``updates`` updates on an idle machine."""
    seconds = FIXED_SECONDS - (0.0 if data else STAGE_SECONDS["data"])
    seconds += 2 * (segments - 1) * PROCESS_SECONDS + updates * sum(SECONDS_PER_UPDATE.values())
    return seconds / 60.0


def log_interval_for(updates: int, segments: int) -> int:
    """fairseq's --log-interval: at most 10, and at least 4 logged intervals per segment."""
    return max(1, min(10, updates // max(1, segments) // 4))


def segment_bounds(updates: int, segments: int, log_interval: int = 1) -> List[Tuple[int, int]]:
    """(start, end) updates of each segment: about equal, inner ends on multiples of
    ``log_interval`` (so every logged interval lies inside one process), the last ends at
    ``updates``; fewer segments when there are fewer updates."""
    segments = max(1, min(segments, updates))
    ends = [log_interval * round(updates * k / segments / log_interval) for k in range(1, segments)]
    bounds, start = [], 0
    for end in ends + [updates]:
        if start < end <= updates:
            bounds.append((start, end))
            start = end
    return bounds


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES,
                   help=f"duration on an idle 2-core machine (default {DEFAULT_MINUTES:g}); sets the number of updates")
    p.add_argument("--updates", type=int, default=None,
                   help="training updates per model (overrides --minutes)")
    p.add_argument("--segments", type=int, default=SEGMENTS,
                   help=f"interleaved segments per model (default {SEGMENTS})")
    p.add_argument("--out-dir", type=Path, default=Path("outputs") / "quickstart")
    p.add_argument("--max-words", type=int, default=10, help="keep pairs of at most N words per side")
    p.add_argument("--vocab-size", type=int, default=2000, help="joint sentencepiece vocabulary")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gen-max-len", type=int, default=200,
                   help="longest hypothesis of fairseq-generate, in tokens (default 200, fairseq's)")
    args = p.parse_args(argv)
    if args.segments < 1:
        p.error("--segments must be >= 1")
    args.updates_given = args.updates is not None
    if args.updates is None:
        args.updates = updates_for_minutes(args.minutes, args.segments)
        if args.updates < MIN_UPDATES:
            p.error(f"--minutes {args.minutes:g} leaves {args.updates} updates for training; use at least "
                    f"{idle_minutes(MIN_UPDATES, args.segments):.1f} (data, decoding and analysis take ~2 minutes)")
    elif args.updates < 1:
        p.error("--updates must be >= 1")
    return args


class Eta:
    """Estimated durations: the idle calibration scaled by the load measured so far."""

    def __init__(self, load: float = 1.0):
        self.seconds_per_update: Dict[str, Optional[float]] = {name: None for name in MODELS}
        self.process_seconds: Optional[float] = None
        self.load = load  # measured / calibrated seconds per update (first: measure_load's)

    def measured(self, name: str, updates: int, seconds: float, startup: float) -> None:
        per_update = max(seconds - startup, 0.0) / max(updates, 1)
        self.seconds_per_update[name] = per_update
        self.process_seconds = startup
        self.load = per_update / SECONDS_PER_UPDATE[name]

    def segment(self, name: str, updates: int) -> float:
        per_update = self.seconds_per_update[name] or SECONDS_PER_UPDATE[name] * self.load
        startup = PROCESS_SECONDS * self.load if self.process_seconds is None else self.process_seconds
        return startup + updates * per_update

    def fixed(self, key: str) -> float:
        return STAGE_SECONDS[key] * self.load

    def after_training(self) -> float:
        return 2 * self.fixed("decode") + 2 * self.fixed("analysis") + self.fixed("figure")


def clock(seconds_from_now: float) -> str:
    return (datetime.datetime.now() + datetime.timedelta(seconds=seconds_from_now)).strftime("%H:%M:%S")


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def stage_eta(message: str, seconds: float, demo_seconds: Optional[float] = None) -> None:
    """``[sdma] message (about 40 s, until 12:03:10[; demo done ~12:09:30])``."""
    until = f"; demo done ~{clock(demo_seconds)}" if demo_seconds is not None else ""
    stage(f"{message} (about {duration(seconds)}, until {clock(seconds)}{until})")


def train_segment(data_bin: Path, save_dir: Path, arch_args, seed: int, start: int, end: int,
                  log_interval: int, log_name: str) -> Dict:
    """One ``fairseq-train`` process: updates ``start`` -> ``end``, resuming ``checkpoint_last.pt``
    of ``save_dir`` unless ``start`` is 0 (then ``save_dir`` is emptied first, so that a stale
    checkpoint of an earlier demo is never resumed)."""
    if start == 0:
        shutil.rmtree(save_dir, ignore_errors=True)
    elif not (save_dir / "checkpoint_last.pt").exists():
        raise SystemExit(f"{save_dir / 'checkpoint_last.pt'} missing: cannot resume at update {start}")
    cmd = [
        console_script("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--task", "translation",
        *arch_args, *MODEL_SIZE, *OPTIMIZATION, "--seed", seed, "--cpu",
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--log-format", "simple",
        "--log-interval", log_interval, "--no-progress-bar", "--max-update", end, "--max-epoch", "1000",
    ]
    echo = r"\| valid \|" + (r"|num\. (shared )?model params" if start == 0 else "")
    run = run_streaming(cmd, save_dir / log_name, echo_filter=echo)
    log = run["log"]
    resumed_at = resumed_update(log)
    if resumed_at != start or last_num_updates(log) != end:
        raise SystemExit(f"{save_dir / log_name}: expected updates {start} -> {end}, got "
                         f"{resumed_at} -> {last_num_updates(log)}")
    begin = next((t for line, t in zip(run["lines"], run["line_seconds"]) if "begin training epoch" in line),
                 0.0)
    intervals = train_inner_intervals(log)
    speed = segment_words_per_second(log, start_update=start)
    return {
        "start": start, "end": end, "seconds": run["seconds"], "startup_seconds": begin,
        "words_per_second": speed["words_per_second"], "words": speed["words"],
        "measured_seconds": speed["seconds"], "intervals": speed["intervals"],
        "loss": intervals[-1]["loss"] if intervals else float("nan"), "log": log,
    }


def pooled_words_per_second(segments: List[Dict]) -> float:
    """All measured intervals of a model's segments: sum of words over sum of seconds."""
    seconds = sum(s["measured_seconds"] for s in segments)
    return sum(s["words"] for s in segments) / seconds if seconds > 0 else float("nan")


def plan_message(updates: int, source: str, rounds: int, idle_seconds: float, probe_seconds: float,
                 load: float) -> str:
    """The plan line: the updates (a function of ``--minutes`` only) and the duration on this machine, the idle
    calibration times the measured ``load``."""
    planned = idle_seconds * load
    return (f"plan: {updates} updates per model ({source}) in {rounds} interleaved segments each (V-T, then "
            f"SDMA-T); this machine: {probe_seconds:.2f} s per probe update, {load:.2f}x the idle calibration's "
            f"{LOAD_PROBE_IDLE_SECONDS:.2f} s, so about {duration(planned)}, done ~{clock(planned)} "
            f"({duration(idle_seconds)} on an idle 2-core machine; the results do not depend on the load)")


def summary_lines(bleu: Dict, valid_bits: Dict[str, float], updates: int) -> List[str]:
    """What the reader can act on: BLEU with intervals, SDMA-T - V-T paired, validation cross-entropy, and what
    this scale can show. ``bleu``: :func:`experiments.bleu_bootstrap.paired_bootstrap` of the two models."""
    systems, diff = bleu["systems"], bleu["comparisons"]["SDMA-T - V-T"]
    pct = int(100 * bleu["level"])
    lines = [
        "BLEU (sacreBLEU 13a, test split, beam 5; " + f"{pct}% bootstrap intervals over test sentences, "
        f"{bleu['resamples']} resamples): " + ", ".join(
            f"{name} {v['bleu']:.2f} ({v['interval'][0]:.2f}-{v['interval'][1]:.2f})" for name, v in systems.items())
        + f"; SDMA-T - V-T {diff['difference']:+.2f} (paired: {diff['interval'][0]:+.2f} to "
        f"{diff['interval'][1]:+.2f})",
        "validation cross-entropy at the last update (bits per target token, no label smoothing, no "
        "regularisers): " + ", ".join(f"{name} {bits:.3f}" for name, bits in valid_bits.items()),
        f"What {updates} updates can show: that data, training, decoding and the analysis run end to end, and the "
        "two models' early learning. Not the paper's BLEU gain: early in training SDMA-T trails V-T at this size; "
        "when and whether the gap closes, and why, is in the learning curves "
        "(examples/sdma_translation/README.md#learning-curves-when-sdma-pays-off).",
    ]
    return lines


def main(argv=None):
    args = parse_args(argv)
    began = time.time()
    out = args.out_dir
    updates = args.updates
    log_interval = log_interval_for(updates, args.segments)
    bounds = segment_bounds(updates, args.segments, log_interval)
    rounds = len(bounds)
    reuse = all((out / "data" / f).exists() for f in ("prep/bin/train.de-en.de.bin", "raw/test.en"))
    idle = idle_minutes(updates, rounds, data=not reuse) * 60
    stage("measuring this machine: a few training updates of the demo's model size (about 10 s)")
    probe_seconds, load = measure_load()
    eta = Eta(load)
    planned = idle * load
    stage(plan_message(updates, "--updates" if args.updates_given else f"--minutes {args.minutes:g}", rounds,
                       idle, probe_seconds, load))

    if not reuse:
        stage_eta("data: Ding pairs, sentencepiece, fairseq-preprocess", eta.fixed("data"), planned)
    data_bin = ding.prepare_fairseq_data(out / "data", args.max_words, args.vocab_size, args.seed, stage=stage)
    references = (out / "data" / "raw" / "test.en").read_text().splitlines()

    segments: Dict[str, List[Dict]] = {name: [] for name in MODELS}
    ratios: List[float] = []
    steps = [(index, name, start, end) for index, (start, end) in enumerate(bounds) for name in MODELS]
    for step, (index, name, start, end) in enumerate(steps):
        subdir, arch_args = MODELS[name]
        remaining = sum(eta.segment(n, e - s) for _, n, s, e in steps[step:]) + eta.after_training()
        stage_eta(f"train {name} segment {index + 1}/{rounds}: updates {start} -> {end}",
                  eta.segment(name, end - start), remaining)
        result = train_segment(data_bin, out / subdir, arch_args, args.seed, start, end, log_interval,
                               f"train-{index + 1}of{rounds}.log")
        eta.measured(name, end - start, result["seconds"], result["startup_seconds"])
        segments[name].append(result)
        stage(f"  {name} {start} -> {end}: {result['seconds']:.0f} s (start-up {result['startup_seconds']:.0f} s), "
              f"{result['words_per_second']:,.0f} words/s, loss {result['loss']:.2f}")
        if name == "SDMA-T":  # the round is complete: both models ran back to back
            ratios.append(result["words_per_second"] / segments["V-T"][-1]["words_per_second"])
            stage(f"  round {index + 1}/{rounds}: words/s SDMA-T / V-T = {ratios[-1]:.3f}")

    from experiments.bleu_bootstrap import paired_bootstrap, sentence_statistics
    from user_dir.tools.sdma.redundancy import attention_redundancy

    ratio = ratio_stats(ratios)
    rows = []
    results = {
        "updates": updates, "minutes": None if args.updates_given else args.minutes, "segments": rounds,
        "log_interval": log_interval,
        "segment_bounds": bounds, "data": str(data_bin), "idle_minutes_estimate": idle / 60,
        "load_probe_seconds": probe_seconds, "load_factor": load, "planned_minutes": planned / 60,
        "train_words_per_second_ratio": ratio,
        "segment_runs": [{"round": i + 1, "model": name, **{k: v for k, v in seg.items() if k != "log"}}
                         for i in range(rounds) for name in MODELS for seg in [segments[name][i]]],
    }
    post_done = 0.0
    sentence_stats, valid_bits = {}, {}
    for name, (subdir, _) in MODELS.items():
        ckpt = out / subdir / "checkpoint_last.pt"
        stage_eta(f"decode: fairseq-generate {name} (beam 5) + sacreBLEU", eta.fixed("decode"),
                  eta.after_training() - post_done)
        gen = generate(data_bin, ckpt, out / subdir, extra=["--max-len-a", "0", "--max-len-b", args.gen_max_len])
        bleu = sacrebleu_score(gen["hypotheses"], references).score
        sentence_stats[name] = [sentence_statistics(gen["hypotheses"], references)]
        valid_bits[name] = valid_metric(segments[name][-1]["log"], "nll_loss")
        post_done += eta.fixed("decode")
        stage_eta(f"analysis: attention redundancy of {name}", eta.fixed("analysis"),
                  eta.after_training() - post_done)
        post_done += eta.fixed("analysis")
        redundancy = attention_redundancy(str(ckpt), data=str(data_bin), subset="test")
        row = {
            "model": name,
            "BLEU": bleu,
            "LR enc": redundancy["encoder_self"]["LR"],
            "HR enc": redundancy["encoder_self"]["HR"],
            "LR dec": redundancy["decoder_self"]["LR"],
            "HR dec": redundancy["decoder_self"]["HR"],
            "LR cross": redundancy["decoder_cross"]["LR"],
            "HR cross": redundancy["decoder_cross"]["HR"],
            "train words/s": pooled_words_per_second(segments[name]),
            "params": model_parameters(segments[name][0]["log"]),
        }
        rows.append(row)
        results[name] = {
            **row, "redundancy": redundancy, "generate_sentences_per_second": gen["sentences_per_second"],
            "train_seconds": sum(s["seconds"] for s in segments[name]),
            "train_words_per_second_segments": [s["words_per_second"] for s in segments[name]],
            "sample_translations": gen["hypotheses"][:5], "valid_nll_bits": valid_bits[name],
        }
    paired = paired_bootstrap(sentence_stats, 1000, seed=1, comparisons=[("SDMA-T", "V-T")])
    results["bleu_bootstrap"] = paired

    stage_eta("figure: clustering probabilities, semantic mask and attention (Fig. 6 style)", eta.fixed("figure"),
              eta.fixed("figure"))
    figure = out / "fig6_sdma.png"
    run_streaming([console_script("sdma-plot"), "--path",
                   out / "sdma" / "checkpoint_last.pt", data_bin, "--subset", "test", "--index", "0",
                   "--layer", "-1", "--head", "0", "--vanilla-path", out / "vanilla" / "checkpoint_last.pt",
                   "--out", figure], out / "figure.log")
    results["figure"] = str(figure)
    results["wall_minutes"] = (time.time() - began) / 60
    print_table(rows, list(rows[0].keys()),
                f"SDMA quickstart: Ding de->en, {updates} updates each, test set of {len(references)} pairs")
    for name in MODELS:
        print(f"{name:6s} words/s per segment: "
              + ", ".join(f"{s['words_per_second']:,.0f}" for s in segments[name]))
    print(f"SDMA-T / V-T words/s over {rounds} interleaved rounds: min {ratio['min']:.3f}, "
          f"median {ratio['median']:.3f}, max {ratio['max']:.3f}", flush=True)
    print("\n".join(summary_lines(paired, valid_bits, updates)) + "\n", flush=True)
    write_json(out / "results.json", results)
    stage(f"wrote {out / 'results.json'} and {figure}; {results['wall_minutes']:.1f} min (planned "
          f"{planned / 60:.1f} at the measured load {load:.2f}x; {idle / 60:.1f} on an idle machine)")


if __name__ == "__main__":
    raise SystemExit(main())
