"""Layer redundancy (LR) and head redundancy (HR) of multi-head attention: the metric and its report.

Chien & Huang, "Latent Semantic and Disentangled Attention", TPAMI 2024
(Chien & Huang, TPAMI 2024, doi:10.1109/TPAMI.2024.3432631, Section IV-A2 "Evaluation Metrics", Tables II-IV,
Figs. 10-11).  Plain PyTorch: the toolkit adapters capture the per-head attention
and hand it to :class:`RedundancyAccumulator`; :mod:`user_dir.tools.sdma.redundancy`
(command ``sdma-redundancy``) for fairseq encoder-decoder checkpoints (the vanilla
``transformer`` and ``sdma_transformer``, whose ``SDMAMultiheadAttention`` returns the
mixed attention A_hat of eq. 11), :mod:`espnet_plugin.tools.redundancy` (command
``sdma-espnet-redundancy``) for ESPnet2 ASR models.

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
  used the encoder attention for all three; this module does not.  The
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

``--hr-matrix`` (:func:`latent_core.redundancy_plot.add_output_arguments`) adds each type's head-pair HR matrix
(``HR_matrix``, ``[N n_h, N n_h]``) to the JSON; ``--heatmap`` also draws it (Figs. 10-11;
implies ``--hr-matrix``) with :mod:`latent_core.redundancy_plot`; the command
``sdma-plot-heads`` (:mod:`user_dir.tools.sdma.plot_heads`) draws the matrices of several JSON files side by side (V-T vs SDMA-T,
as in the paper's figures).

Python::

    from latent_core.redundancy import layer_redundancy, head_redundancy
    layer_redundancy(attn, query_mask, key_mask)   # attn [N, n_h, T, S] or [N, n_h, B, T, S]
    head_redundancy(attn, query_mask, key_mask, return_matrix=True)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

ATTENTION_TYPES = ("encoder_self", "decoder_self", "decoder_cross")
_LN2 = math.log(2.0)
# largest number of floats in one temporary of the pairwise (HR) computation
_PAIR_CHUNK_ELEMENTS = 1 << 23


class RedundancyError(ValueError):
    """A model, data set or argument the redundancy tools cannot evaluate (message says why)."""


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


COLLAPSE_PEAK = 0.9


def attention_focus(attn: Tensor, query_mask: Optional[Tensor] = None, key_mask: Optional[Tensor] = None,
                    peak: float = COLLAPSE_PEAK) -> Tuple[Tensor, Tensor, int]:
    """How concentrated each layer's attention rows are (not a measure of the paper; a diagnostic of collapse).

    ``attn`` ``[N, n_h, B, T, S]`` (or ``[N, n_h, T, S]``), masks as :func:`layer_redundancy_bits`; rows over
    the real keys. Returns ``(entropy_sum [N], peaked_sum [N], rows)``: per layer the sum over real query
    rows and heads of the row's entropy in bits and of 1 where the row puts more than ``peak`` of its mass on
    one key, and the number of rows summed per layer (real queries x heads). A causal decoder
    self-attention's first row has one key and counts as peaked.
    """
    attn, query_mask, _single = _prepare(attn, query_mask, key_mask)
    qm = query_mask.to(attn.dtype)  # [B, T]
    entropy = (entropy_bits(attn) * qm).sum((1, 2, 3))  # [N]
    peaked = ((attn.amax(-1) > peak).to(attn.dtype) * qm).sum((1, 2, 3))
    return entropy, peaked, int(query_mask.sum()) * attn.size(1)


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


def _standard_error(total: float, total_sq: float, n: int) -> Optional[float]:
    """std / sqrt(n) of n values from their sum and sum of squares (None for n < 2)."""
    if n < 2:
        return None
    variance = max(total_sq - total * total / n, 0.0) / (n - 1)
    return math.sqrt(variance / n)


class RedundancyAccumulator:
    """Sums of per-sentence LR (bits) and HR of each attention type over batches.

    ``add`` one attention type of one batch at a time; ``result`` averages over the
    sentences with equal weight and builds the result dictionary.
    """

    def __init__(self, return_matrices: bool = False):
        self.return_matrices = return_matrices
        self.sums = {kind: {"LR_bits": 0.0, "HR": 0.0, "LR_bits_sq": 0.0, "HR_sq": 0.0} for kind in ATTENTION_TYPES}
        self.counts = dict.fromkeys(ATTENTION_TYPES, 0)
        self.shapes: Dict[str, Tuple[int, int]] = {}
        self.matrices: Dict[str, Tensor] = {}
        self.focus: Dict[str, List] = {}  # type -> [entropy_sum [N], peaked_sum [N], rows]

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
        lr_bits = layer_redundancy_bits(attn, query_mask, key_mask).double()  # [B]
        self.sums[kind]["LR_bits"] += lr_bits.sum().item()
        self.sums[kind]["LR_bits_sq"] += (lr_bits * lr_bits).sum().item()
        if self.return_matrices:
            hr, matrix = head_redundancy(attn, query_mask, key_mask, return_matrix=True)
            total = matrix.sum(0)
            self.matrices[kind] = total + self.matrices[kind] if kind in self.matrices else total
        else:
            hr = head_redundancy(attn, query_mask, key_mask)
        self.sums[kind]["HR"] += hr.double().sum().item()
        entropy, peaked, rows = attention_focus(attn, query_mask, key_mask)
        if kind in self.focus:
            sums = self.focus[kind]
            self.focus[kind] = [sums[0] + entropy.double(), sums[1] + peaked.double(), sums[2] + rows]
        else:
            self.focus[kind] = [entropy.double(), peaked.double(), rows]
        self.sums[kind]["HR_sq"] += (hr.double() * hr.double()).sum().item()
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
            sums = self.sums[kind]
            entry = redundancy_entry(sums["LR_bits"] / n, sums["HR"] / n, *self.shapes[kind], hr_matrix=matrix)
            lr_bits_se = _standard_error(sums["LR_bits"], sums["LR_bits_sq"], n)
            heads = self.shapes[kind][1]
            entry["LR_se"] = None if heads < 2 or lr_bits_se is None else lr_bits_se / lr_divisor(heads)
            entry["LR_bits_se"] = lr_bits_se
            entry["HR_se"] = _standard_error(sums["HR"], sums["HR_sq"], n)
            entropy, peaked, rows = self.focus[kind]
            entry["entropy_bits_per_layer"] = (entropy / max(rows, 1)).tolist()
            entry["collapsed_share_per_layer"] = (peaked / max(rows, 1)).tolist()
            result[kind] = entry
        result["sentences"] = self.counts[present[0]]
        result["estimator"] = ("LR and HR: per-sentence values (each sentence's real query/key positions), "
                               "averaged over the sentences with equal weight; *_se: their standard deviation "
                               "over sentences / sqrt(sentences) (None for one sentence); "
                               "entropy_bits_per_layer / collapsed_share_per_layer: over every real query row "
                               "and head of a layer, the mean entropy of the row in bits and the share of rows "
                               f"with more than {COLLAPSE_PEAK} of their mass on one key (attention_focus)")
        result.update(LR_scale=LR_SCALE, HR_scale=HR_SCALE, compare_with_paper="encoder_self",
                      notes=PAPER_COMPARISON)
        return result


# ----------------------------------------------------------------------------
# Reporting: table, JSON, heat map
# ----------------------------------------------------------------------------


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
