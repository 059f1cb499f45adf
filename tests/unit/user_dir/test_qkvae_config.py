"""The ``qkvae`` / ``advae`` configs (user_dir/qkvae/model.py): the fairseq-hydra-train YAML of the
QKVAE recipe (examples/sentence_vae/config/qkvae_small.yaml) builds the model of the README's
fairseq-train command; every architecture is its table row; booleans can be switched off; impossible
values still raise the named errors."""

import argparse
import shlex
from pathlib import Path

import pytest
from fairseq import options
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from conftest import REPO, recipe_fairseq_train_argv
from latent_core.vae import VAEConfigError
from model_configs import assert_same_model, build_like_fairseq_train, build_like_hydra_train
from user_dir.model_config import architecture_overrides, config_defaults
from user_dir.qkvae.model import ARCHITECTURES, BART_DROPOUT, ADVAEConfig, ADVAEModel, QKVAEConfig, QKVAEModel

CONFIG_DIR = REPO / "examples" / "sentence_vae" / "config"
README = REPO / "examples" / "sentence_vae" / "README.md"
RECIPE_START = "fairseq-train outputs/english_vae/bin --user-dir user_dir --task sentence_vae --arch qkvae_small "
SECTIONS = ("task", "criterion", "optimizer", "lr_scheduler", "optimization", "dataset", "checkpoint", "common")
CONFIGS = {"qkvae": QKVAEConfig, "advae": ADVAEConfig}
MODELS = {"qkvae": QKVAEModel, "advae": ADVAEModel}
TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
        "--decoder-attention-heads", "4"]


def readme_command(readme: Path, start: str, replace: dict, section: str = "") -> list:
    """The README's first command that begins with ``start`` (with its ``\\`` continuation lines), after the
    heading ``section`` when one is given, as argv without the program name, each word in ``replace`` replaced."""
    text = readme.read_text()
    text = text[text.index(section):]
    lines = []
    for line in text[text.index(start):].splitlines():
        lines.append(line.rstrip("\\"))
        if not line.endswith("\\"):
            break
    return [replace.get(word, word) for word in shlex.split(" ".join(lines))[1:]]


def recipe_argv(data) -> list:
    return readme_command(README, RECIPE_START,
                          {"outputs/english_vae/bin": str(data), "user_dir": str(REPO / "user_dir")})


def hydra_overrides(data) -> list:
    return [f"common.user_dir={REPO / 'user_dir'}", f"task.data={data}"]


def tiny_argv(data, arch, *extra) -> list:
    return [str(data), "--user-dir", str(REPO / "user_dir"), "--task", "sentence_vae", "--criterion", "sentence_vae",
            "--arch", arch, *TINY, *extra]


# -- (a) the YAML and the README command build the same model --------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("argv_extra, hydra_extra", [
    ([], []),
    (["--qkvae-reading", "paper"], ["model.qkvae_reading=paper"]),  # the derived dropouts under both paths
])
def test_hydra_yaml_builds_the_model_of_the_readme_command(small_vae_bin, argv_extra, hydra_extra):
    by_argv, cfg_argv = build_like_fairseq_train(recipe_argv(small_vae_bin) + argv_extra)
    by_hydra, cfg_hydra = build_like_hydra_train(CONFIG_DIR, "qkvae_small",
                                                 hydra_overrides(small_vae_bin) + hydra_extra)
    assert_same_model(by_argv, by_hydra)
    for name in config_defaults(QKVAEConfig):  # every option as the model resolved it
        assert getattr(by_argv.args, name) == getattr(by_hydra.args, name), name
    for section in SECTIONS:  # the rest of the run: criterion, optimizer, schedule, batch, ...
        assert OmegaConf.to_container(cfg_argv[section]) == OmegaConf.to_container(cfg_hydra[section]), section
    assert (by_argv.sentence_average_loss, by_argv.reset_optimizer_after_ae) == (not argv_extra, not argv_extra)


def test_the_yaml_writes_the_fields_of_its_architecture_and_the_reading():
    model = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "qkvae_small.yaml"))["model"]
    assert model.pop("_name") == "qkvae"
    assert model.pop("qkvae_reading") == config_defaults(QKVAEConfig)["qkvae_reading"]
    assert model == architecture_overrides("qkvae_small")


# -- (b) every architecture is its table row -------------------------------------------------------
def resolved_row(model_name: str, overrides: dict) -> dict:
    """The config defaults, the row's overrides and the defaults that follow other options."""
    row = {**config_defaults(CONFIGS[model_name]), **overrides}
    for name, source in MODELS[model_name].DEFAULTS_FOLLOWING.items():
        row[name] = row[source]
    authors = row.get("qkvae_reading") == "authors"
    row["attention_dropout"] = row["activation_dropout"] = BART_DROPOUT if authors else 0.0
    return row


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_resolves_to_its_row(arch):
    model_name, overrides = ARCHITECTURES[arch]
    assert architecture_overrides(arch) == overrides
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    assert vars(args) == resolved_row(model_name, overrides)


def test_the_table_sizes():
    """Appendix B's sizes and the CPU ones (the module docstring's table)."""
    sizes = {}
    for arch in ARCHITECTURES:
        args = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[arch](args)
        sizes[arch] = (args.encoder_embed_dim, args.encoder_attention_heads, args.encoder_ffn_embed_dim,
                       args.encoder_layers, args.decoder_layers, getattr(args, "syn_latent_dim", None),
                       args.num_latent_slots, args.slot_latent_dim, args.posterior_layers)
    assert sizes == {
        "qkvae_bart_base": (768, 12, 3072, 4, 4, 768, 4, 192, 4),
        "advae_bart_base": (768, 12, 3072, 4, 4, None, 4, 384, 4),
        "qkvae_small": (256, 4, 1024, 2, 2, 64, 4, 16, 2),
        "advae_small": (256, 4, 1024, 2, 2, None, 4, 32, 2),
    }


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["qkvae", "advae"])
def test_the_model_name_is_the_bart_base_architecture(small_vae_bin, model_name):
    """``--arch qkvae`` (the config's defaults, resolved in build_model) = ``--arch qkvae_bart_base``."""
    by_name, _ = build_like_fairseq_train(tiny_argv(small_vae_bin, model_name))
    by_arch, _ = build_like_fairseq_train(tiny_argv(small_vae_bin, f"{model_name}_bart_base"))
    assert_same_model(by_name, by_arch)
    assert {k: v for k, v in vars(by_name.args).items() if k != "_name"} == \
        {k: v for k, v in vars(by_arch.args).items() if k != "_name"}


# -- (c) booleans take a value -----------------------------------------------------------------------
@pytest.mark.slow
def test_boolean_options_can_be_switched_off(small_vae_bin):
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, tiny_argv(small_vae_bin, "qkvae_small", "--layernorm-embedding", "false",
                                                         "--encoder-learned-pos", "false", "--no-scale-embedding"))
    assert (args.layernorm_embedding, args.encoder_learned_pos, args.no_scale_embedding) == (False, False, True)
    on, _ = build_like_fairseq_train(tiny_argv(small_vae_bin, "qkvae_small"))
    off, _ = build_like_fairseq_train(tiny_argv(small_vae_bin, "qkvae_small", "--layernorm-embedding", "false"))
    assert on.encoder.query_layernorm is not None and off.encoder.query_layernorm is None


# -- (d) impossible values raise the named errors ----------------------------------------------------
@pytest.mark.parametrize("arch, extra, message", [
    ("qkvae_small", ["--posterior-layers", "0"], "--posterior-layers=0 must be >= 1"),
    ("qkvae_small", ["--key-mlp-layers", "0"], "--key-mlp-layers=0 must be >= 1"),
    ("qkvae_small", ["--decoder-output-dim", "16"], "--decoder-output-dim and --decoder-input-dim must equal"),
    ("advae_small", ["--latent-encoder-layers", "-1"], "--latent-encoder-layers=-1 must be >= 0"),
    ("advae", ["--cross-self-attention"], "--cross-self-attention is not supported"),
])
def test_impossible_values_raise_vae_config_error(small_vae_bin, arch, extra, message):
    with pytest.raises(VAEConfigError, match=message):
        build_like_fairseq_train(tiny_argv(small_vae_bin, arch, *extra))


def test_an_unknown_reading_is_refused_on_every_path(small_vae_bin):
    with pytest.raises(SystemExit):  # argparse: invalid choice
        options.parse_args_and_arch(options.get_training_parser(),
                                    tiny_argv(small_vae_bin, "qkvae_small", "--qkvae-reading", "theirs"))
    with pytest.raises(ValidationError):  # hydra: not a value of the enum
        build_like_hydra_train(CONFIG_DIR, "qkvae_small",
                               hydra_overrides(small_vae_bin) + ["model.qkvae_reading=theirs"])
    args = argparse.Namespace(qkvae_reading="theirs")  # a Namespace built by hand (tests, tools)
    ARCH_CONFIG_REGISTRY["qkvae_small"](args)
    dictionary = Dictionary()
    task = argparse.Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
    with pytest.raises(VAEConfigError, match="--qkvae-reading='theirs' must be one of authors, paper"):
        QKVAEModel.build_model(args, task)


def test_the_authors_recipe_script_is_their_qkv_train(small_vae_bin, tmp_path):
    """examples/sentence_vae/train_qkvae_authors.sh passes their qkv_train.py's settings: fairseq's Adafactor as
    transformers' Adafactor(lr=2e-4, relative_step=False), a fixed LR, clip 100, their thresholds and windows."""
    import torch
    from fairseq import optim
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from transformers.optimization import Adafactor

    argv = recipe_fairseq_train_argv([REPO / "examples" / "sentence_vae" / "train_qkvae_authors.sh", small_vae_bin,
                                      tmp_path / "bart", tmp_path / "save", "--", "--seed", "3"], tmp_path)
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    assert (args.arch, args.qkvae_reading, args.decoder_start, args.seed) == ("qkvae_bart_base", "authors", "auto", 3)
    assert (args.kl_variant, args.kl_threshold, args.ae_steps) == ("free_bits", "0.01", 3000)
    assert args.beta_schedule == "z_sem=linear:3000:6000:0.6,z_syn=linear:7000:20000:0.3"
    assert (args.lr_scheduler, args.lr, args.clip_norm, args.batch_size, args.max_epoch) == \
        ("fixed", [2e-4], 100.0, 64, 40)
    params = [torch.nn.Parameter(torch.zeros(3, 2))]
    ours = optim.build_optimizer(cfg.optimizer, params).optimizer.defaults
    theirs = Adafactor([torch.nn.Parameter(torch.zeros(3, 2))], lr=2e-4, relative_step=False).defaults
    assert {k: ours[k] for k in theirs} == theirs
