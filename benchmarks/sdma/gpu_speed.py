"""V-T vs SMA-T vs SDMA-T speed on a lent GPU, per attention kernel and sentence length, in one bounded command
(``make gpu-speed``; ``scripts/gpu_check_offline.sh run --steps gpu_speed`` on a machine without a package index).

Models: V-T (``--sdma-mode none``, once per regime), and SMA-T (``sma``) and SDMA-T (``sdma``) for each kernel of
``--kernels`` (``--sdma-attention-kernel``, default ``auto triton``), at ``--config`` (default ``base``), ``--fp16``,
the ``authors`` reading, ``--updates`` updates each (default 300), on two regimes (``--regimes``):

* ``ding``: the Ding German-English pairs of the demo and ``sdma-bench`` (``pipelines.data.ding.prepare_fairseq_data``: at most 10
  words a side, joint sentencepiece 2,000; the test split is the ``--decode-sentences`` pairs, so training gets the
  rest of sdma-bench's 1,000), about 12 tokens a sentence: many short sentences, the launch-bound extreme;
* ``iwslt_like``: ``pipelines.data.synthetic_parallel``: random tokens of 6,000 types, IWSLT'14 sentence lengths
  (5-60 tokens, mean about 27, both sides), one epoch of at least ``--updates`` batches.

Per model and regime, in separate processes, each with its own deadline:

1. **training** (``fairseq-train``, the arguments of ``sdma-bench``, no checkpoint written): words/s at the median
   logged interval after the first (``pipelines.runs.train_inner_intervals``, as ``sdma-bench``'s
   ``train_wps_median_interval``), and the peak of PyTorch's CUDA allocator (``benchmarks.peak_rss``'s
   ``PEAK_CUDA_MB``; peak resident memory with ``--cpu``);
2. **profile** (one process per regime, the models in turn): fairseq's ``Trainer`` built from the training run's own
   arguments (its ``--fp16`` optimizer, its batches), 3 warm-up updates, then the median of 5 updates timed by the
   host with the device synchronised (``host_ms_per_update``), the ATen ops that launch a kernel in one update
   (``benchmarks.op_counts.count_launches``, as ``profile_update``), and one update under ``torch.profiler``: CUDA
   kernels launched and their summed run time, whose ratio to ``host_ms_per_update`` is the GPU busy fraction
   (``profile_update``'s definitions; well under 1: the GPU waits for the host). The model after its warm-up is
   saved as the checkpoint the decoding runs;
3. **decoding** (one process per regime): ``fairseq-generate``'s own ``main`` (beam 5, batches of 64, a fixed output
   length: 12 tokens on ``ding``, 27 on ``iwslt_like``, so every model does the same work whatever its weights)
   on ``--decode-sentences`` test sentences: a warm-up round over all models, then ``--decode-rounds`` rounds
   interleaved (V-T, SMA-T, SDMA-T, V-T, ...) so that no model gets the cold GPU; fairseq's sentences/s, the median
   per model. In one process, so that the rounds do not pay Python's and CUDA's start-up each.

Ratios are to V-T of the same regime in the same command. Writes ``--out`` (JSON: device, torch, triton and CUDA
versions, every run's status, deadline, seconds and log, every raw number, the table's rows) and prints the table.
Exit status 0 when every run ended ok, timed out or was not started for lack of time; 1 when one failed.

**Deadlines and the budget.** The command stops itself after ``--total-timeout`` seconds (default 480: 8 of a
15-minute lease, the rest for the machine's start and ``gpu_check_offline.sh``'s install). Each run gets a deadline:
without ``--run-timeout``, its equal share of what is left, (total - elapsed) / runs not yet started, so no run gets
less than total / runs (the plan's runs times that share is the total), what a quick run leaves goes to the runs
after it, and the runs together cannot take longer than the total; a ``--run-timeout`` is cut to what is left. Over
its deadline a run's process group gets SIGINT (fairseq-train then still reports its peak memory), 5 s later
SIGKILL; the run is recorded ``timed_out`` and the next one starts. A stopped training run still has the words/s of
the intervals it logged (``updates_reached`` says how far it got); a stopped profile or decoding run keeps the
models it finished. With the defaults:

    runs  = 2 regimes x (1 data + 1 V-T + 2 kernels x 2 models + 1 profile + 1 decoding) = 16 (10 training runs)
    share = 480 s / 16 = 30 s at least per run; 16 x 30 s = 480 s = the total

Against the last measurement (H200, ``sdma-bench --gpu --fp16 --config base``, the eager kernels, 200 updates on
``ding``: 43-54 s a run; at the median interval V-T 70,204 words/s, SMA-T 19,745, SDMA-T 18,038, i.e. with about
3,000 target words a batch 45 ms and 150-170 ms an update, so start-up took about 20 s a run, 35 s for the first):
300 updates take V-T about 35 s and an eager SMA-T or SDMA-T about 65-70 s. The data runs leave time to the runs
after them, but at those speeds V-T may be stopped near its end and the eager SMA-T and SDMA-T runs after 100-200
updates (their words/s still measured over 10-20 intervals, their peak memory still reported); whether the
``triton`` kernel's runs finish is part of what the command measures. ``--regimes ding`` (8 runs, 60 s each at
least) or ``--kernels triton`` (12 runs, 40 s) give each run more.

    python -m benchmarks.sdma.gpu_speed                                   # what make gpu-speed runs
    python -m benchmarks.sdma.gpu_speed --regimes ding --kernels triton --run-timeout 90
    python -m benchmarks.sdma.gpu_speed --run-timeout 120 'ding/train/SDMA-T/*=60'   # per-run deadlines
    python -m benchmarks.sdma.gpu_speed --cpu --config tiny2x2 --kernels explicit --regimes iwslt_like
"""

import argparse
import fnmatch
import json
import logging
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from latent_core.sdma.options import ATTENTION_KERNELS
from pipelines.data.synthetic_parallel import sentences_for_updates
from pipelines.runs import (USER_DIR, console_script, last_num_updates, model_parameters, print_table,
                            train_inner_intervals, train_words_per_second, write_json)
from benchmarks.sdma.step_timing import MODELS, STEP_CONFIGS

# step_timing's configurations (architecture, extra options), and one small enough for the --cpu test
CONFIGS = {**STEP_CONFIGS, "micro": ("sdma_transformer_iwslt_de_en_tiny", [
    "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128"])}
REGIMES = {
    "ding": "Ding de-en pairs of the demo and sdma-bench, about 12 tokens a sentence",
    "iwslt_like": "synthetic, IWSLT'14 lengths (5-60 tokens, mean about 27), 6,000 types",
}
DECODE_LENGTH = {"ding": 12, "iwslt_like": 27}  # tokens per hypothesis: the regime's mean sentence length
READING = "authors"
SYNTHETIC_VOCAB = 6000
STOP_GRACE_SECONDS = 5.0  # SIGINT to SIGKILL: fairseq-train's peak-memory report on the way out
MIN_RUN_SECONDS = 5.0  # with less left in the total, a run is not started
GPU_DEFAULTS = {"config": "base", "updates": 300, "kernels": ["auto", "triton"], "total_timeout": 480.0,
                "decode_sentences": 150}
CPU_DEFAULTS = {"config": "tiny", "updates": 6, "kernels": ["auto"], "total_timeout": 1800.0,
                "decode_sentences": 20}
# the profile run's updates per model: warm-up (the first builds the optimizer and, on a GPU, its kernels), then
# timed by the host
PROFILE_UPDATES = {"gpu": (3, 5), "cpu": (1, 3)}
COLUMNS = {  # row key -> printed header
    "regime": "regime", "model": "model", "status": "status", "train_wps": "train words/s",
    "train_wps_vs_vt": "wps vs V-T", "peak_mem_mb": "peak MB", "peak_mem_vs_vt": "mem vs V-T",
    "host_ms_per_update": "host ms/update", "launches_per_update": "launches", "launches_vs_vt": "launches vs V-T",
    "cuda_kernels_per_update": "CUDA kernels", "gpu_busy_fraction": "GPU busy", "decode_sentences_per_second":
    "decode sent/s", "decode_vs_vt": "decode vs V-T",
}


@dataclass
class Variant:
    """One model of a regime: V-T, or SMA-T / SDMA-T with one attention kernel."""

    model: str
    kernel: Optional[str] = None

    @property
    def label(self) -> str:
        return self.model if self.kernel is None else f"{self.model}/{self.kernel}"


@dataclass
class Run:
    name: str  # e.g. ding/train/SDMA-T/triton
    kind: str  # data, train, profile, decode
    regime: str
    variant: Optional[Variant] = None
    status: str = "pending"  # then ok, failed, timed_out, skipped (what it needs failed), not_run
    result: Dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- plan and deadlines


def variants(kernels: Sequence[str]) -> List[Variant]:
    return [Variant("V-T")] + [Variant(model, kernel) for kernel in kernels for model in ("SMA-T", "SDMA-T")]


def plan_runs(regimes: Sequence[str], kernels: Sequence[str]) -> List[Run]:
    runs = []
    for regime in regimes:
        runs.append(Run(f"{regime}/data", "data", regime))
        runs += [Run(f"{regime}/train/{v.label}", "train", regime, v) for v in variants(kernels)]
        runs += [Run(f"{regime}/profile", "profile", regime), Run(f"{regime}/decode", "decode", regime)]
    return runs


def parse_run_timeouts(values: Sequence[str]) -> Dict[str, float]:
    """``--run-timeout`` entries -> {glob of run names: seconds}; a plain number is the glob ``*``."""
    timeouts = {}
    for value in values:
        pattern, _, seconds = value.rpartition("=")
        timeouts[pattern or "*"] = float(seconds)
        if not timeouts[pattern or "*"] > 0:
            raise ValueError(f"{value!r}: seconds must be > 0")
    return timeouts


def run_deadline(run: Run, seconds_left: float, runs_left: int, timeouts: Dict[str, float]) -> float:
    """The run's own ``--run-timeout`` (its last matching entry), else its equal share of what is left; never
    more than what is left."""
    chosen = [seconds for pattern, seconds in timeouts.items() if fnmatch.fnmatchcase(run.name, pattern)]
    share = chosen[-1] if chosen else seconds_left / max(runs_left, 1)
    return max(0.0, min(share, seconds_left))


def run_with_deadline(cmd: Sequence, log: Path, deadline: float) -> Dict:
    """Run ``cmd`` in its own process group, output to ``log``; over ``deadline`` seconds the group gets SIGINT,
    then SIGKILL after a grace. Returns ``status`` (ok, failed, timed_out), ``returncode``, ``seconds``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    grace = min(STOP_GRACE_SECONDS, deadline / 5)
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(deadline - grace, 0.01))
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=max(grace, 0.01))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        if timed_out:
            _signal_group(proc.pid, signal.SIGKILL)  # what the interrupted process left behind (loader workers)
            out.write(f"\n[gpu-speed] stopped after {time.monotonic() - start:.1f} s (deadline {deadline:.1f} s)\n")
    status = "timed_out" if timed_out else ("ok" if proc.returncode == 0 else "failed")
    return {"status": status, "returncode": proc.returncode, "seconds": time.monotonic() - start,
            "deadline_s": deadline, "log": str(log)}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


# ----------------------------------------------------------------------------- what each run runs


def training_arguments(data_bin: Path, args, variant: Variant, save_dir: Path) -> List[str]:
    """``fairseq-train``'s arguments for one model: ``sdma-bench``'s, plus the kernel; nothing saved."""
    arch, extra = CONFIGS[args.config]
    kernel = ["--sdma-attention-kernel", variant.kernel] if variant.kernel else []
    return [str(data_bin), "--user-dir", str(USER_DIR), "--task", "translation", "--arch", arch, *extra,
            "--sdma-mode", MODELS[variant.model], "--sdma-reading", READING, *kernel, "--share-all-embeddings",
            "--criterion", "sdma_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--optimizer", "adam", "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
            "--max-tokens", str(args.max_tokens), "--max-update", str(args.updates), "--seed", "1",
            "--log-interval", str(log_interval(args.updates)), "--log-format", "simple", "--no-progress-bar",
            "--disable-validation", "--save-dir", str(save_dir), "--no-save", "--no-save-optimizer-state",
            *(["--cpu"] if args.cpu else ["--fp16"])]


def log_interval(updates: int) -> int:
    """sdma-bench's 10 updates per logged interval, fewer for a short run (so that it logs several)."""
    return max(1, min(10, updates // 10))


def training_result(log_text: str, cpu: bool) -> Dict:
    intervals = train_inner_intervals(log_text)
    timed = intervals[1:]  # the first interval holds the first updates after start-up
    peak = re.search(rf"{'PEAK_RSS_MB' if cpu else 'PEAK_CUDA_MB'}=([0-9.]+)", log_text)
    return {
        "train_wps": statistics.median(i["wps"] for i in timed) if timed else float("nan"),
        "train_wps_mean": train_words_per_second(log_text) if timed else float("nan"),
        "intervals": len(timed),
        "interval_wps": [i["wps"] for i in intervals],
        "updates_reached": last_num_updates(log_text),
        "peak_mem_mb": float(peak.group(1)) if peak else float("nan"),
        "params": model_parameters(log_text),
    }


def data_dir(work: Path, regime: str, args) -> Path:
    if regime == "ding":  # prepare_fairseq_data reuses a finished directory whatever its sizes: the size is in the name
        return work / "data" / f"ding_test{args.decode_sentences}"
    return work / "data" / f"iwslt_like_{args.updates}x{args.max_tokens}_test{args.decode_sentences}"


def data_workers() -> int:
    return min(8, os.cpu_count() or 1)


def checkpoint_path(work: Path, regime: str, variant: Variant) -> Path:
    return work / regime / "checkpoints" / f"{variant.label.replace('/', '_')}.pt"


def read_records(path: Path) -> List[Dict]:
    """The JSON lines a profile or decoding run wrote before it ended (or was stopped)."""
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written when the run was stopped
            pass
    return lines


def append_record(path: Path, record: Dict) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------------------- the child processes


def data_child(spec: Dict) -> int:
    """The Ding pairs of the demo and sdma-bench, with a test split of ``decode_sentences`` pairs."""
    from pipelines.data.ding import prepare_fairseq_data

    bin_dir = prepare_fairseq_data(Path(spec["out_dir"]), max_words=10, vocab_size=2000,
                                   test_size=spec["decode_sentences"])
    Path(spec["result"]).write_text(json.dumps({"data_bin": str(bin_dir)}))
    return 0


def profile_child(spec: Dict) -> int:
    """Profile each model of ``spec["models"]`` in turn, one JSON line each to ``spec["result"]``."""
    import torch

    for entry in spec["models"]:
        try:
            result = profile_training_update(entry["train_args"], Path(entry["checkpoint"]), spec["warmup"],
                                             spec["timed"])
        except Exception as error:  # one model's failure (a kernel that does not run here) is its own row's
            logging.exception("profile of %s failed", entry["label"])
            result = {"error": f"{type(error).__name__}: {error}"}
        append_record(Path(spec["result"]), {"label": entry["label"], **result})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the previous model's memory, before the next one is built
    return 0


def profile_training_update(train_args: Sequence[str], checkpoint: Path, warmup: int, timed: int) -> Dict:
    """fairseq's Trainer from ``fairseq-train`` arguments: ``warmup`` updates (then the model is saved to
    ``checkpoint``), ``timed`` updates on one batch timed by the host, one update's ATen launches, and on CUDA one
    update under the profiler (CUDA kernels and their GPU time)."""
    import gc

    import numpy as np
    import torch
    from fairseq import options, tasks, utils
    from fairseq.data import iterators
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.op_counts import count_launches

    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), input_args=list(train_args)))
    cfg.dataset.num_workers = 0  # the same batches, without a loader process whose shutdown waits 5 s
    np.random.seed(cfg.common.seed)
    utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    epoch_itr = trainer.get_train_iterator(epoch=1, load_dataset=True)
    trainer.begin_epoch(epoch_itr.epoch)

    def batches():
        while True:  # a small training set: the next epoch
            yield from iterators.GroupedIterator(epoch_itr.next_epoch_itr(shuffle=True), 1)

    source = batches()
    for _ in range(warmup):
        trainer.train_step(next(source))
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(str(checkpoint), {})
    cuda = trainer.device.type == "cuda"

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    samples = next(source)
    times = []
    for _ in range(timed):
        synchronize()
        start = time.perf_counter()
        trainer.train_step(samples)
        synchronize()
        times.append(1000 * (time.perf_counter() - start))
    result = {"host_ms_per_update": statistics.median(times), "host_ms": times,
              "launches_per_update": count_launches(lambda: trainer.train_step(samples))["launches"],
              "sentences": sum(s["nsentences"] for s in samples), "tokens": sum(s["ntokens"] for s in samples)}
    if cuda:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.train_step(samples)
            synchronize()
        kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        busy_ms = sum(e.self_device_time_total for e in kernels) / 1000
        result.update({"cuda_kernels_per_update": sum(e.count for e in kernels), "gpu_busy_ms": busy_ms,
                       "gpu_busy_fraction": busy_ms / result["host_ms_per_update"]})
    result["updates"] = trainer.get_num_updates()
    del trainer, model, task
    gc.collect()
    return result


def decode_child(spec: Dict) -> int:
    """A warm-up round over ``spec["models"]``, then ``spec["rounds"]`` interleaved rounds; one JSON line per
    decoding to ``spec["result"]``."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import generate

    translated = []

    class Translated(logging.Handler):
        def emit(self, record):
            match = re.search(r"Translated ([0-9,]+) sentences .*?\(([0-9.]+) sentences/s", record.getMessage())
            if match:
                translated.append((int(match.group(1).replace(",", "")), float(match.group(2))))

    generate_logger = logging.getLogger("fairseq_cli.generate")
    generate_logger.setLevel(logging.INFO)  # the "Translated ..." line, whatever the root logger's level
    generate_logger.addHandler(Translated())
    parser = options.get_generation_parser()
    parser.add_argument("--arch", "-a", default="wav2vec2")  # what fairseq-generate's cli_main adds
    # one configuration for every decoding, only --path differs: fairseq's conversion to it takes seconds
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, input_args=[
        *spec["generate_args"], "--path", spec["models"][0]["checkpoint"]]))
    for round_index in range(spec["rounds"] + 1):  # round 0: the warm-up
        for entry in spec["models"]:
            start, record = time.monotonic(), {"label": entry["label"], "round": round_index,
                                               "warmup": round_index == 0}
            cfg.common_eval.path = entry["checkpoint"]
            try:
                generate.main(cfg)
                sentences, per_second = translated[-1] if translated else (0, float("nan"))
                record.update({"sentences": sentences, "sentences_per_second": per_second})
            except Exception as error:
                logging.exception("decoding %s failed", entry["label"])
                record.update({"error": f"{type(error).__name__}: {error}", "sentences_per_second": float("nan")})
            translated.clear()
            append_record(Path(spec["result"]), {**record, "seconds": time.monotonic() - start})
    return 0


def generate_arguments(data_bin: Path, regime: str, cpu: bool) -> List[str]:
    length = str(DECODE_LENGTH[regime])
    # min = max length: every model decodes the same number of steps, whatever it learned (sdma-bench's setting)
    return [str(data_bin), "--user-dir", str(USER_DIR), "--gen-subset", "test", "--beam", "5", "--batch-size", "64",
            "--max-tokens", "4000", "--min-len", length, "--max-len-a", "0", "--max-len-b", length,
            "--required-batch-size-multiple", "1", "--seed", "1", "--quiet", "--num-workers", "0",
            *(["--cpu"] if cpu else ["--fp16"])]


CHILDREN = {"data": data_child, "profile": profile_child, "decode": decode_child}


# ----------------------------------------------------------------------------- the command


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("outputs") / "gpu" / "sdma_gpu_speed.json",
                   help="the JSON report (default %(default)s)")
    p.add_argument("--work-dir", type=Path, help="data, logs, checkpoints (default: OUT's folder / gpu_speed)")
    p.add_argument("--updates", type=int, help="training updates per model (default 300; --cpu: 6)")
    p.add_argument("--kernels", nargs="+", help="--sdma-attention-kernel values for SMA-T and SDMA-T "
                                                "(default: auto triton; --cpu: auto)")
    p.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=list(REGIMES),
                   help="; ".join(f"{name}: {what}" for name, what in REGIMES.items()) + " (default: both)")
    p.add_argument("--run-timeout", nargs="+", default=[], metavar="[RUN=]SECONDS",
                   help="deadline of every run (SECONDS) or of the runs whose name matches the glob RUN (e.g. "
                        "'ding/train/SDMA-T/*=60'; names: REGIME/data, REGIME/train/V-T, REGIME/train/MODEL/KERNEL, "
                        "REGIME/profile, REGIME/decode); default: each run's equal share of the time left")
    p.add_argument("--total-timeout", type=float, help="seconds for the whole command (default 480; --cpu: 1800)")
    p.add_argument("--config", help="base, tiny, tiny2x2 (step_timing's) or micro (1+1 layers, 64-d; for the --cpu "
                                    "test) (default base; --cpu: tiny)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per training batch (default 4096)")
    p.add_argument("--decode-sentences", type=int, help="test sentences decoded per round (default 150; --cpu: 20)")
    p.add_argument("--decode-rounds", type=int, default=3, help="interleaved decoding rounds after the warm-up")
    p.add_argument("--cpu", action="store_true", help="the whole command on the CPU, small (to test it): no --fp16, "
                                                      "no GPU columns")
    args = p.parse_args(argv)
    for key, value in (CPU_DEFAULTS if args.cpu else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.config not in CONFIGS:
        p.error(f"--config {args.config}: one of {', '.join(CONFIGS)}")
    unknown = [k for k in args.kernels if k not in ATTENTION_KERNELS]
    if unknown:
        p.error(f"--kernels: {', '.join(unknown)} not in --sdma-attention-kernel's choices "
                f"({', '.join(ATTENTION_KERNELS)})")
    if args.updates < 2:
        p.error("--updates must be >= 2 (the first logged interval is start-up)")
    if args.decode_sentences < 1 or args.decode_rounds < 1 or args.max_tokens < 1:
        p.error("--decode-sentences, --decode-rounds and --max-tokens must be >= 1")
    if not args.total_timeout > 0:
        p.error("--total-timeout must be > 0")
    try:
        args.run_timeouts = parse_run_timeouts(args.run_timeout)
    except ValueError as error:
        p.error(f"--run-timeout: {error}")
    args.kernels = list(dict.fromkeys(args.kernels))
    args.work_dir = args.work_dir or args.out.parent / "gpu_speed"
    return args


def execute(run: Run, args, work: Path, deadline: float, done: Dict[str, Run]) -> Dict:
    """Start ``run`` (its child process under ``deadline``) and return its result."""
    regime_dir = work / run.regime
    spec_path = regime_dir / "specs" / f"{run.name.replace('/', '_')}.json"
    result_path = spec_path.with_suffix(".result")
    result_path.unlink(missing_ok=True)
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    log = regime_dir / "logs" / f"{run.name.replace('/', '_')}.log"
    data_bin = Path(done[f"{run.regime}/data"].result.get("data_bin", "")) if run.kind != "data" else None
    if run.kind == "train":
        save_dir = regime_dir / "train" / run.variant.label.replace("/", "_")
        cmd = [sys.executable, "-m", "benchmarks.peak_rss", console_script("fairseq-train"),
               *training_arguments(data_bin, args, run.variant, save_dir)]
        outcome = run_with_deadline(cmd, log, deadline)
        return {**outcome, **training_result(log.read_text(errors="replace"), args.cpu)}
    if run.kind == "data" and run.regime == "iwslt_like":
        out_dir = data_dir(work, run.regime, args)
        outcome = run_with_deadline([
            sys.executable, "-m", "pipelines.data.synthetic_parallel", "--out-dir", out_dir, "--binarize",
            "--train-sentences", sentences_for_updates(args.updates, args.max_tokens),
            "--test-sentences", args.decode_sentences, "--vocab-size", SYNTHETIC_VOCAB, "--workers", data_workers(),
        ], log, deadline)
        return {**outcome, "data_bin": str(out_dir / "bin")}
    if run.kind == "data":
        spec = {"out_dir": str(data_dir(work, run.regime, args)), "decode_sentences": args.decode_sentences}
    elif run.kind == "profile":
        # a model whose training failed would fail here too
        trained = [r.variant for r in done.values() if r.regime == run.regime and r.kind == "train"
                   and r.status in ("ok", "timed_out")]
        if not trained:
            return {"status": "skipped", "reason": "no model trained"}
        warmup, timed = PROFILE_UPDATES["cpu" if args.cpu else "gpu"]
        spec = {"warmup": warmup, "timed": timed, "models": [
            {"label": v.label, "checkpoint": str(checkpoint_path(work, run.regime, v)),
             "train_args": training_arguments(data_bin, args, v, regime_dir / "profile")} for v in trained]}
        for entry in spec["models"]:
            Path(entry["checkpoint"]).unlink(missing_ok=True)
    else:
        models = [{"label": v.label, "checkpoint": str(checkpoint_path(work, run.regime, v))}
                  for v in variants(args.kernels) if checkpoint_path(work, run.regime, v).exists()]
        if not models:
            return {"status": "skipped", "reason": "no checkpoint: the profile run saved none"}
        spec = {"rounds": args.decode_rounds, "models": models,
                "generate_args": generate_arguments(data_bin, run.regime, args.cpu)}
    spec["result"] = str(result_path)
    spec_path.write_text(json.dumps(spec, indent=2))
    outcome = run_with_deadline([sys.executable, "-m", "benchmarks.sdma.gpu_speed", run.kind, spec_path], log,
                                deadline)
    if run.kind == "data":
        return {**outcome, **(json.loads(result_path.read_text()) if result_path.exists() else {})}
    return {**outcome, "records": read_records(result_path)}


def run_all(args, started: float) -> List[Run]:
    """Every planned run in order, each under its deadline, within ``--total-timeout`` of ``started``."""
    runs = plan_runs(args.regimes, args.kernels)
    done: Dict[str, Run] = {}
    for index, run in enumerate(runs):
        data = done.get(f"{run.regime}/data")
        if data is not None and data.status != "ok":
            run.status, run.result = "skipped", {"reason": f"{data.name} {data.status}"}
        else:
            seconds_left = args.total_timeout - (time.monotonic() - started)
            runs_left = sum(1 for r in runs[index:] if r.status == "pending")
            deadline = run_deadline(run, seconds_left, runs_left, args.run_timeouts)
            if seconds_left < MIN_RUN_SECONDS:
                run.status, run.result = "not_run", {"reason": "out of time (--total-timeout)"}
            else:
                print(f"[gpu-speed] {run.name}: deadline {deadline:.0f} s ({seconds_left:.0f} s left for "
                      f"{runs_left} runs)", flush=True)
                run.result = execute(run, args, args.work_dir, deadline, done)
                run.status = run.result.pop("status")
                print(f"[gpu-speed] {run.name}: {run.status} after {run.result.get('seconds', 0):.1f} s"
                      + _headline(run), flush=True)
        done[run.name] = run
    return runs


def _headline(run: Run) -> str:
    if run.kind == "train":
        return (f", {run.result['train_wps']:.0f} words/s over {run.result['intervals']} intervals, "
                f"{run.result['updates_reached']} updates")
    if run.status != "ok" and run.result.get("log"):
        tail = Path(run.result["log"]).read_text(errors="replace").strip().splitlines()[-3:]
        return "; log: " + " | ".join(line[-160:] for line in tail)
    return ""


def _ratio(value, base):
    if value is None or base is None or not (math.isfinite(value) and math.isfinite(base)) or base == 0:
        return None
    return value / base


def table_rows(runs: Sequence[Run]) -> List[Dict]:
    """One row per training run: its numbers, its profile and decoding, ratios to V-T of its regime."""
    profiles = {(r.regime, rec["label"]): rec for r in runs if r.kind == "profile"
                for rec in r.result.get("records", [])}
    decoded: Dict[tuple, List[float]] = {}
    for r in runs:
        if r.kind == "decode":
            for rec in r.result.get("records", []):
                if not rec["warmup"]:
                    decoded.setdefault((r.regime, rec["label"]), []).append(rec["sentences_per_second"])
    rows = []
    for r in runs:
        if r.kind != "train":
            continue
        profile = profiles.get((r.regime, r.variant.label), {})
        rounds = decoded.get((r.regime, r.variant.label))
        status = r.status if r.status != "timed_out" else f"timed_out ({r.result.get('updates_reached', 0)} updates)"
        rows.append({"regime": r.regime, "model": r.variant.label, "status": status,
                     "train_wps": r.result.get("train_wps"), "peak_mem_mb": r.result.get("peak_mem_mb"),
                     "host_ms_per_update": profile.get("host_ms_per_update"),
                     "launches_per_update": profile.get("launches_per_update"),
                     "cuda_kernels_per_update": profile.get("cuda_kernels_per_update"),
                     "gpu_busy_fraction": profile.get("gpu_busy_fraction"),
                     "decode_sentences_per_second": statistics.median(rounds) if rounds else None})
    for row in rows:
        base = next((b for b in rows if b["regime"] == row["regime"] and b["model"] == "V-T"), {})
        row["train_wps_vs_vt"] = _ratio(row["train_wps"], base.get("train_wps"))
        row["peak_mem_vs_vt"] = _ratio(row["peak_mem_mb"], base.get("peak_mem_mb"))
        row["launches_vs_vt"] = _ratio(row["launches_per_update"], base.get("launches_per_update"))
        row["decode_vs_vt"] = _ratio(row["decode_sentences_per_second"], base.get("decode_sentences_per_second"))
    return rows


def versions(cpu: bool) -> Dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": "cpu" if cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton_version, "cuda": torch.version.cuda, "python": sys.version.split()[0]}


def main(argv=None) -> int:
    started = time.monotonic()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in CHILDREN:  # a run of the command (data, profile, decode): SPEC.json
        return CHILDREN[argv[0]](json.loads(Path(argv[1]).read_text()))
    args = parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu-speed: no CUDA device is visible (--cpu runs the command on the CPU, small)")
    report = {**versions(args.cpu), "options": {key: (str(value) if isinstance(value, Path) else value)
                                                 for key, value in vars(args).items()}}
    print(f"[gpu-speed] {report['device']}, torch {report['torch']}, triton {report['triton']}; "
          f"{len(plan_runs(args.regimes, args.kernels))} runs within {args.total_timeout:.0f} s", flush=True)
    runs = run_all(args, started)
    rows = table_rows(runs)
    report.update({
        "seconds": time.monotonic() - started,
        "runs": [{"name": r.name, "kind": r.kind, "regime": r.regime, "model": r.variant.label if r.variant else None,
                  "status": r.status, **r.result} for r in runs],
        "rows": rows,
    })
    write_json(args.out, report)
    print(f"\n{'run':36} {'status':10} {'deadline s':>10} {'seconds':>8}")
    for r in runs:
        print(f"{r.name:36} {r.status:10} {r.result.get('deadline_s', 0):10.0f} {r.result.get('seconds', 0):8.1f}")
    print_table([{COLUMNS[key]: row[key] for key in COLUMNS} for row in rows], list(COLUMNS.values()),
                f"SDMA speed on {report['device']} ({args.config}, {args.updates} updates, "
                f"{'CPU' if args.cpu else 'fp16'}, {READING} reading; ratios to V-T of the same regime)")
    print(f"[gpu-speed] {report['seconds']:.0f} s; wrote {args.out}", flush=True)
    return 1 if any(r.status == "failed" for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
