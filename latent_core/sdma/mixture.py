"""The Gaussian mixtures of eq. (5)/(9) (:class:`GaussianMixture`, the per-head feature GMM and the
query GMM), their log-joint as one autograd node, and the clusters-first layout of the clustering tensors."""

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from latent_core.sdma.options import LOG_2PI

LOGVAR_RANGE = (-9.0, 9.0)


class GaussianMixture(nn.Module):
    """``groups`` independent diagonal GMMs of ``num_clusters`` components in ``dim`` dims.

    Parameters (eq. 5): prior logits ``[G, C]`` (pi = softmax), means ``[G, C, d]``
    and log-variances ``[G, C, d]``; ``init="paper"`` draws the means from N(0, 1) with unit
    variances and a uniform prior, ``init="authors"`` as their code. The gradient of the means is multiplied by
    ``centroid_grad_scale`` (c_g of Section IV-A3).
    """

    def __init__(self, groups: int, num_clusters: int, dim: int, centroid_grad_scale: float = 1.0,
                 init: str = "paper"):
        super().__init__()
        self.groups, self.num_clusters, self.dim = groups, num_clusters, dim
        self.prior_logits = nn.Parameter(torch.zeros(groups, num_clusters))
        self.means = nn.Parameter(torch.randn(groups, num_clusters, dim))
        self.log_vars = nn.Parameter(torch.zeros(groups, num_clusters, dim))
        if init == "authors":
            self.reset_parameters_as_authors()
        self.centroid_grad_scale = float(centroid_grad_scale)

    def reset_parameters_as_authors(self) -> None:
        """xavier_normal_ (gain 1) on every GMM parameter, as the authors' init_cluster_params: means
        near the origin (std sqrt(2 / ((G + C) d)), ~0.044 at base), soft clusters at step 0."""
        for parameter in (self.prior_logits, self.means, self.log_vars):
            nn.init.xavier_normal_(parameter)

    def scaled_means(self) -> Tensor:
        """The means, whose gradient is multiplied by c_g (``centroid_grad_scale``) on its way back: an op at each
        use rather than a hook on the parameter, which a copy (PEFT's ``modules_to_save``, EMA) or FSDP's
        parameters (new tensors, sharded and gathered) would not carry."""
        if self.centroid_grad_scale == 1.0 or not torch.is_grad_enabled():
            return self.means
        return _ScaledGradient.apply(self.means, self.centroid_grad_scale)

    def log_joint(self, z: Tensor, terms: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
                  scale: float = 1.0) -> Tensor:
        """log pi_c + log N(s z | mu_c, sigma_c^2) for ``z`` of shape ``[..., G, d]`` -> ``[..., G, C]``.

        ``scale`` s multiplies the input (the authors' fairseq code clusters x / 10): it is folded into the
        density's weights, so the scaled input is never materialised or saved for the backward pass.

        Computed in (at least) float32 by :class:`_GaussianLogJoint`, which saves only ``z``
        for the backward pass. The result is stored clusters-first (``[C, ..., G]`` in memory,
        see :func:`clusters_first`), so softmaxes and sums over the few clusters run as
        vectorised operations over the long dimensions. Without gradients, ``terms`` (from
        :meth:`inference_terms`) may be passed by a caller that knows the parameters cannot
        have changed since they were built (one beam search); otherwise they are rebuilt
        from the current parameters on every call.
        """
        return self.log_joint_rows([z], terms, scale).view(*z.shape[:-1], self.num_clusters)

    def log_joint_rows(self, zs: Sequence[Tensor], terms: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
                       scale: float = 1.0) -> Tensor:
        """:meth:`log_joint` of several inputs ``[..., G, d]`` (leading shapes may differ) in one density
        evaluation: their rows in order, ``[N_1 + N_2 + ..., G, C]`` (clusters-first storage). Each input is
        saved for the backward pass as it is (a cross-attention's queries and keys, already saved by their
        projections), not as a concatenated copy."""
        dtype = torch.promote_types(zs[0].dtype, torch.float32)
        flats = [z.to(dtype).reshape(-1, self.groups * self.dim) for z in zs]  # [N_i, G*d]
        with full_precision(flats[0]):
            if torch.is_grad_enabled():
                out = _GaussianLogJoint.apply(scale, self.scaled_means(), self.log_vars, self.prior_logits, *flats)
            else:
                # Never cached across calls on the module: fairseq's FP16Optimizer (and EMA, and
                # anyone writing ``p.data``) changes the parameters without bumping their version
                # counter or moving them, so a cache keyed on either serves stale weights.
                if terms is None or terms[0].dtype != dtype:
                    terms = self.inference_terms(dtype)
                weight_sq, weight_lin, bias = terms
                if scale != 1.0:
                    weight_sq, weight_lin = weight_sq * (scale * scale), weight_lin * scale
                out = _log_joint_columns(flats, weight_sq, weight_lin, bias).t()
        # [N, C*G] (columns cluster-major, stored column-major) -> storage [C, N, G], viewed as [N, G, C]
        # (one copy, none when G = 1: the query GMM's product is already clusters-first)
        return out.view(-1, self.num_clusters, self.groups).transpose(0, 1).contiguous().movedim(0, -1)

    def inference_terms(self, dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor, Tensor]:
        """The expanded log-density of the CURRENT parameters, ``([G*d, C*G], [G*d, C*G], [C*G])``."""
        with torch.no_grad():
            return _gmm_parts(self.means, self.log_vars, self.prior_logits, dtype)[:3]

    def log_prior(self) -> Tensor:
        """log pi, ``[G, C]`` (float32)."""
        return log_prior(self.prior_logits)

    def trace_precision(self) -> Tensor:
        """sum_d 1 / sigma_{c,d}^2, shape ``[G, C]`` (enters the KL of eq. 20)."""
        return trace_precision(self.log_vars)


# Of one GMM's parameters or of several stacked along a leading layer axis (``sdma_losses`` stacks
# the layers' parameters first: one set of ops per attention type instead of one per layer).
def log_prior(prior_logits: Tensor) -> Tensor:
    """log pi, ``[..., G, C]`` (float32), from the prior logits ``[..., G, C]``."""
    return F.log_softmax(prior_logits.float(), dim=-1)


def trace_precision(log_vars: Tensor) -> Tensor:
    """sum_d 1 / sigma_{c,d}^2, ``[..., G, C]`` (float32), from the log-variances ``[..., G, C, d]``."""
    return torch.exp(-log_vars.float().clamp(*LOGVAR_RANGE)).sum(-1)


def authors_linear_init(linear: nn.Linear, gain: float) -> None:
    """The authors' initialisation of an attention projection: xavier_normal_ weights with ``gain``
    and the bias ``nn.Linear`` would draw (uniform in +-1/sqrt(fan_in))."""
    nn.init.xavier_normal_(linear.weight, gain=gain)
    if linear.bias is not None:
        bound = 1 / math.sqrt(linear.weight.size(1))
        nn.init.uniform_(linear.bias, -bound, bound)


def full_precision(tensor: Tensor):
    """Autocast off for the block that follows (its matrix products keep ``tensor``'s dtype)."""
    return torch.autocast(tensor.device.type, enabled=False)


class _GMMParts(NamedTuple):
    """The expanded log-density of :func:`_gmm_parts` and what its backward pass reuses."""
    weight_sq: Tensor  # [G*d, C*G], block-diagonal -1/2 sigma^-2 (times s^2)
    weight_lin: Tensor  # [G*d, C*G], block-diagonal mu sigma^-2 (times s)
    bias: Tensor  # [C*G]
    means: Tensor  # [G, C, d] in the compute dtype
    precision: Tensor  # [G, C, d], sigma^-2 of the clamped log-variances
    log_pi: Tensor  # [G, C]
    clamped_log_vars: Tensor  # [G, C, d]


def _block_diagonal(weights: Tensor) -> Tensor:
    """``[K, G, C, d]`` -> ``[K, G*d, C*G]``: block g of matrix k holds ``weights[k, g]``
    transposed; columns are cluster-major (column ``c * G + g`` is cluster c of group g)."""
    k, groups, clusters, dim = weights.shape
    out = weights.new_zeros(k, groups, dim, clusters, groups)
    out.diagonal(dim1=1, dim2=4).copy_(weights.permute(0, 3, 2, 1))  # the [K, d, C, G] diagonal
    return out.view(k, groups * dim, clusters * groups)


def _diagonal_blocks_transposed(full_t: Tensor, groups: int, clusters: int) -> Tensor:
    """The inverse of :func:`_block_diagonal` for one matrix given transposed: ``[C*G, G*d]`` -> ``[G, C, d]`` (a
    view)."""
    return full_t.view(clusters, groups, groups, -1).diagonal(dim1=1, dim2=2).permute(2, 0, 1)


def _log_joint_columns(flats: Sequence[Tensor], weight_sq: Tensor, weight_lin: Tensor, bias: Tensor) -> Tensor:
    """(b + (z*z) W_sq + z W_lin)^T of the rows of ``flats`` (z ``[N_i, G*d]`` each) in order: ``[C*G, N_1 + N_2 +
    ...]``, contiguous.

    Computed as W^T z^T: with few columns (the query GMM: C*G = 4 against G*d = 64) MKL's row-major product takes
    ~5x as long as the transposed one (1.8 against 0.4 ms over 14,400 rows, one thread), and with G = 1 the
    transposed result is already the clusters-first storage (:func:`clusters_first`)."""
    columns = [torch.addmm(bias.unsqueeze(1), weight_sq.t(), (flat * flat).t()).addmm_(weight_lin.t(), flat.t())
               for flat in flats]
    return columns[0] if len(columns) == 1 else torch.cat(columns, 1)


def _gmm_parts(means: Tensor, log_vars: Tensor, prior_logits: Tensor, dtype: torch.dtype,
               scale: float = 1.0) -> _GMMParts:
    """log pi_c + log N(s z | mu_c, sigma_c^2) = b + (z*z) W_sq + z W_lin (eq. 9, expanded), ``z [N, G*d]``.

    The -1/2 of the Gaussian exponent and the input scale s are folded into the block-diagonal weights.
    """
    groups, clusters, dim = means.shape
    clamped = log_vars.to(dtype).clamp(*LOGVAR_RANGE)
    means = means.to(dtype)
    precision = torch.exp(-clamped)  # sigma^-2, [G, C, d]
    scaled_means = means * precision
    log_pi = F.log_softmax(prior_logits.to(dtype), dim=-1)  # [G, C]
    # mu^T Sigma^-1 mu + log |Sigma| + d log 2 pi
    const = torch.add((scaled_means * means).sum(-1), clamped.sum(-1)).add_(dim * LOG_2PI)
    bias = torch.add(log_pi, const, alpha=-0.5).t().reshape(-1)
    square_term, linear_term = -0.5 * precision, scaled_means
    if scale != 1.0:
        square_term, linear_term = square_term * (scale * scale), linear_term * scale
    weight = _block_diagonal(torch.stack((square_term, linear_term)))  # [2, G*d, C*G]
    return _GMMParts(weight[0], weight[1], bias, means, precision, log_pi, clamped)


class _ScaledGradient(torch.autograd.Function):
    """``x`` unchanged; its gradient multiplied by ``factor`` (c_g of Section IV-A3 on the GMM means)."""

    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.factor, None


class _GaussianLogJoint(torch.autograd.Function):
    """log pi_c + log N(z | mu_c, diag sigma_c^2) for G independent GMMs, ``[N, G*d] -> [N, C*G]``.

    The squared Mahalanobis distance is expanded as z^2 . (1/sigma^2) - 2 z . (mu/sigma^2)
    + const, with the G groups' weights as block-diagonal ``[G*d, C*G]`` matrices W_sq and W_lin:
    b + (z*z) W_sq + z W_lin, two matrix products per input (:func:`_log_joint_columns`; no ``[N, G, C, d]``
    temporary, and no ``[N, 2*G*d]`` concatenation of [z*z, z]: on a CPU that copy costs more than the products).
    The output is stored column-major (``[C*G, N]`` transposed), the layout its products are fastest in. Of the
    ``[N, ...]`` tensors only ``z`` is saved (it is also saved by the q/k/v projections, so this costs no extra
    memory); z*z is recomputed in the backward pass.
    An input scale s (the authors' x / 10) multiplies the weights (W_sq s^2, W_lin s), not the input. The parameters' gradients are
    written out (below) rather than differentiated through the expansion: under half of
    the ATen ops, which on a GPU are kernel launches at these small sizes.
    """

    @staticmethod
    def forward(ctx, scale, means, log_vars, prior_logits, *flats):
        parts = _gmm_parts(means, log_vars, prior_logits, flats[0].dtype, scale)
        ctx.save_for_backward(log_vars, *parts, *flats)
        ctx.param_dtypes = (means.dtype, log_vars.dtype, prior_logits.dtype)
        ctx.scale = scale
        return _log_joint_columns(flats, parts.weight_sq, parts.weight_lin, parts.bias).t()

    @staticmethod
    def backward(ctx, grad):
        log_vars, weight_sq, weight_lin, _, means, precision, log_pi, clamped, *flats = ctx.saved_tensors
        groups, clusters, _ = means.shape
        grads = grad.split([f.size(0) for f in flats]) if len(flats) > 1 else (grad,)
        needs_parameters = any(ctx.needs_input_grad[1:4])
        grad_flats = [None] * len(flats)
        grad_weight_sq = grad_weight_lin = None  # transposed, [C*G, G*d], summed over the inputs
        for i, (flat, g) in enumerate(zip(flats, grads)):
            squares = None
            if needs_parameters:
                # gradients of W_sq and W_lin: g^T (z*z) and g^T z (rather than z^T g: with few columns that takes
                # ~8x as long on a CPU, see _log_joint_columns)
                squares = flat * flat
                if grad_weight_sq is None:
                    grad_weight_sq, grad_weight_lin = torch.mm(g.t(), squares), torch.mm(g.t(), flat)
                else:
                    grad_weight_sq.addmm_(g.t(), squares)
                    grad_weight_lin.addmm_(g.t(), flat)
            if ctx.needs_input_grad[4 + i]:
                # d/dz [(z*z) W_sq + z W_lin] = 2 z o (g W_sq^T) + g W_lin^T (the weights carry the scale), written
                # into the squares' buffer where there is one: on a CPU a fresh [N, G*d] costs its page faults
                grad_flat = torch.mm(g, weight_sq.t()) if squares is None else torch.mm(g, weight_sq.t(), out=squares)
                grad_flats[i] = grad_flat.mul_(flat).addmm_(g, weight_lin.t(), beta=2.0)
        if not needs_parameters:
            return (None, None, None, None, *grad_flats)
        # gradients of W_sq = -P/2, W_lin = mu P and b = log pi - (mu^2 P + log sigma^2)/2 - const,
        # P = sigma^-2 = exp(-clamped log-variance), of the scaled input s z: (s z)^2 and s z, with s
        # folded into the small results
        scale = ctx.scale
        grad_sq = _diagonal_blocks_transposed(grad_weight_sq, groups, clusters)  # [G, C, d]
        grad_lin = _diagonal_blocks_transposed(grad_weight_lin, groups, clusters)
        if scale != 1.0:
            grad_sq, grad_lin = grad_sq * (scale * scale), grad_lin * scale
        grad_bias = grad.sum(0).view(clusters, groups).t()  # [G, C]
        gb = grad_bias.unsqueeze(-1)
        lin_minus_bias = torch.addcmul(grad_lin, gb, means, value=-1.0)  # dL/dW_lin - g_b mu
        grad_means = precision * lin_minus_bias
        # dL/dP = -dW_sq/2 + mu (dW_lin - g_b mu/2); d log-variance = -P dL/dP - g_b/2
        grad_precision = torch.addcmul(lin_minus_bias, gb, means, value=0.5).mul_(means).sub_(grad_sq, alpha=0.5)
        grad_log_vars = torch.addcmul(gb * -0.5, precision, grad_precision, value=-1.0)
        grad_log_vars = grad_log_vars * (clamped == log_vars)  # clamp: no gradient outside the range
        grad_prior = grad_bias - log_pi.exp() * grad_bias.sum(-1, keepdim=True)  # log-softmax
        means_dtype, log_vars_dtype, prior_dtype = ctx.param_dtypes
        return (None, grad_means.to(means_dtype), grad_log_vars.to(log_vars_dtype), grad_prior.to(prior_dtype),
                *grad_flats)


def clusters_first(x: Tensor) -> Tensor:
    """``[..., C]`` -> ``[C, ...]`` (a view). The clustering tensors are stored clusters-first
    (:meth:`GaussianMixture.log_joint`), so this view is contiguous and the few clusters
    become the outermost dimension: a softmax or sum over them is a handful of vectorised
    passes over long rows, where PyTorch's kernels over a last dimension of 4-8 elements
    spend their time in per-row overhead."""
    return x.movedim(-1, 0)


def log_softmax_clusters(x: Tensor) -> Tensor:
    """``log_softmax(x, dim=-1)`` over the (few) clusters of ``x [..., C]``, computed clusters-first."""
    return torch.log_softmax(clusters_first(x), dim=0).movedim(0, -1)
