"""Training-update timing of V-T, SMA-T and SDMA-T, interleaved (part of ``make bench``).

``fairseq-train`` words/s on a shared 2-core machine drifts by 10-20% between runs, more than the
difference being measured. This measure removes what is not the model: the three models are
built by fairseq (``flops.build_translation_model``: the registered architecture, criterion
``sdma_label_smoothed_cross_entropy``) and trained on one fixed batch, and the
models take turns: each *round* times ``updates_per_round`` updates of every model in turn
(criterion forward incl. the SDMA regularisers, backward, Adam step). Per round and model:
wall-clock and process CPU time (``time.process_time``, all threads) per update; the speed
ratio to V-T is taken within each round (so drift between rounds cancels) and reported as
min / median / max over the rounds, with a 95% confidence interval of that median (percentile bootstrap over the
rounds, ``scipy.stats.bootstrap``, 2,000 resamples) and the ratio of the two models' fastest rounds (the least
disturbed of each: on a shared machine the per-round ratios move by +-0.2, so a median of 7 rounds is uncertain by
several hundredths, and the interval says by how much). The FLOPs of one update on the same batch
(``torch.utils.flop_counter``, matrix products only, see ``flops.py``) are counted alongside, so
the time ratio can be read against the arithmetic ratio, and so is the rest of the update
(``benchmarks.op_counts.count_traffic``: the ATen ops that are not matrix products or views, and the bytes they
read and write), the memory traffic and per-op overhead that the FLOPs bound does not see.

One process or one per model (``--isolated``). In one process the models share glibc's heap, and what one model
freed decides whether the next one's large tensors get memory that is already mapped or fresh pages from the kernel
(a minor page fault per 4 KiB, zero-filled). The same op then takes very different times in different models: on
this project's 2-core machine the log_softmax over the [3600, 2000] output logits took 7 ms in SDMA-T's update
and 74 ms in V-T's, in the same process and round. ``--isolated`` gives each model a process of its own (spawned,
driven over a pipe, one at a time, so rounds still interleave and one model computes at any moment); the minor page
faults per update are reported in both modes, so the table shows which models paid for fresh memory. ``make bench``
keeps one process.

The batch mirrors the quickstart data that ``fairseq-train`` sees in the benchmark:
``sentences`` sentences of ``tokens`` tokens (EOS included) on both sides, no padding,
dictionaries of ``vocab`` entries (shared embeddings).

Alone (without the rest of ``make bench``), one reading at a time:

    python -m benchmarks.sdma.step_timing --configs tiny,tiny2x2 --reading paper [--rounds 7] [--threads 1] \
        [--updates-per-round 3] [--isolated] [--json timing.json]

``--threads`` sets torch's CPU threads (default: torch's, as in ``make bench``); on a machine shared with
other work one thread gives steadier ratios (a descheduled second thread stalls every parallel op).
"""

import argparse
import multiprocessing
import os
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Dict, Sequence

import torch

from benchmarks.op_counts import count_flops, count_traffic
from latent_core.sdma import READINGS

from benchmarks.sdma.flops import FlopsSetting, build_with_batch

# configuration -> (architecture, extra fairseq options)
STEP_CONFIGS = {
    "tiny": ("sdma_transformer_iwslt_de_en_tiny", []),  # Table I tiny: 256/512, 6+6 layers, 4 heads
    "tiny2x2": ("sdma_transformer_iwslt_de_en_tiny", ["--encoder-layers", "2", "--decoder-layers", "2"]),
    "base": ("sdma_transformer_iwslt_de_en", []),
}
MODELS = {"V-T": "none", "SMA-T": "sma", "SDMA-T": "sdma"}


@dataclass(frozen=True)
class StepSetting:
    sentences: int = 300
    tokens: int = 12
    vocab: int = 2000
    rounds: int = 7
    updates_per_round: int = 3
    seed: int = 1
    reading: str = "authors"  # --sdma-reading of SMA-T and SDMA-T

    def validate(self) -> "StepSetting":
        for name in ("sentences", "rounds", "updates_per_round"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.tokens < 2:
            raise ValueError(f"tokens={self.tokens} must be >= 2 (a word and EOS)")
        if self.reading not in READINGS:
            raise ValueError(f"reading={self.reading!r}: one of {', '.join(READINGS)}")
        return self


def build_for_updates(config: str, mode: str, setting: StepSetting, device: str = "cpu", kernel: str = "auto"):
    """(model in training mode, criterion, Adam, the fixed batch), all on ``device``; ``kernel``: the
    ``--sdma-attention-kernel``."""
    arch, extra = STEP_CONFIGS[config]
    extra = [*extra, "--sdma-attention-kernel", kernel]
    flops_setting = FlopsSetting(src_vocab=setting.vocab, tgt_vocab=setting.vocab, sentences=setting.sentences,
                                 src_tokens=setting.tokens, tgt_tokens=setting.tokens, seed=setting.seed)
    model, criterion, sample = build_with_batch(arch, mode, flops_setting,
                                                ["--share-all-embeddings", "--sdma-reading", setting.reading, *extra],
                                                device=device)
    model.train()
    return model, criterion, torch.optim.Adam(model.parameters(), lr=1e-4), sample


def forward_backward(model, criterion, sample) -> None:
    loss, _, _ = criterion(model, sample)
    loss.backward()


def training_update(model, criterion, optimizer, sample) -> None:
    forward_backward(model, criterion, sample)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _count_and_warm_up(model, criterion, optimizer, sample) -> Dict:
    """FLOPs and elementwise traffic of one update (two counted updates), then one warm-up update, outside the
    timed rounds."""
    def update():
        training_update(model, criterion, optimizer, sample)

    flops = count_flops(update)[0]
    traffic = count_traffic(update)
    update()
    return {"flops": flops, "traffic": traffic, "params": sum(p.numel() for p in model.parameters()),
            "process_id": os.getpid()}


def _timed_updates(model, criterion, optimizer, sample, updates: int) -> Dict:
    """Wall-clock and process CPU ms per update, and minor page faults per update, of ``updates`` updates."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(updates):
        training_update(model, criterion, optimizer, sample)
    return {"wall_ms": 1000 * (time.perf_counter() - start_wall) / updates,
            "cpu_ms": 1000 * (time.process_time() - start_cpu) / updates,
            "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / updates}


class _SharedProcess:
    """Every model built in this process (the allocator's heap shared between them)."""

    def __init__(self, config: str, setting: StepSetting, models: Sequence[str]):
        self.built = {name: build_for_updates(config, MODELS[name], setting) for name in models}
        self.counts = {name: _count_and_warm_up(*built) for name, built in self.built.items()}

    def run(self, name: str, updates: int) -> Dict:
        return _timed_updates(*self.built[name], updates)

    def close(self) -> None:
        pass


def _worker(connection, config: str, name: str, setting: StepSetting, threads: int) -> None:
    """One model's process: build, count, warm up, then time ``updates`` updates per request until told to stop."""
    try:
        torch.set_num_threads(threads)
        built = build_for_updates(config, MODELS[name], setting)
        connection.send(("ready", _count_and_warm_up(*built)))
        while True:
            updates = connection.recv()
            if updates is None:
                return
            connection.send(("timed", _timed_updates(*built, updates)))
    except Exception as error:  # the parent names the model and re-raises
        connection.send(("error", f"{type(error).__name__}: {error}"))


class _IsolatedProcesses:
    """A process per model (spawned, torch's threads as in this process), driven one at a time over a pipe, so the
    rounds still interleave and only one model computes at any moment."""

    def __init__(self, config: str, setting: StepSetting, models: Sequence[str]):
        context = multiprocessing.get_context("spawn")
        self.workers = {}
        try:
            for name in models:
                parent, child = context.Pipe()
                process = context.Process(target=_worker, args=(child, config, name, setting,
                                                                torch.get_num_threads()), daemon=True)
                process.start()
                child.close()
                self.workers[name] = (process, parent)
            self.counts = {name: self._receive(name, "ready") for name in models}
        except BaseException:
            self.close()
            raise

    def _receive(self, name: str, expected: str):
        process, connection = self.workers[name]
        try:
            kind, value = connection.recv()
        except EOFError:
            process.join(timeout=5)
            raise RuntimeError(f"the update-timing process of {name} ended (exit code {process.exitcode}) "
                               f"before it answered") from None
        if kind == "error":
            raise RuntimeError(f"the update-timing process of {name} failed: {value}")
        assert kind == expected, (kind, expected)
        return value

    def run(self, name: str, updates: int) -> Dict:
        process, connection = self.workers[name]
        try:
            connection.send(updates)
        except (BrokenPipeError, OSError):
            process.join(timeout=5)
            raise RuntimeError(f"the update-timing process of {name} ended (exit code {process.exitcode})") from None
        return self._receive(name, "timed")

    def close(self) -> None:
        for process, connection in self.workers.values():
            try:
                connection.send(None)
            except (BrokenPipeError, OSError):
                pass
        for process, connection in self.workers.values():
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
            connection.close()


def time_updates(config: str, setting: StepSetting = StepSetting(),
                 models: Sequence[str] = tuple(MODELS), isolated: bool = False) -> Dict:
    """Interleaved update timing of ``models`` at ``config``; ratios to V-T per round.

    ``isolated``: each model in a process of its own instead of all in this one (see the module docstring: a model's
    elementwise ops can take several times as long beside the other models' heap as alone).

    Returns ``{"setting": ..., "isolated": ..., "models": {name: {"wall_ms": [...], "cpu_ms": [...],
    "faults_per_update": [...], "speed_ratio": {"min", "median", "max", "median_ci95"}, "cpu_ratio": {...},
    "fastest_ratio", "flops_per_update", "flops_ratio", "elementwise_ops", "elementwise_bytes",
    "elementwise_bytes_ratio", "elementwise_ops_ratio", "params", "process_id"}}}`` (speed ratios: V-T time / model
    time, > 1 is faster; FLOPs and elementwise ratios: model / V-T; faults: minor page faults of the model's process).
    """
    setting = setting.validate()
    if config not in STEP_CONFIGS:
        raise ValueError(f"unknown configuration {config!r}: one of {', '.join(STEP_CONFIGS)}")
    unknown = [name for name in models if name not in MODELS]
    if unknown or not models:
        raise ValueError(f"models={list(models)!r}: name one or more of {', '.join(MODELS)}")
    processes = (_IsolatedProcesses if isolated else _SharedProcess)(config, setting, models)
    try:
        timed = {name: [] for name in models}
        for _ in range(setting.rounds):
            for name in models:
                timed[name].append(processes.run(name, setting.updates_per_round))
    finally:
        processes.close()
    wall = {name: [t["wall_ms"] for t in timed[name]] for name in models}
    cpu = {name: [t["cpu_ms"] for t in timed[name]] for name in models}
    counts = processes.counts
    base = "V-T" if "V-T" in models else models[0]
    result = {}
    for name in models:
        flops, traffic = counts[name]["flops"], counts[name]["traffic"]
        result[name] = {
            "wall_ms": wall[name],
            "cpu_ms": cpu[name],
            "faults_per_update": [t["faults"] for t in timed[name]],
            "speed_ratio": _spread([b / t for b, t in zip(wall[base], wall[name])]),
            "fastest_ratio": min(wall[base]) / min(wall[name]),
            "cpu_ratio": _spread([b / t for b, t in zip(cpu[base], cpu[name])]),
            "flops_per_update": flops,
            "flops_ratio": flops / counts[base]["flops"],
            "elementwise_ops": traffic["ops"],
            "elementwise_bytes": traffic["bytes"],
            "elementwise_bytes_ratio": traffic["bytes"] / counts[base]["traffic"]["bytes"],
            "elementwise_ops_ratio": traffic["ops"] / counts[base]["traffic"]["ops"],
            "params": counts[name]["params"],
            "process_id": counts[name]["process_id"],
        }
    return {"config": config, "arch": STEP_CONFIGS[config][0], "extra_args": STEP_CONFIGS[config][1],
            "setting": setting.__dict__, "threads": torch.get_num_threads(), "isolated": isolated,
            "models": result}


def _spread(values):
    """min / median / max of per-round ratios, and ``median_ci95``: the median's 95% percentile-bootstrap interval
    over the rounds (None under 3 rounds; a single value when every round agrees)."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "median_ci95": median_interval(values)}


def median_interval(values, confidence: float = 0.95, resamples: int = 2000, seed: int = 0):
    """The ``confidence`` interval of the median of ``values`` (percentile bootstrap, seeded: the same timings give
    the same interval), ``[low, high]``; None with fewer than 3 values."""
    if len(values) < 3:
        return None
    if min(values) == max(values):
        return [values[0], values[0]]
    import numpy as np
    from scipy.stats import bootstrap

    result = bootstrap((np.asarray(values, dtype=float),), np.median, confidence_level=confidence,
                       n_resamples=resamples, method="percentile", rng=np.random.default_rng(seed))
    return [float(result.confidence_interval.low), float(result.confidence_interval.high)]


def _interval_text(interval) -> str:
    if interval is None:
        return "-"
    return f"{interval[0]:.3f}-{interval[1]:.3f}"


def table_rows(timing: Dict):
    rows = []
    for name, r in timing["models"].items():
        rows.append({
            "config": timing["config"],
            "reading": timing["setting"]["reading"],
            "model": name,
            "ms/update (median)": statistics.median(r["wall_ms"]),
            "speed vs V-T min": r["speed_ratio"]["min"],
            "median": r["speed_ratio"]["median"],
            "max": r["speed_ratio"]["max"],
            "median 95% CI": _interval_text(r["speed_ratio"]["median_ci95"]),
            "fastest-round ratio": r["fastest_ratio"],
            "CPU ms/update": statistics.median(r["cpu_ms"]),
            "CPU ratio (median)": r["cpu_ratio"]["median"],
            "page faults/update (median)": statistics.median(r["faults_per_update"]),
            "FLOPs bound (V-T FLOPs / model FLOPs)": 1.0 / r["flops_ratio"],
            "elementwise MB": r["elementwise_bytes"] / 1e6,
            "traffic bound (V-T MB / model MB)": 1.0 / r["elementwise_bytes_ratio"],
            "elementwise ops": r["elementwise_ops"],
        })
    return rows


def _at_least_one(text: str) -> int:
    """argparse type of ``--rounds`` and ``--updates-per-round``: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="tiny,tiny2x2", help=f"comma-separated, of {', '.join(STEP_CONFIGS)}")
    p.add_argument("--reading", choices=READINGS, default=StepSetting.reading)
    p.add_argument("--rounds", type=_at_least_one, default=StepSetting.rounds)
    p.add_argument("--updates-per-round", type=_at_least_one, default=StepSetting.updates_per_round,
                   help="updates of each model per round (1: the finest interleaving)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--isolated", action="store_true",
                   help="each model in a process of its own (default: all three in this process)")
    p.add_argument("--json", default=None,
                   help="also write every configuration's timing (per-round times, ratios, intervals) to this file")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    for config in configs:
        if config not in STEP_CONFIGS:
            p.error(f"--configs: unknown configuration {config!r} (one of {', '.join(STEP_CONFIGS)})")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from pipelines.runs import print_table, write_json

    setting = StepSetting(rounds=args.rounds, updates_per_round=args.updates_per_round, reading=args.reading)
    timings = {}
    for config in configs:
        timings[config] = time_updates(config, setting, isolated=args.isolated)
        rows = table_rows(timings[config])
        where = "a process per model" if args.isolated else "one process"
        print_table(rows, list(rows[0].keys()), f"update timing, {config}, {args.reading} reading, "
                                                f"{torch.get_num_threads()} threads, {where} "
                                                f"(ratios: V-T time / model time)")
    if args.json:
        write_json(args.json, timings, announce=True)


if __name__ == "__main__":
    main()
