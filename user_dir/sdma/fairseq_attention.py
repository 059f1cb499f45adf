"""fairseq adapter of the SDMA core: a drop-in ``MultiheadAttention``.

Keeps fairseq's projections, incremental-state buffers and
``reorder_incremental_state``; the clustering probabilities of the keys are cached
next to ``prev_key`` (key ``prev_key_resp``, shape ``[B, n_h, S, n_c]``) so that
step-by-step decoding computes the same semantic mask as a full forward pass.
"""

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor

from latent_core.sdma import (
    AUTHORS_EPS,
    SDMAConfigError,
    SDMACore,
    SDMAOptions,
    all_real_queries,
    authors_linear_init,
    current_real_queries,
    mix_attention,
    reading_semantic_mask,
    sdma_attention,
    tie_to_output,
)
from user_dir.sdma.attention_outputs import AttentionOutputs, output_sink


class SDMAMultiheadAttention(MultiheadAttention):
    """``MultiheadAttention`` with semantic (and disentangled) mask attention.

    Args are those of fairseq's ``MultiheadAttention`` plus ``sdma`` (the options)
    and ``group`` (``encoder_self``, ``decoder_self`` or ``decoder_cross``: how the
    losses are averaged, see :func:`latent_core.sdma.collect_sdma_losses`).

    Input/output shapes are fairseq's: query ``[T, B, E]``, key/value ``[S, B, E]``,
    ``key_padding_mask [B, S]`` (True = pad); returns ``([T, B, E], weights)`` with the
    mixed attention A_hat of eq. (11) as weights (``[B, T, S]``, or
    ``[n_h, B, T, S]`` with ``need_head_weights``).

    In the ``authors`` reading (:class:`SDMAOptions`) the module computes what the authors'
    ``DisentangledAttention`` computes in training: the queries get a second noise draw, k and v
    come from the clean input (cross-attention: k from the noisy keys, v from the clean values),
    the mask is their normalised one, the decoder self-attention ignores key padding beside its
    causal mask, and the four projections start from their initialisation.
    """

    def __init__(self, embed_dim, num_heads, *, sdma: SDMAOptions, group: str, **kwargs):
        if kwargs.get("add_bias_kv") or kwargs.get("add_zero_attn"):
            raise SDMAConfigError("SDMA attention does not support add_bias_kv / add_zero_attn")
        kdim = kwargs.get("kdim") or embed_dim
        if kdim != embed_dim:
            raise SDMAConfigError(
                f"SDMA clusters keys and queries with one GMM: key dim {kdim} must equal "
                f"the embedding dim {embed_dim}"
            )
        super().__init__(embed_dim, num_heads, **kwargs)
        # fairseq's quant-noise (q_noise > 0) is a forward pre-hook on q_proj: then q_proj itself must be called
        self.fold_query_scaling = not kwargs.get("q_noise", 0.0)
        self.sdma = SDMACore(embed_dim, num_heads, sdma)
        self.sdma.sdma_group = group
        if sdma.authors and sdma.mode != "none":
            self._reset_projections_as_authors()

    def __prepare_scriptable__(self):
        """``torch.jit.script`` calls this first, on every submodule: a named error instead of
        TorchScript's compile error deep in the SDMA core."""
        raise SDMAConfigError(
            "torch.jit.script: SDMAMultiheadAttention cannot be scripted (the SDMA core uses custom autograd "
            "functions and per-forward state); run it unscripted, or script fairseq's MultiheadAttention "
            "(sdma_transformer --sdma-mode none builds fairseq's own layers, which script)")

    def _adaptive_prune_heads(self, reserve_head_index):
        """fairseq's head pruning: refused, with what to do instead (its GMMs, noise heads and mask are
        built for ``num_heads`` heads; fairseq's code would fail on a size mismatch in the core)."""
        raise SDMAConfigError(
            f"head pruning (_adaptive_prune_heads) is not supported by SDMA attention: its per-head GMM and noise "
            f"parameters are built for {self.num_heads} heads; prune a --sdma-mode none model (fairseq's own "
            "attention), or train with fewer --encoder-attention-heads / --decoder-attention-heads")

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        core = self.sdma
        if not core.active(self.training):
            return super().forward(
                query, key, value, key_padding_mask, incremental_state, need_weights,
                static_kv, attn_mask, before_softmax, need_head_weights,
            )
        # the recording scopes and the decoder's real positions
        need_losses = incremental_state is None and core.computes_regularisers()
        real_queries = None if self.self_attention else current_real_queries()
        sink = output_sink(self) if incremental_state is None and not before_softmax else None
        attn, weights, record = self._sdma_forward(
            query, key, value, key_padding_mask, incremental_state, need_weights, static_kv, attn_mask, before_softmax,
            need_head_weights, need_losses, real_queries, sink)
        if record is not None:
            core.record(*record)
            attn = tie_to_output(attn, *record[3:5])  # the query GMM, for DDP's --find-unused-parameters
        return attn, weights

    def _sdma_forward(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                      key_padding_mask: Optional[Tensor], incremental_state, need_weights: bool, static_kv: bool,
                      attn_mask: Optional[Tensor], before_softmax: bool, need_head_weights: bool, need_losses: bool,
                      real_queries: Optional[Tensor], sink=None):
        """:meth:`forward` of an active SDMA module: ``(output [T, B, E], weights or None, the arguments of
        :meth:`SDMACore.record` or None)``; with ``before_softmax``, ``(scores, v, None)``. ``sink``: where this
        call's :class:`~user_dir.sdma.attention_outputs.AttentionOutputs` go."""
        core = self.sdma
        if need_head_weights:
            need_weights = True
        caller_needs_weights = need_weights
        if sink is not None:
            need_weights = True
        tgt_len, bsz, embed_dim = query.size()
        H, D = self.num_heads, self.head_dim

        saved_state = None
        if incremental_state is not None:
            saved_state = self._get_input_buffer(incremental_state)
            if "prev_key" in saved_state and static_kv:
                key = value = None

        authors = core.options.authors
        real_key_padding_mask = key_padding_mask
        if authors and self.self_attention and attn_mask is not None:
            # their causal self-attention masks the future only (pad keys stay visible to pad queries)
            key_padding_mask = None

        # fairseq's first layers get the embeddings as a transposed view: one copy here, not one in each of the
        # clustering and the q, k, v projections (each reshapes its input)
        query = query.contiguous()
        # eq. (8): one noisy sample z, clustered (eq. 9) and projected (Algorithm 1)
        z_cluster, z = core.sample(query, self.training)
        cross_keys = key is not None and not self.self_attention
        if cross_keys:
            key, value, key_padding_mask = self._one_copy_per_sentence(key, value, key_padding_mask, bsz)
            # the authors' keys are perturbed, clustered and projected noisy; values stay clean
            key_cluster, key = core.sample(key, self.training) if authors else (key, key)
        gmm_terms = self._decoding_gmm_terms(incremental_state)
        clustered = core.cluster_jointly([z_cluster, key_cluster] if cross_keys else [z_cluster], gmm_terms,
                                         core.clustering_scale)
        log_joint_z, log_resp_z = clustered[0]  # [T, B, H, C]
        resp_query = core.attention_responsibilities(log_resp_z)  # [B*H, T, C], log p(c|.)
        # the Triton kernel scales the scores itself: its queries stay unscaled (no pass forward and backward)
        q_scale = self.scaling if core.kernel_takes_raw_inputs else 1.0
        q = self.q_proj(z) if q_scale != 1.0 else self._scaled_query(z)
        k, v, key_resp, log_joint_k, log_resp_k = self._keys(
            query, z, key, value, resp_query, clustered[1] if cross_keys else None)

        # query clustering for head disentanglement (eq. 16-19), on the scaled queries; the
        # paper reading's q = W_q z + b already carries the sample of eq. (8), the authors'
        # draws a second one
        q_cluster, q = core.sample_queries(q, self.training, q_scale)
        queries = q  # [T, B, E], kept for the recorded outputs
        log_joint_q = log_resp_q = None
        if core.query_gmm is not None and need_losses:
            log_joint_q, log_resp_q = core.cluster_queries(q_cluster.view(tgt_len, bsz, H, D),
                                                           core.clustering_scale * q_scale)

        q = q.contiguous().view(tgt_len, bsz * H, D).transpose(0, 1)
        kv_bsz = bsz
        if k is not None:
            kv_bsz = k.size(1)
            k = k.contiguous().view(-1, kv_bsz * H, D).transpose(0, 1)
            v = v.contiguous().view(-1, kv_bsz * H, D).transpose(0, 1)
        if saved_state is not None:
            k, v, key_resp, key_padding_mask, kv_bsz = self._extend_cache(
                incremental_state, saved_state, k, v, key_resp, key_padding_mask, kv_bsz, static_kv)
        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None

        attn, attn_float = self._mixed_attention(q, k, v, resp_query, key_resp, key_padding_mask, attn_mask,
                                                 bsz, kv_bsz, need_weights, before_softmax, q_scale)
        if before_softmax:
            return attn, v, None  # the scores, as fairseq's MultiheadAttention
        attn = self.out_proj(attn)
        if sink is not None and bsz == kv_bsz:
            plain = self._plain_attention(q, k, v, resp_query, key_resp, key_padding_mask, attn_mask, bsz, q_scale)
            sink(AttentionOutputs(
                query_input=query.detach().float(),
                queries=(queries.detach().float() * q_scale).view(tgt_len, bsz, H, D),
                weights=attn_float.detach().view(bsz, H, tgt_len, -1).transpose(0, 1),
                plain_weights=plain.detach().float().view(bsz, H, tgt_len, -1).transpose(0, 1),
                query_resp=log_resp_z.detach().exp().float(),
                key_resp=(clustered[1][1] if cross_keys else log_resp_z).detach().exp().float(),
                mix_weight=float(core.mix_weight)))

        record = None
        if need_losses:
            record = (log_joint_z, log_resp_z, self._query_valid(query, real_key_padding_mask, real_queries),
                      log_joint_q, log_resp_q, log_joint_k, log_resp_k)

        weights: Optional[Tensor] = None
        if caller_needs_weights and attn_float is not None:
            weights = attn_float.view(bsz, H, tgt_len, k.size(1)).transpose(1, 0)
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return attn, weights, record

    def _one_copy_per_sentence(self, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor], bsz: int):
        """fairseq's beamable encoder-decoder attention: the encoder output once per sentence
        (not once per beam hypothesis). Returns (key, value, key_padding_mask)."""
        if not (self.beam_size > 1 and bsz == key.size(1)):
            return key, value, key_padding_mask
        key = key.view(key.size(0), -1, self.beam_size, key.size(2))[:, :, 0, :]
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.view(-1, self.beam_size, key_padding_mask.size(1))[:, 0, :]
        return key, key, key_padding_mask

    def _keys(self, query: Tensor, z: Tensor, key: Optional[Tensor], value: Optional[Tensor], resp_query: Tensor,
              key_clustering: Optional[Tuple[Tensor, Tensor]]):
        """(k, v ``[S, kv_bsz, E]``, the keys' log p(c|.) ``[kv_bsz*H, S, C]``, their log-joint (the
        authors' reading regularises the keys) and log p(c|.) ``[S, kv_bsz, H, C]``). All None for
        cross-attention keys already in the decoding cache; the last two None in self-attention.
        ``key_clustering``: a cross-attention's (log-joint, log p(c|.)) of ``key`` (already
        perturbed in the authors reading)."""
        core = self.sdma
        if self.self_attention:
            source = query if core.options.authors else z  # the authors project k and v from the clean input
            return self.k_proj(source), self.v_proj(source), resp_query, None, None
        if key is None:
            return None, None, None, None, None
        log_joint_k, log_resp_k = key_clustering
        if not core.options.authors:
            log_joint_k = None
        k, v = self.k_proj(key), self.v_proj(value)
        return k, v, core.attention_responsibilities(log_resp_k), log_joint_k, log_resp_k

    def _extend_cache(self, incremental_state, saved_state, k, v, key_resp, key_padding_mask, kv_bsz: int,
                      static_kv: bool):
        """Incremental decoding: the cached keys, values and key log p(c|.) (``prev_key_resp``) with this
        step's appended (or, for static keys, instead of them), and the cache updated.
        Returns (k, v, key_resp, key_padding_mask, kv_bsz)."""
        H, D = self.num_heads, self.head_dim
        if "prev_key" in saved_state:
            kv_bsz = saved_state["prev_key"].size(0)
            prev_key = saved_state["prev_key"].view(kv_bsz * H, -1, D)
            prev_value = saved_state["prev_value"].view(kv_bsz * H, -1, D)
            prev_resp = saved_state["prev_key_resp"]
            prev_resp = prev_resp.view(kv_bsz * H, -1, prev_resp.size(-1))
            if static_kv:
                k, v, key_resp = prev_key, prev_value, prev_resp
            else:
                k = torch.cat([prev_key, k], dim=1)
                v = torch.cat([prev_value, v], dim=1)
                key_resp = torch.cat([prev_resp, key_resp], dim=1)
        key_padding_mask = MultiheadAttention._append_prev_key_padding_mask(
            key_padding_mask=key_padding_mask,
            prev_key_padding_mask=saved_state.get("prev_key_padding_mask"),
            batch_size=kv_bsz,
            src_len=k.size(1),
            static_kv=static_kv,
        )
        saved_state["prev_key"] = k.view(kv_bsz, H, -1, D)
        saved_state["prev_value"] = v.view(kv_bsz, H, -1, D)
        saved_state["prev_key_resp"] = key_resp.view(kv_bsz, H, -1, key_resp.size(-1))
        saved_state["prev_key_padding_mask"] = key_padding_mask
        self._set_input_buffer(incremental_state, saved_state)
        return k, v, key_resp, key_padding_mask, kv_bsz

    def _mixed_attention(self, q: Tensor, k: Tensor, v: Tensor, resp_query: Tensor, key_resp: Tensor,
                         key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor], bsz: int, kv_bsz: int,
                         need_weights: bool, before_softmax: bool,
                         q_scale: float = 1.0) -> Tuple[Tensor, Optional[Tensor]]:
        """A_hat V of eq. (1), (2), (10), (11) for ``q`` ``[B*H, T, D]`` (whose scores are ``q_scale`` q.k), ``k``/``v``
        ``[kv_bsz*H, S, D]`` and the log p(c|.) of queries ``[B*H, T, C]`` and keys ``[kv_bsz*H, S, C]``.

        Returns (``[T, B, E]``, the weights A_hat ``[B*H, T, S]`` in float32 when computed, else
        None); with ``before_softmax``, (the masked scores, None). The core's entry point
        (:func:`latent_core.sdma.sdma_attention`, which picks the kernel) computes it, except fairseq's
        own cases kept here: beam folding (the encoder's keys shared by a sentence's hypotheses) and the
        raw scores (``before_softmax``).
        """
        core = self.sdma
        authors = core.options.authors
        H, D = self.num_heads, self.head_dim
        tgt_len, src_len = q.size(1), k.size(1)
        dropout_active = self.training and self.dropout_module.p > 0
        if not (self.encoder_decoder_attention and bsz != kv_bsz) and not before_softmax:
            attn, weights = sdma_attention(  # eq. (1), (2), (10), (11)
                *(t.view(bsz, H, -1, t.size(-1)) for t in (q, k, v, resp_query, key_resp)), core.mix_weight,
                authors=authors, blocked=self._blocked_keys(key_padding_mask, attn_mask),
                kernel=core.options.attention_kernel, need_weights=need_weights,
                dropout=self.dropout_module, dropout_p=self.dropout_module.p if dropout_active else 0.0,
                scale=q_scale, log_responsibilities=True)
            weights = None if weights is None else weights.view(bsz * H, tgt_len, src_len)
            return attn.permute(2, 0, 1, 3).reshape(tgt_len, bsz, H * D), weights

        # beam folding (kv_bsz sentences, bsz = kv_bsz * beam hypotheses) or the raw scores: explicit
        if q_scale != 1.0:
            q = q * q_scale
        allowed = self._allowed_keys(key_padding_mask, attn_mask) if authors else None
        mask = reading_semantic_mask(resp_query.exp(), key_resp.exp(), authors, allowed, heads=H)  # eq. (10)
        scores = torch.einsum(
            "bxhtd,bhsd->bxhts", q.view((kv_bsz, -1, H) + q.size()[1:]), k.view((kv_bsz, H) + k.size()[1:]),
        ).reshape(-1, tgt_len, src_len) if bsz != kv_bsz else torch.bmm(q, k.transpose(1, 2))
        scores = scores.float()
        if attn_mask is not None:
            scores = scores + attn_mask.unsqueeze(0).float()
        if key_padding_mask is not None:
            pad = key_padding_mask.to(torch.bool)
            scores = scores.view(kv_bsz, -1, H, tgt_len, src_len).masked_fill(
                pad[:, None, None, None, :], float("-inf")
            ).view(bsz * H, tgt_len, src_len)
        if before_softmax:
            return scores, None
        attn_float = mix_attention(  # eq. (1), (2), (11)
            scores, mask, core.mix_weight, norm_floor=AUTHORS_EPS if authors else 0.0)
        attn_probs = self.dropout_module(attn_float.type_as(v))
        attn = torch.einsum(
            "bxhts,bhsd->bxhtd",
            attn_probs.view((kv_bsz, -1, H) + attn_probs.size()[1:]),
            v.view((kv_bsz, H) + v.size()[1:]),
        ).reshape(-1, tgt_len, D)
        return attn.transpose(0, 1).contiguous().view(tgt_len, bsz, H * D), attn_float

    @staticmethod
    def _blocked_keys(key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor]) -> Optional[Tensor]:
        """True where a query may not attend, broadcastable to ``[B, H, T, S]`` (None when nothing is blocked)."""
        blocked = None
        if key_padding_mask is not None:
            blocked = key_padding_mask.to(torch.bool)[:, None, None, :]  # [B, 1, 1, S]
        if attn_mask is not None:  # fairseq's future mask: 0 / -inf
            future = torch.isneginf(attn_mask)[None, None]  # [1, 1, T, S]
            blocked = future if blocked is None else blocked | future
        return blocked

    def _plain_attention(self, q: Tensor, k: Tensor, v: Tensor, resp_query: Tensor, key_resp: Tensor,
                         key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor], bsz: int,
                         q_scale: float) -> Tensor:
        """A of eq. (1) for the recorded outputs: the weights of :meth:`_mixed_attention` with g = 0 in eq. (11)
        (no dropout), ``[B, H, T, S]``."""
        core, H = self.sdma, self.num_heads
        _, weights = sdma_attention(
            *(t.view(bsz, H, -1, t.size(-1)) for t in (q, k, v, resp_query, key_resp)),
            torch.zeros_like(core.mix_weight), authors=core.options.authors,
            blocked=self._blocked_keys(key_padding_mask, attn_mask), kernel="explicit", need_weights=True,
            dropout=lambda a: a, dropout_p=0.0, scale=q_scale, log_responsibilities=True)
        return weights

    def _query_valid(self, query: Tensor, key_padding_mask: Optional[Tensor], real_queries: Optional[Tensor]) -> Tensor:
        """``[T, B]`` float, 1 at real query positions: self-attention's queries are its keys; a
        cross-attention reads the decoder's real positions (``real_queries`` ``[B, T]``, what the
        :func:`real_queries` scope of the decoder layer holds)."""
        tgt_len, bsz = query.size(0), query.size(1)
        if self.self_attention:
            if key_padding_mask is not None and key_padding_mask.size(-1) == tgt_len:
                return (~key_padding_mask.to(torch.bool)).t().float()
        else:
            if real_queries is not None and real_queries.size(-1) == tgt_len:
                return real_queries.t().float()
        return all_real_queries(tgt_len, bsz, query.device)

    def _reset_projections_as_authors(self) -> None:
        """The authors' initialisation of the four projections (``DisentangledAttention.init_params``)."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            authors_linear_init(proj, gain=1 / math.sqrt(2))

    @staticmethod
    def _allowed_keys(key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor]) -> Optional[Tensor]:
        """The 0/1 mask of keys a query may attend to, broadcastable to ``[B*H, T, S]`` through a
        ``[kv_bsz, -1, T, S]`` view (None when every key is allowed)."""
        allowed = None
        if key_padding_mask is not None:
            allowed = (~key_padding_mask.to(torch.bool)).float()[:, None, None, :]  # [kv_bsz, 1, 1, S]
        if attn_mask is not None:
            future = (attn_mask > float("-inf")).float()[None, None]  # [1, 1, T, S]
            allowed = future if allowed is None else allowed * future
        return allowed

    def _scaled_query(self, z: Tensor) -> Tensor:
        """``q_proj(z) / sqrt(d_k)``, the scaling folded into W_q and b_q (``[E, E]``) rather than
        applied to the ``[T, B, E]`` output (one pass less forward and backward). With fairseq's
        quant-noise (``q_noise`` > 0) the module itself is called, so its noise hook runs."""
        proj = self.q_proj
        if not self.fold_query_scaling:
            return proj(z) * self.scaling
        bias = None if proj.bias is None else proj.bias * self.scaling
        return F.linear(z, proj.weight * self.scaling, bias)

    def _decoding_gmm_terms(self, incremental_state):
        """The feature GMM's inference weights, built once per beam search.

        fairseq's generators create a fresh ``incremental_state`` for every batch they decode,
        and the parameters cannot change within one, so the weights are kept there (under a
        key of their own, which ``reorder_incremental_state`` leaves alone) instead of being
        rebuilt at every step. Outside incremental decoding nothing is cached.
        """
        if incremental_state is None or torch.is_grad_enabled():
            return None
        cached = self.get_incremental_state(incremental_state, "sdma_gmm_terms")
        if cached is None:
            weight_sq, weight_lin, bias = self.sdma.feature_gmm.inference_terms()
            cached = {"weight_sq": weight_sq, "weight_lin": weight_lin, "bias": bias}
            self.set_incremental_state(incremental_state, "sdma_gmm_terms", cached)
        return cached["weight_sq"], cached["weight_lin"], cached["bias"]

    def set_num_updates(self, num_updates: int) -> None:
        self.sdma.set_num_updates(num_updates)
