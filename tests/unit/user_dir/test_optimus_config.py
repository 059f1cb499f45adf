"""The ``optimus`` config (user_dir/optimus/model.py): the fairseq-hydra-train YAML of the pre-training
recipe (examples/optimus/config/pretrain.yaml) builds the model of the README's fairseq-train command
(a tiny local BERT, the GPT-2 decoder from scratch over a BPE trained here); every architecture is its
table row; impossible values still raise the named errors. (Optimus has no boolean option.)"""

import argparse

import pytest
import torch
from fairseq import options
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError
from transformers import BertConfig, BertModel

from conftest import REPO, english_phrases, save_tiny_bert
from pipelines.data.optimus_text import prepare, train_gpt2_tokenizer
from model_configs import assert_same_model, build_like_fairseq_train, build_like_hydra_train
from test_qkvae_config import SECTIONS, readme_command
from user_dir.model_config import architecture_overrides, config_defaults
from user_dir.optimus import OptimusConfigError, OptimusModel
from user_dir.optimus.model import ARCHITECTURES, OptimusConfig

CONFIG_DIR = REPO / "examples" / "optimus" / "config"
README = REPO / "examples" / "optimus" / "README.md"
RECIPE_START = "fairseq-train outputs/optimus/data/pretrain --user-dir user_dir --task optimus_lm "
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """120 Ding phrases in both tokenizations: a tiny WordPiece BERT over their words and a
    byte-level BPE trained on them (the README's offline run: no GPT-2 weights)."""
    root = tmp_path_factory.mktemp("optimus_config")
    lines = english_phrases(120)
    for name, part in (("train", lines[:100]), ("valid", lines[100:])):
        (root / f"{name}.txt").write_text("\n".join(part) + "\n")
    bert = save_tiny_bert(root / "bert", SPECIALS + sorted({w for line in lines for w in line.split()}))
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(str(bert))).save_pretrained(str(bert))
    bpe = train_gpt2_tokenizer([root / "train.txt"], root / "bpe", vocab_size=300)
    prepare(root / "bin", {s: root / f"{s}.txt" for s in ("train", "valid")}, bert, bpe)
    return {"data": root / "bin", "bert": bert}


def recipe_argv(corpus) -> list:
    return readme_command(README, RECIPE_START, {"outputs/optimus/data/pretrain": str(corpus["data"]),
                                                 "user_dir": str(REPO / "user_dir"), "$BERT_DIR": str(corpus["bert"])},
                          section="### 2. Pre-training")


def hydra_overrides(corpus) -> list:
    return [f"common.user_dir={REPO / 'user_dir'}", f"task.data={corpus['data']}", f"model.bert_dir={corpus['bert']}"]


# -- (a) the YAML and the README command build the same model --------------------------------------
@pytest.mark.slow
def test_hydra_yaml_builds_the_model_of_the_readme_command(corpus):
    argv = recipe_argv(corpus)
    assert "--bert-dir" in argv and "--gpt2-dir" not in argv
    by_argv, cfg_argv = build_like_fairseq_train(argv)
    by_hydra, cfg_hydra = build_like_hydra_train(CONFIG_DIR, "pretrain", hydra_overrides(corpus))
    assert_same_model(by_argv, by_hydra)
    for name in config_defaults(OptimusConfig):  # as the model read them (BERT's sizes from its directory)
        assert getattr(by_argv.args, name) == getattr(by_hydra.args, name), name
    assert (by_hydra.args.encoder_embed_dim, by_hydra.args.decoder_embed_dim) == (32, 256)
    for section in SECTIONS:
        assert OmegaConf.to_container(cfg_argv[section]) == OmegaConf.to_container(cfg_hydra[section]), section


def test_the_yaml_writes_the_fields_of_its_architecture():
    model = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "pretrain.yaml"))["model"]
    assert model.pop("_name") == "optimus" and model.pop("bert_dir") == "???"
    assert model.pop("latent_dim") == config_defaults(OptimusConfig)["latent_dim"]  # the command's --latent-dim 32
    assert model == architecture_overrides("optimus_small")


# -- (b) every architecture is its table row -------------------------------------------------------
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_resolves_to_its_row(arch):
    assert architecture_overrides(arch) == ARCHITECTURES[arch]
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    assert vars(args) == {**config_defaults(OptimusConfig), **ARCHITECTURES[arch]}


def test_the_table_sizes():
    """BERT-base + GPT-2 117M (the paper's, also ``--arch optimus``) and the CPU size."""
    sizes = {}
    for arch in ARCHITECTURES:
        args = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[arch](args)
        sizes[arch] = [(getattr(args, f"{side}_layers"), getattr(args, f"{side}_embed_dim"),
                        getattr(args, f"{side}_attention_heads"), getattr(args, f"{side}_ffn_embed_dim"))
                       for side in ("encoder", "decoder")] + [args.latent_dim]
    assert sizes == {"optimus_base": [(12, 768, 12, 3072)] * 2 + [32],
                     "optimus_small": [(4, 256, 4, 1024)] * 2 + [32]}
    assert ARCHITECTURES["optimus_base"] == {}  # = --arch optimus, the config's defaults


# -- (d) impossible values raise the named errors ----------------------------------------------------
def build_from_namespace(**options_):
    args = argparse.Namespace(**options_)
    ARCH_CONFIG_REGISTRY["optimus_small"](args)
    dictionary = Dictionary()
    task = argparse.Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
    return OptimusModel.build_model(args, task)


@pytest.mark.parametrize("options_, message", [
    ({"latent_dim": 0}, "--latent-dim=0 must be >= 1"),
    ({"latent_injection": "sideways"}, "--latent-injection='sideways': choose from"),
    ({"decoder_attention_heads": 3}, "--decoder-attention-heads=3 must be >= 1 and divide --decoder-embed-dim=256"),
    ({"max_encoder_positions": 1}, "--max-encoder-positions=1 must be >= 2"),
    ({"attention_dropout": 1.0}, "--attention-dropout=1.0 must be in"),
])
def test_impossible_values_raise_optimus_config_error(options_, message):
    with pytest.raises(OptimusConfigError, match=message):
        build_from_namespace(**options_)


def test_an_unknown_choice_is_refused_on_the_command_line_and_in_hydra(corpus):
    with pytest.raises(SystemExit):  # argparse: invalid choice
        options.parse_args_and_arch(options.get_training_parser(), recipe_argv(corpus) + ["--latent-injection", "x"])
    with pytest.raises(ValidationError):  # hydra: not a value of the enum
        build_like_hydra_train(CONFIG_DIR, "pretrain", hydra_overrides(corpus) + ["+model.latent_injection=x"])
