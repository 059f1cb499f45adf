"""``optimus``: a BERT encoder and a GPT-2 decoder joined by a latent z (Li et al., 2020).

Section and equation numbers refer to Li et al., EMNLP 2020, arXiv:2004.04092; "the authors' code" to
ChunyuanLI/Optimus (``code/pytorch_transformers/modeling_{bert,gpt2}.py``).

* **Encoder** q(z|x) (Sec. 4.2, "Latent Vector Injection"): ``transformers.BertModel`` over
  ``[CLS] x``; the fairseq source (``sentence </s>``) has no [CLS], so the dictionary's
  ``<s>`` is prepended as the [CLS] position (with ``--bert-dir`` it maps to BERT's
  ``[CLS]`` and ``</s>`` to ``[SEP]``: the input is exactly BERT's ``[CLS] x [SEP]``). The
  [CLS] representation goes through W_E (``Linear(H -> 2P, bias=False)``) and is split into
  mu and log sigma^2. ``--optimus-cls-pooling pooler`` (default) uses BERT's pooled output
  (dense + tanh over the last-layer [CLS]) as the authors' code does;
  ``--optimus-cls-pooling cls`` uses the last-layer [CLS] hidden state h_[CLS] as the paper's
  text describes (z = W_E h_[CLS]). P = 32 (``--latent-dim``).
* **Decoder** p(x|z) (eq. 2): ``transformers.GPT2LMHeadModel``, output layer tied to the input
  embeddings, with the two injections of Sec. 4.2 (``--latent-injection``, default ``both``
  as in the paper's experiments, App. B.1):

  - *memory*: h_Mem = W_M z in R^{L*H} is cut into L vectors of size H, one per layer; in
    layer l it is one extra key/value position that every token attends to. It enters through
    GPT-2's own ``past_key_values``: a one-position past is written into a ``DynamicCache``
    before the tokens are run, exactly how the authors feed ``past = W_M z`` to GPT-2. By
    default (``--optimus-memory-kv direct``) the slot's key and value are both h_Mem_l split
    into heads, as in the authors' code (``past_split = torch.split(W_M z, H)``,
    ``layer_past = (h_l, h_l)``); ``projected`` instead passes h_Mem_l through the layer's own
    c_attn key and value projections (an extra hidden state rather than a key/value).
    As in the authors' code, the memory occupies position 0, so token positions start at 1
    (GPT-2 counts the past); the decoder therefore handles ``n_positions - 1`` tokens.
  - *embedding*: h'_Emb = h_Emb + W_D z is added to every token embedding (``inputs_embeds``).

  The attention mask is built here as a 4-D additive mask: every position sees the memory
  slot, itself and the earlier non-padding tokens, so padding on either side is handled and
  no row is ever empty. Incremental decoding keeps GPT-2's per-layer keys and values (memory
  slot included) in fairseq's ``incremental_state``; beam search reorders them.

**Vocabulary.** Encoder and decoder index the task's one fairseq dictionary (Optimus: WordPiece
in, BPE out); from scratch, both embedding tables have ``len(dictionary)`` rows. ``--bert-dir``
/ ``--gpt2-dir`` load pre-trained weights, mapping the dictionary onto that model's
vocabulary (see :mod:`.pretrained`); both at once only when they share one vocabulary.
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models import FairseqIncrementalDecoder, register_model
from torch import Tensor, nn

from latent_core.errors import check_heads_divide, check_positive_int, option_flag
from user_dir.model_config import add_config_args, model_options, register_architecture
from user_dir.sentence_vae.base import SentenceVAEEncoder, SentenceVAEModel, decoder_extra

from .pretrained import (
    OptimusConfigError,
    PretrainedDirectory,
    bert_special_ids,
    check_one_dictionary,
    gpt2_special_ids,
    inspect_pretrained_directory,
    load_pretrained,
    map_dictionary,
)

if TYPE_CHECKING:  # imported where a model is built, so `--user-dir user_dir` starts without transformers
    from transformers import BertModel, DynamicCache, GPT2LMHeadModel

logger = logging.getLogger(__name__)

POOLINGS = ("pooler", "cls")
INJECTIONS = ("memory", "embedding", "both")
MEMORY_KV = ("direct", "projected")
LATENT = "z"
ATTN_IMPLEMENTATION = "sdpa"  # the 4-D float mask below suits "sdpa" and "eager"


@dataclass
class OptimusConfig(FairseqDataclass):
    """The paper's model (Sec. 4.2): BERT-base (L=12, H=768, A=12) + GPT-2 117M (L=12, H=768, A=12),
    P = 32, memory + embedding injection. The sizes apply from scratch; ``--bert-dir`` /
    ``--gpt2-dir`` bring their own."""

    latent_dim: int = field(default=32, metadata={"help": "size P of z"})
    optimus_cls_pooling: ChoiceEnum(POOLINGS) = field(
        default="pooler", metadata={"help": "sentence representation fed to W_E: 'pooler' = BERT's pooled output "
                                            "(dense+tanh on [CLS], the authors' code), 'cls' = the last-layer "
                                            "[CLS] hidden state (the paper's text)"})
    latent_injection: ChoiceEnum(INJECTIONS) = field(
        default="both", metadata={"help": "how z enters GPT-2 (Sec. 4.2): memory slot per layer, added to the "
                                          "token embeddings, or both (the paper's setting)"})
    optimus_memory_kv: ChoiceEnum(MEMORY_KV) = field(
        default="direct", metadata={"help": "memory slot of layer l: key = value = h_Mem_l ('direct', the "
                                            "authors' code) or h_Mem_l through the layer's c_attn key/value "
                                            "projections ('projected')"})
    bert_dir: Optional[str] = field(
        default=None, metadata={"help": "initialise the encoder from this local Hugging Face BERT directory "
                                        "(config.json, weights, vocab.txt); its sizes override --encoder-*"})
    gpt2_dir: Optional[str] = field(
        default=None, metadata={"help": "initialise the decoder from this local Hugging Face GPT-2 directory "
                                        "(config.json, weights, vocab.json); its sizes override --decoder-*"})
    encoder_layers: int = field(default=12, metadata={"help": "BERT layers (from scratch)"})
    encoder_embed_dim: int = field(default=768, metadata={"help": "BERT hidden size (from scratch)"})
    encoder_attention_heads: int = field(default=12, metadata={"help": "BERT attention heads (from scratch)"})
    encoder_ffn_embed_dim: int = field(default=3072, metadata={"help": "BERT feed-forward inner size (from scratch)"})
    decoder_layers: int = field(default=12, metadata={"help": "GPT-2 layers (from scratch)"})
    decoder_embed_dim: int = field(default=768, metadata={"help": "GPT-2 hidden size (from scratch)"})
    decoder_attention_heads: int = field(default=12, metadata={"help": "GPT-2 attention heads (from scratch)"})
    decoder_ffn_embed_dim: int = field(default=3072,
                                       metadata={"help": "GPT-2 feed-forward inner size (from scratch)"})
    max_encoder_positions: int = field(
        default=512, metadata={"help": "BERT's position table (max_position_embeddings, from scratch); the [CLS] "
                                       "takes one"})
    max_decoder_positions: int = field(
        default=1024, metadata={"help": "GPT-2's position table (n_positions, from scratch); the memory slot "
                                        "takes one"})
    dropout: float = field(default=0.1, metadata={"help": "dropout of BERT's and GPT-2's hidden states and embeddings"})
    attention_dropout: float = field(default=0.1, metadata={"help": "dropout of the attention weights"})


class OptimusEncoder(SentenceVAEEncoder):
    """q(z|x) = N(mu, diag sigma^2), [mu, log sigma^2] = W_E pool(BERT([CLS] x)) (Sec. 4.2).

    ``vocab_rows`` (``[V]``, or ``None`` for the identity) maps fairseq indices to BERT ids.
    """

    def __init__(self, dictionary, bert: "BertModel", latent_dim: int, pooling: str,
                 vocab_rows: Optional[List[int]] = None):
        super().__init__(dictionary)
        if pooling == "pooler" and bert.pooler is None:
            raise OptimusConfigError("--optimus-cls-pooling pooler needs BERT's pooling layer")
        self.bert = bert
        self.pooling = pooling
        self.latent_dim = latent_dim
        self.cls_index = dictionary.bos()
        self.padding_idx = dictionary.pad()
        config = bert.config
        self.posterior = nn.Linear(config.hidden_size, 2 * latent_dim, bias=False)  # W_E
        nn.init.normal_(self.posterior.weight, std=config.initializer_range)
        self.max_source_positions = config.max_position_embeddings - 1  # one is the [CLS]
        rows = None if vocab_rows is None else torch.tensor(vocab_rows, dtype=torch.long)
        self.register_buffer("vocab_rows", rows)

    def bert_inputs(self, src_tokens: Tensor) -> Tuple[Tensor, Tensor]:
        """``[B, S]`` fairseq source (either padding side) -> BERT ``(input_ids, attention_mask)``
        ``[B, S + 1]``: right-padded, ``<s>`` prepended as [CLS] (unless every row already
        starts with it), mapped to BERT ids."""
        tokens = utils.convert_padding_direction(src_tokens, self.padding_idx, left_to_right=True)
        if tokens.size(1) == 0 or not bool((tokens[:, 0] == self.cls_index).all()):
            cls = tokens.new_full((tokens.size(0), 1), self.cls_index)
            tokens = torch.cat([cls, tokens], dim=1)
        if tokens.size(1) > self.max_source_positions + 1:
            raise ValueError(
                f"source of {tokens.size(1) - 1} tokens (+[CLS]) exceeds BERT's "
                f"{self.max_source_positions + 1} positions (--max-encoder-positions)"
            )
        mask = tokens.ne(self.padding_idx)
        ids = tokens if self.vocab_rows is None else self.vocab_rows[tokens]
        return ids, mask.long()

    def sentence_representation(self, src_tokens: Tensor) -> Tensor:
        """The pooled [CLS] representation ``[B, H]`` (BERT pooler or last-layer h_[CLS])."""
        ids, mask = self.bert_inputs(src_tokens)
        out = self.bert(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
        if self.pooling == "pooler":
            return out.pooler_output
        return out.last_hidden_state[:, 0]

    def posterior_parameters(self, src_tokens: Tensor, src_lengths: Tensor):
        """-> ``({"z": mu [B, P]}, {"z": log sigma^2 [B, P]})``."""
        mean, logvar = self.posterior(self.sentence_representation(src_tokens)).chunk(2, dim=-1)
        return {LATENT: mean}, {LATENT: logvar}


class OptimusDecoder(FairseqIncrementalDecoder):
    """p(x_t | x_<t, z) with GPT-2 and the memory / embedding injections of Sec. 4.2.

    Reads ``encoder_out["latents"]["z"]`` ``[B, P]`` only; returns ``(logits [B, T, V],
    extra)`` with ``extra["posteriors"]``. ``vocab_rows`` (``[V]`` or ``None``) maps fairseq
    indices to rows of GPT-2's (tied) embedding matrix.
    """

    def __init__(self, dictionary, gpt2: "GPT2LMHeadModel", latent_dim: int, injection: str,
                 memory_kv: str = "direct", vocab_rows: Optional[List[int]] = None):
        super().__init__(dictionary)
        self.gpt2 = gpt2
        config = gpt2.config
        self.num_layers = config.n_layer
        self.hidden_size = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.injection = injection
        self.memory_kv = memory_kv
        self.padding_idx = dictionary.pad()
        uses_memory = injection in ("memory", "both")
        uses_embedding = injection in ("embedding", "both")
        # W_M in R^{LH x P} and W_D in R^{H x P} (Sec. 4.2); GPT-2's initialisation
        self.memory_proj = (nn.Linear(latent_dim, self.num_layers * self.hidden_size, bias=False)
                            if uses_memory else None)
        self.embed_proj = nn.Linear(latent_dim, self.hidden_size, bias=False) if uses_embedding else None
        for proj in (self.memory_proj, self.embed_proj):
            if proj is not None:
                nn.init.normal_(proj.weight, std=config.initializer_range)
        self.num_memory = 1 if uses_memory else 0
        self.max_target_positions = config.n_positions - self.num_memory
        rows = None if vocab_rows is None else torch.tensor(vocab_rows, dtype=torch.long)
        self.register_buffer("vocab_rows", rows)

    def max_positions(self):
        return self.max_target_positions

    # -- the two injections -------------------------------------------------------------
    def memory_key_values(self, z: Tensor) -> List[Tuple[Tensor, Tensor]]:
        """h_Mem = W_M z ``[B, L*H]`` cut into L slots -> per layer (key, value) ``[B, A, 1, H/A]``."""
        batch = z.size(0)
        memory = self.memory_proj(z).view(batch, self.num_layers, self.hidden_size)
        key_values = []
        for layer, block in enumerate(self.gpt2.transformer.h):
            h_mem = memory[:, layer]  # [B, H]
            if self.memory_kv == "projected":
                c_attn = block.attn.c_attn  # Conv1D: x @ W [H, 3H] + b; columns q | k | v
                kv = torch.addmm(c_attn.bias[self.hidden_size:], h_mem, c_attn.weight[:, self.hidden_size:])
                key, value = kv.split(self.hidden_size, dim=-1)
            else:  # the authors' code: layer_past = (h_Mem_l, h_Mem_l)
                key = value = h_mem
            key_values.append((self._heads(key), self._heads(value)))
        return key_values

    def _heads(self, x: Tensor) -> Tensor:
        """``[B, H]`` -> ``[B, A, 1, H/A]`` (one position, GPT-2's head split)."""
        return x.view(x.size(0), self.num_heads, 1, self.head_dim)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """GPT-2 token embeddings h_Emb of fairseq indices ``[B, T] -> [B, T, H]``."""
        rows = tokens if self.vocab_rows is None else self.vocab_rows[tokens]
        return self.gpt2.transformer.wte(rows)

    # -- positions and mask ---------------------------------------------------------------
    def _positions(self, tokens: Tensor) -> Tensor:
        """GPT-2 position ids ``[B, T]``: counts of non-padding tokens, after the memory slot."""
        nonpad = tokens.ne(self.padding_idx).long()
        return (torch.cumsum(nonpad, dim=1) - 1).clamp(min=0) + self.num_memory

    def _attention_mask(self, tokens: Tensor, num_cached: int, dtype: torch.dtype) -> Tensor:
        """Additive mask ``[B, 1, T - num_cached, num_memory + T]`` for the queries after the
        ``num_cached`` tokens already in the cache: keys = memory slot (always visible), then
        the tokens (visible if not later than the query and not padding; a query always sees
        itself, so a padded query row is never empty)."""
        batch, length = tokens.shape
        nonpad = tokens.ne(self.padding_idx)
        query = torch.arange(num_cached, length, device=tokens.device)
        key = torch.arange(length, device=tokens.device)
        causal = key[None, :] <= query[:, None]  # [Tq, T]
        visible = (causal[None] & nonpad[:, None, :]) | (key[None, :] == query[:, None])[None]
        if self.num_memory:
            memory = visible.new_ones(batch, visible.size(1), self.num_memory)
            visible = torch.cat([memory, visible], dim=-1)
        mask = torch.zeros(visible.shape, dtype=dtype, device=tokens.device)
        return mask.masked_fill(~visible, torch.finfo(dtype).min).unsqueeze(1)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, prev_output_tokens: Tensor, encoder_out=None, incremental_state=None,
                features_only: bool = False, **unused):
        features, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state)
        if not features_only:
            features = self.output_layer(features)
        return features, extra

    def extract_features(self, prev_output_tokens: Tensor, encoder_out=None, incremental_state=None,
                         **unused):
        """GPT-2's last hidden states ``[B, T', H]`` (T' = the tokens not yet in the incremental
        cache; T without one) and ``{"attn": None, "posteriors": {...}}`` (:func:`decoder_extra`)."""
        if encoder_out is None or LATENT not in encoder_out.get("latents", {}):
            raise ValueError("the Optimus decoder needs encoder_out['latents']['z'] [B, P]")
        z = encoder_out["latents"][LATENT]
        if z.size(0) != prev_output_tokens.size(0):
            raise ValueError(f"latents for {z.size(0)} sentences, decoder input for {prev_output_tokens.size(0)}")
        from transformers import DynamicCache

        cache = DynamicCache(config=self.gpt2.config)
        state = self._get_cache(incremental_state) if incremental_state is not None else None
        if state:
            for layer in range(self.num_layers):
                cache.update(state[f"key_{layer}"], state[f"value_{layer}"], layer)
            num_cached = state["key_0"].size(2) - self.num_memory
        else:
            if self.memory_proj is not None:  # the one-position past: h_Mem_l in layer l
                for layer, (key, value) in enumerate(self.memory_key_values(z)):
                    cache.update(key, value, layer)
            num_cached = 0
        if prev_output_tokens.size(1) <= num_cached:
            raise ValueError("incremental decoding was called without a new token")
        if prev_output_tokens.size(1) > self.max_target_positions:
            raise ValueError(
                f"{prev_output_tokens.size(1)} decoder positions exceed the "
                f"{self.max_target_positions} GPT-2 allows here (--max-decoder-positions)"
            )
        new_tokens = prev_output_tokens[:, num_cached:]
        embeds = self.embed_tokens(new_tokens)
        if self.embed_proj is not None:
            embeds = embeds + self.embed_proj(z).unsqueeze(1)  # h'_Emb = h_Emb + W_D z
        out = self.gpt2.transformer(
            inputs_embeds=embeds,
            past_key_values=cache,
            attention_mask=self._attention_mask(prev_output_tokens, num_cached, embeds.dtype),
            position_ids=self._positions(prev_output_tokens)[:, num_cached:],
            use_cache=True,
        )
        if incremental_state is not None:
            self._set_cache(incremental_state, cache)
        return out.last_hidden_state, decoder_extra(encoder_out)

    def output_layer(self, features: Tensor) -> Tensor:
        """Logits over the fairseq dictionary with GPT-2's tied output embedding ``[B, T, V]``."""
        if self.vocab_rows is None:
            return self.gpt2.lm_head(features)
        return F.linear(features, self.gpt2.lm_head.weight.index_select(0, self.vocab_rows))

    # -- incremental state ----------------------------------------------------------------
    def _get_cache(self, incremental_state) -> Optional[Dict[str, Tensor]]:
        return self.get_incremental_state(incremental_state, "gpt2_cache")

    def _set_cache(self, incremental_state, cache: "DynamicCache") -> None:
        state = {}
        for layer in range(self.num_layers):
            state[f"key_{layer}"] = cache.layers[layer].keys
            state[f"value_{layer}"] = cache.layers[layer].values
        self.set_incremental_state(incremental_state, "gpt2_cache", state)

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Select beams: every cached key/value ``[B, A, M + t, H/A]`` along the batch."""
        state = self._get_cache(incremental_state)
        if state is None:
            return
        state = {name: value.index_select(0, new_order) for name, value in state.items()}
        self.set_incremental_state(incremental_state, "gpt2_cache", state)


@register_model("optimus", dataclass=OptimusConfig)
class OptimusModel(SentenceVAEModel):
    """Optimus (Li et al., 2020): BERT encoder, latent z (``latent_sizes = {"z": P}``), GPT-2 decoder."""

    def __init__(self, args, encoder: OptimusEncoder, decoder: OptimusDecoder):
        # what the authors' run computes: the KL hinge mask of their code (``--kl-variant free_bits``
        # gives the paper's eq. 9) and the loss averaged over sentences (their loss_rec + beta *
        # loss_kl, .mean() over the batch)
        super().__init__(encoder, decoder, OrderedDict([(LATENT, encoder.latent_dim)]),
                         default_kl_variant="hinge", sentence_average_loss=True)
        self.args = args

    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, OptimusConfig)

    @classmethod
    def build_model(cls, args, task):
        """``args``: fairseq-train's Namespace or a config; read and completed in place (the sizes of
        ``--bert-dir`` / ``--gpt2-dir`` are recorded in it)."""
        args = model_options(cls, args)
        validate_optimus_args(args)
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        bert_dir = (inspect_pretrained_directory(args.bert_dir, "--bert-dir", "bert")
                    if args.bert_dir else None)
        gpt2_dir = (inspect_pretrained_directory(args.gpt2_dir, "--gpt2-dir", "gpt2")
                    if args.gpt2_dir else None)
        if bert_dir is not None and gpt2_dir is not None:
            check_one_dictionary(src_dict, tgt_dict, bert_dir, gpt2_dir)
        encoder = build_encoder(args, src_dict, bert_dir)
        decoder = build_decoder(args, tgt_dict, gpt2_dir)
        return cls(args, encoder, decoder)


# -- building the two sides -----------------------------------------------------------------
_BERT_SIZES = (("encoder_layers", "num_hidden_layers"), ("encoder_embed_dim", "hidden_size"),
               ("encoder_attention_heads", "num_attention_heads"),
               ("encoder_ffn_embed_dim", "intermediate_size"),
               ("max_encoder_positions", "max_position_embeddings"))
_GPT2_SIZES = (("decoder_layers", "n_layer"), ("decoder_embed_dim", "n_embd"),
               ("decoder_attention_heads", "n_head"), ("decoder_ffn_embed_dim", "n_inner"),
               ("max_decoder_positions", "n_positions"))


def _adopt_pretrained_sizes(args, directory: PretrainedDirectory, sizes) -> None:
    """Sizes come from the directory's config.json: warn where the flags disagree, and record
    the real sizes in ``args`` (so the saved arguments describe the model)."""
    config = dict(directory.config)
    if directory.model_type == "gpt2" and config.get("n_inner") is None:
        config["n_inner"] = 4 * config["n_embd"]  # GPT-2's default inner size
    differing = []
    for arg, key in sizes:
        real = config.get(key)
        if real is None:
            continue
        if getattr(args, arg, None) != real:
            differing.append(f"{option_flag(arg)} {getattr(args, arg, None)} -> {key} {real}")
        setattr(args, arg, real)
    if differing:
        logger.warning("%s %s: the sizes come from its config.json, not from the architecture flags: %s",
                       directory.option, directory.path, "; ".join(differing))


def build_encoder(args, dictionary, directory: Optional[PretrainedDirectory] = None) -> OptimusEncoder:
    """BERT from scratch (``--encoder-*`` sizes, ``len(dictionary)`` rows) or from ``--bert-dir``."""
    from transformers import BertConfig, BertModel

    pooler = args.optimus_cls_pooling == "pooler"
    dropout = dict(hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.attention_dropout)
    if directory is None:
        config = BertConfig(
            vocab_size=len(dictionary),
            hidden_size=args.encoder_embed_dim,
            num_hidden_layers=args.encoder_layers,
            num_attention_heads=args.encoder_attention_heads,
            intermediate_size=args.encoder_ffn_embed_dim,
            max_position_embeddings=args.max_encoder_positions,
            pad_token_id=dictionary.pad(),
            **dropout,
        )
        config._attn_implementation = ATTN_IMPLEMENTATION
        return OptimusEncoder(dictionary, BertModel(config, add_pooling_layer=pooler),
                              args.latent_dim, args.optimus_cls_pooling)
    _adopt_pretrained_sizes(args, directory, _BERT_SIZES)
    special = bert_special_ids(directory, dictionary)
    rows, _ = map_dictionary(dictionary, directory, special, distinct_rows=False,
                             unknown_id=special[dictionary.unk_word])
    bert = load_pretrained(BertModel, directory, allowed_missing=("pooler.",), add_pooling_layer=pooler,
                           attn_implementation=ATTN_IMPLEMENTATION, **dropout)
    return OptimusEncoder(dictionary, bert, args.latent_dim, args.optimus_cls_pooling, vocab_rows=rows)


def build_decoder(args, dictionary, directory: Optional[PretrainedDirectory] = None) -> OptimusDecoder:
    """GPT-2 from scratch (``--decoder-*`` sizes, ``len(dictionary)`` rows) or from ``--gpt2-dir``
    (new embedding rows for the fairseq specials GPT-2 lacks)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    dropout = dict(resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.attention_dropout)
    if directory is None:
        config = GPT2Config(
            vocab_size=len(dictionary),
            n_positions=args.max_decoder_positions,
            n_embd=args.decoder_embed_dim,
            n_layer=args.decoder_layers,
            n_head=args.decoder_attention_heads,
            n_inner=args.decoder_ffn_embed_dim,
            bos_token_id=dictionary.eos(),  # fairseq decoding starts from </s>
            eos_token_id=dictionary.eos(),
            pad_token_id=dictionary.pad(),
            tie_word_embeddings=True,
            **dropout,
        )
        config._attn_implementation = ATTN_IMPLEMENTATION
        gpt2 = GPT2LMHeadModel(config)
        rows = None
    else:
        _adopt_pretrained_sizes(args, directory, _GPT2_SIZES)
        rows, num_new = map_dictionary(dictionary, directory, gpt2_special_ids(directory, dictionary),
                                       distinct_rows=True)
        gpt2 = load_pretrained(GPT2LMHeadModel, directory, allowed_missing=("lm_head.",),
                               attn_implementation=ATTN_IMPLEMENTATION, tie_word_embeddings=True, **dropout)
        if num_new:
            logger.info("%s: %d new embedding rows for fairseq symbols GPT-2 lacks", directory.option, num_new)
            gpt2.resize_token_embeddings(directory.vocab_size + num_new)
    if gpt2.lm_head.weight is not gpt2.transformer.wte.weight:
        raise OptimusConfigError("GPT-2's output layer is not tied to its input embeddings")
    return OptimusDecoder(dictionary, gpt2, args.latent_dim, args.latent_injection,
                          args.optimus_memory_kv, vocab_rows=rows)


# -- options ------------------------------------------------------------------------------
def validate_optimus_args(args) -> None:
    """Early errors that name the option."""
    if args.latent_dim < 1:
        raise OptimusConfigError(f"--latent-dim={args.latent_dim} must be >= 1")
    for name, choices in (("optimus_cls_pooling", POOLINGS), ("latent_injection", INJECTIONS),
                          ("optimus_memory_kv", MEMORY_KV)):
        if getattr(args, name) not in choices:
            raise OptimusConfigError(f"{option_flag(name)}={getattr(args, name)!r}: choose from {choices}")
    for name in ("dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise OptimusConfigError(f"{option_flag(name)}={getattr(args, name)} must be in [0, 1)")
    for side, pretrained in (("encoder", args.bert_dir), ("decoder", args.gpt2_dir)):
        if pretrained:
            continue  # sizes come from the directory
        check_positive_int(f"--{side}-embed-dim", getattr(args, f"{side}_embed_dim"), OptimusConfigError)
        check_heads_divide(f"--{side}-attention-heads", getattr(args, f"{side}_attention_heads"),
                           f"--{side}-embed-dim", getattr(args, f"{side}_embed_dim"), OptimusConfigError)
        for name in (f"{side}_layers", f"{side}_ffn_embed_dim"):
            if getattr(args, name) < 1:
                raise OptimusConfigError(f"{option_flag(name)}={getattr(args, name)} must be >= 1")
        positions = getattr(args, f"max_{side}_positions")
        if positions < 2:
            raise OptimusConfigError(f"--max-{side}-positions={positions} must be >= 2")


# Architectures: the fields each changes (``optimus``, the model name, is the config's defaults)
ARCHITECTURES = {
    "optimus_base": {},
    "optimus_small": dict(  # a CPU-sized Optimus: 4 layers, H = 256, 4 heads, FFN 1024 on both sides
        encoder_layers=4, decoder_layers=4, encoder_embed_dim=256, decoder_embed_dim=256,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_embed_dim=1024, decoder_ffn_embed_dim=1024,
    ),
}
optimus_base, optimus_small = (register_architecture("optimus", arch, **overrides)
                               for arch, overrides in ARCHITECTURES.items())
