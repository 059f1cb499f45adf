"""VAE utilities shared by the QKVAE, ADVAE and Optimus models and the sentence-VAE criterion.

Plain PyTorch (no fairseq import):

* :mod:`.distributions` -- diagonal Gaussian posteriors and the N(0, I) prior;
* :mod:`.kl` -- KL regularisers: beta, free bits (QKVAE; Optimus eq. 9), Optimus' hinge
  mask, per example or batch-averaged, per dimension or per latent;
* :mod:`.schedules` -- beta schedules as pure functions of ``num_updates`` and the
  ``--beta-schedule`` spec parser;
* :mod:`.evaluation` -- importance-weighted log-likelihood and perplexity, ELBO terms,
  mutual information and active units.
"""

from .distributions import LOGVAR_RANGE, DiagonalGaussian, standard_normal_log_prob
from .errors import VAEConfigError
from .evaluation import (
    ElboTerms,
    MIEstimate,
    active_units,
    elbo_terms,
    importance_weighted_log_likelihood,
    mutual_information,
    perplexity,
    principal_variance_shares,
    standard_error,
)
from .kl import KL_GRANULARITIES, KL_SCOPES, KL_VARIANTS, KLRegularizer, KLTerm, regularize_latents
from .schedules import (
    AutoEncoderPhase,
    ConstantSchedule,
    CyclicalSchedule,
    LinearSchedule,
    parse_beta_schedules,
    parse_schedule,
)

__all__ = [
    "LOGVAR_RANGE", "DiagonalGaussian", "standard_normal_log_prob", "VAEConfigError",
    "ElboTerms", "MIEstimate", "active_units", "principal_variance_shares", "elbo_terms",
    "importance_weighted_log_likelihood",
    "mutual_information", "perplexity", "standard_error", "KL_GRANULARITIES", "KL_SCOPES", "KL_VARIANTS",
    "KLRegularizer", "KLTerm", "regularize_latents", "AutoEncoderPhase", "ConstantSchedule",
    "CyclicalSchedule", "LinearSchedule", "parse_beta_schedules", "parse_schedule",
]
