"""The regularisers of eq. (20)-(23) per sentence, batched over the layers of one attention type
(:func:`sdma_losses`, :func:`collect_sdma_losses`), their weighted sum of eq. (24) and the clustering diagnostics."""

import math
from functools import cached_property
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from latent_core.profiling import sourced
from latent_core.sdma.mixture import LOGVAR_RANGE, clusters_first, full_precision, log_prior
from latent_core.sdma.options import (AUTHORS_EPS, LOG_2PI, LOSS_NAMES, LOSS_WEIGHTS, REGULARISER_SCALES,
                                      SDMAConfigError)
from latent_core.sdma.records import ClusteringRecord, SDMARecording

# ----------------------------------------------------------------------------
# Regularisers. Layout: ``[L, T, B, n_h, C]`` -- the L layers of one attention
# type are stacked so each term costs a handful of batched ops (not one set per
# layer); inside, every term works on the clusters-first view ``[C, L, T, B, n_h]``
# (:func:`clusters_first`). ``valid`` is a float ``[T, B]`` mask of real
# (non-padding) query positions, shared by the layers. Every function returns one
# value PER SENTENCE, ``[B]``: the mean over layers, heads and the sentence's own
# tokens (the 1/(N n_h n_q) of eq. 20-23), as the authors' ``clustering()`` does;
# :func:`scale_regulariser` turns the per-sentence values into the batch's loss term.
# ----------------------------------------------------------------------------


class _SentenceWeights:
    """The weights that turn per-token terms into per-sentence means, computed once per attention type: at real
    positions ``per_head`` ``[T, B]`` = 1 / (n_q L n_h) (eq. 20, 22), ``per_head_pair`` = 1 / (n_q L n_h^2) (eq. 21);
    ``per_gram`` ``[B]`` = 1 / (n_q^2 L n_h) (eq. 23)."""

    def __init__(self, valid: Tensor, num_layers: int, num_heads: int):
        self.valid, self.num_layers, self.num_heads = valid, num_layers, num_heads

    @cached_property
    def n_q(self) -> Tensor:
        return self.valid.sum(0).clamp_min(1.0)  # [B]

    @cached_property
    def per_head(self) -> Tensor:
        return self.valid / (self.n_q * (self.num_layers * self.num_heads))

    @cached_property
    def per_head_pair(self) -> Tensor:
        return self.valid / (self.n_q * (self.num_layers * self.num_heads * self.num_heads))

    @cached_property
    def per_gram(self) -> Tensor:
        return (self.n_q * self.n_q).mul_(self.num_layers * self.num_heads).reciprocal_()


def _per_sentence(per_token: Tensor, weights: Tensor) -> Tensor:
    """``[L, T, B, H]`` (weighted by ``weights`` ``[T, B]``) -> ``[B]``."""
    return (per_token * weights[:, :, None]).sum((0, 1, 3))


# Each term below is a torch.autograd.Function whose backward is written out (derived by hand): on a GPU the
# regularisers are bound by kernel launches, and autograd's backward of the direct form spends several small
# kernels per op of the forward. Tensors are clusters-first ``[C, L, T, B, H]``; ``weights`` ``[T, B]`` come from
# :class:`_SentenceWeights`, so each term is sum_{l,t,h} weights * per_token. The direct forms are kept as the
# references of tests/unit/latent_core/test_sdma_regulariser_functions.py.


def _token_weighted_sum(x: Tensor, grad_token: Tensor) -> Tensor:
    """sum_{t,b} x * grad_token of clusters-first ``x [C, L, T, B, H]`` (contiguous) and ``grad_token [T, B, 1]``:
    ``[L, H, C]``, as one product over the positions (no ``[C, L, T, B, H]`` temporary)."""
    num_clusters, num_layers, length, batch, heads = x.shape
    summed = torch.matmul(grad_token.reshape(1, length * batch), x.view(num_clusters * num_layers, -1, heads))
    return summed.view(num_clusters, num_layers, heads).permute(1, 2, 0)


class _VadeKL(torch.autograd.Function):
    """Eq. (20) per token: 0.5 s2 sum_c q(c) tr(Sigma_c^-1) + log q(c=0|z) - log p(z, c=0) - d/2 log(2 pi e s2)
    [authors: + sum_c (log pi_c - log q(c)) (q(c) + pi_c), i.e. - KL(q(c) || pi) + KL(pi || q(c))].

    With the authors' term and one s2 for every position, both sums over c are one:
    sum_c (q_c + pi_c) u_c - s2/2 sum_c pi_c tr_c with u_c = log pi_c + s2/2 tr_c - log q_c, which is also the
    gradient with respect to q_c."""

    @staticmethod
    def forward(ctx, log_joint, log_resp, resp, trace_precision, posterior_var, log_prior, weights, dim):
        trace_cf = trace_precision.permute(2, 0, 1)[:, :, None, None, :]  # [C, L, 1, 1, H]
        log_ratio = log_resp[0] - log_joint[0]  # -log p(z)
        learned_var, authors = isinstance(posterior_var, Tensor), log_prior is not None
        trace = resp_plus_prior = prior = slope = None
        if authors:
            log_prior_cf = log_prior.permute(2, 0, 1)[:, :, None, None, :]
            prior = log_prior_cf.exp()
            resp_plus_prior = resp + prior
        if learned_var:
            trace = (resp * trace_cf).sum(0)  # sum_c q(c) tr(Sigma_c^-1), [L, T, B, H]
            per_token = torch.addcmul(log_ratio, posterior_var, trace, value=0.5)
            per_token = torch.sub(per_token, torch.log(posterior_var), alpha=0.5 * dim)
            per_token = per_token - 0.5 * dim * (LOG_2PI + 1.0)
            if authors:
                slope = log_prior_cf - log_resp  # log pi_c - log q_c
                per_token = per_token + (slope * resp_plus_prior).sum(0)
        else:
            constant = 0.5 * dim * (LOG_2PI + math.log(posterior_var) + 1.0)
            if authors:
                half_trace = trace_cf * (0.5 * posterior_var)
                slope = torch.sub(log_prior_cf + half_trace, log_resp)  # u_c
                # sum_c pi_c s2/2 tr_c, [L, 1, 1, H], taken out of the sum over c
                constant = (prior * half_trace).sum(0) + constant
                per_token = torch.sub(log_ratio + (slope * resp_plus_prior).sum(0), constant)
            else:
                trace = (resp * trace_cf).sum(0)
                per_token = torch.add(log_ratio, trace, alpha=0.5 * posterior_var) - constant
        ctx.save_for_backward(resp, trace_cf, posterior_var if learned_var else None, trace if learned_var else None,
                              prior, slope, resp_plus_prior, weights)
        ctx.learned_var, ctx.authors = learned_var, authors
        ctx.posterior_var, ctx.dim = (None if learned_var else posterior_var), dim
        return _per_sentence(per_token, weights)

    @staticmethod
    def backward(ctx, grad):
        resp, trace_cf, posterior_var, trace, prior, slope, resp_plus_prior, weights = ctx.saved_tensors
        grad_token = (weights * grad)[:, :, None]  # [T, B, 1]: d out / d per_token
        grad_log_joint = torch.zeros_like(resp)
        grad_log_joint[0].sub_(grad_token)
        if ctx.authors:
            grad_log_resp = resp_plus_prior * -grad_token
            grad_log_resp[0].add_(grad_token)
        else:
            grad_log_resp = torch.zeros_like(resp)
            grad_log_resp[0].add_(grad_token)
        # d/d resp_c of 0.5 s2 resp_c tr_c, per token: half_var_grad * tr_c
        half_var_grad = (posterior_var * grad_token * 0.5 if ctx.learned_var
                         else grad_token * (0.5 * ctx.posterior_var))
        if ctx.authors and not ctx.learned_var:
            grad_resp = slope * grad_token  # u_c
        else:
            grad_resp = trace_cf * half_var_grad
            if ctx.authors:
                grad_resp = torch.addcmul(grad_resp, slope, grad_token)
        grad_trace = None
        if ctx.needs_input_grad[3]:
            if ctx.learned_var:
                grad_trace = (resp * half_var_grad).sum((2, 3)).permute(1, 2, 0)
            else:  # sum_{t,b} q_c g s2/2 (the authors' u_c carries s2/2 tr_c, the constant takes its pi_c part back)
                grad_trace = _token_weighted_sum(resp, grad_token) * (0.5 * ctx.posterior_var)
        grad_var = None
        if ctx.learned_var and ctx.needs_input_grad[4]:
            # 0.5 tr - d / (2 s2)
            grad_var = torch.add(trace, posterior_var.reciprocal(), alpha=-ctx.dim) * (0.5 * grad_token)
        grad_log_prior = None
        if ctx.authors and ctx.needs_input_grad[5]:
            # d/d log pi_c of (log pi_c - log q_c)(q_c + pi_c): q_c + pi_c + pi_c (log pi_c - log q_c)
            grad_log_prior = _token_weighted_sum(torch.addcmul(resp_plus_prior, slope, prior), grad_token)
            if not ctx.learned_var:  # slope is u_c = log pi_c - log q_c + s2/2 tr_c: its pi_c s2/2 tr_c is the constant's
                grad_log_prior = grad_log_prior - (prior * trace_cf * (0.5 * ctx.posterior_var))[:, :, 0, 0].permute(
                    1, 2, 0) * grad_token.sum()
        return grad_log_joint, grad_log_resp, grad_resp, grad_trace, grad_var, grad_log_prior, None, None


def vade_kl(log_joint: Tensor, log_resp: Tensor, trace_precision: Tensor, dim: int,
            posterior_var, valid: Tensor, resp: Optional[Tensor] = None,
            authors_log_prior: Optional[Tensor] = None) -> Tensor:
    """KL(q(z, c | x) || p(z, c)) in the VaDE form per sentence, ``[B]`` (eq. 20).

    With q(z|x) = N(z, s2 I) and q(c|x) = p(c|z) (eq. 9), per token and head:
      sum_c q(c) KL(N(z, s2) || N(mu_c, sigma_c^2)) + KL(q(c) || pi)
        = -log p(z) + s2/2 sum_c q(c) tr(Sigma_c^-1) - d/2 log(2 pi e s2)
    where log p(z) = log_joint_c - log p(c|z) for any c. ``trace_precision`` is
    ``[L, n_h, C]`` (see :meth:`GaussianMixture.trace_precision`); ``resp`` is
    ``log_resp.exp()`` when the caller already has it.

    ``authors_log_prior`` (log pi, ``[L, n_h, C]``): the authors' categorical term
    KL(pi || q(c)) (``F.kl_div(log_probs, prior)``) replaces KL(q(c) || pi). ``posterior_var``
    is s2, a number or a tensor ``[L, T, B, n_h]`` (one variance per position and head).
    """
    resp = clusters_first(log_resp).exp().movedim(0, -1) if resp is None else resp
    weights = _SentenceWeights(valid, log_joint.size(0), log_joint.size(-2))
    return _vade_kl(log_joint, log_resp, resp, trace_precision, posterior_var, authors_log_prior, weights, dim)


def _vade_kl(log_joint, log_resp, resp, trace_precision, posterior_var, log_prior, weights, dim) -> Tensor:
    return _VadeKL.apply(clusters_first(log_joint), clusters_first(log_resp), clusters_first(resp), trace_precision,
                         posterior_var, log_prior, weights.per_head, dim)


class _ClusterDiversity(torch.autograd.Function):
    """Eq. (23) per layer and head from the masked responsibilities C (``resp * valid``) and the Gram matrix
    G = C^T C: diag_weight sum_i (s_i - 1)^2 + off_weight (||G||_F^2 - sum_i s_i^2), s_i = ||C_i||^2.
    ``valid`` None: every position is real (no mask). Worked on per layer, sentence and head (``[L B H, C, T]``)."""

    @staticmethod
    def forward(ctx, resp, valid, diag_weight, off_weight, sentence_weights):
        num_clusters, num_layers, length, batch, heads = resp.shape
        masked = resp if valid is None else resp * valid[None, None, :, :, None]  # C, [C, L, T, B, H]
        by_head = masked.permute(1, 3, 4, 0, 2).reshape(-1, num_clusters, length)  # [L B H, C, T]
        gram = torch.bmm(by_head, by_head.transpose(1, 2))  # C^T C, [L B H, C, C]
        self_sim = (by_head * by_head).sum(1)  # s_i, [L B H, T]
        self_sim_minus_one = self_sim - 1.0
        squared_error = self_sim_minus_one * self_sim_minus_one
        if valid is not None:  # a padded position's s_i is 0, its (s_i - 1)^2 is not
            squared_error = squared_error.view(num_layers, batch, heads, length) * valid.t()[None, :, None, :]
        diag = squared_error.sum(-1)
        off = (gram * gram).sum((1, 2)) - (self_sim * self_sim).sum(-1)
        per_head = torch.add(off * off_weight, diag.view_as(off), alpha=diag_weight).view(num_layers, batch, heads)
        ctx.save_for_backward(by_head, gram, self_sim, sentence_weights)
        ctx.diag_weight, ctx.off_weight, ctx.shape = diag_weight, off_weight, resp.shape
        return (per_head * sentence_weights[:, None]).sum((0, 2))

    @staticmethod
    def backward(ctx, grad):
        by_head, gram, self_sim, sentence_weights = ctx.saved_tensors
        num_clusters, num_layers, length, batch, heads = ctx.shape
        # d/dC_i: 4 [diag_weight (s_i - 1) - off_weight s_i] C_i + 4 off_weight (G C^T)_i, times the sentence's
        # weight; d C/d resp = valid, which the result already carries (C_i = 0 at a padded position, and so is
        # every term above), as does the first term's valid_i
        scale = (4.0 * grad * sentence_weights)[None, :, None].expand(num_layers, batch, heads).reshape(-1)  # [L B H]
        coefficient = torch.add(self_sim * (-ctx.off_weight), self_sim, alpha=ctx.diag_weight)
        coefficient = coefficient.sub_(ctx.diag_weight).mul_(scale[:, None])  # [L B H, T]
        gram = gram * (ctx.off_weight * scale)[:, None, None]
        grad_by_head = torch.baddbmm(by_head * coefficient[:, None, :], gram, by_head)  # [L B H, C, T]
        return grad_by_head.view(num_layers, batch, heads, num_clusters, length).permute(3, 0, 4, 1, 2), \
            None, None, None, None


def cluster_diversity(resp: Tensor, valid: Tensor, alpha: float, beta: float, squared: bool = True) -> Tensor:
    """L_DV of eq. (23) per sentence, ``[B]`` (mean over layers and heads).

    sum_ij [M_hat o (C C^T - I)]_ij^2 with M_hat = alpha I + beta (1 - I) equals
    alpha^2 sum_i (s_i - 1)^2 + beta^2 (||C^T C||_F^2 - sum_i s_i^2), s_i = ||C_i||^2,
    so no ``T x T`` matrix is formed. Normalised by n_q^2 of each sentence.
    ``squared=False``: the authors' form, M_hat o (C C^T - I)^2 (alpha and beta weigh the
    squared entries).
    """
    return _cluster_diversity(resp, _SentenceWeights(valid, resp.size(0), resp.size(-2)), alpha, beta, squared)


def _cluster_diversity(resp: Tensor, weights: "_SentenceWeights", alpha: float, beta: float, squared: bool,
                       unmasked: bool = False) -> Tensor:
    """``unmasked``: ``weights.valid`` is all ones (the authors' padded length), so no mask is applied."""
    diag_weight, off_weight = (alpha * alpha, beta * beta) if squared else (alpha, beta)
    return _ClusterDiversity.apply(clusters_first(resp), None if unmasked else weights.valid, diag_weight, off_weight,
                                   weights.per_gram)


class _TokenGivenCluster(torch.autograd.Function):
    """p(q_i^h | c) (eq. 17) normalised over the tokens (dim 2) of clusters-first log-joints: the exact softmax
    over real tokens, or the authors' ``exp(x - layer max) / max(sum, 1e-6)``; returns (p, the authors' clamped
    normalisers)."""

    @staticmethod
    def forward(ctx, log_joint_q, valid, authors):
        if authors:
            layer_max = log_joint_q.amax(dim=(0, 2, 3, 4), keepdim=True)  # one max per layer
            joint = torch.exp(log_joint_q - layer_max)
            norm = joint.sum(2, keepdim=True)
            clamped = norm < AUTHORS_EPS
            p_token_given_c = joint / norm.clamp_min(AUTHORS_EPS)
        else:
            pad = (valid <= 0)[None, None, :, :, None]
            p_token_given_c = torch.softmax(log_joint_q.masked_fill(pad, float("-inf")), dim=2)
            p_token_given_c = p_token_given_c.masked_fill(pad, 0.0)  # sentences of length 0 stay finite
            clamped = None
        ctx.save_for_backward(p_token_given_c, clamped)
        ctx.mark_non_differentiable(*(() if clamped is None else (clamped,)))
        return p_token_given_c, clamped

    @staticmethod
    def backward(ctx, grad, _):
        p_token_given_c, clamped = ctx.saved_tensors
        weighted = p_token_given_c * grad
        through_norm = weighted.sum(2, keepdim=True)  # a clamped normaliser is a constant
        if clamped is not None:
            through_norm = through_norm.masked_fill(clamped, 0.0)
        return torch.addcmul(weighted, p_token_given_c, through_norm, value=-1.0), None, None


def token_given_cluster(log_joint_q: Tensor, valid: Tensor) -> Tensor:
    """p(q_i^h | c) of eq. (17), clusters-first ``[C, L, T, B, H]``: pi_c N(q_i^h | c) normalised
    over the sentence's real tokens (an exact softmax)."""
    return _TokenGivenCluster.apply(log_joint_q, valid, False)[0]


def authors_token_given_cluster(log_joint_q: Tensor) -> Tuple[Tensor, Tensor]:
    """The authors' p(q_i^h | c) (``F.normalize(cluster_probs * pdf, p=1, dim=length, eps=1e-6)``
    with ``pdf = exp(log_pdf - log_pdf.max())``), clusters-first ``[C, L, T, B, H]``, and which of
    its normalisers ``[C, L, 1, B, H]`` sit at the 1e-6 clamp.

    One max over the whole batch of a layer shifts every log-density, so a sentence whose
    queries all lie far below that max gets a normaliser under 1e-6: its probabilities are then
    divided by 1e-6 instead of their sum and stop summing to one.
    """
    return _TokenGivenCluster.apply(log_joint_q, None, True)


def _pair_probabilities(p_token_given_c: Tensor, resp_q: Tensor) -> Tensor:
    """p_hh' = sum_c p(q^h | c) p(c | q^h') (eq. 16) of clusters-first ``[C, L, T, B, H]`` inputs: ``[L, T, B, H, H']``,
    one batched product over the positions (a broadcast product summed over c writes C times as much)."""
    num_clusters, *lead, heads = p_token_given_c.shape
    by_position = lambda x: x.view(num_clusters, -1, heads).permute(1, 2, 0)  # [L T B, H, C], a view
    return torch.bmm(by_position(p_token_given_c), by_position(resp_q).transpose(1, 2)).view(*lead, heads, heads)


def _off_diagonal_weights(weights: Tensor, heads: int) -> Tensor:
    """-weights on the off-diagonal pairs h != h', ``[T, B, H, H']``."""
    return weights[:, :, None, None] * (torch.eye(heads, device=weights.device, dtype=weights.dtype) - 1.0)


def _one_minus_pair(p_pair: Tensor, authors: bool) -> Tuple[Tensor, Tensor, float]:
    """(1 - p, log(1 - p), the clamp's upper limit) with the authors' 1 - min(p, 1) + 1e-6 or the exact clamp at
    1 - 1e-6."""
    if authors:
        one_minus = 1.0 - p_pair.clamp(max=1.0) + AUTHORS_EPS
        return one_minus, torch.log(one_minus), 1.0
    clamped = p_pair.clamp(max=1.0 - 1e-6)
    return 1.0 - clamped, torch.log1p(-clamped), 1.0 - 1e-6


def _head_mi_value(p_token_given_c: Tensor, resp_q: Tensor, weights: Tensor, authors: bool) -> Tensor:
    """:class:`_HeadMI`'s value alone (no gradient: the diagnostics' other reading)."""
    p_pair = _pair_probabilities(p_token_given_c, resp_q)
    return (_one_minus_pair(p_pair, authors)[1] * _off_diagonal_weights(weights, p_pair.size(-1))).sum((0, 1, 3, 4))


class _HeadMI(torch.autograd.Function):
    """Eq. (21) per token from p(q_i^h | c) and p(c | q_i^h') (clusters-first): sum_{h != h'} -log(1 - p_hh'),
    p_hh' = sum_c p(q_i^h | c) p(c | q_i^h') (eq. 16), with the authors' or the exact clamp. The sums over c
    (forward) and over h' or h (backward) are batched products over the positions."""

    @staticmethod
    def forward(ctx, p_token_given_c, resp_q, weights, authors):
        p_pair = _pair_probabilities(p_token_given_c, resp_q)  # [L, T, B, H, H']
        neg_pair_weights = _off_diagonal_weights(weights, p_pair.size(-1))
        one_minus, log_one_minus, limit = _one_minus_pair(p_pair, authors)
        ctx.save_for_backward(p_token_given_c, resp_q, one_minus, (p_pair <= limit) * neg_pair_weights)
        return (log_one_minus * neg_pair_weights).sum((0, 1, 3, 4))

    @staticmethod
    def backward(ctx, grad):
        p_token_given_c, resp_q, one_minus, neg_slope_weights = ctx.saved_tensors
        num_clusters, heads = resp_q.size(0), resp_q.size(-1)
        # d(-log(1 - p))/dp = 1 / (1 - p) where the clamp passes p
        grad_pair = (neg_slope_weights * (-grad)[:, None, None] / one_minus).view(-1, heads, heads)  # [L T B, H, H']
        by_cluster = lambda x: x.view(num_clusters, -1, heads).transpose(0, 1)  # [L T B, C, H], a view
        # sum_h' g_hh' p(c | q^h') and sum_h g_hh' p(q^h | c), as [L T B, C, H] viewed clusters-first
        grad_p = torch.bmm(by_cluster(resp_q), grad_pair.transpose(1, 2)).transpose(0, 1).view_as(resp_q)
        grad_resp = torch.bmm(by_cluster(p_token_given_c), grad_pair).transpose(0, 1).view_as(resp_q)
        return grad_p, grad_resp, None, None


def head_mi_upper_bound(log_joint_q: Tensor, resp_q: Tensor, valid: Tensor, authors: bool = False,
                        p_token_given_c: Optional[Tensor] = None) -> Tensor:
    """L_Dqq of eq. (21) per sentence, ``[B]``: -1/(n_q n_h^2) sum_i sum_{h != h'} log(1 - p(q_i^h | q_i^h')).

    p(q_i^h | c) (eq. 17) = pi_c N(q_i^h | c) / sum_i' pi_c N(q_i'^h | c): a softmax over
    the sentence's tokens of the query GMM's log-joint (eq. 18);
    p(q_i^h | q_i^h') = sum_c p(q_i^h | c) p(c | q_i^h')  (eq. 16).

    ``authors=True``: their normaliser (:func:`authors_token_given_cluster`; pass the
    ``valid`` of the padded length for their sum over pad tokens) and their
    -log(1 - min(p, 1) + 1e-6). ``p_token_given_c``: precomputed p(q_i^h | c), clusters-first.
    """
    log_joint_q, resp_q = clusters_first(log_joint_q), clusters_first(resp_q)  # [C, L, T, B, H]
    n_h = log_joint_q.size(-1)
    if p_token_given_c is None:
        p_token_given_c = (authors_token_given_cluster(log_joint_q)[0] if authors
                           else token_given_cluster(log_joint_q, valid))
    return _HeadMI.apply(p_token_given_c, resp_q, _SentenceWeights(valid, log_joint_q.size(1), n_h).per_head_pair,
                         authors)


class _QueryInputMI(torch.autograd.Function):
    """Eq. (22) per token: f(q_i, x_i) - log sum_j exp f(q_i, x_j) with f(q_i, x_j) = sum_c p(c|q_i) p(c|q_j)
    (eq. 19), over the sentence's real tokens j; the critic is one batched product per layer and head.

    f is a sum of products of probabilities, in [0, 1], so the normaliser is summed from exp(f) without the
    max shift of a logsumexp (no overflow): the exponentials, kept for the backward pass, are the softmax
    numerators, and f(q_i, x_i) is the critic's diagonal. ``valid`` None: every position is real (the authors
    reading, whose normaliser runs over the padded length), no mask."""

    @staticmethod
    def forward(ctx, resp_q, valid, weights):
        num_clusters, num_layers, length, batch, heads = resp_q.shape
        by_head = resp_q.permute(1, 3, 4, 2, 0).reshape(-1, length, num_clusters)  # [L B H, T, C]
        critic = torch.bmm(by_head, by_head.transpose(1, 2))  # f(q_i, x_j), [L B H, T_i, T_j]
        own = critic.diagonal(dim1=1, dim2=2).clone()  # f(q_i, x_i), [L B H, T]
        exp_critic = critic.exp_()
        if valid is not None:
            key_pad = (valid <= 0).t()[None, :, None, None, :]  # [1, B, 1, 1, T_j]
            exp_critic.view(num_layers, batch, heads, length, length).masked_fill_(key_pad, 0.0)
        norm = exp_critic.sum(-1)  # [L B H, T_i]
        log_ratio = (own - norm.log()).view(num_layers, batch, heads, length)
        ctx.save_for_backward(by_head, exp_critic, norm, weights)
        ctx.shape = resp_q.shape
        return (log_ratio * weights.t()[None, :, None, :]).sum((0, 2, 3))

    @staticmethod
    def backward(ctx, grad):
        by_head, exp_critic, norm, weights = ctx.saved_tensors
        num_clusters, num_layers, length, batch, heads = ctx.shape
        grad_token = (weights * grad).t()[None, :, None, :].expand(num_layers, batch, heads, length)
        grad_token = grad_token.reshape(-1, length)  # g_i, [L B H, T_i]
        # W_ij = g_i softmax_j f(q_i, x_j); d/dR_i: 2 g_i R_i (the diagonal f(q_i, x_i)) - sum_j (W_ij + W_ji) R_j,
        # i.e. -sum_j S_ij R_j with S = W + W^T - 2 diag(g)
        weighted_softmax = exp_critic * (grad_token / norm)[..., None]
        symmetric = weighted_softmax + weighted_softmax.transpose(-1, -2)
        symmetric.diagonal(dim1=1, dim2=2).sub_(grad_token, alpha=2.0)
        grad_by_head = torch.baddbmm(by_head, symmetric, by_head, beta=0.0, alpha=-1.0)
        return grad_by_head.view(num_layers, batch, heads, length, -1).permute(4, 0, 3, 1, 2), None, None


def query_input_mi_lower_bound(resp_q: Tensor, valid: Tensor) -> Tensor:
    """L_Dxq of eq. (22) per sentence, ``[B]``, with the critic f(q_i^h, x_j) = sum_c p(c|q_i^h) p(c|q_j^h) (eq. 19).

    1/(n_q n_h) sum_i sum_h log softmax_j f(q_i^h, x_j) evaluated at j = i, with
    the softmax over the sentence's real tokens. Maximised (enters eq. 24 with -lambda_x).
    """
    resp_q = clusters_first(resp_q)  # [C, L, T, B, H]
    return _QueryInputMI.apply(resp_q, valid, _SentenceWeights(valid, resp_q.size(1), resp_q.size(-1)).per_head)


class _StackedTracePrecision(torch.autograd.Function):
    """:func:`trace_precision` of the layers' log-variances ``L x [G, C, d]`` -> ``[L, G, C]``: sum_d exp(-clamp(v))."""

    @staticmethod
    def forward(ctx, *log_vars):
        stacked = torch.stack(log_vars).float()
        neg_clamped = stacked.clamp(*LOGVAR_RANGE).neg_()
        precision = neg_clamped.exp()
        total = precision.sum(-1)
        # d/dv exp(-v) = -exp(-v), zero where the clamp holds v
        ctx.save_for_backward(precision.masked_fill_(neg_clamped != stacked.neg_(), 0.0).neg_())
        ctx.dtypes = [v.dtype for v in log_vars]
        return total

    @staticmethod
    def backward(ctx, grad):
        slope, = ctx.saved_tensors
        return tuple(g.to(dtype) for g, dtype in zip(slope * grad[..., None], ctx.dtypes))


class _StackedGMMs:
    """One attention type's GMMs (one per layer, of G groups: the heads, or one shared by them), stacked once and
    formed on first use: ``log_vars`` ``[L, G, C, d]`` and ``prior_logits`` ``[L, G, C]`` (the Triton kernels read
    them), ``trace`` tr(Sigma_c^-1) and ``log_prior`` (the authors' reading only) ``[L, H, C]``, expanded over the
    heads (the eager terms)."""

    def __init__(self, log_vars: List[Tensor], prior_logits: List[Tensor], authors: bool, num_heads: int,
                 trace_precision: Callable[[List[Tensor]], Tensor]):
        self._log_vars, self._prior_logits, self.authors, self.num_heads = log_vars, prior_logits, authors, num_heads
        self._trace_precision = trace_precision

    @cached_property
    def log_vars(self) -> Tensor:
        return torch.stack(self._log_vars)

    @cached_property
    def prior_logits(self) -> Tensor:
        return torch.stack(self._prior_logits)

    @cached_property
    def trace(self) -> Tensor:
        trace = self._trace_precision(self._log_vars)  # [L, G, C]
        return trace.expand(len(self._log_vars), self.num_heads, -1)

    @cached_property
    def log_prior(self) -> Optional[Tensor]:
        if not self.authors:
            return None
        return log_prior(self.prior_logits).expand(len(self._log_vars), self.num_heads, -1)


def _stack_layers(tensors: List[Tensor]) -> Tensor:
    """``L x [T, B, H, C]`` -> ``[L, T, B, H, C]``, stored clusters-first (``[C, L, T, B, H]``)."""
    return torch.stack([clusters_first(t) for t in tensors], dim=1).movedim(0, -1)


class RegulariserTerms(NamedTuple):
    """The functions :func:`group_terms` computes eq. (17) and (20)-(23) with (its eager path), so that the direct
    forms, differentiated by autograd, can stand in for the hand-written backwards (the tests compare the two).
    ``weights`` is the attention type's :class:`_SentenceWeights`; query tensors are clusters-first."""

    # tr(Sigma_c^-1) [L, G, C] of the layers' log-variances [G, C, d]
    trace_precision: Callable[[List[Tensor]], Tensor]
    # eq. (20): (log_joint, log_resp, resp, trace_precision, posterior_var, log_prior or None, weights, head_dim)
    vade_kl: Callable[..., Tensor]
    # eq. (23): (resp, weights, alpha, beta, squared, unmasked)
    cluster_diversity: Callable[..., Tensor]
    token_given_cluster: Callable[[Tensor, Tensor], Tensor]  # eq. (17) over real tokens: (log_joint_q, valid)
    # the authors' eq. (17): (log_joint_q) -> (p, which normalisers sit at their clamp)
    authors_token_given_cluster: Callable[[Tensor], Tuple[Tensor, Tensor]]
    # eq. (21): (p_token_given_c, resp_q, weights, authors)
    head_mi: Callable[..., Tensor]
    head_mi_value: Callable[..., Tensor]  # head_mi's value alone, for the diagnostics (no gradient)
    # eq. (22): (resp_q, weights, unmasked)
    query_input_mi: Callable[..., Tensor]


# the hand-written backwards above: what the library computes with
FAST_TERMS = RegulariserTerms(
    trace_precision=lambda log_vars: _StackedTracePrecision.apply(*log_vars),
    vade_kl=_vade_kl,
    cluster_diversity=_cluster_diversity,
    token_given_cluster=token_given_cluster,
    authors_token_given_cluster=authors_token_given_cluster,
    head_mi=lambda p_token_given_c, resp_q, weights, authors: _HeadMI.apply(p_token_given_c, resp_q,
                                                                            weights.per_head_pair, authors),
    head_mi_value=lambda p_token_given_c, resp_q, weights, authors: _head_mi_value(p_token_given_c, resp_q,
                                                                                   weights.per_head_pair, authors),
    query_input_mi=lambda resp_q, weights, unmasked: _QueryInputMI.apply(resp_q, None if unmasked else weights.valid,
                                                                         weights.per_head),
)


# Diagnostics of the clustering a user can watch (sums, so they add over batches and DDP workers):
# the share of the authors' L_Dqq normalisers at their 1e-6 clamp, their L_Dqq against the exact one
# (same positions), and the cluster hardness (mean max_c p(c|z) of the feature GMMs over real tokens).
DIAGNOSTIC_SUMS = ("dqq_clamped", "dqq_normalisers", "dqq_authors", "dqq_exact", "hardness_sum", "hardness_count")


def _accumulate(into: Dict[str, Tensor], name: str, value: Tensor) -> None:
    value = value.detach().float()
    into[name] = into[name] + value if name in into else value


_LAYER_FIELDS = ("log_joint_z", "log_resp_z", "log_joint_q", "log_resp_q", "log_joint_k", "log_resp_k")


@sourced("regularisers")
def sdma_losses(items: List[Tuple[nn.Module, ClusteringRecord]],
                diagnostics: Optional[Dict[str, Tensor]] = None) -> Dict[str, Tensor]:
    """The regularisers of SDMA modules of ONE attention type, per sentence (``[B]`` each).

    ``items``: (module, its record) pairs. The records' clustering tensors are stacked along a
    layer axis so each term is one batched computation, averaged over the layers (:func:`group_terms`). The
    modules' ``reading`` decides the form of each term (see the module docstring). ``diagnostics``: a dict to
    which the sums of :data:`DIAGNOSTIC_SUMS` are added.
    """
    if not items:
        return {}
    first_core, first = items[0]
    o = first_core.options
    layers = {name: [getattr(record, name) for _, record in items] for name in _LAYER_FIELDS
              if getattr(first, name) is not None}
    log_vars = {kind: [record.log_vars[kind] for _, record in items] for kind in first.log_vars}
    kinds = ("z", "q") if first.log_joint_q is not None else ("z",)

    def read(core, record, kind):  # the parameters as the clustering read them (Triton), else the module's own
        gmm = core.feature_gmm if kind == "z" else core.query_gmm
        return record.gmm_parameters.get(kind, (gmm.log_vars, gmm.prior_logits))

    gmm_parameters = {kind: tuple(map(list, zip(*(read(core, record, kind) for core, record in items))))
                      for kind in kinds}
    # in float32 under autocast too: the terms' hand-written backward passes reuse their forward's products
    with full_precision(first.valid):
        losses, sums = group_terms(layers, log_vars, gmm_parameters, first.valid, authors=o.authors,
                                   head_dim=first_core.head_dim, num_heads=first_core.num_heads,
                                   posterior_var=o.kl_posterior_var, alpha=o.diversity_alpha, beta=o.diversity_beta,
                                   diagnose=diagnostics is not None, fused=o.attention_kernel == "triton")
    for name, value in sums.items():
        _accumulate(diagnostics, name, value)
    return losses


def group_terms(layers: Dict[str, List[Tensor]], log_vars: Dict[str, List[Tensor]],
                gmm_parameters: Dict[str, Tuple[List[Tensor], List[Tensor]]], real_queries: Tensor, *, authors: bool,
                head_dim: int, num_heads: int, posterior_var: float, alpha: float, beta: float,
                diagnose: bool, fused: bool = False,
                terms: RegulariserTerms = FAST_TERMS) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    """Eq. (20)-(23) of one attention type from tensors alone: ``(losses, diagnostic sums)``.

    ``layers``: the :class:`ClusteringRecord` fields, one ``[T, B, n_h, C]`` tensor per layer each;
    ``log_vars``: the learned posterior log-variances per layer (``z``, ``q``, ``k``), if any;
    ``gmm_parameters``: ``{"z": (log-variances, prior logits) per layer, "q": ...}`` of the feature and query
    GMMs; ``real_queries`` ``[T, B]``; ``posterior_var`` sigma_tilde^2 where no learned one is given; ``fused``: the
    Triton kernels of :mod:`latent_core.sdma.triton_regularisers` (``attention_kernel=triton``): eq. (21)-(22), and
    eq. (20) and (23) where sigma_tilde^2 is a number; ``terms``: the functions of the eager terms.
    """
    real = real_queries.float()
    # the authors average over the padded length and normalise over pad tokens too
    valid = torch.ones_like(real) if authors else real
    num_layers = len(layers["log_joint_z"])
    weights = _SentenceWeights(valid, num_layers, num_heads)
    log_joint_z = _stack_layers(layers["log_joint_z"])
    log_resp_z = _stack_layers(layers["log_resp_z"])
    z_gmms = _StackedGMMs(*gmm_parameters["z"], authors, num_heads, terms.trace_precision)

    def s2(kind):  # sigma_tilde^2: the option's number, or the learned [L, T, B, H]
        if kind not in log_vars:
            return posterior_var
        return torch.stack([v.float() for v in log_vars[kind]]).exp()

    def kl_and_diversity(log_joint, log_resp, gmms: _StackedGMMs, variance, term_weights):
        """Eq. (20) and (23) of one GMM's layers (the authors' diversity unsquared, over the padded length)."""
        if fused and not isinstance(variance, Tensor):
            from latent_core.sdma.triton_regularisers import feature_terms

            diag_weight, off_weight = (alpha, beta) if authors else (alpha * alpha, beta * beta)
            return feature_terms(clusters_first(log_joint), clusters_first(log_resp), gmms.log_vars,
                                 gmms.prior_logits if authors else None, term_weights.valid, not authors, variance,
                                 diag_weight, off_weight)
        resp = log_resp.exp()
        return (terms.vade_kl(log_joint, log_resp, resp, gmms.trace, variance, gmms.log_prior, term_weights,
                              head_dim),
                terms.cluster_diversity(resp, term_weights, alpha, beta, squared=not authors, unmasked=authors))

    losses = dict(zip(("kl_z", "dv_z"), kl_and_diversity(log_joint_z, log_resp_z, z_gmms, s2("z"), weights)))
    sums: Dict[str, Tensor] = {}
    if authors and "log_joint_k" in layers:
        # cross-attention: the (noisy) encoder keys' KL and diversity, over the padded source length
        log_joint_k = _stack_layers(layers["log_joint_k"])
        log_resp_k = _stack_layers(layers["log_resp_k"])
        valid_k = log_joint_k.new_ones(log_joint_k.shape[1:3], dtype=torch.float32)  # [S, B]: padded length
        weights_k = _SentenceWeights(valid_k, num_layers, num_heads)
        kl_k, dv_k = kl_and_diversity(log_joint_k, log_resp_k, z_gmms, s2("k"), weights_k)
        losses["kl_z"] = losses["kl_z"] + kl_k
        losses["dv_z"] = losses["dv_z"] + dv_k
    if diagnose:
        with torch.no_grad():
            hardest = clusters_first(log_resp_z).amax(0).exp()  # max_c p(c|z), [L, T, B, H]
            sums["hardness_sum"] = (hardest * real[None, :, :, None]).sum()
            sums["hardness_count"] = real.sum() * hardest.size(0) * hardest.size(-1)
    if "log_joint_q" in layers:
        log_joint_q = _stack_layers(layers["log_joint_q"])
        log_resp_q = _stack_layers(layers["log_resp_q"])
        # one query GMM shared by the heads
        q_gmms = _StackedGMMs(*gmm_parameters["q"], authors, num_heads, terms.trace_precision)
        losses["kl_q"], losses["dv_q"] = kl_and_diversity(log_joint_q, log_resp_q, q_gmms, s2("q"), weights)
        log_joint_q_cf = clusters_first(log_joint_q)
        if fused:
            from latent_core.sdma.triton_regularisers import query_terms

            losses["dqq"], losses["dxq"], other, clamped = query_terms(log_joint_q_cf, clusters_first(log_resp_q),
                                                                       valid, authors)
            clamped_count = clamped.sum()
        else:
            resp_q_cf = clusters_first(log_resp_q.exp())
            authors_p = clamped = None
            if authors or diagnose:
                authors_p, clamped = terms.authors_token_given_cluster(log_joint_q_cf)
            p_token_given_c = authors_p if authors else terms.token_given_cluster(log_joint_q_cf, valid)
            losses["dqq"] = terms.head_mi(p_token_given_c, resp_q_cf, weights, authors)
            losses["dxq"] = terms.query_input_mi(resp_q_cf, weights, unmasked=authors)
            if diagnose:
                with torch.no_grad():
                    other_p = terms.token_given_cluster(log_joint_q_cf, valid) if authors else authors_p
                    other = terms.head_mi_value(other_p, resp_q_cf, weights, not authors)
                    clamped_count = clamped.sum()
        if diagnose:
            with torch.no_grad():
                exact, theirs = (other, losses["dqq"]) if authors else (losses["dqq"], other)
                sums["dqq_clamped"] = clamped_count
                # one normaliser per cluster, layer, sentence and head
                sums["dqq_normalisers"] = torch.full((), log_joint_q_cf.numel() // log_joint_q_cf.size(2),
                                                     dtype=torch.float32, device=log_joint_q_cf.device)
                sums["dqq_authors"] = theirs.sum()
                sums["dqq_exact"] = exact.sum()
    return losses, sums


GROUP_COMBINATIONS = ("sum", "module_mean")


def collect_sdma_losses(model: nn.Module, records: SDMARecording, diagnostics: Optional[Dict[str, Tensor]] = None,
                        combine: str = "sum") -> Dict[str, Tensor]:
    """Per-sentence SDMA losses (eq. 20-23) of the forward pass ``records`` holds (:func:`recording`):
    layer mean per attention type, summed over types.

    Modules are grouped by ``sdma_group`` (e.g. ``encoder_self``, ``decoder_self``,
    ``decoder_cross``): each group's terms are averaged over its layers (the 1/N of
    eq. 20 and 23), and the groups are summed. Every value is ``[B]`` (one per sentence
    of the batch); a term no module produced (e.g. the query terms of SMA-T) is zeros,
    and when no SDMA module ran at all (V-T) every term is a 0-dim zero, so every term is
    present in every step's logging output. ``diagnostics``: see :func:`sdma_losses`.

    ``combine="module_mean"``: the authors' ESPnet model instead averages over every module of
    every type (``torch.cat(loss_kl, dim=1).mean()``): each group's layer mean is weighted by
    its share of the modules.
    """
    groups: Dict[Tuple, list] = {}  # in module order, as the records of one group are stacked
    for module in model.modules():
        record = records.get(module)  # only SDMA cores are recorded
        if record is not None:
            key = (getattr(module, "sdma_group", "default"), record.layout())
            groups.setdefault(key, []).append((module, record))
    if combine not in GROUP_COMBINATIONS:
        raise SDMAConfigError(f"combine={combine!r} is not one of {', '.join(GROUP_COMBINATIONS)}")
    modules = sum(len(items) for items in groups.values())
    per_group = []
    for items in groups.values():
        terms = sdma_losses(items, diagnostics)
        if combine == "module_mean":
            terms = {name: value * (len(items) / modules) for name, value in terms.items()}
        per_group.append(terms)
    present = [v for g in per_group for v in g.values()]
    zeros = torch.zeros_like(present[0]) if present else torch.zeros(())
    if not per_group:
        return {name: zeros for name in LOSS_NAMES}
    # every group's terms in one stack, summed over the groups at once (a term a group lacks is zeros): three
    # launches for all the terms, not a stack and a sum per term
    stacked = torch.stack([g.get(name, zeros) for g in per_group for name in LOSS_NAMES])
    total = stacked.view(len(per_group), len(LOSS_NAMES), *zeros.shape).sum(0)
    return dict(zip(LOSS_NAMES, total.unbind(0)))


def diagnostic_summary(sums: Mapping) -> Dict:
    """``dqq_clamped`` (share of the authors' L_Dqq normalisers at their clamp), ``dqq_ratio``
    (their L_Dqq / the exact one) and ``hardness`` (mean max_c p(c|z)) from the sums of
    :data:`DIAGNOSTIC_SUMS`. Numbers give floats (a value whose denominator is 0 is left out);
    tensors give 0-dim tensors without a device sync (NaN where the denominator is 0); a value
    whose sums are missing is left out."""
    out = {}
    for name, num, den in (("dqq_clamped", "dqq_clamped", "dqq_normalisers"),
                           ("dqq_ratio", "dqq_authors", "dqq_exact"),
                           ("hardness", "hardness_sum", "hardness_count")):
        if den not in sums:
            continue
        denominator, numerator = sums[den], sums.get(num, 0.0)
        if isinstance(denominator, Tensor):
            ratio = numerator / denominator.clamp_min(torch.finfo(denominator.dtype).tiny)
            out[name] = torch.where(denominator > 0, ratio, torch.full_like(ratio, float("nan")))
        elif float(denominator) > 0:
            out[name] = float(numerator) / float(denominator)
    return out


def weighted_regulariser(terms: Dict[str, Tensor], weights: Dict[str, float]) -> Tensor:
    """lambda_k (KL_z + KL_q) + lambda_q L_Dqq - lambda_x L_Dxq + lambda_d (DV_z + DV_q): eq. (24) without L_CE.

    ``terms`` as returned by :func:`collect_sdma_losses` (``[B]`` per sentence); ``weights``
    keyed like :data:`LOSS_WEIGHTS`. Zero-weighted terms are skipped. Float32, one value
    per sentence (``[B]``, or 0-dim when the terms are).
    """
    total = None
    for name, coefficient in _coefficients(weights):
        term = terms[name].float()
        # one launch per term: the weight rides on the add (alpha), not a product of its own
        total = term * coefficient if total is None else torch.add(total, term, alpha=coefficient)
    return torch.zeros_like(next(iter(terms.values())), dtype=torch.float32) if total is None else total


def weighted_terms(terms: Dict[str, Tensor], weights: Dict[str, float]) -> Dict[str, Tensor]:
    """Each term of eq. (24) as it enters the loss, ``{name: sign * lambda * term}`` (float32; zero-weighted
    terms left out): the parts :func:`weighted_regulariser` sums."""
    return {name: coefficient * terms[name].float() for name, coefficient in _coefficients(weights)}


def _coefficients(weights: Dict[str, float]):
    """(term name, sign * lambda) of each term of eq. (24) whose weight is not zero."""
    return [(name, sign * weights[option]) for option, (_, names, sign) in LOSS_WEIGHTS.items() if weights[option]
            for name in names]


def scale_regulariser(per_sentence: Tensor, scale: str, num_tokens: float) -> Tensor:
    """The batch's regulariser term from per-sentence values ``[B]``, next to a token-SUMMED L_CE.

    * ``sentence`` (default): the sum over the batch's sentences, as the authors' fairseq
      criterion does (``.mean((1, 2)).sum()``); the whole loss is then extensive in the
      batch (two copies of a sentence give twice every term) and the Table I lambdas weigh
      each sentence's regularisers against that sentence's summed L_CE;
    * ``batch``: the batch mean, added once per batch (~``nsentences`` times weaker);
    * ``token``: the batch mean times ``num_tokens`` (eq. 24 read with a per-token L_CE;
      ~tokens-per-sentence times stronger than ``sentence``).
    """
    if scale == "sentence":
        return per_sentence.sum()
    if scale == "batch":
        return per_sentence.mean() if per_sentence.dim() else per_sentence
    if scale == "token":
        return (per_sentence.mean() if per_sentence.dim() else per_sentence) * float(num_tokens)
    raise SDMAConfigError(f"regulariser scale {scale!r} is not one of {', '.join(REGULARISER_SCALES)}")
