"""``encoder: sdma_conformer``: ESPnet's Conformer with SDMA in its (relative-position) self-attention, the
positional scores as the core's score bias."""

import copy

import pytest
import torch

pytest.importorskip("espnet2")

import espnet_plugin  # noqa: E402,F401  (registers the classes)
from espnet2.asr.encoder.conformer_encoder import ConformerEncoder  # noqa: E402
from espnet2.tasks.asr import encoder_choices  # noqa: E402
from espnet_plugin.asr.encoder.sdma_conformer_encoder import SDMAConformerEncoder  # noqa: E402
from espnet_plugin.asr.sdma_attention import (ESPnetConfigError, SDMAMultiHeadedAttention,  # noqa: E402
                                              SDMARelPositionMultiHeadedAttention)
from espnet_plugin.tasks.sdma_asr import SDMAASRTask  # noqa: E402
from latent_core.sdma import SDMACore, recording  # noqa: E402

from conftest import assert_same_step, parameter_gradients  # noqa: E402
from test_sdma_espnet import tiny_args, tiny_batch  # noqa: E402

SIZES = dict(input_size=20, output_size=32, attention_heads=2, linear_units=64, num_blocks=2, cnn_module_kernel=5,
             macaron_style=True, dropout_rate=0.0, positional_dropout_rate=0.0, use_flash_attn=False)
ATTENTION_TYPES = {  # (rel_pos_type, pos_enc_layer_type, selfattention_layer_type)
    "latest": dict(rel_pos_type="latest"),
    "legacy": dict(rel_pos_type="legacy"),
    "absolute": dict(rel_pos_type="latest", pos_enc_layer_type="abs_pos", selfattention_layer_type="selfattn"),
}


def features(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 40, 20, generator=g), torch.tensor([40, 31, 22])


def pair(kind, reading="paper", **sdma):
    """An SDMA Conformer and ESPnet's Conformer with the same weights."""
    torch.manual_seed(0)
    conf = {**SIZES, **ATTENTION_TYPES[kind]}
    model = SDMAConformerEncoder(**conf, sdma_conf={"reading": reading, **sdma})
    plain = ConformerEncoder(**{k: v for k, v in conf.items() if k != "use_flash_attn"}, use_flash_attn=False)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(".sdma." in key for key in unexpected)
    return model, plain


def test_registered_and_built_from_a_config():
    assert encoder_choices.classes["sdma_conformer"] is SDMAConformerEncoder
    model = SDMAASRTask.build_model(tiny_args(encoder="sdma_conformer", encoder_conf=dict(
        output_size=32, attention_heads=2, linear_units=64, num_blocks=2, cnn_module_kernel=5, macaron_style=True,
        rel_pos_type="latest")))
    assert all(isinstance(layer.self_attn, SDMARelPositionMultiHeadedAttention) for layer in model.encoder.encoders)


@pytest.mark.parametrize("kind", sorted(ATTENTION_TYPES))
def test_attention_class_follows_espnets_type(kind):
    model, plain = pair(kind)
    want = SDMAMultiHeadedAttention if kind == "absolute" else SDMARelPositionMultiHeadedAttention
    assert all(type(layer.self_attn) is want for layer in model.encoders)
    if kind != "absolute":
        assert type(plain.encoders[0].self_attn).__name__ == model.encoders[0].self_attn.espnet_class.__name__


@pytest.mark.parametrize("kind", sorted(ATTENTION_TYPES))
@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_at_g_zero_without_noise_it_is_espnets_conformer(kind, reading):
    """g = 0, no noise: A_hat = A (eq. 11), so the SDMA Conformer in training gives ESPnet's Conformer outputs (the
    relative-position scores enter through the score bias; a lost bias or shift would show)."""
    model, plain = pair(kind, reading, noise_var=0.0)
    if reading == "authors":  # their variance heads predict the noise: switch it off
        for layer in model.encoders:
            torch.nn.init.constant_(layer.self_attn.sdma.noise_log_var.bias, -80.0)
            torch.nn.init.constant_(layer.self_attn.sdma.query_noise_log_var.bias, -80.0)
    model.train(), plain.train()
    xs, lengths = features()
    got, got_lengths, _ = model(xs, lengths)
    want, want_lengths, _ = plain(xs, lengths)
    assert torch.equal(got_lengths, want_lengths)
    valid = torch.arange(got.size(1))[None] < got_lengths[:, None]
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["latest", "legacy"])
def test_the_semantic_mask_changes_the_outputs_and_the_model_trains_with_ctc(kind):
    model, plain = pair(kind, mix_rate=0.5)
    for layer in model.encoders:
        layer.self_attn.set_num_updates(100)
    model.eval(), plain.eval()  # the encoder keeps its mask at inference
    xs, lengths = features()
    with torch.no_grad():
        assert (model(xs, lengths)[0] - plain(xs, lengths)[0]).abs().max() > 1e-3
    torch.manual_seed(0)
    asr = SDMAASRTask.build_model(tiny_args(encoder="sdma_conformer", encoder_conf=dict(
        output_size=32, attention_heads=2, linear_units=64, num_blocks=2, cnn_module_kernel=5, macaron_style=True,
        rel_pos_type="latest" if kind == "latest" else "legacy", sdma_conf={"mix_rate": 0.5})))
    asr.train()
    optimizer = torch.optim.Adam(asr.parameters(), lr=2e-3)
    losses = []
    for step in range(12):
        optimizer.zero_grad()
        loss, stats, _ = asr(*tiny_batch())
        loss.backward()
        if step == 0:
            assert stats["sdma_reg"] != 0 and float(stats["loss_ctc"]) > 0
            missing = [n for n, p in asr.named_parameters() if p.grad is None]
            assert not missing, missing
            for layer in asr.encoder.encoders:
                assert layer.self_attn.pos_bias_u.grad.abs().sum() > 0
                assert layer.self_attn.sdma.feature_gmm.means.grad.abs().sum() > 0
        optimizer.step()
        asr.increment_num_updates()
        losses.append(float(loss))
    assert min(losses[-3:]) < losses[0]


@pytest.mark.parametrize("kernel", ["sdpa", "lowrank",
                                    pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_every_kernel_takes_the_positional_score_bias_as_the_explicit_one(kernel, reading):
    """Training forward and every gradient (pos_bias_u/v and linear_pos through the score bias included) of the
    fused kernels equal the explicit kernel's (``triton`` in Triton's interpreter here)."""
    results = []
    for name in ("explicit", kernel):
        model, _ = pair("latest", reading, noise_var=0.0, mix_rate=0.5, attention_kernel=name)
        for layer in model.encoders:
            layer.self_attn.sdma.perturb = lambda x, training, log_var=None: x  # no noise (authors: learned variance)
            layer.self_attn.set_num_updates(100)
        model.train()
        xs, lengths = features()
        xs = xs[:, :17]  # short: the interpreter runs every program in Python
        out, out_lengths, _ = model(xs, torch.tensor([17, 13, 9]))
        valid = torch.arange(out.size(1))[None] < out_lengths[:, None]
        out[valid].pow(2).sum().backward()
        results.append((out[valid].detach(), parameter_gradients(model)))
    assert_same_step(*results, parameter="pos_bias_u", rtol=1e-4, atol=1e-5)


def test_mode_none_is_espnets_conformer():
    torch.manual_seed(0)
    model = SDMAConformerEncoder(**SIZES, sdma_conf={"mode": "none"})
    assert not any(isinstance(m, SDMACore) for m in model.modules())
    assert type(model.encoders[0].self_attn).__name__ == "LegacyRelPositionMultiHeadedAttention"


def test_regularisers_are_recorded_per_layer():
    model, _ = pair("latest")
    model.train()
    with recording() as records:
        model(*features())
    cores = [layer.self_attn.sdma for layer in model.encoders]
    assert all(records.get(core) is not None for core in cores)


@pytest.mark.parametrize("overrides, message", [
    (dict(qk_norm=True), "qk_norm"),
    (dict(rel_pos_type="newest"), "rel_pos_type"),
    (dict(sdma_conf={"clusterz": 3}), "clusterz"),
    (dict(use_flash_attn=True), "use_flash_attn"),
])
def test_bad_config_names_the_key(overrides, message):
    conf = {**SIZES, **overrides}
    with pytest.raises((ESPnetConfigError, ValueError), match=message):
        SDMAConformerEncoder(**conf)


@pytest.mark.parametrize("name", ["train_asr_conformer.yaml", "train_asr_sdma_conformer.yaml"])
def test_the_synthetic_recipes_conformer_configs_build_their_encoder(name):
    """``run_synthetic.py --systems conformer sdma_conformer``: the configs build ESPnet's Conformer and the SDMA one
    with the same sizes, everything else as the transformer pair's configs."""
    import yaml

    from conftest import REPO
    from experiments.espnet.synthetic_asr import DEFAULT_SYSTEMS, SYSTEMS

    conf = REPO / "examples" / "aishell_sdma" / "asr1" / "conf" / "synthetic"
    config = yaml.safe_load((conf / name).read_text(encoding="utf-8"))
    twin = yaml.safe_load((conf / name.replace("conformer", "transformer")).read_text(encoding="utf-8"))
    assert {k: v for k, v in config.items() if k not in ("encoder", "encoder_conf")} == \
        {k: v for k, v in twin.items() if k not in ("encoder", "encoder_conf")}
    assert name in SYSTEMS.values() and not any("conformer" in system for system in DEFAULT_SYSTEMS)
    torch.manual_seed(0)
    encoder = encoder_choices.get_class(config["encoder"])(input_size=80, **config["encoder_conf"])
    want = SDMAConformerEncoder if "sdma" in name else ConformerEncoder
    assert type(encoder) is want
    out, lengths, _ = encoder(torch.randn(2, 60, 80), torch.tensor([60, 44]))
    assert out.shape[-1] == 128 and lengths.max() == out.size(1)
