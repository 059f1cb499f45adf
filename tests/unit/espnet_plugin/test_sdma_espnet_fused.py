"""ESPnet's SDMA attention: the fused paths (``sdma_conf: {attention_kernel: sdpa}`` and ``lowrank``) equal the
explicit one (and ``triton``, in Triton's interpreter here)."""

import pytest
import torch

import espnet_plugin  # noqa: F401  (registers the classes)
from espnet_plugin.asr.sdma_attention import SDMAMultiHeadedAttention
from latent_core.sdma import SDMAOptions, recording, sdma_losses


def attention(kernel, group="encoder_self", reading="authors"):
    torch.manual_seed(0)
    module = SDMAMultiHeadedAttention(2, 16, 0.0, group=group, sdma=SDMAOptions(
        clusters=3, query_clusters=2, noise_var=0.0, attention_kernel=kernel, reading=reading))
    module.sdma.perturb = lambda x, training, log_var=None: x  # no noise (the authors' variance is learned)
    module.set_num_updates(2000)
    return module.train()


@pytest.mark.parametrize("reading", ["authors", "paper"])
@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
def test_fused_training_forward_and_gradients_equal_the_explicit_path(masking, reading):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 16, generator=g)
    mask = torch.ones(2, 1, 6, dtype=torch.bool)
    mask[1, :, 4:] = False
    if masking == "causal":
        mask = mask & torch.tril(torch.ones(6, 6, dtype=torch.bool))[None]
    elif masking == "none":  # every key allowed (the authors reading's normaliser over all keys)
        mask = None
    results = []
    for kernel in ("explicit", "sdpa", "lowrank", "triton"):
        module = attention(kernel, reading=reading)
        inp = x.clone().requires_grad_(True)
        with recording() as records:
            out = module(inp, inp, inp, mask)
        losses = sdma_losses([(module.sdma, records.get(module.sdma))])
        (out.pow(2).sum() + sum(v.sum() for v in losses.values())).backward()
        results.append((out.detach(), inp.grad, {n: p.grad for n, p in module.named_parameters()},
                        module.attn))
    out_e, gx_e, grads_e, attn_e = results[0]
    assert attn_e is not None
    # the key bias's gradient is zero in exact arithmetic (a softmax ignores a constant per row): in
    # float32 it is rounding noise, so absolute errors are measured against the largest gradient
    atol = max(1e-5, 1e-6 * max(float(grad.abs().max()) for grad in grads_e.values()))
    for out_f, gx_f, grads_f, attn_f in results[1:]:
        assert attn_f is None  # the fused paths keep no weights
        torch.testing.assert_close(out_f, out_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gx_f, gx_e, rtol=1e-4, atol=1e-5)
        for name in grads_e:
            torch.testing.assert_close(grads_f[name], grads_e[name], rtol=1e-4, atol=atol, msg=name)


def test_evaluation_keeps_the_weights_for_espnet_attention_plots():
    module = attention("sdpa").eval()
    x = torch.randn(1, 5, 16)
    module(x, x, x, None)
    assert module.attn is not None and module.attn.shape == (1, 2, 5, 5)
