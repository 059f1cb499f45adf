"""What an A100 or H100 would run of SDMA's Triton kernels, without a GPU (command ``sdma-kernels-report``).

1. **Record** (Triton's interpreter, a subprocess with ``TRITON_INTERPRET=1``): one training step (forward, the
   regularisers, backward) of each adapter's model with ``attention_kernel=triton`` -- fairseq SDMA-T in both
   readings and SMA-T, an ESPnet Conformer encoder (relative positions: a score bias) with a Transformer decoder, a
   Hugging Face Llama with head dim 128 and a BART -- collecting every kernel call
   (:func:`latent_core.sdma.triton_kernels.record_calls`: reading, clusters, masks and score bias by broadcast
   pattern, dropout, which gradients backward computed).
2. **Compile** (no interpreter): each distinct call is replayed on ``meta`` tensors at head dims 32, 64 and 128 with
   fp16, bf16 and fp32 inputs (fp32 twice: tf32 allowed, and not), forward and backward, and every launch it makes
   is compiled with ``triton.compile`` for sm_80 (A100) and sm_90 (H100/H200) exactly as Triton's JIT would
   specialise it (its own binder: the argument types, the integers equal to 1 and the 16-divisible ones), at its
   row of :data:`~latent_core.sdma.triton_kernels.LAUNCH`. The ``ptxas -v`` log of each compile gives registers
   and spill bytes; the compiled kernel its shared memory, held against the architecture's per-block limit;
   occupancy is the warps per SM that registers and shared memory allow.

Prints one table row per (kernel, inputs, head dim, arch): the worst over the kernel's recorded variants. Writes
the calls and every compile to JSON (``--json``, default ``outputs/sdma_kernels/report.json``). ``--search`` picks
:data:`LAUNCH` rows instead: per (kernel, inputs, head dim), the first of :data:`CANDIDATES` under which every
variant compiles for both architectures with no spill (printed as the table to paste into ``LAUNCH``).
``tests/integration/test_sdma_kernels_report.py`` holds every recorded call to zero spill bytes in fp16 and bf16.
"""

import argparse
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

ARCHS = (80, 90)  # sm_80 = A100, sm_90 = H100 / H200
HEAD_DIMS = (32, 64, 128)
# inputs -> (dtype, whether torch allows tf32 for fp32 products)
INPUTS = {"fp16": (torch.float16, False), "bf16": (torch.bfloat16, False), "fp32-tf32": (torch.float32, True),
          "fp32": (torch.float32, False)}
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
SHARED_PER_SM = {80: 167936, 90: 233472}  # bytes per SM (164 KB / 228 KB)
SHARED_PER_BLOCK = {80: 166912, 90: 232448}  # the most one block may take (163 KB / 227 KB)
SHARED_RESERVED_PER_BLOCK = 1024  # the driver's own per block (sm_80 and later)
# The replayed problem: 250 queries and keys (a partial last tile, sizes not 16-divisible), 2 sentences, 2 heads
REPLAY_B, REPLAY_H, REPLAY_T = 2, 2, 250
DEFAULT_JSON = Path("outputs/sdma_kernels/report.json")
# --search: LaunchConfig(rows, columns, num_warps, num_stages) tried in this order (most work per program first)
CANDIDATES = {
    "tiles": [(64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2),
              (32, 32, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1), (16, 16, 4, 1), (16, 16, 2, 1)],
    "rows": [(64, 0, 4, 1), (32, 0, 4, 1), (32, 0, 8, 1), (16, 0, 4, 1), (16, 0, 8, 1), (16, 0, 2, 1)],
}
SEARCHED = {"attention_forward": "tiles", "attention_backward_keys": "tiles", "attention_backward_queries": "tiles",
            "attention_weights": "tiles", "row_sums": "rows", "clustering": "rows"}
# which LAUNCH row each launched kernel reads
LAUNCH_ROW = {"attention_forward": "attention_forward", "attention_backward_keys": "attention_backward_keys",
              "attention_backward_queries": "attention_backward_queries", "attention_weights": "attention_weights",
              "attention_row_sums": "row_sums",
              "clustering_forward": "clustering", "clustering_backward": "clustering",
              "clustering_parameter_grads": None, "feature_terms_forward": None, "feature_terms_backward": None,
              "query_normalisers": None, "query_terms_forward": None, "query_terms_backward": None,
              "sampling_noise": None}


# ------------------------------------------------------------------------------------------------ 1. record

def _fairseq_step(mode: str, reading: str) -> None:
    from benchmarks.sdma.step_timing import StepSetting, build_for_updates, forward_backward

    model, criterion, _, sample = build_for_updates("tiny2x2", mode, StepSetting(sentences=2, tokens=9,
                                                                                  reading=reading), kernel="triton")
    forward_backward(model, criterion, sample)


def _espnet_step() -> None:
    import espnet_plugin  # noqa: F401  (registers the classes)
    from espnet_plugin.tasks.sdma_asr import SDMAASRTask

    args = SDMAASRTask.get_parser().parse_args([])
    args.token_list = ["<blank>", "<unk>", *[f"t{i}" for i in range(10)], "<sos/eos>"]
    args.input_size = None
    args.frontend, args.frontend_conf = "default", {"n_fft": 400, "hop_length": 160, "n_mels": 20}
    args.specaug, args.normalize, args.normalize_conf = None, "utterance_mvn", {}
    sdma_conf = {"attention_kernel": "triton"}
    args.encoder, args.encoder_conf = "sdma_conformer", dict(output_size=32, attention_heads=2, linear_units=64,
                                                             num_blocks=1, cnn_module_kernel=5, rel_pos_type="latest",
                                                             sdma_conf=sdma_conf)
    args.decoder, args.decoder_conf = "sdma_transformer", dict(attention_heads=2, linear_units=64, num_blocks=1,
                                                               sdma_conf=sdma_conf)
    args.model, args.model_conf, args.ctc_conf = "sdma", dict(ctc_weight=0.3, lsm_weight=0.1), {}
    model = SDMAASRTask.build_model(args).train()
    g = torch.Generator().manual_seed(0)
    text = torch.randint(2, 11, (2, 4), generator=g)
    text[1, 3:] = -1
    loss, _, _ = model(torch.randn(2, 4000, generator=g), torch.tensor([4000, 3000]), text, torch.tensor([4, 3]))
    loss.backward()


def _hf_step(family: str) -> None:
    from transformers import BartConfig, BartForConditionalGeneration, LlamaConfig, LlamaForCausalLM

    from transformers_plugin import attach_sdma, sdma_loss

    torch.manual_seed(0)
    if family == "llama":  # head dim 128, as Llama-family models have (grouped-query: 2 heads, 1 key/value head)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, attention_dropout=0.0,
                                             pad_token_id=0, attn_implementation="sdpa"))
    else:
        model = BartForConditionalGeneration(BartConfig(
            vocab_size=40, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            attention_dropout=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
            attn_implementation="sdpa"))
    attach_sdma(model, attention_kernel="triton").train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    (out.loss + sdma_loss(model)).backward()


# each adapter's model: name -> one training step with attention_kernel=triton
MODEL_STEPS = {
    "fairseq SDMA-T (authors)": lambda: _fairseq_step("sdma", "authors"),
    "fairseq SDMA-T (paper)": lambda: _fairseq_step("sdma", "paper"),
    "fairseq SMA-T (authors)": lambda: _fairseq_step("sma", "authors"),
    "ESPnet Conformer + Transformer decoder": _espnet_step,
    "transformers Llama (head dim 128)": lambda: _hf_step("llama"),
    "transformers BART": lambda: _hf_step("bart"),
}


def call_key(call: Dict) -> str:
    """What decides a call's kernels' code apart from the head dim and dtype (which the compile step varies)."""
    return json.dumps({k: v for k, v in sorted(call.items()) if k not in ("dtype", "head_dim")}, sort_keys=True)


def record_model_calls(steps: Iterable[str] = tuple(MODEL_STEPS)) -> List[Dict]:
    """The distinct kernel calls of the models' training steps (run in Triton's interpreter), each with the models
    that made it (``models``) and the head dims it had there (``head_dims``)."""
    from latent_core.sdma.triton_kernels import INTERPRETED, record_calls

    if not INTERPRETED:
        raise RuntimeError("record_model_calls runs in Triton's interpreter: set TRITON_INTERPRET=1 before starting "
                           "Python (sdma-kernels-report does this itself)")
    distinct: Dict[str, Dict] = {}
    for name in steps:
        with record_calls() as calls:
            MODEL_STEPS[name]()
        for call in calls:
            entry = distinct.setdefault(call_key(call), {k: v for k, v in call.items()
                                                         if k not in ("dtype", "head_dim")} | {"models": [],
                                                                                               "head_dims": []})
            if name not in entry["models"]:
                entry["models"].append(name)
            if "head_dim" in call and call["head_dim"] not in entry["head_dims"]:  # the noise's kernel has none
                entry["head_dims"].append(call["head_dim"])
    return sorted(distinct.values(), key=call_key)


# ------------------------------------------------------------------------------------------------ 2. compile

def _meta(*shape, dtype, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def replay(call: Dict, head_dim: int, dtype: torch.dtype) -> None:
    """Run ``call``'s forward (and backward where recorded) on meta tensors of ``head_dim`` and ``dtype``, for
    :func:`latent_core.sdma.triton_kernels.intercept_launches` to see its launches."""
    from latent_core.sdma import triton_kernels

    B, H, T = REPLAY_B, REPLAY_H, REPLAY_T
    if call["kind"] == "noise":  # eq. (8)'s z = x + sigma eps, one elementwise kernel (no backward kernel)
        triton_kernels.sampling_noise(_meta(T, B, H * head_dim, dtype=dtype, grad=True), 0.1, seed=1)
        return
    C = call["clusters"]
    if call["kind"] == "clustering":
        G = call["groups"]
        params = dtype  # the GMM in the model's dtype (fairseq --fp16 halves it)
        grad = "grad_joint" in call
        x = _meta(B * T, G * head_dim, dtype=dtype, grad=grad)
        means, log_vars = _meta(G, C, head_dim, dtype=params, grad=grad), _meta(G, C, head_dim, dtype=params, grad=grad)
        prior = _meta(G, C, dtype=params, grad=grad)
        more = call.get("more_grads", False)  # the regularisers' gradients of the parameters, through the clustering
        joint, resp, *read = triton_kernels.gaussian_clustering(x, means, log_vars, prior, 0.1, parameters_read=True)
        if grad:
            outputs = [o for o, wanted in ((joint, call["grad_joint"]), (resp, call["grad_resp"]), (read[0], more),
                                           (read[1], more)) if wanted]
            torch.autograd.backward(outputs, [torch.empty_like(o) for o in outputs])
        return
    grad = call["backward"]
    if call["kind"] == "feature_terms":  # float32 whatever the model's dtype (the regularisers' inputs are)
        from latent_core.sdma.triton_regularisers import feature_terms

        L, G = 2, min(call["groups"], H)
        log_joint, log_resp = (_meta(C, L, T, B, H, dtype=torch.float32, grad=grad) for _ in range(2))
        log_vars = _meta(L, G, C, head_dim, dtype=dtype, grad=grad)  # the GMM in the model's dtype
        prior_logits = _meta(L, G, C, dtype=dtype, grad=grad) if call["authors"] else None
        terms = feature_terms(log_joint, log_resp, log_vars, prior_logits, _meta(T, B, dtype=torch.float32),
                              call["masked"], 1.0, 1.0, 1.0)
        if grad:
            torch.autograd.backward(terms, [torch.empty_like(t) for t in terms])
        return
    if call["kind"] == "query_terms":  # float32, the model's heads (the kernels loop over them)
        from latent_core.sdma.triton_regularisers import query_terms

        L, H = 2, call["heads"]
        log_joint, log_resp = (_meta(C, L, T, B, H, dtype=torch.float32, grad=grad) for _ in range(2))
        weights = _meta(T, B, dtype=torch.float32)
        terms = query_terms(log_joint, log_resp, weights, call["authors"])[:2]
        if grad:
            torch.autograd.backward(terms, [torch.empty_like(t) for t in terms])
        return
    q = _meta(B, H, T, head_dim, dtype=dtype, grad=grad)
    k, v = _meta(B, H, T, head_dim, dtype=dtype, grad=grad), _meta(B, H, T, head_dim, dtype=dtype, grad=grad)
    resp_query, resp_key = _meta(B, H, T, C, dtype=torch.float32, grad=grad), _meta(B, H, T, C, dtype=torch.float32,
                                                                                    grad=grad)
    full = (B, H, T, T)

    def patterned(pattern, **kwargs):
        return None if pattern is None else _meta(*(n if own else 1 for n, own in zip(full, pattern)), **kwargs)

    blocked = patterned(call["blocked"], dtype=torch.bool)
    bias = patterned(call["score_bias"], dtype=dtype, grad=call["bias_grad"])
    out = triton_kernels.mixed_attention(q, k, v, resp_query, resp_key, _meta((), dtype=torch.float32),
                                         authors=call["authors"], blocked=blocked,
                                         dropout_p=0.1 if call["dropout"] else 0.0, seed=1, score_bias=bias,
                                         scale=head_dim ** -0.5, log_responsibilities=call.get("log_resp", False),
                                         need_weights=call.get("weights", False))
    if call.get("weights", False):
        out = out[0]
    if grad:
        out.backward(torch.empty_like(out))


class Compiler:
    """Compiles intercepted launches for one architecture the way Triton's JIT would (its binder), once per distinct
    specialisation; :meth:`measure` reads registers and spills from ``ptxas -v`` and shared memory from the kernel."""

    def __init__(self, arch: int, only: Optional[Sequence[str]] = None):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.arch, self.only = arch, only
        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.binders: Dict[str, object] = {}
        self.results: Dict[str, Dict] = {}
        self.launches: List[Dict] = []

    def __call__(self, name, kernel, grid, args, constexprs, cfg):
        if self.only is not None and name not in self.only:
            return
        from triton.runtime.jit import create_function_from_signature

        if name not in self.binders:
            self.binders[name] = create_function_from_signature(kernel.signature, kernel.params, self.backend)
        num_warps, num_stages = cfg.num_warps, cfg.num_stages
        kwargs = dict(constexprs, num_warps=num_warps, num_stages=num_stages)
        bound, specialization, options = self.binders[name](*args, **kwargs)
        options, signature, constants, attrs = kernel._pack_args(self.backend, kwargs, bound, specialization, options)
        key = repr((name, signature, sorted(constants.items()), sorted(attrs.items()), num_warps, num_stages))
        if key not in self.results:
            self.results[key] = self.measure(kernel, signature, constants, attrs, options, num_warps)
        self.launches.append(dict(self.results[key], kernel=name,
                                  constexprs={k: v for k, v in constexprs.items() if not k.startswith("BLOCK_")},
                                  tile="x".join(str(constexprs[k]) for k in ("BLOCK_T", "BLOCK_S", "BLOCK_N")
                                                if k in constexprs),
                                  num_warps=num_warps, num_stages=num_stages))

    def measure(self, kernel, signature, constants, attrs, options, num_warps) -> Dict:
        import triton
        from triton import knobs
        from triton.compiler import ASTSource

        log = io.StringIO()
        start = time.perf_counter()
        with knobs.nvidia.scope(), knobs.compilation.scope():
            knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed: read it from stdout
            knobs.compilation.always_compile = True  # a cached kernel would print no report
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=self.target,
                                          options=options.__dict__)
        text = log.getvalue()
        registers = int(re.search(r"Used (\d+) registers", text).group(1))
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        shared = int(compiled.metadata.shared)
        return dict(arch=f"sm_{self.arch}", registers=registers, spill_stores=int(spills.group(1)),
                    spill_loads=int(spills.group(2)), shared=shared, shared_limit=SHARED_PER_BLOCK[self.arch],
                    warps_per_sm=warps_per_sm(registers, shared, num_warps, self.arch),
                    seconds=round(time.perf_counter() - start, 2))


def warps_per_sm(registers: int, shared: int, num_warps: int, arch: int) -> int:
    """Resident warps per SM that ``registers`` per thread and ``shared`` bytes per block allow (of 64)."""
    per_warp = math.ceil(registers * 32 / 256) * 256  # registers are allocated per warp in units of 256
    by_registers = REGISTERS_PER_SM // (per_warp * num_warps)
    by_shared = SHARED_PER_SM[arch] // (shared + SHARED_RESERVED_PER_BLOCK) if shared else MAX_BLOCKS_PER_SM
    blocks = min(by_registers, by_shared, MAX_BLOCKS_PER_SM, MAX_WARPS_PER_SM // num_warps)
    return blocks * num_warps


@contextlib.contextmanager
def _inputs(name: str):
    """fp32 products as tf32 (``fp32-tf32``) or in full precision (``fp32``), as torch's flag says."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = INPUTS[name][1]
    try:
        yield INPUTS[name][0]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def compile_calls(calls: List[Dict], inputs: Sequence[str] = tuple(INPUTS), head_dims: Sequence[int] = HEAD_DIMS,
                  archs: Sequence[int] = ARCHS, only: Optional[Sequence[str]] = None, jobs: int = 1) -> List[Dict]:
    """Every launch of every call at each (inputs, head dim, arch), compiled: one dict per launch. ``jobs > 1``:
    the architectures in that many processes."""
    from latent_core.sdma import triton_kernels

    if triton_kernels.INTERPRETED:
        raise RuntimeError("compile_calls compiles for a GPU: start Python without TRITON_INTERPRET=1")
    if jobs > 1 and len(archs) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        launch = dict(triton_kernels.LAUNCH)  # as this process has it (--search changes rows)
        with ProcessPoolExecutor(min(jobs, len(archs)), mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = pool.map(_compile_one_arch, [(calls, inputs, head_dims, arch, only, launch) for arch in archs])
            return [row for part in parts for row in part]
    rows = []
    for arch in archs:
        compiler = Compiler(arch, only)
        for name in inputs:
            for head_dim in head_dims:
                for index, call in enumerate(calls):
                    before = len(compiler.launches)
                    with _inputs(name) as dtype, triton_kernels.intercept_launches(compiler):
                        replay(call, head_dim, dtype)
                    for launch in compiler.launches[before:]:
                        rows.append(dict(launch, inputs=name, head_dim=head_dim, call=index))
    return rows


def _compile_one_arch(job) -> List[Dict]:
    from latent_core.sdma import triton_kernels

    calls, inputs, head_dims, arch, only, launch = job
    triton_kernels.LAUNCH.update(launch)
    return compile_calls(calls, inputs, head_dims, [arch], only)


def summary(rows: List[Dict]) -> List[Dict]:
    """The worst launch per (kernel, inputs, head dim, arch): most spill bytes, then most registers."""
    worst: Dict[Tuple, Dict] = {}
    for row in rows:
        key = (row["kernel"], row["inputs"], row["head_dim"], row["arch"])
        if key not in worst or (row["spill_stores"], row["registers"]) > (worst[key]["spill_stores"],
                                                                          worst[key]["registers"]):
            worst[key] = row
    table = []
    for (kernel, inputs, head_dim, arch), row in sorted(worst.items()):
        variants = sum(1 for r in rows if (r["kernel"], r["inputs"], r["head_dim"], r["arch"]) ==
                       (kernel, inputs, head_dim, arch))
        table.append(dict(kernel=kernel, inputs=inputs, head_dim=head_dim, arch=arch,
                          config=f"{row['tile']} w{row['num_warps']} s{row['num_stages']}",
                          registers=row["registers"], spill_bytes=row["spill_stores"], shared_kb=row["shared"] / 1024,
                          warps_per_sm=row["warps_per_sm"], launches=variants))
    return table


def search(calls: List[Dict], inputs: Sequence[str], head_dims: Sequence[int],
           launch_rows: Sequence[str] = tuple(SEARCHED)) -> Dict[str, List]:
    """Per (LAUNCH row, inputs kind, head dim): the first of :data:`CANDIDATES` with no spill in any variant, on both
    architectures, for every dtype of that kind."""
    from latent_core.sdma import triton_kernels

    kinds: Dict[str, List[str]] = {}
    for name in inputs:
        with _inputs(name) as dtype:
            kinds.setdefault(triton_kernels.input_kind(dtype), []).append(name)
    chosen = {}
    for row_name in launch_rows:
        family = SEARCHED[row_name]
        kernels = [k for k, row in LAUNCH_ROW.items() if row == row_name]
        for kind, names in kinds.items():
            for head_dim in head_dims:
                key = (row_name, kind, head_dim)
                original = triton_kernels.LAUNCH[key]
                found = None
                # fp32 operands take twice the registers of halves: their search starts at 32 x 32 tiles
                candidates = CANDIDATES[family] if kind == "half" or family != "tiles" else CANDIDATES[family][4:]
                for candidate in candidates:
                    triton_kernels.LAUNCH[key] = triton_kernels.LaunchConfig(*candidate)
                    rows = compile_calls(calls, names, [head_dim], only=kernels)
                    spill = max((r["spill_stores"] for r in rows), default=0)
                    print(f"  {row_name} {kind} d={head_dim} {candidate}: spill {spill}, registers "
                          f"{max((r['registers'] for r in rows), default=0)}", flush=True)
                    if spill == 0:
                        found = candidate
                        break
                triton_kernels.LAUNCH[key] = original
                chosen[repr(key)] = found
    return chosen


# ------------------------------------------------------------------------------------------------ command

def _python(module_args: List[str], interpreted: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpreted:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "benchmarks.sdma.kernels_report", *module_args], env=env,
                          check=True)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(prog="sdma-kernels-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where the report goes")
    parser.add_argument("--calls", type=Path, default=None,
                        help="a calls file written by --record-only (default: record the models now)")
    parser.add_argument("--record-only", action="store_true",
                        help="record the models' calls (in Triton's interpreter) into --calls and stop")
    parser.add_argument("--inputs", nargs="+", default=list(INPUTS), choices=list(INPUTS))
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(HEAD_DIMS))
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes compiling (one architecture each)")
    parser.add_argument("--search", action="store_true", help="choose LAUNCH rows instead of reporting")
    parser.add_argument("--rows", nargs="+", default=list(SEARCHED), choices=list(SEARCHED),
                        help="the LAUNCH rows --search chooses")
    args = parser.parse_args(argv)
    from latent_core.sdma import triton_kernels

    if args.record_only:
        if not triton_kernels.INTERPRETED:
            _python([*(argv if argv is not None else sys.argv[1:])], interpreted=True)
            return {}
        calls = record_model_calls()
        args.calls.parent.mkdir(parents=True, exist_ok=True)
        args.calls.write_text(json.dumps(calls, indent=1) + "\n")
        print(f"{len(calls)} distinct kernel calls from {len(MODEL_STEPS)} models -> {args.calls}")
        return {"calls": calls}
    if args.calls is None:
        args.calls = args.json.with_name("calls.json")
        _python(["--record-only", "--calls", str(args.calls)], interpreted=True)
    if triton_kernels.INTERPRETED:  # compiling needs the kernels as Triton's JIT has them
        _python([*(argv if argv is not None else sys.argv[1:]), "--calls", str(args.calls)], interpreted=False)
        return json.loads(args.json.read_text())
    calls = json.loads(args.calls.read_text())
    from pipelines.runs import print_table, write_json

    start = time.perf_counter()
    if args.search:
        chosen = search(calls, args.inputs, args.head_dims, args.rows)
        report = {"search": chosen}
        print("\nchosen LAUNCH rows (rows, columns, num_warps, num_stages):")
        for key, candidate in chosen.items():
            print(f"  {key}: {candidate}")
    else:
        rows = compile_calls(calls, args.inputs, args.head_dims, jobs=args.jobs)
        table = summary(rows)
        print_table(table, ["kernel", "inputs", "head_dim", "arch", "config", "registers", "spill_bytes", "shared_kb",
                            "warps_per_sm", "launches"],
                    f"SDMA's Triton kernels compiled for sm_80 / sm_90 (worst recorded variant; triton "
                    f"{__import__('triton').__version__}, ptxas -v)")
        spilling = [r for r in table if r["spill_bytes"]]
        print(f"{len(rows)} launches ({len(calls)} recorded calls x inputs x head dims x archs), "
              f"{len(spilling)} of {len(table)} rows spill")
        report = {"calls": calls, "launches": rows, "table": table}
    report["seconds"] = round(time.perf_counter() - start, 1)
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
