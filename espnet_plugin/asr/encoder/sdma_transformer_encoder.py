"""Transformer encoder with SDMA self-attention (ESPnet2 ``encoder: sdma_transformer``)."""

from typing import List, Optional, Tuple

import torch
from espnet2.asr.ctc import CTC
from espnet2.asr.encoder.transformer_encoder import TransformerEncoder
from typeguard import typechecked

from espnet_plugin.asr.sdma_attention import (
    SDMAMultiHeadedAttention,
    check_transformer_conf,
    sdma_options_from_conf,
)


class SDMATransformerEncoder(TransformerEncoder):
    """ESPnet2's ``TransformerEncoder`` whose self-attentions are SDMA attentions.

    Everything but the attention is ESPnet's own (subsampling, positional encoding,
    feed-forward, layer norm, intermediate CTC), so a ``transformer`` encoder config
    becomes an SDMA one by changing ``encoder:`` and adding the ``sdma_*`` keys.

    Args (besides those of ``TransformerEncoder``; defaults: the paper's Aishell-1 run):
        sdma_mode: ``sdma`` (SDMA-T), ``sma`` (no head disentanglement) or ``none``
            (ESPnet's plain attention).
        sdma_clusters: feature clusters n_c per head (8).
        sdma_query_clusters: query clusters of the disentanglement GMM (8: the authors'
            Aishell-1 code uses 8 clusters for both GMMs of the encoder, 4 for both of the decoder).
        sdma_mix_max, sdma_mix_rate: nu and the rate of the mixing weight (eq. 11).
        sdma_centroid_grad_scale: c_g, gradient multiplier of the GMM means (5).
        sdma_noise_var: sigma^2 of the training noise (eq. 8).
        sdma_posterior_var: variance of q(z|x) in the KL term (eq. 20).
        sdma_diversity_alpha, sdma_diversity_beta: alpha, beta of eq. (23).
        sdma_mask_at_inference: apply the semantic mask when not training.

    Shapes: ``forward(xs_pad (B, L, input_size), ilens (B,))`` ->
    ``(B, L', output_size), (B,), None`` (L' after subsampling).
    """

    @typechecked
    def __init__(
        self,
        input_size: int,
        output_size: int = 256,
        attention_heads: int = 4,
        linear_units: int = 1024,
        num_blocks: int = 6,
        dropout_rate: float = 0.1,
        positional_dropout_rate: float = 0.1,
        attention_dropout_rate: float = 0.0,
        input_layer: Optional[str] = "conv2d",
        pos_enc_layer_type: str = "abs_pos",
        normalize_before: bool = True,
        concat_after: bool = False,
        positionwise_layer_type: str = "linear",
        positionwise_conv_kernel_size: int = 1,
        padding_idx: int = -1,
        interctc_layer_idx: List[int] = [],
        interctc_use_conditioning: bool = False,
        layer_drop_rate: float = 0.0,
        sdma_mode: str = "sdma",
        sdma_clusters: int = 8,
        sdma_query_clusters: int = 8,
        sdma_mix_max: float = 0.9,
        sdma_mix_rate: float = 5e-4,
        sdma_centroid_grad_scale: float = 5.0,
        sdma_noise_var: float = 0.01,
        sdma_posterior_var: float = 0.1,
        sdma_diversity_alpha: float = 1.25,
        sdma_diversity_beta: float = 0.75,
        sdma_mask_at_inference: bool = True,
    ):
        check_transformer_conf(
            "encoder_conf", width=output_size, width_key="encoder_conf.output_size",
            attention_heads=attention_heads, linear_units=linear_units, num_blocks=num_blocks,
            dropout_rates={"dropout_rate": dropout_rate, "positional_dropout_rate": positional_dropout_rate,
                           "attention_dropout_rate": attention_dropout_rate, "layer_drop_rate": layer_drop_rate},
            interctc_layer_idx=interctc_layer_idx,
        )
        options = sdma_options_from_conf(
            "encoder_conf", mode=sdma_mode, clusters=sdma_clusters, query_clusters=sdma_query_clusters,
            mix_max=sdma_mix_max, mix_rate=sdma_mix_rate, centroid_grad_scale=sdma_centroid_grad_scale,
            noise_var=sdma_noise_var, posterior_var=sdma_posterior_var,
            diversity_alpha=sdma_diversity_alpha, diversity_beta=sdma_diversity_beta,
            mask_at_inference=sdma_mask_at_inference,
        )
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
            pos_enc_layer_type=pos_enc_layer_type,
            normalize_before=normalize_before,
            concat_after=concat_after,
            positionwise_layer_type=positionwise_layer_type,
            positionwise_conv_kernel_size=positionwise_conv_kernel_size,
            padding_idx=padding_idx,
            interctc_layer_idx=interctc_layer_idx,
            interctc_use_conditioning=interctc_use_conditioning,
            layer_drop_rate=layer_drop_rate,
            use_flash_attn=False,
        )
        self.input_size = input_size
        self.input_layer = input_layer
        if options.mode == "none":  # V-T: ESPnet's own attention
            return
        for layer in self.encoders:
            layer.self_attn = SDMAMultiHeadedAttention(
                attention_heads, output_size, attention_dropout_rate, sdma=options, group="encoder_self"
            )

    def forward(self, xs_pad: torch.Tensor, ilens: torch.Tensor, prev_states: torch.Tensor = None,
                masks: torch.Tensor = None, ctc: CTC = None,
                return_all_hs: bool = False) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        if self.input_layer != "embed" and (xs_pad.dim() != 3 or xs_pad.size(-1) != self.input_size):
            raise ValueError(
                f"the encoder got features of shape {tuple(xs_pad.shape)} but was built for "
                f"input_size={self.input_size} features per frame (frontend_conf.n_mels, or --input_size "
                "in the training config): the features do not match the config"
            )
        return super().forward(xs_pad, ilens, prev_states, masks, ctc, return_all_hs)
