#!/usr/bin/env python3
"""Layer redundancy (LR) and head redundancy (HR) of a fairseq encoder-decoder model.

Chien & Huang, "Latent Semantic and Disentangled Attention", TPAMI 2024
(``shared/papers/sdma.txt``, Section IV-A2 "Evaluation Metrics", Tables II-IV,
Figs. 10-11).  Works for any fairseq encoder-decoder checkpoint whose attentions
are fairseq ``MultiheadAttention`` modules: the vanilla ``transformer`` and
``sdma_transformer`` (whose ``SDMAMultiheadAttention`` returns the mixed
attention A_hat of eq. 11).

Definitions (``A^{n,h}_{i,:}`` is row i of the attention matrix of head h in layer n)::

    LR = 1/N sum_n ( log2 n_h - 1/n_q sum_i JS(A^{n,1}_{i,:}, ..., A^{n,n_h}_{i,:}) )
    HR = 1/(N^2 n_h^2) sum_{n1,n2} sum_{h1,h2} 1/n_q sum_i ( 1 - JS(A^{n1,h1}_{i,:}, A^{n2,h2}_{i,:}) )

How the formulas are read here
------------------------------
* JS is the Jensen-Shannon *divergence* in bits (log base 2), i.e. the square of
  ``scipy.spatial.distance.jensenshannon(p, q, base=2)``.  The n-ary JS of LR is
  the generalised divergence with equal weights,
  ``JS(P_1..P_n) = H(mean_h P_h) - mean_h H(P_h)``, which lies in [0, log2 n].
* LR is reported on the paper's [0, 1] scale: the printed formula divided by
  log2 n_h, ``LR = 1/N sum_n (log2 n_h - 1/n_q sum_i JS) / log2 n_h``, as the
  authors' ``utils.py`` computes it (hence the paper's LR values of 0.5-0.79
  for 4- and 8-head models alike).  1 when all heads of every layer attend
  identically, 0 when their rows have disjoint supports.  The undivided value
  of the printed formula, in [0, log2 n_h] bits, is reported as ``LR_bits``.
  With a single head (n_h = 1, log2 n_h = 0) LR is undefined: the result holds
  ``LR = None`` (JSON null) with an ``LR_note`` saying why, ``LR_bits`` is 0,
  and the tensor function :func:`layer_redundancy` raises :class:`RedundancyError`.
* The pairwise JS of HR lies in [0, 1], so 1 - JS and HR lie in [0, 1] too (no
  rescaling).
* HR's double sums run over *all* ordered pairs of (layer, head), identical
  pairs included (they contribute 1 - 0 = 1), exactly as written; the
  normaliser is (N n_h)^2.
* LR and HR are computed separately for encoder self-attention
  (``encoder_self``), decoder self-attention (``decoder_self``) and
  encoder-decoder attention (``decoder_cross``): N and n_h are those of the
  attention type, and HR pairs heads of the same type only.  (The authors' code
  used the encoder attention for all three; this script does not.  The
  paper's published LR / HR values (Tables II-IV, VII) are therefore encoder
  self-attention numbers: compare them with ``encoder_self``; the JSON says so
  too, in ``compare_with_paper`` and ``notes``.)
* Rows i run over the real (non-padding) query positions of a sentence: source
  tokens incl. the final ``</s>`` for the encoder, the decoder inputs
  (``</s> y_1 .. y_{m-1}``, teacher-forced on the reference target) for the
  decoder; n_q is their number.  Each row is a distribution over the real keys
  only (padding columns dropped and the row renormalised; fairseq gives them
  weight 0, so this is a no-op up to rounding).  Decoder self-attention rows are
  causal: the zeros beyond position i are part of the distribution.
* Averaging: the formulas are evaluated per sentence (1/n_q over that
  sentence's rows) and the per-sentence LR / HR are averaged over sentences
  with equal weight.
* The attention is the one the model uses in a full teacher-forced forward pass
  with ``model.eval()`` (no dropout): for SDMA the mixed A_hat of eq. (11) with the
  checkpoint's mixing weight; where SDMA's decoder self-attention drops its mask at
  inference (``--sdma-decoder-mask-at-inference false``, the paper's setting) that
  is the plain softmax attention.

Usage::

    python scripts/attention_redundancy.py --path CKPT DATA_BIN --subset test \
        [--max-sentences N] [--batch-size B] [--json OUT.json] [--user-dir user_dir] \
        [--hr-matrix] [--heatmap OUT.png [--heatmap-kind encoder_self|decoder_self|decoder_cross|all]]

``--hr-matrix`` adds each type's head-pair HR matrix (``HR_matrix``, ``[N n_h, N n_h]``)
to the JSON; ``--heatmap`` also draws it (Figs. 10-11; implies ``--hr-matrix``).
``scripts/plot_head_redundancy.py`` draws the matrices of several JSON files side
by side (V-T vs SDMA-T, as in the paper's figures).

Python::

    from attention_redundancy import attention_redundancy, layer_redundancy, head_redundancy
    result = attention_redundancy("ckpt.pt", subset="test", data="data-bin")
    result = attention_redundancy(models, task, "test", max_sentences=100)
    result["encoder_self"]["LR"]       # [0, 1], the paper's scale (None for one head)
    result["encoder_self"]["LR_bits"]  # the printed formula, [0, log2 n_h]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import inspect
import json
import math
import os
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
ATTENTION_TYPES = ("encoder_self", "decoder_self", "decoder_cross")
_LN2 = math.log(2.0)
# largest number of floats in one temporary of the pairwise (HR) computation
_PAIR_CHUNK_ELEMENTS = 1 << 23


class RedundancyError(ValueError):
    """A model, data set or argument this script cannot evaluate (message says why)."""


# ----------------------------------------------------------------------------
# Pure functions (torch, vectorised)
# ----------------------------------------------------------------------------


def entropy_bits(p: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy in bits along ``dim`` (0 log 0 = 0)."""
    return -torch.xlogy(p, p).sum(dim) / _LN2


def js_divergence(p: Tensor, q: Tensor, dim: int = -1) -> Tensor:
    """Jensen-Shannon divergence JS(p, q) in bits along ``dim`` (broadcasts).

    ``H((p + q) / 2) - (H(p) + H(q)) / 2``; equals
    ``scipy.spatial.distance.jensenshannon(p, q, base=2) ** 2``. In [0, 1].
    """
    p, q = torch.broadcast_tensors(_as_float(p), _as_float(q))
    js = entropy_bits(0.5 * (p + q), dim) - 0.5 * (entropy_bits(p, dim) + entropy_bits(q, dim))
    return js.clamp_min(0.0)


def generalized_js_divergence(dists: Tensor, member_dim: int = 0, dim: int = -1) -> Tensor:
    """Equal-weight JS divergence of the distributions stacked along ``member_dim``, in bits.

    ``JS(P_1..P_n) = H(mean_k P_k) - mean_k H(P_k)`` (distributions along ``dim``);
    in [0, log2 n]. Both dims are removed from the result.
    """
    dists = _as_float(dists)
    member_dim %= dists.dim()
    dim %= dists.dim()
    mean_entropy = entropy_bits(dists, dim).mean(member_dim if member_dim < dim else member_dim - 1)
    mixture = dists.mean(member_dim)
    js = entropy_bits(mixture, dim - 1 if member_dim < dim else dim) - mean_entropy
    return js.clamp_min(0.0)


def _as_float(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _prepare(attn: Tensor, query_mask: Optional[Tensor], key_mask: Optional[Tensor]):
    """Normalise layouts: ``[N, n_h, T, S]`` or ``[N, n_h, B, T, S]`` -> 5-D, masks ``[B, T]``, ``[B, S]``.

    Padding keys are dropped (zeroed) and every row renormalised over the real keys.
    Returns ``(attn [N, n_h, B, T, S], query_mask [B, T] bool, single_sentence)``.
    """
    if attn.dim() not in (4, 5):
        raise RedundancyError(
            f"attention must be [layers, heads, T, S] or [layers, heads, batch, T, S], got shape {tuple(attn.shape)}"
        )
    single = attn.dim() == 4
    attn = _as_float(attn)
    if single:
        attn = attn.unsqueeze(2)
        query_mask = None if query_mask is None else query_mask.reshape(1, -1)
        key_mask = None if key_mask is None else key_mask.reshape(1, -1)
    N, H, B, T, S = attn.shape
    if query_mask is None:
        query_mask = torch.ones(B, T, dtype=torch.bool, device=attn.device)
    query_mask = query_mask.to(device=attn.device, dtype=torch.bool)
    if tuple(query_mask.shape) != (B, T):
        raise RedundancyError(f"query mask has shape {tuple(query_mask.shape)}, expected {(B, T)}")
    if key_mask is not None:
        key_mask = key_mask.to(device=attn.device, dtype=torch.bool)
        if tuple(key_mask.shape) != (B, S):
            raise RedundancyError(f"key mask has shape {tuple(key_mask.shape)}, expected {(B, S)}")
        attn = attn * key_mask[None, None, :, None, :].to(attn.dtype)
    attn = attn / attn.sum(-1, keepdim=True).clamp_min(1e-30)
    return attn, query_mask, single


def lr_divisor(n_heads: int) -> float:
    """log2 n_h, which takes LR from bits to the paper's [0, 1] scale.

    Raises :class:`RedundancyError` for ``n_heads < 2``: with one head log2 n_h = 0 and
    the normalised LR is undefined (``LR_bits`` is 0, see :func:`layer_redundancy_bits`).
    """
    if n_heads < 2:
        raise RedundancyError(
            f"LR on the paper's [0, 1] scale, (log2 n_h - JS) / log2 n_h, is undefined for n_h = {n_heads} "
            "head(s) (log2 1 = 0); LR_bits (= 0 for one head) and HR are defined"
        )
    return math.log2(n_heads)


def layer_redundancy_bits(attn: Tensor, query_mask: Optional[Tensor] = None,
                          key_mask: Optional[Tensor] = None) -> Tensor:
    """LR as printed in the paper, in bits: ``log2 n_h - JS`` averaged over rows, then layers.

    Args:
        attn: attention rows, ``[N, n_h, T, S]`` (one sentence) or ``[N, n_h, B, T, S]``
            (a batch); ``N`` layers, ``n_h`` heads, ``T`` queries, ``S`` keys.
        query_mask: ``[T]`` / ``[B, T]`` bool, True = real query position (default: all).
        key_mask: ``[S]`` / ``[B, S]`` bool, True = real key (default: all).
    Returns:
        a scalar tensor (one sentence) or ``[B]`` (per sentence); in [0, log2 n_h]
        (0 for a single head).
    """
    attn, query_mask, single = _prepare(attn, query_mask, key_mask)
    n_h = attn.size(1)
    js = generalized_js_divergence(attn, member_dim=1, dim=-1)  # [N, B, T]
    qm = query_mask.to(js.dtype)
    per_layer = (js * qm).sum(-1) / qm.sum(-1).clamp_min(1.0)  # [N, B]
    lr = math.log2(n_h) - per_layer.mean(0)  # [B]
    return lr[0] if single else lr


def layer_redundancy(attn: Tensor, query_mask: Optional[Tensor] = None,
                     key_mask: Optional[Tensor] = None) -> Tensor:
    """LR on the paper's [0, 1] scale: :func:`layer_redundancy_bits` divided by log2 n_h.

    The authors' ``utils.py`` value, ``(log2 n_h - JS) / log2 n_h`` averaged over rows and
    layers: 1 when the heads of every layer attend identically, 0 when their rows have
    disjoint supports.  Same arguments and shapes as :func:`layer_redundancy_bits`
    (``attn`` is ``[N, n_h, T, S]`` or ``[N, n_h, B, T, S]``; returns a scalar or ``[B]``).
    Raises :class:`RedundancyError` for ``n_h = 1`` (undefined, see :func:`lr_divisor`).
    """
    divisor = lr_divisor(attn.size(1)) if attn.dim() in (4, 5) else None  # n_h = 1 fails before any work
    return layer_redundancy_bits(attn, query_mask, key_mask) / divisor  # (bad shapes raise in there)


def head_redundancy(attn: Tensor, query_mask: Optional[Tensor] = None, key_mask: Optional[Tensor] = None,
                    return_matrix: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """HR of one attention type: mean over all (N n_h)^2 ordered head pairs of mean_i (1 - JS).

    Same arguments as :func:`layer_redundancy_bits`. The pairwise JS of every row is a
    batched computation over the K (K - 1) / 2 unordered pairs of the K = N n_h
    heads (JS is symmetric, identical pairs contribute 1), chunked over rows to
    bound memory.

    Returns:
        HR (scalar or ``[B]``), in [0, 1]; with ``return_matrix`` also the head-by-head
        matrix ``mean_i (1 - JS)``, ``[K, K]`` or ``[B, K, K]`` (index ``n * n_h + h``,
        as in Figs. 10-11 of the paper), whose mean is HR.
    """
    attn, query_mask, single = _prepare(attn, query_mask, key_mask)
    N, n_h, B, T, S = attn.shape
    K = N * n_h
    rows = attn.reshape(K, B, T, S).permute(1, 2, 0, 3)[query_mask]  # [R, K, S] real rows only
    sentence = torch.arange(B, device=attn.device)[:, None].expand(B, T)[query_mask]  # [R]
    counts = query_mask.sum(-1).to(attn.dtype).clamp_min(1.0)  # [B]
    ia, ib = torch.triu_indices(K, K, offset=1, device=attn.device)
    n_pairs = ia.numel()
    js_sum = attn.new_zeros(B, n_pairs)
    if n_pairs:
        entropies = entropy_bits(rows)  # [R, K]
        chunk = max(1, _PAIR_CHUNK_ELEMENTS // max(1, n_pairs * S))
        for start in range(0, rows.size(0), chunk):
            r = rows[start:start + chunk]
            e = entropies[start:start + chunk]
            mixture_entropy = entropy_bits(0.5 * (r[:, ia] + r[:, ib]))  # [r, P]
            js = (mixture_entropy - 0.5 * (e[:, ia] + e[:, ib])).clamp_min(0.0)
            js_sum.index_add_(0, sentence[start:start + chunk], js)
    js_mean = js_sum / counts[:, None]  # [B, P], mean over each sentence's rows
    hr = 1.0 - 2.0 * js_mean.sum(-1) / (K * K)  # the K diagonal pairs have JS = 0
    if not return_matrix:
        return hr[0] if single else hr
    matrix = attn.new_zeros(B, K, K)
    matrix[:, ia, ib] = js_mean
    matrix[:, ib, ia] = js_mean
    matrix = 1.0 - matrix
    return (hr[0], matrix[0]) if single else (hr, matrix)


# ----------------------------------------------------------------------------
# Capturing per-head attention from fairseq models
# ----------------------------------------------------------------------------


def attention_modules(model) -> Dict[str, List[torch.nn.Module]]:
    """The attention modules of an encoder-decoder model, per attention type (layer order)."""
    from fairseq.modules.multihead_attention import MultiheadAttention

    encoder = getattr(model, "encoder", None)
    decoder = getattr(model, "decoder", None)
    if encoder is None or decoder is None or not hasattr(encoder, "layers") or not hasattr(decoder, "layers"):
        raise RedundancyError(
            f"{type(model).__name__} is not a fairseq encoder-decoder model with attention layers "
            "(expected model.encoder.layers[*].self_attn and model.decoder.layers[*].self_attn / "
            ".encoder_attn, as in the transformer / sdma_transformer architectures)"
        )
    if getattr(decoder, "cross_self_attention", False):
        raise RedundancyError("decoders with --cross-self-attention are not supported")
    modules = {
        "encoder_self": [getattr(layer, "self_attn", None) for layer in encoder.layers],
        "decoder_self": [getattr(layer, "self_attn", None) for layer in decoder.layers],
        "decoder_cross": [getattr(layer, "encoder_attn", None) for layer in decoder.layers],
    }
    if all(m is None for m in modules["decoder_cross"]):
        modules["decoder_cross"] = []  # --no-cross-attention
    for kind, mods in modules.items():
        for index, module in enumerate(mods):
            if not isinstance(module, MultiheadAttention):
                raise RedundancyError(
                    f"{kind} attention of layer {index} is {type(module).__name__}, not a fairseq "
                    "MultiheadAttention: cannot read its per-head attention weights"
                )
            if module.bias_k is not None or module.add_zero_attn:
                raise RedundancyError(f"{kind} layer {index}: add_bias_kv / add_zero_attn are not supported")
    if not modules["encoder_self"] or not modules["decoder_self"]:
        raise RedundancyError("the model has no encoder or no decoder layers")
    return modules


def _force_head_weights(module, args, kwargs):
    """forward pre-hook: call with ``need_weights=True, need_head_weights=True``."""
    signature = getattr(module, "_redundancy_signature", None)
    if signature is None:
        signature = inspect.signature(module.forward)
        module._redundancy_signature = signature
    bound = signature.bind(*args, **kwargs)
    bound.arguments["need_weights"] = True
    bound.arguments["need_head_weights"] = True
    return bound.args, bound.kwargs


def _record(store: List[Optional[Tensor]], index: int, kind: str, module, args, output):
    weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
    if weights is None or weights.dim() != 4 or weights.size(0) != module.num_heads:
        shape = None if weights is None else tuple(weights.shape)
        raise RuntimeError(
            f"{kind} layer {index}: expected per-head attention weights [n_h, B, T, S], got {shape}"
        )
    store[index] = weights.detach().float()


@contextlib.contextmanager
def capture_attention(model) -> Iterator[Dict[str, List[Optional[Tensor]]]]:
    """Record every attention type's per-head weights during forward passes of ``model``.

    Yields ``{type: [weights of layer 0, layer 1, ...]}`` with each entry ``[n_h, B, T, S]``,
    overwritten by every forward pass. fairseq's layers call their attentions with
    ``need_weights=False``; forward pre-hooks force ``need_weights=need_head_weights=True``
    and ``skip_embed_dim_check=True`` is set for the duration, so that the vanilla
    ``MultiheadAttention`` takes its explicit path (the ``F.multi_head_attention_forward``
    fast path ignores ``need_head_weights``).
    """
    modules = attention_modules(model)
    store: Dict[str, List[Optional[Tensor]]] = {kind: [None] * len(mods) for kind, mods in modules.items()}
    handles, saved = [], []
    try:
        for kind, mods in modules.items():
            for index, module in enumerate(mods):
                saved.append((module, module.skip_embed_dim_check))
                module.skip_embed_dim_check = True
                handles.append(module.register_forward_pre_hook(_force_head_weights, with_kwargs=True))
                handles.append(module.register_forward_hook(functools.partial(_record, store[kind], index, kind)))
        yield store
    finally:
        for handle in handles:
            handle.remove()
        for module, flag in saved:
            module.skip_embed_dim_check = flag


def masks_for(sample: dict, pad: int) -> Dict[str, Tuple[Tensor, Tensor]]:
    """(query mask, key mask) of each attention type for a collated translation batch."""
    src = sample["net_input"]["src_tokens"].ne(pad)
    tgt = sample["net_input"]["prev_output_tokens"].ne(pad)
    return {"encoder_self": (src, src), "decoder_self": (tgt, tgt), "decoder_cross": (tgt, src)}


# ----------------------------------------------------------------------------
# Accumulation over batches and the result's structure
# ----------------------------------------------------------------------------

LR_SCALE = (
    "LR = mean over layers of (log2 n_h - mean_i JS) / log2 n_h, in [0, 1]: the paper's scale (Tables II-IV, VII; "
    "the authors' utils.py divides the printed formula by log2 n_h); null for n_h = 1 (log2 1 = 0). "
    "LR_bits = mean over layers of (log2 n_h - mean_i JS), the printed formula undivided, in [0, log2 n_h] bits. "
    "JS in bits (log base 2)."
)
HR_SCALE = ("HR = mean over all ordered (layer, head) pairs of the same attention type of mean_i (1 - JS), "
            "JS of two distributions in bits, in [0, 1]; HR_matrix[k1][k2] is that pair's mean_i (1 - JS), "
            "k = layer * heads + head (0-based), and HR is its mean")
PAPER_COMPARISON = ("The paper's published LR / HR (Tables II-IV, VII) were computed from the encoder self-attention: "
                    "the authors' code passed enc_attn in place of all three attention types (encoder self, decoder "
                    "self, cross), so compare them with encoder_self.")
SINGLE_HEAD_NOTE = "LR is undefined for a single head per layer (log2 1 = 0); LR_bits is 0, HR is defined"


def head_labels(layers: int, heads: int) -> List[str]:
    """``["L0H0", "L0H1", ...]``: the row/column labels of an HR matrix (0-based layer, head)."""
    return [f"L{n}H{h}" for n in range(layers) for h in range(heads)]


def redundancy_entry(lr_bits: float, hr: float, layers: int, heads: int,
                     hr_matrix: Optional[Tensor] = None) -> dict:
    """One attention type's result: ``LR`` ([0, 1], None for one head), ``LR_bits``, ``HR``,
    ``layers``, ``heads`` and, given ``hr_matrix`` ``[N n_h, N n_h]``, ``HR_matrix`` (nested
    lists) with its ``HR_matrix_labels``."""
    entry = {"LR": None if heads < 2 else lr_bits / lr_divisor(heads), "LR_bits": lr_bits, "HR": hr,
             "layers": layers, "heads": heads}
    if heads < 2:
        entry["LR_note"] = SINGLE_HEAD_NOTE
    if hr_matrix is not None:
        entry["HR_matrix"] = hr_matrix.tolist()
        entry["HR_matrix_labels"] = head_labels(layers, heads)
    return entry


class RedundancyAccumulator:
    """Sums of per-sentence LR (bits) and HR of each attention type over batches.

    ``add`` one attention type of one batch at a time; ``result`` averages over the
    sentences with equal weight and builds the result dictionary.
    """

    def __init__(self, return_matrices: bool = False):
        self.return_matrices = return_matrices
        self.sums = {kind: {"LR_bits": 0.0, "HR": 0.0} for kind in ATTENTION_TYPES}
        self.counts = dict.fromkeys(ATTENTION_TYPES, 0)
        self.shapes: Dict[str, Tuple[int, int]] = {}
        self.matrices: Dict[str, Tensor] = {}

    def add(self, kind: str, attn: Tensor, query_mask: Tensor, key_mask: Tensor) -> None:
        """Add one batch of one type: ``attn`` ``[N, n_h, B, T, S]``, ``query_mask`` ``[B, T]``,
        ``key_mask`` ``[B, S]`` (bool, True = real position)."""
        if kind not in self.sums:
            raise RedundancyError(f"unknown attention type {kind!r}; expected one of {', '.join(ATTENTION_TYPES)}")
        if attn.dim() != 5:
            raise RedundancyError(f"{kind}: expected attention [N, n_h, B, T, S], got shape {tuple(attn.shape)}")
        expected = (query_mask.size(0), query_mask.size(1), key_mask.size(1))
        if tuple(attn.shape[2:]) != expected:
            raise RedundancyError(f"{kind}: attention of shape {tuple(attn.shape[2:])} [B, T, S] does not match "
                                  f"the batch {expected}")
        shape = (attn.size(0), attn.size(1))
        if self.shapes.setdefault(kind, shape) != shape:
            raise RedundancyError(f"{kind}: {shape} [layers, heads] differs from an earlier batch's {self.shapes[kind]}")
        self.sums[kind]["LR_bits"] += layer_redundancy_bits(attn, query_mask, key_mask).sum().item()
        if self.return_matrices:
            hr, matrix = head_redundancy(attn, query_mask, key_mask, return_matrix=True)
            total = matrix.sum(0)
            self.matrices[kind] = total + self.matrices[kind] if kind in self.matrices else total
        else:
            hr = head_redundancy(attn, query_mask, key_mask)
        self.sums[kind]["HR"] += hr.sum().item()
        self.counts[kind] += attn.size(2)

    def result(self) -> dict:
        """``{type: entry or None (type absent), "sentences": n, "LR_scale", "HR_scale",
        "compare_with_paper", "notes"}``; entries as :func:`redundancy_entry`, averaged over sentences."""
        present = [kind for kind in ATTENTION_TYPES if self.counts[kind]]
        if not present:
            raise RedundancyError("no attention was measured")
        result: dict = {}
        for kind in ATTENTION_TYPES:
            n = self.counts[kind]
            if not n:
                result[kind] = None
                continue
            matrix = self.matrices[kind] / n if self.return_matrices else None
            result[kind] = redundancy_entry(self.sums[kind]["LR_bits"] / n, self.sums[kind]["HR"] / n,
                                            *self.shapes[kind], hr_matrix=matrix)
        result["sentences"] = self.counts[present[0]]
        result.update(LR_scale=LR_SCALE, HR_scale=HR_SCALE, compare_with_paper="encoder_self",
                      notes=PAPER_COMPARISON)
        return result


# ----------------------------------------------------------------------------
# Loading and the corpus-level measurement
# ----------------------------------------------------------------------------


def import_user_dir(user_dir: Optional[str] = None) -> None:
    """Register this repository's ``user_dir`` (SDMA, safe-load globals) or another one."""
    if user_dir is not None:
        from argparse import Namespace

        from fairseq import utils

        if not os.path.isdir(user_dir):
            raise FileNotFoundError(f"--user-dir {user_dir}: no such directory")
        utils.import_user_module(Namespace(user_dir=user_dir))
        if os.path.realpath(user_dir) == os.path.realpath(REPO / "user_dir"):
            return
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import user_dir as _  # noqa: F401  (registers sdma_transformer and the safe-load globals)


def load_models(path: Union[str, os.PathLike], data: str, user_dir: Optional[str] = None):
    """``(models, cfg, task)`` of a checkpoint, with the data directory overridden."""
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    data_dir = data.split(os.pathsep)[0]
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"data directory not found: {data_dir}")
    import_user_dir(user_dir)
    from fairseq import checkpoint_utils

    return checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": data})


def check_subset(task, subset: str) -> None:
    """Raise a FileNotFoundError naming the expected file when ``subset`` is not binarised."""
    cfg = task.cfg
    src, tgt = getattr(cfg, "source_lang", None), getattr(cfg, "target_lang", None)
    if src is None or tgt is None:
        raise RedundancyError(
            f"task {type(task).__name__} has no source/target language: a translation task is required"
        )
    data_dir = str(cfg.data).split(os.pathsep)[0]
    candidates = [os.path.join(data_dir, f"{subset}.{a}-{b}.{src}") for a, b in ((src, tgt), (tgt, src))]
    for prefix in candidates:
        if os.path.exists(prefix + ".bin") or os.path.exists(prefix):  # binary / raw text
            return
    available = sorted(
        os.path.basename(f).split(".")[0] for f in glob.glob(os.path.join(data_dir, f"*.{src}-{tgt}.{src}.bin"))
    )
    raise FileNotFoundError(
        f"subset '{subset}' not found in {data_dir}: expected {os.path.basename(candidates[0])}.bin "
        f"(and .idx); available subsets: {', '.join(available) or 'none'}"
    )


def _batches(dataset, indices: Sequence[int], batch_size: int) -> Iterator[List[int]]:
    order = sorted(indices, key=lambda i: (int(dataset.src_sizes[i]),
                                            int(dataset.tgt_sizes[i]) if dataset.tgt_sizes is not None else 0, i))
    for start in range(0, len(order), batch_size):
        yield order[start:start + batch_size]


def attention_redundancy(
    models_or_path,
    task=None,
    subset: str = "test",
    max_sentences: Optional[int] = None,
    *,
    data: Optional[str] = None,
    batch_size: int = 32,
    device: Optional[Union[str, torch.device]] = None,
    user_dir: Optional[str] = None,
    return_matrices: bool = False,
) -> dict:
    """LR and HR of each attention type on (the first ``max_sentences`` sentences of) a split.

    Args:
        models_or_path: a checkpoint path, a fairseq model, or a list of models (the
            first one is evaluated).
        task: the fairseq translation task (loaded from the checkpoint when a path is
            given and ``task`` is None).
        subset: split name in the data directory (``test``, ``valid``, ...).
        max_sentences: evaluate sentences 0 .. max_sentences-1 of the split (all by default).
        data: the data directory (binarized DATA_BIN); required with a path and no task.
        batch_size: sentences per forward pass (results do not depend on it).
        device: default cuda when available, else cpu.
        return_matrices: also return each type's ``HR_matrix`` (``[N n_h, N n_h]`` nested
            lists, averaged over sentences, whose mean is HR; Figs. 10-11) and its
            ``HR_matrix_labels`` (``"L<layer>H<head>"``, 0-based).
    Returns:
        ``{"encoder_self": {"LR", "LR_bits", "HR", "layers", "heads"}, "decoder_self": {..},
        "decoder_cross": {..}, "sentences": n, "LR_scale", "HR_scale", "compare_with_paper",
        "notes"}``: LR on the paper's [0, 1] scale (None, with an ``LR_note``, for one head),
        LR_bits the printed formula in bits (see :class:`RedundancyAccumulator`); a type the
        model lacks, e.g. without cross-attention, maps to None.
    """
    if isinstance(models_or_path, (str, os.PathLike)):
        if data is None and task is None:
            raise RedundancyError("give the data directory (data=...) or a task to evaluate a checkpoint path")
        models, _cfg, loaded_task = load_models(models_or_path, data if data is not None else task.cfg.data, user_dir)
        task = task if task is not None else loaded_task
    else:
        models = models_or_path if isinstance(models_or_path, (list, tuple)) else [models_or_path]
        if task is None:
            raise RedundancyError("a fairseq task is required when models are passed")
    if not models:
        raise RedundancyError("no model given")
    model = models[0]
    attention_modules(model)  # fail early with a clear message
    if batch_size < 1:
        raise RedundancyError(f"batch_size={batch_size} must be >= 1")

    check_subset(task, subset)
    task.load_dataset(subset)
    dataset = task.dataset(subset)
    n = len(dataset) if max_sentences is None else min(int(max_sentences), len(dataset))
    if n < 1:
        raise RedundancyError(f"subset '{subset}' has no sentences to evaluate (max_sentences={max_sentences})")

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    was_training = model.training
    model.eval()
    model.to(device)
    pad = task.source_dictionary.pad()
    if task.target_dictionary.pad() != pad:
        raise RedundancyError("source and target dictionaries use different padding indices")

    accumulator = RedundancyAccumulator(return_matrices)
    try:
        with torch.no_grad(), capture_attention(model) as store:
            for batch in _batches(dataset, range(n), batch_size):
                sample = dataset.collater([dataset[i] for i in batch])
                net_input = {k: v.to(device) if torch.is_tensor(v) else v for k, v in sample["net_input"].items()}
                sample["net_input"] = net_input
                model(**net_input)
                for kind, (query_mask, key_mask) in masks_for(sample, pad).items():
                    layers = store[kind]
                    if not layers:
                        continue
                    if any(w is None for w in layers):
                        raise RuntimeError(f"{kind}: not every layer's attention was called in the forward pass")
                    attn = torch.stack(layers)  # [N, n_h, B, T, S]
                    for i in range(len(layers)):
                        layers[i] = None
                    accumulator.add(kind, attn, query_mask, key_mask)
    finally:
        model.train(was_training)
    return accumulator.result()


def _cell(value: Optional[float], width: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.4f}"


def format_table(result: dict) -> str:
    """The result as a table; LR on the paper's [0, 1] scale and in bits, in labelled columns."""
    lines = [f"{'attention':<15}{'heads':>6}{'LR [0,1]':>10}{'LR bits':>10}{'HR [0,1]':>10}"]
    for kind in ATTENTION_TYPES:
        values = result.get(kind)
        if values is None:
            lines.append(f"{kind:<15}{'-':>6}{'-':>10}{'-':>10}{'-':>10}")
        else:
            lines.append(f"{kind:<15}{values['heads']:>6}{_cell(values['LR'], 10)}"
                         f"{_cell(values['LR_bits'], 10)}{_cell(values['HR'], 10)}")
    lines.append(f"({result['sentences']} sentences; lower = less redundant)")
    lines.append("LR [0,1] = (log2 n_h - mean JS) / log2 n_h, the paper's scale (n/a for 1 head); "
                 "LR bits = log2 n_h - mean JS, in [0, log2 n_h]; HR = mean over head pairs of 1 - JS, in [0, 1]")
    lines.append("The paper's LR/HR (Tables II-IV, VII) are encoder self-attention values (the authors' code "
                 "used it for all three types): compare them with encoder_self.")
    return "\n".join(lines)


def report(result: dict, json_path: Optional[str] = None) -> None:
    """Print the table; write ``result`` as JSON to ``json_path`` when given."""
    print(format_table(result))
    if json_path:
        out = Path(json_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json``, ``--hr-matrix``, ``--heatmap``, ``--heatmap-kind`` (shared with the ESPnet script)."""
    parser.add_argument("--json", default=None, metavar="OUT.json", help="write the results as JSON")
    parser.add_argument("--hr-matrix", action="store_true",
                        help="add each type's head-pair HR matrix (HR_matrix, [layers*heads]^2) to the JSON")
    parser.add_argument("--heatmap", default=None, metavar="OUT.png",
                        help="draw the head-pair HR matrix as a heat map, as in Figs. 10-11 (implies --hr-matrix)")
    parser.add_argument("--heatmap-kind", default="encoder_self", choices=[*ATTENTION_TYPES, "all"],
                        help="attention type(s) of the heat map (default: encoder_self, the paper's figures)")


def write_outputs(result: dict, args: argparse.Namespace, name: str) -> None:
    """Print the table, write ``--json`` and draw ``--heatmap`` (``name`` titles the panels)."""
    report(result, args.json)
    if args.heatmap:
        import plot_head_redundancy

        kinds = [k for k in ATTENTION_TYPES if result[k] is not None] if args.heatmap_kind == "all" \
            else [args.heatmap_kind]
        plot_head_redundancy.plot_results([(name, result)], kinds, args.heatmap)
        print(f"wrote {args.heatmap}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Layer / head redundancy (LR, HR) of the encoder self-, decoder self- and "
                    "encoder-decoder attention of a fairseq translation checkpoint (SDMA paper, Sec. IV-A2).",
    )
    parser.add_argument("data", metavar="DATA_BIN", help="fairseq-preprocess'ed data directory")
    parser.add_argument("--path", required=True, help="checkpoint (.pt)")
    parser.add_argument("--subset", default="test", help="split to evaluate (default: test)")
    parser.add_argument("--max-sentences", type=int, default=None, help="evaluate only the first N sentences")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per forward pass (default: 32)")
    parser.add_argument("--user-dir", default=None, help="fairseq --user-dir (this repo's user_dir is always imported)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    add_output_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    prog = os.path.basename(sys.argv[0]) or "attention_redundancy.py"
    try:
        result = attention_redundancy(
            args.path, None, args.subset, args.max_sentences, data=args.data, batch_size=args.batch_size,
            device="cpu" if args.cpu else None, user_dir=args.user_dir,
            return_matrices=args.hr_matrix or bool(args.heatmap),
        )
        write_outputs(result, args, str(Path(Path(args.path).parent.name, Path(args.path).name)))
    except (FileNotFoundError, RedundancyError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
