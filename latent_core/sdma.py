"""Semantic and disentangled mask attention (SDMA): the one attention core.

Chien & Huang, "Latent Semantic and Disentangled Attention", TPAMI 2024
(Chien & Huang, TPAMI 2024, doi:10.1109/TPAMI.2024.3432631), Section III. Plain PyTorch: the fairseq adapter
(``user_dir.sdma.fairseq_attention``) and the ESPnet adapter build on this file.

Symbols follow the paper:

* ``z``   attention input split into heads, ``[..., n_h, d_k]`` (eq. 8)
* ``q``   scaled query split into heads, ``[..., n_h, d_k]``
* ``C``   clustering probabilities p(c | z) ("responsibilities", eq. 9)
* ``M``   semantic mask (eq. 10), ``g`` the mixing weight gamma of eq. (11)

Everything that touches log-densities runs in float32 and in log space, so the
module is safe under fp16/bf16 autocast and a collapsed cluster (all of its
responsibilities ~0) never produces NaN.

Two readings (``SDMAOptions.reading``), see :data:`READINGS` and the README's table:

* ``authors`` (default): the training computation of the authors' fairseq code, which
  produced the paper's tables (``modules/disentangled_attention.py`` of
  NYCU-MLLab/Disentangled-Mask-Attention-in-Transformers): a second noise draw on the
  scaled queries, k and v from the clean input in self-attention (the noisy keys and the
  clean values in cross-attention), posterior variance 0.01 (their fixed ``self.var``, also
  their noise variance), regularisers averaged over the padded length, KL(pi || gamma),
  alpha/beta on the squared entries of eq. (23), their L_Dqq normaliser (one max shift per
  layer, clamped at 1e-6), the cross-attention keys' KL and diversity, their initialisation
  and the two 1e-6 floors of their L1 normalisations. The ESPnet adapter's ``authors``
  reading follows their ESPnet code instead (learned per-position variances: the
  ``log_var`` arguments of :meth:`SDMACore.perturb` and :meth:`SDMACore.record`;
  ``combine="module_mean"`` in :func:`collect_sdma_losses`);
* ``paper``: the equations as printed: one sample z per step for clustering and the q/k/v
  projections (eq. 8 and Algorithm 1), sigma_tilde^2 = 0.1 (Section IV-A3), real positions
  only, KL(gamma || pi) (eq. 20), the weighted mask squared (eq. 23), the exact
  per-sentence softmax of eq. (17).

In both, the scaling factor ``s`` of Algorithm 1 is 1 (its final value in the paper).

Attention is computed in one place for both toolkits: :func:`sdma_attention` (eq. 1, 2, 10, 11 from
q, k, v, the responsibilities, the blocked keys, g and the reading) dispatches on :data:`KERNELS`
(``explicit``, ``sdpa``, ``lowrank``; ``auto`` picks one, :func:`select_kernel`). A new attention
variant is one function of :class:`AttentionInputs` and one row of :data:`KERNELS`;
``tests/unit/latent_core/test_sdma_kernels_exact.py`` holds every row to the explicit kernel.
"""

import contextlib
import contextvars
import math
from dataclasses import dataclass, field, fields
from typing import Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from latent_core.errors import PluginConfigError, check_positive_int

SDMA_MODES = ("sdma", "sma", "none")
# What the SDMA modules compute in training (SDMAOptions.reading): the authors' code or the printed equations
READINGS = ("authors", "paper")
# How the mixed attention of eq. (11) is computed (SDMAOptions.attention_kernel)
ATTENTION_KERNELS = ("auto", "explicit", "sdpa", "lowrank")  # "auto" and the rows of KERNELS
# Names of the regularisers every SDMA module reports (eq. 20, 21, 22, 23).
LOSS_NAMES = ("kl_z", "kl_q", "dqq", "dxq", "dv_z", "dv_q")



def check_loss_weight(name: str, value: float, option: str) -> float:
    """The one check of an eq. (24) weight (``name`` a key of :data:`LOSS_WEIGHTS`, ``option`` how
    the user spelled it, e.g. ``--sdma-kl-weight`` or ``model_conf.sdma_kl_weight``): finite, >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise SDMAConfigError(f"{option}={value}: the weight {LOSS_WEIGHTS[name][0]} of eq. (24) "
                              "must be a finite number >= 0")
    return float(value)


# How the per-sentence regularisers enter the batch loss (see scale_regulariser).
REGULARISER_SCALES = ("sentence", "batch", "token")

_LOG_2PI = math.log(2.0 * math.pi)
_MASK_FLOOR = 1e-6  # smallest semantic-mask value, keeps log M finite
AUTHORS_EPS = 1e-6  # the eps of the authors' F.normalize calls and of their log(1 - p + eps)
# Posterior variance sigma_tilde^2 of eq. (20): Section IV-A3 prints 0.1; the authors' code uses
# its fixed ``self.var`` = 0.01, the variance of its sampling noise too.
PAPER_POSTERIOR_VAR = 0.1
AUTHORS_POSTERIOR_VAR = 0.01
_LOGVAR_RANGE = (-9.0, 9.0)


class SDMAConfigError(PluginConfigError):
    """An impossible SDMA hyper-parameter (the message names the option)."""


def _option(default, help: str, **metadata):
    """A dataclass field whose ``metadata["help"]`` is the documentation of the option (fairseq's
    convention, read by its ``gen_parser_from_dataclass`` and by the ESPnet adapter's errors)."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class SDMAOptions:
    """Hyper-parameters of one SDMA attention module: the one place their defaults and
    documentation are written (paper Section IV-A3 and Table I).

    The toolkits spell each field as an option without the ``num_`` prefix
    (:func:`option_name`): fairseq ``--sdma-clusters`` (``user_dir/sdma/model.py`` generates its
    flags from these fields), ESPnet ``encoder_conf: {sdma_conf: {clusters: 8}}``
    (:meth:`from_conf`). Presets (a Table I row, the Aishell-1 run) override only what differs.
    """

    mode: str = _option("sdma", "sdma: SDMA-T; sma: SMA-T (no head disentanglement); none: vanilla attention",
                        choices=SDMA_MODES)
    reading: str = _option(
        "authors", "authors: the training computation of the authors' code, which produced the paper's "
                   "numbers (second noise draw on the queries, clean k/v, their KL, diversity and L_Dqq "
                   "forms, padded-length averages, their initialisation); paper: the equations as printed "
                   "(see the README's table of the two readings)", choices=READINGS)
    num_clusters: int = _option(8, "n_c of the feature GMM theta_z, eq. (5)/(9) (Table I: 8; Tables II-IV: 4)",
                                metavar="N")
    num_query_clusters: int = _option(8, "n_c of the query GMM theta_q, eq. (18)", metavar="N")
    mix_max: float = _option(0.9, "nu, upper bound of the mixing weight of eq. (11), in (0, 1]", metavar="NU")
    mix_rate: float = _option(5e-4, "R of the annealed mixing weight g = 1 - max(1 - nu, exp(-R * num_updates)), "
                                    "eq. (11)", metavar="R")
    centroid_grad_scale: float = _option(10.0, "c_g: multiplier of the GMM means' gradient (Table I: 10; 5 for "
                                               "Zh-En and Aishell-1)", metavar="C_G")
    noise_var: float = _option(0.01, "variance sigma^2 of the training-time sampling noise, eq. (8)", metavar="S2")
    posterior_var: Optional[float] = _option(
        None, "variance sigma_tilde^2 of q(z|x) and q(q|x) in the KL of eq. (20) (default: the reading's: "
              f"authors = {AUTHORS_POSTERIOR_VAR}, their code; paper = {PAPER_POSTERIOR_VAR}, Section IV-A3)",
        metavar="S2")
    diversity_alpha: float = _option(1.25, "alpha of the diversity mask, eq. (23)", metavar="A")
    diversity_beta: float = _option(0.75, "beta of the diversity mask, eq. (23)", metavar="B")
    attention_kernel: str = _option(
        "auto", "how A_hat V of eq. (11) is computed: explicit (scores, one softmax, the multiplicative mask of "
                "eq. 2; attention weights available), sdpa (two torch scaled_dot_product_attention calls, the "
                "mask as additive log M; attention dropout then drawn per branch), lowrank (one SDPA call over the "
                "value widened by the key responsibilities, no T x S mask; attention dropout then drops A before the "
                "mask; slower than sdpa in every shape measured on an H100, see examples/sdma_translation/README.md), "
                "auto (sdpa on CUDA when the weights are not needed and no attention dropout is active, explicit "
                "otherwise)",
        choices=ATTENTION_KERNELS)
    mask_at_inference: bool = _option(True, "apply the semantic mask when not training (the paper drops the "
                                            "decoder self-attention's mask at test time)")

    @classmethod
    def from_conf(cls, conf: Optional[Mapping], where: str, preset: Optional[Mapping] = None) -> "SDMAOptions":
        """Validated options from a mapping of option names (``{"clusters": 8, ...}``) on top of
        ``preset`` (field names -> values); errors name ``where`` + the key, e.g.
        ``encoder_conf.sdma_conf.clusters=0: ...``."""
        names = {option_name(f.name): f.name for f in fields(cls)}
        values = dict(preset or {})
        for key, value in dict(conf or {}).items():
            if key not in names:
                raise SDMAConfigError(f"{where}.{key}: unknown SDMA option; the options are {', '.join(names)}")
            values[names[key]] = value
        return cls(**values).validate(prefix=f"{where}.", word_sep="_")

    def validate(self, prefix: str = "--sdma-", word_sep: str = "-") -> "SDMAOptions":
        """Raise :class:`SDMAConfigError` naming the option (``prefix`` + name) that is wrong."""

        def opt(name):
            return prefix + option_name(name).replace("_", word_sep)

        if self.mode not in SDMA_MODES:
            raise SDMAConfigError(
                f"{opt('mode')}={self.mode!r} is not one of {', '.join(SDMA_MODES)}"
            )
        if self.reading not in READINGS:
            raise SDMAConfigError(f"{opt('reading')}={self.reading!r} is not one of {', '.join(READINGS)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise SDMAConfigError(f"{opt('attention_kernel')}={self.attention_kernel!r} is not one of "
                                  f"{', '.join(ATTENTION_KERNELS)}")
        for name in ("num_clusters", "num_query_clusters"):
            value = getattr(self, name)
            check_positive_int(opt(name), value, SDMAConfigError, "the number of GMM clusters")
        for name in ("mix_max", "mix_rate", "centroid_grad_scale", "noise_var", "posterior_var",
                     "diversity_alpha", "diversity_beta"):
            value = getattr(self, name)
            if name == "posterior_var" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SDMAConfigError(f"{opt(name)}={value!r} must be a finite number")
        if not (0.0 < self.mix_max <= 1.0):
            raise SDMAConfigError(f"{opt('mix_max')}={self.mix_max}: nu must lie in (0, 1]")
        for name in ("mix_rate", "centroid_grad_scale", "noise_var"):
            if getattr(self, name) < 0:
                raise SDMAConfigError(f"{opt(name)}={getattr(self, name)} must be >= 0")
        if self.posterior_var is not None and self.posterior_var <= 0:
            raise SDMAConfigError(f"{opt('posterior_var')}={self.posterior_var} must be > 0")
        for name in ("diversity_alpha", "diversity_beta"):
            if getattr(self, name) < 0:
                raise SDMAConfigError(f"{opt(name)}={getattr(self, name)} must be >= 0")
        if not isinstance(self.mask_at_inference, bool):
            raise SDMAConfigError(f"{opt('mask_at_inference')}={self.mask_at_inference!r} must be true or false")
        return self

    @property
    def authors(self) -> bool:
        return self.reading == "authors"

    @property
    def kl_posterior_var(self) -> float:
        """sigma_tilde^2 of eq. (20): ``posterior_var``, else the reading's value."""
        if self.posterior_var is not None:
            return float(self.posterior_var)
        return AUTHORS_POSTERIOR_VAR if self.authors else PAPER_POSTERIOR_VAR


def option_name(field_name: str) -> str:
    """The option spelling of an :class:`SDMAOptions` field: ``num_clusters`` -> ``clusters``."""
    return field_name[len("num_"):] if field_name.startswith("num_") else field_name


@dataclass
class SDMALossWeights:
    """The weights of eq. (24) (Table I, IWSLT'14 base; the rows and presets override what differs).
    Options ``sdma_<field>`` (fairseq ``--sdma-kl-weight``, ESPnet ``model_conf.sdma_kl_weight``)."""

    # metadata: the paper's symbol, the loss terms (LOSS_NAMES) it weights and its sign in eq. (24)
    kl_weight: float = _option(0.01, "lambda_k of eq. (24) (Table I: 0.01)", metavar="W",
                               symbol="lambda_k", terms=("kl_z", "kl_q"), sign=1.0)
    dqq_weight: float = _option(100.0, "lambda_q of eq. (24) (Table I: 100 base/small, 50 tiny/Zh-En)", metavar="W",
                                symbol="lambda_q", terms=("dqq",), sign=1.0)
    dxq_weight: float = _option(10.0, "lambda_x of eq. (24) (Table I: 10 base/small, 5 tiny/Zh-En)", metavar="W",
                                symbol="lambda_x", terms=("dxq",), sign=-1.0)
    diversity_weight: float = _option(1.0, "lambda_d of eq. (24) (Table I: 1)", metavar="W",
                                      symbol="lambda_d", terms=("dv_z", "dv_q"), sign=1.0)

    def as_options(self) -> Dict[str, float]:
        """``{"sdma_kl_weight": ..., ...}``: the keys of :data:`LOSS_WEIGHTS`."""
        return {f"sdma_{f.name}": getattr(self, f.name) for f in fields(self)}


# Loss-weight option (fairseq --sdma-*-weight, ESPnet model_conf sdma_*_weight)
# -> (paper symbol, loss terms it weights, sign in eq. 24), read off SDMALossWeights
LOSS_WEIGHTS = {f"sdma_{f.name}": (f.metadata["symbol"], f.metadata["terms"], f.metadata["sign"])
                for f in fields(SDMALossWeights)}


def mixing_weight(num_updates: float, mix_max: float = SDMAOptions.mix_max,
                  mix_rate: float = SDMAOptions.mix_rate) -> float:
    """gamma = 1 - max(1 - nu, exp(-rate * t))  (eq. 11; the paper drops the minus sign)."""
    return 1.0 - max(1.0 - mix_max, math.exp(-mix_rate * float(num_updates)))


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
        if self.centroid_grad_scale != 1.0:
            self.means.register_hook(self._scale_centroid_grad)

    def reset_parameters_as_authors(self) -> None:
        """xavier_normal_ (gain 1) on every GMM parameter, as the authors' init_cluster_params: means
        near the origin (std sqrt(2 / ((G + C) d)), ~0.044 at base), soft clusters at step 0."""
        for parameter in (self.prior_logits, self.means, self.log_vars):
            nn.init.xavier_normal_(parameter)

    def _scale_centroid_grad(self, grad: Tensor) -> Tensor:
        return grad * self.centroid_grad_scale

    def log_joint(self, z: Tensor, terms: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> Tensor:
        """log pi_c + log N(z | mu_c, sigma_c^2) for ``z`` of shape ``[..., G, d]`` -> ``[..., G, C]``.

        Computed in (at least) float32 by :class:`_GaussianLogJoint`, which saves only ``z``
        for the backward pass. The result is stored clusters-first (``[C, ..., G]`` in memory,
        see :func:`clusters_first`), so softmaxes and sums over the few clusters run as
        vectorised operations over the long dimensions. Without gradients, ``terms`` (from
        :meth:`inference_terms`) may be passed by a caller that knows the parameters cannot
        have changed since they were built (one beam search); otherwise they are rebuilt
        from the current parameters on every call.
        """
        lead = z.shape[:-2]
        dtype = torch.promote_types(z.dtype, torch.float32)
        flat = z.to(dtype).reshape(-1, self.groups * self.dim)  # [N, G*d]
        with _full_precision(flat):
            if torch.is_grad_enabled():
                out = _GaussianLogJoint.apply(flat, self.means, self.log_vars, self.prior_logits)
            else:
                # Never cached across calls on the module: fairseq's FP16Optimizer (and EMA, and
                # anyone writing ``p.data``) changes the parameters without bumping their version
                # counter or moving them, so a cache keyed on either serves stale weights.
                if terms is None or terms[0].dtype != dtype:
                    terms = self.inference_terms(dtype)
                weight_sq, weight_lin, bias = terms
                out = torch.addmm(torch.addmm(bias, flat * flat, weight_sq), flat, weight_lin)
        # [N, C*G] (columns cluster-major) -> storage [C, N, G], viewed as [..., G, C]
        out = out.view(-1, self.num_clusters, self.groups).transpose(0, 1).contiguous()
        return out.view(self.num_clusters, *lead, self.groups).movedim(0, -1)

    def log_joint_direct(self, z: Tensor) -> Tensor:
        """:meth:`log_joint` written as eq. (9) reads, ``[..., G, d] -> [..., G, C]``: a
        ``[..., G, C, d]`` difference per cluster instead of two matrix products. Slow and
        memory-hungry; the reference the fast path is tested against."""
        log_vars = self.log_vars.float().clamp(*_LOGVAR_RANGE)
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        squared = ((z.unsqueeze(-2) - self.means) ** 2 / log_vars.exp()).sum(-1)  # (z - mu_c)^T Sigma_c^-1 (z - mu_c)
        log_normal = -0.5 * (squared + log_vars.sum(-1) + self.dim * _LOG_2PI)  # log N(z | mu_c, Sigma_c)
        return log_normal + self.log_prior()  # + log pi_c

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
    return torch.exp(-log_vars.float().clamp(*_LOGVAR_RANGE)).sum(-1)


def authors_linear_init(linear: nn.Linear, gain: float) -> None:
    """The authors' initialisation of an attention projection: xavier_normal_ weights with ``gain``
    and the bias ``nn.Linear`` would draw (uniform in +-1/sqrt(fan_in))."""
    nn.init.xavier_normal_(linear.weight, gain=gain)
    if linear.bias is not None:
        bound = 1 / math.sqrt(linear.weight.size(1))
        nn.init.uniform_(linear.bias, -bound, bound)


def _full_precision(tensor: Tensor):
    """Autocast off for the block that follows (its matrix products keep ``tensor``'s dtype)."""
    return torch.autocast(tensor.device.type, enabled=False)


class _GMMParts(NamedTuple):
    """The expanded log-density of :func:`_gmm_parts` and what its backward pass reuses."""
    weight_sq: Tensor  # [G*d, C*G], block-diagonal -1/2 sigma^-2
    weight_lin: Tensor  # [G*d, C*G], block-diagonal mu sigma^-2
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


def _diagonal_blocks(full: Tensor, groups: int, clusters: int) -> Tensor:
    """The inverse of :func:`_block_diagonal` for one matrix: ``[G*d, C*G]`` -> ``[G, C, d]`` (a view)."""
    return full.view(groups, -1, clusters, groups).diagonal(dim1=0, dim2=3).permute(2, 1, 0)


def _gmm_parts(means: Tensor, log_vars: Tensor, prior_logits: Tensor, dtype: torch.dtype) -> _GMMParts:
    """log pi_c + log N(z | mu_c, sigma_c^2) = b + (z*z) W_sq + z W_lin (eq. 9, expanded), ``z [N, G*d]``.

    The -1/2 of the Gaussian exponent is folded into the block-diagonal weights.
    """
    groups, clusters, dim = means.shape
    clamped = log_vars.to(dtype).clamp(*_LOGVAR_RANGE)
    means = means.to(dtype)
    precision = torch.exp(-clamped)  # sigma^-2, [G, C, d]
    scaled_means = means * precision
    log_pi = F.log_softmax(prior_logits.to(dtype), dim=-1)  # [G, C]
    # mu^T Sigma^-1 mu + log |Sigma| + d log 2 pi
    const = torch.add((scaled_means * means).sum(-1), clamped.sum(-1)).add_(dim * _LOG_2PI)
    bias = torch.add(log_pi, const, alpha=-0.5).t().reshape(-1)
    weight_sq, weight_lin = _block_diagonal(torch.stack((-0.5 * precision, scaled_means)))
    return _GMMParts(weight_sq, weight_lin, bias, means, precision, log_pi, clamped)


class _GaussianLogJoint(torch.autograd.Function):
    """log pi_c + log N(z | mu_c, diag sigma_c^2) for G independent GMMs, ``[N, G*d] -> [N, C*G]``.

    The squared Mahalanobis distance is expanded as z^2 . (1/sigma^2) - 2 z . (mu/sigma^2)
    + const, with the G groups' weights as block-diagonal ``[G*d, C*G]`` matrices: two
    matrix products on the contiguous input, no ``[N, G, C, d]`` temporary. Of the ``[N, ...]``
    tensors only ``z`` is saved (it is also saved by the q/k/v projections, so this costs no
    extra memory); ``z^2`` is recomputed in the backward pass. The parameters' gradients are
    written out (below) rather than differentiated through the expansion: under half of
    the ATen ops, which on a GPU are kernel launches at these small sizes.
    """

    @staticmethod
    def forward(ctx, flat, means, log_vars, prior_logits):
        parts = _gmm_parts(means, log_vars, prior_logits, flat.dtype)
        ctx.save_for_backward(flat, log_vars, *parts)
        ctx.param_dtypes = (means.dtype, log_vars.dtype, prior_logits.dtype)
        return torch.addmm(torch.addmm(parts.bias, flat * flat, parts.weight_sq), flat, parts.weight_lin)

    @staticmethod
    def backward(ctx, grad):
        flat, log_vars, *saved = ctx.saved_tensors
        weight_sq, weight_lin, _, means, precision, log_pi, clamped = saved
        groups, clusters, _ = means.shape
        grad_flat = None
        if ctx.needs_input_grad[0]:
            # d/dz [(z*z) W_sq + z W_lin] = 2 z o (g W_sq^T) + g W_lin^T
            grad_flat = torch.addcmul(torch.mm(grad, weight_lin.t()), flat, torch.mm(grad, weight_sq.t()), value=2.0)
        if not any(ctx.needs_input_grad[1:]):
            return grad_flat, None, None, None
        # gradients of W_sq = -P/2, W_lin = mu P and b = log pi - (mu^2 P + log sigma^2)/2 - const,
        # P = sigma^-2 = exp(-clamped log-variance)
        grad_sq = _diagonal_blocks(torch.mm((flat * flat).t(), grad), groups, clusters)  # [G, C, d]
        grad_lin = _diagonal_blocks(torch.mm(flat.t(), grad), groups, clusters)
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
        return grad_flat, grad_means.to(means_dtype), grad_log_vars.to(log_vars_dtype), grad_prior.to(prior_dtype)


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


def _sentence_mean(per_token: Tensor, valid: Tensor) -> Tensor:
    """``[L, T, B]`` -> ``[B]``: mean over layers and over each sentence's valid positions."""
    n_q = valid.sum(0).clamp_min(1.0)  # [B]
    return ((per_token * valid).sum(1) / n_q).mean(0)


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
    log_joint, log_resp = clusters_first(log_joint), clusters_first(log_resp)  # [C, L, T, B, H]
    resp = log_resp.exp() if resp is None else clusters_first(resp)
    log_marginal = log_joint[0] - log_resp[0]  # log p(z), [L, T, B, H]
    trace = (resp * trace_precision.permute(2, 0, 1)[:, :, None, None, :]).sum(0)
    if isinstance(posterior_var, Tensor):
        const = 0.5 * dim * (_LOG_2PI + torch.log(posterior_var) + 1.0)
    else:
        const = 0.5 * dim * (_LOG_2PI + math.log(posterior_var) + 1.0)
    per_token = 0.5 * posterior_var * trace - log_marginal - const
    if authors_log_prior is not None:
        log_prior = authors_log_prior.permute(2, 0, 1)[:, :, None, None, :]  # [C, L, 1, 1, H]
        forward_kl = (resp * (log_resp - log_prior)).sum(0)  # KL(gamma || pi), inside -log p(z)
        reverse_kl = (log_prior.exp() * (log_prior - log_resp)).sum(0)  # KL(pi || gamma)
        per_token = per_token - forward_kl + reverse_kl
    return _sentence_mean(per_token.mean(-1), valid)


def cluster_diversity(resp: Tensor, valid: Tensor, alpha: float, beta: float, squared: bool = True) -> Tensor:
    """L_DV of eq. (23) per sentence, ``[B]`` (mean over layers and heads).

    sum_ij [M_hat o (C C^T - I)]_ij^2 with M_hat = alpha I + beta (1 - I) equals
    alpha^2 sum_i (s_i - 1)^2 + beta^2 (||C^T C||_F^2 - sum_i s_i^2), s_i = ||C_i||^2,
    so no ``T x T`` matrix is formed. Normalised by n_q^2 of each sentence.
    ``squared=False``: the authors' form, M_hat o (C C^T - I)^2 (alpha and beta weigh the
    squared entries).
    """
    diag_weight, off_weight = (alpha * alpha, beta * beta) if squared else (alpha, beta)
    resp = clusters_first(resp) * valid[None, None, :, :, None]  # [C, L, T, B, H]
    self_sim = (resp * resp).sum(0)  # s_i, [L, T, B, H]
    gram = torch.einsum("cltbh,kltbh->cklbh", resp, resp)  # C^T C, [C, C, L, B, H]
    diag = diag_weight * ((self_sim - 1.0) ** 2 * valid[None, :, :, None]).sum(1)  # [L, B, H]
    off = off_weight * ((gram * gram).sum((0, 1)) - (self_sim * self_sim).sum(1))
    n_q = valid.sum(0).clamp_min(1.0)[None, :, None]  # [1, B, 1]
    return ((diag + off) / (n_q * n_q)).mean((0, 2))


def token_given_cluster(log_joint_q: Tensor, valid: Tensor) -> Tensor:
    """p(q_i^h | c) of eq. (17), clusters-first ``[C, L, T, B, H]``: pi_c N(q_i^h | c) normalised
    over the sentence's real tokens (an exact softmax)."""
    pad = (valid <= 0)[None, None, :, :, None]
    p_token_given_c = torch.softmax(log_joint_q.masked_fill(pad, float("-inf")), dim=2)
    return p_token_given_c.masked_fill(pad, 0.0)  # sentences of length 0 stay finite


def authors_token_given_cluster(log_joint_q: Tensor) -> Tuple[Tensor, Tensor]:
    """The authors' p(q_i^h | c) (``F.normalize(cluster_probs * pdf, p=1, dim=length, eps=1e-6)``
    with ``pdf = exp(log_pdf - log_pdf.max())``), clusters-first ``[C, L, T, B, H]``, and which of
    its normalisers ``[C, L, 1, B, H]`` sit at the 1e-6 clamp.

    One max over the whole batch of a layer shifts every log-density, so a sentence whose
    queries all lie far below that max gets a normaliser under 1e-6: its probabilities are then
    divided by 1e-6 instead of their sum and stop summing to one.
    """
    layer_max = log_joint_q.detach().amax(dim=(0, 2, 3, 4), keepdim=True)  # one max per layer
    joint = torch.exp(log_joint_q - layer_max)
    norm = joint.sum(2, keepdim=True)
    clamped = norm < AUTHORS_EPS
    return joint / norm.clamp_min(AUTHORS_EPS), clamped


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
    p_pair = (p_token_given_c[..., :, None] * resp_q[..., None, :]).sum(0)  # [L, T, B, H, H']
    off_diag = 1.0 - torch.eye(n_h, device=p_pair.device, dtype=p_pair.dtype)
    if authors:
        neg_log = -torch.log(1.0 - p_pair.clamp(max=1.0) + AUTHORS_EPS) * off_diag
    else:
        neg_log = -torch.log1p(-p_pair.clamp(max=1.0 - 1e-6)) * off_diag
    return _sentence_mean(neg_log.sum((-1, -2)) / (n_h * n_h), valid)


def query_input_mi_lower_bound(resp_q: Tensor, valid: Tensor) -> Tensor:
    """L_Dxq of eq. (22) per sentence, ``[B]``, with the critic f(q_i^h, x_j) = sum_c p(c|q_i^h) p(c|q_j^h) (eq. 19).

    1/(n_q n_h) sum_i sum_h log softmax_j f(q_i^h, x_j) evaluated at j = i, with
    the softmax over the sentence's real tokens. Maximised (enters eq. 24 with -lambda_x).
    """
    resp_q = clusters_first(resp_q)  # [C, L, T, B, H]
    # f(q_i, x_j) as [L, T_i, T_j, B, H]: one multiply-add per cluster over long rows
    critic = resp_q[0, :, :, None] * resp_q[0, :, None]
    for c in range(1, resp_q.size(0)):
        critic = torch.addcmul(critic, resp_q[c, :, :, None], resp_q[c, :, None])
    key_pad = (valid <= 0)[None, None, :, :, None]  # [1, 1, T_j, B, 1]
    log_norm = torch.logsumexp(critic.masked_fill(key_pad, float("-inf")), dim=2)  # [L, T, B, H]
    log_ratio = (resp_q * resp_q).sum(0) - log_norm  # f(q_i, x_i) - log sum_j exp f(q_i, x_j)
    return _sentence_mean(log_ratio.mean(-1), valid)


def responsibility_product(resp_query: Tensor, resp_key: Tensor, heads: Optional[int] = None) -> Tensor:
    """sum_c p(c|z_i) p(c|z_j), ``[N, T, C] x [N, S, C] -> [N, T, S]`` (float32 or wider).

    When several hypotheses share one set of keys (fairseq's beamable encoder-decoder
    attention), ``resp_query`` is ``[B * beam * heads, T, C]`` and ``resp_key``
    ``[B * heads, S, C]``; pass ``heads`` for that layout.
    """
    with _full_precision(resp_query):
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
    return responsibility_product(resp_query, resp_key, heads) + _MASK_FLOOR


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
    return _MixedAttention.apply(scores, mask.to(scores.dtype), mix.detach().to(scores.dtype, copy=True), norm_floor)


def mix_attention_direct(scores: Tensor, mask: Optional[Tensor], mix: Tensor, norm_floor: float = 0.0) -> Tensor:
    """:func:`mix_attention` written as eq. (1), (2), (11) read, for autograd to differentiate
    (it keeps A, M o A and A_bar for backward); the reference the fast path is tested against."""
    attn = torch.softmax(scores, dim=-1)  # A (eq. 1)
    if mask is None:
        return attn
    masked = attn * mask  # M o A
    attn_bar = masked / masked.sum(-1, keepdim=True).clamp_min(norm_floor)  # A_bar (eq. 2)
    return (1 - mix) * attn + mix * attn_bar  # A_hat (eq. 11)


class _MixedAttention(torch.autograd.Function):
    """eq. (1), (2), (11) as one autograd node: ``(scores, M, g) -> A_hat``, ``[..., T, S]``.

    Saves A, M and Z = max(sum_j M_ij A_ij, floor) (autograd would keep A, M, M o A and A_bar).
    Backward: dA_bar = g dA_hat; dW = (dA_bar - <dA_bar, A_bar>) / Z for W = M o A (the second
    term vanishes on rows where Z is the floor); dM = dW o A; dA = (1 - g) dA_hat + dW o M;
    dscores = A o (dA - <dA, A>), <.,.> the row sums.
    """

    @staticmethod
    def forward(ctx, scores, mask, mix, norm_floor=0.0):
        attn = torch.softmax(scores, dim=-1)
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
        grad_scores = torch._softmax_backward_data(grad_attn, attn, -1, attn.dtype)  # A o (dA - <dA, A>)
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
        with _full_precision(resp_query):
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
    with _full_precision(resp_query):
        out = out.to(wide)
        plain = out[..., :D]  # [A V]_i
        gq = resp_query.to(wide)
        num = torch.einsum("bhtc,bhtcd->bhtd", gq, out[..., D:D + C * D].unflatten(-1, (C, D)))
        den = torch.einsum("bhtc,bhtc->bht", gq, out[..., D + C * D:]).unsqueeze(-1)
        if not authors:  # eq. (10) plus the 1e-6 floor of semantic_mask_product
            masked = (num + _MASK_FLOOR * plain) / (den + _MASK_FLOOR)
        else:  # r_i = max(sum_c gq_ic sum_{j allowed} gk_jc, eps), then A o M renormalised with eps
            row = (gq * _allowed_key_mass(resp_key.to(wide), allowed)).sum(-1, keepdim=True).clamp_min(AUTHORS_EPS)
            masked = (num / row) / (den / row).clamp_min(AUTHORS_EPS)
        mixed = torch.lerp(plain, masked, mix.detach().to(plain.dtype, copy=True))
    return mixed.to(q.dtype)


def use_fused_kernel(kernel: str, device: torch.device, need_weights: bool, dropout_active: bool) -> bool:
    """Whether a fused kernel (:func:`fused_mix_attention`, or :func:`lowrank_mix_attention` for ``lowrank``)
    computes this forward pass (see ``SDMAOptions.attention_kernel``). ``auto`` never picks ``lowrank``:
    measured on an H100 it was 0.48-0.98x the explicit path's speed where sdpa was 1.10-1.84x."""
    return select_kernel(kernel, device, need_weights, dropout_active) != "explicit"


def select_kernel(kernel: str, device: torch.device, need_weights: bool, dropout_active: bool) -> str:
    """The row of :data:`KERNELS` that computes this forward pass: the option's own kernel, except that
    the weights (attention plots, LR/HR, ``need_weights``) need the explicit one, and ``auto`` is
    ``sdpa`` on CUDA without attention dropout, ``explicit`` elsewhere."""
    if need_weights or kernel == "explicit":
        return "explicit"
    if kernel != "auto":
        return kernel
    return "sdpa" if device.type == "cuda" and not dropout_active else "explicit"


class AttentionInputs(NamedTuple):
    """What every kernel of :data:`KERNELS` receives (built by :func:`sdma_attention`)."""

    q: Tensor  # [B, H, T, D], scaled
    k: Tensor  # [B, H, S, D]
    v: Tensor  # [B, H, S, D]
    resp_query: Tensor  # [B, H, T, C], p(c | z_i)
    resp_key: Tensor  # [B, H, S, C], p(c | z_j)
    mix: Tensor  # g of eq. (11), a scalar buffer
    authors: bool  # the reading of eq. (10)'s mask (authors_semantic_mask vs semantic_mask_product)
    blocked: Optional[Tensor]  # bool, True where query i may not attend to key j, broadcastable to [B, H, T, S]
    allowed: Optional[Tensor]  # its 0/1 float complement: the keys the authors' mask normaliser sums over
    dropout: Callable[[Tensor], Tensor]  # the module's attention dropout (the explicit kernel drops A_hat)
    dropout_p: float  # its rate when active, else 0 (the fused kernels' own dropout)

    def additive_mask(self) -> Optional[Tensor]:
        """``blocked`` as SDPA's additive float mask in ``q``'s dtype (its smallest value, not -inf: a row
        with every key blocked stays finite, as in the explicit kernel)."""
        if self.blocked is None:
            return None
        return torch.zeros(self.blocked.shape, dtype=self.q.dtype, device=self.q.device).masked_fill(
            self.blocked, torch.finfo(self.q.dtype).min)

    def semantic_mask(self) -> Tensor:
        """M of eq. (10), ``[B, H, T, S]``, in this reading."""
        B, H, T, S = self.q.size(0), self.q.size(1), self.q.size(2), self.k.size(2)
        flat_query, flat_key = self.resp_query.flatten(0, 1), self.resp_key.flatten(0, 1)
        return reading_semantic_mask(flat_query, flat_key, self.authors, self.allowed).view(B, H, T, S)


def explicit_kernel(x: AttentionInputs) -> Tuple[Tensor, Tensor]:
    """Scores, eq. (1), (2), (11) in one autograd node (:func:`mix_attention`), dropout, A_hat V; the
    weights A_hat ``[B, H, T, S]`` (float32) are returned. Blocked keys get weight 0."""
    scores = torch.matmul(x.q, x.k.transpose(-2, -1)).float()
    if x.blocked is not None:
        scores = scores.masked_fill(x.blocked, torch.finfo(torch.float32).min)
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


# The kernels of eq. (1), (2), (10), (11), by SDMAOptions.attention_kernel (``auto``: :func:`select_kernel`).
# A new variant is one function of AttentionInputs -> (A_hat V [B, H, T, D], A_hat or None) and one row here;
# tests/unit/latent_core/test_sdma_kernels_exact.py then holds it to the explicit kernel in every row.
KERNELS: Dict[str, Callable[[AttentionInputs], Tuple[Tensor, Optional[Tensor]]]] = {
    "explicit": explicit_kernel,
    "sdpa": sdpa_kernel,
    "lowrank": lowrank_kernel,
}


def sdma_attention(q: Tensor, k: Tensor, v: Tensor, resp_query: Tensor, resp_key: Tensor, mix: Tensor, *,
                   authors: bool, blocked: Optional[Tensor], kernel: str, need_weights: bool,
                   dropout: Callable[[Tensor], Tensor], dropout_p: float) -> Tuple[Tensor, Optional[Tensor]]:
    """A_hat V of eq. (1), (2), (10), (11): the one entry point of both toolkits' adapters.

    ``q [B, H, T, D]`` scaled, ``k, v [B, H, S, D]``, ``resp_query [B, H, T, C]`` and ``resp_key
    [B, H, S, C]`` the clustering probabilities of eq. (9), ``mix`` g, ``authors`` the reading of the
    mask, ``blocked`` bool broadcastable to ``[B, H, T, S]`` (True: padding or a future key; None),
    ``kernel`` the option (``auto`` / a row of :data:`KERNELS`), ``need_weights`` whether A_hat must be
    returned, ``dropout`` the module's attention dropout and ``dropout_p`` its rate when active (else 0).
    Returns ``(A_hat V [B, H, T, D], A_hat [B, H, T, S] float32 or None)``; the adapters keep only their
    layout, incremental cache and beam folding.
    """
    name = select_kernel(kernel, q.device, need_weights, dropout_p > 0)
    allowed = None if blocked is None else (~blocked).to(torch.float32)
    return KERNELS[name](AttentionInputs(q, k, v, resp_query, resp_key, mix, authors, blocked, allowed, dropout,
                                         dropout_p))


@dataclass
class ClusteringRecord:
    """One SDMA attention's clustering in one forward pass: the input of its regularisers.

    ``log_joint_*`` / ``log_resp_*``: log p(z, c) and log p(c | z), ``[T, B, n_h, C]`` (``_k``: the
    keys of a cross-attention, ``[S, B, n_h, C]``, which the authors' reading regularises too);
    ``valid`` ``[T, B]``: 1 at real (non-padding) query positions; ``log_vars``: learned posterior
    log-variances per position and head (``{"z": [T, B, n_h], "q": ..., "k": [S, B, n_h]}``, the
    authors' ESPnet ``var_estimation``) replacing sigma_tilde^2.
    """

    log_joint_z: Tensor
    log_resp_z: Tensor
    valid: Tensor
    log_joint_q: Optional[Tensor] = None
    log_resp_q: Optional[Tensor] = None
    log_joint_k: Optional[Tensor] = None
    log_resp_k: Optional[Tensor] = None
    log_vars: Dict[str, Tensor] = field(default_factory=dict)

    def layout(self) -> Tuple:
        """The shapes that decide which records can be stacked into one batched computation."""
        return tuple(None if t is None else tuple(t.shape) for t in (self.log_joint_z, self.log_joint_q,
                                                                      self.log_joint_k))


class SDMARecording:
    """The :class:`ClusteringRecord` of every SDMA attention called inside one :func:`recording`
    scope (the latest call of each core wins)."""

    def __init__(self):
        self._records: Dict["SDMACore", ClusteringRecord] = {}

    def add(self, core: "SDMACore", record: ClusteringRecord) -> None:
        self._records[core] = record

    def get(self, core: "SDMACore") -> Optional[ClusteringRecord]:
        return self._records.get(core)

    def __len__(self) -> int:
        return len(self._records)


_RECORDING: contextvars.ContextVar[Optional[SDMARecording]] = contextvars.ContextVar("sdma_recording", default=None)
_REAL_QUERIES: contextvars.ContextVar[Optional[Tensor]] = contextvars.ContextVar("sdma_real_queries", default=None)


@contextlib.contextmanager
def recording() -> Iterator[SDMARecording]:
    """Record the clustering of the SDMA attentions called inside, for the regularisers::

        with recording() as records:
            output = model(batch)
        terms = collect_sdma_losses(model, records)

    Outside such a scope (decoding, analysis) nothing is recorded.
    """
    records = SDMARecording()
    token = _RECORDING.set(records)
    try:
        yield records
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def real_queries(valid: Optional[Tensor]) -> Iterator[None]:
    """The decoder's real (non-padding) positions, ``[B, T]`` bool, for the attentions called inside.

    A cross-attention receives only the padding of its keys; its regularisers average over the
    queries, so the decoder layer (or a fused attention) states which queries are real around the
    call. ``None``: every position is real.
    """
    token = _REAL_QUERIES.set(valid)
    try:
        yield
    finally:
        _REAL_QUERIES.reset(token)


def current_real_queries() -> Optional[Tensor]:
    """What the innermost :func:`real_queries` scope set (``[B, T]`` bool), or None."""
    return _REAL_QUERIES.get()


class SDMACore(nn.Module):
    """Parameters and computations of SDMA for one attention module.

    Holds the per-head feature GMM theta_z (``[n_h, n_c, d_k]``), the query GMM theta_q
    shared across heads (``[1, n_c^q, d_k]``, only in ``sdma`` mode) and the mixing
    weight g of eq. (11) as a persistent buffer: it follows ``set_num_updates`` in
    training and is saved in checkpoints, so inference uses its end-of-training value.
    The adapters call :meth:`perturb`, :meth:`cluster`, :meth:`cluster_queries` and
    :meth:`record`; :func:`collect_sdma_losses` turns the clustering recorded in a
    :func:`recording` scope into the regularisers (batched over the layers of each attention type).
    """

    def __init__(self, embed_dim: int, num_heads: int, options: SDMAOptions):
        super().__init__()
        options.validate()
        if embed_dim % num_heads != 0:
            raise SDMAConfigError(
                f"embedding size {embed_dim} is not divisible by the number of heads {num_heads}"
            )
        self.options = options
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.feature_gmm = GaussianMixture(
            num_heads, options.num_clusters, self.head_dim, options.centroid_grad_scale, init=options.reading
        )
        self.query_gmm = (
            GaussianMixture(1, options.num_query_clusters, self.head_dim, options.centroid_grad_scale,
                            init=options.reading)
            if options.mode == "sdma"
            else None
        )
        self.register_buffer("mix_weight", torch.zeros(()), persistent=True)

    # -- schedule ---------------------------------------------------------------
    def set_num_updates(self, num_updates: int) -> None:
        o = self.options
        self.mix_weight.fill_(mixing_weight(num_updates, o.mix_max, o.mix_rate))

    def active(self, training: bool) -> bool:
        """Whether the semantic mask is applied in this forward pass (never in mode ``none``: an attention
        module built with it is the toolkit's plain attention, as the option documents)."""
        return self.options.mode != "none" and (training or self.options.mask_at_inference)

    # -- clustering -------------------------------------------------------------
    def perturb(self, x: Tensor, training: bool, log_var: Optional[Tensor] = None) -> Tensor:
        """z = x + sigma * eps in training (eq. 8, variance ``noise_var``).

        ``log_var`` (``[..., n_h]``, the authors' ESPnet ``var_estimation``): a log-variance per
        position and head instead of ``noise_var``.
        """
        if training and log_var is not None:
            eps = torch.randn(x.shape, dtype=x.dtype, device=x.device)
            std = torch.exp(0.5 * log_var.float()).to(x.dtype)
            return x + (eps.view(*x.shape[:-1], self.num_heads, -1) * std[..., None]).view(x.shape)
        if training and self.options.noise_var > 0:
            # torch.randn, not randn_like: fairseq hands the layers a transposed (non-contiguous)
            # x, and sampling into a strided tensor takes PyTorch's per-element path (~9x slower)
            eps = torch.randn(x.shape, dtype=x.dtype, device=x.device)
            return torch.add(x, eps, alpha=math.sqrt(self.options.noise_var))
        return x

    def sample(self, x: Tensor, training: bool) -> Tuple[Tensor, Tensor]:
        """(input of the feature clustering, input of the projections) for attention input ``x``.

        Both are the one sample z of eq. (8), except in the authors' reading with c_g <= 1, where
        their code clusters x / 10 without noise and projects the noisy x (their
        ``grad_multiplier == 1`` branch).
        """
        if self.options.authors and self.options.centroid_grad_scale <= 1:
            return x / 10.0, self.perturb(x, training)
        z = self.perturb(x, training)
        return z, z

    def sample_queries(self, q: Tensor, training: bool) -> Tuple[Tensor, Tensor]:
        """(input of the query GMM, queries of the scores) for the scaled queries ``q``.

        Paper reading: ``q`` itself (it carries the sample of eq. 8 through W_q). Authors
        reading: a second draw, q + sigma * eps (their ``disentangled_attention`` step 4), used
        for both; with c_g <= 1 their code clusters q / 10 and scores the noisy q.
        """
        if not self.options.authors:
            return q, q
        return self.sample(q, training)

    def cluster(self, x: Tensor, gmm_terms: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor]:
        """Feature clustering of eq. (9): ``x [..., n_h * d_k]`` -> (log-joint, log p(c|z)), ``[..., n_h, n_c]``.

        ``gmm_terms``: see :meth:`GaussianMixture.log_joint` (inference only).
        """
        z = x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)
        log_joint = self.feature_gmm.log_joint(z, gmm_terms)
        return log_joint, log_softmax_clusters(log_joint)

    def cluster_jointly(self, inputs: Sequence[Tensor],
                        gmm_terms: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> List[Tuple[Tensor, Tensor]]:
        """:meth:`cluster` of each of ``inputs`` (``[..., n_h * d_k]``, leading shapes may differ) with
        one density evaluation: a cross-attention's queries and keys share the feature GMM, whose
        parameters are then expanded, and their gradient collected, once instead of twice."""
        if len(inputs) == 1:
            return [self.cluster(inputs[0], gmm_terms)]
        leads = [x.shape[:-1] for x in inputs]
        log_joint, log_resp = self.cluster(torch.cat([x.reshape(-1, x.size(-1)) for x in inputs]), gmm_terms)
        sizes = [math.prod(lead) for lead in leads]
        return [(joint.view(*lead, *joint.shape[1:]), resp.view(*lead, *resp.shape[1:]))
                for joint, resp, lead in zip(log_joint.split(sizes), log_resp.split(sizes), leads)]

    def cluster_queries(self, q: Tensor) -> Tuple[Tensor, Tensor]:
        """Query clustering (eq. 18 prior, eq. 9 form): ``q [..., n_h, d_k]`` -> ``[..., n_h, n_c^q]``."""
        lead = q.shape[:-1]
        log_joint = self.query_gmm.log_joint(q.reshape(-1, 1, self.head_dim)).reshape(*lead, -1)
        return log_joint, log_softmax_clusters(log_joint)

    @staticmethod
    def heads_first(resp: Tensor) -> Tensor:
        """``[T, B, n_h, C]`` -> ``[B * n_h, T, C]`` (the layout of the attention scores)."""
        T, B, H, C = resp.shape
        # contiguous: a clusters-first input would otherwise stay a strided view, on which
        # bmm falls back to one matrix product per batch entry
        return resp.permute(1, 2, 0, 3).contiguous().view(B * H, T, C)

    # -- regularisers -----------------------------------------------------------
    @staticmethod
    def computes_regularisers() -> bool:
        """Whether a forward pass computes the regularisers' inputs (the query clustering, the records).

        Inside a :func:`recording` scope, and whenever autograd is on: activation checkpointing
        (fairseq's ``--checkpoint-activations``, ESPnet's ``gradient_checkpoint_layers``) recomputes
        the forward pass in backward, outside the scope, and must save the same tensors as the
        first pass. Not in ``no_grad`` decoding outside a scope (beam search).
        """
        return torch.is_grad_enabled() or _RECORDING.get() is not None

    def record(self, log_joint_z: Tensor, log_resp_z: Tensor, query_valid: Tensor,
               log_joint_q: Optional[Tensor] = None, log_resp_q: Optional[Tensor] = None,
               log_joint_k: Optional[Tensor] = None, log_resp_k: Optional[Tensor] = None,
               log_vars: Optional[Dict[str, Tensor]] = None) -> None:
        """Keep this forward pass's clustering in the active :func:`recording` (see
        :class:`ClusteringRecord` for the arguments). Outside a scope nothing is kept; nor is
        anything inside backward (activation checkpointing recomputing the forward pass: the
        criterion already took the first pass's records).
        """
        records = _RECORDING.get()
        if records is None or torch._C._current_graph_task_id() != -1:
            return
        records.add(self, ClusteringRecord(log_joint_z, log_resp_z, query_valid, log_joint_q, log_resp_q,
                                           log_joint_k, log_resp_k, log_vars or {}))

    def regularisers(self, log_joint_z: Tensor, log_resp_z: Tensor, query_valid: Tensor,
                     log_joint_q: Optional[Tensor] = None,
                     log_resp_q: Optional[Tensor] = None) -> Dict[str, Tensor]:
        """All SDMA loss terms of this module alone (``[T, B, n_h, C]`` inputs)."""
        return sdma_losses([(self, ClusteringRecord(log_joint_z, log_resp_z, query_valid, log_joint_q, log_resp_q))])

    def extra_repr(self) -> str:
        o = self.options
        return (
            f"mode={o.mode}, reading={o.reading}, heads={self.num_heads}, clusters={o.num_clusters}, "
            f"query_clusters={o.num_query_clusters}, nu={o.mix_max}, c_g={o.centroid_grad_scale}"
        )


def _stack_layers(tensors: List[Tensor]) -> Tensor:
    """``L x [T, B, H, C]`` -> ``[L, T, B, H, C]``, stored clusters-first (``[C, L, T, B, H]``)."""
    return torch.stack([clusters_first(t) for t in tensors], dim=1).movedim(0, -1)


# Diagnostics of the clustering a user can watch (sums, so they add over batches and DDP workers):
# the share of the authors' L_Dqq normalisers at their 1e-6 clamp, their L_Dqq against the exact one
# (same positions), and the cluster hardness (mean max_c p(c|z) of the feature GMMs over real tokens).
DIAGNOSTIC_SUMS = ("dqq_clamped", "dqq_normalisers", "dqq_authors", "dqq_exact", "hardness_sum", "hardness_count")


def _accumulate(into: Dict[str, Tensor], name: str, value: Tensor) -> None:
    value = value.detach().float()
    into[name] = into[name] + value if name in into else value


def sdma_losses(items: List[Tuple["SDMACore", ClusteringRecord]],
                diagnostics: Optional[Dict[str, Tensor]] = None) -> Dict[str, Tensor]:
    """The regularisers of SDMA modules of ONE attention type, per sentence (``[B]`` each).

    ``items``: (module, its record) pairs. The records' clustering tensors are stacked along a
    layer axis so each term is one batched computation, averaged over the layers. The modules'
    ``reading`` decides the form of each term (see the module docstring). ``diagnostics``: a dict
    to which the sums of :data:`DIAGNOSTIC_SUMS` are added.
    """
    if not items:
        return {}
    first_core, first = items[0]
    o = first_core.options
    authors = o.authors
    real = first.valid.float()
    # the authors average over the padded length and normalise over pad tokens too
    valid = torch.ones_like(real) if authors else real
    log_joint_z = _stack_layers([p.log_joint_z for _, p in items])
    log_resp_z = _stack_layers([p.log_resp_z for _, p in items])
    resp_z = log_resp_z.exp()
    trace_z = trace_precision(torch.stack([c.feature_gmm.log_vars for c, _ in items]))  # [L, H, C]
    log_prior_z = log_prior(torch.stack([c.feature_gmm.prior_logits for c, _ in items])) if authors else None
    def posterior_var(kind):  # sigma_tilde^2: the option's number, or the learned [L, T, B, H]
        if kind not in first.log_vars:
            return o.kl_posterior_var
        return torch.stack([p.log_vars[kind].float() for _, p in items]).exp()

    s2 = posterior_var("z")
    losses = {
        "kl_z": vade_kl(log_joint_z, log_resp_z, trace_z, first_core.head_dim, s2, valid, resp_z, log_prior_z),
        "dv_z": cluster_diversity(resp_z, valid, o.diversity_alpha, o.diversity_beta, squared=not authors),
    }
    if authors and first.log_joint_k is not None:
        # cross-attention: the (noisy) encoder keys' KL and diversity, over the padded source length
        log_joint_k = _stack_layers([p.log_joint_k for _, p in items])
        log_resp_k = _stack_layers([p.log_resp_k for _, p in items])
        resp_k = log_resp_k.exp()
        valid_k = log_joint_k.new_ones(log_joint_k.shape[1:3], dtype=torch.float32)  # [S, B]: padded length
        losses["kl_z"] = losses["kl_z"] + vade_kl(log_joint_k, log_resp_k, trace_z, first_core.head_dim,
                                                  posterior_var("k"), valid_k, resp_k, log_prior_z)
        losses["dv_z"] = losses["dv_z"] + cluster_diversity(resp_k, valid_k, o.diversity_alpha,
                                                            o.diversity_beta, squared=False)
    if diagnostics is not None:
        with torch.no_grad():
            hardest = clusters_first(resp_z).amax(0)  # [L, T, B, H]
            _accumulate(diagnostics, "hardness_sum", (hardest * real[None, :, :, None]).sum())
            _accumulate(diagnostics, "hardness_count", real.sum() * hardest.size(0) * hardest.size(-1))
    if first.log_joint_q is not None:
        log_joint_q = _stack_layers([p.log_joint_q for _, p in items])
        log_resp_q = _stack_layers([p.log_resp_q for _, p in items])
        resp_q = log_resp_q.exp()
        heads = (len(items), first_core.num_heads, -1)  # one query GMM shared by the heads: [L, 1, C] -> [L, H, C]
        trace_q = trace_precision(torch.stack([c.query_gmm.log_vars for c, _ in items])).expand(heads)
        log_prior_q = (log_prior(torch.stack([c.query_gmm.prior_logits for c, _ in items])).expand(heads)
                       if authors else None)
        losses["kl_q"] = vade_kl(log_joint_q, log_resp_q, trace_q, first_core.head_dim, posterior_var("q"),
                                 valid, resp_q, log_prior_q)
        losses["dv_q"] = cluster_diversity(resp_q, valid, o.diversity_alpha, o.diversity_beta, squared=not authors)
        authors_p = clamped = None
        if authors or diagnostics is not None:
            authors_p, clamped = authors_token_given_cluster(clusters_first(log_joint_q))
        losses["dqq"] = head_mi_upper_bound(log_joint_q, resp_q, valid, authors,
                                            p_token_given_c=authors_p if authors else None)
        losses["dxq"] = query_input_mi_lower_bound(resp_q, valid)
        if diagnostics is not None:
            with torch.no_grad():
                other = head_mi_upper_bound(log_joint_q, resp_q, valid, not authors,
                                            p_token_given_c=None if authors else authors_p)
                exact, theirs = (other, losses["dqq"]) if authors else (losses["dqq"], other)
                _accumulate(diagnostics, "dqq_clamped", clamped.sum())
                _accumulate(diagnostics, "dqq_normalisers", log_joint_q.new_tensor(float(clamped.numel())))
                _accumulate(diagnostics, "dqq_authors", theirs.sum())
                _accumulate(diagnostics, "dqq_exact", exact.sum())
    return losses


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
        record = records.get(module) if isinstance(module, SDMACore) else None
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
    total = {}
    for name in LOSS_NAMES:
        values = [g[name] for g in per_group if name in g]
        total[name] = torch.stack(values).sum(0) if values else zeros
    return total


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


def check_finite(terms: Dict[str, Tensor], advice: str,
                 diagnose: Optional[Callable[[], str]] = None) -> None:
    """Raise FloatingPointError naming the first non-finite SDMA loss term (one sync when all are finite).

    ``diagnose`` (e.g. :func:`diagnose_nonfinite` bound to the model and batch) runs only on
    that failure path; its sentence (which parameter or activation went non-finite first)
    is added to the message.
    """
    if not terms:
        return
    values = torch.cat([t.detach().float().reshape(-1) for t in terms.values()])
    if bool(torch.isfinite(values).all()):
        return
    for name, value in terms.items():
        if not torch.isfinite(value).all():
            bad = value.detach().reshape(-1)
            bad = bad[~torch.isfinite(bad)]
            where = f" {diagnose()}." if diagnose is not None else ""
            raise FloatingPointError(f"SDMA loss term '{name}' is {float(bad[0])} (NaN/inf) for "
                                     f"{bad.numel()} of {value.numel()} sentence(s).{where} {advice}")


def _nonfinite_count(tensor: Tensor) -> int:
    return int((~torch.isfinite(tensor.detach())).sum()) if tensor.is_floating_point() else 0


def _tensors(value) -> List[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def first_nonfinite_parameter(model: nn.Module) -> Optional[str]:
    """``"name [shape]: n of m values non-finite"`` of the first parameter or float buffer
    with a NaN/inf (in ``named_parameters`` then ``named_buffers`` order), else None."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            bad = _nonfinite_count(tensor)
            if bad:
                return f"{kind} {name} {list(tensor.shape)}: {bad} of {tensor.numel()} values non-finite"
    return None


def first_nonfinite_activation(model: nn.Module, forward: Callable[[], object]) -> Optional[str]:
    """Run ``forward()`` (no gradients) with hooks on every sub-module of ``model`` and name the
    first module, in completion order, whose output holds a NaN/inf (so the innermost, earliest
    one), saying whether its inputs were already non-finite. None when every output is finite."""
    names = {module: name or type(model).__name__ for name, module in model.named_modules()}
    found: List[str] = []

    def hook(module, inputs, output):
        if found:
            return
        outputs = [t for t in _tensors(output) if t.is_floating_point()]
        bad = sum(_nonfinite_count(t) for t in outputs)
        if bad:
            inputs_bad = sum(_nonfinite_count(t) for t in _tensors(inputs))
            origin = "its inputs were already non-finite" if inputs_bad else "its inputs were finite"
            found.append(f"output of {names[module]} ({type(module).__name__}): "
                         f"{bad} of {sum(t.numel() for t in outputs)} values non-finite; {origin}")

    handles = [module.register_forward_hook(hook) for module in model.modules()]
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def diagnose_nonfinite(model: nn.Module, forward: Optional[Callable[[], object]] = None) -> str:
    """One sentence on where a non-finite loss comes from: the first non-finite parameter or
    buffer, else (re-running ``forward``) the first module whose output is non-finite."""
    parameter = first_nonfinite_parameter(model)
    if parameter is not None:
        return f"First non-finite {parameter}"
    if forward is not None:
        try:
            activation = first_nonfinite_activation(model, forward)
        except Exception as error:  # the diagnosis must not hide the original failure
            return f"All parameters are finite; re-running the batch to find the activation failed ({error})"
        if activation is not None:
            return f"All parameters are finite; first non-finite activation: {activation}"
        return ("All parameters are finite and re-running the batch gave finite activations "
                "(a transient overflow, e.g. of the sampling noise)")
    return "All parameters are finite"


def weighted_regulariser(terms: Dict[str, Tensor], weights: Dict[str, float]) -> Tensor:
    """lambda_k (KL_z + KL_q) + lambda_q L_Dqq - lambda_x L_Dxq + lambda_d (DV_z + DV_q): eq. (24) without L_CE.

    ``terms`` as returned by :func:`collect_sdma_losses` (``[B]`` per sentence); ``weights``
    keyed like :data:`LOSS_WEIGHTS`. Zero-weighted terms are skipped. Float32, one value
    per sentence (``[B]``, or 0-dim when the terms are).
    """
    total = torch.zeros_like(next(iter(terms.values())), dtype=torch.float32)
    for option, (_, names, sign) in LOSS_WEIGHTS.items():
        if weights[option]:
            for name in names:
                total = total + sign * weights[option] * terms[name].float()
    return total


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
