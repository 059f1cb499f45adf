"""The fused attention paths (``--sdma-attention-kernel sdpa`` and ``lowrank``) compute what the explicit path computes.

fairseq's SDMA attention with two ``scaled_dot_product_attention`` calls (the semantic mask as an
additive log M) against the explicit path (scores, one softmax, the multiplicative mask of eq. 2):
outputs and every gradient (projections, both GMMs, inputs) in float32, and within low-precision
tolerances in bfloat16 / float16. SDPA runs on a CPU, so the GPU code path is tested here.
"""

import pytest
import torch

from latent_core.sdma import (SDMAConfigError, SDMAOptions, fused_mix_attention, mix_attention, recording, sdma_losses,
                               select_kernel)
from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention

E, H, T, B = 32, 4, 7, 3


def attention(kernel, group="encoder_self", reading="authors", **kwargs):
    torch.manual_seed(0)
    module = SDMAMultiheadAttention(
        E, H, sdma=SDMAOptions(clusters=3, query_clusters=2, noise_var=0.0, attention_kernel=kernel,
                               reading=reading),
        group=group, self_attention=group != "decoder_cross", encoder_decoder_attention=group == "decoder_cross",
        **kwargs)
    module.set_num_updates(2000)  # g = 0.63: both branches matter
    return module.train()


def run(module, x, memory=None, key_padding_mask=None, attn_mask=None, dtype=torch.float32):
    module = module.to(dtype)
    x = x.to(dtype).detach().requires_grad_(True)
    key = value = x if memory is None else memory.to(dtype)
    with recording() as records:
        out, weights = module(x, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                              need_weights=False)
    losses = sdma_losses([(module.sdma, records.get(module.sdma))])
    loss = out.float().pow(2).sum() + sum(v.sum() for v in losses.values())
    loss.backward()
    grads = {name: p.grad.float().clone() for name, p in module.named_parameters()}
    return out.float().detach(), x.grad.float(), grads, weights


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, E, generator=g)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -2:] = True  # right padding in one sentence
    return x, pad


def future_mask():
    return torch.triu(torch.full((T, T), float("-inf")), 1)


@pytest.fixture
def fused_calls(monkeypatch):
    """How many times the core's entry point ran a fused kernel (a row of KERNELS other than explicit)."""
    import latent_core.sdma as core

    calls = []
    for name in ("sdpa", "lowrank", "triton"):
        kernel = core.KERNELS[name]
        monkeypatch.setitem(core.KERNELS, name, lambda x, kernel=kernel: (calls.append(1), kernel(x))[1])
    return calls


@pytest.mark.parametrize("reading", ["authors", "paper"])
@pytest.mark.parametrize("kernel", ["sdpa", "lowrank", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("case", ["encoder_self", "unmasked_self", "decoder_self_causal", "decoder_cross"])
def test_fused_path_equals_explicit_path_fp32_outputs_and_gradients(case, kernel, reading, fused_calls):
    x, pad = inputs()
    kwargs = {}
    if case == "encoder_self":
        kwargs = {"key_padding_mask": pad}
    elif case == "decoder_self_causal":
        kwargs = {"attn_mask": future_mask()}
    elif case == "decoder_cross":
        kwargs = {"memory": torch.randn(T + 2, B, E), "key_padding_mask": torch.cat([pad, pad[:, :2]], 1)}
    group = "decoder_cross" if case == "decoder_cross" else "encoder_self"
    explicit = run(attention("explicit", group, reading), x, **kwargs)
    assert not fused_calls
    fused = run(attention(kernel, group, reading), x, **kwargs)
    assert len(fused_calls) == 1 and fused[3] is None
    torch.testing.assert_close(fused[0], explicit[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1], explicit[1], rtol=1e-4, atol=1e-5)
    assert explicit[2].keys() == fused[2].keys()
    for name in explicit[2]:
        torch.testing.assert_close(fused[2][name], explicit[2][name], rtol=1e-4, atol=1e-5, msg=name)
    assert explicit[2]["sdma.feature_gmm.means"].abs().sum() > 0  # the mask's gradient reached the GMM


@pytest.mark.parametrize("kernel", ["sdpa", "lowrank", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_fused_path_equals_explicit_path_in_low_precision(dtype, tol, kernel):
    x, pad = inputs()
    explicit = run(attention("explicit"), x, key_padding_mask=pad, dtype=dtype)
    fused = run(attention(kernel), x, key_padding_mask=pad, dtype=dtype)
    reference = run(attention("explicit"), x, key_padding_mask=pad)
    assert torch.isfinite(fused[0]).all() and torch.isfinite(fused[1]).all()
    scale = reference[0].abs().max()
    assert (fused[0] - explicit[0]).abs().max() <= tol * scale
    assert (fused[0] - reference[0]).abs().max() <= tol * scale


def test_weights_requested_fall_back_to_the_explicit_path(fused_calls):
    x, pad = inputs()
    module = attention("sdpa")
    out, weights = module(x, x, x, key_padding_mask=pad, need_weights=True)
    assert not fused_calls
    assert weights is not None and weights.shape == (B, T, T)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, T))
    assert weights[0, :, -2:].abs().max() == 0  # padded keys get no weight


@pytest.mark.interpreter
@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_the_triton_kernel_gives_the_weights_fairseq_asks_for_in_training(reading, fused_calls):
    """fairseq's decoder asks its alignment layer's cross-attention for weights in training: the Triton row returns
    them (averaged over heads, as fairseq's module does) equal to the explicit row's, with the same output."""
    x, pad = inputs()
    memory = torch.randn(T + 2, B, E)
    kwargs = dict(key_padding_mask=torch.cat([pad, pad[:, :2]], 1), need_weights=True)
    got = {}
    for kernel in ("explicit", "triton"):
        module = attention(kernel, "decoder_cross", reading)
        with recording():
            got[kernel] = module(x, memory, memory, **kwargs)
    assert len(fused_calls) == 1
    torch.testing.assert_close(got["triton"][0], got["explicit"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["triton"][1], got["explicit"][1].detach(), rtol=1e-5, atol=1e-6)
    assert got["triton"][1].shape == (B, T, T + 2)


def test_padding_never_leaks_through_the_fused_path():
    x, pad = inputs()
    module = attention("sdpa").eval()
    out1, _ = module(x, x, x, key_padding_mask=pad, need_weights=False)
    x2 = x.clone()
    x2[-2:, 0] = 50 * torch.randn(2, E)
    out2, _ = module(x2, x2, x2, key_padding_mask=pad, need_weights=False)
    torch.testing.assert_close(out1[:-2, 0], out2[:-2, 0])


def test_kernel_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_kernel("auto", cpu, need_weights=False, dropout_active=False) == "explicit"
    assert select_kernel("auto", cuda, need_weights=False, dropout_active=False) == "sdpa"
    assert select_kernel("auto", cuda, need_weights=True, dropout_active=False) == "explicit"
    assert select_kernel("auto", cuda, need_weights=False, dropout_active=True) == "explicit"
    assert select_kernel("sdpa", cpu, need_weights=False, dropout_active=True) == "sdpa"
    assert select_kernel("lowrank", cpu, need_weights=False, dropout_active=True) == "lowrank"
    assert select_kernel("lowrank", cuda, need_weights=True, dropout_active=False) == "explicit"
    assert select_kernel("sdpa", cpu, need_weights=True, dropout_active=False) == "explicit"
    assert select_kernel("explicit", cuda, need_weights=False, dropout_active=False) == "explicit"
    # the Triton kernel returns the weights itself (one more kernel, no gradient through them)
    assert select_kernel("triton", cuda, need_weights=True, dropout_active=True) == "triton"
    with pytest.raises(SDMAConfigError, match="--sdma-attention-kernel='flash'"):
        SDMAOptions(attention_kernel="flash").validate()


def test_fused_function_is_eq_11_with_the_additive_mask():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    mask = torch.rand(2, 3, 5, 5, generator=g) + 1e-6
    mix = torch.tensor(0.4)
    expected = mix_attention(q @ k.transpose(-1, -2), mask, mix) @ v
    torch.testing.assert_close(fused_mix_attention(q, k, v, mask, mix), expected, rtol=1e-5, atol=1e-6)
