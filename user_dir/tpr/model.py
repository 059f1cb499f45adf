"""``tpr_classifier`` (HUBERT) and the ``bert_lstm_classifier`` baseline.

HUBERT (Moradshahi et al. 2019, arXiv:1910.12647): a Hugging Face encoder, the TPR
layer of :mod:`.head` over its final hidden states, an aggregation (eq. 5) and the
classification head of ``hf_sentence_classifier``. Architectures:

* ``tpr_classifier``: the paper's HUBERT (Transformer): n_S 50, n_R 35, d_S = d_R 32, T 1,
  ``--tpr-aggregation concat`` (the paper's best), lambda 0.1 (the paper gives no value), and
  the extra Transformer encoder layer over the TPR layer's (scaled) output that footnote 5
  says the reported results used (``--tpr-extra-layer``; not transferred, like the head);
* ``tpr_classifier_plain``: the same without that layer (the model as the paper describes it,
  and as "future versions" of the authors' model were to be);
* ``tpr_classifier_lstm``: HUBERT (LSTM), eq. (2) (no extra layer: footnote 5 is about the
  Transformer variant's results);
* ``bert_lstm_classifier``: BERT-LSTM (Section 4.2): a unidirectional LSTM over the token
  states, its last (``--lstm-pooling last``, the paper) or mean state -> the head.
  (The plain BERT baseline is ``hf_sentence_classifier``.)

Objective (eq. 6): CE_mean + lambda (||R R^T - I||_F^2 + ||R^T R - I||_F^2) per batch. The
model returns ``extra["losses"]["role_orthogonality"] = lambda * (term1 + term2)`` as a 0-d
tensor: the criterion treats a 0-d term as a per-example average, adds ``B *`` it to the
summed CE and fairseq divides by the sample size B, so each update minimises exactly
CE_mean + lambda * reg (also under --update-freq: sum_i B_i lambda reg / sum_i B_i).
``extra["stats"]`` logs the two terms (without lambda): ``role_orth_rrt``, ``role_orth_rtr``.
"""

import logging
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
from fairseq.dataclass import ChoiceEnum
from fairseq.models import register_model
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from latent_core.errors import check_positive_int

from ..hf_sentence.model import HFSentenceClassifier, HFSentenceClassifierConfig, HFSentenceConfigError
from ..model_config import model_options, register_architecture
from .head import (AGGREGATIONS, ENCODERS, Aggregation, TPRLayer, check_orthogonality,
                   warn_unreachable_orthogonality)
from .transfer import ALIASES, PARTS, apply_transfer_options

logger = logging.getLogger(__name__)
PART_NAMES = ", ".join(list(PARTS) + list(ALIASES))


@dataclass
class TPRClassifierConfig(HFSentenceClassifierConfig):
    """HUBERT (Transformer) as the paper gives it; the other architectures override fields."""

    tpr_symbols: int = field(default=50, metadata={"help": "number of symbols/fillers n_S"})
    tpr_roles: int = field(default=35, metadata={"help": "number of roles n_R"})
    tpr_symbol_dim: int = field(default=32, metadata={"help": "symbol size d_S"})
    tpr_role_dim: int = field(default=32, metadata={"help": "role size d_R"})
    tpr_temperature: float = field(default=1.0, metadata={"help": "softmax temperature T of eq. 4"})
    tpr_encoder: ChoiceEnum(ENCODERS) = field(
        default="transformer", metadata={"help": "filler/role paths: transformer (eq. 3) or lstm (eq. 2)"})
    tpr_aggregation: ChoiceEnum(AGGREGATIONS) = field(
        default="concat", metadata={"help": "eq. 5: concat (all tokens, then a linear projection; the paper's best), "
                                            "mean, max, first"})
    tpr_concat_dim: Optional[int] = field(
        default=None, metadata={"help": "output size of the concat projection (unset: d_S * d_R)"})
    tpr_orthogonality: float = field(default=0.1, metadata={"help": "lambda of eq. 6 (the paper gives no value)"})
    tpr_heads: Optional[int] = field(
        default=None, metadata={"help": "attention heads of the TPR transformer paths (unset: the encoder's)"})
    tpr_dropout: Optional[float] = field(
        default=None, metadata={"help": "dropout of the TPR transformer paths (unset: the config's "
                                        "hidden_dropout_prob)"})
    tpr_scale: float = field(
        default=1.0, metadata={"help": "initial value of the trainable scale of the bound values (the paper used "
                                       "~1000 for the LSTM variant)"})
    tpr_extra_layer: bool = field(
        default=True, metadata={"help": "a Transformer encoder layer over the TPR output before the aggregation "
                                        "(footnote 5; off in tpr_classifier_plain and _lstm); its heads: the largest "
                                        "divisor of d_S * d_R not above the encoder's heads, its FFN size the "
                                        "encoder's intermediate size"})
    tpr_transfer_from: Optional[str] = field(default=None, metadata={"help": "source checkpoint for --tpr-transfer"})
    tpr_transfer: Optional[str] = field(
        default=None, metadata={"help": f"comma-separated parts to copy: {PART_NAMES}"})
    tpr_freeze: Optional[str] = field(default=None, metadata={"help": f"comma-separated parts to freeze: {PART_NAMES}"})
    tpr_transferred: Optional[str] = field(
        default=None, metadata={"help": "written by the model, not an input: SOURCE|part:tensors,... of "
                                        "--tpr-transfer, saved with checkpoints"})


@register_model("tpr_classifier", dataclass=TPRClassifierConfig)
class TPRClassifier(HFSentenceClassifier):
    """Encoder -> TPR layer -> aggregation -> classification head (module docstring)."""

    # the transfer (--tpr-transfer) sets tpr_transferred while building: saved, so that a checkpoint
    # of the transferred model does not copy the source's parameters again
    RECORDED_OPTIONS = HFSentenceClassifier.RECORDED_OPTIONS + ("tpr_transferred",)

    def __init__(self, args, backbone, head, padding_idx: int, tpr: TPRLayer, aggregate: Aggregation,
                 extra_layer: Optional[nn.Module] = None):
        super().__init__(args, backbone, head, padding_idx)
        self.tpr, self.aggregate = tpr, aggregate
        self.extra_layer = extra_layer
        self.orthogonality = float(args.tpr_orthogonality)

    @classmethod
    def head_input_size(cls, args, backbone_config) -> int:
        size = args.tpr_symbol_dim * args.tpr_role_dim
        if args.tpr_aggregation == "concat":
            return args.tpr_concat_dim or size
        return size

    @classmethod
    def build_model(cls, args, task):
        args = model_options(cls, args)
        validate_tpr_args(args)
        backbone, head = cls.build_backbone_and_head(args, task)
        config = backbone.config
        dropout = args.tpr_dropout
        if dropout is None:
            dropout = getattr(config, "hidden_dropout_prob", 0.1)
        tpr = TPRLayer(config.hidden_size, args.tpr_symbols, args.tpr_roles, args.tpr_symbol_dim, args.tpr_role_dim,
                       args.tpr_temperature, str(args.tpr_encoder), args.tpr_heads or config.num_attention_heads,
                       dropout, getattr(config, "intermediate_size", None), args.tpr_scale)
        aggregate = Aggregation(str(args.tpr_aggregation), tpr.output_size, task.max_positions(),
                                cls.head_input_size(args, config))
        warn_unreachable_orthogonality(args.tpr_roles, args.tpr_role_dim, args.tpr_orthogonality)
        extra_layer = None
        if args.tpr_extra_layer:
            heads = max(h for h in range(1, (args.tpr_heads or config.num_attention_heads) + 1)
                        if tpr.output_size % h == 0)
            extra_layer = nn.TransformerEncoderLayer(
                tpr.output_size, heads, getattr(config, "intermediate_size", None) or 4 * tpr.output_size,
                dropout, batch_first=True)
        model = cls(args, backbone, head, task.padding_idx, tpr, aggregate, extra_layer)
        apply_transfer_options(model, args, getattr(task, "building_from_checkpoint", False))
        logger.info("TPR head: %s paths, n_S %d, n_R %d, d_S %d, d_R %d, T %g, %s aggregation, lambda %g, "
                    "extra layer %s", args.tpr_encoder, args.tpr_symbols, args.tpr_roles, args.tpr_symbol_dim,
                    args.tpr_role_dim, args.tpr_temperature, args.tpr_aggregation, args.tpr_orthogonality,
                    "yes" if extra_layer is not None else "no")
        return model

    def forward(self, **net_input) -> Tuple[Tensor, dict]:
        hidden, padding_mask = self.encode(net_input)
        out = self.tpr(hidden, padding_mask)
        x = out.x
        if self.extra_layer is not None:  # footnote 5: on the scaled TPR output
            x = self.extra_layer(x, src_key_padding_mask=padding_mask)
            x = x.masked_fill(padding_mask.unsqueeze(-1), 0.0)
        pooled = self.aggregate(x, padding_mask)
        term1, term2 = self.tpr.orthogonality()
        extra = {"pooled": pooled, "hidden_states": hidden, "padding_mask": padding_mask, "tpr": out,
                 "stats": {"role_orth_rrt": term1.detach(), "role_orth_rtr": term2.detach()}}
        if self.orthogonality > 0 and self.tpr.R.requires_grad:
            # 0-d = per-example average for the criterion: objective CE_mean + lambda * reg (eq. 6)
            extra["losses"] = {"role_orthogonality": self.orthogonality * (term1 + term2)}
        return self.classify(pooled), extra


    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        has_extra = any(k.startswith("extra_layer.") for k in state_dict)
        if strict and self.extra_layer is not None and not has_extra and "tpr.R" in state_dict:
            raise HFSentenceConfigError(
                "this checkpoint has no footnote-5 extra layer (trained with --tpr-extra-layer false, or before "
                "the option existed) but the model was built with one: load it with "
                "--model-overrides \"{'tpr_extra_layer': False}\"")
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


def validate_tpr_args(args) -> None:
    for option, name in (("--tpr-symbols", "tpr_symbols"), ("--tpr-roles", "tpr_roles"),
                         ("--tpr-symbol-dim", "tpr_symbol_dim"), ("--tpr-role-dim", "tpr_role_dim")):
        check_positive_int(option, getattr(args, name))
    if args.tpr_heads is not None:
        check_positive_int("--tpr-heads", args.tpr_heads)
    if args.tpr_concat_dim is not None:
        check_positive_int("--tpr-concat-dim", args.tpr_concat_dim)
    check_orthogonality(args.tpr_orthogonality)
    if args.tpr_encoder not in ENCODERS:
        raise HFSentenceConfigError(f"--tpr-encoder {args.tpr_encoder!r}: choose {' or '.join(ENCODERS)}")
    if args.tpr_aggregation not in AGGREGATIONS:
        raise HFSentenceConfigError(f"--tpr-aggregation {args.tpr_aggregation!r}: choose from {', '.join(AGGREGATIONS)}")
    if args.tpr_dropout is not None and not 0 <= args.tpr_dropout < 1:
        raise HFSentenceConfigError(f"--tpr-dropout {args.tpr_dropout!r} must lie in [0, 1)")


# tpr_classifier (the model's own name) is the paper's HUBERT (Transformer): the config's defaults
tpr_classifier_plain = register_architecture("tpr_classifier", "tpr_classifier_plain", tpr_extra_layer=False)
tpr_classifier_lstm = register_architecture("tpr_classifier", "tpr_classifier_lstm", tpr_encoder="lstm",
                                            tpr_extra_layer=False)


# ------------------------------------------------------------------- BERT-LSTM baseline
LSTM_POOLINGS = ("last", "mean")


@dataclass
class BertLSTMClassifierConfig(HFSentenceClassifierConfig):
    lstm_hidden: Optional[int] = field(default=None, metadata={"help": "LSTM size (unset: the encoder's hidden size)"})
    lstm_pooling: ChoiceEnum(LSTM_POOLINGS) = field(
        default="last", metadata={"help": "the LSTM's last state (the paper) or the mean of its states"})


@register_model("bert_lstm_classifier", dataclass=BertLSTMClassifierConfig)
class BertLSTMClassifier(HFSentenceClassifier):
    """BERT-LSTM (Section 4.2): encoder -> unidirectional LSTM over the non-padding token
    states -> final (or mean) LSTM state ``[B, --lstm-hidden]`` -> classification head."""

    def __init__(self, args, backbone, head, padding_idx: int):
        super().__init__(args, backbone, head, padding_idx)
        self.lstm = nn.LSTM(backbone.config.hidden_size, args.lstm_hidden, batch_first=True)
        self.lstm_pooling = str(args.lstm_pooling)

    @classmethod
    def head_input_size(cls, args, backbone_config) -> int:
        if args.lstm_hidden is None:
            args.lstm_hidden = int(backbone_config.hidden_size)
        return args.lstm_hidden

    @classmethod
    def build_model(cls, args, task):
        args = model_options(cls, args)
        if args.lstm_hidden is not None:
            check_positive_int("--lstm-hidden", args.lstm_hidden)
        if args.lstm_pooling not in LSTM_POOLINGS:
            raise HFSentenceConfigError(f"--lstm-pooling {args.lstm_pooling!r}: choose last or mean")
        backbone, head = cls.build_backbone_and_head(args, task)
        return cls(args, backbone, head, task.padding_idx)

    def forward(self, **net_input) -> Tuple[Tensor, dict]:
        hidden, padding_mask = self.encode(net_input)
        keep = ~padding_mask
        lengths = keep.sum(1).clamp_min(1)
        # gather the non-padding states to the left (any padding layout), then pack
        order = torch.sort(keep.to(torch.int8), dim=1, descending=True, stable=True).indices
        left = hidden.gather(1, order.unsqueeze(-1).expand_as(hidden))
        packed = pack_padded_sequence(left, lengths.cpu(), batch_first=True, enforce_sorted=False)
        states, (h_n, _) = self.lstm(packed)
        if self.lstm_pooling == "last":
            pooled = h_n[-1]
        else:
            states, _ = pad_packed_sequence(states, batch_first=True, total_length=hidden.size(1))
            pooled = states.sum(1) / lengths.unsqueeze(-1).to(states.dtype)
        return self.classify(pooled), {"pooled": pooled, "hidden_states": hidden, "padding_mask": padding_mask}
