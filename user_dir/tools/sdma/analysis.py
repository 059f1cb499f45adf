"""Analyses of trained fairseq encoder-decoder checkpoints (SDMA paper, Section IV-B).

Chien & Huang, "Latent Semantic and Disentangled Attention", TPAMI 2024
(Chien & Huang, TPAMI 2024, doi:10.1109/TPAMI.2024.3432631):

* IV-B2, Figs. 8/9: the queries q_i^h = (W_q^h x_i + b_q^h) * scaling of every head of one
  attention (the paper: the last decoder layer's self-attention), reduced to 2-D with
  t-SNE and coloured by head. :func:`collect_queries`, :func:`head_silhouette` (a number
  that says how separate the heads' queries are) and :func:`draw_query_tsne`.
* IV-B1: what the clusters c of the feature GMM theta_z capture. Every real token is
  assigned to its argmax cluster of p(c | z_i^h) (eq. 9, as at inference: no sampling
  noise, z = the attention module's input); :func:`collect_cluster_statistics` and
  :func:`cluster_token_table`.
* Cluster usage of a head: the perplexity exp(H(mean_i p(c | z_i^h))) of its average
  responsibilities over all real tokens, in [1, n_c] (1: every token in one cluster,
  n_c: the clusters are used equally). :func:`cluster_usage` (tensors) and
  :func:`model_cluster_usage` (a model and a split; compare checkpoints with it).

Works on models loaded by fairseq (``checkpoint_utils.load_model_ensemble_and_task``,
which reads checkpoints with torch's safe loader, see ``latent_core/safe_loading.py``);
the vanilla ``transformer`` and ``sdma_transformer`` (whose attention modules are
:class:`~user_dir.sdma.fairseq_attention.SDMAMultiheadAttention`). Shapes follow
fairseq: T time, B batch, n_h heads, d_k head size, C clusters, V vocabulary size,
N real (non-padding) query positions of the analysed sentences (sentence-major order).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from latent_core.sdma import SDMACore
from user_dir.sdma.attention_outputs import (  # noqa: F401 (ATTENTION_TYPES re-exported)
    ATTENTION_TYPES,
    AttentionOutputsError,
    attention_layers,
    attention_outputs,
)
# which side's tokens are the query positions of each attention type
QUERY_SIDE = {"encoder_self": "source", "decoder_self": "target", "decoder_cross": "target"}
DEFAULT_BATCH_SIZE = 32
DEFAULT_SILHOUETTE_SAMPLE = 10_000  # silhouette costs O(n^2): score a fixed-seed subsample
DEFAULT_TSNE_PERPLEXITY = 30.0  # sklearn's default


class AnalysisError(ValueError):
    """A model, data split or argument these analyses cannot handle (the message says why)."""


# ----------------------------------------------------------------------------
# Models: attention modules per type and layer
# ----------------------------------------------------------------------------


def attention_modules(model: nn.Module) -> Dict[str, List[nn.Module]]:
    """The attention modules of a fairseq encoder-decoder model per attention type, in layer order
    (:func:`user_dir.sdma.attention_outputs.attention_layers`)."""
    try:
        return attention_layers(model)
    except AttentionOutputsError as error:
        raise AnalysisError(str(error)) from None


def resolve_index(index: int, size: int, what: str) -> int:
    """``index`` in ``[-size, size)`` as a 0-based index; :class:`AnalysisError` otherwise."""
    if not -size <= index < size:
        raise AnalysisError(f"{what} {index} is out of range: the model has {size} (valid: {-size} .. {size - 1})")
    return index % size


def select_attention(model: nn.Module, attention_type: str, layer: int) -> Tuple[int, int, nn.Module]:
    """``(layer index, number of layers, module)`` of one attention type and layer (negative: from the end)."""
    if attention_type not in ATTENTION_TYPES:
        raise AnalysisError(f"attention type {attention_type!r} is not one of {', '.join(ATTENTION_TYPES)}")
    modules = attention_modules(model).get(attention_type)
    if not modules:
        raise AnalysisError(f"the model has no {attention_type} attention")
    index = resolve_index(layer, len(modules), f"{attention_type} layer")
    return index, len(modules), modules[index]


def sdma_core(module: nn.Module) -> Optional[SDMACore]:
    """The SDMA core (GMMs) of an attention module; None for fairseq's own ``MultiheadAttention``."""
    core = getattr(module, "sdma", None)
    return core if isinstance(core, SDMACore) else None


def model_kind(model: nn.Module) -> str:
    """``"SDMA-T"``, ``"SMA-T"`` (no query GMM) or ``"V-T"`` (no SDMA module)."""
    modes = {core.options.mode for core in model.modules() if isinstance(core, SDMACore)}
    if "sdma" in modes:
        return "SDMA-T"
    return "SMA-T" if modes else "V-T"


def require_sdma(model: nn.Module, name: str = "the model") -> None:
    """Raise :class:`AnalysisError` unless ``model`` has SDMA attention (feature GMMs)."""
    if not any(isinstance(m, SDMACore) for m in model.modules()):
        raise AnalysisError(
            f"{name} is not an SDMA checkpoint: its attentions are plain MultiheadAttention modules "
            "without a GMM (a vanilla transformer or --sdma-mode none); clusters need an "
            "sdma_transformer trained with --sdma-mode sdma or sma"
        )


# ----------------------------------------------------------------------------
# Data: sentences of a split, batches, real query positions
# ----------------------------------------------------------------------------


def load_subset(task, subset: str):
    """The dataset of ``subset`` (``test``, ``valid``, ...) of a fairseq translation task."""
    try:
        task.load_dataset(subset)
    except FileNotFoundError as error:
        raise AnalysisError(f"subset '{subset}' not found in {task.cfg.data}: {error}") from None
    return task.dataset(subset)


def select_sentences(dataset, attention_type: str, max_sentences: Optional[int] = None,
                     max_tokens_total: Optional[int] = None) -> List[int]:
    """Indices of the first sentences of ``dataset`` (file order).

    At most ``max_sentences`` sentences, and (when given) as many as fit in
    ``max_tokens_total`` real query positions of ``attention_type`` (source tokens for
    the encoder, target-side decoder inputs for the decoder).
    """
    n = len(dataset) if max_sentences is None else min(max_sentences, len(dataset))
    if n < 1:
        raise AnalysisError(f"no sentences to analyse (the split has {len(dataset)}, max_sentences={max_sentences})")
    if max_tokens_total is None:
        return list(range(n))
    sizes = dataset.src_sizes if QUERY_SIDE[attention_type] == "source" else dataset.tgt_sizes
    lengths = np.asarray(sizes[:n], dtype=np.int64)
    fits = int(np.searchsorted(np.cumsum(lengths), max_tokens_total, side="right"))
    if fits < 1:
        raise AnalysisError(
            f"max_tokens_total={max_tokens_total} is smaller than the first sentence ({lengths[0]} tokens)"
        )
    return list(range(fits))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def subset_batches(dataset, indices: Sequence[int], batch_size: int = DEFAULT_BATCH_SIZE,
                   device: Union[str, torch.device] = "cpu") -> Iterator[dict]:
    """Collated batches (``net_input`` on ``device``) of the sentences ``indices``, sorted by length."""
    if batch_size < 1:
        raise AnalysisError(f"batch_size={batch_size} must be >= 1")
    tgt_sizes = dataset.tgt_sizes

    def length(i):
        return int(dataset.src_sizes[i]), int(tgt_sizes[i]) if tgt_sizes is not None else 0, i

    order = sorted(indices, key=length)
    for start in range(0, len(order), batch_size):
        sample = dataset.collater([dataset[i] for i in order[start:start + batch_size]])
        sample["net_input"] = {k: v.to(device) if torch.is_tensor(v) else v for k, v in sample["net_input"].items()}
        yield sample


def query_tokens(net_input: dict, attention_type: str) -> Tensor:
    """Token ids ``[B, T]`` at the query positions of ``attention_type``."""
    return net_input["src_tokens"] if QUERY_SIDE[attention_type] == "source" else net_input["prev_output_tokens"]


def real_positions(per_position: Tensor, valid: Tensor) -> Tensor:
    """``[T, B, ...]`` -> ``[N, ...]``: the entries at real positions, ``valid`` ``[B, T]`` bool."""
    return per_position.transpose(0, 1)[valid]


# ----------------------------------------------------------------------------
# Capturing queries and attention inputs
# ----------------------------------------------------------------------------


@contextlib.contextmanager
def capture_inputs(modules: Dict[Tuple[str, int], nn.Module]) -> Iterator[Dict[Tuple[str, int], Tensor]]:
    """Record the query input x ``[T, B, E]`` of each module (keyed like ``modules``) per forward pass."""
    store: Dict[Tuple[str, int], Tensor] = {}
    handles = []

    def recorder(key):
        def pre_hook(_module, args, kwargs):
            store[key] = (args[0] if args else kwargs["query"]).detach()
        return pre_hook

    try:
        for key, module in modules.items():
            handles.append(module.register_forward_pre_hook(recorder(key), with_kwargs=True))
        yield store
    finally:
        for handle in handles:
            handle.remove()


def collect_queries(model: nn.Module, batches: Iterable[dict], attention_type: str,
                    layer: int) -> Tuple[Tensor, Tensor]:
    """Queries of one attention at all real query positions of teacher-forced ``batches``.

    Returns ``(queries [N, n_h, d_k], token ids [N])`` (float32, CPU). The model runs in
    eval mode (no dropout, no SDMA sampling noise) on the batches' device.
    """
    index, _count, _module = select_attention(model, attention_type, layer)
    pad = _padding_index(model, attention_type)
    queries, tokens = [], []
    with _eval(model), torch.no_grad(), attention_outputs(model, only=[(attention_type, index)]) as outputs:
        for sample in batches:
            net_input = sample["net_input"]
            outputs[attention_type][index] = None
            model(**net_input)
            recorded = outputs[attention_type][index]
            if recorded is None:
                raise RuntimeError(f"{attention_type} layer {index} was not called in the forward pass")
            ids = query_tokens(net_input, attention_type)
            valid = ids.ne(pad)
            queries.append(real_positions(recorded.queries, valid).float().cpu())
            tokens.append(ids[valid].cpu())
    if not queries:
        raise AnalysisError("no batches to analyse")
    return torch.cat(queries), torch.cat(tokens)


def query_dictionary(model: nn.Module, attention_type: str):
    """The dictionary of the query tokens of ``attention_type`` (source or target side)."""
    return (model.encoder if QUERY_SIDE[attention_type] == "source" else model.decoder).dictionary


def _padding_index(model: nn.Module, attention_type: str) -> int:
    return query_dictionary(model, attention_type).pad()


@contextlib.contextmanager
def _eval(model: nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------
# Separation of the heads' queries (Figs. 8/9)
# ----------------------------------------------------------------------------


def head_points(queries: Tensor) -> Tuple[np.ndarray, np.ndarray]:
    """``[N, n_h, d_k]`` -> (points ``[N * n_h, d_k]``, head labels ``[N * n_h]``), token-major."""
    N, H, D = queries.shape
    labels = np.tile(np.arange(H), N)
    return queries.reshape(N * H, D).double().numpy(), labels


def subsample_indices(n: int, max_points: Optional[int], seed: int) -> np.ndarray:
    """Sorted indices of ``max_points`` of ``n`` items drawn without replacement with ``seed``.

    All ``n`` when ``max_points`` is None or >= n.
    """
    if max_points is None or max_points >= n:
        return np.arange(n)
    if max_points < 1:
        raise AnalysisError(f"max_points={max_points} must be >= 1")
    return np.sort(np.random.default_rng(seed).choice(n, size=max_points, replace=False))


def silhouette(points: np.ndarray, labels: np.ndarray, sample_size: Optional[int] = DEFAULT_SILHOUETTE_SAMPLE,
               seed: int = 0) -> float:
    """Mean silhouette coefficient (Euclidean) of ``labels`` on ``points [n, d]``, in [-1, 1].

    Scored on a ``sample_size`` subsample drawn with ``seed`` when there are more points.
    """
    from sklearn.metrics import silhouette_score

    n_labels = len(np.unique(labels))
    if not 2 <= n_labels < len(points):
        raise AnalysisError(f"the silhouette needs 2 <= labels ({n_labels}) < points ({len(points)})")
    if sample_size is not None and sample_size <= n_labels:
        raise AnalysisError(f"silhouette sample size {sample_size} must exceed the number of labels ({n_labels})")
    keep = subsample_indices(len(points), sample_size, seed)
    return float(silhouette_score(points[keep], labels[keep], metric="euclidean"))


def head_silhouette(queries: Tensor, sample_size: Optional[int] = DEFAULT_SILHOUETTE_SAMPLE, seed: int = 0) -> float:
    """Silhouette of the head labels of ``queries [N, n_h, d_k]`` in the d_k-dim query space.

    Near 1: each head's queries form their own compact region (separate heads);
    near 0 or below: the heads' queries overlap.
    """
    points, labels = head_points(queries)
    return silhouette(points, labels, sample_size, seed)


def tsne_2d(points: np.ndarray, seed: int = 0, perplexity: float = DEFAULT_TSNE_PERPLEXITY) -> np.ndarray:
    """``[n, d]`` -> ``[n, 2]`` with scikit-learn's t-SNE (PCA init, fixed ``random_state``).

    The perplexity is lowered to (n - 1) / 3 for small n (sklearn requires it below n).
    """
    from sklearn.manifold import TSNE

    n = len(points)
    if n < 2:
        raise AnalysisError(f"t-SNE needs at least 2 points, got {n}")
    usable = min(perplexity, (n - 1) / 3.0)
    return TSNE(n_components=2, perplexity=usable, init="pca", random_state=seed).fit_transform(points)


@dataclass
class QueryEmbedding:
    """One panel of Figs. 8/9: 2-D t-SNE points of the queries and separation scores."""

    label: str
    xy: np.ndarray  # [n, 2] t-SNE coordinates of the subsampled queries
    heads: np.ndarray  # [n] head index of each point
    num_heads: int
    head_dim: int
    tokens: int  # N real query positions
    silhouette_query_space: float  # head labels in the d_k-dim query space
    silhouette_tsne: float  # head labels in the 2-D t-SNE space

    def summary(self) -> dict:
        return {
            "label": self.label, "heads": self.num_heads, "head_dim": self.head_dim, "tokens": self.tokens,
            "points": self.tokens * self.num_heads, "tsne_points": int(len(self.xy)),
            "silhouette_query_space": self.silhouette_query_space, "silhouette_tsne": self.silhouette_tsne,
        }


def embed_queries(queries: Tensor, label: str, max_points: Optional[int] = None, seed: int = 0,
                  perplexity: float = DEFAULT_TSNE_PERPLEXITY,
                  silhouette_sample: Optional[int] = DEFAULT_SILHOUETTE_SAMPLE) -> QueryEmbedding:
    """t-SNE of (a ``max_points`` subsample of) ``queries [N, n_h, d_k]`` and both silhouettes."""
    N, H, D = queries.shape
    points, labels = head_points(queries)
    keep = subsample_indices(len(points), max_points, seed)
    xy = tsne_2d(points[keep], seed, perplexity)
    return QueryEmbedding(
        label=label, xy=xy, heads=labels[keep], num_heads=H, head_dim=D, tokens=N,
        silhouette_query_space=silhouette(points, labels, silhouette_sample, seed),
        silhouette_tsne=silhouette(xy, labels[keep], silhouette_sample, seed),
    )


def draw_query_tsne(panels: Sequence[QueryEmbedding], out: Union[str, os.PathLike], title: str = "",
                    dpi: int = 150, panel_inches: float = 5.0) -> str:
    """One scatter panel per checkpoint, points coloured by head, written to a PNG (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(panel_inches * len(panels), panel_inches + 0.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for letter, panel, ax in zip("abcdefghijklmnopqrstuvwxyz", panels, axes):
        cmap = _head_colours(panel.num_heads)
        for head in range(panel.num_heads):
            xy = panel.xy[panel.heads == head]
            ax.scatter(xy[:, 0], xy[:, 1], s=3, alpha=0.6, color=cmap(head), label=f"head {head}", linewidths=0)
        ax.set_title(f"({letter}) {panel.label}\nsilhouette: query space {panel.silhouette_query_space:.3f}, "
                     f"t-SNE {panel.silhouette_tsne:.3f}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.legend(markerscale=4, fontsize=7, loc="best", frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return str(out)


def _head_colours(num_heads: int):
    from matplotlib import colormaps

    return colormaps["tab10" if num_heads <= 10 else "tab20"]


# ----------------------------------------------------------------------------
# Clusters of the feature GMM (eq. 9) and their usage
# ----------------------------------------------------------------------------


def inference_responsibilities(core: SDMACore, x: Tensor) -> Tensor:
    """p(c | z_i^h) of eq. (9) as at inference (no sampling noise: z = x), ``[T, B, E]`` -> ``[T, B, n_h, C]``."""
    _log_joint, log_resp = core.cluster(x, scale=core.clustering_scale)
    return log_resp.exp()


def usage_perplexity(mean_resp: Tensor) -> Tensor:
    """exp(H(p)) of distributions over clusters ``[..., C]`` -> ``[...]``, in [1, C] (0 log 0 = 0)."""
    p = mean_resp.double()
    return torch.exp(-torch.xlogy(p, p).sum(-1))


def cluster_usage(resp: Tensor, valid: Optional[Tensor] = None) -> Tensor:
    """Cluster usage of each head: exp(H(mean_i p(c | z_i^h))) over the real tokens i.

    Args:
        resp: responsibilities ``[..., n_h, C]`` (any leading token dims, e.g. ``[T, B]`` or ``[N]``).
        valid: bool mask of the leading dims (True = real token); default all.
    Returns:
        ``[n_h]`` float64, in [1, C]: 1 when all tokens' responsibilities are one-hot on the
        same cluster, C when the average responsibility is uniform.
    """
    H, C = resp.shape[-2:]
    flat = resp.reshape(-1, H, C).double()
    if valid is not None:
        flat = flat[valid.reshape(-1).to(torch.bool)]
    if flat.size(0) == 0:
        raise AnalysisError("cluster usage of zero tokens")
    return usage_perplexity(flat.mean(0))


@dataclass
class ClusterStatistics:
    """Corpus statistics of the feature clusters of every SDMA attention module.

    ``resp_sums[type][layer]``: sum over real query tokens of p(c | z_i^h), ``[n_h, C]``;
    ``max_sums[type][layer]``: sum over real query tokens of max_c p(c | z_i^h), ``[n_h]``;
    ``tokens[type]``: their number; ``argmax_counts``: for the focus module, the number of
    tokens of each id assigned to each (head, argmax cluster), ``[n_h, C, V]``.
    """

    resp_sums: Dict[str, List[Tensor]] = field(default_factory=dict)
    max_sums: Dict[str, List[Tensor]] = field(default_factory=dict)
    tokens: Dict[str, int] = field(default_factory=dict)
    argmax_counts: Optional[Tensor] = None

    def usage(self) -> Dict[str, Tensor]:
        """Cluster usage perplexity per attention type, ``[layers, n_h]`` (see :func:`cluster_usage`)."""
        return {kind: usage_perplexity(torch.stack(sums) / max(self.tokens[kind], 1))
                for kind, sums in self.resp_sums.items()}

    def hardness(self) -> Dict[str, Tensor]:
        """Mean max_c p(c | z) per attention type and layer (over real tokens and heads), ``[layers]``: 1/C for
        clusters that do not separate tokens, 1 for hard assignments."""
        return {kind: torch.stack(sums).mean(-1) / max(self.tokens[kind], 1) for kind, sums in self.max_sums.items()}


def sdma_modules(model: nn.Module) -> Dict[Tuple[str, int], nn.Module]:
    """``{(attention type, layer): module}`` of the attention modules that have an SDMA core."""
    return {(kind, index): module
            for kind, modules in attention_modules(model).items()
            for index, module in enumerate(modules) if sdma_core(module) is not None}


def collect_cluster_statistics(model: nn.Module, batches: Iterable[dict],
                               focus: Optional[Tuple[str, int]] = None) -> ClusterStatistics:
    """One teacher-forced pass over ``batches``: usage sums of every SDMA module and, for the
    ``focus`` module ``(attention type, layer)`` (layer may be negative), argmax-cluster token counts.

    Responsibilities are eq. (9) on each module's query input (:func:`inference_responsibilities`);
    the forward passes run in eval mode.
    """
    require_sdma(model)
    modules = sdma_modules(model)
    if focus is not None:
        index, _count, module = select_attention(model, *focus)
        if sdma_core(module) is None:
            raise AnalysisError(f"{focus[0]} layer {index} is a plain MultiheadAttention without a GMM")
        focus = (focus[0], index)
    layers = {kind: len(mods) for kind, mods in attention_modules(model).items()}
    stats = ClusterStatistics(resp_sums={kind: [None] * layers[kind] for kind, _index in modules},
                              max_sums={kind: [None] * layers[kind] for kind, _index in modules})
    with _eval(model), torch.no_grad(), capture_inputs(modules) as inputs:
        for sample in batches:
            inputs.clear()
            model(**sample["net_input"])
            _accumulate(stats, model, modules, inputs, sample["net_input"], focus)
    if not stats.tokens:
        raise AnalysisError("no batches to analyse")
    return stats


def _accumulate(stats: ClusterStatistics, model, modules, inputs, net_input, focus) -> None:
    valid_by_kind: Dict[str, Tensor] = {}
    for (kind, index), module in modules.items():
        if (kind, index) not in inputs:
            raise RuntimeError(f"{kind} layer {index} was not called in the forward pass")
        ids = query_tokens(net_input, kind)
        if kind not in valid_by_kind:
            valid_by_kind[kind] = ids.ne(_padding_index(model, kind))
            stats.tokens[kind] = stats.tokens.get(kind, 0) + int(valid_by_kind[kind].sum())
        valid = valid_by_kind[kind]
        resp = real_positions(inference_responsibilities(sdma_core(module), inputs[(kind, index)]), valid)
        sums = stats.resp_sums[kind]
        batch_sum = resp.double().sum(0).cpu()  # [n_h, C]
        sums[index] = batch_sum if sums[index] is None else sums[index] + batch_sum
        peak = resp.amax(-1).double().sum(0).cpu()  # [n_h]
        maxima = stats.max_sums[kind]
        maxima[index] = peak if maxima[index] is None else maxima[index] + peak
        if (kind, index) == focus:
            counts = argmax_token_counts(resp, ids[valid], len(query_dictionary(model, kind)))
            stats.argmax_counts = counts if stats.argmax_counts is None else stats.argmax_counts + counts


def argmax_token_counts(resp: Tensor, tokens: Tensor, vocab_size: int) -> Tensor:
    """Tokens per (head, argmax cluster, token id).

    ``resp [N, n_h, C]`` responsibilities and ``tokens [N]`` ids -> counts ``[n_h, C, V]`` (CPU int64).
    """
    _N, H, C = resp.shape
    cluster = resp.argmax(-1)  # [N, n_h]
    head = torch.arange(H, device=resp.device)
    flat = (head[None, :] * C + cluster) * vocab_size + tokens[:, None]
    return torch.bincount(flat.reshape(-1), minlength=H * C * vocab_size).view(H, C, vocab_size).cpu()


def cluster_token_table(argmax_counts: Tensor, dictionary, top: int) -> List[List[dict]]:
    """Per head, per cluster: its share of the tokens and its ``top`` most frequent tokens.

    ``argmax_counts [n_h, C, V]`` (:func:`argmax_token_counts`); ``dictionary`` maps ids to
    symbols. Returns ``[[{"cluster", "count", "share", "top_tokens": [[symbol, count], ...]}] per head]``.
    """
    if top < 1:
        raise AnalysisError(f"top={top} must be >= 1")
    table = []
    for head_counts in argmax_counts:  # [C, V]
        per_cluster = head_counts.sum(-1)
        total = max(int(per_cluster.sum()), 1)
        values, ids = head_counts.topk(min(top, head_counts.size(-1)), dim=-1)
        table.append([
            {"cluster": c, "count": int(per_cluster[c]), "share": int(per_cluster[c]) / total,
             "top_tokens": [[dictionary[int(i)], int(v)] for v, i in zip(values[c], ids[c]) if v > 0]}
            for c in range(head_counts.size(0))
        ])
    return table


def model_cluster_usage(model: nn.Module, task, subset: str = "test", max_sentences: Optional[int] = None,
                        batch_size: int = DEFAULT_BATCH_SIZE,
                        device: Optional[Union[str, torch.device]] = None) -> Dict[str, List[List[float]]]:
    """Cluster usage of every SDMA head on (the first ``max_sentences`` sentences of) a split.

    Returns ``{attention type: [[perplexity of head h] for each layer]}``, each value in
    [1, n_c]; see :func:`cluster_usage`. The model is moved to ``device`` (default: CUDA
    when available).
    """
    require_sdma(model)
    device = default_device() if device is None else torch.device(device)
    model.to(device)
    dataset = load_subset(task, subset)
    indices = select_sentences(dataset, "encoder_self", max_sentences)
    stats = collect_cluster_statistics(model, subset_batches(dataset, indices, batch_size, device))
    return {kind: usage.tolist() for kind, usage in stats.usage().items()}


def num_clusters(model: nn.Module) -> Dict[str, int]:
    """n_c of the feature GMMs per attention type."""
    return {kind: sdma_core(modules[0]).feature_gmm.num_clusters
            for kind, modules in attention_modules(model).items() if sdma_core(modules[0]) is not None}
