"""ADVAE's encoder (Felhi et al., NAACL 2022, arXiv:2205.05943, eq. 3), shared by QKVAE and ADVAE.

q(z | w) = prod_l q(z_l | w):

    z~ = Dec(e; Enc(w))                                    (eq. 3)
    mu_l = M_mu(z~_l),  sigma_l = SoftPlus(M_sigma(z~_l)),  z_l ~ N(mu_l, sigma_l)

* ``Enc`` is a fairseq Transformer encoder over the sentence (BART's first layers when
  initialised from BART);
* ``Dec`` is a stack of Transformer decoder layers **without** a causal mask whose inputs are
  learned latent-query ("identifier") embeddings ``e`` that cross-attend to ``Enc(w)``
  (BART's last decoder layers when initialised from BART);
* every latent *group* (QKVAE: ``z_syn`` with 1 query, ``z_sem`` with L queries; ADVAE: ``z``
  with L queries) has its own ``M_mu`` / ``M_sigma`` (QKVAE Section 4.1: "matrices M_mu^s and
  M_sigma^s" for z_syn), shared by the queries of the group.

Two readings (``reading``; ``--qkvae-reading``):

* ``paper``: all queries of all groups run through ``Dec`` together, without a self-attention
  mask (the paper: z_syn is obtained "by adding an additional identifier embedding e_s"), so
  they may attend to each other; ``Enc`` reads the token embeddings as they are.
* ``authors`` (ghazi-f/QKVAE, ``components/links.py`` ``CoattentiveBARTTransformerLink``,
  ``disentanglement_qkv/graphs.py`` ``get_qkv_graphBART``): every group has its own pass through
  the shared ``Enc`` + ``Dec``: its own Linear(C, C) on the token embeddings before ``Enc``
  (``input_to_hidden``), its queries plus BART's learned decoder positions 0..slots-1 (the
  queries are BART's ``decoder_inputs_embeds``), and BART's causal decoder mask among the
  group's own queries (z_sem_l sees z_sem_1..l; z_syn's single query sees itself). The query
  embeddings start N(0, 1) (``nn.Embedding``), as theirs.

In both readings padding is masked in ``Enc`` and in the queries' cross-attention (the authors
call BART without an attention mask on padded batches, a defect not reproduced).

The interface (:mod:`user_dir.sentence_vae.base`) wants log-variances: the paper's softplus
parametrisation of sigma is kept and converted, ``logvar = 2 log(softplus(M_sigma h) +
SIGMA_FLOOR)``. A group of L slots of size d is one interface latent of size L * d whose
dimensions are grouped by slot: ``z[:, l * d:(l + 1) * d]`` is z_l.
"""

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from fairseq.models.transformer import TransformerEncoderBase
from fairseq.modules import FairseqDropout, LayerNorm, PositionalEmbedding
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from torch import Tensor, nn

from user_dir.sentence_vae.base import SentenceVAEEncoder

# sigma = softplus(.) + SIGMA_FLOOR (the authors' code adds the same 1e-8): keeps log sigma
# finite (>= -18.4) when the softplus underflows.
SIGMA_FLOOR = 1e-8

READINGS = ("authors", "paper")


@dataclass(frozen=True)
class LatentGroup:
    """One interface latent made of ``slots`` vectors of size ``slot_dim``."""

    name: str
    slots: int
    slot_dim: int

    @property
    def size(self) -> int:
        return self.slots * self.slot_dim


class LatentQueryEncoder(SentenceVAEEncoder):
    """Sentence -> Gaussian posteriors of the latent groups (eq. 3).

    Args:
        cfg: fairseq ``TransformerConfig`` (``encoder.*`` for ``Enc``, ``decoder.*`` for the
            query layers; both embedding sizes are equal).
        dictionary: the fairseq dictionary.
        embed_tokens: token embedding (shared with the decoder).
        groups: the latent groups, in order.
        posterior_layers: number of query (``Dec``) layers.
        reading: ``"paper"`` (one unmasked pass) or ``"authors"`` (one masked pass per group with
            its own input projection and query positions); see the module doc.
    """

    def __init__(self, cfg, dictionary, embed_tokens: nn.Embedding, groups: Sequence[LatentGroup],
                 posterior_layers: int, reading: str = "paper"):
        super().__init__(dictionary)
        if reading not in READINGS:
            raise ValueError(f"reading must be one of {READINGS}, got {reading!r}")
        self.reading = reading
        self.groups: Tuple[LatentGroup, ...] = tuple(groups)
        self.sentence_encoder = TransformerEncoderBase(cfg, dictionary, embed_tokens)
        self.max_source_positions = cfg.max_source_positions
        dim = cfg.decoder.embed_dim
        num_queries = sum(group.slots for group in self.groups)
        # e (and e_s for QKVAE), one row per latent vector
        self.latent_queries = nn.Parameter(torch.empty(num_queries, dim))
        nn.init.normal_(self.latent_queries, mean=0.0, std=1.0 if reading == "authors" else dim ** -0.5)
        if reading == "authors":
            # input_to_hidden of each group's pass, and BART's decoder positions of the queries
            # (fairseq's learned table, offset padding_idx + 1 = BART's 2)
            self.input_projections = nn.ModuleDict({g.name: nn.Linear(dim, dim) for g in self.groups})
            self.query_positions = PositionalEmbedding(max(g.slots for g in self.groups), dim,
                                                       dictionary.pad(), learned=True)
        self.query_layernorm = LayerNorm(dim) if cfg.layernorm_embedding else None
        self.dropout_module = FairseqDropout(cfg.dropout, module_name=self.__class__.__name__)
        self.query_layers = nn.ModuleList(
            [TransformerDecoderLayerBase(cfg) for _ in range(posterior_layers)]
        )
        self.query_layer_norm = LayerNorm(dim) if cfg.decoder.normalize_before else None
        # M_mu, M_sigma per group (eq. 3; M_mu^s, M_sigma^s of Section 4.1 for z_syn)
        self.mean_heads = nn.ModuleDict({g.name: nn.Linear(dim, g.slot_dim) for g in self.groups})
        self.sigma_heads = nn.ModuleDict({g.name: nn.Linear(dim, g.slot_dim) for g in self.groups})

    def query_states(self, src_tokens: Tensor, src_lengths: Tensor) -> Tensor:
        """z~ = Dec(e; Enc(w)): ``[B, S]`` tokens -> ``[B, num_queries, C]`` (groups in order)."""
        if self.reading == "paper":
            return self.decode_queries(self.latent_queries, src_tokens, src_lengths, None, causal=False)
        states: List[Tensor] = []
        start = 0
        token_embeddings = self.sentence_encoder.embed_tokens(src_tokens)
        for group in self.groups:
            queries = self.latent_queries[start:start + group.slots]
            start += group.slots
            positions = torch.arange(group.slots, device=queries.device) + self.query_positions.padding_idx + 1
            queries = queries + self.query_positions.weight[positions]
            projected = self.input_projections[group.name](token_embeddings)  # input_to_hidden
            states.append(self.decode_queries(queries, src_tokens, src_lengths, projected, causal=True))
        return torch.cat(states, dim=1)

    def decode_queries(self, queries: Tensor, src_tokens: Tensor, src_lengths: Tensor,
                       token_embeddings, causal: bool) -> Tensor:
        """One pass: ``Enc`` over the sentence (optionally from given ``token_embeddings``
        ``[B, S, C]``), then ``queries`` ``[Q, C]`` through ``Dec`` -> ``[B, Q, C]``."""
        enc = self.sentence_encoder(src_tokens, src_lengths=src_lengths, token_embeddings=token_embeddings)
        memory = enc["encoder_out"][0]  # [S, B, C]
        padding = enc["encoder_padding_mask"][0] if len(enc["encoder_padding_mask"]) > 0 else None
        if padding is not None and not padding.any():
            padding = None
        batch = src_tokens.size(0)
        h = queries.to(memory.dtype).unsqueeze(1).expand(-1, batch, -1)  # [Q, B, C]
        if self.query_layernorm is not None:
            h = self.query_layernorm(h)
        h = self.dropout_module(h)
        self_attn_mask = None
        if causal and queries.size(0) > 1:  # BART's decoder mask among the group's queries
            self_attn_mask = torch.triu(torch.full((queries.size(0), queries.size(0)), float("-inf"),
                                                   device=h.device, dtype=h.dtype), 1)
        for layer in self.query_layers:
            h, _, _ = layer(h, memory, padding, self_attn_mask=self_attn_mask)
        if self.query_layer_norm is not None:
            h = self.query_layer_norm(h)
        return h.transpose(0, 1)

    def posterior_parameters(self, src_tokens: Tensor, src_lengths: Tensor):
        """-> ``({name: mu [B, slots * slot_dim]}, {name: logvar [B, slots * slot_dim]})``."""
        h = self.query_states(src_tokens, src_lengths)
        means: Dict[str, Tensor] = {}
        logvars: Dict[str, Tensor] = {}
        start = 0
        for group in self.groups:
            h_group = h[:, start:start + group.slots]  # [B, slots, C]
            start += group.slots
            mean = self.mean_heads[group.name](h_group)  # mu_l = M_mu(z~_l)
            sigma = F.softplus(self.sigma_heads[group.name](h_group)) + SIGMA_FLOOR  # eq. 3
            means[group.name] = mean.reshape(mean.size(0), group.size)
            logvars[group.name] = (2.0 * torch.log(sigma)).reshape(sigma.size(0), group.size)
        return means, logvars
