"""Every model builds from a sparse ``argparse.Namespace``, as the toolkit's own models do.

fairseq's ``TransformerModel.build_model(args, task)`` completes whatever ``args`` leaves unset
with its base architecture, and fairseq's tests, scripts and users rely on it (a Namespace with a
few sizes, or one filled by another architecture function). Each of the plugin's nine models must
do the same: the model built from a Namespace holding only the options a caller chose is the model
``fairseq-train --arch NAME`` builds from the same options (same config values, same parameters
from one seed), in every SDMA mode and reading.
"""

import argparse
from pathlib import Path

import pytest
import torch
from fairseq import tasks
from fairseq.data import Dictionary
from fairseq.models import MODEL_REGISTRY
from fairseq.models.transformer import tiny_architecture

from model_configs import USER_DIR, assert_same_model, build_like_fairseq_train
from test_bert_fused import save_tiny_bert as save_bert_fused_bert, write_data_dir as write_bert_fused_data
from test_hf_sentence_config import bert, mrpc  # noqa: F401  (fixtures)
from test_optimus_config import corpus  # noqa: F401  (fixture)
from user_dir.optimus.model import _BERT_SIZES as BERT_SIZES
from user_dir.sdma.model import SDMATransformerModel

pytestmark = pytest.mark.slow  # every model built twice, by the CLI and from a Namespace (half a minute in all)

TINY_TRANSFORMER = {"encoder_layers": 1, "decoder_layers": 1, "encoder_embed_dim": 16, "decoder_embed_dim": 16,
                    "encoder_ffn_embed_dim": 32, "decoder_ffn_embed_dim": 32, "encoder_attention_heads": 2,
                    "decoder_attention_heads": 2}
TPR_TINY = {"tpr_symbols": 6, "tpr_roles": 4, "tpr_symbol_dim": 4, "tpr_role_dim": 4}
SDMA_SETTINGS = [{"sdma_mode": "none"}, {"sdma_mode": "sma"}, {"sdma_mode": "sdma"},
                 {"sdma_mode": "sma", "sdma_reading": "paper"}, {"sdma_mode": "sdma", "sdma_reading": "paper"}]


def flags(options: dict) -> list:
    argv = []
    for name, value in options.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def assert_sparse_namespace_builds_the_cli_model(model_name: str, task_argv: list, options: dict,
                                                 recorded_by_build=()):
    """``MODEL.build_model(Namespace(**options), task)`` == ``fairseq-train --arch MODEL <options>``;
    ``recorded_by_build``: options build_model sets from a pre-trained directory (not in cfg.model)."""
    options = {name: str(value) if isinstance(value, Path) else value for name, value in options.items()}
    by_cli, cfg = build_like_fairseq_train([*task_argv, "--arch", model_name, *flags(options)])
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(cfg.common.seed)
    sparse = argparse.Namespace(**options)
    by_namespace = MODEL_REGISTRY[model_name].build_model(sparse, task)
    assert_same_model(by_cli, by_namespace)
    for name, value in cfg.model.items():  # the Namespace was completed with the same values
        if name.startswith("_") or name in recorded_by_build or not hasattr(sparse, name):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert float(getattr(sparse, name)) == float(value), name
        elif isinstance(value, (str, bool)):
            assert str(getattr(sparse, name)) == str(value), name


@pytest.fixture(scope="module")
def translation_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("translation_dicts")
    for lang in ("de", "en"):
        (path / f"dict.{lang}.txt").write_text("".join(f"{lang}{i} {100 - i}\n" for i in range(20)))
    return path


def translation_argv(data):
    return [data, "--user-dir", USER_DIR, "--task", "translation", "--source-lang", "de", "--target-lang", "en"]


def test_the_issue_command_builds_in_every_mode():
    """The repro of the regression: fairseq's ``tiny_architecture`` on an empty Namespace, then the
    plugin's build_model (which filled nothing and raised AttributeError 'sdma_kl_weight')."""
    task = argparse.Namespace(source_dictionary=Dictionary(), target_dictionary=Dictionary())
    for settings in SDMA_SETTINGS:
        args = argparse.Namespace(**settings)
        tiny_architecture(args)
        model = SDMATransformerModel.build_model(args, task)
        assert model.sdma_mode == settings["sdma_mode"]
        assert args.sdma_kl_weight is not None and args.sdma_clusters == 4  # the config's defaults
        assert len(model.encoder.layers) == 2 and model.encoder.embed_tokens.embedding_dim == 64  # tiny's


@pytest.mark.parametrize("settings", SDMA_SETTINGS, ids=lambda s: "-".join(s.values()))
def test_sdma_transformer(translation_data, settings):
    assert_sparse_namespace_builds_the_cli_model("sdma_transformer", translation_argv(translation_data),
                                                 {**TINY_TRANSFORMER, **settings})


@pytest.mark.parametrize("mode", ["none", "sdma"])
def test_bert_fused_transformer(tmp_path, mode):
    bert_dir = save_bert_fused_bert(tmp_path / "bert")
    data = write_bert_fused_data(tmp_path / "data", bert_dir)
    argv = [data, "--user-dir", USER_DIR, "--task", "translation", "--source-lang", "src", "--target-lang", "tgt"]
    assert_sparse_namespace_builds_the_cli_model("bert_fused_transformer", argv,
                                                 {**TINY_TRANSFORMER, "bert_dir": bert_dir, "sdma_mode": mode})


@pytest.mark.parametrize("model_name", ["qkvae", "advae"])
def test_sentence_vaes(small_vae_bin, model_name):
    argv = [small_vae_bin, "--user-dir", USER_DIR, "--task", "sentence_vae"]
    sizes = {**TINY_TRANSFORMER, "encoder_embed_dim": 32, "decoder_embed_dim": 32}
    assert_sparse_namespace_builds_the_cli_model(model_name, argv, sizes)


def test_optimus(corpus):  # noqa: F811
    argv = [corpus["data"], "--user-dir", USER_DIR, "--task", "optimus_lm"]
    assert_sparse_namespace_builds_the_cli_model("optimus", argv, {
        "bert_dir": corpus["bert"], "decoder_layers": 1, "decoder_embed_dim": 16, "decoder_attention_heads": 2,
        "decoder_ffn_embed_dim": 32, "latent_dim": 8}, recorded_by_build=[name for name, _ in BERT_SIZES])


@pytest.mark.parametrize("model_name, options", [
    ("hf_sentence_classifier", {}),
    ("tpr_classifier", TPR_TINY),
    ("bert_lstm_classifier", {"lstm_hidden": 8}),
])
def test_hf_sentence_models(bert, mrpc, model_name, options):  # noqa: F811
    argv = [mrpc, "--user-dir", USER_DIR, "--task", "hf_sentence_prediction", "--glue-task", "MRPC",
            "--hf-tokenizer-dir", bert, "--max-positions", "32"]
    assert_sparse_namespace_builds_the_cli_model(model_name, argv, {"hf_config": bert, **options})


def test_topic_vq_sts(bert, mrpc):  # noqa: F811
    argv = [mrpc, "--user-dir", USER_DIR, "--task", "topic_vq_sentence_prediction", "--glue-task", "MRPC",
            "--topic-features", "--hf-tokenizer-dir", bert, "--max-positions", "32"]
    assert_sparse_namespace_builds_the_cli_model("topic_vq_sts", argv, {"hf_config": bert, "num_topics": 4})


def test_every_registered_model_of_the_plugin_is_covered():
    plugin_models = {name for name, cls in MODEL_REGISTRY.items() if cls.__module__.startswith("user_dir.")}
    covered = {"sdma_transformer", "bert_fused_transformer", "qkvae", "advae", "optimus", "hf_sentence_classifier",
               "tpr_classifier", "bert_lstm_classifier", "topic_vq_sts"}
    assert plugin_models == covered
