"""The regularisers of eq. (20)-(23) in Triton kernels, for all layers of an attention type at once
(``attention_kernel=triton``).

The eager terms (:class:`latent_core.sdma.regularisers._VadeKL`, ``_ClusterDiversity``) are a few dozen ATen ops each
way; on a GPU each is a kernel launch. Here one program per (layer, sentence, head) walks the positions once:

* forward: the KL of eq. (20) summed with the sentence weights 1 / (n_q L n_h), and the diversity of eq. (23) from
  the Gram matrix G = C^T C (C = p(c|z) at the real positions) and s_i = ||C_i||^2, weighted 1 / (n_q^2 L n_h); each
  program writes its two sums and its G (kept for backward); one ``sum`` adds the programs up per sentence.
* backward: d/d log p(c|z) of both terms (through q = exp(log p(c|z)); the diversity's
  4 [w_d (s_i - 1) - w_o s_i] C_i + 4 w_o G C_i), d/d log p(z, c=0) (the KL's -log p(z)), and per program the sums
  over its positions of the gradients of tr(Sigma_c^-1) and of log pi_c (the authors' categorical term); one ``sum``
  over the sentences gives the parameters' gradients.

The query terms, :func:`query_terms` (eq. 21 and 22), one program per (layer, sentence) over all heads:

* the normalisers of p(q_i^h | c) over the tokens (eq. 17) in both readings, one program per (layer, sentence,
  head); then L_Dqq (eq. 21) from p(q^h | q^h') = sum_c p(q^h | c) p(c | q^h') for every pair of heads, in the
  reading and (for the logged diagnostics) in the other one, and L_Dxq (eq. 22) with the critic f(q_i, x_j) =
  sum_c p(c|q_i) p(c|q_j) (eq. 19) tile by tile over the keys, keeping each row's normaliser sum_j exp f for backward;
* backward: a pass for sum_i P dP per head and cluster (the softmax over the tokens), then the gradients of
  log p(q, c) and log p(c|q) tile by tile (eq. 22's 2 g_i R_i - sum_j (W_ij + W_ji) R_j over the key tiles).

Inputs are clusters-first ``[C, L, T, B, H]`` (:func:`latent_core.sdma.mixture.clusters_first`), as the eager terms
take them. The learned posterior variance (ESPnet's ``var_estimation``: one s2 per position) stays on the eager
path. The tests hold values and gradients to the eager terms in Triton's interpreter.
"""

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

import triton
import triton.language as tl

import latent_core.sdma.triton_kernels as kernels
from latent_core.sdma.mixture import LOGVAR_RANGE
from latent_core.sdma.options import AUTHORS_EPS, LOG_2PI

_SIZES = ["L", "T", "B", "H"]
_QUERY_SIZES = ["L", "T", "B"]  # the query terms loop over the heads: H is a constant of their code


@triton.jit
def _responsibility_tile(LOG_RESP, pos, plane, offs_c, mask_t, mask_c):
    """log p(c|z) and p(c|z) at positions ``pos`` ``[BLOCK_T, BLOCK_C]`` (columns past C and rows past T: -inf and
    0)."""
    tile = mask_t[:, None] & mask_c[None, :]
    log_resp = tl.load(LOG_RESP + offs_c[None, :] * plane + pos[:, None], mask=tile, other=float("-inf"))
    resp = tl.where(tile, tl.exp(log_resp), 0.0)
    return tl.where(tile, log_resp, 0.0), resp, tile


@triton.jit
def _gmm_terms(LOG_VARS, PRIOR_LOGITS, layer, g, G, D, lv_min, lv_max, offs_c, mask_c, C: tl.constexpr,
               BLOCK_D: tl.constexpr, AUTHORS: tl.constexpr):
    """(tr(Sigma_c^-1) = sum_d exp(-clamped log-variance), log pi_c, pi_c) of GMM ``g`` of layer ``layer``
    (``LOG_VARS`` [L, G, C, D], ``PRIOR_LOGITS`` [L, G, C]), ``[BLOCK_C]`` each (0 past C)."""
    offs_d = tl.arange(0, BLOCK_D)
    tile = mask_c[:, None] & (offs_d < D)[None, :]
    log_vars = tl.load(LOG_VARS + ((layer * G + g) * C + offs_c[:, None]) * D + offs_d[None, :], mask=tile,
                       other=0.0).to(tl.float32)
    trace = tl.sum(tl.where(tile, tl.exp(-tl.minimum(tl.maximum(log_vars, lv_min), lv_max)), 0.0), 1)
    log_pi = tl.zeros_like(trace)
    pi = tl.zeros_like(trace)
    if AUTHORS:
        logits = tl.load(PRIOR_LOGITS + (layer * G + g) * C + offs_c, mask=mask_c, other=float("-inf")).to(tl.float32)
        shifted = logits - tl.max(logits, 0)
        log_pi = tl.where(mask_c, shifted - tl.log(tl.sum(tl.exp(shifted), 0)), 0.0)
        pi = tl.where(mask_c, tl.exp(log_pi), 0.0)
    return trace, log_pi, pi


@triton.jit
def _real_tokens(VALID, b, T, B, BLOCK_T: tl.constexpr):
    """n_q: the sentence's real tokens (at least 1), the sum of its ``VALID`` column."""
    count = tl.zeros((BLOCK_T,), tl.float32)
    for start in range(0, T, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        count += tl.load(VALID + offs_t * B + b, mask=offs_t < T, other=0.0)
    return tl.maximum(tl.sum(count, 0), 1.0)


@triton.jit(do_not_specialize=_SIZES)
def _feature_terms_forward(LOG_JOINT, LOG_RESP, LOG_VARS, PRIOR_LOGITS, VALID, SUMS, GRAM, L, T, B, H, G, D, half_var,
                           base_constant, diag_weight, off_weight, lv_min, lv_max, C: tl.constexpr,
                           AUTHORS: tl.constexpr, MASKED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """Eq. (20) and (23) of one layer, sentence and head (program ``(l * B + b) * H + h``, GMM ``h % G``):
    ``SUMS[0]`` the KL summed with the weights 1 / (n_q L H) over the real tokens, ``SUMS[1]`` the diversity
    weighted 1 / (n_q^2 L H), ``GRAM`` G = C^T C ``[BLOCK_C, BLOCK_C]``."""
    pid = tl.program_id(0)
    h = pid % H
    b = (pid // H) % B
    layer = pid // (H * B)
    plane = L * T * B * H  # between clusters
    base = layer * T * B * H + b * H + h
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    trace, log_pi, pi = _gmm_terms(LOG_VARS, PRIOR_LOGITS, layer, h % G, G, D, lv_min, lv_max, offs_c, mask_c, C,
                                   BLOCK_D, AUTHORS)
    constant = base_constant
    if AUTHORS:  # sum_c pi_c s2/2 tr_c, taken out of the sum over c (see _VadeKL)
        constant += tl.sum(pi * half_var * trace, 0)
    n_q = _real_tokens(VALID, b, T, B, BLOCK_T)
    kl = tl.zeros((BLOCK_T,), tl.float32)
    diag = tl.zeros((BLOCK_T,), tl.float32)
    self_sim_squares = tl.zeros((BLOCK_T,), tl.float32)
    gram = tl.zeros((BLOCK_C, BLOCK_C), tl.float32)
    for start in range(0, T, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        pos = base + offs_t * (B * H)
        log_resp, resp, tile = _responsibility_tile(LOG_RESP, pos, plane, offs_c, mask_t, mask_c)
        log_joint_0 = tl.load(LOG_JOINT + pos, mask=mask_t, other=0.0)
        log_resp_0 = tl.sum(tl.where(offs_c[None, :] == 0, log_resp, 0.0), 1)
        per_token = log_resp_0 - log_joint_0  # -log p(z)
        if AUTHORS:  # + sum_c (q_c + pi_c) u_c, u_c = log pi_c + s2/2 tr_c - log q_c
            slope = log_pi[None, :] + half_var * trace[None, :] - log_resp
            per_token += tl.sum(tl.where(tile, (resp + pi[None, :]) * slope, 0.0), 1)
        else:  # + s2/2 sum_c q_c tr_c
            per_token += half_var * tl.sum(resp * trace[None, :], 1)
        real = tl.load(VALID + offs_t * B + b, mask=mask_t, other=0.0)
        kl += real * (per_token - constant)
        valid = real if MASKED else tl.where(mask_t, 1.0, 0.0)
        masked = resp * valid[:, None]  # C_i
        gram += tl.dot(tl.trans(masked), masked, input_precision="ieee")
        self_sim = tl.sum(masked * masked, 1)  # s_i
        diag += valid * (self_sim - 1.0) * (self_sim - 1.0)
        self_sim_squares += self_sim * self_sim
    off = tl.sum(tl.sum(gram * gram, 1), 0) - tl.sum(self_sim_squares, 0)
    tl.store(SUMS + pid, tl.sum(kl, 0) / (n_q * (L * H)))
    tl.store(SUMS + L * B * H + pid, (diag_weight * tl.sum(diag, 0) + off_weight * off) / (n_q * n_q * (L * H)))
    tl.store(GRAM + pid * BLOCK_C * BLOCK_C + offs_c[:, None] * BLOCK_C + offs_c[None, :], gram)


@triton.jit(do_not_specialize=_SIZES)
def _feature_terms_backward(LOG_RESP, LOG_VARS, PRIOR_LOGITS, VALID, GRAM, GRAD_KL, GRAD_DV, GRAD_LOG_JOINT,
                            GRAD_LOG_RESP, PARTIAL, L, T, B, H, G, D, half_var, diag_weight, off_weight, lv_min,
                            lv_max, C: tl.constexpr, AUTHORS: tl.constexpr, MASKED: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """The backward of :func:`_feature_terms_forward` for one layer, sentence and head: ``GRAD_LOG_JOINT`` and
    ``GRAD_LOG_RESP`` at its positions (clusters-first), and ``PARTIAL[0]`` / ``PARTIAL[1]`` ``[L, B, H, C]`` its
    sums of the gradients of tr(Sigma_c^-1) and log pi_c (:func:`_feature_parameter_grads` adds them up)."""
    pid = tl.program_id(0)
    h = pid % H
    b = (pid // H) % B
    layer = pid // (H * B)
    plane = L * T * B * H
    base = layer * T * B * H + b * H + h
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    trace, log_pi, pi = _gmm_terms(LOG_VARS, PRIOR_LOGITS, layer, h % G, G, D, lv_min, lv_max, offs_c, mask_c, C,
                                   BLOCK_D, AUTHORS)
    gram = tl.load(GRAM + pid * BLOCK_C * BLOCK_C + offs_c[:, None] * BLOCK_C + offs_c[None, :])
    n_q = _real_tokens(VALID, b, T, B, BLOCK_T)
    grad_kl = tl.load(GRAD_KL + b) / (n_q * (L * H))
    diversity_scale = 4.0 * tl.load(GRAD_DV + b) / (n_q * n_q * (L * H))
    grad_trace = tl.zeros((BLOCK_C,), tl.float32)
    grad_log_pi = tl.zeros((BLOCK_C,), tl.float32)
    for start in range(0, T, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        pos = base + offs_t * (B * H)
        log_resp, resp, tile = _responsibility_tile(LOG_RESP, pos, plane, offs_c, mask_t, mask_c)
        real = tl.load(VALID + offs_t * B + b, mask=mask_t, other=0.0)
        grad_token = real * grad_kl  # d out / d per_token
        first = tl.where(offs_c[None, :] == 0, 1.0, 0.0)
        # d(-log p(z)) = d(log q_0 - log p(z, 0))
        tl.store(GRAD_LOG_JOINT + offs_c[None, :] * plane + pos[:, None], -grad_token[:, None] * first, mask=tile)
        grad_log_resp = grad_token[:, None] * first
        if AUTHORS:  # through q_c and the explicit -log q_c of u_c: q_c u_c - (q_c + pi_c)
            slope = log_pi[None, :] + half_var * trace[None, :] - log_resp
            grad_log_resp += grad_token[:, None] * (resp * slope - resp - pi[None, :])
            grad_log_pi += tl.sum(tl.where(tile, grad_token[:, None] * (resp + pi[None, :] + pi[None, :] * (
                log_pi[None, :] - log_resp)), 0.0), 0)
        else:
            grad_log_resp += grad_token[:, None] * half_var * trace[None, :] * resp
        grad_trace += half_var * tl.sum(grad_token[:, None] * resp, 0)
        valid = real if MASKED else tl.where(mask_t, 1.0, 0.0)
        masked = resp * valid[:, None]
        self_sim = tl.sum(masked * masked, 1)
        coefficient = diag_weight * (self_sim - 1.0) - off_weight * self_sim
        grad_masked = coefficient[:, None] * masked + off_weight * tl.dot(masked, gram, input_precision="ieee")
        grad_log_resp += (diversity_scale * valid)[:, None] * grad_masked * resp
        tl.store(GRAD_LOG_RESP + offs_c[None, :] * plane + pos[:, None], grad_log_resp, mask=tile)
    tl.store(PARTIAL + pid * C + offs_c, grad_trace, mask=mask_c)
    tl.store(PARTIAL + (L * B * H + pid) * C + offs_c, grad_log_pi, mask=mask_c)


@triton.jit(do_not_specialize=_SIZES)
def _feature_parameter_grads(LOG_VARS, PRIOR_LOGITS, PARTIAL, GRAD_LOG_VARS, GRAD_PRIOR_LOGITS, L, B, H, G, D,
                             lv_min, lv_max, C: tl.constexpr, AUTHORS: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    """The GMMs' gradients from the programs' partial sums (program ``l * G + g``: the sentences, and the heads
    sharing the GMM): d tr / d log-variance = -exp(-v) inside the clamp's range, and the log-softmax's backward."""
    pid = tl.program_id(0)
    g = pid % G
    layer = pid // G
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    mask_c = offs_c < C
    grad_trace = tl.zeros((BLOCK_C,), tl.float32)
    grad_log_pi = tl.zeros((BLOCK_C,), tl.float32)
    for b in range(0, B):
        for h in range(g, H, G):
            program = (layer * B + b) * H + h
            grad_trace += tl.load(PARTIAL + program * C + offs_c, mask=mask_c, other=0.0)
            grad_log_pi += tl.load(PARTIAL + (L * B * H + program) * C + offs_c, mask=mask_c, other=0.0)
    tile = mask_c[:, None] & (offs_d < D)[None, :]
    params = ((layer * G + g) * C + offs_c[:, None]) * D + offs_d[None, :]
    log_vars = tl.load(LOG_VARS + params, mask=tile, other=0.0).to(tl.float32)
    inside = (log_vars >= lv_min) & (log_vars <= lv_max)
    tl.store(GRAD_LOG_VARS + params, tl.where(inside, -grad_trace[:, None] * tl.exp(-log_vars), 0.0), mask=tile)
    if AUTHORS:
        logits = tl.load(PRIOR_LOGITS + (layer * G + g) * C + offs_c, mask=mask_c, other=float("-inf")).to(tl.float32)
        pi = tl.exp(logits - tl.max(logits, 0))
        pi = pi / tl.sum(pi, 0)
        tl.store(GRAD_PRIOR_LOGITS + (layer * G + g) * C + offs_c, grad_log_pi - pi * tl.sum(grad_log_pi, 0),
                 mask=mask_c)


# Positions per step and warps, per kernel and its backward. Chosen with sdma-kernels-report: no spill for any
# recorded call on sm_80 and sm_90 (ptxas spills a few bytes of the query kernels at some other tile sizes, at well under
# its register limit; tests/integration/test_sdma_kernels_report.py holds them to none)
LAUNCH: Dict[str, kernels.LaunchConfig] = {
    "feature_terms": kernels.LaunchConfig(32, 0, 4, 1),
    "query_normalisers": kernels.LaunchConfig(16, 0, 4, 1),
    "query_terms": kernels.LaunchConfig(32, 0, 4, 1),
}


def _output_grads(first: Optional[Tensor], second: Optional[Tensor], batch: int, device) -> Tuple[Tensor, Tensor]:
    """The two per-sentence outputs' gradients, zeros for one that got none (autograd does not materialise them:
    ``set_materialize_grads(False)``, so the diagnostics' outputs cost no zeros)."""
    if first is None or second is None:
        zeros = torch.zeros(batch, dtype=torch.float32, device=device)
        first, second = (zeros if first is None else first), (zeros if second is None else second)
    return first.contiguous(), second.contiguous()


class _FeatureTerms(torch.autograd.Function):
    """``(log p(z, c), log p(c|z)) [C, L, T, B, H], log-variances [L, G, C, d], prior logits [L, G, C] or None,
    ...) -> (KL of eq. 20, diversity of eq. 23)``, each ``[B]`` (see :func:`feature_terms`)."""

    @staticmethod
    def forward(ctx, log_joint, log_resp, log_vars, prior_logits, valid, masked, posterior_var, diag_weight,
                off_weight):
        ctx.set_materialize_grads(False)
        clusters, layers, length, batch, heads = log_resp.shape
        groups, dim = log_vars.size(1), log_vars.size(-1)
        authors = prior_logits is not None
        cfg = LAUNCH["feature_terms"]
        block_t, block_c = kernels._block(length, cfg.block_rows), kernels._block(clusters, 1 << 20)
        block_d = triton.next_power_of_2(dim)
        programs = layers * batch * heads
        sums = torch.empty(2, layers, batch, heads, dtype=torch.float32, device=log_resp.device)
        gram = torch.empty(programs, block_c, block_c, dtype=torch.float32, device=log_resp.device)
        half_var = 0.5 * float(posterior_var)
        base_constant = 0.5 * dim * (LOG_2PI + math.log(posterior_var) + 1.0)
        kernels._launch("feature_terms_forward", _feature_terms_forward, (programs,),
                        (log_joint, log_resp, log_vars, prior_logits if authors else log_vars, valid, sums, gram,
                         layers, length, batch, heads, groups, dim, half_var, base_constant, float(diag_weight),
                         float(off_weight), *LOGVAR_RANGE),
                        dict(C=clusters, AUTHORS=authors, MASKED=masked, BLOCK_T=block_t, BLOCK_C=block_c,
                             BLOCK_D=block_d), cfg)
        ctx.call = None
        if kernels._CALLS is not None:  # float32 whatever the model's dtype
            ctx.call = dict(kind="feature_terms", dtype="float32", head_dim=dim, clusters=clusters, groups=groups,
                            authors=authors, masked=masked, backward=False)
            kernels._CALLS.append(ctx.call)
        ctx.save_for_backward(log_resp, log_vars, prior_logits, valid, gram)
        ctx.constants = (masked, half_var, float(diag_weight), float(off_weight), block_t, block_c, block_d)
        totals = sums.sum((1, 3))
        return totals[0], totals[1]

    @staticmethod
    def backward(ctx, grad_kl, grad_dv):
        log_resp, log_vars, prior_logits, valid, gram = ctx.saved_tensors
        masked, half_var, diag_weight, off_weight, block_t, block_c, block_d = ctx.constants
        clusters, layers, length, batch, heads = log_resp.shape
        groups, dim = log_vars.size(1), log_vars.size(-1)
        authors = prior_logits is not None
        if ctx.call is not None:
            ctx.call.update(backward=True)
        grad_kl, grad_dv = _output_grads(grad_kl, grad_dv, batch, log_resp.device)
        grad_log_joint = torch.empty_like(log_resp)
        grad_log_resp = torch.empty_like(log_resp)
        partial = torch.empty(2, layers, batch, heads, clusters, dtype=torch.float32, device=log_resp.device)
        prior = prior_logits if authors else log_vars
        constexprs = dict(C=clusters, AUTHORS=authors, BLOCK_C=block_c, BLOCK_D=block_d)
        kernels._launch("feature_terms_backward", _feature_terms_backward, (layers * batch * heads,),
                        (log_resp, log_vars, prior, valid, gram, grad_kl, grad_dv, grad_log_joint, grad_log_resp,
                         partial, layers, length, batch, heads, groups, dim, half_var, diag_weight, off_weight,
                         *LOGVAR_RANGE),
                        dict(constexprs, MASKED=masked, BLOCK_T=block_t), LAUNCH["feature_terms"])
        grad_log_vars = torch.empty(log_vars.shape, dtype=torch.float32, device=log_vars.device)
        grad_prior = torch.empty(prior.shape, dtype=torch.float32, device=prior.device) if authors else grad_log_vars
        kernels._launch("feature_parameter_grads", _feature_parameter_grads, (layers * groups,),
                        (log_vars, prior, partial, grad_log_vars, grad_prior, layers, batch, heads, groups, dim,
                         *LOGVAR_RANGE), constexprs, kernels.LaunchConfig(0, 0, 1, 1))
        return (grad_log_joint, grad_log_resp, grad_log_vars.to(log_vars.dtype),
                grad_prior.to(prior_logits.dtype) if authors else None, None, None, None, None, None)


def feature_terms(log_joint: Tensor, log_resp: Tensor, log_vars: Tensor, prior_logits: Optional[Tensor],
                  valid: Tensor, masked: bool, posterior_var: float, diag_weight: float,
                  off_weight: float) -> Tuple[Tensor, Tensor]:
    """(KL of eq. 20, cluster diversity of eq. 23) per sentence, ``[B]`` each, of one attention type's layers.

    ``log_joint``, ``log_resp``: log p(z, c) and log p(c|z), clusters-first ``[C, L, T, B, H]`` float32 (only
    ``log_joint[0]`` is read: -log p(z) = log p(c=0|z) - log p(z, c=0)); ``log_vars`` the layers' GMM log-variances
    ``[L, G, C, d]`` (G = H: one GMM per head; G = 1: one shared by the heads, the query GMM), clamped to
    :data:`LOGVAR_RANGE` in tr(Sigma_c^-1); ``prior_logits`` ``[L, G, C]``: the authors' categorical term
    KL(pi || q(c)) (None: the paper's); ``valid`` ``[T, B]`` the real tokens n_q counts and the KL's per-token
    weights 1 / (n_q L H) sum over; ``masked``: the diversity counts the real tokens only (else every position, the
    authors' padded length), weighted 1 / (n_q^2 L H); ``posterior_var`` s2 (a number); ``diag_weight``,
    ``off_weight`` the diversity's weights of its diagonal and off-diagonal entries. Equal to ``_VadeKL`` and
    ``_ClusterDiversity`` of :mod:`latent_core.sdma.regularisers` with the same arguments.
    """
    kernels.check_supported(log_resp, option="attention_kernel=triton (the regularisers)")
    if log_vars.dim() != 4 or log_resp.size(-1) % log_vars.size(1) or log_vars.size(2) != log_resp.size(0):
        raise ValueError(f"feature_terms: log_vars must be [L, G, C, d] with G dividing the heads "
                         f"({log_resp.size(-1)}) and C = {log_resp.size(0)}, got {list(log_vars.shape)}")
    return _FeatureTerms.apply(log_joint.float().contiguous(), log_resp.float().contiguous(), log_vars.contiguous(),
                               None if prior_logits is None else prior_logits.contiguous(),
                               valid.float().contiguous(), bool(masked), posterior_var, diag_weight, off_weight)


# ----------------------------------------------------------------------------------------------------------
# The query terms of eq. (21) and (22)
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _query_tile(X, h, layer, b, offs_t, offs_c, L, T, B, H):
    """Offsets and mask of the ``[BLOCK_T, BLOCK_C]`` tile of head ``h`` at positions ``offs_t`` of a clusters-first
    ``[C, L, T, B, H]`` tensor with C = the mask's columns."""
    return X + offs_c[None, :] * (L * T * B * H) + (layer * T * B * H + offs_t * (B * H) + b * H + h)[:, None]


@triton.jit
def _token_given_cluster(LOG_JOINT, LOG_NORMS, h, layer, b, offs_t, offs_c, tile, valid, L, T, B, H,
                         C: tl.constexpr, BLOCK_C: tl.constexpr):
    """p(q_i^h | c) of eq. (17) at a tile of head ``h``: the exact softmax over the real tokens and the authors'
    exp(x - layer max) / max(sum, 1e-6), from the normalisers of the first pass."""
    x = tl.load(_query_tile(LOG_JOINT, h, layer, b, offs_t, offs_c, L, T, B, H), mask=tile, other=0.0)
    norms = LOG_NORMS + ((layer * B + b) * H + h) * BLOCK_C + offs_c
    exact = tl.where(tile & (valid[:, None] > 0), tl.exp(x - tl.load(norms)[None, :]), 0.0)
    theirs = tl.where(tile, tl.exp(x - tl.load(norms + L * B * H * BLOCK_C)[None, :]), 0.0)
    return exact, theirs


@triton.jit
def _responsibilities(LOG_RESP, h, layer, b, offs_t, offs_c, tile, L, T, B, H):
    """p(c | q_i^h) at a tile of head ``h`` (0 outside it)."""
    return tl.where(tile, tl.exp(tl.load(_query_tile(LOG_RESP, h, layer, b, offs_t, offs_c, L, T, B, H), mask=tile,
                                         other=0.0)), 0.0)


@triton.jit
def _pair_slope(p, AUTHORS: tl.constexpr, EPS: tl.constexpr):
    """(-log(1 - p) of eq. 21 with the reading's clamp, its derivative d/dp)."""
    if AUTHORS:  # -log(1 - min(p, 1) + eps)
        one_minus = 1.0 - tl.minimum(p, 1.0) + EPS
        return -tl.log(one_minus), tl.where(p <= 1.0, 1.0 / one_minus, 0.0)
    clamped = tl.minimum(p, 1.0 - EPS)  # -log1p(-min(p, 1 - 1e-6))
    return -tl.log(1.0 - clamped), tl.where(p <= 1.0 - EPS, 1.0 / (1.0 - clamped), 0.0)


@triton.jit(do_not_specialize=_SIZES)
def _query_normalisers(LOG_JOINT, LOG_RESP, VALID, LAYER_MAX, LOG_NORMS, RAW_NORMS, CRITIC_NORMS, DXQ, L, T, B, H,
                       C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """What one layer, sentence and head contributes on its own (program ``(l * B + b) * H + h``): the normalisers of
    p(q_i^h | c) over the tokens, ``LOG_NORMS[0]`` log sum_{i real} exp(x_i) (the exact softmax), ``LOG_NORMS[1]``
    layer max + log max(sum_i exp(x_i - layer max), 1e-6) (the authors'), ``RAW_NORMS`` the authors' sum before its
    clamp; and eq. (22): ``DXQ`` its weighted sum of log softmax_j f(q_i, x_j) at j = i, f(q_i, x_j) = sum_c p(c|q_i)
    p(c|q_j) (eq. 19) over the real j, with ``CRITIC_NORMS`` [L, B, H, T] each row's sum_j exp f (for backward)."""
    pid = tl.program_id(0)
    h = pid % H
    b = (pid // H) % B
    layer = pid // (H * B)
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    layer_max = tl.load(LAYER_MAX + layer)
    running_max = tl.full((BLOCK_C,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_C,), tl.float32)
    theirs = tl.zeros((BLOCK_C,), tl.float32)
    for start in range(0, T, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        tile = mask_t[:, None] & mask_c[None, :]
        x = tl.load(_query_tile(LOG_JOINT, h, layer, b, offs_t, offs_c, L, T, B, H), mask=tile, other=float("-inf"))
        theirs += tl.sum(tl.where(tile, tl.exp(x - layer_max), 0.0), 0)
        valid = tl.load(VALID + offs_t * B + b, mask=mask_t, other=0.0)
        x = tl.where(valid[:, None] > 0, x, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(x, 0))
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift[None, :]), 0)
        running_max = new_max
    out = pid * BLOCK_C + offs_c
    # a column with no real token (past C, or an empty sentence): -inf, its p(q | c) 0
    tl.store(LOG_NORMS + out, running_max + tl.log(tl.maximum(running_sum, 1e-30)))
    tl.store(LOG_NORMS + L * B * H * BLOCK_C + out, layer_max + tl.log(tl.maximum(theirs, 1e-6)))
    tl.store(RAW_NORMS + out, tl.where(mask_c, theirs, 1.0))
    # eq. (22), this head's rows tile by tile over the keys, weighted 1 / (n_q L H)
    per_head = 1.0 / (_real_tokens(VALID, b, T, B, BLOCK_T) * (L * H))
    dxq = 0.0
    for start in range(0, T, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        tile = mask_t[:, None] & mask_c[None, :]
        w_head = tl.load(VALID + offs_t * B + b, mask=mask_t, other=0.0) * per_head
        resp_i = _responsibilities(LOG_RESP, h, layer, b, offs_t, offs_c, tile, L, T, B, H)
        norm = tl.zeros((BLOCK_T,), tl.float32)
        for key_start in range(0, T, BLOCK_T):
            offs_j = key_start + tl.arange(0, BLOCK_T)
            mask_j = offs_j < T
            tile_j = mask_j[:, None] & mask_c[None, :]
            resp_j = _responsibilities(LOG_RESP, h, layer, b, offs_j, offs_c, tile_j, L, T, B, H)
            critic = tl.dot(resp_i, tl.trans(resp_j), input_precision="ieee")
            key_valid = tl.load(VALID + offs_j * B + b, mask=mask_j, other=0.0) > 0
            norm += tl.sum(tl.where(key_valid[None, :], tl.exp(critic), 0.0), 1)
        own = tl.sum(resp_i * resp_i, 1)
        dxq += tl.sum(tl.where(w_head != 0, w_head * (own - tl.log(norm)), 0.0), 0)
        tl.store(CRITIC_NORMS + pid * T + offs_t, norm, mask=mask_t)
    tl.store(DXQ + pid, dxq)


@triton.jit(do_not_specialize=_QUERY_SIZES)
def _query_terms_forward(LOG_JOINT, LOG_RESP, VALID, LOG_NORMS, RAW_NORMS, DXQ, SUMS, L, T, B,
                         H: tl.constexpr, C: tl.constexpr, AUTHORS: tl.constexpr, EPS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Eq. (21) and (22) of one layer and sentence (program ``l * B + b``), all heads, weighted 1 / (n_q L H^2) and
    1 / (n_q L H) over the real tokens: ``SUMS[0]`` L_Dqq in the reading, ``SUMS[1]`` in the other reading (a
    diagnostic), ``SUMS[2]`` L_Dxq (the heads' ``DXQ``), ``SUMS[3]`` how many of the authors' normalisers sit at
    their clamp."""
    pid = tl.program_id(0)
    b = pid % B
    layer = pid // B
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    per_head = 1.0 / (_real_tokens(VALID, b, T, B, BLOCK_T) * (L * H))
    clamped = 0.0
    for h in tl.static_range(H):
        raw = tl.load(RAW_NORMS + ((layer * B + b) * H + h) * BLOCK_C + offs_c)
        clamped += tl.sum(tl.where(mask_c & (raw < EPS), 1.0, 0.0), 0)
    # eq. (21): one pass over the tokens, every pair of heads (the sums kept as scalars: fewer live registers)
    dqq = 0.0
    dqq_other = 0.0
    for start in range(0, T, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        tile = mask_t[:, None] & mask_c[None, :]
        valid = tl.load(VALID + offs_t * B + b, mask=mask_t, other=0.0)
        w_pair = valid * per_head / H
        for h in tl.static_range(H):
            exact, theirs = _token_given_cluster(LOG_JOINT, LOG_NORMS, h, layer, b, offs_t, offs_c, tile, valid,
                                                 L, T, B, H, C, BLOCK_C)
            for h2 in tl.static_range(H):
                if h2 != h:  # p(q^h | q^h') = sum_c p(q^h | c) p(c | q^h') (eq. 16)
                    resp = _responsibilities(LOG_RESP, h2, layer, b, offs_t, offs_c, tile, L, T, B, H)
                    exact_term, _ = _pair_slope(tl.sum(exact * resp, 1), False, EPS)
                    their_term, _ = _pair_slope(tl.sum(theirs * resp, 1), True, EPS)
                    if AUTHORS:
                        dqq += tl.sum(w_pair * their_term, 0)
                        dqq_other += tl.sum(w_pair * exact_term, 0)
                    else:
                        dqq += tl.sum(w_pair * exact_term, 0)
                        dqq_other += tl.sum(w_pair * their_term, 0)
    dxq = 0.0  # eq. (22), per head from _query_normalisers
    for h in tl.static_range(H):
        dxq += tl.load(DXQ + pid * H + h)
    tl.store(SUMS + pid, dqq)
    tl.store(SUMS + L * B + pid, dqq_other)
    tl.store(SUMS + 2 * L * B + pid, dxq)
    tl.store(SUMS + 3 * L * B + pid, clamped)


@triton.jit
def _reading_p(LOG_JOINT, LOG_NORMS, h, layer, b, offs_t, offs_c, tile, valid, L, T, B, H, C: tl.constexpr,
               AUTHORS: tl.constexpr, BLOCK_C: tl.constexpr):
    """p(q_i^h | c) of the reading alone (the backward pass needs no other): :func:`_token_given_cluster`'s second
    value in the authors' reading, its first otherwise."""
    x = tl.load(_query_tile(LOG_JOINT, h, layer, b, offs_t, offs_c, L, T, B, H), mask=tile, other=0.0)
    norms = LOG_NORMS + ((layer * B + b) * H + h) * BLOCK_C + offs_c
    if AUTHORS:
        return tl.where(tile, tl.exp(x - tl.load(norms + L * B * H * BLOCK_C)[None, :]), 0.0)
    return tl.where(tile & (valid[:, None] > 0), tl.exp(x - tl.load(norms)[None, :]), 0.0)


@triton.jit(do_not_specialize=_QUERY_SIZES)
def _query_terms_backward(LOG_JOINT, LOG_RESP, VALID, LOG_NORMS, RAW_NORMS, CRITIC_NORMS, GRAD_DQQ,
                          GRAD_DXQ, GRAD_LOG_JOINT, GRAD_LOG_RESP, L, T, B, H: tl.constexpr, C: tl.constexpr,
                          AUTHORS: tl.constexpr, EPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    """The backward of :func:`_query_terms_forward` for one layer and sentence: d/d log p(q, c) (through p(q | c),
    a softmax over the tokens: P (dP - sum_i P dP), the authors' clamped normalisers constant) and d/d log p(c | q)
    (eq. 21's p(c | q^h') and eq. 22's critic: 2 g_i R_i - sum_j (W_ij + W_ji) R_j, W_ij = g_i softmax_j f_ij)."""
    pid = tl.program_id(0)
    b = pid % B
    layer = pid // B
    offs_c = tl.arange(0, BLOCK_C)
    offs_h = tl.arange(0, BLOCK_H)
    mask_c = offs_c < C
    per_head = 1.0 / (_real_tokens(VALID, b, T, B, BLOCK_T) * (L * H))
    grad_pair = tl.load(GRAD_DQQ + b) * per_head / H
    grad_head = tl.load(GRAD_DXQ + b) * per_head
    # pass A: sum_i P dP per head and cluster (the softmax over the tokens' backward)
    through_norm = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
    for start in range(0, T, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        tile = mask_t[:, None] & mask_c[None, :]
        valid = tl.load(VALID + offs_t * B + b, mask=mask_t, other=0.0)
        scale = valid * grad_pair
        for h in tl.static_range(H):
            p_token = _reading_p(LOG_JOINT, LOG_NORMS, h, layer, b, offs_t, offs_c, tile, valid, L, T, B, H, C,
                                 AUTHORS, BLOCK_C)
            grad_p = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
            for h2 in tl.static_range(H):
                if h2 != h:  # d/d p(q^h | c) of p(q^h | q^h2)
                    resp = _responsibilities(LOG_RESP, h2, layer, b, offs_t, offs_c, tile, L, T, B, H)
                    _, slope = _pair_slope(tl.sum(p_token * resp, 1), AUTHORS, EPS)
                    grad_p += (scale * slope)[:, None] * resp
            through_norm += tl.where(offs_h[:, None] == h, tl.sum(p_token * grad_p, 0)[None, :], 0.0)
    if AUTHORS:  # a clamped normaliser is a constant
        raw = tl.load(RAW_NORMS + ((layer * B + b) * H + offs_h[:, None]) * BLOCK_C + offs_c[None, :],
                      mask=(offs_h[:, None] < H), other=1.0)
        through_norm = tl.where(raw < EPS, 0.0, through_norm)
    # pass B: the gradients, tile by tile
    for start in range(0, T, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        tile = mask_t[:, None] & mask_c[None, :]
        valid = tl.load(VALID + offs_t * B + b, mask=mask_t, other=0.0)
        scale = valid * grad_pair
        grad_token = valid * grad_head  # g_i of eq. (22)
        for h in tl.static_range(H):
            p_token = _reading_p(LOG_JOINT, LOG_NORMS, h, layer, b, offs_t, offs_c, tile, valid, L, T, B, H, C,
                                 AUTHORS, BLOCK_C)
            resp_i = _responsibilities(LOG_RESP, h, layer, b, offs_t, offs_c, tile, L, T, B, H)
            grad_p = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
            grad_resp = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
            for h2 in tl.static_range(H):
                if h2 != h:
                    resp = _responsibilities(LOG_RESP, h2, layer, b, offs_t, offs_c, tile, L, T, B, H)
                    _, slope = _pair_slope(tl.sum(p_token * resp, 1), AUTHORS, EPS)
                    grad_p += (scale * slope)[:, None] * resp
                    # p(c | q^h) enters p(q^h2 | q^h)
                    p_other = _reading_p(LOG_JOINT, LOG_NORMS, h2, layer, b, offs_t, offs_c, tile, valid, L, T, B, H,
                                         C, AUTHORS, BLOCK_C)
                    _, slope = _pair_slope(tl.sum(p_other * resp_i, 1), AUTHORS, EPS)
                    grad_resp += (scale * slope)[:, None] * p_other
            row = tl.sum(tl.where(offs_h[:, None] == h, through_norm, 0.0), 0)
            tl.store(_query_tile(GRAD_LOG_JOINT, h, layer, b, offs_t, offs_c, L, T, B, H),
                     p_token * (grad_p - row[None, :]), mask=tile)
            # eq. (22)
            norms = CRITIC_NORMS + ((layer * B + b) * H + h) * T
            norm_i = tl.load(norms + offs_t, mask=mask_t, other=1.0)
            row_weight = tl.where(grad_token != 0, grad_token / norm_i, 0.0)  # g_i / n_i
            key_valid_i = tl.load(VALID + offs_t * B + b, mask=mask_t, other=0.0) > 0
            grad_resp += 2.0 * grad_token[:, None] * resp_i
            for key_start in range(0, T, BLOCK_T):
                offs_j = key_start + tl.arange(0, BLOCK_T)
                mask_j = offs_j < T
                tile_j = mask_j[:, None] & mask_c[None, :]
                resp_j = _responsibilities(LOG_RESP, h, layer, b, offs_j, offs_c, tile_j, L, T, B, H)
                exp_critic = tl.exp(tl.dot(resp_i, tl.trans(resp_j), input_precision="ieee"))
                key_valid_j = tl.load(VALID + offs_j * B + b, mask=mask_j, other=0.0) > 0
                grad_token_j = tl.load(VALID + offs_j * B + b, mask=mask_j, other=0.0) * grad_head
                norm_j = tl.load(norms + offs_j, mask=mask_j, other=1.0)
                column_weight = tl.where(grad_token_j != 0, grad_token_j / norm_j, 0.0)  # g_j / n_j
                weights = (tl.where(key_valid_j[None, :], exp_critic * row_weight[:, None], 0.0)
                           + tl.where(key_valid_i[:, None], exp_critic * column_weight[None, :], 0.0))
                grad_resp -= tl.dot(weights, resp_j, input_precision="ieee")
            tl.store(_query_tile(GRAD_LOG_RESP, h, layer, b, offs_t, offs_c, L, T, B, H), resp_i * grad_resp,
                     mask=tile)


class _QueryTerms(torch.autograd.Function):
    """``(log p(q, c), log p(c|q)) [C, L, T, B, H], ...) -> (L_Dqq of eq. 21, L_Dqq in the other reading, L_Dxq of
    eq. 22, the authors' clamped normalisers)`` (see :func:`query_terms`)."""

    @staticmethod
    def forward(ctx, log_joint, log_resp, valid, authors):
        ctx.set_materialize_grads(False)
        clusters, layers, length, batch, heads = log_resp.shape
        cfg, cfg_terms = LAUNCH["query_normalisers"], LAUNCH["query_terms"]
        block_t, block_c = kernels._block(length, cfg.block_rows), kernels._block(clusters, 1 << 20)
        device = log_resp.device
        layer_max = log_joint.amax(dim=(0, 2, 3, 4))  # the authors' one max per layer
        log_norms = torch.empty(2, layers, batch, heads, block_c, dtype=torch.float32, device=device)
        raw_norms = torch.empty(layers, batch, heads, block_c, dtype=torch.float32, device=device)
        critic_norms = torch.empty(layers, batch, heads, length, dtype=torch.float32, device=device)
        dxq = torch.empty(layers, batch, heads, dtype=torch.float32, device=device)
        kernels._launch("query_normalisers", _query_normalisers, (layers * batch * heads,),
                        (log_joint, log_resp, valid, layer_max, log_norms, raw_norms, critic_norms, dxq, layers,
                         length, batch, heads),
                        dict(C=clusters, BLOCK_T=block_t, BLOCK_C=block_c), cfg)
        sums = torch.empty(4, layers, batch, dtype=torch.float32, device=device)
        kernels._launch("query_terms_forward", _query_terms_forward, (layers * batch,),
                        (log_joint, log_resp, valid, log_norms, raw_norms, dxq, sums, layers, length, batch),
                        dict(H=heads, C=clusters, AUTHORS=authors, EPS=AUTHORS_EPS,
                             BLOCK_T=kernels._block(length, cfg_terms.block_rows), BLOCK_C=block_c), cfg_terms)
        ctx.call = None
        if kernels._CALLS is not None:
            ctx.call = dict(kind="query_terms", dtype="float32", head_dim=0, clusters=clusters, heads=heads,
                            authors=authors, backward=False)
            kernels._CALLS.append(ctx.call)
        ctx.save_for_backward(log_joint, log_resp, valid, log_norms, raw_norms, critic_norms)
        ctx.authors, ctx.blocks = authors, (kernels._block(length, cfg_terms.block_rows), block_c)
        totals = sums.sum(1)
        ctx.mark_non_differentiable(totals[1], totals[3])
        return totals[0], totals[2], totals[1], totals[3]

    @staticmethod
    def backward(ctx, grad_dqq, grad_dxq, _other, _clamped):
        log_joint, log_resp, valid, log_norms, raw_norms, critic_norms = ctx.saved_tensors
        clusters, layers, length, batch, heads = log_resp.shape
        block_t, block_c = ctx.blocks
        if ctx.call is not None:
            ctx.call.update(backward=True)
        grad_dqq, grad_dxq = _output_grads(grad_dqq, grad_dxq, batch, log_resp.device)
        grad_log_joint, grad_log_resp = torch.empty_like(log_joint), torch.empty_like(log_resp)
        kernels._launch("query_terms_backward", _query_terms_backward, (layers * batch,),
                        (log_joint, log_resp, valid, log_norms, raw_norms, critic_norms, grad_dqq,
                         grad_dxq, grad_log_joint, grad_log_resp, layers, length, batch),
                        dict(H=heads, C=clusters, AUTHORS=ctx.authors, EPS=AUTHORS_EPS, BLOCK_T=block_t,
                             BLOCK_C=block_c, BLOCK_H=triton.next_power_of_2(heads)), LAUNCH["query_terms"])
        return grad_log_joint, grad_log_resp, None, None


def query_terms(log_joint: Tensor, log_resp: Tensor, valid: Tensor,
                authors: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(L_Dqq of eq. 21, L_Dxq of eq. 22, L_Dqq in the other reading, the number of the authors' clamped
    normalisers) per sentence, ``[B]`` each, of one attention type's layers; the third and fourth without gradient.

    ``log_joint``, ``log_resp``: the query GMM's log p(q, c) and log p(c|q), clusters-first ``[C, L, T, B, H]``
    float32; ``valid`` ``[T, B]`` the real tokens: those p(q | c) is normalised over, the keys of eq. (22)'s softmax,
    and the queries the terms average over (1 / (n_q L H^2) and 1 / (n_q L H)); ``authors``: their normaliser
    exp(x - layer max) / max(sum, 1e-6) and -log(1 - min(p, 1) + 1e-6) (else the exact softmax and
    -log(1 - min(p, 1 - 1e-6))). Equal to ``_HeadMI`` and ``_QueryInputMI`` of :mod:`latent_core.sdma.regularisers`.
    """
    kernels.check_supported(log_resp, option="attention_kernel=triton (the regularisers)")
    return _QueryTerms.apply(log_joint.float().contiguous(), log_resp.float().contiguous(), valid.float().contiguous(),
                             bool(authors))
