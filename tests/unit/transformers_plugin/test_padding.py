"""Padding on either side never reaches a real position, in both readings, for every family that has a causal
self-attention: at g = 0 without noise SDMA is the vanilla model on the real positions (train and eval, the mask kept
at inference), and at g > 0 changing the padding's token ids moves no real logit. The authors' causal reading masks
the future only (their decoder's mask, which with right padding also blocks every padding key of a real query); left
padding puts padding keys in the past, which the adapter blocks as well."""

import copy

import pytest
import torch
from transformers import (BartConfig, BartForConditionalGeneration, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          T5Config, T5ForConditionalGeneration)

import transformers_plugin.attention as sdma_attention_module
from transformers_plugin import attach_sdma, set_sdma_updates

DECODER = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, bos_token_id=1,
               eos_token_id=2, pad_token_id=0)


def build(family):
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**DECODER))
    if family == "mistral":  # a window shorter than the batch: the window and the padding together
        return MistralForCausalLM(MistralConfig(**DECODER, sliding_window=4))
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**DECODER))
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0))
    if family == "bart":
        return BartForConditionalGeneration(BartConfig(
            vocab_size=40, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, decoder_start_token_id=2))
    return T5ForConditionalGeneration(T5Config(
        vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, decoder_start_token_id=0))


FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "bart", "t5")
SEQ2SEQ = ("bart", "t5")


def padded_batch(family, side, pad_id=0):
    """Three rows of 9 tokens, rows 1 and 2 padded on ``side`` (the decoder's side for BART and T5)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    pads = {1: 3, 2: 5}
    for row, count in pads.items():
        if side == "left":
            mask[row, :count] = 0
        else:
            mask[row, -count:] = 0
    ids = ids.masked_fill(mask == 0, pad_id)
    if family in SEQ2SEQ:
        source = torch.randint(3, 40, (3, 6), generator=g)
        return {"input_ids": source, "attention_mask": torch.ones_like(source), "decoder_input_ids": ids,
                "decoder_attention_mask": mask}, mask.bool()
    return {"input_ids": ids, "attention_mask": mask}, mask.bool()


def logits(model, inputs, train):
    model.train(train)
    with torch.no_grad():
        return model(**inputs).logits


def attached(family, reading, updates):
    model = attach_sdma(copy.deepcopy(build(family)), mode="sdma", reading=reading, noise_var=0.0,
                        decoder_mask_at_inference=True)
    set_sdma_updates(model, updates)
    return model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_padding_reaches_no_real_position(family, side, reading):
    vanilla = build(family)
    at_zero, at_g = attached(family, reading, 0), attached(family, reading, 3000)
    inputs, real = padded_batch(family, side)
    other_pads, _ = padded_batch(family, side, pad_id=7)
    for train in (True, False):
        # g = 0 without noise: eq. (11) is plain attention, so SDMA is the vanilla model on the real positions
        torch.testing.assert_close(logits(at_zero, inputs, train)[real], logits(vanilla, inputs, train)[real],
                                   atol=2e-5, rtol=1e-4)
        # g > 0: the semantic mask is on, and the padding's ids still reach no real position
        masked = logits(at_g, inputs, train)
        torch.testing.assert_close(logits(at_g, other_pads, train)[real], masked[real], atol=2e-5, rtol=1e-4)
    assert (masked[real] - logits(vanilla, inputs, False)[real]).abs().max() > 1e-4  # the mask is on


@pytest.mark.parametrize("family", ["llama", "gpt2", "bart"])
def test_a_dropped_padding_mask_is_caught(family, monkeypatch):
    """The check above fails where the authors' causal reading drops transformers' mask for the future mask alone
    (the defect left padding exposed)."""
    monkeypatch.setattr(sdma_attention_module, "_padding_before_real_keys",
                        lambda allowed: torch.zeros_like(allowed[..., :1, :]))
    model = attached(family, "authors", 3000)
    inputs, real = padded_batch(family, "left")
    other_pads, _ = padded_batch(family, "left", pad_id=7)
    moved = (logits(model, other_pads, True)[real] - logits(model, inputs, True)[real]).abs().max()
    assert moved > 1e-3
