"""ESPnet adapter of the SDMA core: a drop-in ``MultiHeadedAttention``.

The equations live in :mod:`latent_core.sdma` (one implementation for fairseq and
ESPnet); this file only maps ESPnet's batch-first tensors and boolean masks onto it.

ESPnet's incremental decoding re-runs self-attention over the cached layer inputs of the
whole prefix with only the last position as query, so the key clustering is recomputed
from the same inputs as in a full forward pass and step-by-step scores equal
full-sequence scores without an extra cache.
"""

import math
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.nn as nn
from espnet.nets.pytorch_backend.transformer.attention import MultiHeadedAttention
from torch import Tensor

from latent_core.errors import PluginConfigError, check_heads_divide, check_positive_int
from latent_core.sdma import (SDMACore, SDMAOptions, all_real_queries, authors_linear_init, current_real_queries,
                               sdma_attention, tie_to_output)

ATTENTION_GROUPS = ("encoder_self", "decoder_self", "decoder_cross")


class ESPnetConfigError(PluginConfigError, AssertionError):
    """A training-config value ESPnet would reject with a bare assert (the message names the YAML key).

    Both a ``ValueError`` (the plugin's :class:`PluginConfigError`: one line, exit status 2) and an
    ``AssertionError``: ESPnet's own classes ``assert`` on invalid configuration and code (ESPnet's
    tests among it) written against them catches ``AssertionError``."""


def check_transformer_conf(conf_name: str, *, width: int, width_key: str, attention_heads: int,
                           linear_units: int, num_blocks: int, dropout_rates: dict,
                           interctc_layer_idx: Iterable[int] = ()) -> None:
    """Check what ESPnet's transformer asserts (or fails on later) and name the YAML key.

    ``width`` is the attention dimension and ``width_key`` the key it comes from (the
    decoder's width is ``encoder_conf.output_size``).
    """
    check_positive_int(width_key, width, ESPnetConfigError)
    check_positive_int(f"{conf_name}.attention_heads", attention_heads, ESPnetConfigError)
    check_positive_int(f"{conf_name}.linear_units", linear_units, ESPnetConfigError)
    check_positive_int(f"{conf_name}.num_blocks", num_blocks, ESPnetConfigError)
    check_heads_divide(f"{conf_name}.attention_heads", attention_heads, width_key, width, ESPnetConfigError)
    for name, rate in dropout_rates.items():
        if not (isinstance(rate, (int, float)) and 0.0 <= rate < 1.0):
            raise ESPnetConfigError(f"{conf_name}.{name}={rate!r} must lie in [0, 1)")
    layers = list(interctc_layer_idx or ())
    if layers and not (0 < min(layers) and max(layers) < num_blocks):
        raise ESPnetConfigError(
            f"{conf_name}.interctc_layer_idx={layers}: intermediate CTC layers must lie in "
            f"1 .. num_blocks - 1 = {num_blocks - 1}"
        )


def check_flash_attn(conf: str, use_flash_attn: Optional[bool], options: SDMAOptions) -> bool:
    """ESPnet's ``use_flash_attn`` for a plugin encoder/decoder: None (the default) is ESPnet's default for
    ``mode: none`` (flash attention where installed) and off for SMA/SDMA; ``true`` with SMA/SDMA is refused,
    the flash_attn kernels have no semantic mask (SDMA's fused kernels: ``sdma_conf.attention_kernel``)."""
    if options.mode == "none":
        return True if use_flash_attn is None else use_flash_attn
    if use_flash_attn:
        raise ESPnetConfigError(
            f"{conf}.use_flash_attn=true: flash_attn's kernels cannot apply SDMA's semantic mask; drop the key "
            f"(SDMA's own fused kernels are {conf}.sdma_conf.attention_kernel) or set sdma_conf.mode: none")
    return False


def check_features(encoder, xs_pad: Tensor) -> None:
    """An encoder's input against the ``input_size`` it was built for (its ``input_layer`` other than ``embed``):
    a named error instead of a shape error deep in the subsampling."""
    if encoder.input_layer != "embed" and (xs_pad.dim() != 3 or xs_pad.size(-1) != encoder.input_size):
        raise ValueError(
            f"the encoder got features of shape {tuple(xs_pad.shape)} but was built for "
            f"input_size={encoder.input_size} features per frame (frontend_conf.n_mels, or --input_size "
            "in the training config): the features do not match the config"
        )


class SDMAMultiHeadedAttention(MultiHeadedAttention):
    """Multi-head attention with semantic (and disentangled) mask attention.

    Args:
        n_head: number of heads n_h.
        n_feat: model dimension (n_h * d_k).
        dropout_rate: dropout on the attention probabilities.
        sdma: SDMA hyper-parameters (:class:`SDMAOptions`).
        group: ``encoder_self``, ``decoder_self`` or ``decoder_cross``; the regularisers
            are averaged over the layers of one group and summed over groups.
        qk_norm: ESPnet's ``qk_norm`` (a LayerNorm of each head's q and k before the scores).

    ``forward(query (B, T1, D), key (B, T2, D), value (B, T2, D), mask)`` with ``mask``
    (B, 1, T2) or (B, T1, T2), True = attend, returns (B, T1, D). The mixed attention
    A_hat of eq. (11), (B, n_h, T1, T2), is kept in ``self.attn`` like ESPnet's class.

    The ``authors`` reading computes what the authors' ESPnet ``DisentangledMaskAttention``
    computes with their Aishell-1 config (``var_estimation: True``): the sampling noise and the
    posteriors of eq. (20) get a log-variance per position and head from ``Linear(n_feat, n_head)``
    heads (``sdma.noise_log_var`` on the input, ``sdma.key_noise_log_var`` on cross-attention keys,
    ``sdma.query_noise_log_var`` on the projected queries), the queries a second draw, k and v come
    from the clean input (cross-attention: k from the noisy keys), the decoder self-attention
    masks the future only, and every weight starts from their initialisation.
    """

    def __init__(self, n_head: int, n_feat: int, dropout_rate: float, *, sdma: SDMAOptions, group: str,
                 qk_norm: bool = False):
        if group not in ATTENTION_GROUPS:
            raise ValueError(f"group={group!r} is not one of {', '.join(ATTENTION_GROUPS)}")
        # qk_norm: ESPnet's LayerNorm of q and k per head (in forward_qkv), before SDMA's scores and the query GMM
        super().__init__(n_head, n_feat, dropout_rate, qk_norm)
        self.sdma = SDMACore(n_feat, n_head, sdma)
        self.sdma.sdma_group = group
        self.is_self_attention = group != "decoder_cross"
        self.is_causal = group == "decoder_self"
        if sdma.authors and sdma.mode != "none":
            self._build_authors_variance_heads(n_feat, n_head)

    def _build_authors_variance_heads(self, n_feat: int, n_head: int) -> None:
        """Their ``var_estimation`` heads (kept in the core, so that every SDMA parameter is under
        ``.sdma.``) and their initialisation."""
        core = self.sdma
        core.noise_log_var = nn.Linear(n_feat, n_head)
        core.key_noise_log_var = None if self.is_self_attention else nn.Linear(n_feat, n_head)
        core.query_noise_log_var = nn.Linear(n_feat, n_head)
        self.espnet_initialization_fn()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        core = self.sdma
        if core.options.authors and getattr(core, "noise_log_var", None) is not None \
                and prefix + "sdma.noise_log_var.weight" not in state_dict \
                and any(key.startswith(prefix + "sdma.feature_gmm.") for key in state_dict):
            raise ESPnetConfigError(
                f"{prefix.rstrip('.')}: the model file has no learned noise variances (sdma.noise_log_var): it was "
                "trained in the paper reading (the only one before readings existed); add `reading: paper` to "
                "encoder_conf.sdma_conf and decoder_conf.sdma_conf of its config.yaml")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def espnet_initialization_fn(self) -> None:
        """The authors' initialisation of this module (their ``init_params``): xavier_normal_ (gain 1)
        on the four projections and every GMM parameter, gain 0.01 on the variance heads, biases as
        ``nn.Linear`` draws them. ESPnet's ``initialize`` (the ``init:`` key) calls it after its own
        pass, so a global ``init: xavier_uniform`` cannot give the variance heads gain-1 weights (a
        noise variance of exp(+-several)). The projections and heads only in the ``authors`` reading; the
        GMMs where ``gmm_init`` is ``authors`` (the reading's by default)."""
        core = self.sdma
        if core.options.mode == "none":
            return
        if core.options.authors:
            for proj in (self.linear_q, self.linear_k, self.linear_v, self.linear_out):
                authors_linear_init(proj, gain=1.0)
            for head in (core.noise_log_var, core.key_noise_log_var, core.query_noise_log_var):
                if head is not None:
                    authors_linear_init(head, gain=0.01)
        if core.options.gmm_initialisation == "authors":
            for gmm in (core.feature_gmm, core.query_gmm):
                if gmm is not None:
                    gmm.reset_parameters_as_authors()

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor],
                expand_kv: bool = False) -> Tensor:
        core = self.sdma
        if not core.active(self.training):
            return super().forward(query, key, value, mask, expand_kv)
        if expand_kv:  # partially autoregressive decoding: one memory (B = 1) for n_mask * n_beam queries
            key, value = (t[:1].expand(query.size(0), *t.shape[1:]) for t in (key, value))
        # the recording scope and the decoder's real positions
        need_losses = core.computes_regularisers()
        real_queries = None if self.is_self_attention else current_real_queries()
        body = self._forward_authors if core.options.authors else self._forward_paper
        out, self.attn, record = body(query, key, value, mask, need_losses, real_queries)
        if record is not None:
            core.record(*record)
            out = tie_to_output(out, *record[3:5])  # the query GMM, for DDP's unused-parameter search
        return out

    def _forward_paper(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], need_losses: bool,
                       real_queries: Optional[Tensor]):
        """The ``paper`` reading, shapes as :meth:`forward`: ``(output (B, T1, D), A_hat or None, the arguments
        of :meth:`SDMACore.record` or None)``."""
        core = self.sdma
        B, T1, _ = query.shape
        H, D = self.h, self.d_k

        # eq. (8): one noisy sample per attention input, clustered (eq. 9) and projected
        zq = core.perturb(query, self.training)
        if self.is_self_attention:
            zk = zq if key is query else core.perturb(key, self.training)
            zv = zk if value is key else value
        else:
            zk, zv = key, value
        clustered = core.cluster_jointly([zq] if zk is zq else [zq, zk])  # one density evaluation
        log_joint_z, log_resp_z = clustered[0]  # (B, T1, H, C)
        log_resp_k = clustered[-1][1]
        q, k, v = self.forward_qkv(zq, zk, zv)  # (B, H, T, d_k)
        q = q / math.sqrt(D)

        blocked = None if mask is None else mask.unsqueeze(1).eq(0)  # (B, 1, T1 or 1, T2)
        x, weights = self._attend(q, k, v, core.attention_responsibilities(log_resp_z, True).view(B, H, T1, -1),
                                  core.attention_responsibilities(log_resp_k, True).view(B, H, k.size(2), -1), blocked)
        x = x.transpose(1, 2).reshape(B, T1, H * D)

        record = None
        if need_losses:
            log_joint_q = log_resp_q = None
            if core.query_gmm is not None:  # eq. (16)-(19), on the scaled queries
                log_joint_q, log_resp_q = core.cluster_queries(q.transpose(1, 2))  # (B, T1, H, C_q)
                log_joint_q, log_resp_q = log_joint_q.transpose(0, 1), log_resp_q.transpose(0, 1)
            record = (log_joint_z.transpose(0, 1), log_resp_z.transpose(0, 1),
                      self._query_valid(mask, B, T1, query, real_queries).t(), log_joint_q, log_resp_q)
        return self.linear_out(x), weights, record

    def _forward_authors(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], need_losses: bool,
                         real_queries: Optional[Tensor]):
        """The ``authors`` reading (their ESPnet ``disentangled_attention``), as :meth:`_forward_paper`."""
        core = self.sdma
        B, T1, _ = query.shape
        H, D = self.h, self.d_k
        training = self.training
        # 1. feature clustering of the noisy input, the noise variance predicted per position and head
        log_var_z = core.noise_log_var(query)  # (B, T1, H)
        zq = core.perturb(query, training, log_var_z)
        log_joint_k = log_resp_k = log_var_k = None
        if self.is_self_attention:
            key_cluster = None if key is query else core.perturb(key, training)
            key_input = key  # their k and v come from the clean input
        else:
            log_var_k = core.key_noise_log_var(key)
            key_input = key_cluster = core.perturb(key, training, log_var_k)
        clustered = core.cluster_jointly([zq] if key_cluster is None else [zq, key_cluster])  # one density evaluation
        log_joint_z, log_resp_z = clustered[0]  # (B, T1, H, C)
        key_resp = clustered[-1][1]
        if not self.is_self_attention:
            log_joint_k, log_resp_k = clustered[1]
        q, k, v = self.forward_qkv(zq, key_input, value)  # (B, H, T, d_k)
        # 4. the scaled queries get their own draw (variance from the unscaled projection)
        log_var_q = core.query_noise_log_var(q.transpose(1, 2).reshape(B, T1, H * D))  # (B, T1, H)
        q = core.perturb((q / math.sqrt(D)).transpose(1, 2).reshape(B, T1, H * D), training, log_var_q)
        q = q.view(B, T1, H, D)
        log_joint_q = log_resp_q = None
        if core.query_gmm is not None and need_losses:
            log_joint_q, log_resp_q = core.cluster_queries(q)  # (B, T1, H, C_q)
        q = q.transpose(1, 2)  # (B, H, T1, d_k)

        # 2. the mask: times the padding (encoder, cross) or causal (decoder self) mask, L1-normalised
        T2 = k.size(2)
        if self.is_causal and T1 == T2:
            allowed = torch.ones(T1, T2, dtype=torch.bool, device=q.device).tril()[None]  # (1, T1, T2)
        elif mask is not None:
            allowed = mask.to(torch.bool)
        else:
            allowed = None
        blocked = None if allowed is None else ~allowed.unsqueeze(1)
        x, weights = self._attend(q, k, v, core.attention_responsibilities(log_resp_z, True).view(B, H, T1, -1),
                                  core.attention_responsibilities(key_resp, True).view(B, H, T2, -1), blocked,
                                  authors=True)
        x = x.transpose(1, 2).reshape(B, T1, H * D)

        record = None
        if need_losses:
            log_vars: Dict[str, Tensor] = {"z": log_var_z.transpose(0, 1), "q": log_var_q.transpose(0, 1)}
            if log_joint_k is not None:
                log_vars["k"] = log_var_k.transpose(0, 1)
                log_joint_k, log_resp_k = log_joint_k.transpose(0, 1), log_resp_k.transpose(0, 1)
            if log_joint_q is not None:
                log_joint_q, log_resp_q = log_joint_q.transpose(0, 1), log_resp_q.transpose(0, 1)
            record = (log_joint_z.transpose(0, 1), log_resp_z.transpose(0, 1),
                      self._query_valid(mask, B, T1, query, real_queries).t(), log_joint_q, log_resp_q,
                      log_joint_k, log_resp_k, log_vars)
        return self.linear_out(x), weights, record

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, resp_query: Tensor, resp_key: Tensor,
                blocked: Optional[Tensor], authors: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """A_hat V of eq. (1), (2), (10), (11) through the core's entry point
        (:func:`latent_core.sdma.sdma_attention`): ``q`` (B, H, T1, d_k) scaled, ``k``/``v`` (B, H, T2, d_k),
        ``resp_query`` (B, H, T1, C) and ``resp_key`` (B, H, T2, C) log p(c|.)
        (:meth:`~latent_core.sdma.SDMACore.attention_responsibilities`), ``blocked`` (B or 1, 1, T1 or 1, T2)
        True = masked -> ((B, H, T1, d_k), A_hat (B, H, T1, T2) or None). Outside training ESPnet reads the
        weights (``self.attn``: attention plots), so they are asked for there (the explicit kernel)."""
        core = self.sdma
        dropout_active = self.training and self.dropout.p > 0
        q, score_bias = self._position_terms(q)
        return sdma_attention(
            q, k, v, resp_query, resp_key, core.mix_weight, authors=authors, blocked=blocked,
            kernel=core.options.attention_kernel, need_weights=not self.training, dropout=self.dropout,
            dropout_p=self.dropout.p if dropout_active else 0.0, score_bias=score_bias, log_responsibilities=True)

    def _position_terms(self, q: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """(the queries of the content scores, an additive score bias or None) for scaled ``q``: the queries
        themselves and no bias here; relative positions in :class:`SDMARelPositionMultiHeadedAttention`."""
        return q, None

    def _query_valid(self, mask: Optional[Tensor], B: int, T1: int, query: Tensor,
                     real_queries: Optional[Tensor]) -> Tensor:
        """(B, T1) float, 1 for real (non-padding) query positions (``real_queries``: the decoder's, from its
        :func:`latent_core.sdma.real_queries` scope, for a cross-attention)."""
        if not self.is_self_attention:
            if real_queries is not None and real_queries.shape == (B, T1):
                return real_queries.float()
        elif mask is not None:
            if mask.size(1) == T1 and mask.size(2) == T1:  # causal: position i valid iff M[i, i]
                return mask.diagonal(dim1=1, dim2=2).float()
            if mask.size(1) == 1 and mask.size(2) == T1:
                return mask[:, 0, :].float()
        return all_real_queries(T1, B, query.device).t()

    def set_num_updates(self, num_updates: int) -> None:
        self.sdma.set_num_updates(num_updates)


# The authors' Aishell-1 setting (what ESPnet's encoder and decoder change in the core defaults of
# latent_core.sdma.SDMAOptions): c_g = 5; 8 clusters for both GMMs of the encoder, 4 for both of the
# decoder; the decoder self-attention drops its semantic mask at test time (the paper).
AISHELL_ENCODER_PRESET = {"centroid_grad_scale": 5.0, "clusters": 8, "query_clusters": 8}
AISHELL_DECODER_PRESET = {"centroid_grad_scale": 5.0, "clusters": 4, "query_clusters": 4,
                          "mask_at_inference": False}


def sdma_options_from_conf(conf_name: str, sdma_conf: Optional[dict], preset: dict) -> SDMAOptions:
    """Validated :class:`SDMAOptions` from an ESPnet ``{conf_name}: {sdma_conf: {...}}`` block
    (keys: the option names of :class:`SDMAOptions`, e.g. ``clusters``) on top of ``preset``.

    Errors name the YAML key, e.g. ``encoder_conf.sdma_conf.clusters=0: ...``.
    """
    return SDMAOptions.from_conf(sdma_conf, where=f"{conf_name}.sdma_conf", preset=preset)


def encoder_sdma_options(*, output_size: int, attention_heads: int, linear_units: int, num_blocks: int,
                         dropout_rate: float, positional_dropout_rate: float, attention_dropout_rate: float,
                         layer_drop_rate: float, interctc_layer_idx: Iterable[int], sdma_conf: Optional[dict],
                         use_flash_attn: Optional[bool]) -> Tuple[SDMAOptions, bool]:
    """The ``encoder_conf`` of an SDMA encoder (``sdma_transformer``, ``sdma_conformer``) checked, errors naming its
    YAML keys: ``(the SDMA options of encoder_conf.sdma_conf on top of AISHELL_ENCODER_PRESET, the use_flash_attn
    to hand ESPnet's encoder)``."""
    check_transformer_conf(
        "encoder_conf", width=output_size, width_key="encoder_conf.output_size",
        attention_heads=attention_heads, linear_units=linear_units, num_blocks=num_blocks,
        dropout_rates={"dropout_rate": dropout_rate, "positional_dropout_rate": positional_dropout_rate,
                       "attention_dropout_rate": attention_dropout_rate, "layer_drop_rate": layer_drop_rate},
        interctc_layer_idx=interctc_layer_idx,
    )
    options = sdma_options_from_conf("encoder_conf", sdma_conf, AISHELL_ENCODER_PRESET)
    return options, check_flash_attn("encoder_conf", use_flash_attn, options)


class SDMARelPositionMultiHeadedAttention(SDMAMultiHeadedAttention):
    """SDMA in ESPnet's relative-position self-attention (the Conformer's ``rel_selfattn`` and
    ``legacy_rel_selfattn``): the scores of Transformer-XL (Dai et al. 2019, Section 3.3) that ESPnet computes,
    ((q + u) k^T + rel_shift((q + v) p^T)) / sqrt(d_k), with the positional term ``matrix_bd`` handed to the core as
    the additive ``score_bias`` before eq. (1). The semantic mask of eq. (10) then multiplies the attention these
    scores give; the clusterings are those of :class:`SDMAMultiHeadedAttention` (the query GMM clusters the scaled
    projections W_q z / sqrt(d_k), without the content bias u).

    Args: those of :class:`SDMAMultiHeadedAttention` (no ``qk_norm``: ESPnet's relative-position classes have none),
    ``legacy`` (ESPnet's ``LegacyRelPositionMultiHeadedAttention``: positions 0 .. T-1 and its shift; else the
    latest, ``RelPositionMultiHeadedAttention``, with 2T-1 relative positions) and ``zero_triu`` (ESPnet's option of
    the same name). Parameters are ESPnet's: ``linear_pos``, ``pos_bias_u``, ``pos_bias_v``.

    ``forward(query (B, T, D), key, value, pos_emb (1 or B, P, D), mask (B, 1, T) or (B, T, T))`` -> (B, T, D).
    """

    def __init__(self, n_head: int, n_feat: int, dropout_rate: float, *, sdma: SDMAOptions, group: str,
                 legacy: bool = False, zero_triu: bool = False):
        from espnet.nets.pytorch_backend.transformer.attention import (LegacyRelPositionMultiHeadedAttention,
                                                                       RelPositionMultiHeadedAttention)

        if group != "encoder_self":
            raise ValueError(f"group={group!r}: relative-position SDMA attention is an encoder self-attention")
        self.espnet_class = LegacyRelPositionMultiHeadedAttention if legacy else RelPositionMultiHeadedAttention
        super().__init__(n_head, n_feat, dropout_rate, sdma=sdma, group=group)
        self.zero_triu = zero_triu
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(self.h, self.d_k))
        torch.nn.init.xavier_uniform_(self.pos_bias_u)
        torch.nn.init.xavier_uniform_(self.pos_bias_v)
        self._pos_emb: Optional[Tensor] = None

    def rel_shift(self, x: Tensor) -> Tensor:
        return self.espnet_class.rel_shift(self, x)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, pos_emb: Tensor, mask: Optional[Tensor]) -> Tensor:
        if not self.sdma.active(self.training):  # ESPnet's own relative-position attention
            return self.espnet_class.forward(self, query, key, value, pos_emb, mask)
        self._pos_emb = pos_emb
        try:
            return super().forward(query, key, value, mask)
        finally:
            self._pos_emb = None

    def _position_terms(self, q: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """ESPnet's relative-position scores for scaled ``q`` (B, H, T, d_k): the content queries q + u / sqrt(d_k)
        and ``matrix_bd`` = rel_shift((q + v / sqrt(d_k)) p^T) as the score bias (rel_shift moves entries, it is
        linear)."""
        scale = self.d_k ** -0.5
        pos_emb = self._pos_emb
        p = self.linear_pos(pos_emb).view(pos_emb.size(0), -1, self.h, self.d_k).transpose(1, 2)  # (1|B, H, P, d_k)
        matrix_bd = self.rel_shift(torch.matmul(q + (self.pos_bias_v * scale)[None, :, None, :], p.transpose(-2, -1)))
        return q + (self.pos_bias_u * scale)[None, :, None, :], matrix_bd
