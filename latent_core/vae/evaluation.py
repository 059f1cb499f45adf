"""Evaluation of sentence VAEs: importance-weighted log-likelihood, perplexity, ELBO, MI, AU.

The metrics of Optimus (Li et al., EMNLP 2020, arXiv:2004.04092, Section 5.1 and Appendix C.1),
following He et al. (2019), and of QKVAE's code:

* log p(x) >= L_k = log (1/k) sum_i p(x, z_i) / q(z_i|x), z_i ~ q(z|x) (Burda et al. 2015;
  Optimus eq. 15), per example; perplexity exp(-sum_x log p(x) / #tokens);
* the ELBO, E_q[log p(x|z)] - KL(q(z|x) || p(z)) (QKVAE eq. 1), with one sample;
* the mutual information I_q(x, z) with the aggregate posterior (Optimus Appendix A), both
  of its terms on the same samples (He et al.'s and Optimus' ``calc_mi`` use the analytic
  entropy for the first, see :func:`mutual_information`);
* active units, Cov_x(E_{q(z|x)}[z]) > 0.01 (Optimus Appendix C.1).

Several latents (QKVAE's z_syn and z_sem, Optimus' z) are given as a dict name ->
:class:`DiagonalGaussian`; they are independent given x and have N(0, I) priors, so their
log-densities add. ``log_likelihood_fn(samples)`` maps name -> ``[n, B, D_name]`` to
log p(x|z) ``[n, B]`` (summed over the target tokens).
"""

import math
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from latent_core.errors import check_positive_int

from .distributions import DiagonalGaussian, standard_normal_log_prob
from .errors import VAEConfigError

LogLikelihoodFn = Callable[[Dict[str, Tensor]], Tensor]


def _batch_size(posteriors: Mapping[str, DiagonalGaussian]) -> int:
    if not posteriors:
        raise ValueError("at least one posterior is needed")
    sizes = {name: q.batch_shape for name, q in posteriors.items()}
    if any(len(shape) != 1 for shape in sizes.values()) or len(set(sizes.values())) != 1:
        raise ValueError(f"posteriors must all be [B, D] with the same B, got {sizes}")
    return next(iter(sizes.values()))[0]


def _log_likelihood(fn: LogLikelihoodFn, samples: Dict[str, Tensor], n: int, batch: int) -> Tensor:
    log_lik = fn(samples)
    if log_lik.shape != (n, batch):
        raise ValueError(f"log_likelihood_fn must return [n, B] = {[n, batch]}, got {list(log_lik.shape)}")
    return log_lik


def importance_weighted_log_likelihood(
    log_likelihood_fn: LogLikelihoodFn,
    posteriors: Mapping[str, DiagonalGaussian],
    num_samples: int = 100,
    chunk_size: int = 10,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """L_k per example, ``[B]`` (Optimus eq. 15; k = ``num_samples``, 100 in Optimus' code).

    log w_i = log p(x|z_i) + log p(z_i) - log q(z_i|x). ``log_likelihood_fn`` runs once per
    chunk of at most ``chunk_size`` samples (``[c, B, D]``), and the chunks are combined with
    a running logsumexp, so memory is that of ``chunk_size`` decoder passes.

    The standard-normal noise of all k samples (``k x B x sum_D`` floats, small next to one
    decoder pass) is drawn before the first chunk, so the estimate does not depend on
    ``chunk_size`` for a given ``generator`` state. Call under ``torch.no_grad()``.
    """
    check_positive_int("num_samples", num_samples, VAEConfigError)
    check_positive_int("chunk_size", chunk_size, VAEConfigError)
    batch = _batch_size(posteriors)
    noise = {
        name: torch.randn((num_samples, *q.mean.shape), generator=generator,
                          device=q.mean.device, dtype=q.mean.dtype)
        for name, q in posteriors.items()
    }
    total = None  # running log sum_i w_i, [B]
    for first in range(0, num_samples, chunk_size):
        n = min(chunk_size, num_samples - first)
        samples = {name: q.reparameterize(noise[name][first:first + n]) for name, q in posteriors.items()}
        log_w = _log_likelihood(log_likelihood_fn, samples, n, batch)  # [n, B]
        for name, q in posteriors.items():  # log w_i = log p(x, z_i) - log q(z_i|x), eq. (15)
            log_w = log_w + standard_normal_log_prob(samples[name]) - q.log_prob(samples[name])
        chunk = torch.logsumexp(log_w, dim=0)
        total = chunk if total is None else torch.logaddexp(total, chunk)
    return total - math.log(num_samples)  # log (1/k) sum_i w_i


def perplexity(log_likelihood: Union[Tensor, float], num_tokens: int) -> float:
    """exp(-sum_x log p(x) / #tokens) over an evaluation set.

    ``log_likelihood``: per-sentence log p(x) (a tensor, summed here) or their sum. With
    :func:`importance_weighted_log_likelihood` this is the IW-PPL that Optimus reports
    (He et al. 2019); with ``ElboTerms.elbo`` it is the (higher) ELBO-PPL. ``num_tokens``
    counts every predicted target token including the end-of-sentence token and excluding
    padding and the beginning-of-sentence token (fairseq's ``ntokens``; He et al. count
    ``sent_len - 1`` per sentence, i.e. all but the start symbol).
    """
    check_positive_int("num_tokens", num_tokens, VAEConfigError)
    total = float(log_likelihood.sum()) if isinstance(log_likelihood, Tensor) else float(log_likelihood)
    return math.exp(-total / num_tokens)


class ElboTerms(NamedTuple):
    """Per-example ELBO terms: ``reconstruction`` log p(x|z), z ~ q(z|x), ``[B]``;
    ``kl`` name -> KL(q(z|x) || N(0, I)) ``[B]``; ``elbo`` = reconstruction - sum of KLs."""

    reconstruction: Tensor
    kl: Dict[str, Tensor]
    elbo: Tensor


def elbo_terms(log_likelihood_fn: LogLikelihoodFn, posteriors: Mapping[str, DiagonalGaussian],
               generator: Optional[torch.Generator] = None) -> ElboTerms:
    """The ELBO (QKVAE eq. 1) with one reparameterised sample and the analytic KL."""
    batch = _batch_size(posteriors)
    samples = {name: q.rsample(1, generator=generator) for name, q in posteriors.items()}
    reconstruction = _log_likelihood(log_likelihood_fn, samples, 1, batch)[0]
    kl = {name: q.kl_standard_normal().sum(-1) for name, q in posteriors.items()}
    return ElboTerms(reconstruction, kl, reconstruction - sum(kl.values()))


def _pairwise_log_density(z: Tensor, mean: Tensor, logvar: Tensor) -> Tensor:
    """log N(z_a; mean_j, diag exp(logvar_j)) for all pairs: ``[A, D], [N, D] -> [A, N]``.

    The squared distance is expanded (z^2 . 1/var - 2 z . mean/var + mean^2 . 1/var) into
    matrix products, in float64 against cancellation: memory A x N, no A x N x D temporary.
    """
    z, mean, logvar = z.double(), mean.double(), logvar.double()
    precision = torch.exp(-logvar)
    const = (mean * mean * precision + logvar).sum(-1) + mean.size(-1) * math.log(2.0 * math.pi)
    maha = (z * z) @ precision.T - 2.0 * z @ (mean * precision).T
    return -0.5 * (maha + const)


class MIEstimate(NamedTuple):
    """A Monte-Carlo estimate of I_q(x, z) with what it rests on.

    ``value`` (nats); ``standard_error``: of ``value``, from the spread of the per-example
    terms over the N examples (std / sqrt(N); it treats the examples' terms as independent,
    which the shared aggregate posterior makes only approximately true); ``num_examples``
    (N) and ``num_samples`` (z samples per example); ``log_n``: log N, the largest value the
    estimator can return (q(z) is the mixture of the N posteriors, so log q(z|x_i) - log q(z)
    <= log N): with N = 1,000 no estimate exceeds 6.91 nats, whatever the model.
    """

    value: float
    standard_error: float
    num_examples: int
    num_samples: int
    log_n: float

    ESTIMATOR = ("I_q(x, z) = mean over examples i and samples z ~ q(z|x_i) of log q(z|x_i) - log q(z), "
                 "q(z) = 1/N sum_j q(z|x_j) over the N evaluated examples (both terms on the same sample)")


def standard_error(values: Tensor) -> float:
    """Standard error of the mean of ``values`` ``[N]``: unbiased std / sqrt(N) (NaN for N < 2)."""
    n = values.numel()
    return float(values.double().std(unbiased=True)) / math.sqrt(n) if n > 1 else float("nan")


def mutual_information(means: Tensor, logvars: Tensor, num_samples: int = 1,
                       chunk_size: int = 1024, generator: Optional[torch.Generator] = None) -> MIEstimate:
    """I_q(x, z) = E_x E_{q(z|x)}[log q(z|x) - log q(z)] (Optimus Appendix A; He et al. 2019).

    ``means``, ``logvars``: the posteriors of the whole evaluation set, ``[N, D]`` (for
    several independent latents, concatenate them along D for the joint MI). q(z) is the
    aggregate posterior 1/N sum_j q(z|x_j) over the evaluation set; ``num_samples`` samples
    z ~ q(z|x_i) per example. Both terms are evaluated on the SAME sample: log q(z|x_i) is
    the i-th entry of the N densities that make up q(z), so the estimate is exactly 0 when
    all posteriors are equal and its sampling noise largely cancels.

    The papers' own estimators: Optimus' ``calc_mi`` (``calc_mi_v3``, ``code/examples/big_ae/
    utils.py``) also builds q(z) from the whole evaluation set, but takes the first term as
    the analytic negative entropy, which in 128 dimensions leaves the noise of a single sample
    of log q(z) uncancelled (measured: -0.27 for identical posteriors, 1.24 where the true
    value is at most 0.34); He et al.'s original uses one batch's q(z). QKVAE's code
    (``BaseLatentVariable.get_mi``) is not an MI estimate: it averages the batch posteriors'
    log-densities where their densities must be averaged (mean of logs, not log of the mean),
    so its "log q(z)" is biased low and the value is unbounded (77.5 nats on 512 synthetic
    posteriors, where log N = 6.24): QKVAE's Table 1 MI does not compare with this or any
    correct estimator. The N x N densities are computed ``chunk_size`` samples at a time
    (memory chunk x N).
    """
    check_positive_int("num_samples", num_samples, VAEConfigError)
    check_positive_int("chunk_size", chunk_size, VAEConfigError)
    posterior = DiagonalGaussian(means, logvars)
    n = means.size(0)
    z = posterior.rsample(num_samples, generator=generator).reshape(-1, posterior.latent_size)  # row r: x_{r % N}
    own = torch.arange(z.size(0)) % n
    log_n = math.log(n)
    per_sample = torch.empty(z.size(0), dtype=torch.float64)
    for first in range(0, z.size(0), chunk_size):
        rows = slice(first, first + chunk_size)
        pairwise = _pairwise_log_density(z[rows], posterior.mean, posterior.logvar)  # [chunk, N]
        log_q_own = pairwise.gather(1, own[rows].to(pairwise.device)[:, None])[:, 0]  # log q(z|x_i)
        log_q_aggregate = torch.logsumexp(pairwise, dim=1) - log_n  # log q(z)
        per_sample[rows] = (log_q_own - log_q_aggregate).cpu()
    per_example = per_sample.view(num_samples, n).mean(0)
    return MIEstimate(float(per_example.mean()), standard_error(per_example), n, num_samples, log_n)


def active_units(means: Tensor, threshold: float = 0.01) -> Tuple[int, Tensor]:
    """A_z = #{d : Cov_x(E_{q(z|x)}[z])_dd >= threshold} (Optimus Appendix C.1).

    ``means``: posterior means of the evaluation set, ``[N, D]``, N >= 2. Returns the count and
    the per-dimension variances ``[D]`` (unbiased, divided by N - 1, as He et al.'s and
    Optimus' ``calc_au``, which also count a variance equal to the threshold as active).
    """
    if means.dim() != 2 or means.size(0) < 2:
        raise ValueError(f"means must be [N, D] with N >= 2, got {list(means.shape)}")
    variances = means.double().var(dim=0, unbiased=True)
    return int((variances >= threshold).sum()), variances


def principal_variance_shares(means: Tensor) -> Tensor:
    """Shares of the posterior means' total variance along their principal directions, largest
    first (``[min(N, D)]``, summing to 1; all 0 when the means do not vary).

    ``means``: ``[N, D]``, N >= 2. Active units count dimensions one at a time, so means that
    vary along one direction spread over many dimensions count as many active units; a first
    share near 1 says the latent space is used as a single number (e.g. sentence length).
    """
    if means.dim() != 2 or means.size(0) < 2:
        raise ValueError(f"means must be [N, D] with N >= 2, got {list(means.shape)}")
    centred = means.double() - means.double().mean(0)
    squared = torch.linalg.svdvals(centred) ** 2
    total = squared.sum()
    return squared / total if total > 0 else squared
