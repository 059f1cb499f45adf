"""The model configs of the Hugging Face sentence models (``hf_sentence_classifier`` and its
extensions ``tpr_classifier``, ``bert_lstm_classifier``, ``topic_vq_sts``): one dataclass each.

* the hydra YAMLs of ``examples/hubert_tpr/config`` and ``examples/topic_vq_sts/config`` build the
  same model (config fields, parameters from one seed, optimizer) as the README's ``fairseq-train``
  commands, read from the README itself;
* every architecture resolves to its row of the paper's settings, also under hydra;
* ``--tpr-extra-layer false`` (a value-taking boolean) and old flat (Namespace) model configs work;
* impossible values raise the documented errors.

A tiny random BERT (2 layers, hidden 32, 130 positions: the recipes' 128 pieces fit) with 40
made-up topic words, and GLUE-layout files written here.
"""

import argparse
import re
import shlex

import pytest
import torch
from fairseq import checkpoint_utils, optim, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models import MODEL_DATACLASS_REGISTRY
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from conftest import REPO, save_tiny_bert
from model_configs import USER_DIR, assert_same_model, build_like_fairseq_train, build_like_hydra_train
from user_dir.hf_sentence.model import HFSentenceClassifier, HFSentenceClassifierConfig, HFSentenceConfigError
from user_dir.model_config import architecture_overrides, config_defaults
from user_dir.topic_vq.model import TopicVQSTSConfig, TopicVQSTSModel
from user_dir.tpr.model import BertLSTMClassifierConfig, TPRClassifier, TPRClassifierConfig
from user_dir.tpr.transfer import TPRTransferError

TOPIC_WORDS = ["q" + a + b for a in "bcdfghjk" for b in "aeiou"]  # 40 words, none a stop word
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "and", "a", "."] + TOPIC_WORDS
HUBERT_CONFIG = REPO / "examples/hubert_tpr/config"
TOPIC_VQ_CONFIG = REPO / "examples/topic_vq_sts/config"
TPR_TINY = ["--tpr-symbols", "6", "--tpr-roles", "4", "--tpr-symbol-dim", "4", "--tpr-role-dim", "4"]

# the paper's settings of each architecture (Moradshahi et al. 2019; Yu et al. 2022), written
# here apart from the model code
HUBERT = {"tpr_symbols": 50, "tpr_roles": 35, "tpr_symbol_dim": 32, "tpr_role_dim": 32, "tpr_temperature": 1.0,
          "tpr_encoder": "transformer", "tpr_aggregation": "concat", "tpr_orthogonality": 0.1, "tpr_scale": 1.0,
          "tpr_extra_layer": True, "pooling": "cls", "freeze_layers": 0}
ARCHITECTURES = {
    "hf_sentence_classifier": (HFSentenceClassifierConfig, {"pooling": "cls", "freeze_layers": 0}, {}),
    "tpr_classifier": (TPRClassifierConfig, HUBERT, {}),
    "tpr_classifier_plain": (TPRClassifierConfig, {**HUBERT, "tpr_extra_layer": False}, {"tpr_extra_layer": False}),
    "tpr_classifier_lstm": (TPRClassifierConfig, {**HUBERT, "tpr_encoder": "lstm", "tpr_extra_layer": False},
                            {"tpr_encoder": "lstm", "tpr_extra_layer": False}),
    "bert_lstm_classifier": (BertLSTMClassifierConfig, {"lstm_pooling": "last", "lstm_hidden": None}, {}),
    "topic_vq_sts": (TopicVQSTSConfig, {"topic_vq_stage": "sts", "num_topics": 40, "topic_embed_dim": 64,
                                        "vq_commitment": 1e-4, "ntm_gamma": 1.0, "codebook": "joint",
                                        "semantic_attention_layers": "last", "ablate": ""}, {}),
}


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A pre-trained (random, saved) tiny BERT directory: weights, config and tokenizer."""
    from transformers import BertConfig, BertModel

    path = save_tiny_bert(tmp_path_factory.mktemp("bert"), WORDS)
    config = BertConfig.from_pretrained(str(path))
    config.max_position_embeddings = 130
    torch.manual_seed(0)
    BertModel(config).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def mrpc(tmp_path_factory):
    """GLUE MRPC files (label, two ids, two sentences); every topic word 4 times in train.tsv."""
    path = tmp_path_factory.mktemp("mrpc")
    for split in ("train", "dev", "test"):
        rows = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
        for i in range(40):
            w = [TOPIC_WORDS[(4 * i + k) % 40] for k in range(4)]
            rows.append(f"{i % 2}\t{i}\t{100 + i}\tthe {w[0]} and a {w[1]} .\tthe {w[2]} and a {w[3]} .")
        (path / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    return path


def readme_command(readme: str, marker: str, substitutions: dict) -> list:
    """argv (after the program) of the README's ``fairseq-train`` command whose line holds ``marker``."""
    text = re.sub(r"\\\n\s*", " ", (REPO / readme).read_text())
    line = next(line for line in text.splitlines() if line.startswith("fairseq-train ") and marker in line)
    for old, new in substitutions.items():
        line = line.replace(old, str(new))
    return shlex.split(line, comments=True)[1:]


def model_fields(cfg, config_cls) -> dict:
    return {name: getattr(cfg, name) for name in config_defaults(config_cls)}


def same_fields(a, b, config_cls) -> None:
    assert {k: str(v) for k, v in model_fields(a, config_cls).items()} == \
        {k: str(v) for k, v in model_fields(b, config_cls).items()}


# ------------------------------------------------------------------------------ HUBERT
@pytest.mark.slow
def test_hubert_yaml_builds_the_readme_mnli_model(bert, tmp_path):
    # the recipe's 128 pieces would make the concat projection 128 * 1024 -> 1024: 16 here, on both sides
    argv = readme_command("examples/hubert_tpr/README.md", "--glue-task MNLI",
                          {"/data/glue/MNLI": tmp_path, "$BERT": bert, "--user-dir user_dir": f"--user-dir {USER_DIR}"})
    cli, cli_cfg = build_like_fairseq_train(argv + ["--max-positions", "16"])
    hydra, hydra_cfg = build_like_hydra_train(HUBERT_CONFIG, "mnli_hubert", [
        f"common.user_dir={USER_DIR}", f"task.data={tmp_path}", f"task.hf_tokenizer_dir={bert}",
        f"model.hf_model_dir={bert}", "+task.max_positions=16"])
    assert_same_model(cli, hydra)
    same_fields(cli.args, hydra.args, TPRClassifierConfig)
    assert isinstance(hydra, TPRClassifier) and hydra.extra_layer is not None
    for group, keys in {"task": ("glue_task", "hf_tokenizer_dir", "data", "max_positions"),
                        "dataset": ("batch_size", "valid_subset"),
                        "optimization": ("lr", "max_epoch", "update_freq"),
                        "lr_scheduler": ("_name", "warmup_updates", "total_num_update", "power", "end_learning_rate"),
                        "criterion": ("_name",),
                        "checkpoint": ("save_dir", "best_checkpoint_metric", "maximize_best_checkpoint_metric")}.items():
        for key in keys:
            assert str(getattr(hydra_cfg[group], key)) == str(getattr(cli_cfg[group], key)), (group, key)
    params = list(cli.parameters())
    cli_adamax, hydra_adamax = optim.build_optimizer(cli_cfg.optimizer, params), optim.build_optimizer(
        hydra_cfg.optimizer, params)
    assert type(cli_adamax) is type(hydra_adamax)
    assert cli_adamax.optimizer_config == hydra_adamax.optimizer_config


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_architecture_resolves_to_its_row(arch, bert, tmp_path):
    config_cls, row, overrides = ARCHITECTURES[arch]
    if overrides:
        assert architecture_overrides(arch) == overrides
    else:  # the model's own name: its config's defaults
        assert MODEL_DATACLASS_REGISTRY[arch] is config_cls
    task = "topic_vq_sentence_prediction" if arch == "topic_vq_sts" else "hf_sentence_prediction"
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(tmp_path), "--user-dir", str(USER_DIR), "--task", task, "--arch", arch, "--hf-model-dir", str(bert)])
    resolved = model_fields(convert_namespace_to_omegaconf(args).model, config_cls)  # what the model is built from
    assert resolved == {**config_defaults(config_cls), **row, "hf_model_dir": str(bert)}


def test_an_architecture_under_hydra_is_the_model_name_with_its_fields(bert, tmp_path):
    """A YAML names the model (fairseq-hydra-train ignores an architecture's overrides) and writes
    the architecture's fields under model: (as the YAML's header says)."""
    argv = readme_command("examples/hubert_tpr/README.md", "--glue-task MNLI",
                          {"/data/glue/MNLI": tmp_path, "$BERT": bert, "--user-dir user_dir": f"--user-dir {USER_DIR}"})
    argv = [a.replace("tpr_classifier", "tpr_classifier_lstm") for a in argv] + ["--max-positions", "16"]
    base = [f"common.user_dir={USER_DIR}", f"task.data={tmp_path}", f"task.hf_tokenizer_dir={bert}",
            f"model.hf_model_dir={bert}", "+task.max_positions=16"]
    lstm_fields = [f"++model.{k}={str(v).lower()}" for k, v in architecture_overrides("tpr_classifier_lstm").items()]
    cli, _ = build_like_fairseq_train(argv)
    hydra, _ = build_like_hydra_train(HUBERT_CONFIG, "mnli_hubert", base + lstm_fields)
    assert_same_model(cli, hydra)
    assert cli.extra_layer is None and cli.tpr.encoder == "lstm"


def hubert_argv(bert, data, *extra, arch="tpr_classifier"):
    return [data, "--user-dir", USER_DIR, "--task", "hf_sentence_prediction", "--glue-task", "MNLI",
            "--hf-tokenizer-dir", bert, "--max-positions", "16", "--arch", arch, "--hf-config", bert,
            *TPR_TINY, *extra]


@pytest.mark.slow
@pytest.mark.parametrize("flag, arch, extra_layer", [
    (["--tpr-extra-layer", "false"], "tpr_classifier", False), (["--tpr-extra-layer", "False"], "tpr_classifier", False),
    ([], "tpr_classifier", True), (["--tpr-extra-layer", "true"], "tpr_classifier_plain", True),
    (["--tpr-extra-layer"], "tpr_classifier_plain", True), ([], "tpr_classifier_plain", False),
    (["--tpr-extra-layer", "true"], "tpr_classifier_lstm", True)])
def test_tpr_extra_layer_takes_a_value(bert, tmp_path, flag, arch, extra_layer):
    model, cfg = build_like_fairseq_train(hubert_argv(bert, tmp_path, *flag, arch=arch))
    assert cfg.model.tpr_extra_layer is extra_layer
    assert (model.extra_layer is not None) is extra_layer


def test_an_old_flat_model_config_builds_the_same_model(bert, tmp_path):
    """What a checkpoint of the legacy add_args model saved as cfg.model: the whole Namespace, every
    option set by the architecture function, without the fields that are new (``tpr_transferred``)."""
    from fairseq import tasks

    argv = hubert_argv(bert, tmp_path, "--tpr-aggregation", "mean")
    current, cfg = build_like_fairseq_train(argv)
    legacy = options.parse_args_and_arch(options.get_training_parser(), [str(a) for a in argv])
    for name, value in config_defaults(TPRClassifierConfig).items():
        if getattr(legacy, name, None) is None and name != "tpr_transferred":
            setattr(legacy, name, value)
    legacy._name = "tpr_classifier"

    task = tasks.setup_task(cfg.task)
    torch.manual_seed(cfg.common.seed)
    assert_same_model(current, task.build_model(legacy))


def test_impossible_values_raise_the_documented_errors(bert, tmp_path):
    with pytest.raises(ValueError, match="--tpr-roles"):
        build_like_fairseq_train(hubert_argv(bert, tmp_path, "--tpr-roles", "0"))
    with pytest.raises(TPRTransferError, match="--tpr-transfer 'spam': unknown part"):
        build_like_fairseq_train(hubert_argv(bert, tmp_path, "--tpr-transfer-from", "x.pt", "--tpr-transfer", "spam"))
    with pytest.raises(SystemExit):  # argparse: invalid choice
        build_like_fairseq_train(hubert_argv(bert, tmp_path, "--tpr-aggregation", "sum"))
    with pytest.raises(ValidationError):
        build_like_hydra_train(HUBERT_CONFIG, "mnli_hubert", [
            f"common.user_dir={USER_DIR}", f"task.data={tmp_path}", f"task.hf_tokenizer_dir={bert}",
            f"model.hf_model_dir={bert}", "++model.tpr_aggregation=sum"])
    # a caller that builds the Namespace itself gets the model's own checks
    parser = argparse.ArgumentParser()
    TPRClassifier.add_args(parser)
    args = parser.parse_args(["--hf-config", str(bert)])
    args.tpr_aggregation = "sum"
    with pytest.raises(HFSentenceConfigError, match="--tpr-aggregation 'sum': choose from concat"):
        TPRClassifier.build_model(args, None)
    with pytest.raises(HFSentenceConfigError, match="needs --hf-model-dir DIR .* or --hf-config"):
        build_like_fairseq_train([tmp_path, "--user-dir", USER_DIR, "--task", "hf_sentence_prediction",
                                  "--glue-task", "MNLI", "--hf-tokenizer-dir", bert, "--arch", "hf_sentence_classifier"])
    with pytest.raises(HFSentenceConfigError, match="--freeze-layers 3: the encoder has 2 layers"):
        build_like_fairseq_train([tmp_path, "--user-dir", USER_DIR, "--task", "hf_sentence_prediction",
                                  "--glue-task", "MNLI", "--hf-tokenizer-dir", bert, "--arch", "bert_lstm_classifier",
                                  "--hf-model-dir", bert, "--freeze-layers", "3"])


def test_recorded_options_reach_the_config_fairseq_saves(bert, tmp_path):
    """The encoder config the model records (``hf_backbone_config``) is in cfg.model, which the
    trainer saves, also when fairseq built the model from a merged copy of it (--arch = model name)."""
    model, cfg = build_like_fairseq_train(hubert_argv(bert, tmp_path))
    assert model.args is not cfg.model and cfg.model.hf_backbone_config == model.args.hf_backbone_config
    assert '"hidden_size": 32' in cfg.model.hf_backbone_config


# ------------------------------------------------------------------------- topic VQ
STAGES = {  # YAML -> the README's command (the line holding the marker) and the checkpoint it saves
    "mrpc_1_ntm": ("--topic-vq-stage ntm", "ntm"),
    "mrpc_2_vqvae": ("--topic-vq-stage vqvae", "vqvae"),
    "mrpc_3_disbert": ("--best-checkpoint-metric f1", "disbert"),
}


@pytest.mark.slow
def test_topic_vq_yamls_build_the_readme_mrpc_models_stage_by_stage(bert, mrpc, tmp_path, monkeypatch):
    """Each stage initialises from the previous stage's checkpoint (--topic-vq-init, relative paths
    as in the README and the YAMLs): both ways load the same weights."""
    monkeypatch.chdir(tmp_path)
    for name, (marker, stage_dir) in STAGES.items():
        argv = readme_command("examples/topic_vq_sts/README.md", marker, {
            "/data/glue/MRPC": mrpc, "$BERT": bert, "$OUT": "checkpoints/topic_vq_MRPC",
            "--user-dir user_dir": f"--user-dir {USER_DIR}"})
        cli, cli_cfg = build_like_fairseq_train(argv)
        hydra, hydra_cfg = build_like_hydra_train(TOPIC_VQ_CONFIG, name, [
            f"common.user_dir={USER_DIR}", f"task.data={mrpc}", f"task.hf_tokenizer_dir={bert}",
            f"model.hf_model_dir={bert}"])
        assert_same_model(cli, hydra)
        same_fields(cli.args, hydra.args, TopicVQSTSConfig)
        assert isinstance(hydra, TopicVQSTSModel) and hydra.args.num_topics == 30
        for group, keys in {"task": ("_name", "glue_task", "max_positions", "topic_features", "hf_tokenizer_dir"),
                            "dataset": ("batch_size",), "optimization": ("lr", "max_epoch"),
                            "optimizer": ("_name", "adam_betas", "adam_eps", "weight_decay"),
                            "criterion": ("_name",),
                            "checkpoint": ("save_dir", "best_checkpoint_metric", "maximize_best_checkpoint_metric")
                            }.items():
            for key in keys:
                assert str(getattr(hydra_cfg[group], key)) == str(getattr(cli_cfg[group], key)), (name, group, key)
        saved = tmp_path / cli_cfg.checkpoint.save_dir / "checkpoint_best.pt"
        assert saved.parent.name == stage_dir
        saved.parent.mkdir(parents=True)
        torch.save({"model": hydra.state_dict(), "args": None, "extra_state": {},
                    "cfg": {"model": OmegaConf.to_container(hydra_cfg.model, enum_to_str=True)},
                    "last_optimizer_state": None, "optimizer_history": [
                        {"criterion_name": "HFSentencePredictionCriterion", "optimizer_name": "Adam",
                         "lr_scheduler_state": {"best": None}, "num_updates": 0}]}, str(saved))
        assert checkpoint_utils.load_checkpoint_to_cpu(str(saved))["cfg"]["model"].topic_vq_stage == \
            hydra.stage


def topic_argv(bert, mrpc, *extra):
    return [mrpc, "--user-dir", USER_DIR, "--task", "topic_vq_sentence_prediction", "--glue-task", "MRPC",
            "--topic-features", "--hf-tokenizer-dir", bert, "--max-positions", "32", "--arch", "topic_vq_sts",
            "--hf-config", bert, "--num-topics", "4", *extra]


def test_topic_vq_impossible_values_raise_the_documented_errors(bert, mrpc, tmp_path):
    with pytest.raises(HFSentenceConfigError, match="--ablate spam: unknown"):
        build_like_fairseq_train(topic_argv(bert, mrpc, "--ablate", "spam"))
    with pytest.raises(HFSentenceConfigError, match="--ntm-gamma -1"):
        build_like_fairseq_train(topic_argv(bert, mrpc, "--ntm-gamma", "-1"))
    with pytest.raises(ValueError, match="--num-topics 41 exceeds the 40-word topic vocabulary"):
        build_like_fairseq_train(topic_argv(bert, mrpc, "--num-topics", "41"))
    with pytest.raises(SystemExit):
        build_like_fairseq_train(topic_argv(bert, mrpc, "--codebook", "tied"))
    with pytest.raises(ValidationError):
        build_like_hydra_train(TOPIC_VQ_CONFIG, "mrpc_1_ntm", [
            f"common.user_dir={USER_DIR}", f"task.data={mrpc}", f"task.hf_tokenizer_dir={bert}",
            f"model.hf_model_dir={bert}", "++model.topic_vq_stage=pretrain"])
    args = argparse.Namespace(hf_config=str(bert), codebook="tied", num_topics=4)
    with pytest.raises(HFSentenceConfigError, match="--codebook 'tied': choose joint, multistage"):
        TopicVQSTSModel.build_model(args, type("Task", (), {"topic_vocabulary": object()})())


def test_options_are_defined_once_with_their_defaults():
    """Every option of these models is a field of its config (the command line adds exactly those);
    a help text never repeats its default."""
    for model, config_cls in ((HFSentenceClassifier, HFSentenceClassifierConfig), (TPRClassifier, TPRClassifierConfig),
                              (TopicVQSTSModel, TopicVQSTSConfig)):
        parser = argparse.ArgumentParser()
        model.add_args(parser)
        assert {a.dest for a in parser._actions if a.dest != "help"} == set(config_defaults(config_cls))
        for action in parser._actions:
            assert "default" not in (action.help or "").lower(), action.dest
