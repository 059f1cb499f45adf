"""The attention modules SDMA knows in transformers, by family: how to read each one's heads, key/value heads, input
width and role (encoder self-attention, decoder self-attention, cross-attention), and how to project a difference of
inputs through its query (and, for a cross-attention, key) weights, with the family's rotary embedding where it has one.

A new family is one detector and one :class:`AttentionFamily` row of :data:`FAMILIES`.
"""

import dataclasses
import sys
from typing import Callable, List, Optional, Tuple

import torch.nn.functional as F
from torch import Tensor, nn

from latent_core.sdma import SDMAConfigError

ENCODER_SELF, DECODER_SELF, DECODER_CROSS = "encoder_self", "decoder_self", "decoder_cross"


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
