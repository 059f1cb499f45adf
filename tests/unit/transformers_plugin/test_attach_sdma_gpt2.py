"""``attach_sdma`` on a GPT-2 decoder: causal SDMA in training, ``generate()`` with its KV cache."""

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from latent_core.sdma import SDMAConfigError, SDMACore, SDMAOptions, collect_sdma_losses, recording
from transformers_plugin import attach_sdma
from transformers_plugin import set_sdma_updates

from sdma_round_trip import save_and_reload
from sdma_training import assert_training_lowers_the_loss

CONFIG = dict(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**CONFIG, attn_implementation="sdpa")).eval()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, -3:] = 0  # right padding
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("mode", ["none", "sdma"])
def test_off_equals_the_unmodified_model(mode):
    """mode none, or a decoder (mask off at inference): the plain model's logits and gradients."""
    base = gpt2()
    attached = attach_sdma(copy.deepcopy(base), mode=mode, reading="paper")
    set_sdma_updates(attached, 3000)
    results = {}
    for name, model in (("base", base), ("attached", attached)):
        model.zero_grad()
        out = model(**batch())
        out.loss.backward()
        results[name] = (out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None})
    real = batch()["attention_mask"].bool()
    torch.testing.assert_close(results["attached"][0][real], results["base"][0][real], atol=2e-6, rtol=1e-5)
    for name, grad in results["base"][1].items():
        torch.testing.assert_close(results["attached"][1][name], grad, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_training_trains_every_parameter_and_the_loss_drops(reading):
    model = attach_sdma(gpt2(), mode="sdma", reading=reading)
    assert {core.sdma_group for core in model.modules() if isinstance(core, SDMACore)} == {"decoder_self"}
    assert_training_lowers_the_loss(model, batch, steps=40, every_parameter_gets_a_gradient=True)


def test_generate_with_the_cache_equals_the_full_forward():
    model = attach_sdma(gpt2(), mode="sdma", reading="paper")
    set_sdma_updates(model, 3000)
    prompt = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True,
                                output_scores=True, return_dict_in_generate=True)
        full = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False,
                              output_scores=True, return_dict_in_generate=True)
    assert torch.equal(cached.sequences, full.sequences)
    for a, b in zip(cached.scores, full.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_decoder_mask_at_inference_generates_with_the_cache_as_without(num_beams):
    model = attach_sdma(gpt2(), mode="sdma", reading="paper", decoder_mask_at_inference=True)
    set_sdma_updates(model, 3000)
    prompt = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        kwargs = dict(max_new_tokens=4, do_sample=False, num_beams=num_beams, output_scores=True,
                      return_dict_in_generate=True)
        cached, full = model.generate(prompt, **kwargs, use_cache=True), model.generate(prompt, **kwargs, use_cache=False)
        logits = model(cached.sequences[:1]).logits
        plain = gpt2()(cached.sequences[:1]).logits
    assert torch.equal(cached.sequences, full.sequences)
    for a, b in zip(cached.scores, full.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (logits - plain).abs().max() > 1e-4  # the mask is applied at inference
    if num_beams == 1:
        assert torch.equal(cached.sequences[0, 4:], logits[0, 3:-1].argmax(-1))


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_same_reading_as_the_fairseq_adapter(reading, monkeypatch):
    """A causal GPT-2 attention in training equals the fairseq adapter's decoder self-attention on the same weights,
    input and (element-wise) noise: outputs and the regularisers of eq. (20)-(23)."""
    from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention

    model = attach_sdma(gpt2(), mode="sdma", reading=reading)
    set_sdma_updates(model, 3000)
    hf = model.transformer.h[0].attn
    fs = SDMAMultiheadAttention(32, 4, sdma=SDMAOptions(mode="sdma", reading=reading), group="decoder_self",
                                self_attention=True, dropout=0.0)
    fs.sdma.load_state_dict(hf.sdma.state_dict())
    with torch.no_grad():
        weight, bias = hf.c_attn.weight, hf.c_attn.bias  # Conv1D: x @ weight + bias, q | k | v
        for i, proj in enumerate((fs.q_proj, fs.k_proj, fs.v_proj)):
            proj.weight.copy_(weight[:, 32 * i:32 * (i + 1)].t())
            proj.bias.copy_(bias[32 * i:32 * (i + 1)])
        fs.out_proj.weight.copy_(hf.c_proj.weight.t())
        fs.out_proj.bias.copy_(hf.c_proj.bias)
    monkeypatch.setattr(SDMACore, "perturb",
                        lambda self, value, training, log_var=None: value + 0.1 * torch.sin(7 * value) if training else value)
    x = torch.randn(3, 9, 32, generator=torch.Generator().manual_seed(1))
    valid = batch()["attention_mask"].bool()
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    model.train()
    fs.train()
    with recording() as hf_records:
        got, _ = hf(x, attention_mask=(causal[None, None] & valid[:, None, None, :]))
    future = torch.zeros(9, 9).masked_fill(~causal, float("-inf"))
    with recording() as fs_records:
        want, _ = fs(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), key_padding_mask=~valid,
                     attn_mask=future)
    torch.testing.assert_close(got[valid], want.transpose(0, 1)[valid], atol=1e-5, rtol=1e-4)
    hf_terms, fs_terms = collect_sdma_losses(hf, hf_records), collect_sdma_losses(fs, fs_records)
    for name, value in fs_terms.items():
        torch.testing.assert_close(hf_terms[name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_save_pretrained_and_reload(tmp_path):
    """The options go into the config, the cores' parameters into the weights; the reloaded model is the same."""
    from transformers_plugin import from_pretrained_with_sdma

    model = attach_sdma(gpt2(), mode="sdma", reading="authors", clusters=3, decoder_mask_at_inference=True)
    set_sdma_updates(model, 1234)
    reloaded = save_and_reload(model, GPT2LMHeadModel, tmp_path)
    assert reloaded.config.sdma["clusters"] == 3 and reloaded.config._attn_implementation == "sdma"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch()).logits, model.eval()(**batch()).logits, rtol=0, atol=0)
    plain = tmp_path / "plain"
    gpt2().save_pretrained(plain)
    with pytest.raises(SDMAConfigError, match="no 'sdma' entry"):
        from_pretrained_with_sdma(GPT2LMHeadModel, plain)



@pytest.mark.parametrize("reading", ["authors", "paper"])
@pytest.mark.parametrize("padding", [False, True])
def test_training_forward_does_not_see_the_future(reading, padding):
    """Changing a later token leaves the earlier positions' logits alone. Without padding transformers hands the
    attention no mask at all (sdpa's is_causal flag carries causality), which the SDMA function must not read as
    'attend everywhere'."""
    model = attach_sdma(gpt2(), mode="sdma", reading=reading, noise_var=0.0)
    set_sdma_updates(model, 3000)
    model.train()
    inputs = batch()
    mask = inputs["attention_mask"] if padding else torch.ones_like(inputs["attention_mask"])
    changed = inputs["input_ids"].clone()
    changed[:, 5] = (changed[:, 5] + 1 - 3) % 37 + 3
    with torch.no_grad():
        before = model(input_ids=inputs["input_ids"], attention_mask=mask).logits
        after = model(input_ids=changed, attention_mask=mask).logits
    torch.testing.assert_close(after[:, :5], before[:, :5], atol=1e-6, rtol=1e-6)
    assert (after[:, 5:] - before[:, 5:]).abs().max() > 1e-4
