"""SDMA's GPU path: Triton kernels, each with its backward, for the clustering of eq. (9) and the masked
mixture of eq. (1), (2), (10), (11) (the ``triton`` row of :data:`latent_core.sdma.attention.KERNELS`).

Eager SDMA is bound by kernel launches on a GPU: the clustering, the mask and the mixing are dozens of small
ATen ops per attention module. Here they are five kernels per module and update, and one per noise draw:

* :func:`sampling_noise`: z = x + sigma eps of eq. (8), eps drawn from Philox by (seed, position) in the same
  launch (randn and add are two); its backward is the identity (no launch).
* :func:`gaussian_clustering`: log p(z, c) and log p(c | z) of eq. (9) for every row and group (head) in one
  kernel, read straight from the GMM's means, log-variances and prior logits (no expanded weights); backward:
  one kernel for the input's gradient and per-block partial sums of the parameters' gradients, one to reduce
  them (with the log-variance clamp and the prior's log-softmax).
* :func:`mixed_attention`: A_hat V of eq. (11) flash-style: one pass over the keys per block of queries with an
  online softmax, never materialising the T x S matrices. M has rank C (M_ij = sum_c p(c|z_i) p(c|z_j)), so it
  is rebuilt per tile from the responsibilities. Exact in both readings: the authors' row normaliser r_i of the
  mask and their eps on the masked mass Z_i (rows whose masked mass is below eps are not renormalised to 1),
  the paper's 1e-6 floor; padding and causal masks (any boolean mask broadcastable to ``[B, H, T, S]``); an
  additive score bias before eq. (1) (T5's position bias, the Conformer's matrix_bd), tile by tile, with its
  gradient (d scores, kept at ``[B, H, T, S]`` only when the bias is learned); attention dropout on A_hat (as
  the explicit kernel), drawn from Philox by (seed, position) and redrawn in backward; fp16/bf16 inputs with
  fp32 accumulation. Backward: one kernel for the row sums it needs, one over
  the queries per key block (dk, dv, dp(c|z_j)), one over the keys per query block (dq, dp(c|z_i)).

The backward of eq. (2) and (11) in closed form (A = softmax(s), W = M o A, Z_i = sum_j W_ij, N_i = max(Z_i,
floor), A_bar = W / N, A_hat = (1 - g) A + g A_bar, dA_hat_ij = dO_i . v_j):
  <dA_bar_i, A_bar_i> = g dO_i . O_bar_i  (O_bar the masked branch's output, saved by the forward kernel)
  dW = (g dA_hat - g <dO_i, O_bar_i> [Z_i > floor]) / N_i
  ds = A o (dA - (dO_i . O_i - g dO_i . O_bar_i [Z_i > floor])),  dA = (1 - g) dA_hat + dW o M
  and, in the authors' reading M = P / r_i with r_i = max(sum_{j allowed} P_ij, eps), P_ij = sum_c gq_ic gk_jc:
  dr_i = -g (dO_i . O_bar_i) [Z_i <= floor] / r_i (the normaliser cancels wherever Z_i > floor).

Kernels are written within what the GPU compiler accepts (``tl.dot`` operands padded to at least 16 in every
dimension, power-of-two blocks, no float64); every launch configuration is in :data:`LAUNCH`, so a GPU run can tune
them in one place. ``sdma-kernels-report`` compiles every launch the adapters' models make for sm_80 and sm_90 without
a GPU (:func:`record_calls`, :func:`intercept_launches`): registers, spills, shared memory. On a CPU they run in
Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is first
imported): that is how the tests hold them to the explicit path. Each launch is recorded for the profiler as one
event named ``triton_sdma_*`` (one kernel launch each in ``benchmarks.op_counts.count_launches``).
"""

import contextlib
import os
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

import triton
import triton.language as tl

from latent_core.profiling import host_range, profiler_range
from latent_core.sdma.mixture import LOGVAR_RANGE
from latent_core.sdma.options import AUTHORS_EPS, LOG_2PI, PAPER_MASK_FLOOR, SDMAConfigError, check_score_bias
from latent_core.triton_interpreter import lighten_interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRETED:
    lighten_interpreter()  # the interpreter without the work whose results it drops (about 2x faster here)
# whether Triton's own functions (tl.max, ...) were made for the interpreter: triton.language reads the variable when
# first imported, which may have been before it was set
_LANGUAGE_INTERPRETED = not isinstance(tl.max, triton.runtime.jit.JITFunction)
# The arguments a kernel is not compiled again for (Triton specialises an integer argument by whether it is 1 or
# divisible by 16): the sequence lengths, row counts, the seed, the masks' and biases' broadcast strides and the
# clustering's output gradients' strides vary from batch to batch, and each new combination would be another compile
# of several seconds on the GPU. They are scalars: Triton 3.6 still specialises the members of a tuple argument on
# their divisibility by 16 (one compile per padding and causal-mask pattern and sequence length's residue).
_SIZES = ["T", "S", "N", "G", "H", "NUM_BLOCKS", "total", "seed", "blocked_stride_b", "blocked_stride_h",
          "blocked_stride_t", "bias_stride_b", "bias_stride_h", "bias_stride_t", "grad_stride_n", "grad_stride_g",
          "grad_stride_c", "resp_stride_n", "resp_stride_g", "resp_stride_c"]
_NEG = -1.0e30  # the score of a blocked key (finite: a row with every key blocked stays NaN-free)


class LaunchConfig(NamedTuple):
    """One kernel's launch configuration: its tile (rows, columns; clamped to the problem, at least 16) and the
    GPU's ``num_warps`` / ``num_stages`` (ignored by the interpreter)."""

    block_rows: int
    block_cols: int
    num_warps: int
    num_stages: int


# The dot products' inputs, a key of LAUNCH: fp16/bf16 on tensor cores ("half"), fp32 as tf32 where torch allows it
# (torch.backends.cuda.matmul.allow_tf32), fp32 in full precision ("ieee": CUDA-core FMAs, many more registers).
INPUT_KINDS = ("half", "tf32", "ieee")
HEAD_DIMS = (32, 64, 128)  # the head dims LAUNCH is chosen for (BLOCK_D; 16 takes 32's row, above 128 takes 128's)

# Every launch configuration of this module, by (kernel, inputs, BLOCK_D): LaunchConfig(rows, columns, num_warps,
# num_stages), chosen by ``sdma-kernels-report --search`` (the first tile, most work per program first, under which
# every recorded call compiles for sm_80 and sm_90 without a register spill, then checked on every recorded call;
# tune on a GPU here, nowhere else). rows x columns: attention_forward queries x keys; attention_backward_keys queries
# (its inner loop) x keys; attention_backward_queries queries x keys (its inner loop); row_sums and clustering rows.
# fp32 without tf32 ("ieee": CUDA-core dots) still spills a few bytes in some rows and 1,436 bytes in
# attention_backward_keys at head dim 128 (16 x 16): on a GPU allow tf32 or train in fp16/bf16 (benchmark.md,
# "Compiled for the GPU without one"). attention_weights takes the forward's tile (it holds less).
_ATTENTION_TILES = {  # (inputs, BLOCK_D) -> forward, backward over the keys, backward over the queries
    ("half", 32): ((32, 32, 8, 2), (32, 32, 4, 1), (32, 32, 8, 2)),
    ("half", 64): ((32, 32, 8, 2), (32, 32, 8, 2), (32, 16, 4, 1)),
    ("half", 128): ((32, 32, 8, 1), (32, 32, 4, 1), (32, 32, 8, 2)),
    ("tf32", 32): ((32, 32, 8, 2), (32, 32, 4, 1), (32, 32, 4, 1)),
    ("tf32", 64): ((32, 32, 8, 2), (32, 32, 8, 2), (32, 16, 4, 1)),
    ("tf32", 128): ((32, 32, 8, 1), (32, 32, 4, 1), (32, 16, 4, 1)),
    ("ieee", 32): ((32, 32, 4, 2), (32, 32, 8, 2), (32, 16, 4, 1)),
    ("ieee", 64): ((32, 32, 8, 2), (16, 16, 4, 1), (16, 16, 4, 1)),
    ("ieee", 128): ((16, 16, 4, 1), (16, 16, 4, 1), (16, 16, 4, 1)),
}
LAUNCH: Dict[Tuple[str, str, int], LaunchConfig] = {
    **{(kernel, kind, d): LaunchConfig(*tiles[i]) for (kind, d), tiles in _ATTENTION_TILES.items()
       for i, kernel in enumerate(("attention_forward", "attention_backward_keys", "attention_backward_queries"))},
    # the weights kernel rebuilds the forward's tiles without its D-wide accumulators: the forward's tile fits
    **{("attention_weights", kind, d): LaunchConfig(*tiles[0]) for (kind, d), tiles in _ATTENTION_TILES.items()},
    **{("row_sums", kind, d): LaunchConfig(64, 0, 4, 1) for kind in INPUT_KINDS for d in HEAD_DIMS},
    **{("clustering", kind, d): LaunchConfig(32, 0, 8 if d == 128 else 4, 1) for kind in INPUT_KINDS
       for d in HEAD_DIMS},
}


def input_kind(dtype: torch.dtype) -> str:
    """The key of :data:`LAUNCH` (and the dots' precision) for inputs of ``dtype``."""
    if dtype != torch.float32:
        return "half"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def launch_config(kernel: str, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    """The row of :data:`LAUNCH` for ``kernel`` at ``head_dim`` (rounded up to a power of two in 32..128) and
    ``dtype``'s inputs."""
    block_d = min(128, max(32, triton.next_power_of_2(head_dim)))
    return LAUNCH[(kernel, input_kind(dtype), block_d)]


def _block(size: int, limit: int) -> int:
    """A power-of-two tile edge for ``size`` elements, at least 16 (``tl.dot``), at most ``limit``."""
    return max(16, min(limit, triton.next_power_of_2(max(size, 1))))


# What the compile report installs around a model's forward and backward (intercept_launches, record_calls)
_INTERCEPT: Optional[Callable] = None
_CALLS: Optional[List[dict]] = None


@contextlib.contextmanager
def intercept_launches(hook: Callable):
    """Within the scope, every launch calls ``hook(name, kernel, grid, args, constexprs, launch_config)``
    instead of running (the compile report compiles it for a GPU it does not have); tensors on any device, ``meta``
    included, are accepted."""
    global _INTERCEPT
    previous, _INTERCEPT = _INTERCEPT, hook
    try:
        yield
    finally:
        _INTERCEPT = previous


@contextlib.contextmanager
def record_calls():
    """Within the scope, each call of :func:`gaussian_clustering`, :func:`mixed_attention` (forward and backward) and
    :func:`sampling_noise` appends what decides its kernels' code to the yielded list (a dict per call: dtype,
    clusters, reading, masks and score bias by broadcast pattern, dropout, which gradients backward computed)."""
    global _CALLS
    previous, _CALLS = _CALLS, []
    try:
        yield _CALLS
    finally:
        _CALLS = previous


def _launch(name: str, kernel, grid, args: tuple, constexprs: dict, cfg: LaunchConfig) -> None:
    """Run one kernel (one profiler event ``triton_sdma_<name>``), or hand it to :func:`intercept_launches`' hook."""
    if _INTERCEPT is not None:
        _INTERCEPT(name, kernel, grid, args, constexprs, cfg)
        return
    with _profiled(name):
        kernel[grid](*args, **constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _profiled(name: str):
    """A profiler range named like a generated kernel, so that a profile counts each launch as one kernel."""
    return profiler_range(f"triton_sdma_{name}")


def _broadcast_pattern(tensor: Optional[Tensor]) -> Optional[List[int]]:
    """Which of a ``[B, H, T, S]`` mask's or bias's dimensions are its own (1) or broadcast (0); None: absent."""
    if tensor is None:
        return None
    return [int(size != 1) for size in tensor.shape[-4:]]


def check_supported(*tensors: Tensor, option: str = "attention_kernel=triton") -> None:
    """Raise :class:`SDMAConfigError` where the Triton kernels cannot run these tensors (None: an absent optional
    input): a CPU tensor outside Triton's interpreter, or float64 (not a GPU path)."""
    for tensor in (t for t in tensors if t is not None):
        if tensor.dtype == torch.float64:
            raise SDMAConfigError(f"{option}: float64 tensors are not supported by the Triton kernels (no float64 "
                                  "GPU path); use float32/float16/bfloat16, or attention_kernel=explicit")
        if _INTERCEPT is not None:
            continue
        if tensor.device.type != "cuda" and INTERPRETED and not _LANGUAGE_INTERPRETED:
            raise SDMAConfigError(
                f"{option}: TRITON_INTERPRET=1 was set after triton.language had been imported (by torch.utils."
                "flop_counter, for one), so Triton's own functions are not interpreted; set it before starting "
                "Python (TRITON_INTERPRET=1 python ...) or before the first import of torch.utils.flop_counter")
        if tensor.device.type != "cuda" and not INTERPRETED:
            raise SDMAConfigError(
                f"{option}: the Triton kernels run on CUDA devices; for a {tensor.device.type} tensor set "
                "TRITON_INTERPRET=1 before starting Python (Triton's interpreter: slow, for tests) or use "
                "attention_kernel=explicit / auto")


# ----------------------------------------------------------------------------------------------------------
# The clustering of eq. (9)
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _log_joint_tile(x, MEANS, LOG_VARS, PRIOR, g, offs_c, offs_d, mask_d, D, lv_min, lv_max,
                    C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, LOG_2PI_: tl.constexpr):
    """log pi_c + log N(x | mu_c, sigma_c^2) of eq. (9) for a ``[BLOCK_N, BLOCK_D]`` tile of one group, ``[BLOCK_N,
    BLOCK_C]`` (columns past C at -inf)."""
    prior = tl.load(PRIOR + g * C + offs_c, mask=offs_c < C, other=float("-inf")).to(tl.float32)
    prior_max = tl.max(prior, 0)
    log_pi = prior - prior_max - tl.log(tl.sum(tl.exp(prior - prior_max), 0))
    joint = tl.full((BLOCK_N, BLOCK_C), float("-inf"), tl.float32)
    for c in tl.static_range(C):
        mu = tl.load(MEANS + (g * C + c) * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        lv = tl.load(LOG_VARS + (g * C + c) * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        lv = tl.minimum(tl.maximum(lv, lv_min), lv_max)
        precision = tl.where(mask_d, tl.exp(-lv), 0.0)
        diff = x - mu[None, :]
        squared = tl.sum(diff * diff * precision[None, :], 1)  # (x - mu_c)^T Sigma_c^-1 (x - mu_c)
        log_pi_c = tl.sum(tl.where(offs_c == c, log_pi, 0.0), 0)
        value = -0.5 * (squared + tl.sum(lv, 0) + D * LOG_2PI_) + log_pi_c
        joint = tl.where(offs_c[None, :] == c, value[:, None], joint)
    return joint


@triton.jit(do_not_specialize=_SIZES)
def _clustering_forward(X, MEANS, LOG_VARS, PRIOR, LOG_JOINT, LOG_RESP, N, G, D, stride_xn, scale, lv_min, lv_max,
                        C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                        LOG_2PI_: tl.constexpr):
    """The clustering of eq. (9) for ``BLOCK_N`` rows of one group (head): log p(z, c) and log p(c | z) of ``scale *
    X`` under the group's GMM, written clusters-first to ``LOG_JOINT`` and ``LOG_RESP`` [C, N, G]. Grid: (row
    blocks, G)."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    mask_n, mask_d = offs_n < N, offs_d < D
    x = tl.load(X + offs_n[:, None] * stride_xn + (g * D + offs_d)[None, :], mask=mask_n[:, None] & mask_d[None, :],
                other=0.0).to(tl.float32) * scale
    joint = _log_joint_tile(x, MEANS, LOG_VARS, PRIOR, g, offs_c, offs_d, mask_d, D, lv_min, lv_max,
                            C, BLOCK_N, BLOCK_C, LOG_2PI_)
    joint_max = tl.max(joint, 1)
    log_resp = joint - (joint_max + tl.log(tl.sum(tl.exp(joint - joint_max[:, None]), 1)))[:, None]
    # clusters-first storage [C, N, G] (latent_core.sdma.mixture.clusters_first)
    out = offs_c[None, :] * (N * G) + offs_n[:, None] * G + g
    store = mask_n[:, None] & (offs_c[None, :] < C)
    tl.store(LOG_JOINT + out, joint, mask=store)
    tl.store(LOG_RESP + out, log_resp, mask=store)


@triton.jit(do_not_specialize=_SIZES)
def _clustering_backward(X, MEANS, LOG_VARS, PRIOR, GRAD_JOINT, GRAD_RESP, GRAD_X, PARTIAL_MU, PARTIAL_LV, PARTIAL_PI,
                         N, G, D, stride_xn, stride_gxn, grad_stride_n, grad_stride_g, grad_stride_c,
                         resp_stride_n, resp_stride_g, resp_stride_c, scale, lv_min, lv_max,
                         C: tl.constexpr, HAS_GRAD_JOINT: tl.constexpr, HAS_GRAD_RESP: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                         LOG_2PI_: tl.constexpr):
    """The backward of :func:`_clustering_forward` for ``BLOCK_N`` rows of one group: the input's gradient
    (``GRAD_X``) and this block's sums of the means', log-variances' and prior logits' gradients (``PARTIAL_*``,
    reduced by :func:`_clustering_parameter_grads`). The output gradients ``[N, G, C]`` are read in any layout, each
    its own (``grad_stride_*`` of log p(z, c)'s, ``resp_stride_*`` of log p(c|z)'s). Grid: (row blocks, G)."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    mask_n, mask_d = offs_n < N, offs_d < D
    x = tl.load(X + offs_n[:, None] * stride_xn + (g * D + offs_d)[None, :], mask=mask_n[:, None] & mask_d[None, :],
                other=0.0).to(tl.float32) * scale
    tile = mask_n[:, None] & (offs_c[None, :] < C)
    grads = offs_n[:, None] * grad_stride_n + g * grad_stride_g + offs_c[None, :] * grad_stride_c
    # total gradient of log p(z, c): its own plus the log-softmax's (t = g_joint + g_resp - p(c|z) sum_c g_resp)
    total = tl.zeros((BLOCK_N, BLOCK_C), tl.float32)
    if HAS_GRAD_JOINT:
        total += tl.load(GRAD_JOINT + grads, mask=tile, other=0.0).to(tl.float32)
    if HAS_GRAD_RESP:
        joint = _log_joint_tile(x, MEANS, LOG_VARS, PRIOR, g, offs_c, offs_d, mask_d, D, lv_min, lv_max,
                                C, BLOCK_N, BLOCK_C, LOG_2PI_)
        joint_max = tl.max(joint, 1)
        resp = tl.exp(joint - joint_max[:, None])
        resp = resp / tl.sum(resp, 1)[:, None]
        resp_grads = offs_n[:, None] * resp_stride_n + g * resp_stride_g + offs_c[None, :] * resp_stride_c
        grad_resp = tl.load(GRAD_RESP + resp_grads, mask=tile, other=0.0).to(tl.float32)
        total += grad_resp - resp * tl.sum(grad_resp, 1)[:, None]
    total = tl.where(tile, total, 0.0)
    grad_x = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    # a loop unrolled by two, not over all C: 8 clusters compiled in ~6 s unrolled and ~2 s so, with fewer registers
    # (compile report: 80-194, no spill); fully rolled, ptxas spilled 4-28 bytes at 8 clusters
    for c in tl.range(C, loop_unroll_factor=2):
        t = tl.sum(tl.where(offs_c[None, :] == c, total, 0.0), 1)  # [BLOCK_N]
        mu = tl.load(MEANS + (g * C + c) * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        lv = tl.load(LOG_VARS + (g * C + c) * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        lv = tl.minimum(tl.maximum(lv, lv_min), lv_max)
        precision = tl.where(mask_d, tl.exp(-lv), 0.0)
        weighted = t[:, None] * (x - mu[None, :]) * precision[None, :]  # t (x - mu) / sigma^2
        grad_x -= weighted
        partial = (pid_n * G + g) * C + c
        tl.store(PARTIAL_MU + partial * BLOCK_D + offs_d, tl.sum(weighted, 0))
        half_squared = 0.5 * t[:, None] * ((x - mu[None, :]) * (x - mu[None, :]) * precision[None, :] - 1.0)
        tl.store(PARTIAL_LV + partial * BLOCK_D + offs_d, tl.sum(half_squared, 0))
        tl.store(PARTIAL_PI + partial, tl.sum(t, 0))
    tl.store(GRAD_X + offs_n[:, None] * stride_gxn + (g * D + offs_d)[None, :], grad_x * scale,
             mask=mask_n[:, None] & mask_d[None, :])


# partials (row blocks x clusters x head dim) the parameter kernel reads a step, over 4 warps: 32 fp32 registers per
# thread and tensor (compile report: 96-126 registers, no spill)
PARAMETER_TILE = 4096


@triton.jit(do_not_specialize=_SIZES)
def _clustering_parameter_grads(LOG_VARS, PRIOR, PARTIAL_MU, PARTIAL_LV, PARTIAL_PI, GRAD_MU, GRAD_LV, GRAD_PRIOR,
                                MORE_LV, MORE_PRIOR, NUM_BLOCKS, G, D, lv_min, lv_max, mean_grad_scale,
                                C: tl.constexpr, HAS_MORE_LV: tl.constexpr, HAS_MORE_PRIOR: tl.constexpr,
                                BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr):
    """Sum the partials over the row blocks; the clamp's and the log-softmax's backward; the means' gradient times
    ``mean_grad_scale`` (c_g of Section IV-A3); plus the parameters' gradients from their other uses (``MORE_LV``,
    ``MORE_PRIOR``: the regularisers', which read them through this node). One program per GMM reads ``BLOCK_B`` row
    blocks' partials at a time: on an H200 one block a step made this kernel 5.4 ms of a 124 ms base update."""
    g = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    mask_c, mask_d = offs_c < C, offs_d < D
    grad_mu = tl.zeros((BLOCK_B, BLOCK_C, BLOCK_D), tl.float32)
    grad_lv = tl.zeros((BLOCK_B, BLOCK_C, BLOCK_D), tl.float32)
    grad_pi = tl.zeros((BLOCK_B, BLOCK_C), tl.float32)
    tile = mask_c[:, None] & mask_d[None, :]
    for start in range(0, NUM_BLOCKS, BLOCK_B):
        blocks = start + offs_b
        rows = (blocks < NUM_BLOCKS)[:, None] & mask_c[None, :]
        partial = (blocks[:, None] * G + g) * C + offs_c[None, :]  # [BLOCK_B, BLOCK_C]
        at = partial[:, :, None] * BLOCK_D + offs_d[None, None, :]
        inside = rows[:, :, None] & mask_d[None, None, :]
        grad_mu += tl.load(PARTIAL_MU + at, mask=inside, other=0.0)
        grad_lv += tl.load(PARTIAL_LV + at, mask=inside, other=0.0)
        grad_pi += tl.load(PARTIAL_PI + partial, mask=rows, other=0.0)
    grad_mu = tl.sum(grad_mu, 0)
    grad_lv = tl.sum(grad_lv, 0)
    grad_pi = tl.sum(grad_pi, 0)
    params = (g * C + offs_c)[:, None] * D + offs_d[None, :]
    lv = tl.load(LOG_VARS + params, mask=tile, other=0.0).to(tl.float32)
    grad_lv = tl.where((lv >= lv_min) & (lv <= lv_max), grad_lv, 0.0)
    prior = tl.load(PRIOR + g * C + offs_c, mask=mask_c, other=float("-inf")).to(tl.float32)
    pi = tl.exp(prior - tl.max(prior, 0))
    pi = pi / tl.sum(pi, 0)
    grad_prior = grad_pi - pi * tl.sum(grad_pi, 0)
    if HAS_MORE_LV:
        grad_lv += tl.load(MORE_LV + params, mask=tile, other=0.0).to(tl.float32)
    if HAS_MORE_PRIOR:
        grad_prior += tl.load(MORE_PRIOR + g * C + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(GRAD_MU + params, (grad_mu * mean_grad_scale).to(GRAD_MU.dtype.element_ty), mask=tile)
    tl.store(GRAD_LV + params, grad_lv.to(GRAD_LV.dtype.element_ty), mask=tile)
    tl.store(GRAD_PRIOR + g * C + offs_c, grad_prior.to(GRAD_PRIOR.dtype.element_ty), mask=mask_c)


class _GaussianClustering(torch.autograd.Function):
    """``(x [N, G*d], means, log_vars, prior_logits, s, c_g) -> (log p(z, c), log p(c|z), log_vars, prior_logits)``
    of ``s x``, the first two ``[N, G, C]`` float32 stored clusters-first, the last two the parameters as they came
    (views whose gradients come back here: the regularisers read them so, and their gradients are added to this
    node's own in its parameter kernel rather than by autograd, one launch per parameter fewer); saves only ``x``
    (the projections save it too)."""

    @staticmethod
    def forward(ctx, x, means, log_vars, prior_logits, scale, mean_grad_scale):
        groups, clusters, dim = means.shape
        rows = x.size(0)
        cfg = launch_config("clustering", dim, x.dtype)
        block_n, block_d, block_c = _block(rows, cfg.block_rows), _block(dim, 1 << 20), triton.next_power_of_2(clusters)
        log_joint = torch.empty(clusters, rows, groups, dtype=torch.float32, device=x.device)
        log_resp = torch.empty_like(log_joint)
        if x.stride(-1) != 1:
            x = x.contiguous()
        _launch("clustering_forward", _clustering_forward, (triton.cdiv(rows, block_n), groups),
                (x, means, log_vars, prior_logits, log_joint, log_resp, rows, groups, dim, x.stride(0), float(scale),
                 *LOGVAR_RANGE),
                dict(C=clusters, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_C=block_c, LOG_2PI_=LOG_2PI), cfg)
        ctx.save_for_backward(x, means, log_vars, prior_logits)
        ctx.scale, ctx.mean_grad_scale = float(scale), float(mean_grad_scale)
        ctx.set_materialize_grads(False)  # an output nobody used has no gradient (None), not zeros
        ctx.call = None
        if _CALLS is not None:
            ctx.call = dict(kind="clustering", dtype=str(x.dtype).replace("torch.", ""), clusters=clusters,
                            groups=groups, head_dim=dim)
            _CALLS.append(ctx.call)
        return log_joint.movedim(0, -1), log_resp.movedim(0, -1), log_vars, prior_logits

    @staticmethod
    def backward(ctx, grad_joint, grad_resp, more_log_vars, more_prior):
        x, means, log_vars, prior_logits = ctx.saved_tensors
        groups, clusters, dim = means.shape
        rows = x.size(0)
        cfg = launch_config("clustering", dim, x.dtype)
        block_n, block_d, block_c = _block(rows, cfg.block_rows), _block(dim, 1 << 20), triton.next_power_of_2(clusters)
        num_blocks = triton.cdiv(rows, block_n)
        if ctx.call is not None:
            ctx.call.update(grad_joint=grad_joint is not None, grad_resp=grad_resp is not None,
                            more_grads=more_log_vars is not None)
        if grad_joint is None and grad_resp is None:
            grad_joint = torch.zeros(clusters, rows, groups, dtype=torch.float32, device=x.device).movedim(0, -1)

        # the output gradients are read in the layouts they come in (no copy): the attention's and the regularisers'
        # (a slice of their stacked layers) differ
        strides = grad_joint.stride() if grad_joint is not None else (0, 0, 0)
        resp_strides = grad_resp.stride() if grad_resp is not None else (0, 0, 0)
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        partial_mu = torch.empty(num_blocks, groups, clusters, block_d, dtype=torch.float32, device=x.device)
        partial_lv = torch.empty_like(partial_mu)
        partial_pi = torch.empty(num_blocks, groups, clusters, dtype=torch.float32, device=x.device)
        _launch("clustering_backward", _clustering_backward, (num_blocks, groups),
                (x, means, log_vars, prior_logits, grad_joint if grad_joint is not None else x,
                 grad_resp if grad_resp is not None else x, grad_x, partial_mu, partial_lv, partial_pi,
                 rows, groups, dim, x.stride(0), grad_x.stride(0), *strides, *resp_strides, ctx.scale, *LOGVAR_RANGE),
                dict(C=clusters, HAS_GRAD_JOINT=grad_joint is not None, HAS_GRAD_RESP=grad_resp is not None,
                     BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_C=block_c, LOG_2PI_=LOG_2PI), cfg)
        grad_means, grad_log_vars = torch.empty_like(means), torch.empty_like(log_vars)
        grad_prior = torch.empty_like(prior_logits)
        _launch("clustering_parameter_grads", _clustering_parameter_grads, (groups,),
                (log_vars, prior_logits, partial_mu, partial_lv, partial_pi, grad_means, grad_log_vars, grad_prior,
                 _contiguous_or(more_log_vars, log_vars), _contiguous_or(more_prior, prior_logits), num_blocks, groups,
                 dim, *LOGVAR_RANGE, ctx.mean_grad_scale),
                dict(C=clusters, HAS_MORE_LV=more_log_vars is not None, HAS_MORE_PRIOR=more_prior is not None,
                     BLOCK_D=block_d, BLOCK_C=block_c, BLOCK_B=max(1, PARAMETER_TILE // (block_c * block_d))),
                LaunchConfig(0, 0, 4, 1))
        return grad_x, grad_means, grad_log_vars, grad_prior, None, None


def _contiguous_or(grad: Optional[Tensor], placeholder: Tensor) -> Tensor:
    """A gradient the kernel reads by the parameter's (contiguous) offsets, or a placeholder pointer when there is
    none."""
    return placeholder if grad is None else grad.contiguous()


def gaussian_clustering(x: Tensor, means: Tensor, log_vars: Tensor, prior_logits: Tensor,
                        scale: float = 1.0, mean_grad_scale: float = 1.0,
                        parameters_read: bool = False) -> Tuple[Tensor, ...]:
    """The clustering of eq. (9) of ``scale * x``: ``x [N, G*d]`` (rows of G groups' d-dim inputs) and one GMM per
    group (``means``, ``log_vars`` ``[G, C, d]``, ``prior_logits`` ``[G, C]``) -> (log pi_c + log N(s x | mu_c,
    sigma_c^2), log p(c | s x)), each ``[N, G, C]`` float32, stored clusters-first (as
    :meth:`latent_core.sdma.mixture.GaussianMixture.log_joint`). Log-variances are clamped to :data:`LOGVAR_RANGE`.
    ``mean_grad_scale``: the means' gradient is multiplied by it (c_g, in the backward kernel: no launch of its own,
    where :meth:`~latent_core.sdma.mixture.GaussianMixture.scaled_means` is one). ``parameters_read``: also returns
    ``log_vars`` and ``prior_logits`` as views whose gradients come back through this call (for the regularisers to
    read: their gradients join the clustering's in its parameter kernel, not in an autograd sum per parameter)."""
    check_supported(x, option="attention_kernel=triton (the clustering)")
    if x.dim() != 2 or x.size(1) != means.size(0) * means.size(2):
        raise SDMAConfigError(f"gaussian_clustering: x must be [N, G*d] = [N, {means.size(0) * means.size(2)}], "
                              f"got {list(x.shape)}")
    outputs = _GaussianClustering.apply(x, means, log_vars, prior_logits, scale, mean_grad_scale)
    return outputs if parameters_read else outputs[:2]


# ----------------------------------------------------------------------------------------------------------
# The sampling noise of eq. (8)
# ----------------------------------------------------------------------------------------------------------

NOISE_LAUNCH = LaunchConfig(1024, 0, 4, 1)  # elementwise: 1,024 elements a program whatever the head dim


@triton.jit(do_not_specialize=["total", "seed"])
def _sampling_noise(X, OUT, total, seed, sigma, BLOCK_N: tl.constexpr):
    """z = x + sigma * eps (eq. 8) over ``total`` elements in storage order, eps ~ N(0, 1) from Philox by (seed,
    position); grid (element blocks,)."""
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = offs < total
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (x + sigma * tl.randn(seed, offs)).to(OUT.dtype.element_ty), mask=inside)


class _SamplingNoise(torch.autograd.Function):
    """x + sigma * eps in one launch (randn and add are two); dz/dx is the identity, so backward launches nothing and
    the noise is never redrawn."""

    @staticmethod
    def forward(ctx, x, sigma, seed):
        out = torch.empty_like(x)  # x's strides (x is dense: see sampling_noise)
        total = x.numel()
        if total == 0:  # an empty batch: no program to launch
            return out
        _launch("sampling_noise", _sampling_noise, (triton.cdiv(total, NOISE_LAUNCH.block_rows),),
                (x, out, total, seed, sigma), dict(BLOCK_N=NOISE_LAUNCH.block_rows), NOISE_LAUNCH)
        if _CALLS is not None:
            _CALLS.append(dict(kind="noise", dtype=str(x.dtype).replace("torch.", "")))  # no head dim: elementwise
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def philox_seed() -> int:
    """A Philox seed for one call (from torch's CPU generator: ``torch.manual_seed`` makes it repeatable, and no
    device synchronisation; on a GPU no kernel either, so a launch count skips it)."""
    with host_range("philox_seed"):
        return int(torch.randint(0, 2 ** 31 - 1, (1,)).item())


def sampling_noise(x: Tensor, sigma: float, seed: Optional[int] = None) -> Tensor:
    """z = x + ``sigma`` eps of eq. (8) with eps ~ N(0, 1) drawn in the kernel from Philox by (``seed``, position in
    x's storage order; :func:`philox_seed` draws a seed when None), in ``x``'s dtype and layout. A transposed x (the
    ``[T, B, C]`` view fairseq hands its layers) is read as stored: no copy, and z has its strides. Differentiable
    (dz/dx = 1). :func:`latent_core.sdma.reference.sampling_noise_direct` is the same draw as a tensor."""
    check_supported(x, option="attention_kernel=triton (the noise of eq. 8)")
    x = _dense(x)
    return _SamplingNoise.apply(x, float(sigma), philox_seed() if seed is None else int(seed))


# ----------------------------------------------------------------------------------------------------------
# The masked mixture of eq. (1), (2), (10), (11)
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    """``tl.dot`` with fp32 accumulation; ``DOT_PRECISION == "widen"``: both operands widened to fp32 first (bfloat16
    under the interpreter, whose ``tl.dot`` of bfloat16 operands is wrong in Triton 3.6)."""
    if DOT_PRECISION == "widen":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _head(BASE, strides, b, h):
    """Where sentence ``b``, head ``h`` of a ``[B, H, rows, columns]`` tensor with ``strides`` (4, in elements)
    starts (a mask or bias broadcast along a dimension has stride 0 there)."""
    return BASE + b * strides[0] + h * strides[1]


@triton.jit
def _mask_head(BASE, stride_b, stride_h, stride_t, b, h):
    """(:func:`_head` of a ``[B or 1, H or 1, T or 1, S]`` mask or bias contiguous along the keys, its first 3
    strides). The kernels take those strides as scalar arguments listed in ``_SIZES``, so a broadcast's stride 0
    compiles no variant of its own."""
    strides = (stride_b, stride_h, stride_t)
    return _head(BASE, strides, b, h), strides


@triton.jit
def _tile(HEAD, strides, rows, cols):
    """Pointers to the ``[len(rows), len(cols)]`` tile of one head (``HEAD`` from :func:`_head`)."""
    return HEAD + rows[:, None] * strides[2] + cols[None, :] * strides[3]


@triton.jit
def _row_tile(HEAD, strides, rows, cols):
    """:func:`_tile` of a tensor contiguous along its last dimension (a mask or bias; ``strides`` the first 3): one
    vector load per row of the tile, whatever its other strides."""
    return HEAD + rows[:, None] * strides[2] + cols[None, :]


@triton.jit
def _responsibilities(G, g_strides, offs, mask, offs_c, C: tl.constexpr, LOG_RESP: tl.constexpr):
    """p(c | z) of a block of queries or keys, ``[BLOCK, BLOCK_C]`` float32 (rows past the end and columns past C
    zero); with ``LOG_RESP`` read as log p(c | z), what the clustering of eq. (9) gives (no exp launch before the
    kernel, no product with p in its backward)."""
    tile = mask[:, None] & (offs_c < C)[None, :]
    resp = tl.load(_tile(G, g_strides, offs, offs_c), mask=tile, other=0.0).to(tl.float32)
    if LOG_RESP:
        resp = tl.where(tile, tl.exp(resp), 0.0)
    return resp


@triton.jit
def _responsibility_gradient(grad_resp, resp, LOG_RESP: tl.constexpr):
    """The gradient of what the kernel read: d p(c|z), or with ``LOG_RESP`` d log p(c|z) = p(c|z) d p(c|z)."""
    if LOG_RESP:
        grad_resp = grad_resp * resp
    return grad_resp


@triton.jit
def _responsibility_product(gq, gk, RESP_PRECISION: tl.constexpr):
    """sum_c p(c|z_i) p(c|z_j) for a ``[BLOCK_T, BLOCK_S]`` tile (eq. 10 before its normaliser): M has rank C, one
    matrix product of the two blocks' responsibilities, in float32."""
    return tl.dot(gq, tl.trans(gk), input_precision=RESP_PRECISION)


@triton.jit
def _allowed_tile(BLOCKED, blocked_strides, offs_t, offs_s, mask_t, mask_s, HAS_BLOCKED: tl.constexpr):
    """Which (query, key) pairs of the tile exist and may attend (not padding, not a future key)."""
    allowed = mask_t[:, None] & mask_s[None, :]
    if HAS_BLOCKED:
        blocked = tl.load(_row_tile(BLOCKED, blocked_strides, offs_t, offs_s), mask=allowed, other=1)
        allowed = allowed & (blocked == 0)
    return allowed


@triton.jit
def _add_score_bias(scores, BIAS, bias_strides, offs_t, offs_s, mask_t, mask_s, HAS_BIAS: tl.constexpr):
    """The scores of the tile plus the score bias (a relative-position term added before eq. (1)), in fp32."""
    if HAS_BIAS:
        bias = tl.load(_row_tile(BIAS, bias_strides, offs_t, offs_s), mask=mask_t[:, None] & mask_s[None, :],
                       other=0.0)
        scores = scores + bias.to(tl.float32)
    return scores


@triton.jit
def _dropout_scale(seed, dropout_p, bh, T, S, offs_t, offs_s):
    """1 / (1 - p) where the attention weight is kept, else 0 (Philox, by seed and position)."""
    keep = tl.rand(seed, (bh * T + offs_t[:, None]) * S + offs_s[None, :]) >= dropout_p
    return tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)


@triton.jit(do_not_specialize=_SIZES)
def _attention_forward(Q, q_strides, K, k_strides, V, v_strides, GQ, gq_strides, GK, gk_strides,
                       BLOCKED, blocked_stride_b, blocked_stride_h, blocked_stride_t,
                       BIAS, bias_stride_b, bias_stride_h, bias_stride_t, MIX, OUT, OUT_MASKED, STATS, MIX_USED,
                       H, T, S, D, seed, dropout_p, sm_scale,
                       C: tl.constexpr, LOG_RESP: tl.constexpr, AUTHORS: tl.constexpr, HAS_BLOCKED: tl.constexpr,
                       HAS_BIAS: tl.constexpr,
                       DROPOUT: tl.constexpr, SAVE: tl.constexpr, EPS: tl.constexpr, FLOOR: tl.constexpr,
                       NEG: tl.constexpr, DOT_PRECISION: tl.constexpr, RESP_PRECISION: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """A_hat V of eq. (11) for ``BLOCK_T`` queries of one (sentence, head): one pass over the keys with an online
    softmax, accumulating sum_j A_ij v_j and sum_j M_ij A_ij v_j side by side (M rebuilt per tile from p(c|z), eq.
    10). Writes ``OUT`` [B, H, T, D] and, with ``SAVE`` (a backward follows), the masked branch ``OUT_MASKED``,
    ``STATS`` [3, B*H, T] (log-sum-exp, r_i, Z_i) and the g it used (``MIX_USED``). Grid: (query blocks, B*H)."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t, mask_d = offs_t < T, offs_d < D
    q = tl.load(_tile(_head(Q, q_strides, b, h), q_strides, offs_t, offs_d), mask=mask_t[:, None] & mask_d[None, :],
                other=0.0)
    K, V = _head(K, k_strides, b, h), _head(V, v_strides, b, h)
    GQ, GK = _head(GQ, gq_strides, b, h), _head(GK, gk_strides, b, h)
    BLOCKED, blocked_strides = _mask_head(BLOCKED, blocked_stride_b, blocked_stride_h, blocked_stride_t, b, h)
    BIAS, bias_strides = _mask_head(BIAS, bias_stride_b, bias_stride_h, bias_stride_t, b, h)
    offs_c = tl.arange(0, BLOCK_C)
    gq = _responsibilities(GQ, gq_strides, offs_t, mask_t, offs_c, C, LOG_RESP)
    row_max = tl.full((BLOCK_T,), NEG, tl.float32)
    row_sum = tl.zeros((BLOCK_T,), tl.float32)  # l_i = sum_j exp(s_ij - m_i)
    masked_sum = tl.zeros((BLOCK_T,), tl.float32)  # sum_j exp(s_ij - m_i) P_ij
    mask_norm = tl.zeros((BLOCK_T,), tl.float32)  # r_i = sum_{j allowed} P_ij (the authors' normaliser of M)
    acc_plain = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    acc_masked = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for start in range(0, S, BLOCK_S):
        offs_s = start + tl.arange(0, BLOCK_S)
        mask_s = offs_s < S
        k_t = K + offs_s[None, :] * k_strides[2] + offs_d[:, None] * k_strides[3]  # k transposed, [BLOCK_D, BLOCK_S]
        k = tl.load(k_t, mask=mask_s[None, :] & mask_d[:, None], other=0.0)
        scores = _dot(q, k, DOT_PRECISION) * sm_scale  # [BLOCK_T, BLOCK_S]
        scores = _add_score_bias(scores, BIAS, bias_strides, offs_t, offs_s, mask_t, mask_s, HAS_BIAS)
        allowed = _allowed_tile(BLOCKED, blocked_strides, offs_t, offs_s, mask_t, mask_s, HAS_BLOCKED)
        scores = tl.where(allowed, scores, NEG)
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        weights = tl.where(allowed, tl.exp(scores - new_max[:, None]), 0.0)
        rescale = tl.exp(row_max - new_max)
        gk = _responsibilities(GK, gk_strides, offs_s, mask_s, offs_c, C, LOG_RESP)
        product = _responsibility_product(gq, gk, RESP_PRECISION)
        if AUTHORS:
            mask_norm += tl.sum(tl.where(allowed, product, 0.0), 1)
            semantic = product
        else:
            semantic = product + FLOOR
        masked = weights * semantic
        row_sum = row_sum * rescale + tl.sum(weights, 1)
        masked_sum = masked_sum * rescale + tl.sum(masked, 1)
        if DROPOUT:
            keep = _dropout_scale(seed, dropout_p, bh, T, S, offs_t, offs_s)
            weights *= keep
            masked *= keep
        v = tl.load(_tile(V, v_strides, offs_s, offs_d), mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        acc_plain = acc_plain * rescale[:, None] + _dot(weights.to(v.dtype), v, DOT_PRECISION)
        acc_masked = acc_masked * rescale[:, None] + _dot(masked.to(v.dtype), v, DOT_PRECISION)
        row_max = new_max
    attended = row_sum > 0  # False where every key is blocked: the output is 0 there, as in the explicit kernel
    row_sum = tl.where(attended, row_sum, 1.0)
    if AUTHORS:
        norm_r = tl.maximum(mask_norm, EPS)
    else:
        norm_r = tl.full((BLOCK_T,), 1.0, tl.float32)
    mass = masked_sum / (row_sum * norm_r)  # Z_i = sum_j M_ij A_ij
    if AUTHORS:
        norm_z = tl.maximum(mass, EPS)
    else:
        norm_z = tl.where(mass > 0, mass, 1.0)
    mix = tl.load(MIX).to(tl.float32)
    out_plain = acc_plain / row_sum[:, None]  # sum_j A_ij v_j
    out_masked = acc_masked / (row_sum * norm_r * norm_z)[:, None]  # sum_j A_bar_ij v_j
    out = (1.0 - mix) * out_plain + mix * out_masked  # eq. (11)
    rows = _tile(_head(0, q_strides, b, h), q_strides, offs_t, offs_d)  # the output in q's layout
    store = mask_t[:, None] & mask_d[None, :]
    tl.store(OUT + rows, out.to(OUT.dtype.element_ty), mask=store)
    if SAVE:
        tl.store(OUT_MASKED + rows, out_masked.to(OUT_MASKED.dtype.element_ty), mask=store)
        stats = bh * T + offs_t
        total = tl.num_programs(1) * T
        tl.store(STATS + stats, tl.where(attended, row_max + tl.log(row_sum), float("inf")), mask=mask_t)
        tl.store(STATS + total + stats, norm_r, mask=mask_t)
        tl.store(STATS + 2 * total + stats, mass, mask=mask_t)
        if (pid_t == 0) & (bh == 0):
            tl.store(MIX_USED, mix)


@triton.jit(do_not_specialize=_SIZES)
def _attention_row_sums(GRAD_OUT, grad_out_strides, OUT, OUT_MASKED, out_strides, ROW_SUMS, H, T, D, total,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """dO_i . O_i and dO_i . O_bar_i, per row (``ROW_SUMS`` [2, B*H, T]). Grid: (query blocks, B*H)."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    tile = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    grad = tl.load(_tile(_head(GRAD_OUT, grad_out_strides, b, h), grad_out_strides, offs_t, offs_d), mask=tile,
                   other=0.0).to(tl.float32)
    rows = _tile(_head(0, out_strides, b, h), out_strides, offs_t, offs_d)
    out = tl.load(OUT + rows, mask=tile, other=0.0).to(tl.float32)
    out_masked = tl.load(OUT_MASKED + rows, mask=tile, other=0.0).to(tl.float32)
    tl.store(ROW_SUMS + bh * T + offs_t, tl.sum(grad * out, 1), mask=offs_t < T)
    tl.store(ROW_SUMS + total + bh * T + offs_t, tl.sum(grad * out_masked, 1), mask=offs_t < T)


@triton.jit
def _forward_statistics(STATS, bh, T, offs_t, mask_t):
    """The forward pass's (log-sum-exp, r_i, Z_i) of a block of queries."""
    total = tl.num_programs(1) * T
    rows = bh * T + offs_t
    lse = tl.load(STATS + rows, mask=mask_t, other=float("inf"))
    norm_r = tl.load(STATS + total + rows, mask=mask_t, other=1.0)
    mass = tl.load(STATS + 2 * total + rows, mask=mask_t, other=1.0)
    return lse, norm_r, mass


@triton.jit
def _row_statistics(STATS, ROW_SUMS, bh, T, offs_t, mask_t):
    """The forward pass's (log-sum-exp, r_i, Z_i) and the backward's (dO . O, dO . O_bar) of a block of queries."""
    total = tl.num_programs(1) * T
    rows = bh * T + offs_t
    lse, norm_r, mass = _forward_statistics(STATS, bh, T, offs_t, mask_t)
    dot_all = tl.load(ROW_SUMS + rows, mask=mask_t, other=0.0)
    dot_masked = tl.load(ROW_SUMS + total + rows, mask=mask_t, other=0.0)
    return lse, norm_r, mass, dot_all, dot_masked


@triton.jit
def _mixed_tile(q, k, gq, gk, lse, norm_r, mass, mix, BLOCKED, blocked_strides, BIAS, bias_strides,
                offs_t, offs_s, mask_t, mask_s, sm_scale, AUTHORS: tl.constexpr, HAS_BLOCKED: tl.constexpr,
                HAS_BIAS: tl.constexpr, EPS: tl.constexpr, FLOOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
                RESP_PRECISION: tl.constexpr):
    """One ``[BLOCK_T, BLOCK_S]`` tile rebuilt from the forward pass's row statistics: (allowed, A, M, N_i, whether
    N_i renormalises, A_hat = A ((1 - g) + g M / N_i))."""
    allowed = _allowed_tile(BLOCKED, blocked_strides, offs_t, offs_s, mask_t, mask_s, HAS_BLOCKED)
    scores = _dot(q, tl.trans(k), DOT_PRECISION) * sm_scale
    scores = _add_score_bias(scores, BIAS, bias_strides, offs_t, offs_s, mask_t, mask_s, HAS_BIAS)
    attn = tl.where(allowed, tl.exp(scores - lse[:, None]), 0.0)  # A
    product = _responsibility_product(gq, gk, RESP_PRECISION)
    if AUTHORS:
        semantic = product / norm_r[:, None]  # M
        norm_z = tl.maximum(mass, EPS)
        renormalised = mass > EPS
    else:
        semantic = product + FLOOR
        norm_z = tl.where(mass > 0, mass, 1.0)
        renormalised = mass > 0
    mixed = attn * ((1.0 - mix) + mix * semantic / norm_z[:, None])  # A_hat
    return allowed, attn, semantic, norm_z, renormalised, mixed


@triton.jit(do_not_specialize=_SIZES)
def _attention_weights(Q, q_strides, K, k_strides, GQ, gq_strides, GK, gk_strides,
                       BLOCKED, blocked_stride_b, blocked_stride_h, blocked_stride_t,
                       BIAS, bias_stride_b, bias_stride_h, bias_stride_t, STATS, MIX_USED, WEIGHTS, H, T, S, D,
                       sm_scale, C: tl.constexpr, LOG_RESP: tl.constexpr, AUTHORS: tl.constexpr,
                       HAS_BLOCKED: tl.constexpr, HAS_BIAS: tl.constexpr, EPS: tl.constexpr, FLOOR: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, RESP_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """The weights A_hat of eq. (11) (before dropout; 0 at blocked keys), what the explicit kernel returns, for
    ``BLOCK_T`` queries of one (sentence, head), from the forward's row statistics: ``WEIGHTS`` [B, H, T, S] float32.
    Grid: (query blocks, B*H)."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    mask_t, mask_d = offs_t < T, offs_d < D
    q = tl.load(_tile(_head(Q, q_strides, b, h), q_strides, offs_t, offs_d), mask=mask_t[:, None] & mask_d[None, :],
                other=0.0)
    K, GK = _head(K, k_strides, b, h), _head(GK, gk_strides, b, h)
    BLOCKED, blocked_strides = _mask_head(BLOCKED, blocked_stride_b, blocked_stride_h, blocked_stride_t, b, h)
    BIAS, bias_strides = _mask_head(BIAS, bias_stride_b, bias_stride_h, bias_stride_t, b, h)
    mix = tl.load(MIX_USED)
    rows = bh * T + offs_t
    lse, norm_r, mass = _forward_statistics(STATS, bh, T, offs_t, mask_t)
    gq = _responsibilities(_head(GQ, gq_strides, b, h), gq_strides, offs_t, mask_t, offs_c, C, LOG_RESP)
    for start in range(0, S, BLOCK_S):
        offs_s = start + tl.arange(0, BLOCK_S)
        mask_s = offs_s < S
        k = tl.load(_tile(K, k_strides, offs_s, offs_d), mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        gk = _responsibilities(GK, gk_strides, offs_s, mask_s, offs_c, C, LOG_RESP)
        _, _, _, _, _, mixed = _mixed_tile(
            q, k, gq, gk, lse, norm_r, mass, mix, BLOCKED, blocked_strides, BIAS, bias_strides, offs_t, offs_s,
            mask_t, mask_s, sm_scale, AUTHORS, HAS_BLOCKED, HAS_BIAS, EPS, FLOOR, DOT_PRECISION, RESP_PRECISION)
        tl.store(WEIGHTS + rows[:, None] * S + offs_s[None, :], mixed, mask=mask_t[:, None] & mask_s[None, :])


@triton.jit
def _attention_backward_tile(q, k, v, grad_out, gq, gk, lse, norm_r, mass, dot_all, dot_masked, mix,
                             BLOCKED, blocked_strides, BIAS, bias_strides,
                             offs_t, offs_s, mask_t, mask_s, bh, T, S, seed, dropout_p, sm_scale,
                             AUTHORS: tl.constexpr, HAS_BLOCKED: tl.constexpr, HAS_BIAS: tl.constexpr,
                             DROPOUT: tl.constexpr, EPS: tl.constexpr, FLOOR: tl.constexpr,
                             DOT_PRECISION: tl.constexpr, RESP_PRECISION: tl.constexpr):
    """For one ``[BLOCK_T, BLOCK_S]`` tile: (d scores, d P for the responsibilities, the dropped A_hat), from the
    forward pass's row statistics (see the module docstring for the formulas)."""
    allowed, attn, semantic, norm_z, renormalised, mixed = _mixed_tile(
        q, k, gq, gk, lse, norm_r, mass, mix, BLOCKED, blocked_strides, BIAS, bias_strides, offs_t, offs_s, mask_t,
        mask_s, sm_scale, AUTHORS, HAS_BLOCKED, HAS_BIAS, EPS, FLOOR, DOT_PRECISION, RESP_PRECISION)
    grad_mixed = _dot(grad_out, tl.trans(v), DOT_PRECISION)  # dO_i . v_j
    if DROPOUT:
        keep = _dropout_scale(seed, dropout_p, bh, T, S, offs_t, offs_s)
        grad_mixed *= keep
        mixed *= keep
    inner = tl.where(renormalised, mix * dot_masked, 0.0)  # <dA_bar, A_bar> where Z_i > floor
    grad_w = (mix * grad_mixed - inner[:, None]) / norm_z[:, None]  # dW, W = M o A
    grad_attn = (1.0 - mix) * grad_mixed + grad_w * semantic
    grad_scores = attn * (grad_attn - (dot_all - inner)[:, None])
    grad_product = grad_w * attn  # dM
    if AUTHORS:
        grad_product = grad_product / norm_r[:, None]
        grad_norm_r = tl.where(norm_r > EPS, -(mix * dot_masked - inner) / norm_r, 0.0)  # only where Z_i <= eps
        grad_product = tl.where(allowed, grad_product + grad_norm_r[:, None], 0.0)
    return grad_scores, grad_product, mixed


@triton.jit(do_not_specialize=_SIZES)
def _attention_backward_keys(Q, q_strides, K, k_strides, V, v_strides, GQ, gq_strides, GK, gk_strides,
                             BLOCKED, blocked_stride_b, blocked_stride_h, blocked_stride_t,
                             BIAS, bias_stride_b, bias_stride_h, bias_stride_t, GRAD_OUT, grad_out_strides,
                             STATS, ROW_SUMS, MIX_USED, GRAD_K, GRAD_V, GRAD_GK, H, T, S, D, seed, dropout_p,
                             sm_scale, C: tl.constexpr, LOG_RESP: tl.constexpr, AUTHORS: tl.constexpr,
                             HAS_BLOCKED: tl.constexpr, HAS_BIAS: tl.constexpr,
                             DROPOUT: tl.constexpr, EPS: tl.constexpr, FLOOR: tl.constexpr,
                             DOT_PRECISION: tl.constexpr, RESP_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """The keys' side of eq. (11)'s backward for ``BLOCK_S`` keys of one (sentence, head): one pass over the queries
    accumulating dk, dv and d p(c|z_j) (``GRAD_K``, ``GRAD_V`` [B, H, S, D], ``GRAD_GK`` [B, H, S, C]).
    Grid: (key blocks, B*H)."""
    pid_s = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    mask_s, mask_d = offs_s < S, offs_d < D
    kv_tile = mask_s[:, None] & mask_d[None, :]
    k = tl.load(_tile(_head(K, k_strides, b, h), k_strides, offs_s, offs_d), mask=kv_tile, other=0.0)
    v = tl.load(_tile(_head(V, v_strides, b, h), v_strides, offs_s, offs_d), mask=kv_tile, other=0.0)
    Q, GRAD_OUT = _head(Q, q_strides, b, h), _head(GRAD_OUT, grad_out_strides, b, h)
    GQ, GK = _head(GQ, gq_strides, b, h), _head(GK, gk_strides, b, h)
    BLOCKED, blocked_strides = _mask_head(BLOCKED, blocked_stride_b, blocked_stride_h, blocked_stride_t, b, h)
    BIAS, bias_strides = _mask_head(BIAS, bias_stride_b, bias_stride_h, bias_stride_t, b, h)
    mix = tl.load(MIX_USED)
    gk = _responsibilities(GK, gk_strides, offs_s, mask_s, offs_c, C, LOG_RESP)
    grad_k = tl.zeros((BLOCK_S, BLOCK_D), tl.float32)
    grad_v = tl.zeros((BLOCK_S, BLOCK_D), tl.float32)
    grad_gk = tl.zeros((BLOCK_S, BLOCK_C), tl.float32)
    for start in range(0, T, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        q_tile = mask_t[:, None] & mask_d[None, :]
        q = tl.load(_tile(Q, q_strides, offs_t, offs_d), mask=q_tile, other=0.0)
        grad_out = tl.load(_tile(GRAD_OUT, grad_out_strides, offs_t, offs_d), mask=q_tile, other=0.0).to(q.dtype)
        lse, norm_r, mass, dot_all, dot_masked = _row_statistics(STATS, ROW_SUMS, bh, T, offs_t, mask_t)
        gq = _responsibilities(GQ, gq_strides, offs_t, mask_t, offs_c, C, LOG_RESP)
        grad_scores, grad_product, mixed = _attention_backward_tile(
            q, k, v, grad_out, gq, gk, lse, norm_r, mass, dot_all, dot_masked, mix, BLOCKED, blocked_strides, BIAS,
            bias_strides, offs_t, offs_s, mask_t, mask_s, bh, T, S, seed, dropout_p, sm_scale, AUTHORS, HAS_BLOCKED,
            HAS_BIAS, DROPOUT, EPS, FLOOR, DOT_PRECISION, RESP_PRECISION)
        grad_v += _dot(tl.trans(mixed.to(grad_out.dtype)), grad_out, DOT_PRECISION)
        grad_k += _dot(tl.trans(grad_scores.to(q.dtype)), q, DOT_PRECISION)
        grad_gk += tl.dot(tl.trans(grad_product), gq, input_precision=RESP_PRECISION)  # sum_i dP_ij p(c|z_i)
    # each gradient in its input's layout
    grad_k *= sm_scale  # d (q.k s) / dk = s q
    tl.store(_tile(_head(GRAD_K, k_strides, b, h), k_strides, offs_s, offs_d), grad_k.to(GRAD_K.dtype.element_ty),
             mask=kv_tile)
    tl.store(_tile(_head(GRAD_V, v_strides, b, h), v_strides, offs_s, offs_d), grad_v.to(GRAD_V.dtype.element_ty),
             mask=kv_tile)
    tl.store(_tile(_head(GRAD_GK, gk_strides, b, h), gk_strides, offs_s, offs_c),
             _responsibility_gradient(grad_gk, gk, LOG_RESP),
             mask=mask_s[:, None] & (offs_c[None, :] < C))


@triton.jit(do_not_specialize=_SIZES)
def _attention_backward_queries(Q, q_strides, K, k_strides, V, v_strides, GQ, gq_strides, GK, gk_strides,
                                BLOCKED, blocked_stride_b, blocked_stride_h, blocked_stride_t,
                                BIAS, bias_stride_b, bias_stride_h, bias_stride_t, GRAD_OUT, grad_out_strides,
                                STATS, ROW_SUMS, MIX_USED, GRAD_Q, GRAD_GQ, GRAD_BIAS, H, T, S, D, seed, dropout_p,
                                sm_scale, C: tl.constexpr, LOG_RESP: tl.constexpr, AUTHORS: tl.constexpr,
                                HAS_BLOCKED: tl.constexpr,
                                HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, DROPOUT: tl.constexpr,
                                EPS: tl.constexpr, FLOOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                RESP_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                                BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """The queries' side of eq. (11)'s backward for ``BLOCK_T`` queries of one (sentence, head): one pass over the
    keys accumulating dq and d p(c|z_i) (``GRAD_Q`` [B, H, T, D], ``GRAD_GQ`` [B, H, T, C]) and, with
    ``BIAS_GRAD``, writing d scores (``GRAD_BIAS`` [B, H, T, S]). Grid: (query blocks, B*H)."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    mask_t, mask_d = offs_t < T, offs_d < D
    q_tile = mask_t[:, None] & mask_d[None, :]
    q = tl.load(_tile(_head(Q, q_strides, b, h), q_strides, offs_t, offs_d), mask=q_tile, other=0.0)
    grad_out = tl.load(_tile(_head(GRAD_OUT, grad_out_strides, b, h), grad_out_strides, offs_t, offs_d),
                       mask=q_tile, other=0.0).to(q.dtype)
    K, V = _head(K, k_strides, b, h), _head(V, v_strides, b, h)
    GQ, GK = _head(GQ, gq_strides, b, h), _head(GK, gk_strides, b, h)
    BLOCKED, blocked_strides = _mask_head(BLOCKED, blocked_stride_b, blocked_stride_h, blocked_stride_t, b, h)
    BIAS, bias_strides = _mask_head(BIAS, bias_stride_b, bias_stride_h, bias_stride_t, b, h)
    mix = tl.load(MIX_USED)
    lse, norm_r, mass, dot_all, dot_masked = _row_statistics(STATS, ROW_SUMS, bh, T, offs_t, mask_t)
    gq = _responsibilities(GQ, gq_strides, offs_t, mask_t, offs_c, C, LOG_RESP)
    grad_q = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    grad_gq = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
    for start in range(0, S, BLOCK_S):
        offs_s = start + tl.arange(0, BLOCK_S)
        mask_s = offs_s < S
        kv_tile = mask_s[:, None] & mask_d[None, :]
        k = tl.load(_tile(K, k_strides, offs_s, offs_d), mask=kv_tile, other=0.0)
        v = tl.load(_tile(V, v_strides, offs_s, offs_d), mask=kv_tile, other=0.0)
        gk = _responsibilities(GK, gk_strides, offs_s, mask_s, offs_c, C, LOG_RESP)
        grad_scores, grad_product, _ = _attention_backward_tile(
            q, k, v, grad_out, gq, gk, lse, norm_r, mass, dot_all, dot_masked, mix, BLOCKED, blocked_strides, BIAS,
            bias_strides, offs_t, offs_s, mask_t, mask_s, bh, T, S, seed, dropout_p, sm_scale, AUTHORS, HAS_BLOCKED,
            HAS_BIAS, DROPOUT, EPS, FLOOR, DOT_PRECISION, RESP_PRECISION)
        grad_q += _dot(grad_scores.to(k.dtype), k, DOT_PRECISION)
        if BIAS_GRAD:  # d bias = d scores, one [T, S] tile per (query block, key block): reduced to its shape outside
            tl.store(GRAD_BIAS + (bh * T + offs_t[:, None]) * S + offs_s[None, :], grad_scores,
                     mask=mask_t[:, None] & mask_s[None, :])
        grad_gq += tl.dot(grad_product, gk, input_precision=RESP_PRECISION)  # sum_j dP_ij p(c|z_j)
    # each gradient in its input's layout
    grad_q *= sm_scale
    tl.store(_tile(_head(GRAD_Q, q_strides, b, h), q_strides, offs_t, offs_d), grad_q.to(GRAD_Q.dtype.element_ty),
             mask=q_tile)
    tl.store(_tile(_head(GRAD_GQ, gq_strides, b, h), gq_strides, offs_t, offs_c),
             _responsibility_gradient(grad_gq, gq, LOG_RESP),
             mask=mask_t[:, None] & (offs_c[None, :] < C))


def _rows_of(tensor: Optional[Tensor], shape) -> Tuple[Optional[Tensor], Tuple[int, int, int]]:
    """``tensor`` broadcast to ``shape`` ``[B, H, T, S]`` with unit stride along S (copied along S where it was
    broadcast there), and its strides along B, H, T (0 where broadcast); an absent tensor: (None, zeros)."""
    if tensor is None:
        return None, (0, 0, 0)
    expanded = tensor.expand(*shape)
    if expanded.stride(-1) != 1:
        expanded = tensor.expand(*tensor.shape[:-1], shape[-1]).contiguous().expand(*shape)
    return expanded, tuple(expanded.stride()[:3])


def _laid_out(tensor: Tensor, gaps: bool) -> Tensor:
    """``tensor`` if no two of its elements share memory and (unless ``gaps``) they fill their storage span in some
    order of its dimensions, else a contiguous copy (e.g. an expanded tensor)."""
    span = 1
    for size, stride in sorted((t for t in zip(tensor.shape, tensor.stride()) if t[0] != 1), key=lambda t: t[1]):
        if stride < span or (stride != span and not gaps):
            return tensor.contiguous()
        span = stride * size
    return tensor


def _non_overlapping(tensor: Tensor) -> Tensor:
    """``tensor`` if no two of its elements share memory, whatever the gaps between them (a cross-attention's p(c|.),
    a slice of the clustering's rows: the kernels read it and write its gradient by its strides), else a contiguous
    copy (an expanded tensor)."""
    return _laid_out(tensor, gaps=True)


def _strided_like(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """An uninitialised tensor with ``tensor``'s shape and strides (gaps included) in ``dtype``."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=dtype, device=tensor.device)


def _dense(tensor: Tensor) -> Tensor:
    """``tensor`` if its elements fill its storage span without overlap in some order of its dimensions (then
    ``torch.empty_like`` gives its strides, and the kernels write its output and gradient in its layout), else a
    contiguous copy (e.g. an expanded tensor)."""
    return _laid_out(tensor, gaps=False)


class _AttentionShapes(NamedTuple):
    B: int
    H: int
    T: int
    S: int
    D: int
    C: int


# The responsibilities' products (M of eq. 10 and its gradients): float32 in full precision. Their inner dimension is
# the clusters (at most a few dozen), so CUDA-core FMAs cost little, and they hold fewer registers than the tensor
# cores' layouts: compiled for sm_90 at head dim 128, the backward kernels fit 32 x 32 tiles without a spill where
# tf32 or tf32x3 products spill at every tile size down to 16 x 16 (sdma-kernels-report)
_RESP_PRECISION = "ieee"


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 products in full precision unless torch allows tf32 (``torch.backends.cuda.matmul.allow_tf32``, which
    rounds inputs to 10 bits); halves on tensor cores."""
    if dtype == torch.bfloat16 and INTERPRETED:
        return "widen"
    return "ieee" if input_kind(dtype) == "ieee" else "tf32"


class _MixedAttention(torch.autograd.Function):
    """``(q, k, v, p(c|z_i), p(c|z_j), g, blocked, authors, dropout p, seed, score bias, scale, log_resp) -> A_hat
    V`` (see :func:`mixed_attention`)."""

    @staticmethod
    def forward(ctx, q, k, v, resp_query, resp_key, mix, blocked, authors, dropout_p, seed, score_bias, scale,
                log_resp, need_weights):
        B, H, T, D = q.shape
        S, C = k.size(2), resp_query.size(-1)
        shape = _AttentionShapes(B, H, T, S, D, C)
        full = (B, H, T, S)
        blocked_bytes, blocked_strides = _rows_of(None if blocked is None else blocked.view(torch.uint8), full)
        bias_rows, bias_strides = _rows_of(score_bias, full)
        save = any(ctx.needs_input_grad[:5]) or ctx.needs_input_grad[10]
        keep_stats = save or need_weights  # the weights are rebuilt from the row statistics
        # the output in q's layout (q is dense, mixed_attention sees to it): an adapter's [T, B, H, D] queries give a
        # [T, B, H, D] output, which it reshapes without a copy
        out = torch.empty_like(q)
        out_masked = torch.empty_like(q) if keep_stats else out
        stats = torch.empty(3, B * H, T, dtype=torch.float32, device=q.device) if keep_stats else out
        mix_used = torch.empty((), dtype=torch.float32, device=q.device)
        cfg = launch_config("attention_forward", D, q.dtype)
        block_t, block_s, block_d = _block(T, cfg.block_rows), _block(S, cfg.block_cols), _block(D, 1 << 20)
        _launch("attention_forward", _attention_forward, (triton.cdiv(T, block_t), B * H),
                (q, q.stride(), k, k.stride(), v, v.stride(), resp_query, resp_query.stride(), resp_key,
                 resp_key.stride(), blocked_bytes if blocked_bytes is not None else q, *blocked_strides,
                 bias_rows if bias_rows is not None else q, *bias_strides, mix, out, out_masked,
                 stats, mix_used, H, T, S, D, seed, float(dropout_p), float(scale)),
                dict(C=C, LOG_RESP=log_resp, AUTHORS=authors, HAS_BLOCKED=blocked is not None,
                     HAS_BIAS=score_bias is not None,
                     DROPOUT=dropout_p > 0, SAVE=keep_stats, EPS=AUTHORS_EPS, FLOOR=PAPER_MASK_FLOOR, NEG=_NEG,
                     DOT_PRECISION=_dot_precision(q.dtype), RESP_PRECISION=_RESP_PRECISION, BLOCK_T=block_t,
                     BLOCK_S=block_s, BLOCK_D=block_d, BLOCK_C=_block(C, 1 << 20)), cfg)
        ctx.call = None
        if _CALLS is not None:
            ctx.call = dict(kind="attention", dtype=str(q.dtype).replace("torch.", ""), clusters=C, head_dim=D,
                            authors=bool(authors), log_resp=bool(log_resp), blocked=_broadcast_pattern(blocked),
                            score_bias=_broadcast_pattern(score_bias), dropout=dropout_p > 0, backward=False,
                            bias_grad=False, weights=bool(need_weights))
            _CALLS.append(ctx.call)
        weights = None
        if need_weights:
            weights = torch.empty(full, dtype=torch.float32, device=q.device)
            cfg = launch_config("attention_weights", D, q.dtype)
            block_t, block_s = _block(T, cfg.block_rows), _block(S, cfg.block_cols)
            _launch("attention_weights", _attention_weights, (triton.cdiv(T, block_t), B * H),
                    (q, q.stride(), k, k.stride(), resp_query, resp_query.stride(), resp_key, resp_key.stride(),
                     blocked_bytes if blocked_bytes is not None else q, *blocked_strides,
                     bias_rows if bias_rows is not None else q, *bias_strides, stats, mix_used, weights, H, T, S, D,
                     float(scale)),
                    dict(C=C, LOG_RESP=log_resp, AUTHORS=authors, HAS_BLOCKED=blocked is not None,
                         HAS_BIAS=score_bias is not None, EPS=AUTHORS_EPS, FLOOR=PAPER_MASK_FLOOR,
                         DOT_PRECISION=_dot_precision(q.dtype), RESP_PRECISION=_RESP_PRECISION, BLOCK_T=block_t,
                         BLOCK_S=block_s, BLOCK_D=block_d, BLOCK_C=_block(C, 1 << 20)), cfg)
            # an unused output's gradient stays None (fairseq asks for the weights and most criteria ignore them);
            # one that reaches them is refused in backward rather than dropped
            ctx.set_materialize_grads(False)
        if save:
            ctx.save_for_backward(q, k, v, resp_query, resp_key, blocked_bytes, bias_rows, out, out_masked, stats,
                                  mix_used)
            ctx.strides = (blocked_strides, bias_strides)
            ctx.bias_shape = None if score_bias is None else score_bias.shape
            ctx.shape, ctx.authors, ctx.dropout_p, ctx.seed = shape, authors, float(dropout_p), seed
            ctx.scale, ctx.log_resp = float(scale), log_resp
            ctx.has_blocked = blocked is not None
        return (out, weights) if need_weights else out

    @staticmethod
    def backward(ctx, grad_out, *grad_weights):
        if grad_weights and grad_weights[0] is not None:
            raise SDMAConfigError(
                "attention_kernel=triton returns the attention weights A_hat without a gradient (a loss on them, "
                "e.g. fairseq's label_smoothed_cross_entropy_with_alignment, needs --sdma-attention-kernel explicit)")
        if grad_out is None:
            return (None,) * 14
        q, k, v, resp_query, resp_key, blocked_bytes, bias_rows, out, out_masked, stats, mix_used = ctx.saved_tensors
        blocked_strides, bias_strides = ctx.strides
        B, H, T, S, D, C = ctx.shape
        full = (B, H, T, S)
        bias_grad = bias_rows is not None and ctx.needs_input_grad[10]
        if ctx.call is not None:
            ctx.call.update(backward=True, bias_grad=bias_grad)
        common = dict(C=C, LOG_RESP=ctx.log_resp, AUTHORS=ctx.authors, HAS_BLOCKED=ctx.has_blocked,
                      HAS_BIAS=bias_rows is not None,
                      DROPOUT=ctx.dropout_p > 0, EPS=AUTHORS_EPS, FLOOR=PAPER_MASK_FLOOR,
                      DOT_PRECISION=_dot_precision(q.dtype), RESP_PRECISION=_RESP_PRECISION)
        block_d, block_c = _block(D, 1 << 20), _block(C, 1 << 20)
        row_sums = torch.empty(2, B * H, T, dtype=torch.float32, device=q.device)
        cfg = launch_config("row_sums", D, q.dtype)
        block_t = _block(T, cfg.block_rows)
        _launch("attention_row_sums", _attention_row_sums, (triton.cdiv(T, block_t), B * H),
                (grad_out, grad_out.stride(), out, out_masked, out.stride(), row_sums, H, T, D, B * H * T),
                dict(BLOCK_T=block_t, BLOCK_D=block_d), cfg)
        inputs = (q, q.stride(), k, k.stride(), v, v.stride(), resp_query, resp_query.stride(), resp_key,
                  resp_key.stride(), blocked_bytes if blocked_bytes is not None else q, *blocked_strides,
                  bias_rows if bias_rows is not None else q, *bias_strides, grad_out,
                  grad_out.stride(), stats, row_sums, mix_used)
        sizes = (H, T, S, D, ctx.seed, ctx.dropout_p, ctx.scale)
        # every gradient in its input's layout (the inputs are dense): the adapters' views back to their own layout
        # then copy nothing
        grad_k, grad_v = torch.empty_like(k), torch.empty_like(v)
        grad_resp_key = _strided_like(resp_key, torch.float32)
        cfg = launch_config("attention_backward_keys", D, q.dtype)
        block_t, block_s = _block(T, cfg.block_rows), _block(S, cfg.block_cols)
        _launch("attention_backward_keys", _attention_backward_keys, (triton.cdiv(S, block_s), B * H),
                (*inputs, grad_k, grad_v, grad_resp_key, *sizes),
                dict(**common, BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_D=block_d, BLOCK_C=block_c), cfg)
        grad_q = torch.empty_like(q)
        grad_resp_query = _strided_like(resp_query, torch.float32)
        # the bias's gradient is d scores, [B, H, T, S] (the T x S memory a flash kernel otherwise avoids), summed
        # over the dimensions the bias was broadcast along
        grad_scores = torch.empty(full, dtype=torch.float32, device=q.device) if bias_grad else None
        cfg = launch_config("attention_backward_queries", D, q.dtype)
        block_t, block_s = _block(T, cfg.block_rows), _block(S, cfg.block_cols)
        _launch("attention_backward_queries", _attention_backward_queries, (triton.cdiv(T, block_t), B * H),
                (*inputs, grad_q, grad_resp_query, grad_scores if bias_grad else q, *sizes),
                dict(**common, BIAS_GRAD=bias_grad, BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_D=block_d,
                     BLOCK_C=block_c), cfg)
        grad_bias = grad_scores.sum_to_size(ctx.bias_shape).to(bias_rows.dtype) if bias_grad else None
        return (grad_q, grad_k, grad_v, grad_resp_query.to(resp_query.dtype), grad_resp_key.to(resp_key.dtype),
                None, None, None, None, None, grad_bias, None, None, None)


def dropout_seed(dropout_p: float) -> int:
    """The Philox seed of one call's attention dropout (:func:`philox_seed`; 0 without dropout)."""
    return philox_seed() if dropout_p > 0 else 0


def mixed_attention(q: Tensor, k: Tensor, v: Tensor, resp_query: Tensor, resp_key: Tensor, mix: Tensor, *,
                    authors: bool, blocked: Optional[Tensor] = None, dropout_p: float = 0.0,
                    seed: Optional[int] = None, score_bias: Optional[Tensor] = None, scale: float = 1.0,
                    log_responsibilities: bool = False, need_weights: bool = False):
    """A_hat V of eq. (11) in one flash-style kernel (its backward in three).

    ``q [B, H, T, D]`` (the scores are ``scale`` q.k: 1/sqrt(d_k) for unscaled queries, so the scaling costs no
    pass of its own forward or backward), ``k, v [B, H, S, D]`` (float32/float16/bfloat16, one dtype), ``resp_query
    [B, H, T, C]`` and ``resp_key [B, H, S, C]`` p(c|.) of eq. (9) (with ``log_responsibilities``: log p(c|.), as the
    clustering gives it, and their gradients those of the logs: no exp before the kernel, no product after it),
    ``mix`` g (a tensor, read on the device; the value of this call is kept for backward), ``authors`` the reading of
    eq. (10)'s mask, ``blocked`` bool broadcastable to ``[B, H, T, S]`` (True: padding or a future key; None),
    ``dropout_p`` attention dropout on A_hat (``seed`` its Philox seed; :func:`dropout_seed` draws one),
    ``score_bias`` added to the scaled scores before eq. (1) (T5's position bias, the
    Conformer's matrix_bd), broadcastable to ``[B, H, T, S]``, differentiable (its gradient is formed at ``[B, H, T,
    S]`` in float32, then summed over its broadcast dimensions). Returns ``[B, H, T, D]`` in ``q``'s dtype; a query
    whose keys are all blocked gets 0 (as the explicit kernel). ``need_weights``: returns ``(that, A_hat [B, H, T,
    S])``, the weights before dropout in float32 from one more kernel (fairseq asks for a decoder layer's weights in
    training): they carry no gradient, and a loss on them raises in backward.
    """
    check_supported(q, k, v, score_bias)
    B, H, T, D = q.shape
    if k.dim() != 4 or k.shape[:2] != (B, H) or k.size(-1) != D or v.shape != k.shape:
        raise SDMAConfigError(f"mixed_attention: k and v must be [B, H, S, D] = [{B}, {H}, S, {D}], got "
                              f"{list(k.shape)} and {list(v.shape)}")
    if resp_query.shape[:3] != (B, H, T) or resp_key.shape[:3] != (B, H, k.size(2)) or (
            resp_query.size(-1) != resp_key.size(-1)):
        raise SDMAConfigError(f"mixed_attention: the responsibilities must be [B, H, T, C] and [B, H, S, C], got "
                              f"{list(resp_query.shape)} and {list(resp_key.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise SDMAConfigError(f"mixed_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 0.0 <= dropout_p < 1.0:
        raise SDMAConfigError(f"mixed_attention: dropout_p={dropout_p} must lie in [0, 1)")
    if blocked is not None:
        blocked = blocked.to(torch.bool)
        while blocked.dim() < 4:
            blocked = blocked.unsqueeze(0)
    if score_bias is not None:
        check_score_bias(score_bias, (B, H, T, k.size(2)), caller="mixed_attention: ")
    if seed is None:
        seed = dropout_seed(dropout_p)
    q, k, v = (_dense(t) for t in (q, k, v))
    resp_query, resp_key = _non_overlapping(resp_query), _non_overlapping(resp_key)
    return _MixedAttention.apply(q, k, v, resp_query, resp_key, mix.detach().reshape(()).float(), blocked, authors,
                                 float(dropout_p), seed, score_bias, float(scale), bool(log_responsibilities),
                                 bool(need_weights))


@triton.jit
def dropout_keep(OUT, seed, dropout_p, T, S, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """The scales :func:`mixed_attention` multiplies A_hat by for ``seed`` (``OUT`` [B*H, T, S]; grid (query tiles,
    key tiles, B*H)): read by :func:`latent_core.sdma.reference.dropout_scales`."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    bh = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    scale = _dropout_scale(seed, dropout_p, bh, T, S, offs_t, offs_s)
    tl.store(OUT + (bh * T + offs_t[:, None]) * S + offs_s[None, :], scale,
             mask=(offs_t < T)[:, None] & (offs_s < S)[None, :])


__all__ = ["LAUNCH", "LaunchConfig", "INTERPRETED", "check_supported", "gaussian_clustering", "mixed_attention",
           "sampling_noise", "philox_seed", "dropout_seed", "intercept_launches", "record_calls", "launch_config"]
