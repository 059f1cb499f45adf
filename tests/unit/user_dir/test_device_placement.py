"""No tensor of the plugin's own computations is created on a fixed device.

The plugin's modules run on fake CUDA tensors (``torch._subclasses.FakeTensorMode``: shapes, dtypes
and devices without memory, no GPU needed). A tensor made without ``device=`` (``torch.zeros(n)``)
is a CPU tensor there, and any operation mixing it with the module's CUDA tensors raises, as on a
real GPU (0-dim CPU tensors are scalars to PyTorch on either). Forward passes only: the autograd
engine needs a real CUDA context (the GPU tier, ``tests/gpu``, runs the backward passes).

Covered: fairseq's SDMA attention (three attention types, both readings, the three kernels,
training and inference, one incremental decoding step) with the regularisers and diagnostics;
ESPnet's SDMA attention (both readings, three types); the VAE estimators (posterior sampling, KL
thresholds, importance-weighted bound; MI and active units return Python numbers, i.e. read values,
which fake tensors cannot: ``vae-eval`` on a GPU runs them, in ``make gpu-check``). The last test
plants a ``torch.zeros(n)`` without ``device=`` and shows that the harness catches it.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import espnet_plugin  # noqa: F401
from espnet_plugin.asr.sdma_attention import SDMAMultiHeadedAttention
from latent_core.sdma import SDMAOptions, collect_sdma_losses, real_queries, recording
from latent_core.vae.distributions import DiagonalGaussian
from latent_core.vae.evaluation import importance_weighted_log_likelihood
from latent_core.vae.kl import KLRegularizer
from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention

E, H, T, B = 32, 4, 7, 3


def on_fake_cuda(mode, module):
    """``module``'s parameters and buffers as fake CUDA tensors of ``mode`` (shared ones stay shared)."""
    fake = {}
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for t in store.values():
                if t is not None and id(t) not in fake:
                    fake[id(t)] = mode.from_tensor(t.detach())
    with mode:
        fake = {key: t.to("cuda") for key, t in fake.items()}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(fake[id(p)], requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = fake[id(b)]
    return module


def fake_inputs(mode, *tensors):
    fakes = [mode.from_tensor(t) for t in tensors]
    with mode:
        return [t.to("cuda") for t in fakes]


def assert_cuda(*tensors):
    for t in tensors:
        assert t.device.type == "cuda", t.device


def fairseq_attention(group, reading, kernel):
    torch.manual_seed(0)
    module = SDMAMultiheadAttention(
        E, H, sdma=SDMAOptions(clusters=3, query_clusters=2, reading=reading, attention_kernel=kernel),
        group=group, self_attention=group != "decoder_cross", encoder_decoder_attention=group == "decoder_cross")
    module.set_num_updates(1000)
    return module


@pytest.mark.parametrize("kernel", ["explicit", "sdpa", "lowrank"])
@pytest.mark.parametrize("reading", ["authors", "paper"])
@pytest.mark.parametrize("group", ["encoder_self", "decoder_self", "decoder_cross"])
def test_fairseq_sdma_attention_and_regularisers_stay_on_the_device(group, reading, kernel):
    mode = FakeTensorMode()
    module = on_fake_cuda(mode, fairseq_attention(group, reading, kernel).train())
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -2:] = True
    x, pad, memory, future = fake_inputs(mode, torch.randn(T, B, E), pad, torch.randn(T + 2, B, E),
                                         torch.triu(torch.full((T, T), float("-inf")), 1))
    with mode, recording() as records:
        if group == "decoder_cross":
            with real_queries(~pad):
                out, _ = module(x, memory, memory, key_padding_mask=torch.cat([pad, pad[:, :2]], 1),
                                need_weights=False)
        elif group == "decoder_self":
            out, _ = module(x, x, x, attn_mask=future, need_weights=False)
        else:
            out, _ = module(x, x, x, key_padding_mask=pad, need_weights=False)
        diagnostics = {}
        terms = collect_sdma_losses(module, records, diagnostics)
        assert_cuda(out, *terms.values(), *diagnostics.values())
        module.eval()
        out, weights = module(x, x, x, need_weights=True) if group != "decoder_cross" else \
            module(x, memory, memory, need_weights=True)
        assert_cuda(out, weights)


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_fairseq_incremental_decoding_step_stays_on_the_device(reading):
    mode = FakeTensorMode()
    module = on_fake_cuda(mode, fairseq_attention("decoder_self", reading, "explicit").eval())
    (x,) = fake_inputs(mode, torch.randn(1, B, E))
    state = {}
    with mode:
        for _ in range(2):
            out, _ = module(x, x, x, incremental_state=state, need_weights=False)
        assert_cuda(out)


@pytest.mark.parametrize("reading", ["authors", "paper"])
@pytest.mark.parametrize("group", ["encoder_self", "decoder_self", "decoder_cross"])
def test_espnet_sdma_attention_stays_on_the_device(group, reading):
    torch.manual_seed(0)
    module = SDMAMultiHeadedAttention(2, 16, 0.1, group=group, sdma=SDMAOptions(
        clusters=3, query_clusters=2, reading=reading))
    module.set_num_updates(1000)
    mode = FakeTensorMode()
    on_fake_cuda(mode, module.train())
    mask = torch.ones(2, 1, 6, dtype=torch.bool)
    mask[1, :, 4:] = False
    if group == "decoder_self":
        mask = mask & torch.tril(torch.ones(6, 6, dtype=torch.bool))[None]
    x, memory, mask = fake_inputs(mode, torch.randn(2, 6, 16), torch.randn(2, 6, 16), mask)
    with mode, recording() as records:
        key = memory if group == "decoder_cross" else x
        with real_queries(torch.ones(2, 6, dtype=torch.bool, device=x.device)):
            out = module(x, key, key, mask)
        terms = collect_sdma_losses(module, records, combine="module_mean")
        assert_cuda(out, *terms.values())


def test_vae_estimators_stay_on_the_device():
    mode = FakeTensorMode()
    mean, logvar, tokens = fake_inputs(mode, torch.randn(5, 8), torch.randn(5, 8), torch.randn(5))
    with mode:
        posterior = DiagonalGaussian(mean, logvar)
        z = posterior.rsample(3)
        assert_cuda(z, posterior.log_prob(z), posterior.kl_standard_normal())
        for variant in ("beta", "free_bits", "hinge"):  # the thresholds (its finiteness check reads values)
            assert_cuda(KLRegularizer(variant=variant, threshold=0.1)._threshold(posterior.kl_standard_normal()))

        def log_likelihood(samples):  # [n, B]: a stand-in decoder that depends on z
            return -(samples["z"] ** 2).sum(-1) + tokens

        assert_cuda(importance_weighted_log_likelihood(log_likelihood, {"z": posterior}, num_samples=4,
                                                       chunk_size=2))


def test_a_planted_cpu_tensor_is_caught(monkeypatch):
    """A ``torch.zeros(S)`` without ``device=`` in the mixing of eq. (11) fails the harness."""
    from latent_core.sdma import attention

    original = attention.mix_attention

    def planted(scores, mask, mix, norm_floor=0.0):
        return original(scores, mask, mix, norm_floor) + torch.zeros(scores.size(-1))

    monkeypatch.setattr(attention, "mix_attention", planted)  # the explicit kernel of the core's entry point
    with pytest.raises(RuntimeError, match="device"):
        test_fairseq_sdma_attention_and_regularisers_stay_on_the_device("encoder_self", "paper", "explicit")
