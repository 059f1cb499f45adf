"""Transformer encoder with SDMA self-attention (ESPnet2 ``encoder: sdma_transformer``)."""

from typing import Any, Dict, List, Optional, Tuple

import torch
from espnet2.asr.ctc import CTC
from espnet2.asr.encoder.transformer_encoder import TransformerEncoder
from espnet.nets.pytorch_backend.transformer.embedding import PositionalEncoding
from typeguard import typechecked

from espnet_plugin.asr.sdma_attention import (
    SDMAMultiHeadedAttention,
    check_features,
    encoder_sdma_options,
)


class SDMATransformerEncoder(TransformerEncoder):
    """ESPnet2's ``TransformerEncoder`` whose self-attentions are SDMA attentions.

    Everything but the attention is ESPnet's own (subsampling, positional encoding,
    feed-forward, layer norm, intermediate CTC), so a ``transformer`` encoder config
    becomes an SDMA one by changing ``encoder:`` and adding an ``sdma_conf`` block: every
    keyword of ESPnet's ``TransformerEncoder`` is accepted with ESPnet's default (``qk_norm``
    normalises q and k before SDMA's scores), except ``use_flash_attn``, whose default here is
    ESPnet's for ``sdma_conf.mode: none`` and off for SMA/SDMA (``true`` is refused there:
    flash_attn cannot apply the semantic mask).

    Args (besides those of ``TransformerEncoder``):
        sdma_conf: SDMA options, keyed by the option names of
            :class:`latent_core.sdma.SDMAOptions` (``mode``: ``sdma`` / ``sma`` / ``none``
            = ESPnet's plain attention, ``clusters``, ``query_clusters``, ``mix_max``,
            ``mix_rate``, ``centroid_grad_scale``, ``noise_var``, ``posterior_var``, ``gmm_init``,
            ``diversity_alpha``, ``diversity_beta``, ``mask_at_inference``); documented and
            defaulted there, on top of ``AISHELL_ENCODER_PRESET`` (the authors' Aishell-1 run:
            8 feature and 8 query clusters, c_g = 5). Unknown keys are refused by name.

    Shapes: ``forward(xs_pad (B, L, input_size), ilens (B,))`` ->
    ``(B, L', output_size), (B,), None`` (L' after subsampling).
    """

    @typechecked
    def __init__(
        self,
        input_size: int,
        output_size: int = 256,
        attention_heads: int = 4,
        linear_units: int = 2048,
        num_blocks: int = 6,
        dropout_rate: float = 0.1,
        positional_dropout_rate: float = 0.1,
        attention_dropout_rate: float = 0.0,
        input_layer: Optional[str] = "conv2d",
        pos_enc_class=PositionalEncoding,
        pos_enc_layer_type: str = "abs_pos",
        normalize_before: bool = True,
        concat_after: bool = False,
        positionwise_layer_type: str = "linear",
        positionwise_conv_kernel_size: int = 1,
        padding_idx: int = -1,
        interctc_layer_idx: List[int] = [],
        interctc_use_conditioning: bool = False,
        layer_drop_rate: float = 0.0,
        qk_norm: bool = False,
        use_flash_attn: Optional[bool] = None,
        sdma_conf: Optional[Dict[str, Any]] = None,
    ):
        options, use_flash_attn = encoder_sdma_options(
            output_size=output_size, attention_heads=attention_heads, linear_units=linear_units, num_blocks=num_blocks,
            dropout_rate=dropout_rate, positional_dropout_rate=positional_dropout_rate,
            attention_dropout_rate=attention_dropout_rate, layer_drop_rate=layer_drop_rate,
            interctc_layer_idx=interctc_layer_idx, sdma_conf=sdma_conf, use_flash_attn=use_flash_attn)
        super().__init__(
            input_size=input_size,
            output_size=output_size,
            attention_heads=attention_heads,
            linear_units=linear_units,
            num_blocks=num_blocks,
            dropout_rate=dropout_rate,
            positional_dropout_rate=positional_dropout_rate,
            attention_dropout_rate=attention_dropout_rate,
            input_layer=input_layer,
            pos_enc_class=pos_enc_class,
            pos_enc_layer_type=pos_enc_layer_type,
            normalize_before=normalize_before,
            concat_after=concat_after,
            positionwise_layer_type=positionwise_layer_type,
            positionwise_conv_kernel_size=positionwise_conv_kernel_size,
            padding_idx=padding_idx,
            interctc_layer_idx=interctc_layer_idx,
            interctc_use_conditioning=interctc_use_conditioning,
            layer_drop_rate=layer_drop_rate,
            qk_norm=qk_norm,
            use_flash_attn=use_flash_attn,
        )
        self.input_size = input_size
        self.input_layer = input_layer
        if options.mode == "none":  # V-T: ESPnet's own attention
            return
        for layer in self.encoders:
            layer.self_attn = SDMAMultiHeadedAttention(
                attention_heads, output_size, attention_dropout_rate, sdma=options, group="encoder_self",
                qk_norm=qk_norm,
            )

    def forward(self, xs_pad: torch.Tensor, ilens: torch.Tensor, prev_states: torch.Tensor = None,
                masks: torch.Tensor = None, ctc: CTC = None,
                return_all_hs: bool = False) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        check_features(self, xs_pad)
        return super().forward(xs_pad, ilens, prev_states, masks, ctc, return_all_hs)
