"""``bert_fused_transformer``: BV-T and BSDMA-T of the SDMA paper (Tables II and III).

"The pre-trained BERT is incorporated to implement the BERT-fused V-T (BV-T) and SDMA-T
(BSDMA-T) with base model where the positional encoding and input/output embeddings are
replaced by BERT contextual embeddings [Zhu et al., ICLR 2020]" (Section IV-C). The model is
``sdma_transformer`` (same layers, same SDMA core, ``--sdma-mode {sdma,sma,none}``: BSDMA-T
is ``sdma``, BV-T ``none``) whose source side reads a local Hugging Face BERT-family
directory (``--bert-dir``, ``transformers.AutoModel``, never a download):

* ``--bert-fusion embed`` (default, the paper's description): BERT's contextual vector of
  each source token, projected to the model's width when the widths differ, replaces the
  source embedding and the positional encoding; the encoder has no source embedding table.
* ``--bert-fusion attention`` (Zhu et al.'s full BERT-fused model, beyond the paper's text):
  the encoder keeps its own embeddings, and every encoder and decoder layer also attends to
  BERT's (projected) output through an extra attention -- an SDMA attention in BSDMA-T --
  averaged with the layer's self-attention (encoder) or encoder-decoder attention (decoder):
  ``h = 1/2 (attn(x) + attn_B(x, H_B))``. Drop-net (``--bert-dropnet p``, Zhu et al.'s
  p_net = 1.0): in training, with probability p/2 only ``attn``, p/2 only ``attn_B``, else the
  average; the average at inference. Both branches are always computed (the one dropped is
  weighted 0), so every parameter has a gradient in every step and DDP needs no
  ``--find-unused-parameters``.

Source data are tokenised with BERT's own tokenizer and binarised with BERT's vocabulary as
the fairseq source dictionary (``prepare-translation --src-bert-dir DIR``); the model maps
each dictionary index to BERT's id once (fairseq's ``<s>``/``</s>``/``<pad>``/``<unk>`` to
``[CLS]``/``[SEP]``/``[PAD]``/``[UNK]``), puts ``[CLS]`` in front, feeds BERT right-padded
ids with its attention mask (fairseq pads sources on the left; BERT's absolute positions
must start at the first real piece) and puts the outputs back in fairseq's layout, so
padding never changes a real token's vector. Nothing of BERT's output is cached across
forward passes (within one beam search it travels in ``encoder_out``, reordered with it).

BERT is frozen by default (``--bert-finetune true`` trains it): its parameters do not
require gradients, it stays in eval mode (no dropout) and its weights are NOT written to
checkpoints -- they are re-read from ``--bert-dir`` (the saved path, or ``fairseq-generate
--model-overrides "{'bert_dir': 'DIR'}"``) and checked against a fingerprint saved with the
model. fairseq's own log line ``num. model params: X (num. trained: Y)`` then counts as the
paper does: Y excludes the frozen BERT (Table II: BV-T 39.5M, BSDMA-T 39.6M at base size).

Sources longer than BERT's positions (``max_position_embeddings`` minus ``[CLS]``) are
refused: the model's ``max_positions()`` says so to fairseq, which stops with its
"skip this example with --skip-invalid-size-inputs-valid-test" error, and
``prepare-translation --src-bert-dir`` refuses, truncates or skips them beforehand.
"""

import contextlib
import contextvars
import functools
import hashlib
import logging
import struct
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
from fairseq.dataclass import ChoiceEnum
from fairseq.models import register_model
from fairseq.models.transformer import TransformerConfig
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor

from pipelines.data.bert_source import load_tokenizer, max_source_pieces
from latent_core.errors import PluginConfigError, parse_bool
from latent_core.sdma import real_queries
from ..hf_pretrained import inspect_hf_directory
from ..hf_sentence.model import ENCODER_TYPES, load_pretrained_encoder
from ..model_config import add_config_args, model_options
from .fairseq_attention import SDMAMultiheadAttention
from .model import (
    IWSLT_BASE,
    TABLE_ONE,
    SDMADecoderLayer,
    SDMAEncoderLayer,
    SDMATransformerConfig,
    SDMATransformerDecoder,
    SDMATransformerEncoder,
    SDMATransformerModel,
    attention_kwargs,
    register_table_one,
    wrap_layer,
    sdma_options,
)

logger = logging.getLogger(__name__)

BERT_FUSIONS = ("embed", "attention")
# fairseq dictionary symbols that are not BERT tokens: fairseq-preprocess pads a dictionary it
# builds with these (never seen in data); they map to [UNK]
MADE_UP_PREFIX = "madeupword"


class BertFusedConfigError(PluginConfigError):
    """An impossible BERT-fusion option or a BERT directory / dictionary that does not fit."""


# ------------------------------------------------------------------------------ BERT side
def _check_bert_family(config: dict, where: str) -> None:
    model_type = config.get("model_type")
    if model_type not in ENCODER_TYPES:
        raise BertFusedConfigError(
            f"--bert-dir {where}: model_type {model_type!r} is not a BERT-family encoder "
            f"(supported: {', '.join(ENCODER_TYPES)})")


MOVED_HINT = ("a checkpoint keeps the path it was trained with; point fairseq-generate elsewhere with "
              "--model-overrides \"{'bert_dir': 'DIR'}\"")


def bert_token_ids(dictionary, tokenizer, bert_dir: str) -> Tensor:
    """BERT's id of every fairseq dictionary index, ``[len(dictionary)]``.

    fairseq's ``<s>``, ``</s>``, ``<pad>``, ``<unk>`` become the tokenizer's CLS, SEP, PAD
    and UNK; every other symbol must be a token of BERT's vocabulary (the dictionary that
    ``prepare-translation --src-bert-dir`` writes), else the data were binarised with
    another tokenizer and the error says so.
    """
    vocab = tokenizer.get_vocab()
    ids = torch.full((len(dictionary),), int(tokenizer.unk_token_id), dtype=torch.long)
    ids[dictionary.bos()] = tokenizer.cls_token_id
    ids[dictionary.eos()] = tokenizer.sep_token_id
    ids[dictionary.pad()] = tokenizer.pad_token_id
    ids[dictionary.unk()] = tokenizer.unk_token_id
    unknown = []
    for index in range(dictionary.nspecial, len(dictionary)):
        symbol = dictionary[index]
        if symbol in vocab:
            ids[index] = vocab[symbol]
        elif not symbol.startswith(MADE_UP_PREFIX):
            unknown.append(symbol)
    if unknown:
        raise BertFusedConfigError(
            f"--bert-dir {bert_dir}: {len(unknown)} of the {len(dictionary) - dictionary.nspecial} symbols of "
            f"the source dictionary are not tokens of this BERT's vocabulary (e.g. {unknown[:5]}): the source side was "
            f"binarised with another tokenizer; prepare it with prepare-translation --src-bert-dir {bert_dir}")
    return ids


def _fingerprint(module: nn.Module) -> Tensor:
    """SHA-256 of a module's float32 parameters (names and values) as four int64: which weights
    were used. Integer, so ``model.half()`` (fairseq's --fp16) leaves it as it is."""
    digest = hashlib.sha256()
    for name, parameter in module.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().float().cpu().contiguous().numpy().tobytes())
    return torch.tensor(struct.unpack("<4q", digest.digest()), dtype=torch.long)


class BertContext(nn.Module):
    """A local Hugging Face BERT-family encoder read over fairseq source tokens.

    ``forward(src_tokens [B, S]) -> [B, S, H]``: BERT's last hidden state of every source
    token in fairseq's layout (either padding side; zeros at padding), from one batched
    BERT pass over ``[CLS] tokens [SEP]`` (fairseq's appended ``</s>`` is BERT's ``[SEP]``),
    right-padded, with its attention mask. ``[CLS]``'s own vector is not returned.
    """

    def __init__(self, bert: nn.Module, token_ids: Tensor, padding_idx: int, bert_dir: str,
                 cls_id: int, bert_pad_id: int, finetune: bool = False):
        super().__init__()
        self.bert = bert
        self.bert_dir = bert_dir
        self.padding_idx = int(padding_idx)  # fairseq's
        self.cls_id, self.bert_pad_id = int(cls_id), int(bert_pad_id)  # BERT's
        self.finetune = bool(finetune)
        config = bert.config
        self.hidden_size = int(config.hidden_size)
        self.register_buffer("token_ids", token_ids, persistent=False)
        # pieces + </s> per source sentence: BERT's positions minus [CLS] (and RoBERTa's offset)
        self.max_source_positions = max_source_pieces(config.to_dict())
        self.register_buffer("bert_fingerprint", _fingerprint(bert), persistent=True)
        if not self.finetune:
            bert.requires_grad_(False)
            bert.eval()
            self.register_state_dict_post_hook(_drop_frozen_weights)
            self.register_load_state_dict_pre_hook(_restore_frozen_weights)

    def train(self, mode: bool = True):
        super().train(mode)
        if not self.finetune:
            self.bert.eval()  # a frozen BERT never runs its dropout
        return self

    def forward(self, src_tokens: Tensor) -> Tensor:
        real = src_tokens.ne(self.padding_idx)  # [B, S]
        lengths = real.sum(1)
        width = int(lengths.max()) + 1 if real.numel() else 1
        if width - 1 > self.max_source_positions:
            raise BertFusedConfigError(
                f"a source sentence has {width - 1} pieces (with </s>) but BERT at --bert-dir {self.bert_dir} "
                f"takes at most {self.max_source_positions} after [CLS]; shorten the data "
                f"(prepare-translation --src-bert-dir ... --truncate or --skip) or let fairseq skip them "
                f"(--skip-invalid-size-inputs-valid-test)")
        batch, rows = real.nonzero(as_tuple=True)
        slots = 1 + (real.long().cumsum(1) - 1)[batch, rows]  # BERT position of each real token
        ids = src_tokens.new_full((src_tokens.size(0), width), self.bert_pad_id)
        ids[:, 0] = self.cls_id
        ids[batch, slots] = self.token_ids[src_tokens[batch, rows]]
        attention_mask = (torch.arange(width, device=ids.device)[None, :] <= lengths[:, None]).long()
        with torch.set_grad_enabled(self.finetune and torch.is_grad_enabled()):
            hidden = self.bert(input_ids=ids, attention_mask=attention_mask).last_hidden_state  # [B, W, H]
        states = hidden.new_zeros(src_tokens.size(0), src_tokens.size(1), hidden.size(-1))
        states[batch, rows] = hidden[batch, slots]
        return states


def _restore_frozen_weights(context: "BertContext", state_dict, prefix, local_metadata, strict, missing_keys,
                            unexpected_keys, error_msgs) -> None:
    """A checkpoint of a frozen-BERT model has no BERT weights: take them from ``--bert-dir``,
    after checking that they are the ones the model was trained with."""
    saved = state_dict.get(prefix + "bert_fingerprint")
    has_weights = any(key.startswith(prefix + "bert.") for key in state_dict)
    if has_weights:
        return
    if saved is not None and not torch.equal(saved.cpu(), context.bert_fingerprint.cpu()):
        raise BertFusedConfigError(
            f"--bert-dir {context.bert_dir}: these BERT weights differ from the ones the checkpoint was trained "
            f"with (their SHA-256 fingerprints differ); " + MOVED_HINT)
    for key, value in context.bert.state_dict().items():
        state_dict[prefix + "bert." + key] = value


def _drop_frozen_weights(context: "BertContext", state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook of a frozen BERT's context: its weights stay in ``--bert-dir``, not in checkpoints."""
    for key in [k for k in state_dict if k.startswith(prefix + "bert.")]:
        del state_dict[key]


def build_bert_context(bert_dir: Optional[str], dictionary, finetune: bool) -> BertContext:
    """Load BERT and its tokenizer from ``bert_dir`` and map ``dictionary`` onto its vocabulary."""
    if not bert_dir:
        raise BertFusedConfigError("--bert-dir is required: a local Hugging Face BERT-family directory "
                                   "(save_pretrained() output with config.json, weights and tokenizer files)")
    try:
        inspect_hf_directory(bert_dir, "--bert-dir", BertFusedConfigError, validate=_check_bert_family)
    except BertFusedConfigError as error:
        raise BertFusedConfigError(f"{error}; {MOVED_HINT}") from None
    tokenizer = load_tokenizer(bert_dir, "--bert-dir")
    token_ids = bert_token_ids(dictionary, tokenizer, bert_dir)
    bert = load_pretrained_encoder(bert_dir, "--bert-dir")
    return BertContext(bert, token_ids, dictionary.pad(), bert_dir, tokenizer.cls_token_id,
                       tokenizer.pad_token_id, finetune)


# ------------------------------------------------------------------------- BERT attention
def dropnet_weights(p_net: float, training: bool) -> Tuple[float, float]:
    """Zhu et al.'s drop-net: weights of (the layer's own attention, the BERT attention)."""
    if training and p_net > 0:
        u = float(torch.rand(()))
        if u < p_net / 2:
            return 1.0, 0.0
        if u > 1 - p_net / 2:
            return 0.0, 1.0
    return 0.5, 0.5


# BERT's output H_B (``[S, B, E]``) and its padding mask (``[B, S]``) for the forward pass under way
_BERT_OUTPUT: contextvars.ContextVar[Tuple[Optional[Tensor], Optional[Tensor]]] = contextvars.ContextVar(
    "bert_fused_output", default=(None, None))


@contextlib.contextmanager
def bert_output(states: Tensor, padding_mask: Optional[Tensor]) -> Iterator[None]:
    """Every :class:`BertFusedAttention` called inside this scope attends to ``states`` (set by the
    encoder and the decoder around their layers; nested scopes restore the outer one)."""
    token = _BERT_OUTPUT.set((states, padding_mask))
    try:
        yield
    finally:
        _BERT_OUTPUT.reset(token)


class BertFusedAttention(nn.Module):
    """A layer's attention fused with an attention over BERT's output (Zhu et al., eq. 3/4).

    Called exactly like fairseq's ``MultiheadAttention`` by fairseq's own layers; returns
    ``(w_a attention(x) + w_b attention_B(x, H_B), attention(x)'s weights)`` with
    ``(w_a, w_b)`` from :func:`dropnet_weights`. ``H_B`` (``[S, B, E]``) and its padding mask
    (``[B, S]``) are set by the encoder/decoder for one forward pass (:func:`bert_output`).
    Both inner modules keep their own incremental state, so decoding step by step equals
    the full pass and beam reordering reaches both.
    """

    def __init__(self, attention: nn.Module, bert_attention: nn.Module, p_net: float):
        super().__init__()
        self.attention = attention
        self.bert_attention = bert_attention
        self.p_net = float(p_net)

    def recompute_context(self):
        """:func:`bert_output` with this forward pass's BERT output, for activation checkpointing's
        recomputation in backward (``model.regulariser_preserving_checkpoint``)."""
        return functools.partial(bert_output, *_BERT_OUTPUT.get())

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, need_weights=True,
                static_kv=False, attn_mask=None, before_softmax=False, need_head_weights=False):
        bert_states, bert_padding_mask = _BERT_OUTPUT.get()
        if bert_states is None:
            raise RuntimeError("BertFusedAttention called outside bert_output(): the encoder/decoder sets "
                               "BERT's output for each forward pass")
        # the queries of the attention over BERT's output are this layer's positions: in the
        # encoder they are the keys of the self-attention; the decoder layer sets its own
        queries = contextlib.nullcontext()
        if getattr(self.attention, "self_attention", False):
            queries = real_queries(None if key_padding_mask is None else ~key_padding_mask.to(torch.bool))
        with queries:
            out, weights = self.attention(
                query=query, key=key, value=value, key_padding_mask=key_padding_mask,
                incremental_state=incremental_state, need_weights=need_weights, static_kv=static_kv,
                attn_mask=attn_mask, before_softmax=before_softmax, need_head_weights=need_head_weights)
            if before_softmax:
                return out, weights
            bert_out, _ = self.bert_attention(
                query=query, key=bert_states, value=bert_states,
                key_padding_mask=bert_padding_mask, incremental_state=incremental_state,
                need_weights=False, static_kv=True)
        own, bert = dropnet_weights(self.p_net, self.training)
        return own * out + bert * bert_out, weights

    def extra_repr(self) -> str:
        return f"p_net={self.p_net}"


def fuse_with_bert(layer, attention: nn.Module, cfg, embed_dim: int, side: str) -> nn.Module:
    """``attention`` as it is (embed fusion), or wrapped with an attention over BERT's output
    (attention fusion): SDMA unless ``--sdma-mode none``."""
    if cfg.bert_fusion != "attention":
        return attention
    heads = getattr(cfg, side).attention_heads
    common = dict(kdim=embed_dim, vdim=embed_dim, encoder_decoder_attention=True, **attention_kwargs(layer, cfg))
    if cfg.sdma_mode == "none":
        bert = MultiheadAttention(embed_dim, heads, **common)
    else:
        bert = SDMAMultiheadAttention(embed_dim, heads, sdma=sdma_options(cfg, side), group=f"{side}_bert", **common)
    return BertFusedAttention(attention, bert, cfg.bert_dropnet)


class BertFusedEncoderLayer(SDMAEncoderLayer):
    def build_self_attention(self, embed_dim, cfg):
        return fuse_with_bert(self, super().build_self_attention(embed_dim, cfg), cfg, embed_dim, "encoder")


class BertFusedDecoderLayer(SDMADecoderLayer):
    def build_encoder_attention(self, embed_dim, cfg):
        return fuse_with_bert(self, super().build_encoder_attention(embed_dim, cfg), cfg, embed_dim, "decoder")


def fused_attentions(layers) -> List[BertFusedAttention]:
    return [m for layer in layers for m in layer.modules() if isinstance(m, BertFusedAttention)]


# --------------------------------------------------------------------- encoder / decoder
class BertFusedEncoder(SDMATransformerEncoder):
    """fairseq's (SDMA) transformer encoder over BERT's contextual source vectors.

    ``encoder_out`` is fairseq's dict plus ``bert_out`` (``[S, B, E]``, BERT's projected
    output) and ``bert_padding_mask`` (``[B, S]``) in attention fusion, reordered by
    :meth:`reorder_encoder_out` like the rest.
    """

    def __init__(self, cfg, dictionary, embed_tokens, bert: BertContext):
        super().__init__(cfg, dictionary, embed_tokens)
        self.fusion = cfg.bert_fusion
        self.bert = bert
        embed_dim = cfg.encoder.embed_dim
        self.bert_proj = nn.Linear(bert.hidden_size, embed_dim) if bert.hidden_size != embed_dim else None
        self.max_source_positions = min(self.max_source_positions, bert.max_source_positions)
        if self.fusion == "embed":
            # BERT replaces the source embedding and the positional encoding (no unused parameters)
            self.embed_tokens = None
            self.embed_positions = None
        self.fused = fused_attentions(self.layers)  # found once, not in every forward

    def build_encoder_layer(self, cfg):
        return wrap_layer(BertFusedEncoderLayer(cfg, return_fc=self.return_fc), cfg)

    def bert_states(self, src_tokens: Tensor) -> Tensor:
        """BERT's vectors of the source tokens at the model's width, ``[B, S, E]``."""
        states = self.bert(src_tokens)
        return states if self.bert_proj is None else self.bert_proj(states)

    def forward(self, src_tokens, src_lengths: Optional[Tensor] = None, return_all_hiddens: bool = False,
                token_embeddings: Optional[Tensor] = None):
        states = self.bert_states(src_tokens)
        if self.fusion == "embed":
            return self.forward_scriptable(src_tokens, src_lengths, return_all_hiddens, states)
        bert_out, padding_mask = states.transpose(0, 1), src_tokens.eq(self.padding_idx)
        with bert_output(bert_out, padding_mask):
            out = self.forward_scriptable(src_tokens, src_lengths, return_all_hiddens, token_embeddings)
        out["bert_out"] = [bert_out]
        out["bert_padding_mask"] = [padding_mask]
        return out

    def forward_embedding(self, src_tokens, token_embedding: Optional[Tensor] = None):
        if self.fusion != "embed":
            return super().forward_embedding(src_tokens, token_embedding)
        x = embedded = token_embedding  # BERT's vectors: no scaling, no positions
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x)
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        return x, embedded

    def reorder_encoder_out(self, encoder_out: Dict[str, List[Tensor]], new_order):
        reordered = super().reorder_encoder_out(encoder_out, new_order)
        if encoder_out.get("bert_out"):
            reordered["bert_out"] = [encoder_out["bert_out"][0].index_select(1, new_order)]
            reordered["bert_padding_mask"] = [encoder_out["bert_padding_mask"][0].index_select(0, new_order)]
        return reordered

    def max_positions(self):
        return self.max_source_positions


class BertFusedDecoder(SDMATransformerDecoder):
    """fairseq's (SDMA) transformer decoder; in attention fusion each layer also attends to BERT."""

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return wrap_layer(BertFusedDecoderLayer(cfg, no_encoder_attn), cfg)

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)
        self.fused = fused_attentions(self.layers)  # found once, not in every step

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                         full_context_alignment: bool = False, alignment_layer: Optional[int] = None,
                         alignment_heads: Optional[int] = None):
        if not self.fused:
            return super().extract_features(prev_output_tokens, encoder_out, incremental_state,
                                            full_context_alignment, alignment_layer, alignment_heads)
        if not encoder_out or not encoder_out.get("bert_out"):
            raise RuntimeError("the attention-fusion decoder needs encoder_out['bert_out'] from BertFusedEncoder")
        with bert_output(encoder_out["bert_out"][0], encoder_out["bert_padding_mask"][0]):
            return super().extract_features(prev_output_tokens, encoder_out, incremental_state,
                                            full_context_alignment, alignment_layer, alignment_heads)


# ----------------------------------------------------------------------------- the model
@dataclass
class BertFusedTransformerConfig(SDMATransformerConfig):
    """``bert_fused_transformer``: ``sdma_transformer``'s options and the BERT side's."""

    bert_dir: Optional[str] = field(default=None, metadata={
        "help": "local Hugging Face BERT-family directory (config.json, weights, tokenizer); model_type one of "
                + ", ".join(ENCODER_TYPES)})
    bert_fusion: ChoiceEnum(BERT_FUSIONS) = field(default="embed", metadata={
        "help": "'embed': BERT's vectors replace the source embeddings and positions (the paper); 'attention': "
                "Zhu et al.'s extra BERT attention in every layer"})
    bert_finetune: bool = field(default=False, metadata={
        "help": "train BERT too (else it is frozen: no gradients, no dropout, not saved in checkpoints)"})
    bert_dropnet: float = field(default=1.0, metadata={
        "help": "drop-net rate p_net of the attention fusion, in [0, 1] (the default is Zhu et al.'s)"})


@register_model("bert_fused_transformer", dataclass=BertFusedTransformerConfig)
class BertFusedTransformerModel(SDMATransformerModel):
    """BV-T (``--sdma-mode none``) and BSDMA-T (``--sdma-mode sdma``); see the module docstring."""

    def __prepare_scriptable__(self):
        raise BertFusedConfigError("torch.jit.script: bert_fused_transformer cannot be scripted (a Hugging Face "
                                   "BERT inside, state set around each forward); run it unscripted")

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, BertFusedTransformerConfig)

    @classmethod
    def build_model(cls, cfg, task):
        args = model_options(cls, cfg)
        validate_bert_args(args)
        model = super().build_model(args, task)  # SDMA's checks
        log_parameter_counts(model)
        return model

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        bert = build_bert_context(args.bert_dir, src_dict, args.bert_finetune)
        return BertFusedEncoder(cfg, src_dict, embed_tokens, bert)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return BertFusedDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


def parameter_counts(model: nn.Module) -> Dict[str, int]:
    """``trained`` (what the optimiser updates; the paper's count) and ``bert`` (all BERT parameters)."""
    bert = sum(p.numel() for p in model.encoder.bert.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trained": trained, "bert": bert, "total": sum(p.numel() for p in model.parameters())}


def log_parameter_counts(model: nn.Module) -> None:
    counts = parameter_counts(model)
    state = "fine-tuned, counted" if model.encoder.bert.finetune else "frozen, not counted"
    logger.info(f"bert_fused_transformer: {counts['trained']:,} trained parameters "
                f"(BERT {counts['bert']:,}, {state})")


def validate_bert_args(args) -> None:
    if args.bert_fusion not in BERT_FUSIONS:
        raise BertFusedConfigError(f"--bert-fusion={args.bert_fusion!r}: expected one of {', '.join(BERT_FUSIONS)}")
    try:
        args.bert_finetune = parse_bool(args.bert_finetune)
    except ValueError as error:
        raise BertFusedConfigError(f"--bert-finetune={args.bert_finetune!r}: {error}") from None
    dropnet = args.bert_dropnet
    if isinstance(dropnet, bool) or not isinstance(dropnet, (int, float)) or not 0.0 <= dropnet <= 1.0:
        raise BertFusedConfigError(f"--bert-dropnet={dropnet!r}: the drop-net rate p_net must be in [0, 1]")
    if getattr(args, "share_all_embeddings", False):
        raise BertFusedConfigError("--share-all-embeddings cannot be used: the source side is BERT's vocabulary "
                                   "and the target side the model's own (use --share-decoder-input-output-embed)")


# architecture -> its Table I row: the base rows of Tables II/III and the tiny one; the model's own
# name is the IWSLT'14 base (its config defaults)
BERT_FUSED_ARCHITECTURES = {
    "bert_fused_transformer": IWSLT_BASE,
    "bert_fused_transformer_iwslt_de_en": IWSLT_BASE,
    "bert_fused_transformer_wmt_en_de": TABLE_ONE["sdma_transformer_wmt_en_de"],
    "bert_fused_transformer_tiny": TABLE_ONE["sdma_transformer_iwslt_de_en_tiny"],
}
register_table_one("bert_fused_transformer", BERT_FUSED_ARCHITECTURES)
