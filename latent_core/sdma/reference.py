"""The direct forms the fast paths are held to: each equation written as it reads, for autograd to differentiate
(no custom backward, no fusion, no kernels of our own). Tests compare the autograd Functions of ``attention.py``, the
Triton kernels of ``triton_kernels.py`` and the GMM's batched clustering against these."""

from typing import Optional

import torch
from torch import Tensor

from latent_core.sdma.mixture import LOGVAR_RANGE, GaussianMixture
from latent_core.sdma.options import LOG_2PI


def log_joint_direct(gmm: GaussianMixture, z: Tensor, scale: float = 1.0) -> Tensor:
    """log pi_c + log N(s z | mu_c, Sigma_c) of eq. (9) for ``gmm``'s groups, ``[..., G, d] -> [..., G, C]``, as it
    reads: a ``[..., G, C, d]`` difference per cluster (what :meth:`GaussianMixture.log_joint` computes with two matrix
    products). Slow and memory-hungry."""
    log_vars = gmm.log_vars.float().clamp(*LOGVAR_RANGE)
    z = z.to(torch.promote_types(z.dtype, torch.float32)) * scale
    squared = ((z.unsqueeze(-2) - gmm.scaled_means()) ** 2 / log_vars.exp()).sum(-1)  # (z - mu_c)^T Sigma_c^-1 (z - mu_c)
    log_normal = -0.5 * (squared + log_vars.sum(-1) + gmm.dim * LOG_2PI)  # log N(z | mu_c, Sigma_c)
    return log_normal + gmm.log_prior()  # + log pi_c


def mix_attention_direct(scores: Tensor, mask: Optional[Tensor], mix: Tensor, norm_floor: float = 0.0) -> Tensor:
    """A_hat of eq. (1), (2), (11) from pre-softmax ``scores`` and the unnormalised mask M (``[..., T, S]``), as
    :func:`latent_core.sdma.attention.mix_attention` computes it in one autograd node; ``norm_floor`` the authors'
    eps on the row sums of M o A."""
    attn = torch.softmax(scores, dim=-1)  # A (eq. 1)
    if mask is None:
        return attn
    masked = attn * mask  # M o A
    attn_bar = masked / masked.sum(-1, keepdim=True).clamp_min(norm_floor)  # A_bar (eq. 2)
    return (1 - mix) * attn + mix * attn_bar  # A_hat (eq. 11)


def dropout_scales(seed: int, dropout_p: float, B: int, H: int, T: int, S: int, device="cpu") -> Tensor:
    """The dropout :func:`latent_core.sdma.triton_kernels.mixed_attention` applies to A_hat for ``seed``: ``[B, H, T,
    S]`` float32, 1 / (1 - p) where a weight is kept, 0 where it is dropped (the same Philox draw), so that the
    explicit path can reproduce a call of the kernel."""
    import triton

    from latent_core.sdma.triton_kernels import dropout_keep

    out = torch.empty(B, H, T, S, dtype=torch.float32, device=device)
    dropout_keep[(triton.cdiv(T, 16), triton.cdiv(S, 16), B * H)](out, seed, float(dropout_p), T, S, BLOCK_T=16,
                                                                    BLOCK_S=16)
    return out


def sampling_noise_direct(x: Tensor, sigma: float, seed: int) -> Tensor:
    """z = x + sigma eps of eq. (8) as :func:`latent_core.sdma.triton_kernels.sampling_noise` draws it for ``seed``:
    eps the kernel's Philox normals (its draw on zeros, in ``x``'s layout), added here in float32."""
    from latent_core.sdma.triton_kernels import sampling_noise

    eps = sampling_noise(torch.zeros_like(x, dtype=torch.float32), 1.0, seed)  # in x's strides, as the kernel draws
    return (x.float() + sigma * eps).to(x.dtype)
