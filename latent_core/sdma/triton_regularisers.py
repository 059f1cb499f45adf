"""The feature-GMM regularisers of eq. (20) and (23) in Triton kernels: one launch forward and one backward for all
layers of an attention type (``attention_kernel=triton``).

The eager terms (:class:`latent_core.sdma.regularisers._VadeKL`, ``_ClusterDiversity``) are a few dozen ATen ops each
way; on a GPU each is a kernel launch. Here one program per (layer, sentence, head) walks the positions once:

* forward: the KL of eq. (20) summed with the sentence weights 1 / (n_q L n_h), and the diversity of eq. (23) from
  the Gram matrix G = C^T C (C = p(c|z) at the real positions) and s_i = ||C_i||^2, weighted 1 / (n_q^2 L n_h); each
  program writes its two sums and its G (kept for backward); one ``sum`` adds the programs up per sentence.
* backward: d/d log p(c|z) of both terms (through q = exp(log p(c|z)); the diversity's
  4 [w_d (s_i - 1) - w_o s_i] C_i + 4 w_o G C_i), d/d log p(z, c=0) (the KL's -log p(z)), and per program the sums
  over its positions of the gradients of tr(Sigma_c^-1) and of log pi_c (the authors' categorical term); one ``sum``
  over the sentences gives the parameters' gradients.

Inputs are clusters-first ``[C, L, T, B, H]`` (:func:`latent_core.sdma.mixture.clusters_first`), as the eager terms
take them. The learned posterior variance (ESPnet's ``var_estimation``: one s2 per position) stays on the eager
path. The tests hold values and gradients to the eager terms in Triton's interpreter.
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

import triton
import triton.language as tl

from latent_core.sdma import triton_kernels as kernels
from latent_core.sdma.options import LOG_2PI

_SIZES = ["L", "T", "B", "H"]


@triton.jit
def _responsibility_tile(LOG_RESP, pos, plane, offs_c, mask_t, mask_c):
    """log p(c|z) and p(c|z) at positions ``pos`` ``[BLOCK_T, BLOCK_C]`` (columns past C and rows past T: -inf and
    0)."""
    tile = mask_t[:, None] & mask_c[None, :]
    log_resp = tl.load(LOG_RESP + offs_c[None, :] * plane + pos[:, None], mask=tile, other=float("-inf"))
    resp = tl.where(tile, tl.exp(log_resp), 0.0)
    return tl.where(tile, log_resp, 0.0), resp, tile


@triton.jit(do_not_specialize=_SIZES)
def _feature_terms_forward(LOG_JOINT, LOG_RESP, TRACE, trace_strides, LOG_PRIOR, prior_strides, WEIGHTS, VALID,
                           PER_GRAM, SUMS, GRAM, L, T, B, H, half_var, base_constant, diag_weight, off_weight,
                           C: tl.constexpr, AUTHORS: tl.constexpr, MASKED: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    """Eq. (20) and (23) of one layer, sentence and head (program ``(l * B + b) * H + h``): ``SUMS[0]`` the
    weighted KL, ``SUMS[1]`` the weighted diversity, ``GRAM`` G = C^T C ``[BLOCK_C, BLOCK_C]``."""
    pid = tl.program_id(0)
    h = pid % H
    b = (pid // H) % B
    layer = pid // (H * B)
    plane = L * T * B * H  # between clusters
    base = layer * T * B * H + b * H + h
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    trace = tl.load(TRACE + layer * trace_strides[0] + h * trace_strides[1] + offs_c * trace_strides[2],
                    mask=mask_c, other=0.0)
    constant = base_constant
    if AUTHORS:
        log_pi = tl.load(LOG_PRIOR + layer * prior_strides[0] + h * prior_strides[1] + offs_c * prior_strides[2],
                         mask=mask_c, other=0.0)
        pi = tl.where(mask_c, tl.exp(log_pi), 0.0)
        # sum_c pi_c s2/2 tr_c, taken out of the sum over c (see _VadeKL)
        constant += tl.sum(pi * half_var * trace, 0)
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
        weight = tl.load(WEIGHTS + offs_t * B + b, mask=mask_t, other=0.0)
        kl += weight * (per_token - constant)
        if MASKED:
            valid = tl.load(VALID + offs_t * B + b, mask=mask_t, other=0.0)
        else:
            valid = tl.where(mask_t, 1.0, 0.0)
        masked = resp * valid[:, None]  # C_i
        gram += tl.dot(tl.trans(masked), masked, input_precision="ieee")
        self_sim = tl.sum(masked * masked, 1)  # s_i
        diag += valid * (self_sim - 1.0) * (self_sim - 1.0)
        self_sim_squares += self_sim * self_sim
    off = tl.sum(tl.sum(gram * gram, 1), 0) - tl.sum(self_sim_squares, 0)
    diversity = (diag_weight * tl.sum(diag, 0) + off_weight * off) * tl.load(PER_GRAM + b)
    tl.store(SUMS + pid, tl.sum(kl, 0))
    tl.store(SUMS + L * B * H + pid, diversity)
    tl.store(GRAM + pid * BLOCK_C * BLOCK_C + offs_c[:, None] * BLOCK_C + offs_c[None, :], gram)


@triton.jit(do_not_specialize=_SIZES)
def _feature_terms_backward(LOG_RESP, TRACE, trace_strides, LOG_PRIOR, prior_strides, WEIGHTS, VALID, PER_GRAM, GRAM,
                            GRAD_KL, GRAD_DV, GRAD_LOG_JOINT, GRAD_LOG_RESP, PARTIAL, L, T, B, H, half_var,
                            diag_weight, off_weight, C: tl.constexpr, AUTHORS: tl.constexpr, MASKED: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """The backward of :func:`_feature_terms_forward` for one layer, sentence and head: ``GRAD_LOG_JOINT`` and
    ``GRAD_LOG_RESP`` at its positions (clusters-first), and ``PARTIAL[0]`` / ``PARTIAL[1]`` ``[L, B, H, C]`` its
    sums of the gradients of tr(Sigma_c^-1) and log pi_c."""
    pid = tl.program_id(0)
    h = pid % H
    b = (pid // H) % B
    layer = pid // (H * B)
    plane = L * T * B * H
    base = layer * T * B * H + b * H + h
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    trace = tl.load(TRACE + layer * trace_strides[0] + h * trace_strides[1] + offs_c * trace_strides[2],
                    mask=mask_c, other=0.0)
    if AUTHORS:
        log_pi = tl.load(LOG_PRIOR + layer * prior_strides[0] + h * prior_strides[1] + offs_c * prior_strides[2],
                         mask=mask_c, other=0.0)
        pi = tl.where(mask_c, tl.exp(log_pi), 0.0)
    gram = tl.load(GRAM + pid * BLOCK_C * BLOCK_C + offs_c[:, None] * BLOCK_C + offs_c[None, :])
    grad_kl = tl.load(GRAD_KL + b)
    diversity_scale = 4.0 * tl.load(GRAD_DV + b) * tl.load(PER_GRAM + b)
    grad_trace = tl.zeros((BLOCK_C,), tl.float32)
    grad_log_pi = tl.zeros((BLOCK_C,), tl.float32)
    for start in range(0, T, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        pos = base + offs_t * (B * H)
        log_resp, resp, tile = _responsibility_tile(LOG_RESP, pos, plane, offs_c, mask_t, mask_c)
        grad_token = tl.load(WEIGHTS + offs_t * B + b, mask=mask_t, other=0.0) * grad_kl  # d out / d per_token
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
        if MASKED:
            valid = tl.load(VALID + offs_t * B + b, mask=mask_t, other=0.0)
        else:
            valid = tl.where(mask_t, 1.0, 0.0)
        masked = resp * valid[:, None]
        self_sim = tl.sum(masked * masked, 1)
        coefficient = diag_weight * (self_sim - 1.0) - off_weight * self_sim
        grad_masked = coefficient[:, None] * masked + off_weight * tl.dot(masked, gram, input_precision="ieee")
        grad_log_resp += (diversity_scale * valid)[:, None] * grad_masked * resp
        tl.store(GRAD_LOG_RESP + offs_c[None, :] * plane + pos[:, None], grad_log_resp, mask=tile)
    tl.store(PARTIAL + pid * C + offs_c, grad_trace, mask=mask_c)
    tl.store(PARTIAL + (L * B * H + pid) * C + offs_c, grad_log_pi, mask=mask_c)


# 32 positions per step: the [32, C] tiles and the C x C Gram matrix are small
LAUNCH = kernels.LaunchConfig(32, 0, 4, 1)


class _FeatureTerms(torch.autograd.Function):
    """``(log p(z, c), log p(c|z)) [C, L, T, B, H], tr(Sigma^-1) [L, H, C], log pi [L, H, C] or None, ...) ->
    (KL of eq. 20, diversity of eq. 23)``, each ``[B]`` (see :func:`feature_terms`)."""

    @staticmethod
    def forward(ctx, log_joint, log_resp, trace, log_prior, weights, valid, per_gram, posterior_var, dim,
                diag_weight, off_weight):
        clusters, layers, length, batch, heads = log_resp.shape
        authors = log_prior is not None
        cfg = LAUNCH
        block_t, block_c = kernels._block(length, cfg.block_rows), kernels._block(clusters, 1 << 20)
        programs = layers * batch * heads
        sums = torch.empty(2, layers, batch, heads, dtype=torch.float32, device=log_resp.device)
        gram = torch.empty(programs, block_c, block_c, dtype=torch.float32, device=log_resp.device)
        half_var = 0.5 * float(posterior_var)
        base_constant = 0.5 * dim * (LOG_2PI + math.log(posterior_var) + 1.0)
        prior = log_prior if authors else trace
        kernels._launch("feature_terms_forward", _feature_terms_forward, (programs,),
                        (log_joint, log_resp, trace, trace.stride(), prior, prior.stride(), weights,
                         valid if valid is not None else weights, per_gram, sums, gram, layers, length, batch, heads,
                         half_var, base_constant, float(diag_weight), float(off_weight)),
                        dict(C=clusters, AUTHORS=authors, MASKED=valid is not None, BLOCK_T=block_t, BLOCK_C=block_c),
                        cfg)
        if kernels._CALLS is not None:
            kernels._CALLS.append(dict(kind="feature_terms", clusters=clusters, authors=authors,
                                       masked=valid is not None))
        ctx.save_for_backward(log_resp, trace, log_prior, weights, valid, per_gram, gram)
        ctx.constants = (half_var, float(diag_weight), float(off_weight), block_t, block_c)
        totals = sums.sum((1, 3))
        return totals[0], totals[1]

    @staticmethod
    def backward(ctx, grad_kl, grad_dv):
        log_resp, trace, log_prior, weights, valid, per_gram, gram = ctx.saved_tensors
        half_var, diag_weight, off_weight, block_t, block_c = ctx.constants
        clusters, layers, length, batch, heads = log_resp.shape
        authors = log_prior is not None
        zeros = log_resp.new_zeros(batch)
        grad_kl = zeros if grad_kl is None else grad_kl.contiguous()
        grad_dv = zeros if grad_dv is None else grad_dv.contiguous()
        grad_log_joint = torch.empty_like(log_resp)
        grad_log_resp = torch.empty_like(log_resp)
        partial = torch.empty(2, layers, batch, heads, clusters, dtype=torch.float32, device=log_resp.device)
        prior = log_prior if authors else trace
        kernels._launch("feature_terms_backward", _feature_terms_backward, (layers * batch * heads,),
                        (log_resp, trace, trace.stride(), prior, prior.stride(), weights,
                         valid if valid is not None else weights, per_gram, gram, grad_kl, grad_dv, grad_log_joint,
                         grad_log_resp, partial, layers, length, batch, heads, half_var, diag_weight, off_weight),
                        dict(C=clusters, AUTHORS=authors, MASKED=valid is not None, BLOCK_T=block_t, BLOCK_C=block_c),
                        LAUNCH)
        parameter_grads = partial.sum(2)  # [2, L, H, C]
        grad_trace = parameter_grads[0] if ctx.needs_input_grad[2] else None
        grad_log_prior = parameter_grads[1] if authors and ctx.needs_input_grad[3] else None
        return (grad_log_joint, grad_log_resp, grad_trace, grad_log_prior, None, None, None, None, None, None, None)


def feature_terms(log_joint: Tensor, log_resp: Tensor, trace_precision: Tensor, log_prior: Optional[Tensor],
                  weights: Tensor, valid: Optional[Tensor], per_gram: Tensor, posterior_var: float, dim: int,
                  diag_weight: float, off_weight: float) -> Tuple[Tensor, Tensor]:
    """(KL of eq. 20, cluster diversity of eq. 23) per sentence, ``[B]`` each, of one attention type's layers.

    ``log_joint``, ``log_resp``: log p(z, c) and log p(c|z), clusters-first ``[C, L, T, B, H]`` float32 (only
    ``log_joint[0]`` is read: -log p(z) = log p(c=0|z) - log p(z, c=0)); ``trace_precision`` tr(Sigma_c^-1)
    ``[L, H, C]`` (broadcast views accepted); ``log_prior`` log pi ``[L, H, C]``: the authors' categorical term
    KL(pi || q(c)) (None: the paper's); ``weights`` ``[T, B]`` the KL's per-position weights; ``valid`` ``[T, B]``
    the positions the diversity counts (None: all); ``per_gram`` ``[B]`` the diversity's weight;
    ``posterior_var`` s2 (a number); ``dim`` d_k; ``diag_weight``, ``off_weight`` the diversity's weights of its
    diagonal and off-diagonal entries. Equal to ``_VadeKL`` and ``_ClusterDiversity`` of
    :mod:`latent_core.sdma.regularisers` with the same arguments.
    """
    kernels.check_supported(log_resp, option="attention_kernel=triton (the regularisers)")
    contiguous = lambda t: None if t is None else t.float().contiguous()
    return _FeatureTerms.apply(log_joint.contiguous(), log_resp.contiguous(), trace_precision.float(),
                               None if log_prior is None else log_prior.float(), contiguous(weights),
                               contiguous(valid), contiguous(per_gram), posterior_var, dim, diag_weight, off_weight)
