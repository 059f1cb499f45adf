"""The two latent-conditioned decoders (Felhi et al., NAACL 2022, arXiv:2205.05943).

Both are fairseq ``TransformerDecoderBase`` subclasses (token/position embeddings, BART-style
``layernorm_embedding``, causal self-attention with fairseq's incremental state, tied output
projection) whose per-layer "memory" is computed from ``encoder_out["latents"]`` only:

* :class:`QKVDecoder` (QKVAE, Section 4.1): the cross-attention of every layer is replaced by
  :class:`QKVAttention`, ``MHA(SA(T), S_K, S_V)`` with keys from z_syn and values from z_sem:

      k = M^s(z_syn)   -> reshaped to L keys per layer (footnote 5; an MLP in the authors' code)
      v = Cat(d; z_sem) -> projected per layer to L values

  Only the query and output projections of that attention are parameters of the layer; keys
  and values enter the heads as they are (no k/v projections, as in the authors' code).
* :class:`ADVAEDecoder` (Section 3.3): ordinary cross-attention to ``Enc(y)``, y = Cat(d; z),
  where ``Enc`` is a small Transformer encoder over the L latent vectors.

Keys/values (QKVAE) and ``Enc(y)`` (ADVAE) are recomputed from the latents at every call, so
incremental decoding needs no extra cache: fairseq's ``SequenceGenerator`` reorders the
encoder output (hence the latents) and the self-attention caches; ADVAE's cross-attention
caches its static keys/values like any fairseq encoder-decoder attention.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.models.transformer import TransformerDecoderBase
from fairseq.modules import FairseqDropout, LayerNorm
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from torch import Tensor, nn

from latent_core.errors import check_heads_divide
from user_dir.sentence_vae.base import posteriors_of, word_dropout


class QKVAttention(nn.Module):
    """Multi-head attention whose keys and values are given (QKVAE's QKVDec, Section 4.1).

    ``forward(query [T, B, C], keys [B, L, C], values [B, L, C]) -> ([T, B, C], weights)``:
    the query is projected (``q_proj``, scaled by head_dim^-1/2), split into heads like the keys
    and values, softmax-normalised over the L keys, and the heads' outputs are concatenated and
    projected (``out_proj``) -- ``Cat(head_1..head_H) W^O`` of Section 3.2 with
    ``head_i = Attention(Q W^Q_i, K_i, V_i)``.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        check_heads_divide("num_heads", num_heads, "embed_dim", embed_dim)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        nn.init.xavier_uniform_(self.q_proj.weight, gain=2 ** -0.5)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.q_proj.bias)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, need_weights: bool = False,
                need_head_weights: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """Returns the output ``[T, B, C]`` and, if asked, the attention weights: ``[B, T, L]``
        averaged over heads, or ``[H, B, T, L]`` with ``need_head_weights`` (fairseq's layout)."""
        tgt_len, bsz, dim = query.shape
        num_keys = keys.size(1)
        heads, head_dim = self.num_heads, self.head_dim
        q = (self.q_proj(query) * self.scaling).view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)
        k = keys.to(q.dtype).reshape(bsz, num_keys, heads, head_dim).transpose(1, 2)  # [B, H, L, hd]
        v = values.to(q.dtype).reshape(bsz, num_keys, heads, head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2))  # [B, H, T, L]   Q K^T (eq. 2)
        probs = F.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(self.dropout_module(probs), v)  # [B, H, T, hd]
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, dim))
        weights = None
        if need_weights or need_head_weights:
            weights = probs.transpose(0, 1)  # [H, B, T, L]
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return out, weights


class QKVDecoderLayer(TransformerDecoderLayerBase):
    """A fairseq decoder layer whose ``encoder_attn`` is a :class:`QKVAttention`.

    ``forward(x, (keys, values), ...)``: the ``encoder_out`` argument of fairseq's layer is the
    pair (keys ``[B, L, C]``, values ``[B, L, C]``) of this layer; everything else (causal
    self-attention with incremental state, residuals, layer norms, FFN) is fairseq's.
    """

    def build_encoder_attention(self, embed_dim, cfg):
        return QKVAttention(embed_dim, cfg.decoder.attention_heads, cfg.attention_dropout)

    def forward(self, x, encoder_out: Optional[Tuple[Tensor, Tensor]] = None,
                encoder_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                prev_self_attn_state=None, prev_attn_state=None, self_attn_mask: Optional[Tensor] = None,
                self_attn_padding_mask: Optional[Tensor] = None, need_attn: bool = False,
                need_head_weights: bool = False):
        """``x`` ``[T, B, C]`` -> ``([T, B, C], attention weights or None, None)``."""
        if encoder_out is None:
            raise ValueError("QKVDecoderLayer needs the (keys, values) of its QKV attention")
        if encoder_padding_mask is not None:
            raise ValueError("QKVDecoderLayer: the latent keys/values have no padding")
        if prev_self_attn_state is not None or prev_attn_state is not None:
            raise ValueError("QKVDecoderLayer takes no explicit previous attention states: decode step by step "
                             "through the decoder's incremental_state")
        keys, values = encoder_out
        if need_head_weights:
            need_attn = True

        # T~ = SA(T~_{d-1})   (causal self-attention, fairseq incremental state)
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=self_attn_padding_mask,
                              incremental_state=incremental_state, need_weights=False,
                              attn_mask=self_attn_mask)
        if self.c_attn is not None:
            tgt_len, bsz = x.size(0), x.size(1)
            x = torch.einsum("tbhd,h->tbhd", x.view(tgt_len, bsz, self.nh, self.head_dim), self.c_attn)
            x = x.reshape(tgt_len, bsz, self.embed_dim)
        if self.attn_ln is not None:
            x = self.attn_ln(x)
        x = self.residual_connection(self.dropout_module(x), residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        # MHA(., S_K, S_V)   (QKVDec, Section 4.1)
        residual = x
        if self.normalize_before:
            x = self.encoder_attn_layer_norm(x)
        x, attn = self.encoder_attn(x, keys, values,
                                    need_weights=need_attn or (not self.training and self.need_attn),
                                    need_head_weights=need_head_weights)
        x = self.residual_connection(self.dropout_module(x), residual)
        if not self.normalize_before:
            x = self.encoder_attn_layer_norm(x)

        # F(.)
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_dropout_module(self.activation_fn(self.fc1(x)))
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        x = self.dropout_module(self.fc2(x))
        if self.w_resid is not None:
            residual = torch.mul(self.w_resid, residual)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x, attn, None


class LatentConditionedDecoder(TransformerDecoderBase):
    """fairseq Transformer decoder reading ``encoder_out["latents"]`` only.

    Subclasses implement :meth:`layer_memories` (what each layer attends to). ``forward``
    returns ``(logits [B, T, V], extra)`` with ``extra["attn"]`` (``[attn [B, T, S]]`` of the
    last layer, or ``[None]``), ``extra["inner_states"]`` and ``extra["posteriors"]``.

    Word dropout (Bowman et al. 2016; the QKVAE authors use 0.4), ``reading``:

    * ``paper``: decoder-input tokens are replaced by ``<unk>`` with probability p in training
      only (the first position is kept); the logits are the tied embedding times the features;
    * ``authors`` (ghazi-f/QKVAE ``components/latent_variables.py`` ``Categorical.rep``): the
      token embeddings are multiplied by a Bernoulli(1 - p) mask in training, at every position
      including the first, and by 1 - p in evaluation (decoding too); the features pass a
      Linear(C, C) (``output_hidden``, their ``hidden_to_z_params['logits']``) before the tied
      embedding.
    """

    def __init__(self, cfg, dictionary, embed_tokens, word_dropout_p: float, reading: str = "paper"):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=False)
        self.word_dropout_p = float(word_dropout_p)
        self.reading = reading
        dim = cfg.decoder.embed_dim
        self.output_hidden = nn.Linear(dim, dim) if reading == "authors" else None

    def token_embedding_scale(self, tokens: Tensor, like: Tensor) -> Optional[Tensor]:
        """The authors' word dropout on embeddings: ``[B, T, 1]`` mask (training) or 1 - p."""
        if self.reading != "authors" or self.word_dropout_p <= 0:
            return None
        if not self.training:
            return like.new_full((1, 1, 1), 1.0 - self.word_dropout_p)
        keep = torch.rand(tokens.shape, device=like.device) >= self.word_dropout_p
        return keep.to(like.dtype).unsqueeze(-1)

    def output_layer(self, features: Tensor) -> Tensor:
        if self.output_hidden is not None:
            features = self.output_hidden(features)
        return super().output_layer(features)

    def layer_memories(self, latents: Dict[str, Tensor]) -> List[object]:
        """One memory per layer (what its cross-attention reads), from ``{name: [B, D]}``."""
        raise NotImplementedError  # abstract

    def forward(self, prev_output_tokens: Tensor, encoder_out=None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                features_only: bool = False, alignment_layer: Optional[int] = None,
                alignment_heads: Optional[int] = None, **unused):
        """``prev_output_tokens`` ``[B, T]`` -> ``(logits [B, T, V], extra)``."""
        if encoder_out is None or "latents" not in encoder_out:
            raise ValueError(f"{self.__class__.__name__} needs encoder_out['latents']")
        if self.reading == "paper" and self.training and incremental_state is None and self.word_dropout_p > 0:
            prev_output_tokens = word_dropout(prev_output_tokens, self.word_dropout_p, self.dictionary.unk())
        x, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state,
                                         alignment_layer=alignment_layer, alignment_heads=alignment_heads)
        if not features_only:
            x = self.output_layer(x)
        extra["posteriors"] = posteriors_of(encoder_out)
        return x, extra

    def extract_features(self, prev_output_tokens: Tensor, encoder_out,
                         incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                         full_context_alignment: bool = False, alignment_layer: Optional[int] = None,
                         alignment_heads: Optional[int] = None, **unused):
        """fairseq's ``extract_features_scriptable`` with a per-layer latent memory:
        ``[B, T]`` -> ``(features [B, T, C], {"attn": [...], "inner_states": [...]})``."""
        if alignment_layer is None:
            alignment_layer = self.num_layers - 1
        memories = self.layer_memories(encoder_out["latents"])

        positions = None
        if self.embed_positions is not None:
            positions = self.embed_positions(prev_output_tokens, incremental_state=incremental_state)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            if positions is not None:
                positions = positions[:, -1:]
        x = self.embed_scale * self.embed_tokens(prev_output_tokens.contiguous())
        keep = self.token_embedding_scale(prev_output_tokens, x)
        if keep is not None:
            x = x * keep
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if positions is not None:
            x = x + positions
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x).transpose(0, 1)  # [T, B, C]

        self_attn_padding_mask: Optional[Tensor] = None
        if prev_output_tokens.eq(self.padding_idx).any():
            self_attn_padding_mask = prev_output_tokens.eq(self.padding_idx)

        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x]
        for idx, (layer, memory) in enumerate(zip(self.layers, memories)):
            self_attn_mask = (self.buffered_future_mask(x)
                              if incremental_state is None and not full_context_alignment else None)
            x, layer_attn, _ = layer(
                x, memory, None, incremental_state,
                self_attn_mask=self_attn_mask, self_attn_padding_mask=self_attn_padding_mask,
                need_attn=bool(idx == alignment_layer), need_head_weights=bool(idx == alignment_layer),
            )
            inner_states.append(x)
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.float().to(x)
        if attn is not None:
            if alignment_heads is not None:
                attn = attn[:alignment_heads]
            attn = attn.mean(dim=0)  # average over heads: [B, T, S]
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, {"attn": [attn], "inner_states": inner_states}


class QKVDecoder(LatentConditionedDecoder):
    """QKVAE's decoder: w~_i = QKVDec(w_0..w_{i-1}; k; v) (Section 4.1).

    * keys: ``key_mlp(z_syn)`` ``[B, d_syn] -> [B, layers * L * C]`` reshaped to L keys of size C
      per layer (``key_mlp_layers`` = 1: the paper's linear M^s; 2: the authors' Linear-GELU-
      Linear with hidden size C);
    * values: ``value_proj(Cat(d_l; z_sem_l))`` ``[B, L, 2 d_sem] -> [B, L, layers * C]``, one
      value per slot and layer; ``d_l`` are learned slot identifiers of size d_sem.

    z_syn reaches the logits only through the keys (attention weights) and z_sem only through
    the values (:meth:`keys_and_values`).
    """

    def __init__(self, cfg, dictionary, embed_tokens, word_dropout_p: float, syn_dim: int, slots: int,
                 slot_dim: int, key_mlp_layers: int, reading: str = "paper"):
        super().__init__(cfg, dictionary, embed_tokens, word_dropout_p, reading)
        dim = cfg.decoder.embed_dim
        self.slots, self.slot_dim, self.syn_dim = slots, slot_dim, syn_dim
        layers: List[nn.Module] = []
        in_dim = syn_dim
        for _ in range(key_mlp_layers - 1):
            layers += [nn.Linear(in_dim, dim), nn.GELU()]
            in_dim = dim
        layers.append(nn.Linear(in_dim, self.num_layers * slots * dim))
        self.key_mlp = nn.Sequential(*layers)
        self.slot_ids = nn.Parameter(torch.randn(slots, slot_dim))  # d = {d_1..d_L}
        self.value_proj = nn.Linear(2 * slot_dim, self.num_layers * dim)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        # not wrapped for --checkpoint-activations: fairseq's wrapper only tracks top-level
        # tensor arguments, and this layer's memory is a (keys, values) pair
        return QKVDecoderLayer(cfg)

    def latent_keys(self, z_syn: Tensor) -> Tensor:
        """k = M^s(z_syn): ``[B, d_syn] -> [B, layers, L, C]`` (footnote 5: reshaped)."""
        return self.key_mlp(z_syn).view(z_syn.size(0), self.num_layers, self.slots, -1)

    def latent_values(self, z_sem: Tensor) -> Tensor:
        """v = Cat(d; z_sem), projected per layer: ``[B, L * d_sem] -> [B, layers, L, C]``."""
        bsz = z_sem.size(0)
        sem = z_sem.view(bsz, self.slots, self.slot_dim)
        ids = self.slot_ids.to(sem.dtype).unsqueeze(0).expand(bsz, -1, -1)
        values = self.value_proj(torch.cat([ids, sem], dim=-1))  # [B, L, layers * C]
        return values.view(bsz, self.slots, self.num_layers, -1).transpose(1, 2)

    def keys_and_values(self, latents: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
        """``(keys, values)``, each ``[B, layers, L, C]``; keys from z_syn only, values from z_sem only."""
        return self.latent_keys(latents["z_syn"]), self.latent_values(latents["z_sem"])

    def layer_memories(self, latents: Dict[str, Tensor]) -> List[object]:
        keys, values = self.keys_and_values(latents)
        return [(keys[:, i], values[:, i]) for i in range(self.num_layers)]


class ADVAEDecoder(LatentConditionedDecoder):
    """ADVAE's decoder: w~_i = Dec(w_0..w_{i-1}; Enc(y)), y = Cat(d; z) (Section 3.3).

    ``y_l = Cat(d_l; z_l)`` (learned slot identifiers of the latent's slot size) is projected
    to the model size, layer-normalised (BART's ``layernorm_embedding`` position) and passed
    through ``latent_encoder_layers`` Transformer encoder layers; every decoder layer
    cross-attends (ordinary fairseq encoder-decoder attention) to the resulting L vectors.
    """

    def __init__(self, cfg, dictionary, embed_tokens, word_dropout_p: float, slots: int, slot_dim: int,
                 latent_encoder_layers: int, latent_name: str = "z"):
        super().__init__(cfg, dictionary, embed_tokens, word_dropout_p)
        dim = cfg.encoder.embed_dim
        self.slots, self.slot_dim, self.latent_name = slots, slot_dim, latent_name
        self.slot_ids = nn.Parameter(torch.randn(slots, slot_dim))  # d = {d_1..d_L}
        self.latent_in = nn.Linear(2 * slot_dim, dim)
        self.latent_layernorm = LayerNorm(dim) if cfg.layernorm_embedding else None
        self.latent_dropout = FairseqDropout(cfg.dropout, module_name=self.__class__.__name__)
        self.latent_layers = nn.ModuleList(
            [TransformerEncoderLayerBase(cfg) for _ in range(latent_encoder_layers)]
        )
        self.latent_layer_norm = (LayerNorm(dim) if cfg.encoder.normalize_before and latent_encoder_layers > 0
                                  else None)

    def encode_latents(self, z: Tensor) -> Tensor:
        """Enc(Cat(d; z)): ``[B, L * d] -> [L, B, C]`` (fairseq's time-first layout)."""
        bsz = z.size(0)
        ids = self.slot_ids.to(z.dtype).unsqueeze(0).expand(bsz, -1, -1)
        y = self.latent_in(torch.cat([ids, z.view(bsz, self.slots, self.slot_dim)], dim=-1))
        if self.latent_layernorm is not None:
            y = self.latent_layernorm(y)
        y = self.latent_dropout(y).transpose(0, 1)
        for layer in self.latent_layers:
            y = layer(y, None)
        if self.latent_layer_norm is not None:
            y = self.latent_layer_norm(y)
        return y

    def layer_memories(self, latents: Dict[str, Tensor]) -> List[object]:
        memory = self.encode_latents(latents[self.latent_name])
        return [memory] * self.num_layers
