#!/usr/bin/env python3
"""Benchmark of the kernels of SDMA's mixed attention, eq. (11) (``attention_kernel``).

explicit (scores, one softmax, the multiplicative mask; the baseline), sdpa (two
``scaled_dot_product_attention`` calls, the mask as additive log M), lowrank (one SDPA call over
the value widened by the key responsibilities, no T x S mask) and, on CUDA, triton (the fused kernels through
:func:`latent_core.sdma.sdma_attention`, given unscaled queries and log p(c|.) as the adapters hand them), each
timed for one forward + backward of the attention alone (q, k, v, both responsibilities get gradients) at the shapes below, per
precision. Prints a table and writes JSON (``--out``) with the milliseconds, the peak memory
(``torch.cuda.max_memory_allocated`` on CUDA) and every ratio to explicit from the same run.

    python -m benchmarks.sdma.kernels_bench --device cuda --dtypes fp16 bf16 fp32
    python -m benchmarks.sdma.kernels_bench --device cpu --dtypes fp32 --repeats 5   # a CPU run
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from latent_core.sdma import (
    fused_mix_attention,
    lowrank_mix_attention,
    mix_attention,
    sdma_attention,
    semantic_mask_product,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (name, batch, heads, length, head dim, clusters): 4096 tokens at the IWSLT base size (512-d, 4
# heads, fairseq preset n_c 4); the Aishell conformer/transformer (256-d, 4 heads, n_c 8) at ~250
# frames after subsampling; one long sequence
SHAPES = {
    "mt_base_T32": (128, 4, 32, 128, 4),
    "asr_T256": (16, 4, 256, 64, 8),
    "long_T1024": (4, 8, 1024, 64, 4),
}
KERNELS = ("explicit", "sdpa", "lowrank")
GPU_KERNELS = KERNELS + ("triton",)  # Triton runs on CUDA (on the CPU only in its interpreter)


def make_inputs(shape, dtype, device, seed=0):
    batch, heads, length, dim, clusters = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=g) for _ in range(3))
    resp_q, resp_k = (torch.softmax(torch.randn(batch, heads, length, clusters, generator=g), -1) for _ in range(2))
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    lengths[0] = length
    allowed = (torch.arange(length)[None, :] < lengths[:, None]).view(batch, 1, 1, length)
    base_mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    tensors = dict(q=(q / dim ** 0.5).to(dtype), k=k.to(dtype), v=v.to(dtype), resp_q=resp_q, resp_k=resp_k)
    tensors = {name: t.to(device).requires_grad_() for name, t in tensors.items()}
    return tensors, base_mask.to(device, dtype), allowed.to(device)


def step(kernel, t, base_mask, allowed, mix):
    q, k, v, resp_q, resp_k = t["q"], t["k"], t["v"], t["resp_q"], t["resp_k"]
    if kernel == "triton":  # q unscaled and log p(c|.) (triton_inputs)
        out, _ = sdma_attention(q, k, v, resp_q, resp_k, mix, authors=False, blocked=~allowed, kernel="triton",
                                need_weights=False, dropout=lambda a: a, dropout_p=0.0, scale=q.size(-1) ** -0.5,
                                log_responsibilities=True)
    elif kernel == "lowrank":
        out = lowrank_mix_attention(q, k, v, resp_q, resp_k, mix, base_mask)
    else:
        B, H, T, C = resp_q.shape
        mask = semantic_mask_product(resp_q.reshape(B * H, T, C), resp_k.reshape(B * H, -1, C)).view(B, H, T, -1)
        if kernel == "sdpa":
            out = fused_mix_attention(q, k, v, mask, mix, base_mask)
        else:
            scores = (q @ k.transpose(-1, -2)).float().masked_fill(~allowed, float("-inf"))
            out = mix_attention(scores, mask, mix).to(v.dtype) @ v
    out.float().square().mean().backward()


def triton_inputs(t):
    """The inputs as the adapters hand the Triton kernel (:data:`latent_core.sdma.attention.TAKES_RAW_INPUTS`): the queries
    unscaled (the kernel applies the scores' factor) and log p(c|.), as leaves made once, outside the timed steps."""
    q, resp_q, resp_k = (t["q"] * t["q"].size(-1) ** 0.5, t["resp_q"].log(), t["resp_k"].log())
    return {**t, **{name: x.detach().requires_grad_() for name, x in
                    (("q", q), ("resp_q", resp_q), ("resp_k", resp_k))}}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_kernel(kernel, shape, dtype, device, repeats, warmup):
    t, base_mask, allowed = make_inputs(shape, dtype, device)
    if kernel == "triton":
        t = triton_inputs(t)
    mix = torch.tensor(0.5, device=device)
    for _ in range(warmup):
        step(kernel, t, base_mask, allowed, mix)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(kernel, t, base_mask, allowed, mix)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda" else None
    return {"ms_median": statistics.median(times), "ms_min": min(times), "peak_mib": peak}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32"])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("outputs") / "bench" / "sdma_kernels.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible (use --device cpu)")
    rows = []
    for precision in args.dtypes:
        for shape_name in args.shapes:
            base = None
            for kernel in GPU_KERNELS if device.type == "cuda" else KERNELS:
                try:
                    result = time_kernel(kernel, SHAPES[shape_name], DTYPES[precision], device,
                                         args.repeats, args.warmup)
                except (RuntimeError, torch.cuda.OutOfMemoryError) as err:  # e.g. a kernel without this dtype
                    result = {"error": str(err).splitlines()[0]}
                if kernel == "explicit":
                    base = result.get("ms_median")
                if base and "ms_median" in result:
                    result["speedup_vs_explicit"] = base / result["ms_median"]
                rows.append({"dtype": precision, "shape": shape_name, "kernel": kernel, **result})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"SDMA attention kernels, forward + backward, {name} (median of {args.repeats})")
    print(f"{'dtype':6} {'shape':12} {'kernel':9} {'ms':>9} {'x explicit':>10} {'peak MiB':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['dtype']:6} {r['shape']:12} {r['kernel']:9} error: {r['error'][:60]}")
            continue
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        print(f"{r['dtype']:6} {r['shape']:12} {r['kernel']:9} {r['ms_median']:9.3f} "
              f"{r.get('speedup_vs_explicit', 1.0):10.2f} {peak:>9}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": name, "torch": torch.__version__, "shapes": {
        s: dict(zip(("batch", "heads", "length", "head_dim", "clusters"), SHAPES[s])) for s in args.shapes},
        "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
