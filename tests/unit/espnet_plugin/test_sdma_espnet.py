"""The ESPnet2 SDMA plugin: attention, encoder, decoder, model, task registration."""

import math

import pytest
import torch

pytest.importorskip("espnet2")

import espnet_plugin  # noqa: E402,F401  (registers the classes)
from espnet.nets.pytorch_backend.transformer.attention import MultiHeadedAttention  # noqa: E402
from espnet_plugin.asr.decoder.sdma_transformer_decoder import SDMATransformerDecoder  # noqa: E402
from espnet_plugin.asr.encoder.sdma_transformer_encoder import SDMATransformerEncoder  # noqa: E402
from espnet_plugin.asr.sdma_attention import SDMAMultiHeadedAttention  # noqa: E402
from espnet_plugin.asr.sdma_espnet_model import ESPnetSDMAASRModel  # noqa: E402
from espnet_plugin.tasks.sdma_asr import SDMAASRTask  # noqa: E402
from latent_core.sdma import (LOSS_NAMES, SDMAConfigError, SDMAOptions, mixing_weight, real_queries,  # noqa: E402
                               recording)


TOKENS = ["<blank>", "<unk>"] + list("一二三四五六七八九十") + ["<sos/eos>"]


def tiny_args(**overrides):
    args = SDMAASRTask.get_parser().parse_args([])
    args.token_list = list(TOKENS)
    args.input_size = None
    args.frontend, args.frontend_conf = "default", {"n_fft": 400, "hop_length": 160, "n_mels": 20}
    args.specaug, args.normalize, args.normalize_conf = None, "utterance_mvn", {}
    args.encoder = "sdma_transformer"
    args.encoder_conf = dict(output_size=32, attention_heads=2, linear_units=64, num_blocks=2)
    args.decoder = "sdma_transformer"
    args.decoder_conf = dict(attention_heads=2, linear_units=64, num_blocks=2)
    args.model, args.model_conf, args.ctc_conf = "sdma", dict(ctc_weight=0.3, lsm_weight=0.1), {}
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def tiny_args_read(reading, **overrides):
    """``tiny_args`` with both SDMA sides in ``reading``."""
    args = tiny_args(**overrides)
    args.encoder_conf = dict(args.encoder_conf, sdma_conf={"reading": reading})
    args.decoder_conf = dict(args.decoder_conf, sdma_conf={"reading": reading})
    return args


def tiny_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    speech = torch.randn(3, 12000, generator=g)
    speech_lengths = torch.tensor([12000, 9000, 6000])
    text = torch.randint(2, 12, (3, 5), generator=g)
    text_lengths = torch.tensor([5, 4, 3])
    text[1, 4:] = -1
    text[2, 3:] = -1
    return speech, speech_lengths, text, text_lengths


def attention_pair(group="encoder_self", mix_updates=10_000, mask_at_inference=True, seed=0):
    torch.manual_seed(seed)
    sdma = SDMAMultiHeadedAttention(2, 16, 0.0, sdma=SDMAOptions(clusters=3, query_clusters=2,
                                                                 mask_at_inference=mask_at_inference),
                                    group=group)
    sdma.set_num_updates(mix_updates)
    vanilla = MultiHeadedAttention(2, 16, 0.0)
    vanilla.load_state_dict({k: v for k, v in sdma.state_dict().items() if k.startswith("linear_")})
    return sdma.eval(), vanilla.eval()


# --------------------------------------------------------------------------- registration


def test_classes_are_registered_in_espnet_choices():
    from espnet2.tasks.asr import decoder_choices, encoder_choices, model_choices

    assert encoder_choices.get_class("sdma_transformer") is SDMATransformerEncoder
    assert decoder_choices.get_class("sdma_transformer") is SDMATransformerDecoder
    assert model_choices.get_class("sdma") is ESPnetSDMAASRModel
    espnet_plugin.register()  # idempotent
    assert "sdma_transformer" in SDMAASRTask.get_parser().format_help()


def test_decoder_and_encoder_build_from_standard_arguments_alone():
    decoder = SDMATransformerDecoder(vocab_size=13, encoder_output_size=32)
    assert len(decoder.decoders) == 6 and isinstance(decoder.decoders[0].src_attn, SDMAMultiHeadedAttention)
    assert decoder.decoders[0].self_attn.sdma.options.mask_at_inference is False
    encoder = SDMATransformerEncoder(input_size=80)
    core = encoder.encoders[0].self_attn.sdma
    assert (encoder.output_size(), core.options.clusters, core.options.query_clusters) == (256, 8, 8)
    assert core.options.centroid_grad_scale == 5.0


# --------------------------------------------------------------------------- attention


def test_attention_with_zero_mixing_weight_equals_espnet_attention():
    sdma, vanilla = attention_pair(mix_updates=0)
    x = torch.randn(2, 7, 16)
    mask = torch.ones(2, 1, 7, dtype=torch.bool)
    mask[1, :, 5:] = False
    torch.testing.assert_close(sdma(x, x, x, mask), vanilla(x, x, x, mask))
    torch.testing.assert_close(sdma.attn, vanilla.attn)


def test_attention_matches_eq_2_10_11_written_out():
    sdma, _ = attention_pair(mix_updates=10_000)
    g = mixing_weight(10_000)
    x = torch.randn(2, 6, 16)
    mask = torch.ones(2, 1, 6, dtype=torch.bool)
    mask[0, :, 4:] = False
    sdma(x, x, x, mask)

    q = sdma.linear_q(x).view(2, 6, 2, 8).transpose(1, 2)
    k = sdma.linear_k(x).view(2, 6, 2, 8).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    keep = mask[:, None]  # (B, 1, 1, T)
    A = torch.softmax(scores.masked_fill(~keep, -1e30), -1)
    gamma = sdma.sdma.cluster(x)[1].exp().permute(0, 2, 1, 3)  # (B, H, T, C)
    M = (gamma @ gamma.transpose(-1, -2) + 1e-6) * keep
    M = M / M.sum(-1, keepdim=True)  # eq. (10)
    A_bar = M * A / (M * A).sum(-1, keepdim=True)  # eq. (2)
    expected = ((1 - g) * A + g * A_bar).masked_fill(~keep, 0.0)  # eq. (11)
    torch.testing.assert_close(sdma.attn, expected, rtol=1e-5, atol=1e-6)
    assert sdma.attn[0, :, :, 4:].abs().max() == 0


def test_padding_keys_do_not_change_valid_outputs():
    sdma, _ = attention_pair(mix_updates=10_000)
    x = torch.randn(1, 6, 16)
    mask = torch.ones(1, 1, 6, dtype=torch.bool)
    mask[..., 4:] = False
    y1 = sdma(x, x, x, mask)
    x2 = x.clone()
    x2[:, 4:] = 100 * torch.randn(1, 2, 16)
    y2 = sdma(x2, x2, x2, mask)
    torch.testing.assert_close(y1[:, :4], y2[:, :4])


def test_cross_attention_uses_memory_clustering_and_decoder_query_padding():
    sdma, _ = attention_pair(group="decoder_cross")
    sdma.train()
    query, memory = torch.randn(2, 4, 16), torch.randn(2, 9, 16)
    memory_mask = torch.ones(2, 1, 9, dtype=torch.bool)
    with recording() as records, real_queries(torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)):
        sdma(query, memory, memory, memory_mask)
    record = records.get(sdma.sdma)
    assert record.valid.t().tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert record.log_joint_z.shape == (4, 2, 2, 3)  # [T, B, H, C]


# --------------------------------------------------------------------------- decoder


@pytest.mark.parametrize("reading", ["authors", "paper"])
@pytest.mark.parametrize("mask_at_inference", [True, False])
def test_incremental_batch_score_equals_full_forward(mask_at_inference, reading):
    torch.manual_seed(0)
    decoder = SDMATransformerDecoder(vocab_size=13, encoder_output_size=32, attention_heads=2, linear_units=64,
                                     num_blocks=2, sdma_conf=dict(clusters=3, query_clusters=2, reading=reading,
                                     mask_at_inference=mask_at_inference)).eval()
    for module in decoder.modules():
        if isinstance(module, SDMAMultiHeadedAttention):
            module.set_num_updates(10_000)  # g = 0.9: the mask matters
    memory = torch.randn(3, 11, 32)
    ys = torch.randint(0, 13, (3, 6))
    ys[:, 0] = 12
    with torch.no_grad():
        full = torch.log_softmax(decoder(memory, torch.full((3,), 11), ys, torch.full((3,), 6))[0], -1)
        states = [None] * 3
        for t in range(1, 7):
            logp, states = decoder.batch_score(ys[:, :t], states, memory)
            torch.testing.assert_close(logp, full[:, t - 1], rtol=1e-5, atol=1e-5)
        single, _ = decoder.score(ys[0, :4], None, memory[0])
    torch.testing.assert_close(single, full[0, 3], rtol=1e-5, atol=1e-5)


def test_mask_at_inference_governs_decoder_self_attention_only():
    """The paper drops the decoder SELF-attention's mask at test time; cross-attention keeps its mask."""
    torch.manual_seed(0)
    kwargs = dict(vocab_size=13, encoder_output_size=32, attention_heads=2, linear_units=64, num_blocks=1)
    on = SDMATransformerDecoder(**kwargs, sdma_conf={"mask_at_inference": True}).eval()
    off = SDMATransformerDecoder(**kwargs, sdma_conf={"mask_at_inference": False}).eval()
    off.load_state_dict(on.state_dict())
    for module in list(on.modules()) + list(off.modules()):
        if isinstance(module, SDMAMultiHeadedAttention):
            module.set_num_updates(10_000)
    layer = off.decoders[0]
    assert not layer.self_attn.sdma.active(False) and layer.src_attn.sdma.active(False)
    memory, ys = torch.randn(1, 5, 32), torch.tensor([[12, 3, 4]])
    args = (memory, torch.tensor([5]), ys, torch.tensor([3]))
    # "off" is "on" with only the self-attention made plain (ESPnet's own attention, same weights)
    plain_self = MultiHeadedAttention(2, 32, 0.0).eval()
    plain_self.load_state_dict({k: v for k, v in on.decoders[0].self_attn.state_dict().items()
                                if k.startswith("linear_")})
    on.decoders[0].self_attn = plain_self
    torch.testing.assert_close(off(*args)[0], on(*args)[0])
    vanilla = espnet_plugin_vanilla_decoder(kwargs)
    vanilla.load_state_dict({k: v for k, v in off.state_dict().items() if ".sdma." not in k})
    assert not torch.allclose(off(*args)[0], vanilla(*args)[0], atol=1e-4)  # the cross mask acts


def espnet_plugin_vanilla_decoder(kwargs):
    from espnet2.asr.decoder.transformer_decoder import TransformerDecoder

    return TransformerDecoder(**kwargs, use_flash_attn=False).eval()


# --------------------------------------------------------------------------- model


@pytest.mark.parametrize("reading, weights", [("authors", (0.001, 10.0, 1.0)), ("paper", (0.001, 30.0, 4.0))])
def test_model_adds_weighted_regularisers_and_reports_every_term(reading, weights):
    """Defaults: the authors' Aishell-1 config (mi_weight 1 = lambda_q 10, lambda_x 1) or the paper's."""
    torch.manual_seed(0)
    model = SDMAASRTask.build_model(tiny_args_read(reading))
    model.train()
    loss, stats, weight = model(*tiny_batch())
    w = model.sdma_loss_weights
    expected_reg = (w["sdma_kl_weight"] * (stats["sdma_kl_z"] + stats["sdma_kl_q"])
                    + w["sdma_dqq_weight"] * stats["sdma_dqq"] - w["sdma_dxq_weight"] * stats["sdma_dxq"]
                    + w["sdma_diversity_weight"] * (stats["sdma_dv_z"] + stats["sdma_dv_q"]))
    torch.testing.assert_close(stats["sdma_reg"], expected_reg)
    torch.testing.assert_close(loss, 0.3 * stats["loss_ctc"] + 0.7 * stats["loss_att"] + expected_reg)
    assert (w["sdma_kl_weight"], w["sdma_dqq_weight"], w["sdma_dxq_weight"]) == weights
    assert 0.25 <= float(stats["sdma_hardness"]) <= 1.0  # 4 or 8 clusters per GMM
    assert 0.0 <= float(stats["sdma_dqq_clamped"]) <= 1.0 and float(stats["sdma_dqq_ratio"]) > 0
    loss.backward()
    for path in ("encoder.encoders.0.self_attn", "decoder.decoders.1.self_attn", "decoder.decoders.0.src_attn"):
        core = model.get_submodule(path).sdma
        assert core.feature_gmm.means.grad.abs().sum() > 0, path
        assert core.query_gmm.means.grad.abs().sum() > 0, path


def test_every_stat_is_present_even_without_the_attention_decoder():
    torch.manual_seed(0)
    with_decoder = SDMAASRTask.build_model(tiny_args())
    ctc_only = SDMAASRTask.build_model(tiny_args(model_conf=dict(ctc_weight=1.0)))
    _, stats_a, _ = with_decoder(*tiny_batch())
    _, stats_b, _ = ctc_only(*tiny_batch())
    assert set(stats_a) == set(stats_b)
    for name in LOSS_NAMES:
        assert stats_b[f"sdma_{name}"] is not None and torch.isfinite(stats_b[f"sdma_{name}"]).all()


def test_optimizer_steps_drive_the_mixing_weight_and_survive_reload():
    """Paper reading: g follows the optimizer steps (a forward without a step leaves it)."""
    args = tiny_args_read("paper")
    model = SDMAASRTask.build_model(args)
    optimizer = SDMAASRTask.build_optimizers(args, model)[0]
    for _ in range(3):
        loss, _, _ = model(*tiny_batch())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert int(model.num_updates) == 3
    for core in model.sdma_cores:
        assert float(core.mix_weight) == pytest.approx(mixing_weight(3, 0.9, 5e-4))
    _, stats, _ = model(*tiny_batch())
    assert float(stats["sdma_mix"]) == pytest.approx(mixing_weight(3))
    restored = SDMAASRTask.build_model(args)
    restored.load_state_dict(model.state_dict())
    assert int(restored.num_updates) == 3
    assert float(restored.decoder.decoders[1].src_attn.sdma.mix_weight) == pytest.approx(mixing_weight(3))


def test_authors_reading_counts_forward_calls():
    """The authors' ESPnet model advances g after every forward call, training or validation, and
    not at optimizer steps; each call uses the g of the calls before it."""
    args = tiny_args_read("authors")
    model = SDMAASRTask.build_model(args)
    optimizer = SDMAASRTask.build_optimizers(args, model)[0]
    for step in range(3):
        loss, stats, _ = model(*tiny_batch())
        assert float(stats["sdma_mix"]) == pytest.approx(mixing_weight(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert int(model.num_updates) == 3
    model.eval()
    with torch.no_grad():
        model(*tiny_batch())  # a validation batch counts too
    assert int(model.num_updates) == 4
    restored = SDMAASRTask.build_model(args)
    restored.load_state_dict(model.state_dict())
    assert int(restored.num_updates) == 4
    assert float(restored.decoder.decoders[1].src_attn.sdma.mix_weight) == pytest.approx(mixing_weight(4))


def test_regulariser_is_normalised_like_espnets_attention_loss():
    """Per-utterance regularisers summed ('sentence') and divided by ESPnet's CE normaliser: the
    batch size by default (= the batch mean, as the authors' ESPnet code adds it), the number of
    target tokens with length_normalized_loss: true."""
    batch = tiny_batch()
    num_tokens = float((batch[3] + 1).sum())
    for conf, normaliser in ((dict(), 3.0), (dict(length_normalized_loss=True), num_tokens)):
        torch.manual_seed(0)
        model = SDMAASRTask.build_model(tiny_args(model_conf=dict(ctc_weight=0.3, lsm_weight=0.1, **conf)))
        model.train()
        loss, stats, _ = model(*batch)
        w = model.sdma_loss_weights
        mean_reg = (w["sdma_kl_weight"] * (stats["sdma_kl_z"] + stats["sdma_kl_q"])
                    + w["sdma_dqq_weight"] * stats["sdma_dqq"] - w["sdma_dxq_weight"] * stats["sdma_dxq"]
                    + w["sdma_diversity_weight"] * (stats["sdma_dv_z"] + stats["sdma_dv_q"]))
        torch.testing.assert_close(stats["sdma_reg"], mean_reg * 3 / normaliser)
        torch.testing.assert_close(loss, 0.3 * stats["loss_ctc"] + 0.7 * stats["loss_att"] + stats["sdma_reg"])


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_model_loss_per_utterance_is_unchanged_by_duplicating_the_batch(reading):
    """ESPnet's loss is per utterance: two copies of a batch give the same loss and regulariser."""
    torch.manual_seed(0)
    model = SDMAASRTask.build_model(tiny_args_read(reading))
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for core in model.sdma_cores:  # no sampling noise (the authors' variance is learned: bypass it)
        core.perturb = lambda x, training, log_var=None: x
    model.counts_forward_calls = False  # the same g in both calls
    speech, speech_lengths, text, text_lengths = tiny_batch()
    _, one, _ = model(speech, speech_lengths, text, text_lengths)
    _, two, _ = model(speech.repeat(2, 1), speech_lengths.repeat(2), text.repeat(2, 1), text_lengths.repeat(2))
    for key in ("loss", "sdma_reg", *(f"sdma_{n}" for n in LOSS_NAMES)):
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)


def test_inference_uses_weights_written_through_data():
    """An fp16 optimizer writes master weights with ``p.data.copy_`` (no version bump): decoding must
    see them."""
    torch.manual_seed(0)
    encoder = SDMATransformerEncoder(input_size=20, output_size=32, attention_heads=2, linear_units=64,
                                     num_blocks=2).eval()
    for module in encoder.modules():
        if isinstance(module, SDMAMultiHeadedAttention):
            module.set_num_updates(10_000)
    xs, lens = torch.randn(2, 40, 20), torch.tensor([40, 31])
    with torch.no_grad():
        encoder(xs, lens)
        for module in encoder.modules():
            if isinstance(module, SDMAMultiHeadedAttention):
                gmm = module.sdma.feature_gmm
                gmm.means.data.copy_(gmm.means.data + torch.randn_like(gmm.means))
        after = encoder(xs, lens)[0]
        fresh = SDMATransformerEncoder(input_size=20, output_size=32, attention_heads=2, linear_units=64,
                                       num_blocks=2).eval()
        fresh.load_state_dict(encoder.state_dict())
        expected = fresh(xs, lens)[0]
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)


def test_default_clusters_follow_the_authors_aishell_config():
    """Table I's Aishell-1 "8/4": 8 clusters in the encoder (both GMMs), 4 in the decoder (both GMMs)."""
    model = SDMAASRTask.build_model(tiny_args())
    for path in ("encoder.encoders.0.self_attn", "decoder.decoders.0.self_attn", "decoder.decoders.0.src_attn"):
        core = model.get_submodule(path).sdma
        expected = 8 if path.startswith("encoder") else 4
        assert (core.feature_gmm.num_clusters, core.query_gmm.num_clusters) == (expected, expected), path


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(encoder_conf=dict(output_size=32, attention_heads=2, sdma_conf=dict(clusters=0))),
         "encoder_conf.sdma_conf.clusters=0"),
        (dict(encoder_conf=dict(output_size=32, attention_heads=2, sdma_conf=dict(clusterz=8))),
         "encoder_conf.sdma_conf.clusterz: unknown SDMA option"),
        (dict(encoder_conf=dict(output_size=32, attention_heads=2, sdma_conf=dict(compile=True))),
         "encoder_conf.sdma_conf.compile: this option was removed: running SDMA's training through torch.compile "
         "took minutes"),
        (dict(decoder_conf=dict(attention_heads=2, sdma_conf=dict(compile=False))),
         "decoder_conf.sdma_conf.compile: this option was removed"),
        (dict(decoder_conf=dict(attention_heads=2, sdma_conf=dict(mode="fancy"))), "decoder_conf.sdma_conf.mode='fancy'"),
        (dict(model_conf=dict(sdma_dqq_weight=-1.0)), "model_conf.sdma_dqq_weight=-1.0"),
        (dict(model_conf=dict(sdma_regulariser_scale="tokens")), "model_conf.sdma_regulariser_scale='tokens'"),
        (dict(encoder="transformer", decoder="transformer"), "model: sdma needs an SDMA encoder"),
    ],
)
def test_impossible_options_name_the_config_key(overrides, message):
    with pytest.raises(SDMAConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        SDMAASRTask.build_model(tiny_args(**overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(encoder_conf=dict(output_size=32, attention_heads=3)),
         "encoder_conf.attention_heads=3 must be >= 1 and divide encoder_conf.output_size=32"),
        (dict(encoder_conf=dict(output_size=32, attention_heads=2), decoder_conf=dict(attention_heads=5)),
         "decoder_conf.attention_heads=5 must be >= 1 and divide encoder_conf.output_size=32"),
        (dict(encoder_conf=dict(output_size=32, attention_heads=2, dropout_rate=1.5)),
         "encoder_conf.dropout_rate=1.5 must lie in [0, 1)"),
        (dict(encoder_conf=dict(output_size=32, attention_heads=2, num_blocks=2, interctc_layer_idx=[2])),
         "encoder_conf.interctc_layer_idx=[2]"),
        (dict(model_conf=dict(ctc_weight=1.5)), "model_conf.ctc_weight=1.5 must lie in [0, 1]"),
    ],
)
def test_what_espnet_asserts_is_checked_first_and_named_by_its_yaml_key(overrides, message):
    """ESPnet would fail with a bare AssertionError; the plugin names the key (a PluginConfigError), and
    the error is an AssertionError too, so code written against ESPnet's classes still catches it."""
    from espnet_plugin.asr.sdma_attention import ESPnetConfigError
    from latent_core.errors import PluginConfigError

    with pytest.raises(AssertionError) as error:
        SDMAASRTask.build_model(tiny_args(**overrides))
    assert isinstance(error.value, ESPnetConfigError) and isinstance(error.value, PluginConfigError)
    assert isinstance(error.value, ValueError) and message in str(error.value)


def test_unknown_option_is_refused_by_name():
    with pytest.raises(TypeError, match="sdma_clustres"):
        SDMAASRTask.build_model(tiny_args(encoder_conf=dict(output_size=32, attention_heads=2, sdma_clustres=4)))


def test_feature_dimension_mismatch_names_the_config_option():
    encoder = SDMATransformerEncoder(input_size=20, output_size=32, attention_heads=2, linear_units=64, num_blocks=1)
    with pytest.raises(ValueError, match="input_size=20.*frontend_conf.n_mels"):
        encoder(torch.randn(2, 50, 80), torch.tensor([50, 40]))


def test_model_forward_backward_under_bf16_autocast():
    torch.manual_seed(0)
    model = SDMAASRTask.build_model(tiny_args())
    model.set_num_updates(5000)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, stats, _ = model(*tiny_batch())
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("num_updates", [0, 5000])
@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_every_trained_parameter_gets_a_gradient_for_ddp(reading, num_updates):
    """ESPnet's DDP runs with find_unused_parameters off (``--unused_parameters false``): every
    parameter of the model gets a gradient, before and after the mixing weight has grown."""
    torch.manual_seed(0)
    model = SDMAASRTask.build_model(tiny_args_read(reading))
    model.set_num_updates(num_updates)
    loss, _, _ = model(*tiny_batch())
    loss.sum().backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_mode_none_is_espnets_plain_attention_in_training(reading):
    """``SDMAOptions(mode="none")`` documents vanilla attention: the class built with it computes ESPnet's
    ``MultiHeadedAttention`` exactly, in training too (the authors reading crashed on its absent noise heads)."""
    from espnet.nets.pytorch_backend.transformer.attention import MultiHeadedAttention

    from espnet_plugin.asr.sdma_attention import SDMAMultiHeadedAttention
    from latent_core.sdma import SDMAOptions

    torch.manual_seed(0)
    sdma = SDMAMultiHeadedAttention(2, 8, 0.0, sdma=SDMAOptions(mode="none", reading=reading), group="encoder_self")
    plain = MultiHeadedAttention(2, 8, 0.0)
    plain.load_state_dict({k: v for k, v in sdma.state_dict().items() if not k.startswith("sdma.")})
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 1, 5, dtype=torch.bool)
    mask[1, :, 3:] = False
    torch.testing.assert_close(sdma.train()(x, x, x, mask), plain.train()(x, x, x, mask), rtol=0, atol=0)
