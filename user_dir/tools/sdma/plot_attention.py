"""Fig. 6 of the SDMA paper for one sentence: clustering probabilities, semantic mask, attention.

Chien & Huang, "Latent Semantic and Disentangled Attention", TPAMI 2024
(Chien & Huang, TPAMI 2024, doi:10.1109/TPAMI.2024.3432631, Fig. 6/7).  For one source sentence of a binarized
split and one encoder layer/head of an ``sdma_transformer`` checkpoint, draws

(a) the clustering probabilities p(c | z_i) of eq. (9) of every source token
    (tokens x clusters), from ``module.sdma.cluster(x)`` on the layer's attention
    input x (captured with a forward pre-hook on the layer's ``self_attn``; in
    eval mode there is no sampling noise, so z = x);
(b) the semantic mask M of eq. (10), ``latent_core.sdma.semantic_mask`` of those
    responsibilities (rows = query tokens i, columns = key tokens j, rows sum to 1);
(c) the plain softmax attention A of eq. (1) of the same SDMA layer/head (the
    module run with its mixing weight temporarily set to 0, so A_hat = A);
(d) with ``--vanilla-path``: the attention A of a vanilla ``transformer`` checkpoint in
    the same layer/head, as in the paper's panel (c);
and with ``--mixed`` also the mixed attention A_hat of eq. (11) that SDMA really uses.

Usage::

    sdma-plot --path CKPT DATA_BIN --subset test --index 0 \
        --layer -1 --head 0 [--vanilla-path CKPT] [--mixed] --out fig6.png

(``python -m user_dir.tools.sdma.plot_attention`` is the same command.)

``--layer`` / ``--head`` are 0-based, negative values count from the end (the
paper's "first head of the sixth encoder layer" is ``--layer 5 --head 0`` or
``--layer -1 --head 0`` for a 6-layer encoder).  Token labels are the source
dictionary's symbols (sentencepiece / BPE pieces as stored).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

import matplotlib

matplotlib.use("Agg")
logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq sets the root logger to DEBUG
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from latent_core.errors import command_error
from latent_core.redundancy import RedundancyError  # noqa: E402
from user_dir.sdma.attention_outputs import AttentionOutputs, attention_outputs  # noqa: E402
from user_dir.tools.sdma.redundancy import check_subset, load_models  # noqa: E402


class PlotError(RedundancyError):
    """A checkpoint / argument the figure cannot be drawn for (message says why)."""


def _resolve(index: int, size: int, what: str) -> int:
    if not -size <= index < size:
        raise PlotError(f"{what} {index} is out of range: the model has {size}")
    return index % size


def encoder_self_attention(model, layer: int):
    encoder = getattr(model, "encoder", None)
    layers = getattr(encoder, "layers", None)
    if layers is None or len(layers) == 0:
        raise PlotError(f"{type(model).__name__} has no encoder layers (an encoder-decoder model is required)")
    index = _resolve(layer, len(layers), "--layer")
    module = getattr(layers[index], "self_attn", None)
    if module is None:
        raise PlotError(f"encoder layer {index} has no self_attn module")
    return index, len(layers), module


def _encoder_outputs(model, sample, layer: int) -> AttentionOutputs:
    """What encoder layer ``layer``'s self-attention computed for ``sample`` (one encoder forward, eval mode)."""
    net = sample["net_input"]
    model.eval()
    with torch.no_grad(), attention_outputs(model, only=[("encoder_self", layer)]) as outputs:
        model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])
    recorded = outputs["encoder_self"][layer]
    if recorded is None:
        raise PlotError(f"encoder layer {layer}'s self-attention was not called by the encoder")
    return recorded


def sentence(task, subset: str, index: int):
    """A one-sentence batch of ``subset`` and its source token labels."""
    check_subset(task, subset)
    task.load_dataset(subset)
    dataset = task.dataset(subset)
    if not 0 <= index < len(dataset):
        raise PlotError(f"--index {index} is out of range: subset '{subset}' has {len(dataset)} sentences")
    sample = dataset.collater([dataset[index]])
    tokens = sample["net_input"]["src_tokens"][0].tolist()
    labels = [task.source_dictionary[t] for t in tokens]
    return sample, labels


def sdma_panels(model, sample, layer: int, head: int, path: str = "checkpoint") -> dict:
    """Responsibilities [T, C], semantic mask M [T, T], plain A [T, T] and mixed A_hat [T, T]."""
    from latent_core.sdma import SDMACore, semantic_mask

    layer, n_layers, module = encoder_self_attention(model, layer)
    core = getattr(module, "sdma", None)
    if not isinstance(core, SDMACore):
        raise PlotError(
            f"{path} is not an SDMA model: encoder layer {layer}'s self-attention is "
            f"{type(module).__name__}; panels (a) and (b) need an sdma_transformer checkpoint "
            "(--sdma-mode sdma or sma)"
        )
    head = _resolve(head, module.num_heads, "--head")
    recorded = _encoder_outputs(model, sample, layer)
    resp = recorded.query_resp[:, 0, head, :]  # [T, C], eq. (9)
    mask = semantic_mask(resp[None], resp[None])[0]  # [T, T]
    return {
        "resp": resp, "mask": mask.float(), "attn": recorded.plain_weights[head, 0],
        "mixed": recorded.weights[head, 0], "layer": layer, "layers": n_layers, "head": head,
        "heads": module.num_heads, "mix_weight": recorded.mix_weight,
    }


def vanilla_attention(model, sample, layer: int, head: int) -> dict:
    """Per-head softmax attention A [T, T] of an encoder layer of any fairseq encoder-decoder model."""
    layer, n_layers, module = encoder_self_attention(model, layer)
    head = _resolve(head, module.num_heads, "--head")
    return {"attn": _encoder_outputs(model, sample, layer).weights[head, 0], "layer": layer, "layers": n_layers,
            "head": head, "heads": module.num_heads}


def _heatmap(ax, fig, matrix, xlabels, ylabels, title, xlabel, ylabel, fontsize):
    image = ax.imshow(matrix.cpu().numpy(), cmap="viridis", vmin=0.0, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(xlabels)))
    ax.set_xticklabels(xlabels, rotation=90, fontsize=fontsize)
    ax.set_yticks(range(len(ylabels)))
    ax.set_yticklabels(ylabels, fontsize=fontsize)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03)


def draw(labels: List[str], sdma: dict, vanilla: Optional[dict], out: str, mixed: bool = False,
         title: Optional[str] = None, dpi: int = 150) -> str:
    T = len(labels)
    C = sdma["resp"].size(1)
    fontsize = max(4, min(9, int(220 / max(T, 1))))
    side = min(16.0, max(3.6, 0.22 * T + 1.6))  # inches per T x T panel
    panels = [("resp", 0.6 * side * max(0.45, min(1.0, C / max(T, 1))) + 1.0)]
    panels += [("mask", side), ("attn", side)]
    if mixed:
        panels.append(("mixed", side))
    if vanilla is not None:
        panels.append(("vanilla", side))
    widths = [w for _, w in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths) + 0.8 * len(panels), side + 1.4),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    where = f"layer {sdma['layer']} (of {sdma['layers']}), head {sdma['head']} (of {sdma['heads']})"
    for letter, (name, _), ax in zip("abcdef", panels, axes[0]):
        if name == "resp":
            _heatmap(ax, fig, sdma["resp"], [str(c) for c in range(C)], labels,
                     f"({letter}) SDMA p(c|z_i), eq. (9)", "cluster c", "token i", fontsize)
        elif name == "mask":
            _heatmap(ax, fig, sdma["mask"], labels, labels,
                     f"({letter}) SDMA semantic mask M, eq. (10)", "token j", "token i", fontsize)
        elif name == "attn":
            _heatmap(ax, fig, sdma["attn"], labels, labels,
                     f"({letter}) SDMA attention A, eq. (1)", "token j", "token i", fontsize)
        elif name == "mixed":
            _heatmap(ax, fig, sdma["mixed"], labels, labels,
                     f"({letter}) SDMA mixed A_hat, eq. (11), g={sdma['mix_weight']:.2f}",
                     "token j", "token i", fontsize)
        else:
            v_where = f"layer {vanilla['layer']}, head {vanilla['head']}"
            _heatmap(ax, fig, vanilla["attn"], labels, labels,
                     f"({letter}) transformer attention A, eq. (1)\n{v_where}", "token j", "token i", fontsize)
    fig.suptitle(title or f"encoder {where}", fontsize=11)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Fig. 6 of the SDMA paper: clustering probabilities (eq. 9), semantic mask (eq. 10) "
                    "and attention (eq. 1) of one encoder layer/head for one source sentence.")
    parser.add_argument("data", metavar="DATA_BIN", help="fairseq-preprocess'ed data directory")
    parser.add_argument("--path", required=True, help="sdma_transformer checkpoint (.pt)")
    parser.add_argument("--subset", default="test", help="split (default: test)")
    parser.add_argument("--index", type=int, default=0, help="sentence index in the split (file order; default 0)")
    parser.add_argument("--layer", type=int, default=-1, help="encoder layer, 0-based, negative from the end (default -1)")
    parser.add_argument("--head", type=int, default=0, help="attention head, 0-based (default 0)")
    parser.add_argument("--vanilla-path", default=None, help="vanilla transformer checkpoint for the extra attention panel")
    parser.add_argument("--mixed", action="store_true", help="also draw SDMA's mixed attention A_hat (eq. 11)")
    parser.add_argument("--out", default="fig6.png", help="output image (default fig6.png)")
    parser.add_argument("--dpi", type=int, default=150)
    parser.add_argument("--user-dir", default=None, help="fairseq --user-dir (this repo's user_dir is always imported)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    prog = os.path.basename(sys.argv[0]) or "sdma-plot"
    try:
        models, _cfg, task = load_models(args.path, args.data, args.user_dir)
        model = models[0].cpu()
        sample, labels = sentence(task, args.subset, args.index)
        sdma = sdma_panels(model, sample, args.layer, args.head, path=args.path)
        vanilla = None
        if args.vanilla_path:
            v_models, _v_cfg, v_task = load_models(args.vanilla_path, args.data, args.user_dir)
            if v_task.source_dictionary.symbols != task.source_dictionary.symbols:
                raise PlotError(f"{args.vanilla_path} and {args.path} use different source dictionaries")
            vanilla = vanilla_attention(v_models[0].cpu(), sample, args.layer, args.head)
        title = (f"{args.subset} sentence {args.index}: encoder layer {sdma['layer']} (of {sdma['layers']}), "
                 f"head {sdma['head']} (of {sdma['heads']}), 0-based")
        draw(labels, sdma, vanilla, args.out, mixed=args.mixed, title=title, dpi=args.dpi)
    except (FileNotFoundError, RedundancyError) as error:
        return command_error(prog, error)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
