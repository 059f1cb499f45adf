"""Where a training update of V-T, SMA-T and SDMA-T spends its time (``make gpu-check``'s ``profile`` step).

Each model is built by fairseq as in the update timing (``step_timing.py``: the registered
architecture, criterion ``sdma_label_smoothed_cross_entropy``, Adam, one fixed batch), warmed up,
then timed over ``--updates`` updates (wall clock, the device synchronised) and profiled over as
many more with ``torch.profiler``. Per model and update it reports:

* ``ms_per_update``: wall clock;
* ``launches``: kernel launches per update (``benchmarks.op_counts.count_launches``: ATen ops that run a
  kernel, plus generated kernels, ``triton_*``, counted as ``triton_kernels``), split into
  ``model_launches`` (criterion forward with the regularisers, and backward) and ``optimizer_launches``
  (the Adam step: per parameter on a CPU; a handful with fairseq's ``--fp16`` flat parameters or a
  multi-tensor Adam on a GPU, so ``model_launches`` is the ratio that carries over);
* ``aten_ops``: ATen ops that are not views (``benchmarks.op_counts.count_traffic``: elementwise
  ops plus matrix products);
* on CUDA, ``kernels`` (kernels launched) and ``gpu_busy_ms`` (the sum of their run times); their
  ratio to the wall clock, ``gpu_busy_fraction``, says whether the GPU waits for the CPU to launch
  work (well under 1: launch-bound, where fewer ops or fusion help) or computes (near 1);
* ``top_ops``: the ops with the most self time (device time on CUDA, CPU time otherwise).

Variants (``--models``): V-T, SMA-T and SDMA-T with the default attention kernel (``auto``: ``sdpa`` on CUDA, ``explicit``
on a CPU), and SMA-T and SDMA-T with the Triton kernels (``--sdma-attention-kernel triton``: ``SMA-T triton``, ``SDMA-T
triton``). All of them by default. On a CPU the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set
here before they are first imported): a Triton variant is then only counted, not timed (``interpreted``), each of its
kernels one launch (``triton_kernels``), on a 2-sentence batch (``count_batch``; the interpreter runs every program of
a grid in Python), with V-T counted on the same batch for its ratio (``vt_model_launches_same_batch``): launch counts
hardly depend on the batch (V-T tiny2x2: the same for 2 x 12 and 160 x 26 tokens, 419 against 422 for 2 and 4 x 5).

On a CPU the same code runs (no kernel columns), so the step is tested without a GPU.

    python -m benchmarks.sdma.profile_update --device cuda --config base --out outputs/gpu/sdma_profile.json
    python -m benchmarks.sdma.profile_update --device cpu --config base   # every variant's launches (minutes)
"""

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Dict, Sequence

import torch

# On a CPU the Triton variants run in Triton's interpreter. Triton reads the variable when triton.language is first
# imported, which torch.utils.flop_counter (through benchmarks.op_counts, below) already does: set it first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.op_counts import count_launches, count_traffic  # noqa: E402
from latent_core.profiling import source_range  # noqa: E402
from pipelines.runs import print_table, write_json
from latent_core.sdma import READINGS
from benchmarks.sdma.step_timing import (MODELS, STEP_CONFIGS, StepSetting, build_for_updates, forward_backward,
                                             training_update)

# variant -> (--sdma-mode, --sdma-attention-kernel)
VARIANTS = {**{name: (mode, "auto") for name, mode in MODELS.items()},
            "SMA-T triton": ("sma", "triton"), "SDMA-T triton": ("sdma", "triton")}
COUNT_SENTENCES = 2  # the batch an interpreted variant is counted on


# where a model's launches come from (latent_core.profiling.source_range): each attention module's forward is
# "attention" (its projections and layout), and inside it SDMA's steps name themselves
SOURCES = ("attention", "noise", "clustering", "mixture", "regularisers", "other")


def attention_modules(model) -> list:
    from fairseq.modules import MultiheadAttention

    return [m for m in model.modules() if isinstance(m, MultiheadAttention)]


@contextlib.contextmanager
def attention_sources(model):
    """Each attention module's forward inside a ``source::attention`` profiler range (module hooks)."""
    handles = []
    for module in attention_modules(model):
        open_ranges = []

        def enter(_module, _args, open_ranges=open_ranges):
            open_ranges.append(source_range("attention"))
            open_ranges[-1].__enter__()

        def leave(_module, _args, _out, open_ranges=open_ranges):
            open_ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def launches_by_source(model, criterion, sample) -> Dict:
    """One forward + backward's launches by source: ``{"total": {source: n}, "per_attention_module": {source: n / the
    number of attention modules}}`` (``other``, the rest of the model and the loss, only in total)."""
    model.zero_grad(set_to_none=True)  # as the other counts: backward writes fresh gradients, no accumulation
    with attention_sources(model):
        counted = count_launches(lambda: forward_backward(model, criterion, sample), by_source=True)
    modules = len(attention_modules(model))
    total = {source: counted["by_source"].get(source, 0) for source in SOURCES}
    return {"total": total, "modules": modules, "launches": counted["launches"], "triton_kernels": counted["inductor"],
            "per_attention_module": {s: n / modules for s, n in total.items() if s != "other"}}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interpreted(name: str, device: torch.device) -> bool:
    """Whether ``name``'s Triton kernels run in Triton's interpreter (a Triton variant on a CPU)."""
    return VARIANTS[name][1] == "triton" and device.type != "cuda"


def count_model(config: str, name: str, setting: StepSetting, device: torch.device) -> Dict:
    """The launches of one forward + backward of ``name`` on a ``COUNT_SENTENCES``-sentence batch, untimed (a
    Triton variant in the interpreter), and V-T's on the same batch for the ratio."""
    small = StepSetting(**{**setting.__dict__, "sentences": COUNT_SENTENCES})
    counts = {}
    for variant in ("V-T", name):
        mode, kernel = VARIANTS[variant]
        model, criterion, _, sample = build_for_updates(config, mode, small, str(device), kernel)
        forward_backward(model, criterion, sample)  # the first call: the interpreter rewrites the kernels
        model.zero_grad(set_to_none=True)
        if variant == name:  # one count in the interpreter: the launches by source add up to the total
            sources = launches_by_source(model, criterion, sample)
            counts[variant] = {"launches": sources["launches"], "inductor": sources["triton_kernels"]}
        else:
            counts[variant] = count_launches(lambda: forward_backward(model, criterion, sample))
    own = counts[name]
    return {"interpreted": True, "count_batch": [COUNT_SENTENCES, setting.tokens],
            "model_launches": own["launches"], "triton_kernels": own["inductor"],
            "vt_model_launches_same_batch": counts["V-T"]["launches"], "sources": sources,
            "model_launches_vs_vt": own["launches"] / counts["V-T"]["launches"],
            "params": sum(p.numel() for p in model.parameters())}


def profile_model(config: str, name: str, setting: StepSetting, device: torch.device, updates: int,
                  warmup: int, top: int = 12) -> Dict:
    """One model's numbers (see the module docstring)."""
    if interpreted(name, device):
        return count_model(config, name, setting, device)
    mode, kernel = VARIANTS[name]
    model, criterion, optimizer, sample = build_for_updates(config, mode, setting, str(device), kernel)
    for _ in range(warmup):
        training_update(model, criterion, optimizer, sample)
    _synchronize(device)
    model_launches = count_launches(lambda: forward_backward(model, criterion, sample))
    sources = launches_by_source(model, criterion, sample)
    optimizer_launches = count_launches(optimizer.step)
    optimizer.zero_grad(set_to_none=True)
    traffic = count_traffic(lambda: training_update(model, criterion, optimizer, sample))
    _synchronize(device)
    times = []
    for _ in range(updates):
        start = time.perf_counter()
        training_update(model, criterion, optimizer, sample)
        _synchronize(device)
        times.append(1000 * (time.perf_counter() - start))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(updates):
            training_update(model, criterion, optimizer, sample)
        _synchronize(device)
    events = prof.key_averages()
    result = {
        "ms_per_update": statistics.median(times),
        "launches": model_launches["launches"] + optimizer_launches["launches"],
        "model_launches": model_launches["launches"],
        "triton_kernels": model_launches["inductor"],
        "optimizer_launches": optimizer_launches["launches"],
        "params": sum(p.numel() for p in model.parameters()),
        "aten_ops": traffic["ops"] + traffic["matmul_ops"],
        "sources": sources,
    }
    if device.type == "cuda":  # the kernels, by their GPU time
        ranked = [e for e in events if e.device_type == DeviceType.CUDA]
        self_us = lambda e: e.self_device_time_total  # noqa: E731
        busy_ms = sum(map(self_us, ranked)) / 1000 / updates
        result.update({"kernels": sum(e.count for e in ranked) / updates, "gpu_busy_ms": busy_ms,
                       "gpu_busy_fraction": busy_ms / result["ms_per_update"]})
    else:  # the ATen ops, by their CPU time
        ranked = [e for e in events if e.key.startswith("aten::")]
        self_us = lambda e: e.self_cpu_time_total  # noqa: E731
    ranked.sort(key=self_us, reverse=True)
    result["top_ops"] = [{"name": e.key, "calls_per_update": e.count / updates,
                          "self_ms_per_update": self_us(e) / 1000 / updates} for e in ranked[:top]]
    return result


def profile_updates(config: str, setting: StepSetting, device: str = "cpu", updates: int = 5, warmup: int = 3,
                    models: Sequence[str] = tuple(VARIANTS)) -> Dict:
    """``{"config", "device", "setting", "models": {name: profile_model(...)}}`` with ratios to V-T."""
    setting = setting.validate()
    if config not in STEP_CONFIGS:
        raise ValueError(f"unknown configuration {config!r}: one of {', '.join(STEP_CONFIGS)}")
    if updates < 1 or warmup < 0:
        raise ValueError(f"updates={updates} must be >= 1 and warmup={warmup} >= 0")
    device = torch.device(device)
    results = {}
    for name in models:
        results[name] = profile_model(config, name, setting, device, updates, warmup)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the previous model's memory, before the next one is built
    base = results.get("V-T")
    for result in results.values():
        if base is not None and not result.get("interpreted"):
            result["speed_vs_vt"] = base["ms_per_update"] / result["ms_per_update"]
            result["launches_vs_vt"] = result["launches"] / base["launches"]
            result["model_launches_vs_vt"] = result["model_launches"] / base["model_launches"]
            result["aten_ops_vs_vt"] = result["aten_ops"] / base["aten_ops"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"config": config, "device": name, "setting": setting.__dict__, "updates": updates, "models": results}


def table_rows(report: Dict):
    rows = []
    for name, r in report["models"].items():
        row = {"model": name, "ms/update": r.get("ms_per_update"), "speed vs V-T": r.get("speed_vs_vt"),
               "launches": r.get("launches"), "vs V-T": r.get("launches_vs_vt"),
               "fwd+bwd launches": r["model_launches"], "fwd+bwd vs V-T": r.get("model_launches_vs_vt"),
               "optimizer": r.get("optimizer_launches")}
        if "kernels" in r:
            row.update({"kernels": r["kernels"], "GPU busy ms": r["gpu_busy_ms"], "busy fraction": r["gpu_busy_fraction"]})
        rows.append(row)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(STEP_CONFIGS), default="base")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reading", choices=READINGS, default=StepSetting.reading, help="--sdma-reading of SMA-T, SDMA-T")
    p.add_argument("--sentences", type=int, default=160, help="sentences of the fixed batch (default 160)")
    p.add_argument("--tokens", type=int, default=26, help="tokens per sentence, EOS included (default 26: "
                                                          "160 x 26 is the IWSLT recipe's 4,096-token batch)")
    p.add_argument("--updates", type=int, default=5, help="timed updates, and as many profiled (default 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--models", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="default: all; a Triton variant on a CPU is counted in Triton's interpreter, not timed")
    p.add_argument("--out", type=Path, default=Path("outputs") / "bench" / "sdma_profile.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device is visible (use --device cpu)")
    setting = StepSetting(sentences=args.sentences, tokens=args.tokens, reading=args.reading)
    try:
        report = profile_updates(args.config, setting, args.device, args.updates, args.warmup,
                                 list(dict.fromkeys(args.models)))
    except ValueError as err:
        raise SystemExit(f"profile_update: {err}")
    rows = table_rows(report)
    print_table(rows, list(rows[-1].keys()),
                f"One training update, {args.config}, {report['device']}, batch {args.sentences} x {args.tokens}, "
                f"{args.reading} reading (median of {args.updates})")
    source_rows = [{"model": name, **{s: r["sources"]["per_attention_module"][s] for s in SOURCES if s != "other"},
                    "all modules": sum(r["sources"]["total"][s] for s in SOURCES if s != "other"),
                    "rest of the model": r["sources"]["total"]["other"]} for name, r in report["models"].items()]
    print_table(source_rows, list(source_rows[0].keys()),
                "Launches of one forward + backward per attention module, by source (attention: the module's "
                "projections and layout; regularisers: eq. (20)-(23) of all layers, divided by the modules)")
    for name, r in report["models"].items():
        if "top_ops" in r:
            print(f"{name}: " + ", ".join(f"{op['name']} {op['self_ms_per_update']:.2f} ms" for op in r["top_ops"][:6]))
        else:
            print(f"{name}: counted in Triton's interpreter on a {r['count_batch'][0]}-sentence batch (V-T on it: "
                  f"{r['vt_model_launches_same_batch']} launches), {r['triton_kernels']} of them Triton kernels")
    write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
