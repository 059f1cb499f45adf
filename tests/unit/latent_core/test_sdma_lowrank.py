"""The low-rank kernel of eq. (11) (``lowrank_mix_attention``) equals the explicit path: outputs and
the gradients of q, k, v and both responsibilities, for both readings, with key padding and a
causal mask."""

import pytest
import torch

from latent_core.sdma import (
    AUTHORS_EPS,
    authors_semantic_mask,
    lowrank_mix_attention,
    mix_attention,
    semantic_mask_product,
)

B, H, T, S, D, C = 2, 3, 5, 6, 4, 3


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for n in (T, S, S))
    resp_q = torch.softmax(2 * torch.randn(B, H, T, C, generator=g, dtype=dtype), -1)
    resp_k = torch.softmax(2 * torch.randn(B, H, S, C, generator=g, dtype=dtype), -1)
    return [t.requires_grad_() for t in (q, k, v, resp_q, resp_k)]


def _allowed(causal: bool) -> torch.Tensor:
    """0/1 ``[B, 1, T or 1, S]``: the second sentence's last two keys are padding; causal adds a future mask."""
    allowed = torch.ones(B, 1, 1, S, dtype=torch.float64)
    allowed[1, ..., -2:] = 0
    if causal:
        allowed = allowed * torch.ones(T, S, dtype=torch.float64).tril(diagonal=S - T)
    return allowed


def _explicit(q, k, v, resp_q, resp_k, mix, allowed, authors):
    scores = (q @ k.transpose(-1, -2)).masked_fill(allowed == 0, float("-inf"))
    flat = lambda x: x.reshape(B * H, x.size(-2), C)  # noqa: E731
    if authors:
        mask = authors_semantic_mask(flat(resp_q), flat(resp_k), allowed)
    else:
        mask = semantic_mask_product(flat(resp_q), flat(resp_k))
    attn = mix_attention(scores, mask.view(B, H, T, S), mix, norm_floor=AUTHORS_EPS if authors else 0.0)
    return attn @ v


@pytest.mark.parametrize("authors", [False, True], ids=["paper", "authors"])
@pytest.mark.parametrize("causal", [False, True], ids=["padding", "causal"])
def test_lowrank_equals_explicit(authors, causal):
    mix = torch.tensor(0.7, dtype=torch.float64)
    allowed = _allowed(causal)
    base_mask = torch.zeros_like(allowed).masked_fill(allowed == 0, float("-inf"))
    ref_in, low_in = _inputs(), _inputs()
    ref = _explicit(*ref_in, mix, allowed, authors)
    low = lowrank_mix_attention(*low_in, mix, base_mask, allowed, authors=authors)
    torch.testing.assert_close(low, ref, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(ref)
    (ref * weights).sum().backward()
    (low * weights).sum().backward()
    for name, a, b in zip(("q", "k", "v", "resp_q", "resp_k"), ref_in, low_in):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-11, msg=name)


def test_lowrank_rows_with_no_shared_cluster_fall_back_like_the_explicit_path():
    """Query and key responsibilities on disjoint clusters: M is the 1e-6 floor (paper) or zero
    (authors); both paths agree there too."""
    q, k, v, _, _ = _inputs()
    resp_q = torch.zeros(B, H, T, C, dtype=torch.float64)
    resp_q[..., 0] = 1
    resp_k = torch.zeros(B, H, S, C, dtype=torch.float64)
    resp_k[..., 1] = 1
    mix = torch.tensor(1.0, dtype=torch.float64)
    allowed = _allowed(False)
    base_mask = torch.zeros_like(allowed).masked_fill(allowed == 0, float("-inf"))
    for authors in (False, True):
        ref = _explicit(q, k, v, resp_q, resp_k, mix, allowed, authors)
        low = lowrank_mix_attention(q, k, v, resp_q, resp_k, mix, base_mask, allowed, authors=authors)
        torch.testing.assert_close(low, ref, rtol=1e-9, atol=1e-12)
