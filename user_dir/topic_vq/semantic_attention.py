"""Semantics-driven multi-head attention and output enhancement for BERT-family encoders.

Yu et al., "Learning Semantic Textual Similarity via Topic-informed Discrete Latent
Variables" (Yu et al. 2022, arXiv:2211.03616), Section 3.3, eq. (4)-(5). Plain PyTorch on
Hugging Face ``transformers`` models (BERT, RoBERTa, ELECTRA, XLM-R: any model whose
``base_model.encoder.layer[i].attention.self`` is the self-attention, as in transformers 5).

* :func:`align_to_pieces` puts the quantised vectors of the two sentences, Z_i^q and Z_j^q
  (one per VQ word, from ``user_dir.topic_vq.vqvae``), on the backbone's word pieces:
  ``[B, T, E]``, the sequence "Z_i^q (+) Z_j^q" of eq. (4). Sentence-2 pieces take sentence 2's
  vectors (the authors' code took sentence 1's topic ids for both);
* :class:`SemanticScores`: Z = FFN(Z_i^q (+) Z_j^q), Q_q = Z W_q^Q, K_q = Z W_q^K (eq. 4) and
  the score bias Q_q K_q^T / sqrt(d_k) ``[B, 1, T, T]``, shared by all heads and by all
  chosen layers (eq. 4 has one Z; one set of parameters per model, so DDP finds no unused
  ones; the authors created the projections in every layer and used them in one). d_k is
  the backbone's head size, and the bias is DIVIDED by sqrt(d_k) (the authors multiplied);
* :func:`install_semantic_attention` hooks the chosen layers' self-attention modules (and
  creates no parameters) so that their scores become

      softmax((Q K^T + Q_q K_q^T) / sqrt(d_k) + mask)        (eq. 5)

  by adding the bias to the additive attention mask those layers receive. The bias of the
  current forward pass is held by a :class:`SemanticAttentionContext`
  (``with context.use(bias): model(...)``). Padding keys stay masked whatever the bias.
  Works with ``attn_implementation`` 'eager' and 'sdpa' (same results); others (flash
  attention, flex attention) cannot take a dense score bias and are refused;
* :class:`OutputEnhancement`: [h^l ; LayerNorm(Linear(Z_i^q (+) Z_j^q))] (Section 3.3, end)
  before the prediction layer, pooled: the pooled h^l ``[B, H]`` joined with the mean of the
  enhancement over the pair's pieces (the special tokens carry no code, so a [CLS]-only
  read-out would not see it) -> ``[B, H + E']``.

Layers are chosen by ``--semantic-attention-layers`` (:func:`parse_semantic_attention_layers`):
'last' (the paper's best, Figure 5), 'all', 'none', or comma-separated indices. With 'none'
(the "w/o semantics-driven attention" ablation) build no :class:`SemanticScores` either, or
its parameters would be unused.
"""

import contextlib
import contextvars
import math
from typing import Dict, Iterator, List, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch import Tensor

SUPPORTED_ATTENTION = ("eager", "sdpa")
LAYERS_OPTION = "--semantic-attention-layers"
# Entries of a float attention mask at or below this value mark masked keys (HF fills them
# with finfo(dtype).min; older code used -10000).
_MASKED_BELOW = -1e4


def align_to_pieces(z_q_1: Tensor, z_q_2: Tensor, piece_sentence: Tensor, piece_word: Tensor) -> Tensor:
    """The quantised vector of each word piece of a sentence pair, ``[B, T, E]``.

    ``z_q_1`` ``[B, W1, E]``, ``z_q_2`` ``[B, W2, E]``: Z^q of sentence 1 and sentence 2 (one
    vector per VQ word); ``piece_sentence`` ``[B, T]``: 0 for a piece of sentence 1, 1 for
    sentence 2, -1 for special tokens and padding; ``piece_word`` ``[B, T]``: the index of
    the piece's word within ITS OWN sentence (-1 for special tokens and padding). Special and
    padding pieces get zeros; pieces of sentence 2 get sentence 2's vectors.
    """
    if z_q_1.dim() != 3 or z_q_2.dim() != 3 or z_q_1.size(0) != z_q_2.size(0) or z_q_1.size(2) != z_q_2.size(2):
        raise ValueError(
            f"z_q_1 and z_q_2 must be [B, W1, E] and [B, W2, E], got {tuple(z_q_1.shape)} and "
            f"{tuple(z_q_2.shape)}"
        )
    batch, words_1 = z_q_1.shape[:2]
    words_2 = z_q_2.size(1)
    if piece_sentence.shape != piece_word.shape or piece_sentence.dim() != 2 or piece_sentence.size(0) != batch:
        raise ValueError(
            f"piece_sentence and piece_word must both be [B={batch}, T], got "
            f"{tuple(piece_sentence.shape)} and {tuple(piece_word.shape)}"
        )
    first, second = piece_sentence.eq(0), piece_sentence.eq(1)
    in_pair = first | second
    if bool((~in_pair & piece_sentence.ne(-1)).any()):
        raise ValueError("piece_sentence may only hold 0 (sentence 1), 1 (sentence 2) or -1 (special/padding)")
    if bool((in_pair & piece_word.lt(0)).any()):
        raise ValueError("a piece of sentence 1 or 2 has piece_word < 0")
    if bool((first & piece_word.ge(words_1)).any()) or bool((second & piece_word.ge(words_2)).any()):
        raise ValueError(
            f"piece_word points past its sentence's words (sentence 1 has {words_1}, sentence 2 "
            f"{words_2} positions)"
        )
    pair = torch.cat([z_q_1, z_q_2.to(z_q_1.dtype)], dim=1)  # [B, W1 + W2, E]
    index = torch.where(second, piece_word + words_1, piece_word).clamp(min=0)  # sentence 2 after sentence 1
    aligned = torch.gather(pair, 1, index.unsqueeze(-1).expand(-1, -1, pair.size(-1)))
    return aligned * in_pair.unsqueeze(-1).to(aligned.dtype)


class SemanticScores(nn.Module):
    """Score bias of the semantics-driven attention (eq. 4-5), one per model.

    ``code_dim`` E of the quantised vectors; ``hidden_dim`` of the FFN (Linear-ReLU-Linear,
    the transformer's position-wise FFN, E -> hidden -> E); ``head_dim`` d_k, the backbone's
    attention head size (:func:`attention_head_dim`); W_q^Q, W_q^K are E x E (no bias). E and the
    FFN size are options (``--topic-embed-dim``, ``--semantic-ffn-dim``), checked where the
    configuration is read.
    """

    def __init__(self, code_dim: int, hidden_dim: int, head_dim: int, dropout: float = 0.0):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"attention head size d_k={head_dim!r} must be an integer >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"semantic FFN dropout={dropout} must lie in [0, 1)")
        self.code_dim, self.head_dim = code_dim, head_dim
        self.ffn = nn.Sequential(nn.Linear(code_dim, hidden_dim), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden_dim, code_dim))
        self.query = nn.Linear(code_dim, code_dim, bias=False)  # W_q^Q
        self.key = nn.Linear(code_dim, code_dim, bias=False)  # W_q^K

    def forward(self, z: Tensor) -> Tensor:
        """``z`` = Z_i^q (+) Z_j^q on the pieces ``[B, T, E]`` (:func:`align_to_pieces`) ->
        Q_q K_q^T / sqrt(d_k) ``[B, 1, T, T]`` (eq. 4; the Q_q K_q^T part of eq. 5)."""
        if z.dim() != 3 or z.size(-1) != self.code_dim:
            raise ValueError(f"z must be [B, T, {self.code_dim}], got {tuple(z.shape)}")
        hidden = self.ffn(z)  # Z = FFN[Z_i^q (+) Z_j^q]
        q, k = self.query(hidden), self.key(hidden)  # Q_q, K_q (eq. 4)
        return (q @ k.transpose(-1, -2)).unsqueeze(1) / math.sqrt(self.head_dim)


class OutputEnhancement(nn.Module):
    """[h^l ; LayerNorm(Linear(Z_i^q (+) Z_j^q))] (Section 3.3), pooled: the pooled backbone
    output ``[B, H]`` joined with the mean of LayerNorm(Linear(Z)) over the pair's pieces ->
    ``[B, H + out_dim]`` (``out_dim`` defaults to E; the paper's (n+1)E has E' = the head
    size, 64 like E). The special tokens carry no code, so they are left out of the mean. E is
    ``--topic-embed-dim``, checked where the configuration is read."""

    def __init__(self, code_dim: int, out_dim: Optional[int] = None):
        super().__init__()
        if out_dim is None:
            out_dim = code_dim
        elif isinstance(out_dim, bool) or not isinstance(out_dim, int) or out_dim < 1:
            raise ValueError(f"output enhancement size={out_dim!r} must be an integer >= 1")
        self.code_dim, self.out_dim = code_dim, out_dim
        self.proj = nn.Linear(code_dim, out_dim)
        self.norm = nn.LayerNorm(out_dim)

    def forward(self, pooled: Tensor, z: Tensor, in_pair: Tensor) -> Tensor:
        """``pooled`` ``[B, H]``, ``z`` ``[B, T, E]`` (:func:`align_to_pieces`), ``in_pair``
        ``[B, T]`` (True on the pieces of the two sentences) -> ``[B, H + out_dim]``."""
        if (pooled.dim() != 2 or z.dim() != 3 or z.size(-1) != self.code_dim or in_pair.shape != z.shape[:2]
                or pooled.size(0) != z.size(0)):
            raise ValueError(
                f"pooled must be [B, H], z [B, T, {self.code_dim}] and in_pair [B, T] with the same B, T; got "
                f"{tuple(pooled.shape)}, {tuple(z.shape)} and {tuple(in_pair.shape)}"
            )
        enhanced = self.norm(self.proj(z)).to(pooled.dtype)  # LayerNorm(Linear(Z)) [B, T, E']
        keep = in_pair.unsqueeze(-1).to(enhanced.dtype)
        return torch.cat([pooled, (enhanced * keep).sum(1) / keep.sum(1).clamp_min(1.0)], dim=-1)


# the bias of the forward pass under way, a context variable as SDMA's recording scope: nested scopes
# restore the outer bias, threads running a backbone each see their own, and no model holds it (a
# model stays deep-copyable and picklable)
_SEMANTIC_BIAS: contextvars.ContextVar[Optional[Tensor]] = contextvars.ContextVar("semantic_attention_bias",
                                                                                  default=None)


class SemanticAttentionContext:
    """The score bias ``[B, 1, T, T]`` of the forward pass under way, read by every hooked layer.

    Set it around the backbone call: ``with context.use(scores(z)): outputs = bert(...)``.
    A hooked layer called while no bias is set raises (it never silently falls back to plain
    attention). With gradient checkpointing the layers are re-run during backward: keep the
    same bias set until backward is done.
    """

    @property
    def bias(self) -> Optional[Tensor]:
        """The bias of the innermost :meth:`use` scope, or None outside any."""
        return _SEMANTIC_BIAS.get()

    @contextlib.contextmanager
    def use(self, bias: Tensor) -> Iterator["SemanticAttentionContext"]:
        if bias.dim() != 4 or bias.size(1) != 1 or bias.size(2) != bias.size(3):
            raise ValueError(f"the semantic attention bias must be [B, 1, T, T], got {tuple(bias.shape)}")
        token = _SEMANTIC_BIAS.set(bias)
        try:
            yield self
        finally:
            _SEMANTIC_BIAS.reset(token)


def parse_semantic_attention_layers(spec: str, num_layers: int) -> List[int]:
    """Layer indices (sorted, non-negative) of ``--semantic-attention-layers``: 'last' (default),
    'all', 'none' (no semantics-driven attention: the ablation of Section 4.5), or
    comma-separated indices, negative ones counting from the end (``-1`` = the last)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"the encoder must have at least one layer, got {num_layers!r}")
    text = str(spec).strip().lower()
    if text == "last":
        return [num_layers - 1]
    if text == "all":
        return list(range(num_layers))
    if text == "none":
        return []
    try:
        indices = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"{LAYERS_OPTION}={spec!r}: expected 'last', 'all', 'none' or comma-separated layer indices"
        ) from None
    return _normalise_layers(indices, num_layers, spec)


def _normalise_layers(indices: Sequence[int], num_layers: int, spec: object) -> List[int]:
    chosen = []
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int) or not -num_layers <= index < num_layers:
            raise ValueError(
                f"{LAYERS_OPTION}={spec!r}: layer {index!r} does not exist; the encoder has {num_layers} "
                f"layers (0..{num_layers - 1}, or -{num_layers}..-1 from the end)"
            )
        index = index % num_layers
        if index in chosen:
            raise ValueError(f"{LAYERS_OPTION}={spec!r}: layer {index} is named twice")
        chosen.append(index)
    return sorted(chosen)


def _encoder_layers(hf_model: nn.Module) -> nn.ModuleList:
    base = getattr(hf_model, "base_model", hf_model)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList) or not all(
        hasattr(getattr(layer, "attention", None), "self") for layer in layers
    ):
        raise TypeError(
            f"{type(hf_model).__name__} is not a BERT-family encoder (expected "
            "base_model.encoder.layer[i].attention.self, as in BERT and RoBERTa)"
        )
    return layers


def attention_head_dim(hf_model: nn.Module) -> int:
    """d_k, the head size of the backbone's self-attention (for :class:`SemanticScores`)."""
    return int(_encoder_layers(hf_model)[0].attention.self.attention_head_size)


def _check_implementation(config) -> None:
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"semantics-driven attention adds a dense score bias, which attn_implementation="
            f"{implementation!r} cannot take; load the backbone with attn_implementation='eager' "
            "or 'sdpa'"
        )


def _mask_dtype(hidden: Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def semantic_attention_mask(attention_mask: Optional[Tensor], bias: Tensor, dtype: torch.dtype) -> Tensor:
    """The additive mask of a hooked layer: ``attention_mask`` + ``bias`` ``[B, 1, T, T]`` (dtype).

    ``attention_mask`` as the layer receives it from transformers: None (no padding), boolean
    ``[B, 1, T, T]`` (True = attend; 'sdpa') or additive float (0 = attend, finfo.min =
    masked; 'eager'). Masked keys get finfo(dtype).min and no bias, so no bias can un-mask a
    padding key (and no sum overflows to -inf).
    """
    bias = bias.to(dtype)
    if attention_mask is None:
        return bias
    lowest = torch.finfo(dtype).min
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, bias, lowest)
    masked = attention_mask <= _MASKED_BELOW
    return torch.where(masked, lowest, (attention_mask.to(dtype) + bias).clamp(min=lowest))


def _attention_hook(context: SemanticAttentionContext, layer_index: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        _check_implementation(module.config)
        bias = context.bias
        if bias is None:
            raise RuntimeError(
                f"layer {layer_index} uses semantics-driven attention but no bias is set: call the "
                "backbone inside `with context.use(bias):`"
            )
        if kwargs.get("past_key_values") is not None or kwargs.get("encoder_hidden_states") is not None:
            raise RuntimeError("semantics-driven attention is for encoder self-attention without a cache")
        hidden = args[0] if args else kwargs["hidden_states"]
        batch, length = hidden.shape[:2]
        if tuple(bias.shape) != (batch, 1, length, length):
            raise ValueError(
                f"semantic attention bias is {tuple(bias.shape)}, layer {layer_index} needs "
                f"[{batch}, 1, {length}, {length}]"
            )
        if len(args) > 1:  # attention_mask given positionally
            args = (args[0], semantic_attention_mask(args[1], bias, _mask_dtype(hidden))) + tuple(args[2:])
        else:
            kwargs["attention_mask"] = semantic_attention_mask(
                kwargs.get("attention_mask"), bias, _mask_dtype(hidden)
            )
        return args, kwargs

    return hook


def install_semantic_attention(hf_model: nn.Module, layers: Union[str, Sequence[int]],
                               context: SemanticAttentionContext) -> Dict[int, nn.Module]:
    """Make the self-attention of ``layers`` semantics-driven (eq. 5), reading ``context.bias``.

    ``layers``: a ``--semantic-attention-layers`` spec ('last', 'all', 'none', '0,-1') or
    indices (negative from the end). Only forward pre-hooks are added: the model gets no
    parameters (those live once in :class:`SemanticScores`). Returns layer index -> the
    hooked self-attention module. Raises for non-BERT-family models, decoders, attention
    implementations other than 'eager'/'sdpa', and layers hooked twice.
    """
    encoder_layers = _encoder_layers(hf_model)
    config = hf_model.config
    if getattr(config, "is_decoder", False):
        raise ValueError("semantics-driven attention needs an encoder (config.is_decoder is True)")
    _check_implementation(config)
    num_layers = len(encoder_layers)
    if isinstance(layers, str):
        chosen = parse_semantic_attention_layers(layers, num_layers)
    else:
        chosen = _normalise_layers(list(layers), num_layers, list(layers))
    installed = {}
    for index in chosen:
        module = encoder_layers[index].attention.self
        if getattr(module, "_semantic_attention_handle", None) is not None:
            raise ValueError(f"layer {index} already has semantics-driven attention")
        installed[index] = module
    for index, module in installed.items():
        module._semantic_attention_handle = module.register_forward_pre_hook(
            _attention_hook(context, index), with_kwargs=True
        )
    return installed


def uninstall_semantic_attention(hf_model: nn.Module) -> List[int]:
    """Remove the hooks of :func:`install_semantic_attention`; returns the layers freed."""
    freed = []
    for index, layer in enumerate(_encoder_layers(hf_model)):
        module = layer.attention.self
        handle = getattr(module, "_semantic_attention_handle", None)
        if handle is not None:
            handle.remove()
            module._semantic_attention_handle = None
            freed.append(index)
    return freed
