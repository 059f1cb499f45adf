"""Conformer encoder with SDMA self-attention (ESPnet2 ``encoder: sdma_conformer``)."""

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from espnet2.asr.ctc import CTC
from espnet2.asr.encoder.conformer_encoder import ConformerEncoder
from typeguard import typechecked

from espnet_plugin.asr.sdma_attention import (
    ESPnetConfigError,
    SDMAMultiHeadedAttention,
    SDMARelPositionMultiHeadedAttention,
    check_features,
    encoder_sdma_options,
)


class SDMAConformerEncoder(ConformerEncoder):
    """ESPnet2's ``ConformerEncoder`` whose self-attentions are SDMA attentions.

    Everything but the attention is ESPnet's own (subsampling, relative positional encoding, macaron feed-forward,
    convolution module, stochastic depth, intermediate CTC), so a ``conformer`` encoder config becomes an SDMA one by
    changing ``encoder:`` and adding the ``sdma_conf`` block of the ``sdma_transformer`` encoder. ESPnet's three
    self-attention types are kept: ``rel_selfattn`` (``rel_pos_type: latest``) and ``legacy_rel_selfattn`` (``rel_pos_type:
    legacy``, ESPnet's default) through :class:`SDMARelPositionMultiHeadedAttention` (the positional scores
    ``matrix_bd`` as the core's score bias), ``selfattn`` (absolute positions) through
    :class:`SDMAMultiHeadedAttention`. ``sdma_conf.mode: none`` is ESPnet's Conformer unchanged.

    Args (besides those of ``ConformerEncoder``, every keyword with ESPnet's default except ``use_flash_attn``, as in
    ``sdma_transformer``):
        sdma_conf: SDMA options by the names of :class:`latent_core.sdma.SDMAOptions`, on top of
            ``AISHELL_ENCODER_PRESET``; unknown keys are refused by name.

    Shapes: ``forward(xs_pad (B, L, input_size), ilens (B,))`` -> ``(B, L', output_size), (B,), None``.
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
        normalize_before: bool = True,
        concat_after: bool = False,
        positionwise_layer_type: str = "linear",
        positionwise_conv_kernel_size: int = 3,
        macaron_style: bool = False,
        rel_pos_type: str = "legacy",
        pos_enc_layer_type: str = "rel_pos",
        selfattention_layer_type: str = "rel_selfattn",
        activation_type: str = "swish",
        use_cnn_module: bool = True,
        zero_triu: bool = False,
        cnn_module_kernel: int = 31,
        padding_idx: int = -1,
        interctc_layer_idx: List[int] = [],
        interctc_use_conditioning: bool = False,
        ctc_trim: bool = False,
        stochastic_depth_rate: Union[float, List[float]] = 0.0,
        layer_drop_rate: float = 0.0,
        max_pos_emb_len: int = 5000,
        qk_norm: bool = False,
        use_flash_attn: Optional[bool] = None,
        sdma_conf: Optional[Dict[str, Any]] = None,
    ):
        options, use_flash_attn = encoder_sdma_options(
            output_size=output_size, attention_heads=attention_heads, linear_units=linear_units, num_blocks=num_blocks,
            dropout_rate=dropout_rate, positional_dropout_rate=positional_dropout_rate,
            attention_dropout_rate=attention_dropout_rate, layer_drop_rate=layer_drop_rate,
            interctc_layer_idx=interctc_layer_idx, sdma_conf=sdma_conf, use_flash_attn=use_flash_attn)
        if rel_pos_type not in ("legacy", "latest"):
            raise ESPnetConfigError(f"encoder_conf.rel_pos_type={rel_pos_type!r} must be 'legacy' or 'latest'")
        if options.mode != "none" and qk_norm and selfattention_layer_type != "selfattn":
            raise ESPnetConfigError(
                "encoder_conf.qk_norm=true with a relative-position self-attention: ESPnet's relative-position "
                "attention has no qk_norm; drop the key or use selfattention_layer_type: selfattn")
        super().__init__(
            input_size=input_size, output_size=output_size, attention_heads=attention_heads,
            linear_units=linear_units, num_blocks=num_blocks, dropout_rate=dropout_rate,
            positional_dropout_rate=positional_dropout_rate, attention_dropout_rate=attention_dropout_rate,
            input_layer=input_layer, normalize_before=normalize_before, concat_after=concat_after,
            positionwise_layer_type=positionwise_layer_type,
            positionwise_conv_kernel_size=positionwise_conv_kernel_size, macaron_style=macaron_style,
            rel_pos_type=rel_pos_type, pos_enc_layer_type=pos_enc_layer_type,
            selfattention_layer_type=selfattention_layer_type, activation_type=activation_type,
            use_cnn_module=use_cnn_module, zero_triu=zero_triu, cnn_module_kernel=cnn_module_kernel,
            padding_idx=padding_idx, interctc_layer_idx=interctc_layer_idx,
            interctc_use_conditioning=interctc_use_conditioning, ctc_trim=ctc_trim,
            stochastic_depth_rate=stochastic_depth_rate, layer_drop_rate=layer_drop_rate,
            max_pos_emb_len=max_pos_emb_len, qk_norm=qk_norm, use_flash_attn=use_flash_attn,
        )
        self.input_size = input_size
        self.input_layer = input_layer
        if options.mode == "none":  # V-T: ESPnet's own attention
            return
        # ESPnet's constructor resolved the legacy names (rel_pos_type: legacy -> legacy_rel_selfattn)
        kind = type(self.encoders[0].self_attn).__name__
        for layer in self.encoders:
            if kind == "MultiHeadedAttention":
                layer.self_attn = SDMAMultiHeadedAttention(
                    attention_heads, output_size, attention_dropout_rate, sdma=options, group="encoder_self",
                    qk_norm=qk_norm)
            else:
                layer.self_attn = SDMARelPositionMultiHeadedAttention(
                    attention_heads, output_size, attention_dropout_rate, sdma=options, group="encoder_self",
                    legacy=kind == "LegacyRelPositionMultiHeadedAttention", zero_triu=zero_triu)

    def forward(self, xs_pad: torch.Tensor, ilens: torch.Tensor, prev_states: torch.Tensor = None,
                masks: torch.Tensor = None, ctc: CTC = None,
                return_all_hs: bool = False) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        check_features(self, xs_pad)
        return super().forward(xs_pad, ilens, prev_states, masks, ctc, return_all_hs)
