"""``sdma_transformer``: fairseq's transformer with SDMA in all three attentions.

The encoder self-attention, decoder self-attention and encoder-decoder attention
of fairseq's own transformer layers are swapped for
:class:`~user_dir.sdma.fairseq_attention.SDMAMultiheadAttention` through the
``build_*_attention`` hooks; everything else (embeddings, incremental decoding,
beam search, checkpointing) is fairseq's. ``--sdma-mode none`` gives the vanilla
transformer (V-T), ``sma`` SMA-T and ``sdma`` SDMA-T.
"""

from typing import Dict

from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.models.transformer.transformer_legacy import base_architecture
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper

from latent_core.sdma import (
    LOSS_WEIGHTS,
    SDMA_MODES,
    SDMAConfigError,
    SDMAOptions,
    check_loss_weight,
    collect_sdma_losses,
)
from .fairseq_attention import SDMAMultiheadAttention

# lambda_k, lambda_q, lambda_x, lambda_d of eq. (24); Table I defaults per architecture
LOSS_WEIGHT_ARGS = tuple(LOSS_WEIGHTS)


def sdma_options(cfg, side: str, mask_at_inference: bool = True) -> SDMAOptions:
    """Options of one side (``encoder`` / ``decoder``) from the flat model config."""
    clusters = getattr(cfg, f"sdma_{side}_clusters", None)
    query_clusters = getattr(cfg, f"sdma_{side}_query_clusters", None)
    return SDMAOptions(
        mode=cfg.sdma_mode,
        num_clusters=cfg.sdma_clusters if clusters is None else clusters,
        num_query_clusters=cfg.sdma_query_clusters if query_clusters is None else query_clusters,
        mix_max=cfg.sdma_mix_max,
        mix_rate=cfg.sdma_mix_rate,
        centroid_grad_scale=cfg.sdma_centroid_grad_scale,
        noise_var=cfg.sdma_noise_var,
        posterior_var=cfg.sdma_posterior_var,
        diversity_alpha=cfg.sdma_diversity_alpha,
        diversity_beta=cfg.sdma_diversity_beta,
        mask_at_inference=mask_at_inference,
    )


def _attention_kwargs(layer, cfg):
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
            **_attention_kwargs(self, cfg),
        )


class SDMADecoderLayer(TransformerDecoderLayerBase):
    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if cfg.sdma_mode == "none" or cfg.cross_self_attention:
            return super().build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn)
        return SDMAMultiheadAttention(
            embed_dim,
            cfg.decoder.attention_heads,
            self_attention=True,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            sdma=sdma_options(cfg, "decoder", mask_at_inference=cfg.sdma_decoder_mask_at_inference),
            group="decoder_self",
            **_attention_kwargs(self, cfg),
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
            **_attention_kwargs(self, cfg),
        )

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, incremental_state=None,
                prev_self_attn_state=None, prev_attn_state=None, self_attn_mask=None,
                self_attn_padding_mask=None, need_attn=False, need_head_weights=False):
        # cross-attention needs the decoder padding for its (query-side) losses
        cross = self.encoder_attn if isinstance(self.encoder_attn, SDMAMultiheadAttention) else None
        if cross is not None:
            cross.query_padding_mask = self_attn_padding_mask
        try:
            return super().forward(
                x, encoder_out, encoder_padding_mask, incremental_state, prev_self_attn_state,
                prev_attn_state, self_attn_mask, self_attn_padding_mask, need_attn, need_head_weights,
            )
        finally:
            if cross is not None:
                cross.query_padding_mask = None


def _wrap_layer(layer, cfg):
    """fairseq's activation checkpointing / FSDP wrapping, as in its own build_*_layer."""
    if cfg.checkpoint_activations:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    min_params_to_wrap = cfg.min_params_to_wrap if not cfg.checkpoint_activations else 0
    return fsdp_wrap(layer, min_num_params=min_params_to_wrap)


class SDMATransformerEncoder(TransformerEncoderBase):
    def build_encoder_layer(self, cfg):
        return _wrap_layer(SDMAEncoderLayer(cfg, return_fc=self.return_fc), cfg)


class SDMATransformerDecoder(TransformerDecoderBase):
    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return _wrap_layer(SDMADecoderLayer(cfg, no_encoder_attn), cfg)


@register_model("sdma_transformer")
class SDMATransformerModel(TransformerModel):
    """Transformer with semantic and disentangled mask attention (Chien & Huang, 2024)."""

    @classmethod
    def hub_models(cls):
        return {}

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        group = parser.add_argument_group("SDMA (semantic and disentangled mask attention)")
        group.add_argument("--sdma-mode", choices=SDMA_MODES,
                           help="sdma: SDMA-T; sma: SMA-T (no head disentanglement); none: vanilla (default: sdma)")
        group.add_argument("--sdma-clusters", type=int, metavar="N",
                           help="n_c of the feature GMM theta_z, eq. (5)/(9) (default 4: Tables II-IV; "
                                "Table I's IWSLT base 8 is Table V's n_c = 8 row)")
        group.add_argument("--sdma-query-clusters", type=int, metavar="N",
                           help="n_c of the query GMM theta_q, eq. (18) (default 4, as --sdma-clusters)")
        group.add_argument("--sdma-encoder-clusters", type=int, metavar="N",
                           help="feature clusters in the encoder only (default: --sdma-clusters)")
        group.add_argument("--sdma-decoder-clusters", type=int, metavar="N",
                           help="feature clusters in the decoder only (default: --sdma-clusters)")
        group.add_argument("--sdma-encoder-query-clusters", type=int, metavar="N",
                           help="query clusters in the encoder only (default: --sdma-query-clusters)")
        group.add_argument("--sdma-decoder-query-clusters", type=int, metavar="N",
                           help="query clusters in the decoder only (default: --sdma-query-clusters)")
        group.add_argument("--sdma-mix-max", type=float, metavar="NU",
                           help="nu, upper bound of the mixing weight of eq. (11), in (0, 1] (default: 0.9)")
        group.add_argument("--sdma-mix-rate", type=float, metavar="R",
                           help="g = 1 - max(1 - nu, exp(-R * num_updates)), eq. (11) (default: 5e-4)")
        group.add_argument("--sdma-centroid-grad-scale", type=float, metavar="C_G",
                           help="c_g: multiplier of the GMM means' gradient (Table I: 10; 5 for Zh-En)")
        group.add_argument("--sdma-noise-var", type=float, metavar="S2",
                           help="variance sigma^2 of the training-time sampling noise, eq. (8) (default: 0.01)")
        group.add_argument("--sdma-posterior-var", type=float, metavar="S2",
                           help="variance of q(z|x) and q(q|x) in the KL of eq. (20) (default: 0.1)")
        group.add_argument("--sdma-diversity-alpha", type=float, metavar="A",
                           help="alpha of the diversity mask, eq. (23) (default: 1.25)")
        group.add_argument("--sdma-diversity-beta", type=float, metavar="B",
                           help="beta of the diversity mask, eq. (23) (default: 0.75)")
        group.add_argument("--sdma-decoder-mask-at-inference", type=_str2bool, metavar="BOOL",
                           help="use the decoder self-attention's semantic mask when not training "
                                "(the paper drops it: default False)")
        group.add_argument("--sdma-kl-weight", type=float, metavar="W",
                           help="lambda_k of eq. (24) (Table I: 0.01)")
        group.add_argument("--sdma-dqq-weight", type=float, metavar="W",
                           help="lambda_q of eq. (24) (Table I: 100 base/small, 50 tiny/Zh-En)")
        group.add_argument("--sdma-dxq-weight", type=float, metavar="W",
                           help="lambda_x of eq. (24) (Table I: 10 base/small, 5 tiny/Zh-En)")
        group.add_argument("--sdma-diversity-weight", type=float, metavar="W",
                           help="lambda_d of eq. (24) (Table I: 1)")

    @classmethod
    def build_model(cls, args, task):
        sdma_base_architecture(args)
        validate_sdma_args(args)
        model = super().build_model(args, task)
        model.sdma_loss_weights = {name: float(getattr(args, name)) for name in LOSS_WEIGHT_ARGS}
        return model

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return SDMATransformerEncoder(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return SDMATransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)

    def sdma_losses(self) -> Dict[str, "torch.Tensor"]:
        """The regularisers of the last forward pass (see ``collect_sdma_losses``)."""
        return collect_sdma_losses(self)


def _str2bool(value):
    if isinstance(value, bool):
        return value
    lowered = str(value).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


def validate_sdma_args(args) -> None:
    """Early, named errors for impossible SDMA settings."""
    for side in ("encoder", "decoder"):
        dim = getattr(args, f"{side}_embed_dim")
        heads = getattr(args, f"{side}_attention_heads")
        if heads < 1 or dim % heads != 0:
            raise SDMAConfigError(
                f"--{side}-attention-heads={heads} must be >= 1 and divide --{side}-embed-dim={dim}"
            )
    for name in ("sdma_clusters", "sdma_query_clusters", "sdma_encoder_clusters", "sdma_decoder_clusters",
                 "sdma_encoder_query_clusters", "sdma_decoder_query_clusters"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise SDMAConfigError(f"--{name.replace('_', '-')}={value}: the number of clusters must be >= 1")
    for name in LOSS_WEIGHT_ARGS:
        check_loss_weight(name, getattr(args, name), "--" + name.replace("_", "-"))
    for side in ("encoder", "decoder"):
        sdma_options(args, side).validate()


def _set_default(args, name, value):
    if getattr(args, name, None) is None:
        setattr(args, name, value)


def sdma_base_architecture(args):
    """SDMA defaults (paper, Section IV-A3 and Table I, IWSLT'14 base) on top of fairseq's."""
    _set_default(args, "sdma_mode", "sdma")
    _set_default(args, "sdma_clusters", 4)
    _set_default(args, "sdma_query_clusters", 4)
    _set_default(args, "sdma_mix_max", 0.9)
    _set_default(args, "sdma_mix_rate", 5e-4)
    _set_default(args, "sdma_centroid_grad_scale", 10.0)
    _set_default(args, "sdma_noise_var", 0.01)
    _set_default(args, "sdma_posterior_var", 0.1)
    _set_default(args, "sdma_diversity_alpha", 1.25)
    _set_default(args, "sdma_diversity_beta", 0.75)
    _set_default(args, "sdma_decoder_mask_at_inference", False)
    _set_default(args, "sdma_kl_weight", 0.01)
    _set_default(args, "sdma_dqq_weight", 100.0)
    _set_default(args, "sdma_dxq_weight", 10.0)
    _set_default(args, "sdma_diversity_weight", 1.0)
    _set_default(args, "dropout", 0.3)
    base_architecture(args)


def _table_one(args, embed, ffn, heads, clusters, dqq, dxq, c_g=10.0, layers=6):
    """One row of Table I (Embed/FFN, N, n_h, n_c, lambda_q, lambda_x, c_g; lambda_k 0.01, lambda_d 1)."""
    for side in ("encoder", "decoder"):
        _set_default(args, f"{side}_embed_dim", embed)
        _set_default(args, f"{side}_ffn_embed_dim", ffn)
        _set_default(args, f"{side}_attention_heads", heads)
        _set_default(args, f"{side}_layers", layers)
    _set_default(args, "sdma_clusters", clusters)
    _set_default(args, "sdma_query_clusters", clusters)
    _set_default(args, "sdma_dqq_weight", dqq)
    _set_default(args, "sdma_dxq_weight", dxq)
    _set_default(args, "sdma_centroid_grad_scale", c_g)
    sdma_base_architecture(args)


# IWSLT'14 base: Table I lists n_c = 8/8, but Tables II-IV fix n_c = 4 (Section IV-C1; Table
# V's n_c = 4 row is Table II's SDMA-T base, 35.22 BLEU; the authors' IWSLT script passes
# --clusters 4). The default reproduces Table II; --sdma-clusters 8 --sdma-query-clusters 8
# is Table I's setting (Table V's n_c = 8 row).
@register_model_architecture("sdma_transformer", "sdma_transformer")
def sdma_transformer(args):
    _table_one(args, 512, 1024, 4, 4, 100.0, 10.0)


@register_model_architecture("sdma_transformer", "sdma_transformer_iwslt_de_en")
def sdma_transformer_iwslt_de_en(args):
    _table_one(args, 512, 1024, 4, 4, 100.0, 10.0)


@register_model_architecture("sdma_transformer", "sdma_transformer_iwslt_de_en_small")
def sdma_transformer_iwslt_de_en_small(args):
    _table_one(args, 384, 1024, 4, 4, 100.0, 10.0)


@register_model_architecture("sdma_transformer", "sdma_transformer_iwslt_de_en_tiny")
def sdma_transformer_iwslt_de_en_tiny(args):
    _table_one(args, 256, 512, 4, 4, 50.0, 5.0)


@register_model_architecture("sdma_transformer", "sdma_transformer_wmt_en_de")
def sdma_transformer_wmt_en_de(args):
    _table_one(args, 512, 2048, 8, 4, 100.0, 10.0)


@register_model_architecture("sdma_transformer", "sdma_transformer_wmt_en_de_small")
def sdma_transformer_wmt_en_de_small(args):
    _table_one(args, 384, 2048, 8, 4, 100.0, 10.0)


@register_model_architecture("sdma_transformer", "sdma_transformer_wmt_en_de_tiny")
def sdma_transformer_wmt_en_de_tiny(args):
    _table_one(args, 256, 1024, 4, 4, 50.0, 5.0)


@register_model_architecture("sdma_transformer", "sdma_transformer_wmt_zh_en")
def sdma_transformer_wmt_zh_en(args):
    _table_one(args, 512, 1024, 4, 4, 50.0, 5.0, c_g=5.0)
