"""``attach_sdma`` on encoder-decoders (BART, Marian, mBART): SDMA in the encoder self-attention, the decoder
self-attention and the decoder's cross-attention, equal to the fairseq adapter on each; ``generate()`` with beam
search and the cache; ``SDMASeq2SeqTrainer``."""

import copy

import pytest
import torch
from transformers import (BartConfig, BartForConditionalGeneration, MarianConfig, MarianMTModel, MBartConfig,
                          MBartForConditionalGeneration, Seq2SeqTrainer, Seq2SeqTrainingArguments)

from latent_core.sdma import SDMAConfigError, SDMACore, SDMAOptions, collect_sdma_losses, real_queries, recording
from transformers_plugin import attach_sdma, sdma_loss
from transformers_plugin import set_sdma_updates
from transformers_plugin.trainer import SDMASeq2SeqTrainer

from sdma_round_trip import save_and_reload
from sdma_training import assert_training_lowers_the_loss

SIZES = dict(vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
             dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
FAMILIES = {"bart": (BartConfig, BartForConditionalGeneration), "marian": (MarianConfig, MarianMTModel),
            "mbart": (MBartConfig, MBartForConditionalGeneration)}


def seq2seq(family="bart", seed=0):
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(seed)
    return model_class(config_class(**SIZES, attn_implementation="sdpa")).eval()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(3, 40, (3, 8), generator=g)
    source_mask = torch.ones(3, 8, dtype=torch.long)
    source_mask[1, -3:] = 0
    source[1, -3:] = 0
    labels = torch.randint(3, 40, (3, 7), generator=g)
    labels[2, -2:] = -100  # a shorter target
    return {"input_ids": source, "attention_mask": source_mask, "labels": labels}


def deterministic_noise(self, value, training, log_var=None):
    return value + 0.1 * torch.sin(7 * value) if training else value


def test_the_three_attention_types_get_cores():
    model = attach_sdma(seq2seq(), mode="sdma")
    groups = {name: module.sdma.sdma_group for name, module in model.named_modules() if hasattr(module, "sdma")
              and isinstance(module.sdma, SDMACore)}
    assert sorted(groups.values()) == ["decoder_cross"] * 2 + ["decoder_self"] * 2 + ["encoder_self"] * 2
    assert all(group == "decoder_cross" for name, group in groups.items() if name.endswith("encoder_attn"))
    assert all(group == "encoder_self" for name, group in groups.items() if ".encoder." in name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mode_none_equals_the_unmodified_model(family):
    base = seq2seq(family)
    attached = attach_sdma(copy.deepcopy(base), mode="none")
    for model in (base, attached):
        model.zero_grad()
        model(**batch()).loss.backward()
    torch.testing.assert_close(attached(**batch()).logits, base(**batch()).logits, atol=2e-6, rtol=1e-5)
    grads = dict(attached.named_parameters())
    for name, parameter in base.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(grads[name].grad, parameter.grad, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_every_parameter_gets_a_gradient(family, reading):
    model = attach_sdma(seq2seq(family), mode="sdma", reading=reading).train()
    set_sdma_updates(model, 2000)
    (model(**batch()).loss + sdma_loss(model)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None and p.requires_grad]
    assert not missing, missing


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_training_lowers_the_loss(reading):
    assert_training_lowers_the_loss(attach_sdma(seq2seq(), mode="sdma", reading=reading), batch)


def _fairseq_twin(hf_attention, group: str, reading: str):
    """The fairseq adapter's attention with ``hf_attention``'s weights and SDMA parameters."""
    from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention

    kind = {"encoder_self": dict(self_attention=True), "decoder_self": dict(self_attention=True),
            "decoder_cross": dict(encoder_decoder_attention=True)}[group]
    twin = SDMAMultiheadAttention(32, 4, sdma=SDMAOptions(mode="sdma", reading=reading), group=group, dropout=0.0,
                                  **kind)
    twin.sdma.load_state_dict(hf_attention.sdma.state_dict())
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            getattr(twin, name).weight.copy_(getattr(hf_attention, name).weight)
            getattr(twin, name).bias.copy_(getattr(hf_attention, name).bias)
    return twin.train()


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_each_attention_type_equals_the_fairseq_adapter(reading, monkeypatch):
    """On the same weights, inputs and (element-wise) noise, in training: the encoder self-attention, the decoder
    self-attention and the cross-attention of an attached BART equal the fairseq adapter's ``SDMAMultiheadAttention``
    built for that type, outputs and every regulariser of eq. (20)-(23) (the cross-attention's averaged over the
    decoder's real positions, which its own mask does not hold)."""
    monkeypatch.setattr(SDMACore, "perturb", deterministic_noise)
    model = attach_sdma(seq2seq(), mode="sdma", reading=reading)
    set_sdma_updates(model, 3000)
    model.train()
    g = torch.Generator().manual_seed(1)
    source, target = torch.randn(3, 8, 32, generator=g), torch.randn(3, 6, 32, generator=g)
    source_valid = torch.ones(3, 8, dtype=torch.bool)
    source_valid[1, -3:] = False
    target_valid = torch.ones(3, 6, dtype=torch.bool)
    target_valid[2, -2:] = False
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    future = torch.zeros(6, 6).masked_fill(~causal, float("-inf"))
    encoder_attention = model.model.encoder.layers[0].self_attn
    decoder_layer = model.model.decoder.layers[0]
    cases = [
        ("encoder_self", encoder_attention, dict(hidden_states=source, attention_mask=source_valid[:, None, None, :]),
         dict(query=source, key=source, value=source, key_padding_mask=~source_valid), source_valid),
        ("decoder_self", decoder_layer.self_attn,
         dict(hidden_states=target, attention_mask=causal[None, None] & target_valid[:, None, None, :]),
         dict(query=target, key=target, value=target, key_padding_mask=~target_valid, attn_mask=future),
         target_valid),
        ("decoder_cross", decoder_layer.encoder_attn,
         dict(hidden_states=target, key_value_states=source, attention_mask=source_valid[:, None, None, :]),
         dict(query=target, key=source, value=source, key_padding_mask=~source_valid), target_valid),
    ]
    for group, hf, hf_inputs, fs_inputs, valid in cases:
        fs = _fairseq_twin(hf, group, reading)
        with recording() as hf_records:
            got, _ = hf(**hf_inputs)
        fs_inputs = {k: v.transpose(0, 1) if k in ("query", "key", "value") else v for k, v in fs_inputs.items()}
        with recording() as fs_records, real_queries(target_valid if group == "decoder_cross" else None):
            want, _ = fs(**fs_inputs)
        torch.testing.assert_close(got[valid], want.transpose(0, 1)[valid], atol=1e-5, rtol=1e-4, msg=group)
        hf_terms, fs_terms = collect_sdma_losses(hf, hf_records), collect_sdma_losses(fs, fs_records)
        for name, value in fs_terms.items():
            torch.testing.assert_close(hf_terms[name], value, atol=1e-5, rtol=1e-4, msg=f"{group} {name}")


def test_the_cross_attention_reads_the_decoders_real_positions(monkeypatch):
    """In a whole forward the cross-attention's regularisers average over the target's real positions: padding the
    target further (labels -100 beyond the real words, decoder_attention_mask 0) leaves the per-sentence terms of
    the real positions unchanged."""
    monkeypatch.setattr(SDMACore, "perturb", deterministic_noise)
    model = attach_sdma(seq2seq(), mode="sdma", reading="paper")
    set_sdma_updates(model, 3000)
    model.train()
    inputs = batch()
    decoder_ids = torch.randint(3, 40, (3, 5), generator=torch.Generator().manual_seed(4))
    padded_ids = torch.cat([decoder_ids, torch.zeros(3, 3, dtype=torch.long)], 1)
    padded_mask = torch.cat([torch.ones(3, 5, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long)], 1)
    terms = []
    for ids, mask in ((decoder_ids, None), (padded_ids, padded_mask)):
        with recording() as records:
            model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], decoder_input_ids=ids,
                  decoder_attention_mask=mask)
        cross = [m for m in model.modules() if isinstance(m, SDMACore) and m.sdma_group == "decoder_cross"]
        terms.append(collect_sdma_losses(torch.nn.ModuleList(cross), records))
    for name, value in terms[0].items():
        torch.testing.assert_close(terms[1][name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_with_the_cache_equals_the_full_decoding(num_beams):
    """The encoder's and the cross-attention's masks stay on at inference (mask_at_inference, as in the fairseq
    adapter), the decoder self-attention's is off: beam search with the cache gives the hypotheses and scores of
    decoding without it, and greedy tokens are the full forward's argmax."""
    model = attach_sdma(seq2seq(), mode="sdma", reading="authors")
    set_sdma_updates(model, 3000)
    inputs = batch()
    with torch.no_grad():
        kwargs = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=6,
                      do_sample=False, num_beams=num_beams, output_scores=True, return_dict_in_generate=True)
        cached, full = model.generate(**kwargs, use_cache=True), model.generate(**kwargs, use_cache=False)
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       decoder_input_ids=cached.sequences[:, :-1]).logits
        plain = seq2seq()(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                          decoder_input_ids=cached.sequences[:, :-1]).logits
    assert torch.equal(cached.sequences, full.sequences)
    for a, b in zip(cached.scores, full.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (logits - plain).abs().max() > 1e-4  # the masks are applied at inference
    if num_beams == 1:
        finished = cached.sequences[:, 1:] != 0  # pad after eos
        assert torch.equal(cached.sequences[:, 1:][finished], logits.argmax(-1)[finished])
    else:
        torch.testing.assert_close(cached.sequences_scores, full.sequences_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_decoder_mask_at_inference_generates_with_the_cache_as_without(num_beams):
    model = attach_sdma(seq2seq(), mode="sdma", reading="paper", decoder_mask_at_inference=True)
    set_sdma_updates(model, 3000)
    inputs = batch()
    with torch.no_grad():
        kwargs = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=4,
                      do_sample=False, num_beams=num_beams, output_scores=True, return_dict_in_generate=True)
        cached, full = model.generate(**kwargs, use_cache=True), model.generate(**kwargs, use_cache=False)
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       decoder_input_ids=cached.sequences[:, :-1]).logits
    assert torch.equal(cached.sequences, full.sequences)
    for a, b in zip(cached.scores, full.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if num_beams == 1:
        finished = cached.sequences[:, 1:] != 0
        assert torch.equal(cached.sequences[:, 1:][finished], logits.argmax(-1)[finished])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_pretrained_and_reload(family, tmp_path):
    model = attach_sdma(seq2seq(family), mode="sdma", reading="authors", clusters=3)
    set_sdma_updates(model, 1234)
    reloaded = save_and_reload(model, FAMILIES[family][1], tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch()).logits, model.eval()(**batch()).logits, rtol=0, atol=0)


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        source = torch.randint(3, 40, (8,), generator=g)
        return {"input_ids": source, "attention_mask": torch.ones(8, dtype=torch.long), "labels": source.flip(0)}


def test_seq2seq_trainer_trains_with_the_regularisers(tmp_path):
    model = attach_sdma(seq2seq(), mode="sdma", reading="authors", mix_rate=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8,
                                    learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                                    predict_with_generate=True, generation_max_length=6)
    trainer = SDMASeq2SeqTrainer(model=model, args=args, train_dataset=Pairs(), eval_dataset=Pairs())
    trainer.train()
    assert all(float(core.mix_weight) > 0.5 for core in model.modules() if isinstance(core, SDMACore))
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert any(".encoder_attn.sdma." in n for n in moved) and any(".self_attn.sdma." in n for n in moved)
    predictions = trainer.predict(Pairs())
    assert predictions.predictions.shape[0] == 24 and "test_loss" in predictions.metrics
    model.train()
    inputs = {k: torch.stack([Pairs()[i][k] for i in range(8)]) for k in ("input_ids", "attention_mask", "labels")}
    # fairseq's criterion weighs each sentence's regularisers against its token-SUMMED cross-entropy; next to the
    # token-mean task loss that is their sum over the sentences / the label tokens (the default "sentence" scale)
    tokens = int(inputs["labels"].ne(-100).sum())
    torch.manual_seed(1)
    total = trainer.compute_loss(model, dict(inputs))
    per_sentence_mean = sdma_loss(model)
    torch.manual_seed(1)
    task = model(**inputs).loss
    torch.testing.assert_close(total, task + per_sentence_mean * 8 / tokens, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sdma_loss(model, regulariser_scale="sentence", num_tokens=tokens),
                               per_sentence_mean * 8 / tokens)
    accumulated = torch.tensor(2 * tokens)  # the Trainer's count over two accumulated batches halves the term
    torch.manual_seed(1)
    halved = trainer.compute_loss(model, dict(inputs), num_items_in_batch=accumulated)
    torch.manual_seed(1)
    task_of_accumulated = Seq2SeqTrainer.compute_loss(trainer, model, dict(inputs), num_items_in_batch=accumulated)
    torch.testing.assert_close(halved - task_of_accumulated, per_sentence_mean * 4 / tokens, atol=1e-5, rtol=1e-4)
    trainer.sdma_regulariser_scale = "token"  # eq. (24) read with a per-token L_CE: the sentence mean
    torch.manual_seed(1)
    torch.testing.assert_close(trainer.compute_loss(model, dict(inputs)), task + per_sentence_mean, atol=1e-5,
                               rtol=1e-5)
    with pytest.raises(SDMAConfigError, match="sdma_regulariser_scale='mean' is not one of sentence, batch, token"):
        SDMASeq2SeqTrainer(model=model, args=args, train_dataset=Pairs(), sdma_regulariser_scale="mean")
    with pytest.raises(SDMAConfigError, match="needs num_tokens > 0"):
        sdma_loss(model, regulariser_scale="sentence")


def test_each_cross_attention_reads_its_own_layers_decoder_positions():
    model = attach_sdma(seq2seq(), mode="sdma")
    for layer in model.model.decoder.layers:
        assert layer.encoder_attn.sdma_state.partner is layer.self_attn
