"""KL regularisers of the beta-VAE objective: plain beta, free bits, and Optimus' hinge mask.

Input: the per-dimension KL(q(z_d|x) || p(z_d)) of one latent for a batch, ``[B, D]``
(:meth:`DiagonalGaussian.kl_standard_normal`). Three variants, applied to a "unit" u:

* ``beta``      beta * sum_u KL_u (beta-VAE; QKVAE Section 4.3, Optimus eq. 5-6);
* ``free_bits`` beta * sum_u max(lambda, KL_u) (Kingma et al. 2016; QKVAE Section 4.3 and
                Appendix B, lambda = 0.05; Optimus eq. 9);
* ``hinge``     beta * sum_u KL_u [KL_u > lambda]: units below lambda contribute nothing
                (the mask of Optimus' code, ``fb_mode=1``; the paper's eq. 9 is ``free_bits``).

Where the threshold applies is explicit, on two axes:

* ``scope="example"``: each example's KL is thresholded (QKVAE's and Optimus' code, and
  Optimus eq. 9, whose KL(q(z_i|x)||p(z_i)) is per x); ``scope="batch"``: the KL is first
  averaged over the batch, then thresholded (Kingma et al.'s original free bits);
* ``granularity="dimension"``: one unit per latent dimension (QKVAE, Optimus eq. 9);
  ``granularity="latent"``: one unit per latent, its summed KL (lambda is then nats per
  latent; Kingma et al.'s groups with the whole latent as one group).

The loss is summed over the batch (fairseq's convention; the criterion divides by the
sample size). With ``scope="batch"`` the thresholded batch mean is multiplied by B, so both
scopes are on the same scale and agree when nothing is thresholded.
"""

import math
from dataclasses import dataclass
from typing import Dict, Mapping, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .errors import VAEConfigError

KL_VARIANTS = ("beta", "free_bits", "hinge")
KL_SCOPES = ("example", "batch")
KL_GRANULARITIES = ("dimension", "latent")
DEFAULT_KL_THRESHOLD = 0.05  # lambda in nats per unit: QKVAE (Appendix B); Optimus' tables vary it
THRESHOLD_OPTION = "--kl-threshold"


def check_threshold(value: float, context: str = THRESHOLD_OPTION) -> float:
    """The one check of a KL threshold lambda: a finite number >= 0 (VAEConfigError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise VAEConfigError(f"{context}: lambda={value} must be a finite number >= 0")
    return float(value)


def parse_kl_thresholds(spec: str) -> Dict[Optional[str], float]:
    """``--kl-threshold`` -> {latent or None (the default entry): lambda}.

    ``spec``: a number, or comma-separated ``[LATENT=]NUMBER`` (``z_syn=0.05,z_sem=0.1``).
    """
    out: Dict[Optional[str], float] = {}
    for entry in str(spec).split(","):
        latent, named, text = entry.rpartition("=")
        key = latent.strip() if named else None
        where = f"{THRESHOLD_OPTION} {spec!r}"
        if key == "":
            raise VAEConfigError(f"{where}: {entry.strip()!r} has an empty latent name")
        if key in out:
            raise VAEConfigError(f"{where}: two thresholds for {key or 'the default'}")
        try:
            value = float(text)
        except ValueError:
            raise VAEConfigError(f"{where}: {text.strip()!r} is not a number") from None
        out[key] = check_threshold(value, where)
    return out


class KLTerm(NamedTuple):
    """One latent's KL term of the loss.

    ``loss``: beta * penalty, scalar (what enters the loss); ``penalty``: the thresholded
    KL summed over the batch, scalar, before beta; ``kl``: the raw KL per example (summed
    over dimensions), ``[B]``, detached, for logging.
    """

    loss: Tensor
    penalty: Tensor
    kl: Tensor


def _check_finite(kl: Tensor, name: str) -> None:
    """Raise FloatingPointError naming the latent if its KL has a NaN or an infinity.

    (One device synchronisation per call.)
    """
    if not bool(torch.isfinite(kl).all()):
        bad = "nan" if bool(torch.isnan(kl).any()) else "inf"
        raise FloatingPointError(f"KL of latent {name} is {bad}")


@dataclass(frozen=True)
class KLRegularizer:
    """A KL variant with its threshold lambda (>= 0; unused by ``beta``) and scope.

    Command-line names: ``--kl-variant``, ``--kl-threshold``, ``--kl-scope``,
    ``--kl-granularity``.
    """

    variant: str = "free_bits"
    threshold: float = DEFAULT_KL_THRESHOLD  # lambda
    scope: str = "example"
    granularity: str = "dimension"

    def __post_init__(self):
        for option, value, allowed in (("--kl-variant", self.variant, KL_VARIANTS),
                                       ("--kl-scope", self.scope, KL_SCOPES),
                                       ("--kl-granularity", self.granularity, KL_GRANULARITIES)):
            if value not in allowed:
                raise VAEConfigError(f"{option}={value!r} is not one of {', '.join(allowed)}")
        check_threshold(self.threshold, f"{THRESHOLD_OPTION}={self.threshold}")

    def _threshold(self, units: Tensor) -> Tensor:
        if self.variant == "free_bits":
            return units.clamp(min=self.threshold)  # max(lambda, KL_u), Optimus eq. (9)
        if self.variant == "hinge":
            return units * (units > self.threshold).to(units.dtype)  # KL_u [KL_u > lambda]
        return units

    def __call__(self, kl: Tensor, beta: float, name: str = "z") -> KLTerm:
        """The KL term of latent ``name`` from its per-dimension KL ``[B, D]`` and weight beta."""
        if kl.dim() != 2:
            raise ValueError(f"KL of latent {name} must be [batch, dims], got {tuple(kl.shape)}")
        if not beta >= 0:  # also rejects NaN
            raise VAEConfigError(f"beta of latent {name} is {beta}; it must be >= 0")
        _check_finite(kl, name)
        units = kl if self.granularity == "dimension" else kl.sum(-1, keepdim=True)  # [B, U]
        if self.scope == "batch":
            penalty = kl.size(0) * self._threshold(units.mean(0)).sum()
        else:
            penalty = self._threshold(units).sum()
        return KLTerm(beta * penalty, penalty, kl.detach().sum(-1))


def regularize_latents(kls: Mapping[str, Tensor], betas: Mapping[str, float],
                       regularizer: KLRegularizer) -> Tuple[Tensor, Dict[str, KLTerm]]:
    """Apply ``regularizer`` to several latents, each with its own beta (QKVAE Section 4.3).

    ``kls``: name -> per-dimension KL ``[B, D_name]``; ``betas``: name -> beta (e.g. from
    :func:`latent_core.vae.schedules.parse_beta_schedules`). Returns the summed loss (scalar)
    and the per-latent :class:`KLTerm`.
    """
    if not kls:
        raise ValueError("regularize_latents needs at least one latent")
    missing = [name for name in kls if name not in betas]
    if missing:
        raise VAEConfigError(f"no beta for latent(s) {', '.join(missing)}")
    terms = {name: regularizer(kl, betas[name], name) for name, kl in kls.items()}
    return sum(term.loss for term in terms.values()), terms
