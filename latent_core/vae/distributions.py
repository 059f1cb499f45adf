"""Diagonal Gaussian posteriors q(z|x) = N(mu, diag exp(logvar)) and the N(0, I) prior.

Shared by the QKVAE/ADVAE and Optimus models (Felhi et al., NAACL 2022, arXiv:2205.05943, eq. 1 and 3,
Li et al., EMNLP 2020, arXiv:2004.04092, eq. 6). Shapes: any leading "batch" shape, the last dimension
is the latent size D.

Numerical safety:

* the log-variance is clamped to ``LOGVAR_RANGE`` = [-30, 20] (variance between ~1e-13 and
  ~5e8). The range is wide enough never to bind in healthy training, and keeps exp() finite
  (float32 overflows at exp(88.7), fp16 at exp(11.1)); a clamped entry gets no gradient;
* densities, KL and entropy are computed in (at least) float32, so they are safe under
  fp16/bf16 autocast; samples keep the dtype of the mean (the decoder's dtype).
"""

import math
from typing import Optional

import torch
from torch import Tensor

LOGVAR_RANGE = (-30.0, 20.0)
_LOG_2PI = math.log(2.0 * math.pi)


def _at_least_float32(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def standard_normal_log_prob(z: Tensor) -> Tensor:
    """log N(z; 0, I), summed over the last dimension: ``[..., D] -> [...]``."""
    z = _at_least_float32(z)
    return -0.5 * (z * z + _LOG_2PI).sum(-1)


class DiagonalGaussian:
    """N(mean, diag exp(logvar)) with ``mean``, ``logvar`` of the same shape ``[*batch, D]``."""

    def __init__(self, mean: Tensor, logvar: Tensor):
        if mean.shape != logvar.shape:
            raise ValueError(
                f"mean {tuple(mean.shape)} and logvar {tuple(logvar.shape)} must have the same shape"
            )
        if mean.dim() < 1:
            raise ValueError("mean and logvar need a last (latent) dimension")
        self.mean = mean
        self.logvar = logvar.clamp(*LOGVAR_RANGE)

    @property
    def batch_shape(self) -> torch.Size:
        return self.mean.shape[:-1]

    @property
    def latent_size(self) -> int:
        return self.mean.size(-1)

    @property
    def std(self) -> Tensor:
        """sigma = exp(logvar / 2), ``[*batch, D]`` (dtype of ``logvar``)."""
        return torch.exp(0.5 * self.logvar)

    def reparameterize(self, eps: Tensor) -> Tensor:
        """z = mu + sigma * eps for standard-normal noise ``eps`` ``[..., *batch, D]``."""
        return self.mean + self.std * eps

    def rsample(self, num_samples: Optional[int] = None,
                generator: Optional[torch.Generator] = None) -> Tensor:
        """Reparameterised samples: ``[*batch, D]``, or ``[n, *batch, D]`` with ``num_samples=n``.

        Gradients flow to ``mean`` and ``logvar``. ``generator`` (on the mean's device) fixes
        the random stream.
        """
        shape = self.mean.shape if num_samples is None else (num_samples, *self.mean.shape)
        eps = torch.randn(shape, generator=generator, device=self.mean.device, dtype=self.mean.dtype)
        return self.reparameterize(eps)

    def log_prob(self, z: Tensor) -> Tensor:
        """log q(z) summed over the last dimension: ``[..., *batch, D] -> [..., *batch]``.

        Leading sample dimensions of ``z`` broadcast against the batch shape.
        """
        mean, logvar = _at_least_float32(self.mean), _at_least_float32(self.logvar)
        dev = _at_least_float32(z) - mean
        return -0.5 * (dev * dev * torch.exp(-logvar) + logvar + _LOG_2PI).sum(-1)

    def kl_standard_normal(self) -> Tensor:
        """KL(q || N(0, I)) per dimension, ``[*batch, D]``: 0.5 (mu^2 + sigma^2 - log sigma^2 - 1)."""
        mean, logvar = _at_least_float32(self.mean), _at_least_float32(self.logvar)
        return 0.5 * (mean * mean + torch.exp(logvar) - logvar - 1.0)

    def entropy(self) -> Tensor:
        """H[q] = 0.5 sum_d (1 + log 2 pi + logvar_d), ``[*batch]``."""
        return 0.5 * (_at_least_float32(self.logvar) + 1.0 + _LOG_2PI).sum(-1)
