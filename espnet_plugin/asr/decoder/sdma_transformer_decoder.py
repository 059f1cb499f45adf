"""Transformer decoder with SDMA self- and cross-attention (ESPnet2 ``decoder: sdma_transformer``)."""

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
from espnet2.asr.decoder.transformer_decoder import TransformerDecoder
from espnet.nets.pytorch_backend.nets_utils import make_pad_mask
from espnet.nets.pytorch_backend.transformer.embedding import PositionalEncoding
from typeguard import typechecked

from espnet_plugin.asr.sdma_attention import (
    AISHELL_DECODER_PRESET,
    ESPnetConfigError,
    SDMAMultiHeadedAttention,
    check_flash_attn,
    check_transformer_conf,
    sdma_options_from_conf,
)
from latent_core.sdma import real_queries


class SDMATransformerDecoder(TransformerDecoder):
    """ESPnet2's ``TransformerDecoder`` with SDMA decoder self-attention and cross-attention.

    It keeps ESPnet's batch scorer interface (``score``, ``batch_score``, and ``batch_score_partially_AR`` for
    ``Speech2Text(partially_ar=...)``: the masked positions' queries over one encoder output, ESPnet's
    ``expand_kv``), so ``BatchBeamSearch`` with CTC prefix scoring and ESPnet's partially autoregressive
    decoding work unchanged. ESPnet caches layer
    outputs, not keys: every step re-clusters the whole prefix, so incremental scores
    equal full-sequence scores for both ``mask_at_inference`` settings.

    Constructible from ``vocab_size`` and ``encoder_output_size`` alone, like ESPnet's own
    decoders; every keyword of ESPnet's ``TransformerDecoder`` is accepted with ESPnet's default
    (``gradient_checkpoint_layers`` keeps the SDMA regularisers' gradients: ESPnet's checkpoint is
    non-reentrant and ``SDMACore.record`` ignores the recomputation; ``use_flash_attn`` as in
    the encoder). ``sdma_conf`` takes the options of
    :class:`~espnet_plugin.asr.encoder.sdma_transformer_encoder.SDMATransformerEncoder`, on top
    of ``AISHELL_DECODER_PRESET`` (4 feature and 4 query clusters, c_g = 5: the authors'
    Aishell-1 setting; ``mask_at_inference`` false). ``mask_at_inference`` governs the decoder
    SELF-attention only: the paper disregards its semantic mask at test time. The
    cross-attention keeps its mask at inference, as in the fairseq model.

    Shapes: ``forward(hs_pad (B, S, D), hlens (B,), ys_in_pad (B, L), ys_in_lens (B,))`` ->
    ``(B, L, vocab_size), (B,)``.
    """

    @typechecked
    def __init__(
        self,
        vocab_size: int,
        encoder_output_size: int,
        attention_heads: int = 4,
        linear_units: int = 2048,
        num_blocks: int = 6,
        dropout_rate: float = 0.1,
        positional_dropout_rate: float = 0.1,
        self_attention_dropout_rate: float = 0.0,
        src_attention_dropout_rate: float = 0.0,
        input_layer: str = "embed",
        use_output_layer: bool = True,
        pos_enc_class=PositionalEncoding,
        normalize_before: bool = True,
        concat_after: bool = False,
        layer_drop_rate: float = 0.0,
        qk_norm: bool = False,
        use_flash_attn: Optional[bool] = None,
        gradient_checkpoint_layers: List[int] = [],
        sdma_conf: Optional[Dict[str, Any]] = None,
    ):
        check_transformer_conf(
            "decoder_conf", width=encoder_output_size, width_key="encoder_conf.output_size",
            attention_heads=attention_heads, linear_units=linear_units, num_blocks=num_blocks,
            dropout_rates={"dropout_rate": dropout_rate, "positional_dropout_rate": positional_dropout_rate,
                           "self_attention_dropout_rate": self_attention_dropout_rate,
                           "src_attention_dropout_rate": src_attention_dropout_rate,
                           "layer_drop_rate": layer_drop_rate},
        )
        options = sdma_options_from_conf("decoder_conf", sdma_conf, AISHELL_DECODER_PRESET)
        use_flash_attn = check_flash_attn("decoder_conf", use_flash_attn, options)
        super().__init__(
            vocab_size=vocab_size,
            encoder_output_size=encoder_output_size,
            attention_heads=attention_heads,
            linear_units=linear_units,
            num_blocks=num_blocks,
            dropout_rate=dropout_rate,
            positional_dropout_rate=positional_dropout_rate,
            self_attention_dropout_rate=self_attention_dropout_rate,
            src_attention_dropout_rate=src_attention_dropout_rate,
            input_layer=input_layer,
            use_output_layer=use_output_layer,
            pos_enc_class=pos_enc_class,
            normalize_before=normalize_before,
            concat_after=concat_after,
            layer_drop_rate=layer_drop_rate,
            qk_norm=qk_norm,
            use_flash_attn=use_flash_attn,
            gradient_checkpoint_layers=gradient_checkpoint_layers,
        )
        cross_options = dataclasses.replace(options, mask_at_inference=True)
        for layer in self.decoders if options.mode != "none" else ():  # "none": ESPnet's own attention
            layer.self_attn = SDMAMultiHeadedAttention(
                attention_heads, encoder_output_size, self_attention_dropout_rate,
                sdma=options, group="decoder_self", qk_norm=qk_norm,
            )
            layer.src_attn = SDMAMultiHeadedAttention(
                attention_heads, encoder_output_size, src_attention_dropout_rate,
                sdma=cross_options, group="decoder_cross", qk_norm=qk_norm,
            )
        for index in gradient_checkpoint_layers:  # ESPnet counts them from 1
            if not 1 <= index <= num_blocks:
                raise ESPnetConfigError(f"decoder_conf.gradient_checkpoint_layers={gradient_checkpoint_layers}: "
                                        f"layer {index} is not one of 1..{num_blocks} (counted from 1)")

    def forward(self, hs_pad: torch.Tensor, hlens: torch.Tensor, ys_in_pad: torch.Tensor,
                ys_in_lens: torch.Tensor, return_hs: bool = False,
                return_all_hs: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        # cross-attention receives only the encoder's mask; its regularisers average over the real queries
        with real_queries(~make_pad_mask(ys_in_lens, maxlen=ys_in_pad.size(1)).to(ys_in_pad.device)):
            return super().forward(hs_pad, hlens, ys_in_pad, ys_in_lens, return_hs, return_all_hs)

