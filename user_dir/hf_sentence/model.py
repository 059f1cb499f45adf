"""``hf_sentence_classifier``: a Hugging Face BERT/RoBERTa-family encoder inside fairseq.

``transformers.AutoModel`` (the bare encoder, its pooler removed: an unused module would
break fairseq's DDP) + a classification head (dropout, dense H -> H, tanh, dropout,
out_proj H -> C; fairseq's ``RobertaClassificationHead``) over the [CLS] vector
(``--pooling cls``) or the mean of the non-padding pieces (``--pooling mean``).

* ``--hf-model-dir DIR``: pre-trained weights, ``from_pretrained(DIR, local_files_only=True)``
  (checked first: config.json, a supported ``model_type``, a weights file; weights missing
  from the checkpoint are an error);
* ``--hf-config JSON_OR_DIR``: random weights from a config (a directory with config.json,
  a JSON file, or inline JSON text);
* ``--freeze-layers N``: freeze the embeddings and the first N layers (-1: the whole
  encoder; fairseq's optimizer skips parameters without gradients).

The options are the fields of :class:`HFSentenceClassifierConfig` (each default and help written
there once; subclasses extend it). The resolved config is recorded in the model's arguments
(``hf_backbone_config``), so a checkpoint rebuilds its encoder without the original directory.

Subclasses (e.g. the topic-VQ model) reuse the pieces: :meth:`build_backbone_and_head`
``(args, task) -> (backbone, head)`` (checks, encoder, a head over :meth:`head_input_size`
inputs, --freeze-layers; a subclass's ``build_model`` starts with ``args = model_options(cls, args)``, calls
it, then its constructor),
:meth:`build_backbone`, :meth:`encode` ``(net_input) -> (hidden [B, T, H], padding_mask
[B, T] True at padding)``, :meth:`pool` ``(hidden, net_input) -> [B, H]``,
:meth:`classify` ``([B, H]) -> [B, C]``, and :meth:`forward` ``(**net_input) -> (logits
[B, C], extra)``, where ``extra`` holds ``pooled``, ``hidden_states``, ``padding_mask`` and
may hold ``losses`` ({name: tensor}, added to the objective by the criterion) and ``stats``
(same form, only logged).
"""

import inspect
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models import BaseFairseqModel, register_model
from omegaconf import OmegaConf, open_dict
from torch import Tensor, nn

from latent_core.errors import PluginConfigError
from pipelines.data.bert_source import PADDING_OFFSET_POSITIONS

from ..hf_pretrained import inspect_hf_directory
from ..model_config import add_config_args, model_options

logger = logging.getLogger(__name__)

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "mpnet", "distilbert")
POOLINGS = ("cls", "mean")


class HFSentenceConfigError(PluginConfigError):
    """An impossible model option or Hugging Face directory (the message names which)."""


# ---------------------------------------------------------------------------- options
@dataclass
class HFSentenceClassifierConfig(FairseqDataclass):
    hf_model_dir: Optional[str] = field(
        default=None, metadata={"help": "local Hugging Face encoder directory with pre-trained weights "
                                        f"(model_type {', '.join(ENCODER_TYPES)})"})
    hf_config: Optional[str] = field(
        default=None, metadata={"help": "train from scratch: a directory with config.json, a JSON file or inline JSON"})
    pooling: ChoiceEnum(POOLINGS) = field(
        default="cls", metadata={"help": "sentence vector: the first piece ([CLS]) or the mean of the non-padding "
                                         "pieces"})
    pooler_dropout: Optional[float] = field(
        default=None, metadata={"help": "dropout of the classification head (unset: the config's hidden_dropout_prob)"})
    freeze_layers: int = field(
        default=0, metadata={"help": "freeze the embeddings and the first N encoder layers (0: none; -1: the whole "
                                     "encoder)"})
    hf_backbone_config: Optional[str] = field(
        default=None, metadata={"help": "written by the model, not an input: the encoder's resolved config (JSON), "
                                        "saved with checkpoints"})


def record_in_config(cfg, values: Dict[str, object]) -> None:
    """Write options a model set while building (:attr:`HFSentenceClassifier.RECORDED_OPTIONS`) into
    ``cfg``, the model config the task was handed: the one the trainer saves with every checkpoint
    (fairseq builds a dataclass model from a merged copy of it, which is not saved)."""
    try:
        if OmegaConf.is_config(cfg):
            with open_dict(cfg):
                for name, value in values.items():
                    cfg[name] = value
        else:
            for name, value in values.items():
                setattr(cfg, name, value)
    except (AttributeError, KeyError, ValueError):  # a read-only config
        logger.warning("could not record %s in the model configuration", ", ".join(values))


# ---------------------------------------------------------------------------- configs
def _check_model_type(config: dict, option: str, where: str) -> str:
    model_type = config.get("model_type")
    if model_type not in ENCODER_TYPES:
        raise HFSentenceConfigError(
            f"{option} {where}: model_type {model_type!r} is not a supported encoder "
            f"(supported: {', '.join(ENCODER_TYPES)})"
        )
    return model_type


def read_config(spec: str, option: str) -> dict:
    """config.json of a directory, a JSON file, or inline JSON text -> dict (checked)."""
    if spec.lstrip().startswith("{"):
        where, text = "(inline JSON)", spec
    else:
        where = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        if not os.path.isfile(where):
            problem = "no config.json" if os.path.isdir(spec) else "no such file or directory"
            raise HFSentenceConfigError(f"{option} {spec}: {problem}")
        with open(where, encoding="utf-8") as f:
            text = f.read()
    try:
        config = json.loads(text)
    except ValueError as error:
        raise HFSentenceConfigError(f"{option} {where}: not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise HFSentenceConfigError(f"{option} {where}: not a JSON object")
    _check_model_type(config, option, where)
    return config


def inspect_encoder_directory(path: str, option: str = "--hf-model-dir") -> dict:
    """Check a pre-trained directory before loading (config.json, model_type, weights)."""
    return inspect_hf_directory(path, option, HFSentenceConfigError,
                                validate=lambda config, where: _check_model_type(config, option, where))


def make_config(config: dict):
    from transformers import AutoConfig

    config = dict(config)
    return AutoConfig.for_model(config.pop("model_type"), **config)


def config_max_positions(config) -> int:
    """Pieces the encoder's position table holds (RoBERTa-style tables lose pad + 1 rows)."""
    positions = int(config.max_position_embeddings)
    if config.model_type in PADDING_OFFSET_POSITIONS:
        positions -= int(config.pad_token_id) + 1
    return positions


# --------------------------------------------------------------------------- backbone
def encoder_parts(backbone) -> Tuple[nn.Module, nn.ModuleList]:
    """(embeddings, list of transformer layers) of a supported encoder."""
    layers = getattr(getattr(backbone, "encoder", None), "layer", None)
    if layers is None:
        layers = getattr(getattr(backbone, "transformer", None), "layer", None)  # DistilBERT
    embeddings = getattr(backbone, "embeddings", None)
    if not isinstance(layers, nn.ModuleList) or embeddings is None:
        raise HFSentenceConfigError(f"--freeze-layers: cannot find the embeddings and layers of "
                                    f"{type(backbone).__name__}")
    return embeddings, layers


def freeze_layers(backbone, num_layers: int) -> int:
    """Freeze the embeddings and the first ``num_layers`` layers (-1: everything, 0: nothing);
    returns the number of frozen parameters."""
    if num_layers == 0:
        return 0
    if num_layers == -1:
        modules = [backbone]
    else:
        embeddings, layers = encoder_parts(backbone)
        if not 0 < num_layers <= len(layers):
            raise HFSentenceConfigError(f"--freeze-layers {num_layers}: the encoder has {len(layers)} layers "
                                        f"(0 = train all, -1 = freeze the whole encoder)")
        modules = [embeddings] + list(layers[:num_layers])
    frozen = 0
    for module in modules:
        for parameter in module.parameters():
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    return frozen


def load_pretrained_encoder(path: str, option: str = "--hf-model-dir"):
    """``AutoModel.from_pretrained(path)`` in float32, refusing missing weights (the pooler,
    removed afterwards, excepted)."""
    from transformers import AutoModel

    model, info = AutoModel.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                            dtype=torch.float32)
    missing = sorted(k for k in info.get("missing_keys") or [] if not k.startswith("pooler."))
    if missing:
        raise HFSentenceConfigError(f"{option} {path}: {len(missing)} weights of {type(model).__name__} are not "
                                    f"in the checkpoint (e.g. {missing[:5]}); is it the right architecture?")
    if info.get("mismatched_keys"):
        raise HFSentenceConfigError(f"{option} {path}: weights with mismatched shapes: "
                                    f"{sorted(map(str, info['mismatched_keys']))[:5]}")
    return model


class ClassificationHead(nn.Module):
    """dropout -> dense (H -> H) -> tanh -> dropout -> out_proj (H -> C): ``[B, H] -> [B, C]``."""

    def __init__(self, hidden_size: int, num_classes: int, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_classes)

    def forward(self, pooled: Tensor) -> Tensor:
        x = torch.tanh(self.dense(self.dropout(pooled)))
        return self.out_proj(self.dropout(x))


# ------------------------------------------------------------------------------ model
@register_model("hf_sentence_classifier", dataclass=HFSentenceClassifierConfig)
class HFSentenceClassifier(BaseFairseqModel):
    """Hugging Face encoder + classification head; see the module docstring."""

    # options the model sets while building, which the task writes into the saved config
    # (record_in_config): the encoder's config, to rebuild it without its weights from a checkpoint
    RECORDED_OPTIONS = ("hf_backbone_config",)

    def __init__(self, args, backbone, head: ClassificationHead, padding_idx: int):
        super().__init__()
        self.args = args
        self.backbone = backbone
        self.head = head
        self.padding_idx = int(padding_idx)
        self.pooling = str(args.pooling)
        config = backbone.config
        self.uses_token_types = ("token_type_ids" in inspect.signature(backbone.forward).parameters
                                 and int(getattr(config, "type_vocab_size", 0) or 0) > 1)

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, cls.config_class())

    @classmethod
    def config_class(cls):
        """The model's config dataclass (``register_model`` stores it on the class)."""
        return getattr(cls, "__dataclass")

    # ------------------------------------------------------------------ building
    @classmethod
    def build_backbone(cls, args, load_weights: bool = True):
        """The encoder (``transformers.PreTrainedModel``, pooler removed). Records its config in
        ``args.hf_backbone_config``; with ``load_weights=False`` (a checkpoint is about to be
        loaded) builds from that record or the directory's config.json, without weights."""
        from transformers import AutoModel

        model_dir, config_spec = getattr(args, "hf_model_dir", None), getattr(args, "hf_config", None)
        recorded = getattr(args, "hf_backbone_config", None)
        if model_dir and config_spec:
            raise HFSentenceConfigError("give --hf-model-dir (pre-trained) or --hf-config (from scratch), not both")
        if not load_weights and recorded:
            backbone = AutoModel.from_config(make_config(read_config(recorded, "hf_backbone_config")))
        elif model_dir:
            config = inspect_encoder_directory(model_dir, "--hf-model-dir")
            backbone = (load_pretrained_encoder(model_dir) if load_weights
                        else AutoModel.from_config(make_config(config)))
        elif config_spec:
            backbone = AutoModel.from_config(make_config(read_config(config_spec, "--hf-config")))
        else:
            raise HFSentenceConfigError("--arch hf_sentence_classifier needs --hf-model-dir DIR (pre-trained "
                                        "encoder) or --hf-config JSON_OR_DIR (random initialisation)")
        if getattr(backbone, "pooler", None) is not None:
            backbone.pooler = None  # unused: DDP needs every parameter to receive a gradient
        args.hf_backbone_config = backbone.config.to_json_string(use_diff=False)  # saved: RECORDED_OPTIONS
        return backbone.float()

    @classmethod
    def head_input_size(cls, args, backbone_config) -> int:
        """Size of the vector the classification head reads (a subclass that concatenates
        features to the pooled vector returns more)."""
        return int(backbone_config.hidden_size)

    @classmethod
    def build_backbone_and_head(cls, args, task) -> Tuple[nn.Module, ClassificationHead]:
        """Checks the options and the task, builds the encoder (with weights unless
        ``task.building_from_checkpoint``), the :class:`ClassificationHead` over
        :meth:`head_input_size` inputs, and applies ``--freeze-layers``."""
        for needed in ("tokenizer", "num_classes", "padding_idx"):
            if not hasattr(task, needed):
                arch = getattr(args, "arch", None) or getattr(args, "_name", None)
                raise TypeError(f"--arch {arch} needs a task with {needed} (--task hf_sentence_prediction)")
        if args.pooling not in POOLINGS:
            raise HFSentenceConfigError(f"--pooling {args.pooling!r}: choose {' or '.join(POOLINGS)}")
        backbone = cls.build_backbone(args, load_weights=not getattr(task, "building_from_checkpoint", False))
        config = backbone.config
        check_compatible(config, task)
        dropout = args.pooler_dropout
        if dropout is None:
            dropout = getattr(config, "hidden_dropout_prob", getattr(config, "dropout", 0.1))
        head = ClassificationHead(cls.head_input_size(args, config), task.num_classes, dropout)
        frozen = freeze_layers(backbone, args.freeze_layers)
        logger.info("%s encoder: %d layers, hidden %d; %s pooling; %d frozen parameters",
                    config.model_type, config.num_hidden_layers if hasattr(config, "num_hidden_layers")
                    else -1, config.hidden_size, args.pooling, frozen)
        return backbone, head

    @classmethod
    def build_model(cls, args, task):
        args = model_options(cls, args)
        backbone, head = cls.build_backbone_and_head(args, task)
        return cls(args, backbone, head, task.padding_idx)

    def max_positions(self) -> int:
        return config_max_positions(self.backbone.config)

    def recorded_options(self) -> Dict[str, object]:
        """The values of :attr:`RECORDED_OPTIONS` this model was built with."""
        return {name: getattr(self.args, name) for name in self.RECORDED_OPTIONS}

    # ------------------------------------------------------------------- forward
    def padding_mask(self, net_input: Dict[str, Tensor]) -> Tensor:
        """``[B, T]`` bool, True at padding (from ``attention_mask``, else the pad id)."""
        mask = net_input.get("attention_mask")
        if mask is None:
            return net_input["src_tokens"].eq(self.padding_idx)
        return mask.eq(0)

    def encode(self, net_input: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
        """-> (last hidden states ``[B, T, H]``, padding mask ``[B, T]`` True at padding)."""
        padding_mask = self.padding_mask(net_input)
        inputs = {"input_ids": net_input["src_tokens"], "attention_mask": (~padding_mask).long()}
        if self.uses_token_types and net_input.get("token_type_ids") is not None:
            inputs["token_type_ids"] = net_input["token_type_ids"]
        hidden = self.backbone(**inputs).last_hidden_state
        return hidden, padding_mask

    def pool(self, hidden: Tensor, net_input: Dict[str, Tensor]) -> Tensor:
        """``[B, T, H] -> [B, H]``: the first piece, or the mean over non-padding pieces."""
        if self.pooling == "cls":
            return hidden[:, 0]
        keep = (~self.padding_mask(net_input)).unsqueeze(-1).to(hidden.dtype)
        return (hidden * keep).sum(1) / keep.sum(1).clamp_min(1.0)

    def classify(self, pooled: Tensor) -> Tensor:
        """``[B, H] -> [B, C]`` logits (C = 1: regression scores)."""
        return self.head(pooled)

    def forward(self, **net_input) -> Tuple[Tensor, dict]:
        """``net_input`` of :class:`~user_dir.hf_sentence.data.HFSentenceDataset` (keys this
        model does not use are ignored) -> (logits ``[B, C]``, extra)."""
        hidden, padding_mask = self.encode(net_input)
        pooled = self.pool(hidden, net_input)
        return self.classify(pooled), {"pooled": pooled, "hidden_states": hidden, "padding_mask": padding_mask}


def check_compatible(config, task) -> None:
    """The task's tokenizer and --max-positions must fit the encoder."""
    tokenizer_size = len(task.tokenizer)
    if tokenizer_size > config.vocab_size:
        raise HFSentenceConfigError(
            f"the tokenizer (--hf-tokenizer-dir) has {tokenizer_size} tokens but the encoder's vocab_size is "
            f"{config.vocab_size}: tokenizer and model do not belong together")
    positions = config_max_positions(config)
    if task.max_positions() > positions:
        raise HFSentenceConfigError(f"--max-positions {task.max_positions()} exceeds the encoder's {positions} "
                                    f"positions (max_position_embeddings {config.max_position_embeddings})")
    if config.model_type in PADDING_OFFSET_POSITIONS and config.pad_token_id != task.padding_idx:
        raise HFSentenceConfigError(
            f"the tokenizer's pad id {task.padding_idx} differs from the encoder's pad_token_id "
            f"{config.pad_token_id} ({config.model_type} derives positions from it)")
