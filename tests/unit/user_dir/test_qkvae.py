"""QKVAE and ADVAE (``user_dir/qkvae``) and the Table-2 probe (``qkvae-probe``: ``user_dir/tools/qkvae/probe.py``)."""

import argparse
import json
import math

import pytest
import torch
import torch.nn.functional as F
from fairseq.data import Dictionary, data_utils
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
from fairseq.sequence_generator import SequenceGenerator

from user_dir.qkvae import ADVAEModel, BartInitError, QKVAEModel

from user_dir.tools.qkvae import probe
from pipelines.data.bart_data import BartDataError, tokenize_lines, write_fairseq_dictionary
from user_dir.qkvae.encoder import SIGMA_FLOOR
from user_dir.sentence_vae.base import SentenceVAEEncoder
from latent_core.vae import DiagonalGaussian, VAEConfigError

WORDS = "the a cat dog sat ran on under mat rug big small quickly slowly".split()
SENTENCES = [
    "the cat sat on the mat",
    "a dog ran under the rug",
    "the big dog sat quickly",
    "a small cat ran slowly on a mat",
    "the dog sat under a big rug",
    "a cat ran",
]
TINY = dict(encoder_embed_dim=32, decoder_embed_dim=32, encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_layers=2, decoder_layers=2,
            posterior_layers=2, dropout=0.0, max_source_positions=64, max_target_positions=64)
QKVAE_TINY = dict(TINY, syn_latent_dim=8, num_latent_slots=4, slot_latent_dim=4)
ADVAE_TINY = dict(TINY, num_latent_slots=4, slot_latent_dim=6, latent_encoder_layers=1)
MODELS = {"qkvae": (QKVAEModel, "qkvae_small", QKVAE_TINY), "advae": (ADVAEModel, "advae_small", ADVAE_TINY)}


def make_dictionary(words=WORDS) -> Dictionary:
    d = Dictionary()
    for w in words:
        d.add_symbol(w)
    return d


def make_args(arch: str, **overrides) -> argparse.Namespace:
    args = argparse.Namespace(arch=arch, **overrides)
    ARCH_CONFIG_REGISTRY[arch](args)
    return args


def build(kind: str, dictionary=None, **overrides):
    cls, arch, tiny = MODELS[kind]
    dictionary = dictionary or make_dictionary()
    task = argparse.Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
    torch.manual_seed(0)
    return cls.build_model(make_args(arch, **{**tiny, **overrides}), task), dictionary


def batch(dictionary, sentences=SENTENCES):
    """src = sentence + EOS (left padded), prev = EOS + sentence, target = sentence + EOS."""
    lines = [dictionary.encode_line(s, add_if_not_exist=False).long() for s in sentences]
    src = data_utils.collate_tokens(lines, dictionary.pad(), dictionary.eos(), left_pad=True)
    prev = data_utils.collate_tokens(lines, dictionary.pad(), dictionary.eos(), left_pad=False,
                                     move_eos_to_beginning=True)
    target = data_utils.collate_tokens(lines, dictionary.pad(), dictionary.eos(), left_pad=False)
    return src, torch.tensor([t.numel() for t in lines]), prev, target


def nll(logits, target, pad):
    return F.cross_entropy(logits.transpose(1, 2), target, ignore_index=pad, reduction="sum") / target.ne(pad).sum()


# -- interface and shapes ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qkvae", "advae"])
def test_forward_shapes_and_interface(kind):
    model, d = build(kind)
    src, lengths, prev, target = batch(d)
    bsz = src.size(0)
    assert isinstance(model.encoder, SentenceVAEEncoder)
    expected = {"qkvae": {"z_syn": 8, "z_sem": 16}, "advae": {"z": 24}}[kind]
    assert dict(model.latent_sizes) == expected and list(model.latent_sizes) == list(expected)

    model.eval()
    enc = model.encoder(src, lengths)
    assert set(enc) == {"posterior_mean", "posterior_logvar", "latents"}
    for name, size in expected.items():
        for key in enc:
            assert enc[key][name].shape == (bsz, size)
        assert torch.equal(enc["latents"][name], enc["posterior_mean"][name])  # eval: the means
    logits, extra = model(src, lengths, prev)
    assert logits.shape == (bsz, prev.size(1), len(d))
    assert set(extra["posteriors"]) == set(expected)
    assert all(isinstance(q, DiagonalGaussian) for q in extra["posteriors"].values())
    slots = model.args.num_latent_slots
    assert extra["attn"][0].shape == (bsz, prev.size(1), slots)
    assert torch.allclose(extra["attn"][0].sum(-1), torch.ones(bsz, prev.size(1)), atol=1e-5)

    model.train()
    enc_train = model.encoder(src, lengths)
    name = next(iter(expected))
    assert not torch.equal(enc_train["latents"][name], enc_train["posterior_mean"][name])  # sampled


@pytest.mark.parametrize("kind", ["qkvae", "advae"])
def test_posterior_is_eq3_softplus_sigma_per_slot(kind):
    """mu_l = M_mu(z~_l), sigma_l = softplus(M_sigma(z~_l)); logvar = 2 log sigma, slot-major."""
    model, d = build(kind)
    model.eval()
    src, lengths, _, _ = batch(d)
    with torch.no_grad():
        h = model.encoder.query_states(src, lengths)
        means, logvars = model.encoder.posterior_parameters(src, lengths)
    start = 0
    for group in model.encoder.groups:
        for slot in range(group.slots):
            h_l = h[:, start + slot]
            mu = model.encoder.mean_heads[group.name](h_l)
            sigma = F.softplus(model.encoder.sigma_heads[group.name](h_l)) + SIGMA_FLOOR
            dims = slice(slot * group.slot_dim, (slot + 1) * group.slot_dim)
            assert torch.allclose(means[group.name][:, dims], mu, atol=1e-6)
            assert torch.allclose(logvars[group.name][:, dims], 2 * torch.log(sigma), atol=1e-5)
        start += group.slots
    assert h.size(1) == start  # QKVAE: 1 + L queries; ADVAE: L


def test_posterior_independent_of_padding_side():
    model, d = build("qkvae")
    model.eval()
    lines = [d.encode_line(s, add_if_not_exist=False).long() for s in SENTENCES]
    lengths = torch.tensor([t.numel() for t in lines])
    with torch.no_grad():
        left = model.encoder.posterior_parameters(
            data_utils.collate_tokens(lines, d.pad(), d.eos(), left_pad=True), lengths)[0]
        right = model.encoder.posterior_parameters(
            data_utils.collate_tokens(lines, d.pad(), d.eos(), left_pad=False), lengths)[0]
        single = model.encoder.posterior_parameters(lines[0].unsqueeze(0), lengths[:1])[0]
    for name in left:
        assert torch.allclose(left[name], right[name], atol=1e-5)
        assert torch.allclose(left[name][:1], single[name], atol=1e-5)


def test_architectures_registered_with_paper_sizes():
    for arch in ("qkvae", "qkvae_bart_base", "qkvae_small", "advae", "advae_bart_base", "advae_small"):
        assert arch in ARCH_MODEL_REGISTRY
    paper = make_args("qkvae_bart_base")
    assert (paper.encoder_embed_dim, paper.encoder_layers, paper.decoder_layers, paper.encoder_attention_heads,
            paper.encoder_ffn_embed_dim) == (768, 4, 4, 12, 3072)
    assert (paper.syn_latent_dim, paper.num_latent_slots, paper.slot_latent_dim) == (768, 4, 192)
    assert paper.word_dropout == 0.4 and paper.posterior_layers == 4 and paper.key_mlp_layers == 2
    assert paper.activation_fn == "gelu" and paper.layernorm_embedding and paper.no_scale_embedding
    advae = make_args("advae_bart_base")
    assert advae.num_latent_slots * advae.slot_latent_dim == 1536 and advae.latent_encoder_layers == 4
    small = make_args("qkvae_small")
    assert (small.encoder_embed_dim, small.encoder_attention_heads, small.encoder_ffn_embed_dim,
            small.encoder_layers, small.decoder_layers) == (256, 4, 1024, 2, 2)
    assert (small.syn_latent_dim, small.num_latent_slots, small.slot_latent_dim) == (64, 4, 16)
    small_ad = make_args("advae_small")
    assert small_ad.num_latent_slots * small_ad.slot_latent_dim == 128


def test_small_architecture_builds_and_runs():
    cls, arch, _ = MODELS["qkvae"]
    d = make_dictionary()
    model = cls.build_model(make_args(arch), argparse.Namespace(source_dictionary=d, target_dictionary=d))
    src, lengths, prev, _ = batch(d)
    logits, _ = model(src, lengths, prev)
    assert logits.shape == (len(SENTENCES), prev.size(1), len(d))
    assert dict(model.latent_sizes) == {"z_syn": 64, "z_sem": 64}


# -- QKV: keys from z_syn, values from z_sem ----------------------------------------------------
def _latents(model, d, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(len(SENTENCES), size, generator=gen) for name, size in model.latent_sizes.items()}


def test_keys_depend_only_on_z_syn_and_values_only_on_z_sem():
    model, d = build("qkvae")
    z = {name: value.requires_grad_() for name, value in _latents(model, d).items()}
    keys, values = model.decoder.keys_and_values(z)
    n_layers, slots, dim = 2, 4, 32
    assert keys.shape == values.shape == (len(SENTENCES), n_layers, slots, dim)
    assert torch.autograd.grad(keys.sum(), z["z_sem"], allow_unused=True, retain_graph=True)[0] is None
    assert torch.autograd.grad(values.sum(), z["z_syn"], allow_unused=True, retain_graph=True)[0] is None
    g_syn = torch.autograd.grad(keys.sum(), z["z_syn"], retain_graph=True)[0]
    g_sem = torch.autograd.grad(values.sum(), z["z_sem"])[0]
    assert g_syn.abs().sum() > 0 and g_sem.abs().sum() > 0


def test_z_syn_acts_only_through_attention_weights():
    """With identical values for all slots, the attention weights (the only thing the keys
    control) cannot matter: the logits are then independent of z_syn."""
    model, d = build("qkvae")
    model.eval()
    src, lengths, prev, _ = batch(d)
    z = _latents(model, d)
    z_syn = z["z_syn"].clone().requires_grad_()

    def logits_of(z_syn, z_sem):
        enc = model.encoder(src, lengths, latents={"z_syn": z_syn, "z_sem": z_sem})
        return model.decoder(prev, enc)[0]

    grad_generic = torch.autograd.grad(logits_of(z_syn, z["z_sem"]).sum(), z_syn)[0]
    assert grad_generic.abs().max() > 1e-4
    with torch.no_grad():
        model.decoder.slot_ids.zero_()  # same identifier for every slot
    same_slots = z["z_sem"].view(len(SENTENCES), 4, 4)[:, :1].expand(-1, 4, -1).reshape(len(SENTENCES), 16)
    grad_same = torch.autograd.grad(logits_of(z_syn, same_slots).sum(), z_syn)[0]
    assert grad_same.abs().max() < 1e-5


def test_changing_z_syn_changes_keys_and_weights_not_values():
    model, d = build("qkvae")
    model.eval()
    src, lengths, prev, _ = batch(d)
    z = _latents(model, d)
    other_syn = _latents(model, d, seed=2)["z_syn"]
    other_sem = _latents(model, d, seed=3)["z_sem"]
    with torch.no_grad():
        k1, v1 = model.decoder.keys_and_values(z)
        k2, v2 = model.decoder.keys_and_values({"z_syn": other_syn, "z_sem": z["z_sem"]})
        k3, v3 = model.decoder.keys_and_values({"z_syn": z["z_syn"], "z_sem": other_sem})
        assert torch.equal(v1, v2) and not torch.allclose(k1, k2)
        assert torch.equal(k1, k3) and not torch.allclose(v1, v3)

        def first_layer_weights(latents):
            enc = model.encoder(src, lengths, latents=latents)
            return model.decoder(prev, enc, alignment_layer=0)[1]["attn"][0]

        w1 = first_layer_weights(z)
        w2 = first_layer_weights({"z_syn": other_syn, "z_sem": z["z_sem"]})
        w3 = first_layer_weights({"z_syn": z["z_syn"], "z_sem": other_sem})
    assert not torch.allclose(w1, w2, atol=1e-4)  # keys move the weights
    assert torch.allclose(w1, w3, atol=1e-6)  # values do not (first layer: queries see only tokens)


# -- incremental decoding ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qkvae", "advae"])
def test_incremental_decoding_equals_full_forward(kind):
    model, d = build(kind)
    model.eval()
    src, lengths, prev, _ = batch(d)
    with torch.no_grad():
        enc = model.encoder(src, lengths)
        full = model.decoder(prev, enc)[0]
        state = {}
        steps = [model.decoder(prev[:, : t + 1], enc, incremental_state=state)[0] for t in range(prev.size(1))]
    incremental = torch.cat(steps, dim=1)
    mask = prev.ne(d.pad())
    assert torch.allclose(full[mask], incremental[mask], atol=1e-5)

    # beam search: 2 beams per sentence (rows 2i, 2i+1 share a latent), reordered within
    # each sentence's beams half way (fairseq's cross-attention caches rely on this)
    beams = model.encoder.reorder_encoder_out(enc, torch.tensor([0, 0, 2, 2, 4, 4]))
    order = torch.tensor([1, 1, 2, 3, 5, 4])
    with torch.no_grad():
        state = {}
        half = 3
        for t in range(half):
            model.decoder(prev[:, : t + 1], beams, incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, order)
        enc_r = model.encoder.reorder_encoder_out(beams, order)
        prev_r = prev.index_select(0, order)
        rest = [model.decoder(prev_r[:, : t + 1], enc_r, incremental_state=state)[0] for t in range(half, prev.size(1))]
        full_r = model.decoder(prev_r, enc_r)[0]
    mask_r = prev_r.ne(d.pad())[:, half:]
    assert torch.allclose(full_r[:, half:][mask_r], torch.cat(rest, dim=1)[mask_r], atol=1e-5)


@pytest.mark.parametrize("kind", ["qkvae", "advae"])
def test_beam_search_scores_equal_full_scoring(kind):
    model, d = build(kind)
    model.eval()
    src, lengths, _, _ = batch(d, SENTENCES[:3])
    generator = SequenceGenerator([model], d, beam_size=3, max_len_b=8)
    with torch.no_grad():
        hypos = generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
        enc = model.encoder(src, lengths)
        for i, beams in enumerate(hypos):
            assert len(beams) == 3
            enc_i = model.encoder.reorder_encoder_out(enc, torch.tensor([i]))
            for hypo in beams:
                tokens = hypo["tokens"].unsqueeze(0)
                prev = torch.cat([tokens.new_full((1, 1), d.eos()), tokens[:, :-1]], dim=1)
                lprobs = F.log_softmax(model.decoder(prev, enc_i)[0].float(), dim=-1)
                expected = lprobs.gather(-1, tokens.unsqueeze(-1)).view(-1)
                assert torch.allclose(hypo["positional_scores"], expected, atol=1e-4)


# -- word dropout -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qkvae", "advae"])
def test_word_dropout_only_in_training(kind):
    """The paper's reading (and ADVAE): input tokens become <unk> in training, the first kept."""
    model, d = build(kind, word_dropout=1.0, **({"qkvae_reading": "paper"} if kind == "qkvae" else {}))
    src, lengths, prev, _ = batch(d)
    z = _latents(model, d)
    dropped = prev.clone()
    dropped[:, 1:] = d.unk()
    model.train()
    with torch.no_grad():
        train_logits = model.decoder(prev, model.encoder(src, lengths, latents=z))[0]
        model.eval()
        enc = model.encoder(src, lengths, latents=z)
        eval_logits = model.decoder(prev, enc)[0]
        eval_dropped = model.decoder(dropped, enc)[0]
    assert torch.allclose(train_logits, eval_dropped, atol=1e-5)  # every input token became <unk>
    assert not torch.allclose(train_logits, eval_logits, atol=1e-3)  # ... but not in evaluation

    model_default, _ = build(kind, dictionary=d)
    assert model_default.decoder.word_dropout_p == 0.4


def test_authors_reading_word_dropout_zeroes_embeddings_and_scales_them_in_evaluation():
    """``--qkvae-reading authors``: Bernoulli(1-p) on the token embeddings at every position,
    the first included, no rescaling in training; every embedding times 1-p in evaluation."""
    model, d = build("qkvae", word_dropout=0.4)
    assert model.decoder.reading == "authors"
    src, lengths, prev, _ = batch(d)
    embed = model.decoder.embed_tokens(prev)
    torch.manual_seed(3)
    model.train()
    keep = model.decoder.token_embedding_scale(prev, embed)
    assert keep.shape == (*prev.shape, 1) and set(keep.unique().tolist()) == {0.0, 1.0}
    assert 0.45 < float(keep.mean()) < 0.75 and float(keep[:, 0].sum()) < prev.size(0)  # first dropped too
    model.eval()
    assert model.decoder.token_embedding_scale(prev, embed).item() == pytest.approx(0.6)

    z = _latents(model, d)
    with torch.no_grad():
        enc = model.encoder(src, lengths, latents=z)
        scaled = model.decoder(prev, enc)[0]
        model.decoder.word_dropout_p = 0.0
        unscaled = model.decoder(prev, enc)[0]
        # the same as scaling the input embeddings only (the tied output projection is not scaled)
        hook = model.decoder.embed_tokens.register_forward_hook(lambda module, args, out: out * 0.6)
        assert torch.allclose(model.decoder(prev, enc)[0], scaled, atol=1e-5)
        hook.remove()
    assert not torch.allclose(scaled, unscaled, atol=1e-3)


def test_authors_reading_encoder_runs_one_causal_pass_per_latent():
    """z_syn's query is computed without the z_sem queries; z_sem_l sees z_sem_1..l only."""
    model, d = build("qkvae")
    enc = model.encoder
    src, lengths, _, _ = batch(d)
    model.eval()
    with torch.no_grad():
        base = enc.query_states(src, lengths)
        enc.latent_queries[3] += torch.randn(enc.latent_queries.size(1))  # z_sem_3 (row 0 is z_syn)
        moved = enc.query_states(src, lengths)
        diff = (moved - base).abs().amax(dim=(0, 2))
    assert diff[0] == 0 and diff[1] == 0 and diff[2] == 0  # z_syn, z_sem_1, z_sem_2 unchanged
    assert diff[3] > 1e-3 and diff[4] > 1e-3  # z_sem_3 itself and z_sem_4 after it

    paper, _ = build("qkvae", dictionary=d, qkvae_reading="paper")
    with torch.no_grad():
        paper.eval()
        before = paper.encoder.query_states(src, lengths)
        paper.encoder.latent_queries[3] += torch.randn(paper.encoder.latent_queries.size(1))
        after = paper.encoder.query_states(src, lengths)
    assert (after - before).abs().amax(dim=(0, 2)).min() > 1e-4  # one unmasked pass: every query moves


def test_readings_defaults_and_parameters():
    d = make_dictionary()
    authors = make_args("qkvae_small")
    paper = make_args("qkvae_small", qkvae_reading="paper")
    assert authors.qkvae_reading == "authors" and make_args("qkvae_bart_base").qkvae_reading == "authors"
    assert (authors.attention_dropout, authors.activation_dropout) == (0.1, 0.1)  # BART's
    assert (paper.attention_dropout, paper.activation_dropout) == (0.0, 0.0)
    model, _ = build("qkvae", dictionary=d)
    assert model.sentence_average_loss and model.reset_optimizer_after_ae
    assert model.encoder.latent_queries.std().item() > 0.5  # nn.Embedding's N(0, 1)
    names = {n.split(".")[1] for n, _ in model.named_parameters()}
    assert {"input_projections", "query_positions", "output_hidden"} <= names
    model, _ = build("qkvae", dictionary=d, qkvae_reading="paper")
    assert not model.sentence_average_loss and model.decoder.output_hidden is None
    advae, _ = build("advae", dictionary=d)
    assert advae.encoder.reading == "paper" and not advae.sentence_average_loss
    with pytest.raises(VAEConfigError, match="--qkvae-reading"):
        build("qkvae", dictionary=d, qkvae_reading="printed")


def test_authors_reading_resets_optimizer_state_when_the_ae_phase_ends():
    from types import SimpleNamespace

    from user_dir.sentence_vae.task import reset_optimizer_state

    param = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([param], lr=0.1)
    param.grad = torch.ones(3)
    adam.step()
    assert adam.state
    reset_optimizer_state(SimpleNamespace(optimizer=adam), 3000)  # fairseq's wrapper exposes .optimizer
    assert not adam.state
    param.grad = torch.ones(3)
    adam.step()  # starts again from step 1
    assert int(adam.state[param]["step"]) == 1


# -- training -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qkvae", "advae"])
def test_reconstruction_loss_drops(kind):
    model, d = build(kind, word_dropout=0.0)
    src, lengths, prev, target = batch(d)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(40):
        logits, extra = model(src, lengths, prev)
        kl = sum(q.kl_standard_normal().sum(-1).mean() for q in extra["posteriors"].values())
        loss = nll(logits, target, d.pad()) + 0.0 * kl  # beta = 0: auto-encoding phase
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert math.isfinite(losses[-1])
    assert losses[-1] < 0.3 * losses[0], losses


# -- BART initialisation --------------------------------------------------------------------------
def _tiny_bart(tmp_path, dictionary, **overrides):
    from transformers import BartConfig, BartModel

    config = dict(vocab_size=len(dictionary), d_model=16, encoder_layers=6, decoder_layers=6,
                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                  max_position_embeddings=64, pad_token_id=dictionary.pad(), bos_token_id=dictionary.bos(),
                  eos_token_id=dictionary.eos(), decoder_start_token_id=dictionary.eos())
    config.update(overrides)
    torch.manual_seed(123)
    bart = BartModel(BartConfig(**config)).eval()
    bart.save_pretrained(str(tmp_path))
    return bart


BART_SIZE = dict(encoder_embed_dim=16, decoder_embed_dim=16, encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32,
                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_layers=4, decoder_layers=4,
                 posterior_layers=4, max_source_positions=32, max_target_positions=32, dropout=0.0)


def _assert_same(module, bart_module, skip=()):
    ours = dict(module.named_parameters())
    theirs = dict(bart_module.named_parameters())
    compared = 0
    for name, param in ours.items():
        if name in skip:
            continue
        assert torch.equal(param, theirs[name]), name
        compared += 1
    return compared


@pytest.mark.parametrize("kind,reading", [("qkvae", "paper"), ("qkvae", "authors"), ("advae", None)])
def test_bart_initialisation_copies_first_encoder_and_last_decoder_layers(tmp_path, kind, reading):
    d = make_dictionary()
    bart = _tiny_bart(tmp_path, d)
    model, _ = build(kind, dictionary=d, bart_dir=str(tmp_path), latent_encoder_layers=2, **BART_SIZE,
                     **({"qkvae_reading": reading} if reading else {}))
    enc, dec = model.encoder, model.decoder
    for i in range(4):  # the first 4 encoder layers, the last 4 decoder layers (of 6)
        assert _assert_same(enc.sentence_encoder.layers[i], bart.encoder.layers[i]) == 16
        assert _assert_same(enc.query_layers[i], bart.decoder.layers[2 + i]) == 26
        if kind == "qkvae":  # no k/v projections in the QKV attention
            assert "encoder_attn.k_proj.weight" not in dict(dec.layers[i].named_parameters())
            assert _assert_same(dec.layers[i], bart.decoder.layers[2 + i]) == 22
        else:
            assert _assert_same(dec.layers[i], bart.decoder.layers[2 + i]) == 26
    assert not torch.equal(enc.sentence_encoder.layers[0].fc1.weight, bart.encoder.layers[4].fc1.weight)
    assert not torch.equal(dec.layers[0].fc1.weight, bart.decoder.layers[0].fc1.weight)
    if kind == "advae":
        for i in range(2):
            assert _assert_same(dec.latent_layers[i], bart.encoder.layers[i]) == 16
        assert torch.equal(dec.latent_layernorm.weight, bart.encoder.layernorm_embedding.weight)
    assert torch.equal(enc.sentence_encoder.embed_tokens.weight, bart.shared.weight)
    assert dec.embed_tokens is enc.sentence_encoder.embed_tokens
    assert dec.output_projection.weight is dec.embed_tokens.weight
    assert torch.equal(enc.sentence_encoder.embed_positions.weight, bart.encoder.embed_positions.weight[:34])
    assert torch.equal(dec.embed_positions.weight, bart.decoder.embed_positions.weight[:34])
    assert torch.equal(enc.query_layernorm.bias, bart.decoder.layernorm_embedding.bias)
    assert torch.equal(dec.layernorm_embedding.weight, bart.decoder.layernorm_embedding.weight)

    # exactly the parts without a BART counterpart stay random
    mapped = set(model.bart_parameter_map)
    unmapped = {n.split(".")[1] for n, _ in model.named_parameters() if n not in mapped}
    expected = {"latent_queries", "mean_heads", "sigma_heads"} | (
        {"key_mlp", "slot_ids", "value_proj"} if kind == "qkvae" else {"slot_ids", "latent_in"})
    if reading == "authors":  # their random input_to_hidden per latent and Linear before the output
        expected |= {"input_projections", "output_hidden"}
        positions = bart.decoder.embed_positions.weight[:enc.query_positions.weight.size(0)]
        assert torch.equal(enc.query_positions.weight, positions)
    assert unmapped == expected

    # the copied sentence encoder computes what BART's first 4 encoder layers compute
    model.eval()
    src, lengths, _, _ = batch(d, SENTENCES[:1])
    bart.encoder.layers = bart.encoder.layers[:4]
    with torch.no_grad():
        ours = model.encoder.sentence_encoder(src, src_lengths=lengths)["encoder_out"][0].transpose(0, 1)
        theirs = bart.encoder(input_ids=src).last_hidden_state
    assert torch.allclose(ours, theirs, atol=1e-5)
    if reading == "authors":
        # z_sem's pass is BART (its last 4 decoder layers) run on input_to_hidden(embeddings) with
        # the 4 queries as decoder_inputs_embeds: BART's positions and causal mask included
        bart.decoder.layers = bart.decoder.layers[2:]
        queries = enc.latent_queries[1:].unsqueeze(0)
        with torch.no_grad():
            projected = enc.input_projections["z_sem"](bart.shared(src))
            theirs = bart(inputs_embeds=projected, decoder_inputs_embeds=queries).last_hidden_state
            ours = enc.query_states(src, lengths)[:, 1:]
        assert torch.allclose(ours, theirs, atol=1e-5)


def test_bart_dir_errors(tmp_path):
    d = make_dictionary()
    with pytest.raises(BartInitError, match="config.json"):
        build("qkvae", dictionary=d, bart_dir=str(tmp_path), **BART_SIZE)
    with pytest.raises(BartInitError, match="--bart-dir .*: no such directory"):
        build("qkvae", dictionary=d, bart_dir=str(tmp_path / "absent"), **BART_SIZE)

    from transformers import BertConfig
    bert_dir = tmp_path / "bert"
    BertConfig(vocab_size=len(d), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=32).save_pretrained(str(bert_dir))
    with pytest.raises(BartInitError, match="model_type.*'bert'"):
        build("qkvae", dictionary=d, bart_dir=str(bert_dir), **BART_SIZE)

    bart_dir = tmp_path / "bart"
    _tiny_bart(bart_dir, d)
    with pytest.raises(BartInitError, match="'d_model' is 16 but --encoder-embed-dim is 32"):
        build("qkvae", dictionary=d, bart_dir=str(bart_dir), **{**BART_SIZE, "encoder_embed_dim": 32,
                                                                 "decoder_embed_dim": 32})
    with pytest.raises(BartInitError, match="'decoder_layers' is 6 but --posterior-layers is 7"):
        build("qkvae", dictionary=d, bart_dir=str(bart_dir), **{**BART_SIZE, "posterior_layers": 7})
    bigger = make_dictionary(WORDS + ["extra"])
    with pytest.raises(BartInitError, match="'vocab_size' is 18 but the fairseq dictionary has 19"):
        build("qkvae", dictionary=bigger, bart_dir=str(bart_dir), **BART_SIZE)
    weight_files = list(bart_dir.glob("*.safetensors"))
    assert weight_files, "the tiny BART directory has no weights file to remove"
    for weights in weight_files:
        weights.unlink()
    with pytest.raises(BartInitError, match="no weights file"):
        build("qkvae", dictionary=d, bart_dir=str(bart_dir), **BART_SIZE)


def test_bart_vocabulary_dictionary_and_tokenizer(tmp_path):
    """``dict`` aligns fairseq indices with BART's token ids; ``tokenize`` emits BART's BPE tokens."""
    from transformers import BartTokenizer

    from pipelines.data.bart_data import main as bart_data_main

    tokens = ["<s>", "<pad>", "</s>", "<unk>", "t", "h", "e", "c", "a", "\u0120", "th", "the", "\u0120c",
              "\u0120ca", "\u0120cat", "<mask>"]
    files = tmp_path / "files"
    files.mkdir()
    (files / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}), encoding="utf-8")
    (files / "merges.txt").write_text("#version: 0.2\nt h\nth e\n\u0120 c\n\u0120c a\n\u0120ca t\n",
                                      encoding="utf-8")
    bart_dir = tmp_path / "bart"
    BartTokenizer(str(files / "vocab.json"), str(files / "merges.txt")).save_pretrained(str(bart_dir))

    out = tmp_path / "dict.txt"
    assert bart_data_main(["dict", str(bart_dir), str(out)]) == 0
    loaded = Dictionary.load(str(out))
    assert len(loaded) == len(tokens)
    assert [loaded.index(t) for t in tokens] == list(range(len(tokens)))
    bpe = list(tokenize_lines(str(bart_dir), ["the cat\n", "cat the"]))
    assert bpe == ["the \u0120cat", "c a t \u0120 the"]
    encoded = loaded.encode_line(bpe[0], add_if_not_exist=False, append_eos=False)
    assert encoded.tolist() == [tokens.index("the"), tokens.index("\u0120cat")]

    (files / "vocab.json").write_text(json.dumps({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}), encoding="utf-8")
    (files / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    BartTokenizer(str(files / "vocab.json"), str(files / "merges.txt")).save_pretrained(str(tmp_path / "bad"))
    with pytest.raises(BartDataError, match="ids 0-3"):
        write_fairseq_dictionary(str(tmp_path / "bad"), str(out))


# -- validation --------------------------------------------------------------------------------
def test_invalid_options_are_named():
    with pytest.raises(VAEConfigError, match="--encoder-embed-dim=32 must equal --decoder-embed-dim=48"):
        build("qkvae", decoder_embed_dim=48)
    with pytest.raises(VAEConfigError, match="--word-dropout"):
        build("advae", word_dropout=1.5)
    with pytest.raises(VAEConfigError, match="--key-mlp-layers=0"):
        build("qkvae", key_mlp_layers=0)
    with pytest.raises(VAEConfigError, match="--num-latent-slots=0"):
        build("advae", num_latent_slots=0)
    d, other = make_dictionary(), make_dictionary(WORDS[:-1])
    task = argparse.Namespace(source_dictionary=d, target_dictionary=other)
    with pytest.raises(VAEConfigError, match="dictionaries differ"):
        QKVAEModel.build_model(make_args("qkvae_small", **QKVAE_TINY), task)


def test_key_mlp_layers_one_is_the_papers_linear_map():
    model, _ = build("qkvae", key_mlp_layers=1)
    assert len(model.decoder.key_mlp) == 1 and isinstance(model.decoder.key_mlp[0], torch.nn.Linear)
    model2, _ = build("qkvae")
    assert [type(m).__name__ for m in model2.decoder.key_mlp] == ["Linear", "GELU", "Linear"]


# -- the Table-2 probe ----------------------------------------------------------------------------
def _save_checkpoint(model, path):
    torch.save({
        "cfg": {"model": model.args},
        "model": model.state_dict(),
        "optimizer_history": [{"criterion_name": "sentence_vae", "optimizer_name": "Adam",
                               "lr_scheduler_state": {"best": None}, "num_updates": 0}],
        "extra_state": {"train_iterator": {"epoch": 1}},
    }, path)


@pytest.mark.parametrize("kind", ["qkvae", "advae"])
def test_probe_scores(tmp_path, kind):
    model, d = build(kind)
    data = tmp_path / "data"
    data.mkdir()
    d.save(str(data / "dict.txt"))
    ckpt = tmp_path / "checkpoint.pt"
    _save_checkpoint(model, ckpt)

    tsv = tmp_path / "triplets.tsv"
    tsv.write_text("the cat sat on the mat\ta cat sat on a mat\tthe dog ran under the rug\n"
                   "a dog ran\tthe dog ran\ta cat sat\n\n"
                   "the big dog sat quickly\tthe large dog sat fast\ta small cat ran slowly\n", encoding="utf-8")
    out = tmp_path / "probe.json"
    result = probe.run(probe.parse_args(["--checkpoint", str(ckpt), "--data", str(data), "--triplets", str(tsv),
                                         "--json", str(out), "--batch-size", "2"]))
    saved = json.loads(out.read_text())
    assert saved["scores"] == result["scores"] and saved["num_triplets"] == 3
    labels = ["z_syn", "z_sem", "z_sem[0]", "z_sem[1]", "z_sem[2]", "z_sem[3]"] if kind == "qkvae" else \
        ["z", "z[0]", "z[1]", "z[2]", "z[3]"]
    assert list(result["scores"]) == labels
    for score in result["scores"].values():  # a multiple of 100 / 3
        assert 0.0 <= score <= 100.0 and score * 3 / 100 == pytest.approx(round(score * 3 / 100))
    assert result["unknown_tokens"] == 2  # "large", "fast"

    # the loaded model is the saved one
    loaded = probe.load_model(str(ckpt), d)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))

    # known answers: sem_src = target -> always closer (100); syn_src = target -> never (0)
    triplets = [(s, s, SENTENCES[(i + 1) % 6]) for i, s in enumerate(SENTENCES)]
    assert set(probe.probe(loaded, d, triplets)["scores"].values()) == {100.0}
    swapped = [(t, syn, sem) for t, sem, syn in triplets]
    assert set(probe.probe(loaded, d, swapped)["scores"].values()) == {0.0}


def test_probe_chooses_advae_slots_on_dev_triplets_and_scores_them_on_test(tmp_path):
    model, d = build("advae")
    dev = [(s, s, SENTENCES[(i + 2) % 6]) for i, s in enumerate(SENTENCES[:3])]
    test = [(s, SENTENCES[(i + 1) % 6], SENTENCES[(i + 3) % 6]) for i, s in enumerate(SENTENCES)]
    result = probe.probe(model, d, test, dev_triplets=dev)
    slots = [f"z[{l}]" for l in range(4)]
    chosen = result["slot_selection"]["z"]
    assert chosen["semantic"] == max(slots, key=lambda k: result["dev_scores"][k])
    assert chosen["syntactic"] == min(slots, key=lambda k: result["dev_scores"][k])
    assert chosen["semantic_score"] == result["scores"][chosen["semantic"]]  # reported on test
    assert result["selected_on"] == "dev triplets" and result["num_dev_triplets"] == 3
    for label, (low, high) in result["ci95"].items():
        assert 0.0 <= low <= result["scores"][label] <= high <= 100.0

    data = tmp_path / "data"
    data.mkdir()
    d.save(str(data / "dict.txt"))
    _save_checkpoint(model, tmp_path / "checkpoint.pt")
    shared = tmp_path / "dev.tsv"
    shared.write_text("\t".join(test[0]) + "\n", encoding="utf-8")
    tsv = tmp_path / "test.tsv"
    tsv.write_text("".join("\t".join(t) + "\n" for t in test), encoding="utf-8")
    with pytest.raises(ValueError, match="share 1 triplet"):
        probe.run(probe.parse_args(["--checkpoint", str(tmp_path / "checkpoint.pt"), "--data", str(data),
                                    "--triplets", str(tsv), "--dev-triplets", str(shared)]))


def test_probe_scores_a_single_latent_sentence_vae(tmp_path):
    from user_dir.optimus import OptimusModel
    from user_dir.optimus.model import optimus_small

    parser = argparse.ArgumentParser()
    OptimusModel.add_args(parser)
    args = parser.parse_args(["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
                              "--decoder-embed-dim", "32", "--encoder-attention-heads", "4",
                              "--decoder-attention-heads", "4", "--encoder-ffn-embed-dim", "64",
                              "--decoder-ffn-embed-dim", "64", "--latent-dim", "8"])
    optimus_small(args)
    args.arch = "optimus_small"
    d = make_dictionary()
    task = argparse.Namespace(source_dictionary=d, target_dictionary=d)
    model = OptimusModel.build_model(args, task)
    _save_checkpoint(model, tmp_path / "optimus.pt")
    loaded = probe.load_model(str(tmp_path / "optimus.pt"), d)
    triplets = [(s, s, SENTENCES[(i + 1) % 6]) for i, s in enumerate(SENTENCES)]
    result = probe.probe(loaded, d, triplets)
    assert result["scores"] == {"z": 100.0} and result["slot_selection"] == {}


def test_probe_malformed_lines(tmp_path):
    tsv = tmp_path / "bad.tsv"
    tsv.write_text("a\tb\tc\n\nonly two\tfields\n", encoding="utf-8")
    with pytest.raises(probe.TripletFormatError, match="line 3: expected 3 tab-separated fields"):
        probe.read_triplets(str(tsv))
    tsv.write_text("a\tb\tc\na\t \tc\n", encoding="utf-8")
    with pytest.raises(probe.TripletFormatError, match="line 2: the semantic source is empty"):
        probe.read_triplets(str(tsv))


