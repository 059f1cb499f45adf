"""What the semantic clusters of an SDMA checkpoint capture (SDMA paper, Section IV-B1).

Chien & Huang, "Latent Semantic and Disentangled Attention", TPAMI 2024
(Chien & Huang, TPAMI 2024, doi:10.1109/TPAMI.2024.3432631). Teacher-forces the first sentences of a binarized split
through an ``sdma_transformer`` checkpoint and, for one attention type / layer (and one
or all heads), assigns every real (non-padding) query token to its argmax cluster of
p(c | z_i^h) (eq. 9, as at inference: no sampling noise, z = the attention module's
input). Prints per cluster its share of the tokens and its most frequent tokens (the
dictionary's symbols, e.g. BPE pieces), as in the paper's examples ('es', 'ing', 'ed';
'year', 'time', 'Thursday'). Also prints the cluster usage of every layer/head of every
attention type: the perplexity exp(H(mean_i p(c | z_i^h))) of the average
responsibilities, in [1, n_c] (1 = every token in one cluster).

Query tokens are the source tokens for ``encoder_self`` and the decoder inputs
(``</s> y_1 .. y_{m-1}``, target dictionary) for ``decoder_self`` / ``decoder_cross``.

Usage::

    sdma-cluster-tokens DATA_BIN --path SDMA.pt [--subset test] \
        [--attention encoder_self] [--layer -1] [--head 0] [--top 15] [--max-sentences N] [--json OUT.json]

(``python -m user_dir.tools.sdma.cluster_tokens`` is the same command.)
Library: ``user_dir.tools.sdma.analysis`` (collect_cluster_statistics, cluster_token_table,
cluster_usage, model_cluster_usage).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

from latent_core.errors import command_error
from latent_core.redundancy import RedundancyError
from pipelines.runs import write_json
from user_dir.tools.sdma import analysis
from user_dir.tools.sdma.redundancy import check_subset, load_models

DEFAULT_TOP_TOKENS = 15


def cluster_report(path: str, args) -> dict:
    """The JSON-ready report of one checkpoint (see the module docstring)."""
    if args.top < 1:
        raise analysis.AnalysisError(f"--top {args.top} must be >= 1")
    models, _cfg, task = load_models(path, args.data, args.user_dir)
    model = models[0]
    analysis.require_sdma(model, path)
    check_subset(task, args.subset)
    dataset = analysis.load_subset(task, args.subset)
    layer, layers, module = analysis.select_attention(model, args.attention, args.layer)
    heads = range(module.num_heads)
    if args.head is not None:
        heads = [analysis.resolve_index(args.head, module.num_heads, "--head")]
    indices = analysis.select_sentences(dataset, args.attention, args.max_sentences)
    device = "cpu" if args.cpu else analysis.default_device()
    model.to(device)
    stats = analysis.collect_cluster_statistics(
        model, analysis.subset_batches(dataset, indices, args.batch_size, device), (args.attention, layer))
    usage = stats.usage()
    dictionary = analysis.query_dictionary(model, args.attention)
    table = analysis.cluster_token_table(stats.argmax_counts, dictionary, args.top)
    return {
        "checkpoint": path, "subset": args.subset, "sentences": len(indices), "attention": args.attention,
        "layer": layer, "layers": layers, "num_heads": module.num_heads,
        "num_clusters": analysis.sdma_core(module).feature_gmm.num_clusters,
        "tokens": stats.tokens[args.attention],
        "heads": [{"head": h, "usage_perplexity": float(usage[args.attention][layer, h]), "clusters": table[h]}
                  for h in heads],
        "cluster_usage": {kind: values.tolist() for kind, values in usage.items()},
        "cluster_usage_num_clusters": analysis.num_clusters(model),
        "cluster_usage_tokens": stats.tokens,
    }


def format_clusters(report: dict) -> str:
    lines = []
    for head in report["heads"]:
        lines.append(
            f"{report['attention']} layer {report['layer']} (of {report['layers']}), head {head['head']} "
            f"(of {report['num_heads']}), 0-based: {report['tokens']} tokens of {report['sentences']} sentences "
            f"by argmax p(c|z) (eq. 9); usage perplexity {head['usage_perplexity']:.3f} of {report['num_clusters']}")
        lines.append(f"{'cluster':>7}{'share':>8}{'count':>8}  top tokens (count)")
        for cluster in head["clusters"]:
            tokens = " ".join(f"{symbol} ({count})" for symbol, count in cluster["top_tokens"])
            lines.append(f"{cluster['cluster']:>7}{100 * cluster['share']:>7.1f}%{cluster['count']:>8}  {tokens}")
        lines.append("")
    return "\n".join(lines)


def format_usage(usage: Dict[str, List[List[float]]], num_clusters: Dict[str, int]) -> str:
    heads = max(len(layers[0]) for layers in usage.values())
    lines = ["cluster usage exp(H(mean_i p(c|z_i^h))) per layer and head, in [1, n_c] (1 = one cluster):",
             f"{'attention':<15}{'n_c':>4}{'layer':>6}" + "".join(f"{'h' + str(h):>7}" for h in range(heads))]
    for kind, layers in usage.items():
        for layer, values in enumerate(layers):
            lines.append(f"{kind:<15}{num_clusters[kind]:>4}{layer:>6}" + "".join(f"{v:>7.3f}" for v in values))
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Tokens per semantic cluster (argmax of eq. 9) of one SDMA attention layer/head, and the "
                    "cluster usage perplexity of every layer/head (SDMA paper, Sec. IV-B1).")
    parser.add_argument("data", metavar="DATA_BIN", help="fairseq-preprocess'ed data directory")
    parser.add_argument("--path", required=True, help="sdma_transformer checkpoint (.pt)")
    parser.add_argument("--subset", default="test", help="split (default: test)")
    parser.add_argument("--attention", default="encoder_self", choices=analysis.ATTENTION_TYPES,
                        help="attention type of the token table (default: encoder_self)")
    parser.add_argument("--layer", type=int, default=-1, help="layer, 0-based, negative from the end (default: -1)")
    parser.add_argument("--head", type=int, default=None, help="one head, 0-based (default: all heads)")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP_TOKENS,
                        help=f"most frequent tokens per cluster (default: {DEFAULT_TOP_TOKENS})")
    parser.add_argument("--max-sentences", type=int, default=None, help="use the first N sentences (default: all)")
    parser.add_argument("--batch-size", type=int, default=analysis.DEFAULT_BATCH_SIZE)
    parser.add_argument("--json", default=None, metavar="OUT.json", help="write the report as JSON")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    parser.add_argument("--user-dir", default=None, help="fairseq --user-dir (this repo's user_dir is always imported)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    prog = os.path.basename(sys.argv[0]) or "sdma-cluster-tokens"
    try:
        report = cluster_report(args.path, args)
    except (FileNotFoundError, analysis.AnalysisError, RedundancyError) as error:
        return command_error(prog, error)
    print(format_clusters(report))
    print(format_usage(report["cluster_usage"], report["cluster_usage_num_clusters"]))
    if args.json:
        write_json(args.json, report, announce=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
