"""``sdma_transformer``: fairseq's transformer with SDMA in all three attentions.

The encoder self-attention, decoder self-attention and encoder-decoder attention
of fairseq's own transformer layers are swapped for
:class:`~user_dir.sdma.fairseq_attention.SDMAMultiheadAttention` through the
``build_*_attention`` hooks; everything else (embeddings, incremental decoding,
beam search, checkpointing) is fairseq's. ``--sdma-mode none`` gives the vanilla
transformer (V-T), ``sma`` SMA-T and ``sdma`` SDMA-T.
"""

import argparse
import contextlib
import functools
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.utils.checkpoint
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.distributed import fsdp_wrap
from fairseq.models import MODEL_DATACLASS_REGISTRY, register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from fairseq.models.transformer.transformer_decoder import module_name_fordropout as decoder_dropout_name
from fairseq.models.transformer.transformer_encoder import module_name_fordropout as encoder_dropout_name
from fairseq.modules import FairseqDropout
from fairseq.modules.checkpoint_activations import checkpoint_wrapper

from latent_core.errors import check_heads_divide, check_positive_int, option_flag
from latent_core.sdma import (
    ATTENTION_KERNELS,
    AUTHORS_SCRIPT_LOSS_WEIGHTS,
    READINGS,
    REMOVED_OPTIONS,
    SDMA_MODES,
    SMALLER_DISENTANGLEMENT_WEIGHTS,
    SDMAConfigError,
    SDMALossWeights,
    SDMAOptions,
    check_loss_weight,
    real_queries,
    removed_option_message,
)

from ..model_config import add_config_args, config_defaults, fill_unset, flat_transformer_fields, model_options
from .fairseq_attention import SDMAMultiheadAttention

SIDES = ("encoder", "decoder")
LOSS_WEIGHT_ARGS = tuple(SDMALossWeights().as_options())  # lambda_k, lambda_q, lambda_x, lambda_d of eq. (24)


def table_one_row(embed: int, ffn: int, heads: int, layers: int = 6, **sdma) -> Dict[str, object]:
    """One row of Table I as config fields: Embed / FFN, n_h and N on both sides, and the SDMA
    values where the row differs from the config's defaults."""
    sizes = {}
    for side in SIDES:
        sizes.update({f"{side}_embed_dim": embed, f"{side}_ffn_embed_dim": ffn,
                      f"{side}_attention_heads": heads, f"{side}_layers": layers})
    return {**sizes, **sdma}


# the loss-weight settings of latent_core.sdma as this model's config fields
SMALLER_DISENTANGLEMENT = {f"sdma_{name}": value for name, value in SMALLER_DISENTANGLEMENT_WEIGHTS.items()}
AUTHORS_SCRIPT_WEIGHTS = {f"sdma_{name}": value for name, value in AUTHORS_SCRIPT_LOSS_WEIGHTS.items()}
IWSLT_BASE = table_one_row(512, 1024, 4)
# architecture -> its fields: the rows of Table I. The model's own name is the IWSLT'14 base row
# (its config defaults); Zh-En has no script of the authors (Table I's weights in both readings).
TABLE_ONE = {
    "sdma_transformer": IWSLT_BASE,
    "sdma_transformer_iwslt_de_en": IWSLT_BASE,
    "sdma_transformer_iwslt_de_en_small": table_one_row(384, 1024, 4),
    "sdma_transformer_iwslt_de_en_tiny": table_one_row(256, 512, 4, **SMALLER_DISENTANGLEMENT),
    "sdma_transformer_wmt_en_de": table_one_row(512, 2048, 8),
    "sdma_transformer_wmt_en_de_small": table_one_row(384, 2048, 8),
    "sdma_transformer_wmt_en_de_tiny": table_one_row(256, 1024, 4, **SMALLER_DISENTANGLEMENT),
    "sdma_transformer_wmt_zh_en": table_one_row(512, 1024, 4, **SMALLER_DISENTANGLEMENT, sdma_centroid_grad_scale=5.0),
}
WITHOUT_AUTHORS_SCRIPT = ("sdma_transformer_wmt_zh_en",)

# fairseq's transformer options with the defaults of SDMA's IWSLT'14 base: Table I's row and dropout 0.3
# (the legacy base_architecture's other values are TransformerConfig's defaults)
SDMA_TRANSFORMER_DEFAULTS = {**IWSLT_BASE, "dropout": 0.3}
TransformerFields = make_dataclass("TransformerFields", flat_transformer_fields(SDMA_TRANSFORMER_DEFAULTS),
                                   bases=(FairseqDataclass,))


def core_field(core_dataclass, name: str, **default):
    """A config field documented by a field of a core dataclass (``latent_core.sdma``): its help
    text, and its default unless ``default=`` gives the fairseq model's own."""
    core = core_dataclass.__dataclass_fields__[name]
    return field(default=default.get("default", core.default), metadata={"help": core.metadata["help"]})


@dataclass
class SDMATransformerConfig(TransformerFields):
    """``sdma_transformer``: fairseq's transformer options (:data:`TransformerFields`) and SDMA's
    (``--sdma-*``; the help texts and most defaults are the core's, ``latent_core.sdma``). The
    defaults are Table I's IWSLT'14 base; the architectures override their rows' fields."""

    sdma_mode: ChoiceEnum(SDMA_MODES) = core_field(SDMAOptions, "mode")
    sdma_reading: ChoiceEnum(READINGS) = core_field(SDMAOptions, "reading")
    sdma_clusters: int = core_field(SDMAOptions, "clusters")  # Table I's 8/8: --sdma-clusters 8 --sdma-query-clusters 8
    sdma_query_clusters: int = core_field(SDMAOptions, "query_clusters")
    sdma_mix_max: float = core_field(SDMAOptions, "mix_max")
    sdma_mix_rate: float = core_field(SDMAOptions, "mix_rate")
    sdma_centroid_grad_scale: float = core_field(SDMAOptions, "centroid_grad_scale")
    sdma_noise_var: float = core_field(SDMAOptions, "noise_var")
    sdma_posterior_var: Optional[float] = core_field(SDMAOptions, "posterior_var")
    sdma_gmm_init: Optional[str] = core_field(SDMAOptions, "gmm_init")
    sdma_diversity_alpha: float = core_field(SDMAOptions, "diversity_alpha")
    sdma_diversity_beta: float = core_field(SDMAOptions, "diversity_beta")
    sdma_attention_kernel: ChoiceEnum(ATTENTION_KERNELS) = core_field(SDMAOptions, "attention_kernel")
    sdma_encoder_clusters: Optional[int] = field(
        default=None, metadata={"help": "n_c of the feature GMM in the encoder only (unset: --sdma-clusters)"})
    sdma_encoder_query_clusters: Optional[int] = field(
        default=None, metadata={"help": "n_c of the query GMM in the encoder only (unset: --sdma-query-clusters)"})
    sdma_decoder_clusters: Optional[int] = field(
        default=None, metadata={"help": "n_c of the feature GMM in the decoder only (unset: --sdma-clusters)"})
    sdma_decoder_query_clusters: Optional[int] = field(
        default=None, metadata={"help": "n_c of the query GMM in the decoder only (unset: --sdma-query-clusters)"})
    # eq. (24); an architecture's row may take the authors' scripts' values instead (register_table_one_row)
    sdma_kl_weight: float = core_field(SDMALossWeights, "kl_weight")
    sdma_dqq_weight: float = core_field(SDMALossWeights, "dqq_weight")
    sdma_dxq_weight: float = core_field(SDMALossWeights, "dxq_weight")
    sdma_diversity_weight: float = core_field(SDMALossWeights, "diversity_weight")
    sdma_decoder_mask_at_inference: bool = field(default=False, metadata={
        "help": "apply the decoder self-attention's semantic mask when not training (the paper drops it at "
                "test time; the encoder's and the cross-attention's keep theirs)"})


def sdma_options(cfg, side: str, mask_at_inference: bool = True) -> SDMAOptions:
    """Options of one side (``encoder`` / ``decoder``) from the flat model config: ``--sdma-<option>``,
    with ``--sdma-<side>-clusters`` / ``--sdma-<side>-query-clusters`` where given."""
    if side == "encoder":
        clusters, query_clusters = getattr(cfg, "sdma_encoder_clusters", None), getattr(cfg, "sdma_encoder_query_clusters", None)
    else:
        clusters, query_clusters = getattr(cfg, "sdma_decoder_clusters", None), getattr(cfg, "sdma_decoder_query_clusters", None)
    return SDMAOptions(
        mode=cfg.sdma_mode,
        reading=cfg.sdma_reading,
        clusters=cfg.sdma_clusters if clusters is None else clusters,
        query_clusters=cfg.sdma_query_clusters if query_clusters is None else query_clusters,
        mix_max=cfg.sdma_mix_max,
        mix_rate=cfg.sdma_mix_rate,
        centroid_grad_scale=cfg.sdma_centroid_grad_scale,
        noise_var=cfg.sdma_noise_var,
        posterior_var=cfg.sdma_posterior_var,
        gmm_init=cfg.sdma_gmm_init,
        diversity_alpha=cfg.sdma_diversity_alpha,
        diversity_beta=cfg.sdma_diversity_beta,
        attention_kernel=cfg.sdma_attention_kernel,
        mask_at_inference=mask_at_inference,
    )


def attention_kwargs(layer, cfg):
    return dict(
        dropout=cfg.attention_dropout,
        q_noise=layer.quant_noise,
        qn_block_size=layer.quant_noise_block_size,
    )


class SDMAEncoderLayer(TransformerEncoderLayerBase):
    def build_self_attention(self, embed_dim, cfg):
        if cfg.sdma_mode == "none":
            return super().build_self_attention(embed_dim, cfg)
        return SDMAMultiheadAttention(
            embed_dim,
            cfg.encoder.attention_heads,
            self_attention=True,
            sdma=sdma_options(cfg, "encoder"),
            group="encoder_self",
            **attention_kwargs(self, cfg),
        )


class SDMADecoderLayer(TransformerDecoderLayerBase):
    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if cfg.sdma_mode == "none":  # --cross-self-attention is refused for SMA/SDMA (validate_sdma_args)
            return super().build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn)
        return SDMAMultiheadAttention(
            embed_dim,
            cfg.decoder.attention_heads,
            self_attention=True,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            sdma=sdma_options(cfg, "decoder", mask_at_inference=cfg.sdma_decoder_mask_at_inference),
            group="decoder_self",
            **attention_kwargs(self, cfg),
        )

    def build_encoder_attention(self, embed_dim, cfg):
        if cfg.sdma_mode == "none":
            return super().build_encoder_attention(embed_dim, cfg)
        return SDMAMultiheadAttention(
            embed_dim,
            cfg.decoder.attention_heads,
            kdim=cfg.encoder.embed_dim,
            vdim=cfg.encoder.embed_dim,
            encoder_decoder_attention=True,
            sdma=sdma_options(cfg, "decoder"),
            group="decoder_cross",
            **attention_kwargs(self, cfg),
        )

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, incremental_state=None,
                prev_self_attn_state=None, prev_attn_state=None, self_attn_mask=None,
                self_attn_padding_mask=None, need_attn=False, need_head_weights=False):
        # cross-attention receives only the encoder's padding; its regularisers average over the
        # decoder's real positions (SDMAMultiheadAttention, or bert_fused.BertFusedAttention around one)
        valid = None if self_attn_padding_mask is None else ~self_attn_padding_mask.to(torch.bool)
        with real_queries(valid):
            return super().forward(
                x, encoder_out, encoder_padding_mask, incremental_state, prev_self_attn_state,
                prev_attn_state, self_attn_mask, self_attn_padding_mask, need_attn, need_head_weights,
            )


def _checkpointed_forward(original_forward, offload_to_cpu, *args, **kwargs):
    # state set around the layer for this forward pass (BERT's output), replayed in the recomputation
    contexts = [m.recompute_context() for m in original_forward.__self__.modules() if hasattr(m, "recompute_context")]

    def run(*inner_args, **inner_kwargs):
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            return original_forward(*inner_args, **inner_kwargs)

    # pinned host memory needs CUDA (without it the recomputation's saved tensors mismatched)
    offload = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if offload_to_cpu \
        else contextlib.nullcontext()
    with offload:
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


def regulariser_preserving_checkpoint(layer, offload_to_cpu=False):
    """``--checkpoint-activations`` (``--offload-activations``) for a layer with SDMA attention.

    fairseq's ``checkpoint_wrapper`` runs the first forward under ``no_grad`` and recomputes it in
    backward, so the regularisers the SDMA modules record in that forward (``SDMACore.record``)
    would reach the criterion without a graph: no gradient for the query GMMs, none of the
    regularisers' part anywhere. PyTorch's non-reentrant checkpoint builds the ordinary graph
    (the recorded terms keep theirs; ``SDMACore.record`` ignores the recomputation) and recomputes
    the saved activations in backward, with the RNG state of the first pass (same noise, same
    dropout); a module's ``recompute_context()`` (a context-manager factory taken at the forward
    pass) is entered around every call (``BertFusedAttention``'s BERT output). Same attribute as fairseq's wrapper
    (``precheckpoint_forward``), so ``fairseq.modules.checkpoint_activations.unwrap_checkpoint``
    undoes it; a ``functools.partial`` of the bound method, so ``copy.deepcopy`` (EMA) follows the copy.
    """
    layer.precheckpoint_forward = layer.forward
    layer.forward = functools.partial(_checkpointed_forward, layer.precheckpoint_forward, offload_to_cpu)
    return layer


def wrap_layer(layer, cfg):
    """fairseq's activation checkpointing / FSDP wrapping, as in its own build_*_layer (the vanilla
    transformer keeps fairseq's wrapper; SMA/SDMA layers :func:`regulariser_preserving_checkpoint`)."""
    if cfg.checkpoint_activations:
        wrap = checkpoint_wrapper if cfg.sdma_mode == "none" else regulariser_preserving_checkpoint
        layer = wrap(layer, offload_to_cpu=cfg.offload_activations)
    min_params_to_wrap = cfg.min_params_to_wrap if not cfg.checkpoint_activations else 0
    return fsdp_wrap(layer, min_num_params=min_params_to_wrap)


def use_fairseq_dropout_names(root: nn.Module) -> None:
    """Name every ``FairseqDropout`` under ``root`` as fairseq's own transformer names it.

    fairseq's ``--retain-dropout-modules`` matches ``FairseqDropout.module_name``, which each
    module sets from its own class (``TransformerEncoderLayerBase``, ``MultiheadAttention``,
    ``TransformerEncoder``, ...); the plugin's subclasses would carry theirs (``SDMAEncoderLayer``)
    and MC-dropout decoding of an SDMA model would silently keep no dropout. The owner's first
    fairseq class in its MRO gives the name (through fairseq's ``module_name_fordropout``).
    """
    for module in root.modules():
        for attr in ("dropout_module", "activation_dropout_module"):
            dropout = getattr(module, attr, None)
            if not isinstance(dropout, FairseqDropout):
                continue
            base = next(c for c in type(module).__mro__ if c.__module__.startswith("fairseq."))
            name = encoder_dropout_name(decoder_dropout_name(base.__name__))
            dropout.module_name = name


class SDMATransformerEncoder(TransformerEncoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, return_fc=False):
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        use_fairseq_dropout_names(self)

    def build_encoder_layer(self, cfg):
        if cfg.sdma_mode == "none":  # fairseq's own layer: the vanilla transformer, scriptable
            return wrap_layer(TransformerEncoderLayerBase(cfg, return_fc=self.return_fc), cfg)
        return wrap_layer(SDMAEncoderLayer(cfg, return_fc=self.return_fc), cfg)


class SDMATransformerDecoder(TransformerDecoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        use_fairseq_dropout_names(self)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        if cfg.sdma_mode == "none":
            return wrap_layer(TransformerDecoderLayerBase(cfg, no_encoder_attn), cfg)
        return wrap_layer(SDMADecoderLayer(cfg, no_encoder_attn), cfg)


class RemovedOption(argparse.Action):
    """A ``--sdma-*`` option the model no longer has (a key of :data:`latent_core.sdma.REMOVED_OPTIONS`): given
    on the command line, with or without a value, it is an :class:`SDMAConfigError` that says why; hidden from
    ``--help``. A checkpoint whose ``cfg.model`` still holds ``sdma_<name>`` loads as before: nothing reads the
    key (fairseq drops it when it merges the config into the model's dataclass, ``--arch sdma_transformer``;
    an architecture's config keeps it unread)."""

    def __init__(self, option_strings, dest, removed: str, **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.removed = removed

    def __call__(self, parser, namespace, values, option_string=None):
        raise SDMAConfigError(removed_option_message(option_string, self.removed, f"drop {option_string}"))


@register_model("sdma_transformer", dataclass=SDMATransformerConfig)
class SDMATransformerModel(TransformerModel):
    """Transformer with semantic and disentangled mask attention (Chien & Huang, 2024)."""

    # set by build_model: the eq. (24) weights of the architecture and options (the criterion's
    # defaults), and --sdma-mode
    sdma_loss_weights: Dict[str, float]
    sdma_mode: str

    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, SDMATransformerConfig)
        for name in REMOVED_OPTIONS:
            parser.add_argument(option_flag(f"sdma_{name}"), action=RemovedOption, removed=name)

    @classmethod
    def build_model(cls, cfg, task):
        args = model_options(cls, cfg)  # a sparse Namespace builds, as fairseq's
        validate_sdma_args(args)
        model = super().build_model(args, task)
        model.sdma_loss_weights = {name: float(getattr(args, name)) for name in LOSS_WEIGHT_ARGS}
        model.sdma_mode = args.sdma_mode
        return model

    def __prepare_scriptable__(self):
        """``torch.jit.script`` (fairseq's export, a scripted ``SequenceGenerator``): ``--sdma-mode none``
        is fairseq's transformer and scripts; SMA/SDMA attention does not (custom autograd functions,
        the options dataclass, state set around each forward)."""
        if getattr(self, "sdma_mode", "sdma") != "none":
            raise SDMAConfigError(
                f"torch.jit.script: a --sdma-mode {self.sdma_mode} model cannot be scripted (SMA/SDMA attention "
                "uses custom autograd functions); run it unscripted, or script a --sdma-mode none model")
        return self

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return SDMATransformerEncoder(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return SDMATransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


def validate_sdma_args(args) -> None:
    """Early, named errors for impossible SDMA settings."""
    for side in SIDES:
        check_heads_divide(f"--{side}-attention-heads", getattr(args, f"{side}_attention_heads"),
                           f"--{side}-embed-dim", getattr(args, f"{side}_embed_dim"), SDMAConfigError)
    if getattr(args, "sdma_mode", "sdma") != "none":
        if args.encoder_embed_dim != args.decoder_embed_dim:
            raise SDMAConfigError(
                f"--encoder-embed-dim={args.encoder_embed_dim} and --decoder-embed-dim={args.decoder_embed_dim} "
                "differ: SDMA's cross-attention clusters the encoder's keys with the decoder's feature GMM, so "
                "both sides need one width (set them equal, or --sdma-mode none)")
        if getattr(args, "cross_self_attention", False):
            raise SDMAConfigError(
                "--cross-self-attention is not implemented for SMA/SDMA attention (the decoder self-attention "
                "would attend over encoder states clustered by the decoder's GMM); drop it, or --sdma-mode none")
    for name in LOSS_WEIGHT_ARGS:
        check_loss_weight(name, getattr(args, name), option_flag(name))
    for flag, value in (("--sdma-encoder-clusters", getattr(args, "sdma_encoder_clusters", None)),
                        ("--sdma-encoder-query-clusters", getattr(args, "sdma_encoder_query_clusters", None)),
                        ("--sdma-decoder-clusters", getattr(args, "sdma_decoder_clusters", None)),
                        ("--sdma-decoder-query-clusters", getattr(args, "sdma_decoder_query_clusters", None))):
        if value is not None:
            check_positive_int(flag, value, SDMAConfigError, "the number of GMM clusters")
    for side in SIDES:
        sdma_options(args, side).validate()


def register_table_one_row(model_name: str, arch_name: str, row: Dict[str, object], authors_script: bool = True):
    """``--arch arch_name``: ``model_name``'s config with the fields of a Table I row, set where the
    command line (or a checkpoint's config) left them unset, the config defaults elsewhere.

    In the authors reading (``--sdma-reading authors``, the default) a row the authors trained with
    their scripts takes those scripts' loss weights (:data:`AUTHORS_SCRIPT_WEIGHTS`) instead of
    Table I's; the paper reading keeps Table I's. (``model_config.register_architecture`` has one set
    of overrides per architecture; here they depend on the reading the command line chose.)"""
    defaults = config_defaults(MODEL_DATACLASS_REGISTRY[model_name])
    table_one = {**defaults, **row}
    by_reading = {"paper": table_one, "authors": {**table_one, **(AUTHORS_SCRIPT_WEIGHTS if authors_script else {})}}

    def architecture(args):
        reading = getattr(args, "sdma_reading", None) or defaults["sdma_reading"]
        fill_unset(args, by_reading.get(reading, table_one))  # an unknown reading fails validation

    architecture.__name__ = arch_name
    architecture.__doc__ = f"{model_name} with Table I's {row}" + (
        f" ({AUTHORS_SCRIPT_WEIGHTS} in the authors reading)" if authors_script else "")
    register_model_architecture(model_name, arch_name)(architecture)
    return architecture


def register_table_one(model_name: str, rows: Dict[str, Dict[str, object]]) -> None:
    """Every row as an architecture of ``model_name``, but the model's own (its config defaults:
    fairseq registers the model name as an architecture that changes nothing)."""
    for arch_name, row in rows.items():
        if arch_name != model_name:
            register_table_one_row(model_name, arch_name, row, authors_script=arch_name not in WITHOUT_AUTHORS_SCRIPT)


register_table_one("sdma_transformer", TABLE_ONE)
