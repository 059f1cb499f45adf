"""``attach_sdma`` on Llama-family decoders (Llama, Mistral, Qwen2): rotary embeddings, grouped-query attention, causal
SDMA in training, ``generate()`` with its KV cache."""

import copy

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from latent_core.sdma import SDMAConfigError, SDMACore, sdma_attention
from transformers_plugin import attach_sdma, sdma_loss
from transformers_plugin import set_sdma_updates

from sdma_round_trip import save_and_reload
from sdma_training import assert_training_lowers_the_loss

SIZES = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=False)
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def decoder(family="llama", seed=0, **overrides):
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(seed)
    return model_class(config_class(**{**SIZES, **overrides}, attn_implementation="sdpa")).eval()


def batch(seed=0, left_padding=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    if left_padding:
        mask[1, :3] = 0  # decoders are padded on the left for generation
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def deterministic_noise(self, value, training, log_var=None):
    return value + 0.1 * torch.sin(7 * value) if training else value


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("mode", ["none", "sdma"])
def test_off_equals_the_unmodified_model(family, mode):
    """mode none, or a decoder in evaluation (mask off at inference): the plain model's logits and gradients."""
    base = decoder(family)
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_training_trains_every_parameter_and_the_loss_drops(family, reading):
    model = attach_sdma(decoder(family), mode="sdma", reading=reading)
    assert {core.sdma_group for core in model.modules() if isinstance(core, SDMACore)} == {"decoder_self"}
    assert_training_lowers_the_loss(model, batch, every_parameter_gets_a_gradient=True)


@pytest.mark.parametrize("reading", ["authors", "paper"])
@pytest.mark.parametrize("padding", [False, True])
def test_training_forward_does_not_see_the_future(reading, padding, monkeypatch):
    """Changing a later token leaves the earlier positions' logits alone, with and without a padding mask (without
    one transformers hands the attention no mask, leaving causality to sdpa's is_causal flag)."""
    monkeypatch.setattr(SDMACore, "perturb", deterministic_noise)
    model = attach_sdma(decoder(), mode="sdma", reading=reading)
    set_sdma_updates(model, 3000)
    model.train()
    inputs = batch(left_padding=padding)
    changed = inputs["input_ids"].clone()
    changed[:, 6] = (changed[:, 6] + 1 - 3) % 37 + 3
    with torch.no_grad():
        before = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        after = model(input_ids=changed, attention_mask=inputs["attention_mask"]).logits
    real = inputs["attention_mask"].bool()[:, :6]
    torch.testing.assert_close(after[:, :6][real], before[:, :6][real], atol=1e-6, rtol=1e-6)
    assert (after[:, 6:] - before[:, 6:]).abs().max() > 1e-4


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_a_shared_key_value_head_equals_its_copies(reading, monkeypatch):
    """Grouped-query attention: 4 query heads over 2 key/value heads equal 4 query heads over 4 key/value heads whose
    weights are the shared heads' copies: each query head masks its group's key/value head with its own
    responsibilities (outputs, regularisers and every gradient of the shared weights)."""
    monkeypatch.setattr(SDMACore, "perturb", deterministic_noise)
    grouped = attach_sdma(decoder(num_key_value_heads=2), mode="sdma", reading=reading)
    full = attach_sdma(decoder(num_key_value_heads=4), mode="sdma", reading=reading)
    copied = {}
    for name, tensor in grouped.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # [2 heads * 8, 32] -> [4 heads * 8, 32]
            tensor = tensor.view(2, 1, 8, 32).expand(2, 2, 8, 32).reshape(32, 32)
        copied[name] = tensor
    full.load_state_dict(copied)
    results = []
    for model in (grouped, full):
        set_sdma_updates(model, 3000)
        model.train()
        out = model(**batch())
        regulariser = sdma_loss(model)
        (out.loss + regulariser).backward()
        results.append((out.logits.detach(), regulariser.detach(), model))
    real = batch()["attention_mask"].bool()
    torch.testing.assert_close(results[1][0][real], results[0][0][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-6, rtol=1e-5)
    for name, parameter in grouped.named_parameters():
        grad = dict(full.named_parameters())[name].grad
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # a shared head gathers its copies' gradients
            grad = grad.view(2, 2, 8, 32).sum(1).reshape(16, 32)
        torch.testing.assert_close(parameter.grad, grad, atol=1e-5, rtol=1e-4, msg=name)


def test_authors_reading_rotates_the_noisy_queries(monkeypatch):
    """Authors reading, one layer by hand: q = rot(W_q z) (then its second draw), k = rot(W_k x), v = W_v x, the
    clustering of z (c_g = 10, the default), the future masked: the attached layer's output."""
    monkeypatch.setattr(SDMACore, "perturb", deterministic_noise)
    model = attach_sdma(decoder(num_key_value_heads=4), mode="sdma", reading="authors")
    set_sdma_updates(model, 3000)
    model.train()
    attention = model.model.layers[0].self_attn
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(7)[None].expand(2, 7)
    cos, sin = model.model.rotary_emb(x, positions)
    got, _ = attention(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)

    core = attention.sdma
    heads = lambda t: t.view(2, 7, 4, 8).transpose(1, 2)  # noqa: E731
    z = deterministic_noise(None, x, True)
    query, key = apply_rotary_pos_emb(heads(attention.q_proj(z)), heads(attention.k_proj(x)), cos, sin)
    query = deterministic_noise(None, query * 8 ** -0.5, True)
    assert core.clustering_scale == 1.0
    _, log_resp = core.cluster(z)  # [B, T, H, C]
    resp = log_resp.exp().transpose(1, 2)
    future = torch.ones(7, 7, dtype=torch.bool).triu(1)[None, None]
    want, _ = sdma_attention(query, key, heads(attention.v_proj(x)), resp, resp, core.mix_weight, authors=True,
                             blocked=future, kernel="explicit", need_weights=False, dropout=lambda a: a, dropout_p=0.0)
    want = attention.o_proj(want.transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_sliding_window_is_kept():
    """Mistral with a window shorter than the sentence: in training a query does not see the keys before its window
    (the earliest token changes, positions beyond the window stay)."""
    model = attach_sdma(decoder("mistral", sliding_window=3), mode="sdma", reading="paper", noise_var=0.0)
    set_sdma_updates(model, 3000)
    model.train()
    ids = batch(left_padding=False)["input_ids"]
    changed = ids.clone()
    changed[:, 0] = (changed[:, 0] + 1 - 3) % 37 + 3
    with torch.no_grad():
        # one layer: with more, a position's hidden state carries earlier tokens beyond the window
        model.model.layers = model.model.layers[:1]
        before, after = model(ids).logits, model(changed).logits
    torch.testing.assert_close(after[:, 3:], before[:, 3:], atol=1e-6, rtol=1e-6)
    assert (after[:, :3] - before[:, :3]).abs().max() > 1e-4


@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_with_the_cache_equals_the_full_forward(num_beams):
    model = attach_sdma(decoder(), mode="sdma", reading="paper")
    set_sdma_updates(model, 3000)
    prompt = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, num_beams=num_beams,
                                output_scores=True, return_dict_in_generate=True)
        full = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False, num_beams=num_beams,
                              output_scores=True, return_dict_in_generate=True)
        logits = model(cached.sequences).logits
    assert torch.equal(cached.sequences, full.sequences)
    for a, b in zip(cached.scores, full.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if num_beams == 1:  # each generated token is the full forward's argmax
        assert torch.equal(cached.sequences[0, 4:], logits[0, 3:-1].argmax(-1))


@pytest.mark.parametrize("num_beams", [1, 3])
def test_decoder_mask_at_inference_generates_with_the_cache_as_without(num_beams):
    """The mask kept at inference: the keys' responsibilities are cached beside transformers' KV cache (and follow
    beam search's reordering of it), so cached generation equals uncached, on a left-padded batch."""
    model = attach_sdma(decoder(), mode="sdma", reading="paper", decoder_mask_at_inference=True)
    set_sdma_updates(model, 3000)
    prompt = torch.tensor([[1, 5, 7, 9], [0, 0, 4, 6]])
    with torch.no_grad():
        kwargs = dict(input_ids=prompt, attention_mask=prompt.ne(0).long(), max_new_tokens=5, do_sample=False,
                      num_beams=num_beams, output_scores=True, return_dict_in_generate=True)
        cached, full = model.generate(**kwargs, use_cache=True), model.generate(**kwargs, use_cache=False)
        logits = model(cached.sequences[:1]).logits
        plain = decoder()(cached.sequences[:1]).logits
    assert torch.equal(cached.sequences, full.sequences)
    for a, b in zip(cached.scores, full.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (logits - plain).abs().max() > 1e-4  # the mask is applied at inference
    if num_beams == 1:  # each generated token is the full forward's argmax
        assert torch.equal(cached.sequences[0, 4:], logits[0, 3:-1].argmax(-1))


def test_a_head_dim_apart_from_the_hidden_size_is_refused():
    with pytest.raises(SDMAConfigError, match="hidden_size = num_attention_heads \\* head_dim: leave head_dim unset"):
        attach_sdma(decoder(head_dim=16), mode="sdma")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_pretrained_and_reload(family, tmp_path):
    from transformers_plugin import from_pretrained_with_sdma  # noqa: F401 (save_and_reload uses it)

    model = attach_sdma(decoder(family), mode="sdma", reading="authors", clusters=3)
    set_sdma_updates(model, 1234)
    reloaded = save_and_reload(model, FAMILIES[family][1], tmp_path)
    assert reloaded.config._attn_implementation == "sdma"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch()).logits, model.eval()(**batch()).logits, rtol=0, atol=0)
