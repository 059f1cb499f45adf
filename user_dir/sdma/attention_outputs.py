"""What every attention of a fairseq encoder-decoder computed in a forward pass: the one documented output
that analysis reads (the counterpart of Hugging Face's ``output_attentions``).

    with attention_outputs(model) as outputs:    # {type: [AttentionOutputs of layer 0, layer 1, ...]}
        model(**sample["net_input"])             # a full (teacher-forced) forward
    outputs["encoder_self"][0].weights           # [n_h, B, T, S]

Types are ``encoder_self``, ``decoder_self`` and ``decoder_cross`` (a model without cross-attention has no
``decoder_cross``); each entry holds the latest forward's outputs of that layer (None before its first call).

- An SDMA attention (:class:`~user_dir.sdma.fairseq_attention.SDMAMultiheadAttention`, ``--sdma-mode
  sdma|sma``) that applies its mask in this pass (in training; at inference the encoder's, and the decoder's
  with ``--sdma-decoder-mask-at-inference``) writes its own entry from inside its forward: the attention it applied (A_hat, eq. 11), the
  softmax attention of the same scores before mixing (A, eq. 1), the p(c|.) of its queries and keys (eq. 9),
  its scaled queries and the mixing weight g.
- Every other attention runs fairseq's softmax attention: fairseq's own ``MultiheadAttention`` (the vanilla
  transformer, ``--sdma-mode none``) and an SDMA attention without its mask in this pass. It cannot be asked: its
  fast path (``F.multi_head_attention_forward``) averages the heads and never calls ``q_proj``. Its entry is
  computed after the call from the call's inputs (a forward hook) with the module's own projections: fairseq's
  explicit path, eq. (1), written out below.

Nothing in the model is changed while recording and the forward's own outputs are the same. Incremental
decoding steps and ``before_softmax`` calls are not recorded.
"""

import contextlib
import inspect
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor, nn

from latent_core.redundancy import ATTENTION_TYPES  # noqa: F401 (the three types, re-exported)


class AttentionOutputsError(ValueError):
    """The model's attention layers cannot be recorded (not a fairseq encoder-decoder, unsupported options)."""


@dataclass
class AttentionOutputs:
    """One attention's outputs of one forward pass (float32, detached, on the model's device).

    ``query_input`` ``[T, B, E]``: the query input x of the call.
    ``queries`` ``[T, B, n_h, d_k]``: the scaled queries W_q x / sqrt(d_k) (SDMA: of its sample z, eq. 8).
    ``weights`` ``[n_h, B, T, S]``: the attention applied to the values (SDMA: A_hat, eq. 11; vanilla: A).
    ``plain_weights`` ``[n_h, B, T, S]``: the softmax attention A of eq. (1) before any mixing.
    ``query_resp`` ``[T, B, n_h, C]`` / ``key_resp`` ``[S, B, n_h, C]``: p(c|.) of eq. (9) (SDMA only).
    ``mix_weight``: g of eq. (11) (SDMA only).
    """

    query_input: Tensor
    queries: Tensor
    weights: Tensor
    plain_weights: Tensor
    query_resp: Optional[Tensor] = None
    key_resp: Optional[Tensor] = None
    mix_weight: Optional[float] = None


# module -> where its outputs go, while attention_outputs() is active
_SINKS: ContextVar[Optional[Dict[nn.Module, Callable[[AttentionOutputs], None]]]] = ContextVar(
    "attention_output_sinks", default=None)


def output_sink(module: nn.Module) -> Optional[Callable[[AttentionOutputs], None]]:
    """Where ``module`` writes its :class:`AttentionOutputs` in this forward, or None when it is not recorded."""
    sinks = _SINKS.get()
    return None if sinks is None else sinks.get(module)


def attention_layers(model: nn.Module) -> Dict[str, List[nn.Module]]:
    """The attention modules of a fairseq encoder-decoder model per type, in layer order; a type the model does
    not have (``--no-cross-attention``) is left out. In ``bert_fused_transformer``'s attention fusion the layer's
    own attention inside the wrapper is returned (the extra attentions over BERT's output are not one of the
    paper's three types)."""
    encoder = getattr(model, "encoder", None)
    decoder = getattr(model, "decoder", None)
    if not hasattr(encoder, "layers") or not hasattr(decoder, "layers"):
        raise AttentionOutputsError(
            f"{type(model).__name__} is not a fairseq encoder-decoder model with attention layers "
            "(expected model.encoder.layers[*].self_attn and model.decoder.layers[*].self_attn / .encoder_attn, "
            "as in the transformer / sdma_transformer architectures)"
        )
    modules = {
        "encoder_self": [getattr(layer, "self_attn", None) for layer in encoder.layers],
        "decoder_self": [getattr(layer, "self_attn", None) for layer in decoder.layers],
        "decoder_cross": [getattr(layer, "encoder_attn", None) for layer in decoder.layers],
    }
    modules = {kind: [getattr(m, "attention", m) if hasattr(m, "bert_attention") else m for m in mods]
               for kind, mods in modules.items()}
    return {kind: mods for kind, mods in modules.items() if mods and all(m is not None for m in mods)}


def recordable_layers(model: nn.Module) -> Dict[str, List[nn.Module]]:
    """:func:`attention_layers`, checked for what recording needs (fairseq ``MultiheadAttention`` without
    add_bias_kv / add_zero_attn, no ``--cross-self-attention``); :class:`AttentionOutputsError` otherwise."""
    layers = attention_layers(model)
    if getattr(model.decoder, "cross_self_attention", False):
        raise AttentionOutputsError("decoders with --cross-self-attention are not supported")
    for kind, mods in layers.items():
        for index, module in enumerate(mods):
            _check_recordable(kind, index, module)
    return layers


def _check_recordable(kind: str, index: int, module: nn.Module) -> None:
    if not isinstance(module, MultiheadAttention):
        raise AttentionOutputsError(f"{kind} attention of layer {index} is {type(module).__name__}, not a fairseq "
                                    "MultiheadAttention: its attention cannot be recorded")
    if module.bias_k is not None or module.add_zero_attn:
        raise AttentionOutputsError(f"{kind} layer {index}: add_bias_kv / add_zero_attn are not supported")


_FORWARD = inspect.signature(MultiheadAttention.forward)


def softmax_attention(module: MultiheadAttention, query: Tensor, key: Optional[Tensor],
                      key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor]) -> AttentionOutputs:
    """fairseq's explicit path of ``MultiheadAttention`` up to its attention weights, eq. (1):
    A = softmax(q k^T + masks) with q = W_q x / sqrt(d_k), per head, in float32."""
    T, B, _ = query.shape
    H, D = module.num_heads, module.head_dim
    key = query if key is None else key
    q = (module.q_proj(query) * module.scaling).view(T, B, H, D)
    k = module.k_proj(key).view(key.size(0), B, H, D)
    scores = torch.einsum("tbhd,sbhd->hbts", q.float(), k.float())
    if attn_mask is not None:  # [T, S]: fairseq's float future mask (0 / -inf) or a bool mask
        scores = (scores.masked_fill(attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.float())
    if key_padding_mask is not None:  # [B, S], True = pad
        scores = scores.masked_fill(key_padding_mask.to(torch.bool)[None, :, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return AttentionOutputs(query_input=query.detach().float(), queries=q.detach().float(), weights=weights,
                            plain_weights=weights)


@contextlib.contextmanager
def attention_outputs(model: nn.Module, only: Optional[Iterable[Tuple[str, int]]] = None
                      ) -> Iterator[Dict[str, List[Optional[AttentionOutputs]]]]:
    """Record every attention's :class:`AttentionOutputs` during forward passes of ``model`` (see the module
    docstring); yields ``{type: [layer 0, layer 1, ...]}``, overwritten by each forward. ``only``: record just
    these ``(type, layer index)`` pairs (the others stay None)."""
    layers = recordable_layers(model)
    selected = None if only is None else set(only)
    store: Dict[str, List[Optional[AttentionOutputs]]] = {kind: [None] * len(mods) for kind, mods in layers.items()}
    sinks: Dict[nn.Module, Callable[[AttentionOutputs], None]] = {}
    written: Dict[nn.Module, bool] = {}
    handles = []

    def sink_for(kind: str, index: int, module: nn.Module):
        def sink(outputs: AttentionOutputs) -> None:
            store[kind][index] = outputs
            written[module] = True
        return sink

    def before(module, _args, _kwargs):
        written[module] = False

    def after(module, args, kwargs, _output):
        if written[module]:  # an SDMA module wrote its own
            return
        call = _FORWARD.bind(module, *args, **kwargs)
        call.apply_defaults()
        arguments = call.arguments
        if arguments["incremental_state"] is not None or arguments["before_softmax"]:
            return
        with torch.no_grad():
            sinks[module](softmax_attention(module, arguments["query"], arguments["key"],
                                            arguments["key_padding_mask"], arguments["attn_mask"]))

    for kind, mods in layers.items():
        for index, module in enumerate(mods):
            if selected is not None and (kind, index) not in selected:
                continue
            sinks[module] = sink_for(kind, index, module)
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, with_kwargs=True))
    token = _SINKS.set(sinks)
    try:
        yield store
    finally:
        _SINKS.reset(token)
        for handle in handles:
            handle.remove()
