"""Figs. 8/9 of the SDMA paper: t-SNE of the queries q_i^h of each head, coloured by head.

Chien & Huang, "Latent Semantic and Disentangled Attention", TPAMI 2024
(Chien & Huang, TPAMI 2024, doi:10.1109/TPAMI.2024.3432631, Section IV-B2). For one or more fairseq translation
checkpoints (e.g. V-T and SDMA-T) and a binarized split, teacher-forces the first
sentences, captures the queries q = q_proj(x) * scaling of one attention (default:
the last decoder layer's self-attention) at every real (non-padding) position, split
into heads, reduces them to 2-D with scikit-learn's t-SNE (PCA init, fixed seed) and
draws one panel per checkpoint. As a number that a figure cannot give, it prints and
writes to JSON the silhouette score of the head labels in the d_k-dim query space
(and in the t-SNE plane): higher = the heads' queries are more separate.

Usage::

    sdma-plot-tsne DATA_BIN --vanilla-path VT.pt --path SDMA.pt \
        [--subset test] [--attention decoder_self] [--layer -1] [--max-sentences 104] \
        [--max-tokens-total 13312] [--max-points 20000] --out fig8.png [--json fig8.json]

(``python -m user_dir.tools.sdma.plot_query_tsne`` is the same command.)
Library: ``user_dir.tools.sdma.analysis`` (collect_queries, embed_queries, draw_query_tsne).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

from latent_core.errors import command_error
from latent_core.redundancy import RedundancyError
from pipelines.runs import write_json
from user_dir.tools.sdma import analysis
from user_dir.tools.sdma.redundancy import check_subset, load_models

DEFAULT_TSNE_POINTS = 20_000  # Barnes-Hut t-SNE of more points takes minutes on a CPU


def checkpoints(args) -> List[str]:
    paths = ([args.vanilla_path] if args.vanilla_path else []) + (args.path or [])
    if not paths:
        raise analysis.AnalysisError("give at least one checkpoint (--path, --vanilla-path)")
    if args.label and len(args.label) != len(paths):
        raise analysis.AnalysisError(f"{len(args.label)} --label for {len(paths)} checkpoints")
    return paths


def panel_label(model, path: str, label: Optional[str]) -> str:
    if label:
        return label
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return f"{analysis.model_kind(model)}: {os.path.join(parent, os.path.basename(path))}"


def embed_checkpoint(path: str, label: Optional[str], args):
    """(QueryEmbedding, {"layer", "layers", "sentences"}) of one checkpoint."""
    models, _cfg, task = load_models(path, args.data, args.user_dir)
    model = models[0]
    check_subset(task, args.subset)
    dataset = analysis.load_subset(task, args.subset)
    layer, layers, _module = analysis.select_attention(model, args.attention, args.layer)
    indices = analysis.select_sentences(dataset, args.attention, args.max_sentences, args.max_tokens_total)
    device = "cpu" if args.cpu else analysis.default_device()
    model.to(device)
    batches = analysis.subset_batches(dataset, indices, args.batch_size, device)
    queries, _tokens = analysis.collect_queries(model, batches, args.attention, layer)
    max_points = None if args.max_points == 0 else args.max_points
    embedding = analysis.embed_queries(queries, panel_label(model, path, label), max_points, args.seed,
                                       args.perplexity, args.silhouette_sample)
    return embedding, {"layer": layer, "layers": layers, "sentences": len(indices)}


def format_table(rows: List[dict]) -> str:
    lines = [f"{'checkpoint':<40}{'tokens':>8}{'points':>9}{'heads':>6}{'silhouette(q)':>15}{'silhouette(2-D)':>17}"]
    for row in rows:
        lines.append(f"{row['label'][:39]:<40}{row['tokens']:>8}{row['tsne_points']:>9}{row['heads']:>6}"
                     f"{row['silhouette_query_space']:>15.4f}{row['silhouette_tsne']:>17.4f}")
    lines.append("(silhouette of the head labels, in [-1, 1]; higher = heads' queries more separate)")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="t-SNE of the per-head queries of one attention (SDMA paper, Figs. 8/9), one panel per "
                    "checkpoint, with the silhouette score of the head labels.")
    parser.add_argument("data", metavar="DATA_BIN", help="fairseq-preprocess'ed data directory")
    parser.add_argument("--path", action="append", help="checkpoint (.pt); repeat for several panels")
    parser.add_argument("--vanilla-path", default=None, help="vanilla transformer checkpoint (drawn first)")
    parser.add_argument("--label", action="append", help="panel title per checkpoint (same order; default: kind: file)")
    parser.add_argument("--subset", default="test", help="split (default: test)")
    parser.add_argument("--attention", default="decoder_self", choices=analysis.ATTENTION_TYPES,
                        help="attention type (default: decoder_self, as in Fig. 8)")
    parser.add_argument("--layer", type=int, default=-1, help="layer, 0-based, negative from the end (default: -1)")
    parser.add_argument("--max-sentences", type=int, default=None, help="use the first N sentences (default: all)")
    parser.add_argument("--max-tokens-total", type=int, default=None,
                        help="use the first sentences that together have at most N query tokens")
    parser.add_argument("--max-points", type=int, default=DEFAULT_TSNE_POINTS,
                        help=f"t-SNE of a fixed-seed subsample of at most N (token, head) points; 0 = all "
                             f"(default: {DEFAULT_TSNE_POINTS})")
    parser.add_argument("--perplexity", type=float, default=analysis.DEFAULT_TSNE_PERPLEXITY, help="t-SNE perplexity")
    parser.add_argument("--silhouette-sample", type=int, default=analysis.DEFAULT_SILHOUETTE_SAMPLE,
                        help="score the silhouette on a fixed-seed subsample of N points")
    parser.add_argument("--seed", type=int, default=0, help="random_state of t-SNE and the subsamples")
    parser.add_argument("--batch-size", type=int, default=analysis.DEFAULT_BATCH_SIZE)
    parser.add_argument("--out", default="query_tsne.png", help="output PNG (default: query_tsne.png)")
    parser.add_argument("--json", default=None, metavar="OUT.json", help="write the scores as JSON")
    parser.add_argument("--dpi", type=int, default=150)
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    parser.add_argument("--user-dir", default=None, help="fairseq --user-dir (this repo's user_dir is always imported)")
    return parser.parse_args(argv)


def run(args) -> dict:
    paths = checkpoints(args)
    labels = args.label or [None] * len(paths)
    panels, where = [], None
    for path, label in zip(paths, labels):
        embedding, where = embed_checkpoint(path, label, args)
        panels.append(embedding)
    title = (f"queries of {args.attention} layer {where['layer']} (of {where['layers']}, 0-based), "
             f"{args.subset}: {where['sentences']} sentences, {panels[0].tokens} tokens")
    analysis.draw_query_tsne(panels, args.out, title, args.dpi)
    return {
        "subset": args.subset, "attention": args.attention, **where, "seed": args.seed,
        "perplexity": args.perplexity, "png": args.out,
        "checkpoints": [dict(panel.summary(), path=path) for panel, path in zip(panels, paths)],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq sets the root logger to DEBUG
    prog = os.path.basename(sys.argv[0]) or "sdma-plot-tsne"
    try:
        result = run(args)
    except (FileNotFoundError, analysis.AnalysisError, RedundancyError) as error:
        return command_error(prog, error)
    print(format_table(result["checkpoints"]))
    print(f"wrote {args.out}")
    if args.json:
        write_json(args.json, result, announce=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
