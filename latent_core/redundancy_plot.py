"""Figs. 10-11 of the SDMA paper: heat maps of the head-pair head redundancy (HR) matrix.

Chien & Huang, "Latent Semantic and Disentangled Attention", TPAMI 2024
(Chien & Huang, TPAMI 2024, doi:10.1109/TPAMI.2024.3432631, Sec. IV-B3, Figs. 10-11: "head redundancy in encoder of
(a) transformer and (b) SDMA transformer" over all 6 x 4 = 24 (or 6 x 8 = 48) heads).
Cell (k1, k2) of a panel is ``mean_i (1 - JS(A^{k1}_{i,:}, A^{k2}_{i,:}))`` of the
heads k = layer * n_h + head of one attention type, averaged over sentences; the
mean of the matrix is that type's HR.  Axis labels are ``L<layer>H<head>``, 0-based.

Reads the JSON of ``sdma-redundancy`` (fairseq, :mod:`user_dir.tools.sdma.redundancy`) or
``sdma-espnet-redundancy`` (:mod:`espnet_plugin.tools.redundancy`) written with ``--hr-matrix``
(or ``--heatmap``); several files are drawn side by side on one shared colour scale,
e.g. V-T next to SDMA-T as in the paper::

    sdma-redundancy --path vanilla.pt DATA_BIN --hr-matrix --json vt.json
    sdma-redundancy --path sdma.pt DATA_BIN --hr-matrix --json sdma.json
    sdma-plot-heads vt.json sdma.json --names V-T SDMA-T --out fig10.png

(``sdma-redundancy --heatmap OUT.png`` draws one model's matrix directly; the command ``sdma-plot-heads`` is
:mod:`user_dir.tools.sdma.plot_heads`.)
Needs only matplotlib and numpy.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq sets the root logger to DEBUG
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from latent_core.redundancy import ATTENTION_TYPES, RedundancyError, head_labels, report  # noqa: E402

Panel = Tuple[str, np.ndarray, List[str]]  # (title, matrix [K, K], K axis labels)


def hr_matrix(result: dict, kind: str, source: str = "result") -> Tuple[np.ndarray, List[str], float]:
    """``(matrix [K, K], labels, HR)`` of attention type ``kind`` of a redundancy result.

    ``K = layers * heads``; raises :class:`RedundancyError` naming ``source`` when the
    result has no such type or was computed without ``--hr-matrix``.
    """
    if kind not in ATTENTION_TYPES:
        raise RedundancyError(f"unknown attention type {kind!r}; expected one of {', '.join(ATTENTION_TYPES)}")
    entry = result.get(kind)
    if entry is None:
        raise RedundancyError(f"{source} has no {kind} attention (the model lacks it)")
    if "HR_matrix" not in entry:
        raise RedundancyError(f"{source} has no HR_matrix for {kind}: compute it with --hr-matrix (or --heatmap)")
    matrix = np.asarray(entry["HR_matrix"], dtype=np.float64)
    labels = entry.get("HR_matrix_labels") or head_labels(entry["layers"], entry["heads"])
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] != len(labels):
        raise RedundancyError(f"{source}: {kind} HR_matrix of shape {matrix.shape} does not match "
                              f"its {len(labels)} head labels")
    return matrix, list(labels), float(entry["HR"])


def draw_heatmaps(panels: Sequence[Panel], out: str, title: Optional[str] = None, dpi: int = 150) -> List[np.ndarray]:
    """Draw ``panels`` side by side on one colour scale (min to max over all panels) into ``out``.

    Returns the matrices as drawn, read back from matplotlib's images (``[K, K]`` each).
    """
    if not panels:
        raise RedundancyError("nothing to draw")
    vmin = min(float(matrix.min()) for _, matrix, _ in panels)
    vmax = max(float(matrix.max()) for _, matrix, _ in panels)
    K = max(len(labels) for _, _, labels in panels)
    side = min(12.0, max(4.0, 0.12 * K + 2.5))  # inches per panel: 24 heads 5.4, 48 heads 8.3
    fontsize = max(4, min(9, int(300 / max(K, 1))))
    fig, axes = plt.subplots(1, len(panels), figsize=(side * len(panels) + 1.2, side + 0.8), squeeze=False,
                             constrained_layout=True)
    image = None
    for (name, matrix, labels), ax in zip(panels, axes[0]):
        image = ax.imshow(matrix, cmap="viridis", vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=fontsize)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("layer / head (0-based)", fontsize=9)
        ax.set_ylabel("layer / head (0-based)", fontsize=9)
    fig.colorbar(image, ax=list(axes[0]), fraction=0.046 / len(panels), pad=0.02,
                 label="mean_i (1 - JS), JS in bits")
    if title:
        fig.suptitle(title, fontsize=11)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    drawn = [np.asarray(ax.images[0].get_array(), dtype=np.float64) for ax in axes[0]]
    plt.close(fig)
    return drawn


def plot_results(named_results: Sequence[Tuple[str, dict]], kinds: Sequence[str], out: str,
                 title: Optional[str] = None, dpi: int = 150) -> List[np.ndarray]:
    """One panel per (result, attention type), results outermost; returns the drawn matrices."""
    panels = []
    for name, result in named_results:
        for kind in kinds:
            matrix, labels, hr = hr_matrix(result, kind, name)
            panels.append((f"{name}: {kind}, HR = {hr:.3f}", matrix, labels))
    if title is None:
        title = "head redundancy: mean_i (1 - JS) of every pair of heads"
    return draw_heatmaps(panels, out, title=title, dpi=dpi)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json``, ``--hr-matrix``, ``--heatmap``, ``--heatmap-kind`` (shared by the fairseq and ESPnet commands)."""
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
        kinds = [k for k in ATTENTION_TYPES if result[k] is not None] if args.heatmap_kind == "all" \
            else [args.heatmap_kind]
        plot_results([(name, result)], kinds, args.heatmap)
        print(f"wrote {args.heatmap}")
