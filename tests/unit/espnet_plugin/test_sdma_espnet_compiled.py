"""ESPnet's SDMA attention on the compiled path (``sdma_conf: {compile: true}``) in the authors reading (learned
noise variances): outputs, regularisers and every gradient equal eager, over batches of new lengths, without
recompiling. ``fallback_random``: inductor draws eager's random numbers, so noise and dropout are the same."""

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

from espnet_plugin.asr.sdma_attention import SDMAMultiHeadedAttention
from latent_core.sdma import SDMAOptions, recording, sdma_losses

HEADS, WIDTH = 2, 16
LENGTHS = [(5, 7), (8, 4), (6, 9)]  # (T1 queries, T2 keys of the cross-attention)


def masks(group, batch, t1, t2):
    lengths = torch.tensor([t1, t1 - 2])
    if group == "encoder_self":
        return (torch.arange(t1)[None] < lengths[:, None])[:, None, :]  # (B, 1, T1)
    if group == "decoder_self":
        pad = torch.arange(t1)[None] < lengths[:, None]
        return pad[:, None, :] & torch.ones(t1, t1, dtype=torch.bool).tril()[None]  # (B, T1, T1)
    return (torch.arange(t2)[None] < torch.tensor([t2, t2 - 1])[:, None])[:, None, :]  # (B, 1, T2)


def step(module, x, key, mask, seed):
    torch.manual_seed(seed)
    module.zero_grad(set_to_none=True)
    with recording() as records:
        out = module(x, key, key, mask)
    terms = sdma_losses([(module.sdma, records.get(module.sdma))])
    loss = (out * torch.linspace(-1, 1, out.size(-1))).sum() + sum(t.sum() for t in terms.values())
    loss.backward()
    return out.detach(), {k: v.detach() for k, v in terms.items()}, {
        name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("group", ["encoder_self", "decoder_self", "decoder_cross"])
def test_compiled_equals_eager_and_does_not_recompile(group):
    def build(compile):  # the same seed: the same weights
        torch.manual_seed(0)
        return SDMAMultiHeadedAttention(HEADS, WIDTH, 0.1, group=group,
                                        sdma=SDMAOptions(clusters=4, query_clusters=4, compile=compile))

    eager, compiled = build(False), build(True)
    if group == "decoder_cross":
        # inductor draws a cross-attention's three noise tensors in another order than eager (the same
        # distributions, other numbers): their learned variances are made negligible here
        for module in (eager, compiled):
            for head in (module.sdma.noise_log_var, module.sdma.key_noise_log_var, module.sdma.query_noise_log_var):
                torch.nn.init.constant_(head.bias, -30.0)
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values()):
        assert torch.equal(a, b), name
    eager.train(), compiled.train()
    graphs = []
    with inductor_config.patch(fallback_random=True):
        for seed, (t1, t2) in enumerate(LENGTHS):
            x = torch.randn(2, t1, WIDTH)
            key = x if group != "decoder_cross" else torch.randn(2, t2, WIDTH)
            mask = masks(group, 2, t1, t2)
            out_e, terms_e, grads_e = step(eager, x, key, mask, seed)
            out_c, terms_c, grads_c = step(compiled, x, key, mask, seed)
            torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
            for name in terms_e:
                torch.testing.assert_close(terms_c[name], terms_e[name], rtol=1e-4, atol=1e-5)
            assert grads_c.keys() == grads_e.keys()
            largest = max(float(g.abs().max()) for g in grads_e.values())
            for name, grad in grads_e.items():
                torch.testing.assert_close(grads_c[name], grad, rtol=1e-3, atol=1e-5 * largest,
                                           msg=lambda text, name=name: f"{name}: {text}")
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1], f"recompiled for new lengths: {graphs}"
    assert compiled.sdma.noise_log_var.weight.grad is not None  # the authors' learned variances train
