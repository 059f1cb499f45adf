"""ESPnet's partially autoregressive decoding (``PartiallyARInference``, ``Speech2Text(partially_ar=...)``) on the
plugin's decoder: the batched forward over the masked positions with the cache and the source attention's
``expand_kv`` equal the decoder's full forward, and at g = 0 the decoding is ESPnet's decoder's."""

import pytest
import torch

pytest.importorskip("espnet2")

import espnet_plugin  # noqa: E402,F401
from espnet2.asr.ctc import CTC  # noqa: E402
from espnet2.asr.decoder.transformer_decoder import TransformerDecoder  # noqa: E402
from espnet2.asr.partially_AR_model import PartiallyARInference  # noqa: E402
from espnet_plugin.asr.decoder.sdma_transformer_decoder import SDMATransformerDecoder  # noqa: E402
from espnet_plugin.asr.sdma_attention import SDMAMultiHeadedAttention  # noqa: E402

VOCAB, WIDTH = 5, 8


def plugin_decoder(reading, mask_at_inference, updates=10_000, seed=0):
    torch.manual_seed(seed)
    decoder = SDMATransformerDecoder(VOCAB, WIDTH, attention_heads=2, linear_units=16, num_blocks=2,
                                     sdma_conf=dict(clusters=3, query_clusters=2, reading=reading,
                                                    mask_at_inference=mask_at_inference)).eval()
    for module in decoder.modules():
        if isinstance(module, SDMAMultiHeadedAttention):
            module.set_num_updates(updates)  # g = 0.9 at 10,000 updates: the masks matter
    return decoder


@pytest.mark.parametrize("reading", ["authors", "paper"])
@pytest.mark.parametrize("mask_at_inference", [True, False])
def test_partially_ar_scores_equal_the_full_forward(reading, mask_at_inference):
    """Four masked positions of one utterance (different prefix lengths), two steps with the cache: each
    position's log-probabilities equal the decoder's full forward of its prefix over the same encoder output."""
    decoder = plugin_decoder(reading, mask_at_inference)
    memory = torch.randn(1, 7, WIDTH, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    ys = torch.randint(0, VOCAB - 1, (4, 6), generator=g)
    ys[:, 0] = VOCAB - 1
    lengths = torch.tensor([3, 5, 2, 4])

    def full(prefix):
        out = decoder(memory, torch.tensor([7]), prefix[None], torch.tensor([prefix.numel()]))[0]
        return torch.log_softmax(out[0, -1], -1)

    with torch.no_grad():
        logp, states = decoder.batch_score_partially_AR(ys[:, :5], [None], memory, lengths)
        for n in range(4):
            torch.testing.assert_close(logp[n], full(ys[n, :lengths[n]]), rtol=1e-5, atol=1e-5)
        logp, _ = decoder.batch_score_partially_AR(ys, states, memory, lengths + 1)
        for n in range(4):
            torch.testing.assert_close(logp[n], full(ys[n, :lengths[n] + 1]), rtol=1e-5, atol=1e-5)


def partially_ar(decoder, ctc):
    return PartiallyARInference(ctc=ctc, decoder=decoder, threshold_probability=0.95, sos=VOCAB - 1,
                                eos=VOCAB - 1, mask_token=VOCAB, token_list=["<blank>", "<unk>", "a", "i", "<eos>"],
                                weights={"decoder": 1.0}, scorers={"decoder": decoder})


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_partially_ar_inference_runs_and_at_g_zero_is_espnets(reading, monkeypatch):
    """ESPnet's own partially-AR test with the plugin's decoder (random CTC and encoder outputs, 12 draws): the
    decoding reaches the decoder, and with g = 0 (the plain attention of eq. 1) its hypotheses are those of ESPnet's
    ``TransformerDecoder`` with the same weights."""
    calls = []
    original = SDMATransformerDecoder.batch_score_partially_AR

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SDMATransformerDecoder, "batch_score_partially_AR", counting)
    for seed in range(12):
        sdma = plugin_decoder(reading, True, updates=0, seed=seed)
        plain = TransformerDecoder(VOCAB, WIDTH, attention_heads=2, linear_units=16, num_blocks=2,
                                   use_flash_attn=False).eval()
        missing, unexpected = plain.load_state_dict(sdma.state_dict(), strict=False)
        assert not missing and all(".sdma." in key for key in unexpected)
        ctc = CTC(odim=VOCAB, encoder_output_size=WIDTH)
        enc_out = torch.randn(6, WIDTH, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            got, want = partially_ar(sdma, ctc)(enc_out), partially_ar(plain, ctc)(enc_out)
        assert [h.yseq.tolist() for h in got] == [h.yseq.tolist() for h in want], seed
    assert len(calls) >= 6  # most draws mask a token and decode it
