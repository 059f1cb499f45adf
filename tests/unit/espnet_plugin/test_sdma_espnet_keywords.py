"""A transformer config carries over: the plugin's encoder and decoder take every keyword of ESPnet's
``TransformerEncoder`` / ``TransformerDecoder`` with ESPnet's defaults (``use_flash_attn`` excepted, by
design), ``qk_norm`` reaches SDMA's scores, ``use_flash_attn: true`` is refused under SMA/SDMA by name,
and ``gradient_checkpoint_layers`` trains the same decoder (loss and every gradient)."""

import inspect

import pytest
import torch
from espnet2.asr.decoder.transformer_decoder import TransformerDecoder
from espnet2.asr.encoder.transformer_encoder import TransformerEncoder
from espnet.nets.pytorch_backend.transformer.layer_norm import LayerNorm

import espnet_plugin  # noqa: F401  (registers the classes)
from espnet_plugin.asr.decoder.sdma_transformer_decoder import SDMATransformerDecoder
from espnet_plugin.asr.encoder.sdma_transformer_encoder import SDMATransformerEncoder
from espnet_plugin.asr.sdma_attention import ESPnetConfigError, SDMAMultiHeadedAttention
from latent_core.sdma import collect_sdma_losses, recording

# ESPnet's default True means "flash attention where installed"; here None = that for mode none, off
# for SMA/SDMA (flash_attn has no semantic mask), so that a default config never hits the refusal.
DIFFERENT_ON_PURPOSE = {"use_flash_attn"}


@pytest.mark.parametrize("ours,espnets", [(SDMATransformerEncoder, TransformerEncoder),
                                          (SDMATransformerDecoder, TransformerDecoder)])
def test_every_espnet_keyword_is_accepted_with_espnets_default(ours, espnets):
    mine = inspect.signature(ours.__init__).parameters
    for name, param in inspect.signature(espnets.__init__).parameters.items():
        assert name in mine, f"{ours.__name__} does not accept {name}"
        if name not in DIFFERENT_ON_PURPOSE:
            assert mine[name].default == param.default, (name, mine[name].default, param.default)
    assert mine["linear_units"].default == 2048


def test_qk_norm_normalises_sdmas_queries_and_keys():
    kwargs = dict(input_size=20, output_size=32, attention_heads=2, linear_units=64, num_blocks=1,
                  input_layer="linear", sdma_conf={"clusters": 3, "query_clusters": 2})
    torch.manual_seed(0)
    normed = SDMATransformerEncoder(**kwargs, qk_norm=True).eval()
    attention = normed.encoders[0].self_attn
    assert isinstance(attention, SDMAMultiHeadedAttention) and isinstance(attention.q_norm, LayerNorm)
    plain = SDMATransformerEncoder(**kwargs).eval()
    plain.load_state_dict(normed.state_dict(), strict=False)
    with torch.no_grad():
        attention.q_norm.weight.fill_(3.0)  # a LayerNorm that is not the identity at init
    x, lengths = torch.randn(2, 9, 20), torch.tensor([9, 7])
    with torch.no_grad():
        assert not torch.allclose(normed(x, lengths)[0], plain(x, lengths)[0], atol=1e-4)


def test_flash_attention_is_refused_under_sdma_and_passed_on_under_mode_none():
    common = dict(input_size=20, output_size=32, attention_heads=2, linear_units=64, num_blocks=1)
    with pytest.raises(ESPnetConfigError, match=r"encoder_conf.use_flash_attn=true: flash_attn's kernels cannot"):
        SDMATransformerEncoder(**common, use_flash_attn=True)
    with pytest.raises(ESPnetConfigError, match=r"decoder_conf.use_flash_attn=true"):
        SDMATransformerDecoder(vocab_size=13, encoder_output_size=32, attention_heads=2, linear_units=64,
                               num_blocks=1, use_flash_attn=True)
    SDMATransformerEncoder(**common, use_flash_attn=True, sdma_conf={"mode": "none"})
    SDMATransformerEncoder(**common, use_flash_attn=False)


def decoder_step(checkpoint_layers, reading):
    torch.manual_seed(0)
    decoder = SDMATransformerDecoder(vocab_size=13, encoder_output_size=32, attention_heads=2, linear_units=64,
                                     num_blocks=2, dropout_rate=0.1, self_attention_dropout_rate=0.1,
                                     gradient_checkpoint_layers=checkpoint_layers,
                                     sdma_conf=dict(clusters=3, query_clusters=2, reading=reading)).train()
    for module in decoder.modules():
        if isinstance(module, SDMAMultiHeadedAttention):
            module.set_num_updates(2000)
    g = torch.Generator().manual_seed(1)
    memory = torch.randn(3, 8, 32, generator=g)
    ys = torch.randint(0, 13, (3, 6), generator=g)
    lengths = torch.tensor([6, 4, 5])
    torch.manual_seed(5)  # the same noise and dropout in both runs
    with recording() as records:
        out, _ = decoder(memory, torch.tensor([8, 8, 6]), ys, lengths)
    terms = collect_sdma_losses(decoder, records, combine="module_mean")
    loss = out.pow(2).mean() + sum(v.sum() for v in terms.values())
    recorded = {id(m.sdma): records.get(m.sdma) for m in decoder.modules() if isinstance(m, SDMAMultiHeadedAttention)}
    loss.backward()
    # the recomputation in backward recorded nothing: the first pass's records are still there
    assert all(records.get(m.sdma) is recorded[id(m.sdma)] for m in decoder.modules()
               if isinstance(m, SDMAMultiHeadedAttention))
    return loss.detach(), {n: p.grad.clone() for n, p in decoder.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_gradient_checkpoint_layers_train_the_same_decoder(reading):
    loss_a, grads_a = decoder_step([], reading)
    loss_b, grads_b = decoder_step([1, 2], reading)
    torch.testing.assert_close(loss_b, loss_a)
    assert grads_a.keys() == grads_b.keys() and any("query_gmm" in n for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_checkpoint_layers_outside_the_decoder_are_refused():
    with pytest.raises(ESPnetConfigError, match=r"gradient_checkpoint_layers=\[3\]: layer 3 is not one of 1..2"):
        SDMATransformerDecoder(vocab_size=13, encoder_output_size=32, attention_heads=2, linear_units=64,
                               num_blocks=2, gradient_checkpoint_layers=[3])
