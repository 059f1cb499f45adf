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
BERT, RoBERTa, MiniLM, ...) and GPT-2 decoders (``GPT2Attention``, causal). As in the fairseq adapter, a decoder's
mask is off at inference unless asked for, so ``generate()`` runs transformers' own attention with its KV cache.
"""

import contextlib
import dataclasses
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
    sdma_attention,
    weighted_regulariser,
)

SDMA_ATTENTION = "sdma"
HF_ADVICE = ("lower the learning rate or the regulariser weights (sdma_loss(model, weights=...)), or train in float32 "
             "where it ran in half precision")

# (x, input of the clustering, z of eq. 8) of each self-attention call in progress: set by the module's pre-hook,
# read once by the attention function of the same call
_SAMPLES: "weakref.WeakKeyDictionary[nn.Module, Tuple[Tensor, Tensor, Tensor]]" = weakref.WeakKeyDictionary()
# the open recording scope of a model's forward, and the records of its latest forward (for sdma_loss)
_SCOPES: "weakref.WeakKeyDictionary[nn.Module, contextlib.ExitStack]" = weakref.WeakKeyDictionary()
_RECORDS: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()
_FAMILY: "weakref.WeakKeyDictionary[nn.Module, AttentionFamily]" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class AttentionFamily:
    """How SDMA reads one family of transformers self-attention modules: its heads, and the query projection of a
    difference of inputs (the authors reading's queries are projections of z while k and v stay those of x)."""

    name: str
    heads: Callable[[nn.Module], int]
    head_dim: Callable[[nn.Module], int]
    project_query: Callable[[nn.Module, Tensor], Tensor]  # W_q d (no bias), [..., E] -> [..., E]
    causal: Callable[[nn.Module], bool]


def _is_bert_self_attention(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("SelfAttention") and hasattr(module, "num_attention_heads")
            and all(isinstance(getattr(module, name, None), nn.Linear) for name in ("query", "key", "value")))


def _is_gpt2_self_attention(module: nn.Module) -> bool:
    return (type(module).__name__ == "GPT2Attention" and not module.is_cross_attention
            and hasattr(module, "c_attn"))


FAMILIES = (
    (_is_bert_self_attention, AttentionFamily(
        "BERT", heads=lambda m: m.num_attention_heads, head_dim=lambda m: m.attention_head_size,
        project_query=lambda m, d: F.linear(d, m.query.weight), causal=lambda m: bool(getattr(m, "is_causal", False)))),
    (_is_gpt2_self_attention, AttentionFamily(
        "GPT-2", heads=lambda m: m.num_heads, head_dim=lambda m: m.head_dim,
        project_query=lambda m, d: d @ m.c_attn.weight[:, :m.embed_dim], causal=lambda m: True)),
)


def self_attention_modules(model: nn.Module) -> List[Tuple[nn.Module, AttentionFamily]]:
    """The self-attention modules SDMA is attached to, with their family, in model order: BERT-family
    ``*SelfAttention`` modules (``query``/``key``/``value`` projections) and GPT-2's ``GPT2Attention`` (self-attention,
    fused ``c_attn``)."""
    found = []
    for module in model.modules():
        family = next((family for matches, family in FAMILIES if matches(module)), None)
        if family is not None:
            found.append((module, family))
    if not found:
        raise SDMAConfigError(
            f"attach_sdma: {type(model).__name__} has no self-attention module SDMA knows: BERT-family *SelfAttention "
            "modules (query/key/value projections: BERT, RoBERTa, MiniLM, ...) or GPT-2's GPT2Attention")
    return found


def attach_sdma(model: nn.Module, decoder_mask_at_inference: bool = False, **options) -> nn.Module:
    """Give every self-attention module of ``model`` an SDMA core with ``options`` (the fields of
    :class:`latent_core.sdma.SDMAOptions`, named as there: ``mode``, ``reading``, ``clusters``, ...), register the
    attention function and switch the model's attention implementation to it. Pretrained weights are kept; only the
    cores' parameters (GMM means and variances, the mixing weight g) are new. Returns ``model``.

    A causal (decoder) self-attention applies its mask at inference only with ``decoder_mask_at_inference``, as the
    fairseq adapter's ``--sdma-decoder-mask-at-inference`` (the paper drops it there); then it needs the keys'
    cluster probabilities of every position, and generates without a KV cache (``use_cache=False``)."""
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
    modules = self_attention_modules(model)
    for module, family in modules:
        if hasattr(module, "sdma"):
            raise SDMAConfigError(f"attach_sdma: {type(module).__name__} already has an SDMA core (attached twice)")
        causal = family.causal(module)
        heads = family.heads(module)
        core = SDMACore(heads * family.head_dim(module), heads, decoder if causal else sdma)
        core.sdma_group = "decoder_self" if causal else "encoder_self"
        module.sdma = core
        module.register_forward_pre_hook(_draw_sample, with_kwargs=True)
        _FAMILY[module] = family
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


def sdma_loss(model: nn.Module, weights: Optional[Dict[str, float]] = None) -> Tensor:
    """The regularisers of eq. (24) (lambda_k KL + lambda_q L_Dqq - lambda_x L_Dxq + lambda_d DV) of the model's
    latest forward, averaged over its sequences: a 0-dim tensor to add to the task loss. ``weights``: the lambdas
    by the field names of :class:`latent_core.sdma.SDMALossWeights` (``kl_weight``, ``dqq_weight``, ``dxq_weight``,
    ``diversity_weight``; default Table I's)."""
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
    weights = {**defaults, **given}
    terms = collect_sdma_losses(model, records)
    check_finite(terms, HF_ADVICE)
    return weighted_regulariser(terms, weights).mean()


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
    reading handed to the module's projections."""
    core = module.sdma
    if not core.active(module.training):
        return None
    hidden = args[0] if args else kwargs["hidden_states"]
    cluster_input, sample = core.sample(hidden, module.training)
    _SAMPLES[module] = (hidden, cluster_input, sample)
    if sample is hidden or core.options.authors:
        return None
    if args:
        return (sample, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": sample}


def sdma_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Optional[Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                           **kwargs) -> Tuple[Tensor, Optional[Tensor]]:
    """The registered attention function: ``query``/``key``/``value`` ``[B, H, T, d_k]`` (projections of z),
    ``attention_mask`` bool ``[B, 1, T, S]`` (True = may attend) or None. Returns (``[B, T, H, d_k]``, A_hat
    ``[B, H, T, S]`` when ``output_attentions`` asks for it, else None), as transformers' own functions do.
    A module without an active core (mode ``none``; a module SDMA was not attached to) runs transformers' sdpa."""
    core = getattr(module, "sdma", None)
    drawn = _SAMPLES.pop(module, None)
    if core is None or drawn is None or not core.active(module.training):
        if kwargs.get("output_attentions"):  # transformers' sdpa returns no weights
            return _softmax_attention(module, query, key, value, attention_mask, scaling, dropout)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    x, cluster_input, z = drawn
    B, H, T, D = query.shape
    S = key.size(2)
    if S != T:
        raise SDMAConfigError(
            f"SDMA attention of {type(module).__name__}: {T} queries over {S} keys (a KV cache): applying the mask at "
            "inference needs every key's cluster probabilities; generate with use_cache=False, or leave the decoder's "
            "mask off at inference (attach_sdma(..., decoder_mask_at_inference=False), the default)")
    authors = core.options.authors
    family = _FAMILY[module]
    if authors and z is not x:  # their queries are projections of z, their keys and values of x
        query = query + family.project_query(module, z - x).view(B, T, H, D).transpose(1, 2)
    q = query * (D ** -0.5 if scaling is None else scaling)
    log_joint_z, log_resp_z = core.cluster(cluster_input, scale=core.clustering_scale)  # [B, T, H, C], eq. (9)
    resp = log_resp_z.exp().transpose(1, 2)  # [B, H, T, C]
    # the scaled queries: the paper's carry the sample through W_q; the authors' get a second draw
    q_cluster, q = (t.view(B, T, H, D).transpose(1, 2)
                    for t in core.sample_queries(q.transpose(1, 2).reshape(B, T, H * D), module.training))
    if authors and family.causal(module):  # their causal self-attention masks the future only
        blocked = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1)[None, None]  # [1, 1, T, S]
    else:
        blocked = None if attention_mask is None else ~attention_mask.to(torch.bool)
    attention_dropout = (lambda a: F.dropout(a, dropout, training=True)) if dropout > 0 else (lambda a: a)
    out, weights = sdma_attention(  # eq. (1), (2), (10), (11)
        q, key, value, resp, resp, core.mix_weight, authors=authors, blocked=blocked,
        kernel=core.options.attention_kernel, need_weights=bool(kwargs.get("output_attentions")),
        dropout=attention_dropout, dropout_p=dropout)
    if core.computes_regularisers():
        log_joint_q = log_resp_q = None
        if core.query_gmm is not None:  # eq. (16)-(19), on the scaled queries
            log_joint_q, log_resp_q = (t.transpose(0, 1) for t in core.cluster_queries(q_cluster.transpose(1, 2),
                                                                                       core.clustering_scale))
        valid = _real_queries(attention_mask, B, T, q.device)
        core.record(log_joint_z.transpose(0, 1), log_resp_z.transpose(0, 1), valid.t(), log_joint_q, log_resp_q)
    return out.transpose(1, 2).contiguous(), weights


def _softmax_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                       scaling: Optional[float], dropout: float) -> Tuple[Tensor, Tensor]:
    """Plain softmax attention (eq. 1) with its weights, for an attention without SDMA in this pass asked for
    ``output_attentions``: the boolean mask as transformers' eager functions apply an additive one."""
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * (query.size(-1) ** -0.5 if scaling is None
                                                                   else scaling)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask.to(torch.bool), torch.finfo(scores.dtype).min)
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
