"""The forward path of SDMA in transformers: the attention function registered with ``AttentionInterface`` under
the name ``"sdma"`` (:func:`sdma_attention_forward`), the pre-hook that draws the sample of eq. (8), and the state
each attention module with SDMA carries (:class:`SDMAAttentionState`).

How a forward runs: the attention module's pre-hook (:func:`draw_sample`) draws z = x + sigma eps of eq. (8) in
training. In the ``paper`` reading it hands z to the module, whose own projections then give q, k and v of z; in the
``authors`` reading (their fairseq ``DisentangledAttention``) k and v stay projections of the clean x and the queries
are W_q z + b, with a second draw on the scaled queries. transformers then calls the registered function with the
module, q, k, v and the mask (the boolean form of its ``sdpa`` implementation, True = may attend); the function runs
four named steps, as ``eager_attention_forward`` does its own: shift the queries to the sample, cluster (eq. 9),
attend (eq. 1, 2, 10, 11: the core's one entry point :func:`latent_core.sdma.sdma_attention`) and record the
clustering for the regularisers of eq. (20)-(23), which :func:`transformers_plugin.sdma_loss` returns.

Grouped-query attention: the responsibilities p(c|z) of eq. (9) belong to the query heads, as the feature GMM
clusters the input x in one slice of d_k = E / n_h per query head; a key/value head shared by a group of query heads
is repeated to each of them (transformers' ``repeat_kv``), and each query head masks it with its own
responsibilities: M_ts = sum_c p(c|z_t) p(c|z_s) of that query head's slice (eq. 10).
"""

import dataclasses
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import repeat_kv

from latent_core.sdma import SDMAConfigError, SDMARecording, active_recording, sdma_attention, tie_to_output

from transformers_plugin.families import DECODER_CROSS, DECODER_SELF, ENCODER_SELF, AttentionFamily

SDMA_ATTENTION = "sdma"


@dataclasses.dataclass
class Drawn:
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


@dataclasses.dataclass(eq=False)
class ForwardRecords:
    """The clustering of every SDMA attention in the model's latest forward (the regularisers' inputs): one object per
    model, shared by its attention modules; the model's forward pre-hook starts a new :class:`SDMARecording`."""

    recording: Optional[SDMARecording] = None


@dataclasses.dataclass(eq=False)
class KeyCache:
    """A causal self-attention's mask at inference with transformers' KV cache: the responsibilities p(c|z) of the
    cached keys' inputs ``resp`` ``[B, H, S, C]``, with the keys they belong to ``keys`` ``[B, H_kv, S, d_k]``; beam
    search reorders the cache's rows between steps, and the rows of ``resp`` follow by matching ``keys``."""

    keys: Tensor
    resp: Tensor


@dataclasses.dataclass(eq=False)
class SDMAAttentionState:
    """What one attention module with SDMA carries (``module.sdma_state``; its parameters are ``module.sdma``): its
    family and role, the model's :class:`ForwardRecords`, for a cross-attention the same layer's decoder
    self-attention (whose real query positions it averages over), and per call: the draw of the pre-hook, the real
    query positions of its latest training call, the keys' responsibilities cached for generation."""

    family: AttentionFamily
    role: str
    records: ForwardRecords
    partner: Optional[nn.Module] = None
    drawn: Optional[Drawn] = None
    real_queries: Optional[Tensor] = None
    key_cache: Optional[KeyCache] = None


def draw_sample(module, args, kwargs):
    """Forward pre-hook: z = x + sigma eps (eq. 8) in training, kept for the clustering of the same call; in the paper
    reading handed to the module's projections. A cross-attention's keys (the encoder states) are perturbed too in
    the authors reading, whose code projects the keys of the noisy states and the values of the clean ones."""
    core, state = module.sdma, module.sdma_state
    state.drawn = None
    if not core.active(module.training):
        return None
    hidden = args[0] if args else kwargs["hidden_states"]
    cluster_input, sample = core.sample(hidden, module.training)
    drawn = Drawn(hidden, cluster_input, sample, kwargs)
    if state.role == DECODER_CROSS:
        keys = kwargs.get("key_value_states")
        if keys is None:
            raise SDMAConfigError(f"SDMA cross-attention of {type(module).__name__}: called without "
                                  "key_value_states (the encoder states its keys' clustering needs)")
        drawn.keys = keys
        drawn.key_cluster_input, drawn.key_sample = core.sample(keys, module.training) if core.options.authors \
            else (keys, keys)
    state.drawn = drawn
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
    do. A module without an active core (mode ``none``; a decoder at inference) runs transformers' sdpa."""
    core, state = getattr(module, "sdma", None), getattr(module, "sdma_state", None)
    drawn = state.drawn if state is not None else None
    if state is not None:
        state.drawn = None
    if core is None:
        _refuse_saved_without_cores(module)
    if drawn is None:
        if kwargs.get("output_attentions"):  # transformers' sdpa returns no weights
            return _softmax_attention(module, query, key, value, attention_mask, scaling, dropout,
                                      kwargs.get("position_bias"))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    B, H, T, D = query.shape
    query, key = _shift_to_sample(module, state, drawn, query, key)
    clustering = _cluster(module, drawn, key)
    key, value = repeat_kv(key, H // key.size(1)), repeat_kv(value, H // value.size(1))
    # the scaled queries: the paper's carry the sample through W_q; the authors' get a second draw
    q = query * (D ** -0.5 if scaling is None else scaling)
    q_cluster, q = (t.view(B, T, H, D).transpose(1, 2)
                    for t in core.sample_queries(q.transpose(1, 2).reshape(B, T, H * D), module.training))
    blocked = blocked_keys(state.role, attention_mask, core.options.authors, T, key.size(2), q.device,
                           kwargs.get("sliding_window"))
    attention_dropout = (lambda a: F.dropout(a, dropout, training=True)) if dropout > 0 else (lambda a: a)
    out, weights = sdma_attention(  # eq. (1), (2), (10), (11)
        q, key, value, clustering.resp, clustering.key_resp, core.mix_weight, authors=core.options.authors,
        blocked=blocked, kernel=core.options.attention_kernel, need_weights=bool(kwargs.get("output_attentions")),
        dropout=attention_dropout, dropout_p=dropout, score_bias=kwargs.get("position_bias"))
    out = _record(module, clustering, q_cluster, attention_mask, out)
    return out.transpose(1, 2).contiguous(), weights


@dataclasses.dataclass
class _Clustering:
    """Eq. (9) of one call: log p(z, c) and log p(c|z) of the queries' inputs ``[B, T, H, C]`` (and of a
    cross-attention's keys, ``[B, S, H, C]``), and the responsibilities the mask takes, ``[B, H, T|S, C]``."""

    log_joint_z: Tensor
    log_resp_z: Tensor
    resp: Tensor
    key_resp: Tensor
    log_joint_k: Optional[Tensor] = None
    log_resp_k: Optional[Tensor] = None


def _shift_to_sample(module, state: SDMAAttentionState, drawn: Drawn, query: Tensor,
                     key: Tensor) -> Tuple[Tensor, Tensor]:
    """The authors reading's queries W_q z + b (their keys and values stay projections of x) and, in a
    cross-attention, their keys W_k of the noisy encoder states; unchanged in the paper reading, where the module
    projected z itself."""
    family = state.family
    B, H, T, D = query.shape
    if module.sdma.options.authors and drawn.z is not drawn.x:
        shift = family.project_query(module, drawn.z - drawn.x).view(B, T, H, D).transpose(1, 2)
        # a rotary embedding is linear: rot(W_q x + b) + rot(W_q (z - x)) = rot(W_q z + b)
        query = query + (shift if family.rotate_query is None else family.rotate_query(module, shift, drawn.call_kwargs))
    if state.role == DECODER_CROSS and drawn.key_sample is not drawn.keys:
        S = key.size(2)
        key = key + family.project_key(module, drawn.key_sample - drawn.keys).view(B, S, -1, D).transpose(1, 2)
    return query, key


def _cluster(module, drawn: Drawn, key: Tensor) -> _Clustering:
    """Eq. (9): the responsibilities of the queries' inputs and of the keys' (the same positions in a
    self-attention, the cached ones prepended at inference with a KV cache; a cross-attention's encoder states, one
    density evaluation with the queries'). ``key`` ``[B, H_kv, S, d_k]``, before the heads are repeated."""
    core, state, S = module.sdma, module.sdma_state, key.size(2)
    if state.role == DECODER_CROSS:
        (log_joint_z, log_resp_z), (log_joint_k, log_resp_k) = core.cluster_jointly(
            [drawn.cluster_input, drawn.key_cluster_input], scale=core.clustering_scale)  # [B, T|S, H, C]
        if log_resp_k.size(1) != S:
            raise SDMAConfigError(f"SDMA cross-attention of {type(module).__name__}: {S} keys but "
                                  f"{log_resp_k.size(1)} encoder states in key_value_states")
        return _Clustering(log_joint_z, log_resp_z, log_resp_z.exp().transpose(1, 2),
                           log_resp_k.exp().transpose(1, 2), log_joint_k, log_resp_k)
    log_joint_z, log_resp_z = core.cluster(drawn.cluster_input, scale=core.clustering_scale)  # [B, T, H, C]
    resp = log_resp_z.exp().transpose(1, 2)
    return _Clustering(log_joint_z, log_resp_z, resp, _key_responsibilities(state, resp, key, module.training))


def _key_responsibilities(state: SDMAAttentionState, resp: Tensor, key: Tensor, training: bool) -> Tensor:
    """A self-attention's keys' responsibilities ``[B, H, S, C]``: its queries' ``resp`` ``[B, H, T, C]`` when they
    are the same positions; at inference, the cached keys' responsibilities before them (transformers' KV cache),
    their rows reordered as beam search reordered the cache."""
    T, S = resp.size(2), key.size(2)
    if training or state.role != DECODER_SELF:
        if S != T:
            raise SDMAConfigError(f"SDMA self-attention: {T} queries over {S} keys in training (a KV cache); "
                                  "train with use_cache=False")
        return resp
    cache = state.key_cache
    if S == T:  # the first step of a generation (or a call without a cache)
        state.key_cache = KeyCache(key, resp)
        return resp
    past = key[:, :, :S - T]
    if cache is None or cache.keys.shape != past.shape:
        raise SDMAConfigError(
            f"SDMA decoder self-attention: {S - T} cached keys whose responsibilities this module did not see (a "
            "cache filled without SDMA, or another module's); start the generation with SDMA attached")
    if torch.equal(cache.keys, past):
        cached = cache.resp
    else:  # beam search reordered the cache's rows: find each row's origin
        same = (past[:, None] == cache.keys[None]).flatten(2).all(-1)  # [B_now, B_cached]
        if not bool(same.any(-1).all()):
            raise SDMAConfigError("SDMA decoder self-attention: the KV cache's keys match none of the keys whose "
                                  "responsibilities were cached (the cache was edited outside generate())")
        cached = cache.resp[same.float().argmax(-1)]
    key_resp = torch.cat([cached, resp], dim=2)
    state.key_cache = KeyCache(key, key_resp)
    return key_resp


def _record(module, clustering: _Clustering, q_cluster: Tensor, attention_mask: Optional[Tensor],
            out: Tensor) -> Tensor:
    """Keep the clustering of this call for the regularisers of eq. (20)-(23) (the queries' GMM of eq. 16-19 on the
    scaled queries) in the model's records; returns ``out`` tied to them (:func:`latent_core.sdma.tie_to_output`,
    for distributed training)."""
    core, state = module.sdma, module.sdma_state
    B, H, T, _ = q_cluster.shape
    if state.role == DECODER_CROSS:  # the decoder's real positions, which the encoder's mask does not say
        valid = state.partner.sdma_state.real_queries if state.partner is not None else None
        if valid is None or valid.shape != (B, T):
            valid = torch.ones(B, T, device=out.device)
    else:
        valid = real_queries(attention_mask, B, T, out.device)
        if state.role == DECODER_SELF and module.training:
            state.real_queries = valid
    # an open latent_core.sdma.recording() scope, else the records of the model's forward
    recording = active_recording()
    if recording is None:
        recording = state.records.recording
    if recording is None:  # neither: a submodule called alone
        return out
    log_joint_q = log_resp_q = None
    if core.query_gmm is not None:  # eq. (16)-(19), on the scaled queries
        log_joint_q, log_resp_q = (t.transpose(0, 1) for t in core.cluster_queries(q_cluster.transpose(1, 2),
                                                                                   core.clustering_scale))
    log_joint_k = log_resp_k = None
    if clustering.log_joint_k is not None:
        log_joint_k, log_resp_k = clustering.log_joint_k.transpose(0, 1), clustering.log_resp_k.transpose(0, 1)
        if not core.options.authors:  # the paper regularises the keys through their p(c|.) only
            log_joint_k = None
    core.record(clustering.log_joint_z.transpose(0, 1), clustering.log_resp_z.transpose(0, 1), valid.t(),
                log_joint_q, log_resp_q, log_joint_k, log_resp_k, into=recording)
    return tie_to_output(out, log_joint_q, log_resp_q)


def blocked_keys(role: str, attention_mask: Optional[Tensor], authors: bool, T: int, S: int, device,
                 sliding_window: Optional[int]) -> Optional[Tensor]:
    """The keys each query may not attend to, bool ``[B or 1, 1, T, S]`` (True = blocked), or None.

    The mask transformers built, except where it left it out for sdpa's ``is_causal`` flag (a causal attention
    without padding gets None: the future, and the keys beyond a sliding window, are built here), and in the authors
    reading of a causal attention: their code masks the future only. With right padding (fairseq's) that blocks
    every padding key of a real query too, and the padding queries attend the padding keys before them as in their
    code; left padding puts padding keys before real ones, so those are blocked as well: no real position ever
    attends a padding key, in either reading."""
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
    blocked = blocked[None, None]
    if attention_mask is not None:
        blocked = blocked | _padding_before_real_keys(attention_mask.to(torch.bool))
    return blocked


def _padding_before_real_keys(allowed: Tensor) -> Tensor:
    """``[B, 1, 1, S]``: the keys no query may attend (padding, in transformers' mask ``allowed`` ``[B, 1, T, S]``)
    that lie before the row's last real key (left padding; right padding lies after every real key)."""
    real = allowed.any(dim=-2, keepdim=True)  # [B, 1, 1, S]
    positions = torch.arange(real.size(-1), device=real.device)
    last_real = torch.where(real, positions, -1).amax(dim=-1, keepdim=True)
    return ~real & (positions < last_real)


def _softmax_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                       scaling: Optional[float], dropout: float,
                       position_bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Plain softmax attention (eq. 1) with its weights, for an attention without SDMA in this pass asked for
    ``output_attentions``: the boolean mask as transformers' eager functions apply an additive one, T5's position
    bias added, shared key/value heads repeated, the causal mask built where transformers left it to sdpa."""
    B, H, T, D = query.shape
    S = key.size(2)
    key, value = repeat_kv(key, H // key.size(1)), repeat_kv(value, H // value.size(1))
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * (D ** -0.5 if scaling is None else scaling)
    if position_bias is not None:
        scores = scores + position_bias
    state = getattr(module, "sdma_state", None)
    role = state.role if state is not None else (DECODER_SELF if getattr(module, "is_causal", False)
                                                 else ENCODER_SELF)
    blocked = blocked_keys(role, attention_mask, False, T, S, query.device, None)
    if blocked is not None:
        scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(F.dropout(weights, dropout, training=module.training), value)
    return out.transpose(1, 2).contiguous(), weights


def real_queries(attention_mask: Optional[Tensor], batch: int, length: int, device) -> Tensor:
    """``[B, T]`` float, 1 at real query positions of a self-attention: a real query may attend to itself (the
    diagonal of a ``[B, 1, T, S]`` mask, whose queries are the last T of the S keys under a KV cache; a ``[B, 1, 1,
    S]`` padding mask holds that row)."""
    if attention_mask is None:
        return torch.ones(batch, length, device=device)
    mask = attention_mask[:, 0].to(torch.bool)
    keys = mask.size(-1)
    if mask.size(-2) == 1:
        return mask[:, 0, keys - length:].expand(batch, length).float()
    return mask.diagonal(offset=keys - length, dim1=-2, dim2=-1).expand(batch, length).float()


def _refuse_saved_without_cores(module: nn.Module) -> None:
    """An attention module without a core, in a model whose config says it was saved after ``attach_sdma``: loaded
    with plain ``from_pretrained``, it would silently run as the vanilla model."""
    config = getattr(module, "config", None)
    if getattr(config, "sdma", None):
        raise SDMAConfigError(
            f"{type(module).__name__} has no SDMA core, but the model's config has an 'sdma' entry (it was saved "
            "after attach_sdma): load it with transformers_plugin.from_pretrained_with_sdma(ModelClass, path), "
            "which attaches SDMA and reads its parameters")
