"""``attach_sdma`` on T5: its relative position bias reaches the SDMA function as ``position_bias`` and is added to
the scores before eq. (1) (the core's ``score_bias``), in the encoder self-attention, the decoder self-attention and
the cross-attention."""

import copy

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from latent_core.sdma import SDMAConfigError, SDMACore
from transformers_plugin import attach_sdma, sdma_loss
from transformers_plugin import set_sdma_updates

from conftest import assert_same_step, parameter_gradients
from sdma_round_trip import save_and_reload
from sdma_training import assert_training_lowers_the_loss

SIZES = dict(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
             relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
             decoder_start_token_id=0, feed_forward_proj="relu")


def t5(seed=0, **overrides):
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(T5Config(**{**SIZES, **overrides}, attn_implementation="sdpa")).eval()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(2, 40, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, -3:] = 0
    labels = torch.randint(2, 40, (3, 7), generator=g)
    labels[2, -2:] = -100
    return {"input_ids": source, "attention_mask": mask, "labels": labels}


def test_the_three_attention_types_get_cores():
    model = attach_sdma(t5(), mode="sdma")
    groups = sorted(m.sdma_group for m in model.modules() if isinstance(m, SDMACore))
    assert groups == ["decoder_cross"] * 2 + ["decoder_self"] * 2 + ["encoder_self"] * 2


def test_mode_none_equals_the_unmodified_model():
    base = t5()
    attached = attach_sdma(copy.deepcopy(base), mode="none")
    torch.testing.assert_close(attached(**batch()).logits, base(**batch()).logits, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_at_g_zero_without_noise_training_equals_the_unmodified_model(reading):
    """g = 0 and sigma = 0: A_hat = A (eq. 11), so the attached model in training is T5 itself, position bias, causal
    and padding masks included (the bias dropped or a mask lost would change the logits)."""
    base = t5().train()
    attached = attach_sdma(copy.deepcopy(base), mode="sdma", reading=reading, noise_var=0.0).train()
    set_sdma_updates(attached, 0)
    got, want = attached(**batch()), base(**batch())
    real = batch()["labels"] != -100
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=2e-5, rtol=1e-4)
    assert float(sdma_loss(attached).abs()) > 0  # the regularisers are computed all the same


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_every_parameter_gets_a_gradient(reading):
    model = attach_sdma(t5(), mode="sdma", reading=reading).train()
    set_sdma_updates(model, 2000)
    (model(**batch()).loss + sdma_loss(model)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_training_lowers_the_loss():
    assert_training_lowers_the_loss(attach_sdma(t5(), mode="sdma", reading="authors"), batch)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_with_the_cache_equals_the_full_decoding(num_beams):
    model = attach_sdma(t5(), mode="sdma", reading="paper")
    set_sdma_updates(model, 3000)
    inputs = batch()
    with torch.no_grad():
        kwargs = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=6,
                      do_sample=False, num_beams=num_beams, output_scores=True, return_dict_in_generate=True)
        cached, full = model.generate(**kwargs, use_cache=True), model.generate(**kwargs, use_cache=False)
    assert torch.equal(cached.sequences, full.sequences)
    for a, b in zip(cached.scores, full.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["sdpa", "lowrank",
                                    pytest.param("triton", marks=pytest.mark.interpreter)])
def test_every_kernel_takes_the_position_bias_as_the_explicit_one(kernel):
    """Training loss and every gradient (the relative attention bias's through the score bias included) of the fused
    kernels equal the explicit kernel's, at g = 0.63 (``triton`` in Triton's interpreter here)."""
    results = []
    for name in ("explicit", kernel):
        model = attach_sdma(t5(), mode="sdma", reading="authors", noise_var=0.0, attention_kernel=name).train()
        for module in model.modules():
            if isinstance(module, SDMACore):
                module.perturb = lambda x, training, log_var=None: x  # no noise (the authors' variance is learned)
        set_sdma_updates(model, 2000)
        loss = model(**batch()).loss
        loss.backward()
        results.append((loss.detach(), parameter_gradients(model)))
    assert_same_step(*results, parameter="relative_attention_bias", rtol=1e-5, atol=1e-6)


def test_a_width_apart_from_the_heads_is_refused():
    with pytest.raises(SDMAConfigError, match="d_model = num_heads \\* d_kv"):
        attach_sdma(t5(d_kv=16), mode="sdma")


def test_save_pretrained_and_reload(tmp_path):
    model = attach_sdma(t5(), mode="sdma", reading="authors", clusters=3)
    set_sdma_updates(model, 1234)
    reloaded = save_and_reload(model, T5ForConditionalGeneration, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch()).logits, model.eval()(**batch()).logits, rtol=0, atol=0)


def test_each_cross_attention_reads_its_own_blocks_decoder_positions():
    model = attach_sdma(t5(), mode="sdma")
    for block in model.decoder.block:
        assert block.layer[1].EncDecAttention.sdma_state.partner is block.layer[0].SelfAttention
