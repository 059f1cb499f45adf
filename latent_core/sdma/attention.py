"""Attention with the semantic mask: eq. (1), (2), (10), (11) from q, k, v and the responsibilities.

:func:`sdma_attention` is the one entry point of both toolkits' adapters; it dispatches on :data:`KERNELS`.
A new attention variant is one function ``AttentionInputs -> (A_hat V, A_hat or None)`` and one row of
:data:`KERNELS`; ``tests/unit/latent_core/test_sdma_kernels_exact.py`` then holds it to the explicit kernel
in every row (values and gradients, both readings, padding and causal masks).
"""

from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from latent_core.profiling import source_range
from latent_core.sdma.mixture import full_precision
from latent_core.sdma.options import AUTHORS_EPS, PAPER_MASK_FLOOR, SDMAConfigError, check_score_bias


def responsibility_product(resp_query: Tensor, resp_key: Tensor, heads: Optional[int] = None) -> Tensor:
    """sum_c p(c|z_i) p(c|z_j), ``[N, T, C] x [N, S, C] -> [N, T, S]`` (float32 or wider).

    When several hypotheses share one set of keys (fairseq's beamable encoder-decoder
    attention), ``resp_query`` is ``[B * beam * heads, T, C]`` and ``resp_key``
    ``[B * heads, S, C]``; pass ``heads`` for that layout.
    """
    with full_precision(resp_query):
        if resp_query.size(0) == resp_key.size(0):
            return torch.bmm(resp_query, resp_key.transpose(1, 2))
        n_key, S, C = resp_key.shape
        batch, T = n_key // heads, resp_query.size(1)
        return torch.einsum(
            "bxhtc,bhsc->bxhts",
            resp_query.view(batch, -1, heads, T, C),
            resp_key.view(batch, heads, S, C),
        ).reshape(-1, T, S)


def semantic_mask_product(resp_query: Tensor, resp_key: Tensor, heads: Optional[int] = None) -> Tensor:
    """M of eq. (10) up to its row normaliser, ``[N, T, S]`` (the paper reading).

    M_ij is proportional to sum_c p(c|z_i) p(c|z_j) (:func:`responsibility_product`, which
    documents the shapes and ``heads``); the normaliser over keys cancels in the renormalised
    masked attention of eq. (2), so only the product is kept (plus 1e-6, so a row with no
    overlap falls back to plain attention, never NaN).
    """
    return responsibility_product(resp_query, resp_key, heads) + PAPER_MASK_FLOOR


def authors_semantic_mask(resp_query: Tensor, resp_key: Tensor, allowed: Optional[Tensor],
                          heads: Optional[int] = None) -> Tensor:
    """M of eq. (10) as the authors compute it, ``[N, T, S]``: the product of the responsibilities
    times the 0/1 padding/causal mask ``allowed`` (or None), L1-normalised over keys with their
    eps (``F.normalize(..., p=1, eps=1e-6)``). ``allowed`` is ``[K, 1 or N/K, 1 or T, S]``: the N
    rows are read as K sentence-major blocks (e.g. ``[B, 1, 1, S]`` key padding, ``[1, 1, T, S]``
    a causal mask)."""
    product = responsibility_product(resp_query, resp_key, heads)
    if allowed is not None:
        T, S = product.shape[-2:]
        product = (product.view(allowed.size(0), -1, T, S) * allowed).view(-1, T, S)
    return product / product.sum(-1, keepdim=True).clamp_min(AUTHORS_EPS)


def reading_semantic_mask(resp_query: Tensor, resp_key: Tensor, authors: bool, allowed: Optional[Tensor] = None,
                          heads: Optional[int] = None) -> Tensor:
    """M of eq. (10) as the attention uses it, ``[N, T, S]``, in one reading: the authors'
    (:func:`authors_semantic_mask`, times ``allowed``, L1-normalised with their eps) or the paper's
    (:func:`semantic_mask_product`; ``allowed`` unused, the blocked keys' scores carry it)."""
    if authors:
        return authors_semantic_mask(resp_query, resp_key, allowed, heads)
    return semantic_mask_product(resp_query, resp_key, heads)


def semantic_mask(resp_query: Tensor, resp_key: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """M of eq. (10), normalised over (non-padding) keys; for analysis and figures."""
    m = torch.bmm(resp_query, resp_key.transpose(1, 2))
    if key_padding_mask is not None:
        m = m.masked_fill(key_padding_mask[:, None, :], 0.0)
    return m / m.sum(-1, keepdim=True).clamp_min(1e-12)


def row_softmax(scores: Tensor) -> Tensor:
    """``torch.softmax(scores, -1)`` for an autograd Function's forward (on a CPU its ops work in place, which autograd
    could not differentiate; :func:`row_softmax_backward` is its backward). On a CPU over short rows (attention at MT
    lengths) as max, exp and a division: ATen's last-dimension softmax takes ~4x as long there (4.6 against 1.1 ms
    over [300, 4, 12, 12], one thread)."""
    if scores.device.type != "cpu":
        return torch.softmax(scores, dim=-1)
    shifted = scores - scores.amax(-1, keepdim=True)
    exps = shifted.exp_()
    return exps.div_(exps.sum(-1, keepdim=True))


def row_softmax_backward(grad: Tensor, probs: Tensor) -> Tensor:
    """d/ds of ``probs = row_softmax(s)`` given ``grad``: probs o (grad - <grad, probs>); on a CPU in three ops (ATen's
    kernel: 1.9 against 0.8 ms over [300, 4, 12, 12])."""
    if probs.device.type != "cpu":
        return torch._softmax_backward_data(grad, probs, -1, probs.dtype)
    return (grad - (grad * probs).sum(-1, keepdim=True)).mul_(probs)


def mix_attention(scores: Tensor, mask: Optional[Tensor], mix: Tensor, norm_floor: float = 0.0) -> Tensor:
    """A_hat = (1 - g) A + g A_bar (eq. 11), from pre-softmax ``scores`` (float32).

    A = softmax(scores) (eq. 1); A_bar = M o A / sum_j' (M o A) (eq. 2) with ``mask`` the
    unnormalised M of :func:`semantic_mask_product` (its row normaliser cancels). One
    softmax: A_bar reuses A (the same value as softmax(scores + log M), without a
    second exponential pass). Differentiable in ``scores`` and ``mask`` by
    :class:`_MixedAttention`, which keeps only A, M and the row sums for the backward pass.
    ``norm_floor``: the row sums are clamped from below (the authors' ``F.normalize`` eps, 1e-6,
    with the normalised mask of :func:`authors_semantic_mask`).
    """
    if mask is None:
        return torch.softmax(scores, dim=-1)
    # g is a schedule (the SDMACore buffer), never trained: no gradient flows to it; a copy, so that
    # advancing the schedule before backward (the authors' ESPnet counter) leaves the graph intact
    mix = mix.detach().to(scores.dtype, copy=True)
    return _MixedAttention.apply(scores, mask.to(scores.dtype), mix, norm_floor)


class _MixedAttention(torch.autograd.Function):
    """eq. (1), (2), (11) as one autograd node: ``(scores, M, g) -> A_hat``, ``[..., T, S]``.

    Saves A, M and Z = max(sum_j M_ij A_ij, floor) (autograd would keep A, M, M o A and A_bar).
    Backward: dA_bar = g dA_hat; dW = (dA_bar - <dA_bar, A_bar>) / Z for W = M o A (the second
    term vanishes on rows where Z is the floor); dM = dW o A; dA = (1 - g) dA_hat + dW o M;
    dscores = A o (dA - <dA, A>), <.,.> the row sums.
    """

    @staticmethod
    def forward(ctx, scores, mask, mix, norm_floor=0.0):
        attn = row_softmax(scores)
        masked = attn * mask
        norm = masked.sum(-1, keepdim=True)
        if norm_floor > 0:
            norm = norm.clamp_min(norm_floor)
        ctx.norm_floor = norm_floor
        ctx.save_for_backward(attn, mask, norm, mix)
        return torch.lerp(attn, masked.div_(norm), mix)

    @staticmethod
    def backward(ctx, grad):
        attn, mask, norm, mix = ctx.saved_tensors
        masked = attn * mask / norm  # A_bar
        grad_masked = grad * mix
        inner = (grad_masked * masked).sum(-1, keepdim=True)
        if ctx.norm_floor > 0:
            inner = inner.masked_fill(norm <= ctx.norm_floor, 0.0)
        grad_w = (grad_masked - inner).div_(norm)
        grad_mask = grad_w * attn if ctx.needs_input_grad[1] else None
        grad_attn = torch.addcmul(grad - grad_masked, grad_w, mask)  # (1 - g) dA_hat + dW o M
        grad_scores = row_softmax_backward(grad_attn, attn)  # A o (dA - <dA, A>)
        return grad_scores, grad_mask, None, None


def fused_mix_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, mix: Tensor,
                        base_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                        authors_responsibilities: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None) -> Tensor:
    """A_hat V of eq. (11) with ``torch.nn.functional.scaled_dot_product_attention``.

    A_hat V = (1 - g) softmax(s) V + g softmax(s + log M) V: two SDPA calls, the second with
    the semantic mask as an additive float mask, so fused kernels run (memory-efficient
    attention on CUDA accepts, and differentiates, an additive mask; on a CPU the unmasked
    branch gets the fused CPU kernel). ``q [B, H, T, D]`` already scaled, ``k, v [B, H, S, D]``,
    ``mask`` M of eq. (10) reshaped to ``[B, H, T, S]`` (:func:`semantic_mask_product`, or the
    authors' :func:`authors_semantic_mask`), ``base_mask`` an additive float mask (padding / future
    positions as ``-inf``) broadcastable to ``[B, H, T, S]`` in ``q``'s dtype, or None. Returns
    ``[B, H, T, D]`` in ``q``'s dtype. With ``dropout_p > 0`` each branch draws its own dropout (the
    explicit path drops A_hat). A mask with zeros is floored at the smallest normal float before the log.

    The authors reading (``authors_responsibilities = (resp_query [B, H, T, C], resp_key [B, H, S, C],
    allowed)``, ``allowed`` the 0/1 mask of :func:`authors_semantic_mask` or None): their A_bar divides
    M o A by max(Z_i, eps), Z_i = sum_j M_ij A_ij, so a row whose masked mass is below eps is not
    renormalised to 1 (softmax(s + log M) always is). Z_i = sum_c gq_ic [A gk_c]_i / r_i (M has rank C;
    r_i its row normaliser), so the plain call's value is widened by the C responsibilities of the keys
    and the masked branch is scaled by min(1, Z_i / eps): exact in every row.
    """
    log_mask = torch.log(mask.clamp_min(torch.finfo(mask.dtype).tiny)).to(q.dtype)
    if base_mask is not None:
        log_mask = log_mask + base_mask
    D = v.size(-1)
    plain_value = v if authors_responsibilities is None else torch.cat([v, authors_responsibilities[1].to(v.dtype)], -1)
    plain = F.scaled_dot_product_attention(q, k, plain_value, attn_mask=base_mask, dropout_p=dropout_p, scale=1.0)
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=log_mask, dropout_p=dropout_p, scale=1.0)
    if authors_responsibilities is not None:
        resp_query, resp_key, allowed = authors_responsibilities
        plain, attended_key_resp = plain[..., :D], plain[..., D:]  # [A V], [A gk]
        with full_precision(resp_query):
            wide = torch.promote_types(q.dtype, torch.float32)
            gq = resp_query.to(wide)
            row = (gq * _allowed_key_mass(resp_key.to(wide), allowed)).sum(-1, keepdim=True).clamp_min(AUTHORS_EPS)
            mass = (gq * attended_key_resp.to(wide)).sum(-1, keepdim=True) / row  # Z_i of eq. (2)
            masked = (masked.to(wide) * (mass / AUTHORS_EPS).clamp_max(1.0)).to(q.dtype)
    return torch.lerp(plain, masked, mix.detach().to(plain.dtype, copy=True))


def _allowed_key_mass(resp_key: Tensor, allowed: Optional[Tensor]) -> Tensor:
    """sum_{j allowed} p(c|k_j), ``[B, H, T or 1, C]`` from ``resp_key [B, H, S, C]`` and the 0/1
    ``allowed`` (broadcastable to ``[B, H, T, S]``; None: every key): the authors' mask normaliser
    r_i = sum_c gq_ic (this)_ic before its eps."""
    if allowed is None:
        return resp_key.sum(-2, keepdim=True)
    return torch.matmul(allowed.to(resp_key.dtype), resp_key)


def lowrank_mix_attention(q: Tensor, k: Tensor, v: Tensor, resp_query: Tensor, resp_key: Tensor, mix: Tensor,
                          base_mask: Optional[Tensor] = None, allowed: Optional[Tensor] = None,
                          dropout_p: float = 0.0, authors: bool = False) -> Tensor:
    """A_hat V of eq. (11) in one ``scaled_dot_product_attention`` call, with no T x S mask.

    M_ij = sum_c gq_ic gk_jc (+ eps) has rank C, so the masked branch of eq. (2) is
    ``(sum_c gq_ic [A (gk_c o V)]_i + eps [A V]_i) / (sum_c gq_ic [A gk_c]_i + eps)``: one SDPA call
    with the value widened to ``[V | gk_1 V | ... | gk_C V | gk]`` (width (C+1) D + C) gives both
    branches; the responsibilities get their gradient through that value and the final ratio.
    ``q [B, H, T, D]`` scaled, ``k, v [B, H, S, D]``, ``resp_query [B, H, T, C]``,
    ``resp_key [B, H, S, C]`` (p(c|.) per head), ``base_mask`` additive (``-inf`` at padding/future
    keys) broadcastable to ``[B, H, T, S]`` in ``q``'s dtype. ``authors`` selects the authors reading
    (:func:`authors_semantic_mask`: M L1-normalised over the keys ``allowed`` (0/1, broadcastable to
    ``[B, H, T, S]``; None: every key), both normalisers floored at their eps); else the paper reading
    (:func:`semantic_mask_product`; ``allowed`` unused). Returns ``[B, H, T, D]`` in ``q``'s dtype. Exact (no
    approximation) up to rounding; with ``dropout_p > 0`` the kernel drops A before the mask
    (one draw for both branches; the explicit path drops A_hat).
    """
    D, C = v.size(-1), resp_key.size(-1)
    gk = resp_key.to(v.dtype)
    widened = torch.cat([v, (gk.unsqueeze(-1) * v.unsqueeze(-2)).flatten(-2), gk], dim=-1)
    out = F.scaled_dot_product_attention(q, k, widened, attn_mask=base_mask, dropout_p=dropout_p, scale=1.0)
    wide = torch.promote_types(out.dtype, torch.float32)  # the ratio in fp32 (or wider) under fp16/bf16
    with full_precision(resp_query):
        out = out.to(wide)
        plain = out[..., :D]  # [A V]_i
        gq = resp_query.to(wide)
        num = torch.einsum("bhtc,bhtcd->bhtd", gq, out[..., D:D + C * D].unflatten(-1, (C, D)))
        den = torch.einsum("bhtc,bhtc->bht", gq, out[..., D + C * D:]).unsqueeze(-1)
        if not authors:  # eq. (10) plus the 1e-6 floor of semantic_mask_product
            masked = (num + PAPER_MASK_FLOOR * plain) / (den + PAPER_MASK_FLOOR)
        else:  # r_i = max(sum_c gq_ic sum_{j allowed} gk_jc, eps), then A o M renormalised with eps
            row = (gq * _allowed_key_mass(resp_key.to(wide), allowed)).sum(-1, keepdim=True).clamp_min(AUTHORS_EPS)
            masked = (num / row) / (den / row).clamp_min(AUTHORS_EPS)
        mixed = torch.lerp(plain, masked, mix.detach().to(plain.dtype, copy=True))
    return mixed.to(q.dtype)


def select_kernel(kernel: str, device: torch.device, need_weights: bool, dropout_active: bool) -> str:
    """The row of :data:`KERNELS` that computes this forward pass: the option's own kernel, except that
    the weights (attention plots, LR/HR, ``need_weights``) need one of :data:`RETURNS_WEIGHTS` (else the explicit
    one), and ``auto`` is ``sdpa`` on CUDA without attention dropout, ``explicit`` elsewhere."""
    if (need_weights and kernel not in RETURNS_WEIGHTS) or kernel == "explicit":
        return "explicit"
    if kernel != "auto":
        return kernel
    return "sdpa" if device.type == "cuda" and not dropout_active else "explicit"


class AttentionInputs(NamedTuple):
    """What every kernel of :data:`KERNELS` receives (built by :func:`sdma_attention`)."""

    q: Tensor  # [B, H, T, D], scaled (times `scale` in the rows of TAKES_RAW_INPUTS)
    k: Tensor  # [B, H, S, D]
    v: Tensor  # [B, H, S, D]
    resp_query: Tensor  # [B, H, T, C], p(c | z_i) (log p(c | z_i) with `log_responsibilities`)
    resp_key: Tensor  # [B, H, S, C], p(c | z_j) (likewise)
    mix: Tensor  # g of eq. (11), a scalar buffer
    authors: bool  # the reading of eq. (10)'s mask (authors_semantic_mask vs semantic_mask_product)
    blocked: Optional[Tensor]  # bool, True where query i may not attend to key j, broadcastable to [B, H, T, S]
    allowed: Optional[Tensor]  # its 0/1 float complement: the keys the authors' mask normaliser sums over
    dropout: Callable[[Tensor], Tensor]  # the module's attention dropout (the explicit kernel drops A_hat)
    dropout_p: float  # its rate when active, else 0 (the fused kernels' own dropout)
    score_bias: Optional[Tensor] = None  # added to the scaled scores before eq. (1), broadcastable to [B, H, T, S]
    scale: float = 1.0  # the scores' factor on q.k (only in the rows of TAKES_RAW_INPUTS; the others get q scaled)
    log_responsibilities: bool = False  # resp_* are log p(c|.) (only in TAKES_RAW_INPUTS; the others get p(c|.))
    need_weights: bool = False  # A_hat asked for (rows of RETURNS_WEIGHTS; select_kernel sends the others to explicit)

    def additive_mask(self) -> Optional[Tensor]:
        """``score_bias`` and ``blocked`` as SDPA's additive float mask in ``q``'s dtype: the bias, with the blocked
        keys at the dtype's smallest value (not -inf, and not bias + smallest, which overflows in fp16: a row with
        every key blocked stays finite, as in the explicit kernel)."""
        if self.score_bias is None and self.blocked is None:
            return None
        if self.score_bias is None:
            return torch.zeros(self.blocked.shape, dtype=self.q.dtype, device=self.q.device).masked_fill(
                self.blocked, torch.finfo(self.q.dtype).min)
        bias = self.score_bias.to(self.q.dtype)
        if self.blocked is None:
            return bias
        return bias.masked_fill(self.blocked, torch.finfo(self.q.dtype).min)

    def semantic_mask(self) -> Tensor:
        """M of eq. (10), ``[B, H, T, S]``, in this reading."""
        B, H, T, S = self.q.size(0), self.q.size(1), self.q.size(2), self.k.size(2)
        flat_query, flat_key = self.resp_query.flatten(0, 1), self.resp_key.flatten(0, 1)
        return reading_semantic_mask(flat_query, flat_key, self.authors, self.allowed).view(B, H, T, S)


def explicit_kernel(x: AttentionInputs) -> Tuple[Tensor, Tensor]:
    """Scores, eq. (1), (2), (11) in one autograd node (:func:`mix_attention`), dropout, A_hat V; the
    weights A_hat ``[B, H, T, S]`` (float32, or float64 for float64 inputs) are returned. Blocked keys get
    weight 0."""
    # Half-precision scores are widened: the mixture's normaliser (eps 1e-6) underflows in fp16.
    score_dtype = torch.promote_types(x.q.dtype, torch.float32)
    scores = torch.matmul(x.q, x.k.transpose(-2, -1)).to(score_dtype)
    if x.score_bias is not None:
        scores = scores + x.score_bias.to(score_dtype)
    if x.blocked is not None:
        scores = scores.masked_fill(x.blocked, torch.finfo(score_dtype).min)
    attn = mix_attention(scores, x.semantic_mask(), x.mix, norm_floor=AUTHORS_EPS if x.authors else 0.0)
    if x.blocked is not None:
        attn = attn.masked_fill(x.blocked, 0.0)
    return torch.matmul(x.dropout(attn.type_as(x.v)), x.v), attn


def sdpa_kernel(x: AttentionInputs) -> Tuple[Tensor, None]:
    """Two ``scaled_dot_product_attention`` calls (:func:`fused_mix_attention`)."""
    exact_rows = (x.resp_query, x.resp_key, x.allowed) if x.authors else None
    return fused_mix_attention(x.q, x.k, x.v, x.semantic_mask(), x.mix, x.additive_mask(), x.dropout_p,
                               authors_responsibilities=exact_rows), None


def lowrank_kernel(x: AttentionInputs) -> Tuple[Tensor, None]:
    """One ``scaled_dot_product_attention`` call with no T x S mask (:func:`lowrank_mix_attention`)."""
    return lowrank_mix_attention(x.q, x.k, x.v, x.resp_query, x.resp_key, x.mix, x.additive_mask(), x.allowed,
                                 x.dropout_p, authors=x.authors), None


def triton_kernel(x: AttentionInputs) -> Tuple[Tensor, Optional[Tensor]]:
    """One flash-style Triton kernel, its backward in three (:func:`latent_core.sdma.triton_kernels.mixed_attention`;
    imported on first use, so that ``TRITON_INTERPRET`` can be set before Triton reads it); with ``need_weights`` one
    more for A_hat (without a gradient)."""
    from latent_core.sdma.triton_kernels import mixed_attention

    out = mixed_attention(x.q, x.k, x.v, x.resp_query, x.resp_key, x.mix, authors=x.authors, blocked=x.blocked,
                          dropout_p=x.dropout_p, score_bias=x.score_bias, scale=x.scale,
                          log_responsibilities=x.log_responsibilities, need_weights=x.need_weights)
    return out if x.need_weights else (out, None)


# The rows of KERNELS that take the queries unscaled with the scores' factor, and the responsibilities as log p(c|.)
# (AttentionInputs.scale, .log_responsibilities): the Triton kernel, where scaling the queries and exponentiating the
# clustering's output are launches of their own, forward and backward. The other rows get q scaled and p(c|.).
TAKES_RAW_INPUTS = frozenset({"triton"})

# The rows of KERNELS that return the weights A_hat when asked (need_weights): the explicit row, with their gradient,
# and the Triton kernel, without one (fairseq asks for the last decoder layer's cross-attention weights in training
# and its criteria but the alignment one ignore them; the explicit row there is ~50 launches, this one 1).
RETURNS_WEIGHTS = frozenset({"explicit", "triton"})

# The rows of KERNELS that add a score bias (T5's position bias, the Conformer's matrix_bd, ALiBi) to the scores of
# eq. (1); the others refuse one by name.
TAKES_SCORE_BIAS = frozenset({"explicit", "sdpa", "lowrank", "triton"})

# The kernels of eq. (1), (2), (10), (11), by SDMAOptions.attention_kernel (``auto``: :func:`select_kernel`).
# A new variant is one function of AttentionInputs -> (A_hat V [B, H, T, D], A_hat or None) and one row here;
# tests/unit/latent_core/test_sdma_kernels_exact.py then holds it to the explicit kernel in every row.
KERNELS: Dict[str, Callable[[AttentionInputs], Tuple[Tensor, Optional[Tensor]]]] = {
    "explicit": explicit_kernel,
    "sdpa": sdpa_kernel,
    "lowrank": lowrank_kernel,
    "triton": triton_kernel,
}


def _same_elements(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same elements in the same order."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype)


def sdma_attention(q: Tensor, k: Tensor, v: Tensor, resp_query: Tensor, resp_key: Tensor, mix: Tensor, *,
                   authors: bool, blocked: Optional[Tensor], kernel: str, need_weights: bool,
                   dropout: Callable[[Tensor], Tensor], dropout_p: float,
                   score_bias: Optional[Tensor] = None, scale: float = 1.0,
                   log_responsibilities: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """A_hat V of eq. (1), (2), (10), (11): the one entry point of both toolkits' adapters.

    ``q [B, H, T, D]`` whose scores are ``scale`` q.k (1: already scaled), ``k, v [B, H, S, D]``, ``resp_query [B, H,
    T, C]`` and ``resp_key [B, H, S, C]`` the clustering probabilities of eq. (9) (their logs, as the clustering gives
    them, with ``log_responsibilities``; the Triton kernel reads q, ``scale`` and the logs as they are, the other
    rows get q scaled and p(c|.)), ``mix`` g, ``authors`` the reading of the
    mask, ``blocked`` bool broadcastable to ``[B, H, T, S]`` (True: padding or a future key; None),
    ``kernel`` the option (``auto`` / a row of :data:`KERNELS`), ``need_weights`` whether A_hat must be
    returned, ``dropout`` the module's attention dropout and ``dropout_p`` its rate when active (else 0),
    ``score_bias`` an additive bias on the scaled scores before the softmax of eq. (1) (relative positions),
    broadcastable to ``[B, H, T, S]``, differentiable (rows of :data:`TAKES_SCORE_BIAS`; ``auto`` picks one).
    Returns ``(A_hat V [B, H, T, D], A_hat [B, H, T, S] (at least float32) or None)``; the adapters keep only their
    layout, incremental cache and beam folding.
    """
    name = select_kernel(kernel, q.device, need_weights, dropout_p > 0)
    if score_bias is not None:
        if name not in TAKES_SCORE_BIAS:
            raise SDMAConfigError(
                f"attention_kernel={name!r} does not take a score bias (a relative-position attention: T5, the "
                f"Conformer, ALiBi); use one of {', '.join(sorted(TAKES_SCORE_BIAS))} or 'auto'")
        check_score_bias(score_bias, (q.size(0), q.size(1), q.size(2), k.size(2)))
    with source_range("mixture"):
        if name not in TAKES_RAW_INPUTS:
            if scale != 1.0:
                q = q * scale
            if log_responsibilities:
                # a self-attention's keys are its queries (the adapters pass two views of one tensor): one exp
                same = _same_elements(resp_query, resp_key)
                resp_query = resp_query.exp()
                resp_key = resp_query if same else resp_key.exp()
            scale, log_responsibilities = 1.0, False
        # the 0/1 complement of blocked, for the rows that read it (the Triton kernel reads blocked itself)
        allowed = None if blocked is None or name in TAKES_RAW_INPUTS else (~blocked).to(torch.float32)
        return KERNELS[name](AttentionInputs(q, k, v, resp_query, resp_key, mix, authors, blocked, allowed, dropout,
                                             dropout_p, score_bias, scale, log_responsibilities,
                                             need_weights and name != "explicit"))
