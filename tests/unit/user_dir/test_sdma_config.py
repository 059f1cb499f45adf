"""The one config of sdma_transformer and bert_fused_transformer: the hydra YAML of examples/ builds the
model of the recipe's fairseq-train command, every architecture is its row of Table I, the boolean
options take a value and impossible values raise the named errors."""

import argparse
from dataclasses import fields

import pytest
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_INV_REGISTRY

from conftest import REPO, recipe_fairseq_train_argv
from latent_core.sdma import SDMAConfigError, SDMALossWeights, SDMAOptions
from model_configs import USER_DIR, assert_same_model, build_like_fairseq_train, build_like_hydra_train
from user_dir.model_config import config_defaults, config_fields
from user_dir.sdma.bert_fused import BertFusedConfigError, BertFusedTransformerConfig
from user_dir.sdma.model import SDMATransformerConfig

CONFIG_DIR = REPO / "examples" / "sdma_translation" / "config"
TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64"]

# Table I: Embed, FFN, n_h and, in the paper reading, lambda_q, lambda_x, c_g. In the authors reading the
# rows their scripts trained take lambda_q 100, lambda_x 10; Zh-En (no script) keeps Table I's.
TABLE_ONE = {
    "sdma_transformer_iwslt_de_en": (512, 1024, 4, 100.0, 10.0, 10.0),
    "sdma_transformer_iwslt_de_en_small": (384, 1024, 4, 100.0, 10.0, 10.0),
    "sdma_transformer_iwslt_de_en_tiny": (256, 512, 4, 50.0, 5.0, 10.0),
    "sdma_transformer_wmt_en_de": (512, 2048, 8, 100.0, 10.0, 10.0),
    "sdma_transformer_wmt_en_de_small": (384, 2048, 8, 100.0, 10.0, 10.0),
    "sdma_transformer_wmt_en_de_tiny": (256, 1024, 4, 50.0, 5.0, 10.0),
    "sdma_transformer_wmt_zh_en": (512, 1024, 4, 50.0, 5.0, 5.0),
}
BERT_FUSED = {  # the rows of Tables II/III (base) and the tiny one
    "bert_fused_transformer_iwslt_de_en": TABLE_ONE["sdma_transformer_iwslt_de_en"],
    "bert_fused_transformer_wmt_en_de": TABLE_ONE["sdma_transformer_wmt_en_de"],
    "bert_fused_transformer_tiny": TABLE_ONE["sdma_transformer_iwslt_de_en_tiny"],
}
IWSLT_BASE = TABLE_ONE["sdma_transformer_iwslt_de_en"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Dictionaries of a de -> en translation directory (enough to build a model)."""
    path = tmp_path_factory.mktemp("de_en")
    for lang in ("de", "en"):
        (path / f"dict.{lang}.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(30)))
    return path


def build_from_yaml(data, *overrides):
    return build_like_hydra_train(CONFIG_DIR, "iwslt14_de_en",
                                  [f"common.user_dir={USER_DIR}", f"task.data={data}", *overrides])


def command(data, arch, *extra):
    return [data, "--user-dir", USER_DIR, "--task", "translation", "--source-lang", "de", "--target-lang", "en",
            "--arch", arch, "--criterion", "sdma_label_smoothed_cross_entropy", *extra]


def model_fields(model, config=SDMATransformerConfig):
    return {f.name: getattr(model.args, f.name) for f in config_fields(config)}


def recipe_command(data, tmp_path, *args, env=None) -> list:
    """The fairseq-train arguments ``train_iwslt14_de_en.sh ARGS`` runs (through its FAIRSEQ_TRAIN hook)."""
    return recipe_fairseq_train_argv(
        [REPO / "examples" / "sdma_translation" / "train_iwslt14_de_en.sh", "--data", data, "--save-dir",
         tmp_path / "save", *args], tmp_path, env={"FP16": "0", **(env or {})})


@pytest.mark.slow
def test_hydra_yaml_builds_the_model_of_the_recipe_command(data, tmp_path):
    """iwslt14_de_en.yaml is train_iwslt14_de_en.sh --size base --mode sdma (the command the recipe runs)."""
    hydra, hydra_cfg = build_from_yaml(data)
    argv = recipe_command(data, tmp_path, "--size", "base", "--mode", "sdma")
    assert argv[argv.index("--warmup-updates") + 1] == "8000"  # the authors' IWSLT script
    plain, plain_cfg = build_like_fairseq_train(argv)
    assert model_fields(hydra) == model_fields(plain)
    assert_same_model(hydra, plain)
    for section, name in [("criterion", "label_smoothing"), ("optimizer", "adam_betas"), ("optimizer", "weight_decay"),
                          ("lr_scheduler", "warmup_updates"), ("optimization", "lr"), ("optimization", "max_update"),
                          ("optimization", "clip_norm"), ("dataset", "max_tokens"), ("common", "seed")]:
        assert hydra_cfg[section][name] == plain_cfg[section][name], (section, name)
    embed, ffn, heads, dqq, dxq, centroid_grad_scale = IWSLT_BASE
    assert (hydra.args.encoder_embed_dim, hydra.args.decoder_ffn_embed_dim, hydra.args.decoder_attention_heads,
            hydra.args.encoder_layers, hydra.args.dropout) == (embed, ffn, heads, 6, 0.3)


def resolved(arch, **command_line):
    args = argparse.Namespace(**command_line)
    ARCH_CONFIG_REGISTRY[arch](args)
    return args


@pytest.mark.parametrize("reading", ["authors", "paper"])
@pytest.mark.parametrize("arch", [*TABLE_ONE, *BERT_FUSED])
def test_every_architecture_is_its_table_one_row(arch, reading):
    embed, ffn, heads, dqq, dxq, centroid_grad_scale = {**TABLE_ONE, **BERT_FUSED}[arch]
    if reading == "authors" and not arch.endswith("zh_en"):
        dqq, dxq = 100.0, 10.0
    config = BertFusedTransformerConfig if arch.startswith("bert") else SDMATransformerConfig
    args = resolved(arch, sdma_reading=reading)
    row = {"sdma_dqq_weight": dqq, "sdma_dxq_weight": dxq, "sdma_centroid_grad_scale": centroid_grad_scale}
    for side in ("encoder", "decoder"):
        row.update({f"{side}_embed_dim": embed, f"{side}_ffn_embed_dim": ffn, f"{side}_attention_heads": heads,
                    f"{side}_layers": 6})
    expected = {**config_defaults(config), "sdma_reading": reading, **row}
    assert {name: getattr(args, name) for name in expected} == expected
    assert (args.sdma_clusters, args.sdma_query_clusters, args.sdma_kl_weight, args.sdma_diversity_weight,
            args.dropout) == (4, 4, 0.01, 1.0, 0.3)


def test_the_model_defaults_are_the_iwslt_base_row_and_every_architecture_is_listed():
    embed, ffn, heads, dqq, dxq, centroid_grad_scale = IWSLT_BASE
    for config in (SDMATransformerConfig, BertFusedTransformerConfig):
        defaults = config_defaults(config)
        assert (defaults["encoder_embed_dim"], defaults["decoder_ffn_embed_dim"], defaults["encoder_attention_heads"],
                defaults["sdma_dqq_weight"], defaults["sdma_dxq_weight"], defaults["sdma_centroid_grad_scale"],
                defaults["dropout"]) == (embed, ffn, heads, dqq, dxq, centroid_grad_scale, 0.3)
    assert set(ARCH_MODEL_INV_REGISTRY["sdma_transformer"]) == {"sdma_transformer", *TABLE_ONE}
    assert set(ARCH_MODEL_INV_REGISTRY["bert_fused_transformer"]) == {"bert_fused_transformer", *BERT_FUSED}


def test_the_command_line_wins_over_the_row():
    args = resolved("sdma_transformer_iwslt_de_en_tiny", sdma_dqq_weight=50.0, encoder_embed_dim=64)
    assert (args.sdma_dqq_weight, args.sdma_dxq_weight, args.encoder_embed_dim, args.decoder_embed_dim) \
        == (50.0, 10.0, 64, 256)


def parsed(data, arch, *extra):
    args = options.parse_args_and_arch(options.get_training_parser(), [str(a) for a in command(data, arch, *extra)])
    return convert_namespace_to_omegaconf(args).model


@pytest.mark.slow
@pytest.mark.parametrize("value, expected", [(["false"], False), (["true"], True), ([], True)])
def test_boolean_options_take_a_value(data, value, expected):
    """``--bert-finetune false`` (the form of the README and the recipes) and the bare flag."""
    assert parsed(data, "bert_fused_transformer_tiny", "--bert-finetune", *value).bert_finetune is expected
    assert parsed(data, "sdma_transformer", "--sdma-decoder-mask-at-inference", *value) \
        .sdma_decoder_mask_at_inference is expected
    assert parsed(data, "sdma_transformer_iwslt_de_en", "--share-decoder-input-output-embed", *value) \
        .share_decoder_input_output_embed is expected


def test_boolean_defaults(data):
    cfg = parsed(data, "bert_fused_transformer_tiny")
    assert (cfg.bert_finetune, cfg.sdma_decoder_mask_at_inference, cfg.bert_fusion, cfg.bert_dropnet) \
        == (False, False, "embed", 1.0)


@pytest.mark.parametrize("arch, extra, error, pattern", [
    ("sdma_transformer_iwslt_de_en_tiny", ["--sdma-clusters", "0"], SDMAConfigError, "--sdma-clusters=0"),
    ("sdma_transformer", ["--sdma-decoder-query-clusters", "-1"], SDMAConfigError, "--sdma-decoder-query-clusters=-1"),
    ("sdma_transformer_wmt_en_de", ["--encoder-attention-heads", "3"], SDMAConfigError, "--encoder-attention-heads=3"),
    ("sdma_transformer", ["--sdma-dxq-weight", "-1"], SDMAConfigError, "--sdma-dxq-weight=-1"),
    ("sdma_transformer", ["--sdma-gmm-init", "xavier"], SDMAConfigError, "--sdma-gmm-init='xavier' is not one of"),
    ("bert_fused_transformer_tiny", ["--bert-dropnet", "1.5"], BertFusedConfigError, "--bert-dropnet=1.5"),
    ("bert_fused_transformer", [], BertFusedConfigError, "--bert-dir is required"),
])
def test_impossible_values_raise_the_named_errors(data, arch, extra, error, pattern):
    with pytest.raises(error, match=pattern):
        build_like_fairseq_train(command(data, arch, *TINY[:4], *extra))


@pytest.mark.parametrize("value", [[], ["true"], ["false"]])
def test_the_removed_compile_option_is_a_named_error_saying_why(data, value):
    with pytest.raises(SDMAConfigError, match=r"^--sdma-compile: this option was removed: running SDMA's training "
                                              r"through torch\.compile took minutes .*; drop --sdma-compile$"):
        build_like_fairseq_train(command(data, "sdma_transformer_iwslt_de_en_tiny", *TINY[:4], "--sdma-compile",
                                         *value))


@pytest.mark.parametrize("arch", ["sdma_transformer", "sdma_transformer_iwslt_de_en_tiny"])
def test_a_checkpoint_holding_the_removed_compile_field_loads_and_ignores_it(data, tmp_path, arch):
    """A checkpoint written while ``--sdma-compile`` existed has ``sdma_compile`` in ``cfg.model``: fairseq's
    ``load_model_ensemble`` (what ``fairseq-generate --path`` runs) builds the same model from it, through the
    model's dataclass (``--arch sdma_transformer``) and through an architecture."""
    import torch
    from fairseq import checkpoint_utils
    from omegaconf import OmegaConf

    model, cfg = build_like_fairseq_train(command(data, arch, *TINY))
    saved_cfg = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    saved_cfg["model"]["sdma_compile"] = True
    path = tmp_path / "checkpoint_with_sdma_compile.pt"
    torch.save({"cfg": saved_cfg, "model": model.state_dict(), "extra_state": {"train_iterator": {"epoch": 1}},
                "optimizer_history": [{"criterion_name": "sdma_label_smoothed_cross_entropy", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {"best": None}, "num_updates": 0}]}, path)
    models, _ = checkpoint_utils.load_model_ensemble([str(path)])
    assert_same_model(models[0], model)
    assert models[0].encoder.layers[0].self_attn.sdma.options == model.encoder.layers[0].self_attn.sdma.options


@pytest.mark.parametrize("extra", [["--sdma-mode", "vanilla"], ["--sdma-reading", "printed"],
                                   ["--bert-fusion", "concat"]])
def test_unknown_choices_are_argparse_errors(data, extra, capsys):
    with pytest.raises(SystemExit):
        parsed(data, "bert_fused_transformer_tiny", *extra)
    assert extra[0] in capsys.readouterr().err


def test_impossible_values_in_the_hydra_yaml_raise_the_named_error(data):
    with pytest.raises(SDMAConfigError, match="--sdma-clusters=0"):
        build_from_yaml(data, "+model.sdma_clusters=0")


def test_every_core_option_is_a_field():
    """The fields are written out in the config; sdma_options() reads one per SDMAOptions field."""
    names = {f.name for f in config_fields(SDMATransformerConfig)}
    core = {"sdma_" + f.name for f in fields(SDMAOptions) if f.name != "mask_at_inference"}
    assert core | set(SDMALossWeights().as_options()) <= names


def test_the_criterion_overrides_every_loss_weight():
    from user_dir.sdma.criterion import SDMACriterionConfig

    overrides = {f.name: f.default for f in fields(SDMACriterionConfig) if f.name.endswith("_weight")}
    assert overrides == {name: None for name in SDMALossWeights().as_options()}


@pytest.mark.parametrize("reading, gmm_init, expected", [("authors", None, "authors"), ("paper", None, "paper"),
                                                         ("authors", "paper", "paper"), ("paper", "authors", "authors")])
def test_gmm_init_chooses_how_both_gmms_start(data, reading, gmm_init, expected):
    """``--sdma-gmm-init``: the reading's by default; it changes the GMMs only (the authors' projections stay)."""
    import torch

    torch.manual_seed(0)
    extra = ["--sdma-reading", reading, *(["--sdma-gmm-init", gmm_init] if gmm_init else [])]
    model, _ = build_like_fairseq_train(command(data, "sdma_transformer_iwslt_de_en_tiny", *TINY, *extra))
    core = model.encoder.layers[0].self_attn.sdma
    assert core.options.gmm_initialisation == expected
    for gmm in (core.feature_gmm, core.query_gmm):
        spread = float(gmm.means.std())
        if expected == "paper":  # N(0, 1) means, unit variances, uniform prior
            assert 0.8 < spread < 1.2 and not gmm.log_vars.any() and not gmm.prior_logits.any()
        else:  # xavier_normal_: std sqrt(2 / ((G + C) d)) on the means
            assert spread < 0.5 and gmm.log_vars.std() > 0


@pytest.mark.parametrize("fp16, expected", [("1", True), ("0", False)])
def test_recipe_fp16_switch(data, tmp_path, fp16, expected):
    """FP16=1 / 0 (the default, auto, adds --fp16 where torch sees a CUDA GPU, as the authors' scripts train)."""
    assert ("--fp16" in recipe_command(data, tmp_path, env={"FP16": fp16})) is expected
