"""The transformers adapter of the SDMA core: an attention function registered with transformers'
``AttentionInterface`` under the name ``"sdma"``, an SDMA core (the GMMs of eq. 5/9 and 18, the mixing weight g of
eq. 11) on every self-attention module, and the regularisers of eq. (24) handed back after each forward.

How a forward runs: a forward pre-hook on each self-attention module draws the sample z = x + sigma eps of
eq. (8) in training. In the ``paper`` reading it hands z to the module, whose own projections then give q, k and v
of z; in the ``authors`` reading (their fairseq ``DisentangledAttention``) k and v stay projections of the clean x
and the queries are W_q z + b (the module's ``query`` projection of z), with a second draw on the scaled queries.
transformers calls the registered function with the module, q, k, v and the mask; the function clusters the
sample (eq. 9), mixes A and the semantically masked A_bar (eq. 10, 11) through the core's one entry point
(:func:`latent_core.sdma.sdma_attention`, the reading's mask) and records the clustering for the regularisers
(eq. 20-23), which :func:`sdma_loss` returns. Masks reach the function in the boolean form of transformers'
``sdpa`` implementation (True = may attend). Pretrained projections are kept as loaded in both readings (the
authors' initialisation of the projections applies to training from scratch).

Supported: BERT-family encoders (self-attention modules with ``query``/``key``/``value`` projections:
BERT, RoBERTa, MiniLM, ...), GPT-2 decoders (``GPT2Attention``, causal), Llama-family decoders (Llama, Mistral,
Qwen2: rotary embeddings, grouped-query attention) and encoder-decoders (BART, Marian, mBART; T5 with its relative
position bias as the core's ``score_bias``): the paper's three attention types, encoder self-attention, decoder
self-attention and the decoder's cross-attention (queries from the decoder, keys from the encoder, each clustered by
the module's feature GMM; the authors reading perturbs the keys, whose projections are then of the noisy encoder
states while the values stay clean, as in their fairseq code). As in the fairseq adapter, a decoder self-attention's
mask is off at inference unless asked for, so ``generate()`` runs transformers' own attention with its KV cache;
encoder self-attention and cross-attention keep theirs (the cross-attention recomputes the keys' cluster
probabilities from the encoder states transformers hands it at every step).

Grouped-query attention: the responsibilities p(c|z) of eq. (9) belong to the query heads, as the feature GMM
clusters the input x in one slice of d_k = E / n_h per query head; a key/value head shared by a group of query
heads is repeated to each of them (transformers' ``repeat_kv``), and each query head masks it with its own
responsibilities: M_ts = sum_c p(c|z_t) p(c|z_s) of that query head's slice (eq. 10), as in a model with one
key/value head per query head whose key/value weights are the shared head's copies.
"""

import contextlib
import dataclasses
import os
import sys
import weakref
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.utils import logging as transformers_logging
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from latent_core.sdma import (
    SDMAConfigError,
    SDMACore,
    SDMALossWeights,
    SDMAOptions,
    check_finite,
    collect_sdma_losses,
    recording,
    scale_regulariser,
    sdma_attention,
    weighted_regulariser,
)

SDMA_ATTENTION = "sdma"
HF_ADVICE = ("lower the learning rate or the regulariser weights (sdma_loss(model, weights=...)), or train in float32 "
             "where it ran in half precision")

# the samples of each attention call in progress (:class:`_Drawn`): set by the module's pre-hook, read once by the
# attention function of the same call
_SAMPLES: "weakref.WeakKeyDictionary[nn.Module, _Drawn]" = weakref.WeakKeyDictionary()
# the open recording scope of a model's forward, and the records of its latest forward (for sdma_loss)
_SCOPES: "weakref.WeakKeyDictionary[nn.Module, contextlib.ExitStack]" = weakref.WeakKeyDictionary()
_RECORDS: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()
_FAMILY: "weakref.WeakKeyDictionary[nn.Module, AttentionFamily]" = weakref.WeakKeyDictionary()
# a cross-attention's decoder self-attention (the same layer's): its real query positions are the cross-attention's
_PARTNER: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()
# the real query positions ([B, T] float) of each decoder self-attention's latest call in training
_REAL_QUERIES: "weakref.WeakKeyDictionary[nn.Module, Tensor]" = weakref.WeakKeyDictionary()

ENCODER_SELF, DECODER_SELF, DECODER_CROSS = "encoder_self", "decoder_self", "decoder_cross"


@dataclasses.dataclass
class _Drawn:
    """What a module's pre-hook drew for one call: the input x, the input of the feature clustering and the sample z
    of eq. (8) (the same tensor as x outside training), the call's keyword arguments (rotary (cos, sin)), and for a
    cross-attention the encoder states with their clustering input and sample (the authors perturb the keys)."""

    x: Tensor
    cluster_input: Tensor
    z: Tensor
    call_kwargs: dict
    keys: Optional[Tensor] = None
    key_cluster_input: Optional[Tensor] = None
    key_sample: Optional[Tensor] = None


@dataclasses.dataclass(frozen=True)
class AttentionFamily:
    """How SDMA reads one family of transformers self-attention modules: its query heads and key/value heads (fewer
    under grouped-query attention), the width of its input, and the query projection of a difference of inputs (the
    authors reading's queries are projections of z while k and v stay those of x), with the family's rotary position
    embedding where it has one."""

    name: str
    heads: Callable[[nn.Module], int]
    head_dim: Callable[[nn.Module], int]
    project_query: Callable[[nn.Module, Tensor], Tensor]  # W_q d (no bias), [..., E] -> [..., H * d_k]
    # encoder_self, decoder_self or decoder_cross, from the module and its name in the model
    role: Callable[[nn.Module, str], str]
    project_key: Optional[Callable[[nn.Module, Tensor], Tensor]] = None  # W_k d (no bias), cross-attentions
    key_value_heads: Optional[Callable[[nn.Module], int]] = None  # None: as many as query heads
    input_dim: Optional[Callable[[nn.Module], int]] = None  # None: heads * head_dim
    # the module's rotary embedding of [B, H, T, d_k] queries, given the keyword arguments of its call
    rotate_query: Optional[Callable[[nn.Module, Tensor, dict], Tensor]] = None


def _causal_if(flag: str) -> Callable[[nn.Module, str], str]:
    return lambda module, name: DECODER_SELF if bool(getattr(module, flag, False)) else ENCODER_SELF


def _encoder_decoder_role(cross_name: str, decoder_flag: str) -> Callable[[nn.Module, str], str]:
    """An encoder-decoder family's role by the module's name (its cross-attentions are the decoder layers'
    ``cross_name``) and its decoder flag."""

    def role(module: nn.Module, name: str) -> str:
        if name.split(".")[-1] == cross_name:
            return DECODER_CROSS
        return DECODER_SELF if bool(getattr(module, decoder_flag)) else ENCODER_SELF

    return role


def _is_bert_self_attention(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("SelfAttention") and hasattr(module, "num_attention_heads")
            and all(isinstance(getattr(module, name, None), nn.Linear) for name in ("query", "key", "value")))


def _is_gpt2_self_attention(module: nn.Module) -> bool:
    return (type(module).__name__ == "GPT2Attention" and not module.is_cross_attention
            and hasattr(module, "c_attn"))


# Llama-family decoders whose queries and keys are rotary embeddings of plain projections (no norm between the
# projection and the rotation, which the authors reading's W_q (z - x) + W_q x = W_q z needs)
LLAMA_FAMILY = ("LlamaAttention", "MistralAttention", "Qwen2Attention")


def _is_llama_attention(module: nn.Module) -> bool:
    return (type(module).__name__ in LLAMA_FAMILY and hasattr(module, "config")
            and all(isinstance(getattr(module, name, None), nn.Linear) for name in ("q_proj", "k_proj", "v_proj")))


def _rotate_llama_query(module: nn.Module, query: Tensor, call_kwargs: dict) -> Tensor:
    """The module's own ``apply_rotary_pos_emb`` (its modeling file's) of ``query`` ``[B, H, T, d_k]``, with the
    ``position_embeddings`` (cos, sin) its layer passed it."""
    cos, sin = call_kwargs["position_embeddings"]
    apply_rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb
    return apply_rotary(query, query, cos, sin)[0]


# encoder-decoders of fairseq's transformer shape: encoder self-attention, decoder self-attention and the decoder's
# cross-attention (``encoder_attn``) are one class with q_proj/k_proj/v_proj
BART_FAMILY = ("BartAttention", "MarianAttention", "MBartAttention")


def _is_bart_attention(module: nn.Module) -> bool:
    return (type(module).__name__ in BART_FAMILY
            and all(isinstance(getattr(module, name, None), nn.Linear) for name in ("q_proj", "k_proj", "v_proj")))


def _is_t5_attention(module: nn.Module) -> bool:
    return type(module).__name__ == "T5Attention" and all(
        isinstance(getattr(module, name, None), nn.Linear) for name in ("q", "k", "v"))


FAMILIES = (
    (_is_bert_self_attention, AttentionFamily(
        "BERT", heads=lambda m: m.num_attention_heads, head_dim=lambda m: m.attention_head_size,
        project_query=lambda m, d: F.linear(d, m.query.weight), role=_causal_if("is_causal"))),
    (_is_gpt2_self_attention, AttentionFamily(
        "GPT-2", heads=lambda m: m.num_heads, head_dim=lambda m: m.head_dim,
        project_query=lambda m, d: d @ m.c_attn.weight[:, :m.embed_dim], role=lambda m, name: DECODER_SELF)),
    (_is_llama_attention, AttentionFamily(
        "Llama", heads=lambda m: m.config.num_attention_heads, head_dim=lambda m: m.head_dim,
        project_query=lambda m, d: F.linear(d, m.q_proj.weight), role=lambda m, name: DECODER_SELF,
        key_value_heads=lambda m: m.config.num_key_value_heads, input_dim=lambda m: m.config.hidden_size,
        rotate_query=_rotate_llama_query)),
    (_is_bart_attention, AttentionFamily(
        "BART", heads=lambda m: m.num_heads, head_dim=lambda m: m.head_dim,
        project_query=lambda m, d: F.linear(d, m.q_proj.weight), role=_encoder_decoder_role("encoder_attn", "is_causal"),
        project_key=lambda m, d: F.linear(d, m.k_proj.weight), input_dim=lambda m: m.embed_dim)),
    # T5's relative position bias reaches the attention function as position_bias: the core's score_bias
    (_is_t5_attention, AttentionFamily(
        "T5", heads=lambda m: m.n_heads, head_dim=lambda m: m.key_value_proj_dim,
        project_query=lambda m, d: F.linear(d, m.q.weight), role=_encoder_decoder_role("EncDecAttention", "is_decoder"),
        project_key=lambda m, d: F.linear(d, m.k.weight), input_dim=lambda m: m.d_model)),
)


def attention_modules(model: nn.Module) -> List[Tuple[str, nn.Module, AttentionFamily]]:
    """The attention modules SDMA is attached to, with their names and family, in model order: BERT-family
    ``*SelfAttention`` modules (``query``/``key``/``value`` projections), GPT-2's ``GPT2Attention`` (self-attention,
    fused ``c_attn``), the Llama family's ``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention``, and the
    encoder-decoders' ``BartAttention``, ``MarianAttention``, ``MBartAttention`` and ``T5Attention`` (encoder
    self-attention, decoder self-attention, cross-attention)."""
    found = []
    for name, module in model.named_modules():
        family = next((family for matches, family in FAMILIES if matches(module)), None)
        if family is not None:
            found.append((name, module, family))
    if not found:
        raise SDMAConfigError(
            f"attach_sdma: {type(model).__name__} has no attention module SDMA knows: BERT-family *SelfAttention "
            "modules (query/key/value projections: BERT, RoBERTa, MiniLM, ...), GPT-2's GPT2Attention, the Llama "
            f"family's {', '.join(LLAMA_FAMILY)}, or the encoder-decoders' {', '.join(BART_FAMILY)}, T5Attention")
    return found


def attach_sdma(model: nn.Module, decoder_mask_at_inference: bool = False, **options) -> nn.Module:
    """Give every attention module of ``model`` an SDMA core with ``options`` (the fields of
    :class:`latent_core.sdma.SDMAOptions`, named as there: ``mode``, ``reading``, ``clusters``, ...), register the
    attention function and switch the model's attention implementation to it. Pretrained weights are kept; only the
    cores' parameters (GMM means and variances, the mixing weight g) are new. Returns ``model``.

    A causal (decoder) self-attention applies its mask at inference only with ``decoder_mask_at_inference``, as the
    fairseq adapter's ``--sdma-decoder-mask-at-inference`` (the paper drops it there); then it needs the keys'
    cluster probabilities of every position, and generates without a KV cache (``use_cache=False``). Encoder
    self-attention and cross-attention keep it at inference (``mask_at_inference``), as in the fairseq adapter."""
    known = {f.name for f in dataclasses.fields(SDMAOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise SDMAConfigError(f"attach_sdma: unknown option(s) {', '.join(unknown)}; the options are the fields of "
                              f"latent_core.sdma.SDMAOptions: {', '.join(sorted(known))}")
    sdma = SDMAOptions(**options)
    sdma.validate()
    if not isinstance(decoder_mask_at_inference, bool):
        raise SDMAConfigError(f"attach_sdma: decoder_mask_at_inference={decoder_mask_at_inference!r} must be "
                              "True or False")
    decoder = dataclasses.replace(sdma, mask_at_inference=decoder_mask_at_inference)
    modules = attention_modules(model)
    for name, module, family in modules:
        if hasattr(module, "sdma"):
            raise SDMAConfigError(f"attach_sdma: {type(module).__name__} already has an SDMA core (attached twice)")
        role = family.role(module, name)
        heads = family.heads(module)
        width = heads * family.head_dim(module)
        if family.input_dim is not None and family.input_dim(module) != width:
            raise SDMAConfigError(
                f"attach_sdma: {type(module).__name__} has {heads} heads of {family.head_dim(module)} over an input of "
                f"{family.input_dim(module)}: SDMA clusters the input in one slice per head, which needs a model width "
                "equal to heads * head dimension (hidden_size = num_attention_heads * head_dim: leave head_dim unset; "
                "T5: d_model = num_heads * d_kv)")
        core = SDMACore(width, heads, decoder if role == DECODER_SELF else sdma)
        core.sdma_group = role
        module.sdma = core
        module.register_forward_pre_hook(_draw_sample, with_kwargs=True)
        _FAMILY[module] = family
    # a cross-attention's queries are its decoder layer's: the decoder self-attention whose name shares the longest
    # prefix with its own (BART: layers.3.self_attn for layers.3.encoder_attn; T5: block.3.layer.0.SelfAttention for
    # block.3.layer.1.EncDecAttention)
    decoder_selves = [(name, module) for name, module, _ in modules if module.sdma.sdma_group == DECODER_SELF]
    for name, module, _ in modules:
        if module.sdma.sdma_group == DECODER_CROSS and decoder_selves:
            _PARTNER[module] = max(decoder_selves, key=lambda item: len(os.path.commonprefix([item[0], name])))[1]
    AttentionInterface.register(SDMA_ATTENTION, sdma_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SDMA_ATTENTION, sdpa_mask)
    model.set_attn_implementation(SDMA_ATTENTION)
    model.config.sdma = {**dataclasses.asdict(sdma), "decoder_mask_at_inference": decoder_mask_at_inference}
    model.register_forward_pre_hook(_open_recording)
    model.register_forward_hook(_close_recording, always_call=True)
    return model


def set_sdma_updates(model: nn.Module, num_updates: int) -> None:
    """The mixing weight g of eq. (11) after ``num_updates`` optimizer updates (call it after each step)."""
    for module in model.modules():
        if isinstance(module, SDMACore):
            module.set_num_updates(num_updates)


def sdma_loss(model: nn.Module, weights: Optional[Dict[str, float]] = None, regulariser_scale: Optional[str] = None,
              num_tokens: Optional[float] = None) -> Tensor:
    """The regularisers of eq. (24) (lambda_k KL + lambda_q L_Dqq - lambda_x L_Dxq + lambda_d DV) of the model's
    latest forward: a 0-dim tensor to add to the task loss. ``weights``: the lambdas by the field names of
    :class:`latent_core.sdma.SDMALossWeights` (``kl_weight``, ``dqq_weight``, ``dxq_weight``, ``diversity_weight``;
    default Table I's).

    Without ``regulariser_scale``: the mean over the batch's sequences. With it, next to a task loss that is a MEAN
    over ``num_tokens`` items (the target tokens of a token-mean cross-entropy): fairseq's
    ``--sdma-regulariser-scale`` divided by ``num_tokens``, so both toolkits weigh the terms alike. ``sentence``
    (the authors' criterion: each sequence's regularisers added to the token-SUMMED cross-entropy) is their sum over
    the sequences / ``num_tokens``; ``token`` the sequence mean (eq. 24 read with a per-token L_CE; ~tokens per
    sequence times stronger); ``batch`` the sequence mean / ``num_tokens``."""
    records = _RECORDS.get(model)
    if records is None:
        raise SDMAConfigError("sdma_loss: no forward of this model with SDMA has run yet (call attach_sdma, then the "
                              "model, then sdma_loss)")
    defaults = {f"sdma_{name}": value for name, value in dataclasses.asdict(SDMALossWeights()).items()}
    given = {f"sdma_{name}": value for name, value in (weights or {}).items()}
    unknown = sorted(name[5:] for name in set(given) - set(defaults))
    if unknown:
        raise SDMAConfigError(f"sdma_loss: unknown weight(s) {', '.join(unknown)}; the weights are "
                              f"{', '.join(name[5:] for name in defaults)}")
    if regulariser_scale is not None and (num_tokens is None or not num_tokens > 0):
        raise SDMAConfigError(f"sdma_loss: regulariser_scale={regulariser_scale!r} needs num_tokens > 0 (the items "
                              f"the task loss averages over), got {num_tokens!r}")
    weights = {**defaults, **given}
    terms = collect_sdma_losses(model, records)
    check_finite(terms, HF_ADVICE)
    per_sequence = weighted_regulariser(terms, weights)
    if regulariser_scale is None:
        return per_sequence.mean()
    return scale_regulariser(per_sequence, regulariser_scale, num_tokens) / float(num_tokens)


def sdma_records(model: nn.Module) -> Dict[str, object]:
    """The clustering each SDMA attention recorded in the model's latest forward (the inputs of its regularisers):
    ``{module name: latent_core.sdma.ClusteringRecord}``, with p(c|z) of eq. (9) as ``log_resp_z`` ``[T, B, n_h, C]``
    and the real query positions as ``valid`` ``[T, B]``. Empty where no attention applied its mask."""
    records = _RECORDS.get(model)
    if records is None:
        raise SDMAConfigError("sdma_records: no forward of this model with SDMA has run yet")
    return {name: records.get(module.sdma) for name, module in model.named_modules()
            if isinstance(getattr(module, "sdma", None), SDMACore) and records.get(module.sdma) is not None}


def _open_recording(model, _args):
    stack = contextlib.ExitStack()
    _RECORDS[model] = stack.enter_context(recording())
    _SCOPES[model] = stack


def _close_recording(model, _args, _output):
    stack = _SCOPES.pop(model, None)
    if stack is not None:
        stack.close()


def _draw_sample(module, args, kwargs):
    """Forward pre-hook: z = x + sigma eps (eq. 8) in training, kept for the clustering of the same call; in the paper
    reading handed to the module's projections. A cross-attention's keys (the encoder states) are perturbed too in
    the authors reading, whose code projects the keys of the noisy states and the values of the clean ones."""
    core = module.sdma
    if not core.active(module.training):
        return None
    hidden = args[0] if args else kwargs["hidden_states"]
    cluster_input, sample = core.sample(hidden, module.training)
    drawn = _Drawn(hidden, cluster_input, sample, kwargs)
    if core.sdma_group == DECODER_CROSS:
        keys = kwargs.get("key_value_states")
        if keys is None:
            raise SDMAConfigError(f"SDMA cross-attention of {type(module).__name__}: called without "
                                  "key_value_states (the encoder states its keys' clustering needs)")
        drawn.keys = keys
        drawn.key_cluster_input, drawn.key_sample = core.sample(keys, module.training) if core.options.authors \
            else (keys, keys)
    _SAMPLES[module] = drawn
    if sample is hidden or core.options.authors:
        return None
    if args:
        return (sample, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": sample}


def sdma_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Optional[Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                           **kwargs) -> Tuple[Tensor, Optional[Tensor]]:
    """The registered attention function: ``query`` ``[B, H, T, d_k]``, ``key``/``value`` ``[B, H_kv, S, d_k]``
    (projections of z; H_kv divides H), ``attention_mask`` bool ``[B, 1, T, S]`` (True = may attend) or None, T5's
    ``position_bias`` ``[B or 1, H, T, S]`` (added to the scores: the core's ``score_bias``). Returns (``[B, T, H,
    d_k]``, A_hat ``[B, H, T, S]`` when ``output_attentions`` asks for it, else None), as transformers' own functions
    do. A module without an active core (mode ``none``; a module SDMA was not attached to; a decoder at inference)
    runs transformers' sdpa."""
    core = getattr(module, "sdma", None)
    drawn = _SAMPLES.pop(module, None)
    if core is None or drawn is None or not core.active(module.training):
        if kwargs.get("output_attentions"):  # transformers' sdpa returns no weights
            return _softmax_attention(module, query, key, value, attention_mask, scaling, dropout,
                                      kwargs.get("position_bias"))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    role = core.sdma_group
    B, H, T, D = query.shape
    S = key.size(2)
    if S != T and role != DECODER_CROSS:
        raise SDMAConfigError(
            f"SDMA attention of {type(module).__name__}: {T} queries over {S} keys (a KV cache): applying the mask at "
            "inference needs every key's cluster probabilities; generate with use_cache=False, or leave the decoder's "
            "mask off at inference (attach_sdma(..., decoder_mask_at_inference=False), the default)")
    authors = core.options.authors
    family = _FAMILY[module]
    x, z = drawn.x, drawn.z
    if authors and z is not x:  # their queries are projections of z, their keys and values of x
        shift = family.project_query(module, z - x).view(B, T, H, D).transpose(1, 2)
        # a rotary embedding is linear: rot(W_q x + b) + rot(W_q (z - x)) = rot(W_q z + b)
        query = query + (shift if family.rotate_query is None else family.rotate_query(module, shift, drawn.call_kwargs))
    if role == DECODER_CROSS and drawn.key_sample is not drawn.keys:  # the authors' keys: W_k of the noisy states
        key = key + family.project_key(module, drawn.key_sample - drawn.keys).view(B, S, -1, D).transpose(1, 2)
    key, value = _repeat_key_value_heads(key, value, H)
    q = query * (D ** -0.5 if scaling is None else scaling)
    log_joint_k = log_resp_k = None
    if role == DECODER_CROSS:  # eq. (9) of the decoder's queries and the encoder's keys, one density evaluation
        (log_joint_z, log_resp_z), (log_joint_k, log_resp_k) = core.cluster_jointly(
            [drawn.cluster_input, drawn.key_cluster_input], scale=core.clustering_scale)  # [B, T|S, H, C]
        if log_resp_k.size(1) != S:
            raise SDMAConfigError(f"SDMA cross-attention of {type(module).__name__}: {S} keys but "
                                  f"{log_resp_k.size(1)} encoder states in key_value_states")
        resp = log_resp_z.exp().transpose(1, 2)  # [B, H, T, C]
        key_resp = log_resp_k.exp().transpose(1, 2)  # [B, H, S, C]
    else:
        log_joint_z, log_resp_z = core.cluster(drawn.cluster_input, scale=core.clustering_scale)  # [B, T, H, C]
        resp = key_resp = log_resp_z.exp().transpose(1, 2)
    # the scaled queries: the paper's carry the sample through W_q; the authors' get a second draw
    q_cluster, q = (t.view(B, T, H, D).transpose(1, 2)
                    for t in core.sample_queries(q.transpose(1, 2).reshape(B, T, H * D), module.training))
    blocked = _blocked_keys(role, attention_mask, authors, T, S, q.device, kwargs.get("sliding_window"))
    attention_dropout = (lambda a: F.dropout(a, dropout, training=True)) if dropout > 0 else (lambda a: a)
    out, weights = sdma_attention(  # eq. (1), (2), (10), (11)
        q, key, value, resp, key_resp, core.mix_weight, authors=authors, blocked=blocked,
        kernel=core.options.attention_kernel, need_weights=bool(kwargs.get("output_attentions")),
        dropout=attention_dropout, dropout_p=dropout, score_bias=kwargs.get("position_bias"))
    if role == DECODER_SELF and module.training:
        _REAL_QUERIES[module] = _real_queries(attention_mask, B, T, q.device)
    if core.computes_regularisers():
        log_joint_q = log_resp_q = None
        if core.query_gmm is not None:  # eq. (16)-(19), on the scaled queries
            log_joint_q, log_resp_q = (t.transpose(0, 1) for t in core.cluster_queries(q_cluster.transpose(1, 2),
                                                                                       core.clustering_scale))
        if role == DECODER_CROSS:  # the decoder's real positions, which the encoder's mask does not say
            valid = _REAL_QUERIES.get(_PARTNER.get(module))
            if valid is None or valid.shape != (B, T):
                valid = torch.ones(B, T, device=q.device)
        else:
            valid = _real_queries(attention_mask, B, T, q.device)
        if log_joint_k is not None:
            log_joint_k, log_resp_k = log_joint_k.transpose(0, 1), log_resp_k.transpose(0, 1)
            if not authors:  # the paper regularises the keys through their p(c|.) only
                log_joint_k = None
        core.record(log_joint_z.transpose(0, 1), log_resp_z.transpose(0, 1), valid.t(), log_joint_q, log_resp_q,
                    log_joint_k, log_resp_k)
    return out.transpose(1, 2).contiguous(), weights


def _repeat_key_value_heads(key: Tensor, value: Tensor, heads: int) -> Tuple[Tensor, Tensor]:
    """Grouped-query attention: ``[B, H_kv, S, d_k]`` key/value heads repeated to the ``heads`` query heads, each
    query head its group's (transformers' ``repeat_kv``); unchanged when there are as many."""
    if key.size(1) == heads:
        return key, value
    B, kv_heads, S, D = key.shape
    return tuple(t[:, :, None].expand(B, kv_heads, heads // kv_heads, S, D).reshape(B, heads, S, D)
                 for t in (key, value))


def _blocked_keys(role: str, attention_mask: Optional[Tensor], authors: bool, T: int, S: int, device,
                  sliding_window: Optional[int]) -> Optional[Tensor]:
    """The keys each query may not attend to, bool ``[B or 1, 1, T, S]`` (True = blocked), or None. The mask
    transformers built, except where it left it out for sdpa's ``is_causal`` flag (a causal attention without
    padding gets None) and in the authors reading of a causal attention, whose code masks the future only (and
    the keys beyond a sliding window, which their models did not have)."""
    causal = role == DECODER_SELF
    if attention_mask is not None and not (authors and causal):
        return ~attention_mask.to(torch.bool)
    if not causal:
        return None
    query_positions = torch.arange(S - T, S, device=device)[:, None]
    key_positions = torch.arange(S, device=device)[None, :]
    blocked = key_positions > query_positions
    if sliding_window:  # transformers' sliding_window_overlay: a query sees the keys with s > t - window
        blocked = blocked | (key_positions <= query_positions - sliding_window)
    return blocked[None, None]


def _softmax_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                       scaling: Optional[float], dropout: float,
                       position_bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Plain softmax attention (eq. 1) with its weights, for an attention without SDMA in this pass asked for
    ``output_attentions``: the boolean mask as transformers' eager functions apply an additive one, T5's position
    bias added, shared key/value heads repeated, the causal mask built where transformers left it to sdpa."""
    B, H, T, D = query.shape
    S = key.size(2)
    key, value = _repeat_key_value_heads(key, value, H)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * (D ** -0.5 if scaling is None else scaling)
    if position_bias is not None:
        scores = scores + position_bias
    core = getattr(module, "sdma", None)
    role = core.sdma_group if core is not None else (DECODER_SELF if getattr(module, "is_causal", False)
                                                     else ENCODER_SELF)
    blocked = _blocked_keys(role, attention_mask, False, T, S, query.device, None)
    if blocked is not None:
        scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(F.dropout(weights, dropout, training=module.training), value)
    return out.transpose(1, 2).contiguous(), weights


def _real_queries(attention_mask: Optional[Tensor], batch: int, length: int, device) -> Tensor:
    """``[B, T]`` float, 1 at real query positions: a real query may attend to itself (the diagonal of a
    ``[B, 1, T, T]`` mask; a ``[B, 1, 1, T]`` padding mask is that row)."""
    if attention_mask is None:
        return torch.ones(batch, length, device=device)
    mask = attention_mask[:, 0].to(torch.bool)
    if mask.size(-2) == 1:
        return mask[:, 0, :].expand(batch, length).float()
    return mask.diagonal(dim1=-2, dim2=-1).expand(batch, length).float()


def from_pretrained_with_sdma(model_class, path, **kwargs) -> nn.Module:
    """Reload a model that ``save_pretrained`` wrote after :func:`attach_sdma`: ``model_class.from_pretrained(path,
    **kwargs)`` loads the pretrained weights, SDMA is attached again with the options the config records
    (``config.sdma``) and the cores' parameters are read from the same weight files (safetensors, or a
    ``pytorch_model*.bin`` through torch's safe loader)."""
    directory = Path(path)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its report would list the cores' weights as unexpected keys
    try:
        model = model_class.from_pretrained(path, **kwargs)
    finally:
        transformers_logging.set_verbosity(verbosity)
    options = dict(getattr(model.config, "sdma", None) or {})
    if not options:
        raise SDMAConfigError(f"{path}: its config has no 'sdma' entry (not saved after attach_sdma); "
                              "load it with from_pretrained and call attach_sdma")
    decoder = options.pop("decoder_mask_at_inference", False)
    attach_sdma(model, decoder_mask_at_inference=decoder, **options)
    saved = {}
    for file in sorted(directory.glob("*.safetensors")):  # only the cores' tensors: from_pretrained read the rest
        with safe_open(str(file), framework="pt") as weights:
            saved.update({k: weights.get_tensor(k) for k in weights.keys() if ".sdma." in f".{k}"})
    for file in sorted(directory.glob("pytorch_model*.bin")):
        saved.update({k: v for k, v in torch.load(file, map_location="cpu", weights_only=True).items()
                      if ".sdma." in f".{k}"})
    loaded = {}
    for name in (name for name in model.state_dict() if ".sdma." in f".{name}"):
        # save_pretrained of a head model keeps the base model's prefix ("transformer.", "bert."), a base model none
        match = name if name in saved else next((key for key in saved if key.endswith("." + name)
                                                 or name.endswith("." + key)), None)
        if match is None:
            raise SDMAConfigError(f"{path}: the weights have no {name} (the SDMA parameters were not saved)")
        loaded[name] = saved[match]
    model.load_state_dict(loaded, strict=False)
    return model
