"""Layer redundancy (LR) and head redundancy (HR) of a fairseq encoder-decoder model.

Chien & Huang, "Latent Semantic and Disentangled Attention", TPAMI 2024
(Chien & Huang, TPAMI 2024, doi:10.1109/TPAMI.2024.3432631, Section IV-A2 "Evaluation Metrics", Tables II-IV,
Figs. 10-11).  Works for any fairseq encoder-decoder checkpoint whose attentions
are fairseq ``MultiheadAttention`` modules: the vanilla ``transformer`` and
``sdma_transformer`` (whose ``SDMAMultiheadAttention`` returns the mixed
attention A_hat of eq. 11).

This module captures the per-head attention of the model; the metric (its
definitions and how the paper's formulas are read), the result's structure and the
report are :mod:`latent_core.redundancy`, whose names are re-exported here.

* The attention is the one the model uses in a full teacher-forced forward pass
  with ``model.eval()`` (no dropout): for SDMA the mixed A_hat of eq. (11) with the
  checkpoint's mixing weight; where SDMA's decoder self-attention drops its mask at
  inference (``--sdma-decoder-mask-at-inference false``, the paper's setting) that
  is the plain softmax attention.

Usage::

    sdma-redundancy --path CKPT DATA_BIN --subset test \
        [--max-sentences N] [--batch-size B] [--json OUT.json] [--user-dir user_dir] \
        [--hr-matrix] [--heatmap OUT.png [--heatmap-kind encoder_self|decoder_self|decoder_cross|all]]

(``python -m user_dir.tools.sdma.redundancy`` is the same command.)
``--hr-matrix`` adds each type's head-pair HR matrix (``HR_matrix``, ``[N n_h, N n_h]``)
to the JSON; ``--heatmap`` also draws it (Figs. 10-11; implies ``--hr-matrix``).
``sdma-plot-heads`` (:mod:`user_dir.tools.sdma.plot_heads`) draws the matrices of several
JSON files side by side (V-T vs SDMA-T, as in the paper's figures).

Python::

    from user_dir.tools.sdma.redundancy import attention_redundancy, layer_redundancy, head_redundancy
    result = attention_redundancy("ckpt.pt", subset="test", data="data-bin")
    result = attention_redundancy(models, task, "test", max_sentences=100)
    result["encoder_self"]["LR"]       # [0, 1], the paper's scale (None for one head)
    result["encoder_self"]["LR_bits"]  # the printed formula, [0, log2 n_h]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from latent_core.errors import command_error
from latent_core.redundancy import (  # re-exported (__all__): the metric, its result and its report
    ATTENTION_TYPES,
    HR_SCALE,
    LR_SCALE,
    PAPER_COMPARISON,
    SINGLE_HEAD_NOTE,
    RedundancyAccumulator,
    RedundancyError,
    entropy_bits,
    format_table,
    generalized_js_divergence,
    head_labels,
    head_redundancy,
    js_divergence,
    layer_redundancy,
    layer_redundancy_bits,
    lr_divisor,
    redundancy_entry,
    report,
)
from latent_core.redundancy_plot import add_output_arguments, write_outputs
from user_dir.sdma.attention_outputs import AttentionOutputsError, attention_outputs, recordable_layers
from user_dir.tools.sdma import analysis

__all__ = [
    # the fairseq capture and the command
    "head_weight_modules", "masks_for", "import_user_dir", "load_models", "check_subset",
    "attention_redundancy", "parse_args", "main",
    # re-exported from latent_core.redundancy
    "ATTENTION_TYPES", "HR_SCALE", "LR_SCALE", "PAPER_COMPARISON", "SINGLE_HEAD_NOTE", "RedundancyAccumulator",
    "RedundancyError", "add_output_arguments", "entropy_bits", "format_table", "generalized_js_divergence",
    "head_labels", "head_redundancy", "js_divergence", "layer_redundancy", "layer_redundancy_bits", "lr_divisor",
    "redundancy_entry", "report", "write_outputs",
]

# ----------------------------------------------------------------------------
# Capturing per-head attention from fairseq models
# ----------------------------------------------------------------------------


def head_weight_modules(model) -> Dict[str, List[torch.nn.Module]]:
    """The attention modules whose per-head weights :func:`attention_redundancy` reads
    (:func:`user_dir.sdma.attention_outputs.attention_outputs` records them), checked: fairseq
    ``MultiheadAttention`` without add_bias_kv / add_zero_attn, no --cross-self-attention, an encoder and
    a decoder; a type the model does not have is ``[]``."""
    try:
        found = recordable_layers(model)
    except AttentionOutputsError as error:
        raise RedundancyError(str(error)) from None
    modules = {kind: found.get(kind, []) for kind in ATTENTION_TYPES}
    if not modules["encoder_self"] or not modules["decoder_self"]:
        raise RedundancyError("the model has no encoder or no decoder layers")
    return modules


def masks_for(sample: dict, pad: int) -> Dict[str, Tuple[Tensor, Tensor]]:
    """(query mask, key mask) of each attention type for a collated translation batch."""
    src = sample["net_input"]["src_tokens"].ne(pad)
    tgt = sample["net_input"]["prev_output_tokens"].ne(pad)
    return {"encoder_self": (src, src), "decoder_self": (tgt, tgt), "decoder_cross": (tgt, src)}


# ----------------------------------------------------------------------------
# Loading and the corpus-level measurement
# ----------------------------------------------------------------------------


def import_user_dir(user_dir: Optional[str] = None) -> None:
    """Register another fairseq ``--user-dir``; this repository's ``user_dir`` (SDMA, safe-load
    globals) is registered already, since this module is part of it."""
    if user_dir is not None:
        from argparse import Namespace

        from fairseq import utils

        if not os.path.isdir(user_dir):
            raise FileNotFoundError(f"--user-dir {user_dir}: no such directory")
        utils.import_user_module(Namespace(user_dir=user_dir))


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
    head_weight_modules(model)  # fail early with a clear message
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
        with torch.no_grad(), attention_outputs(model) as store:
            for batch in _batches(dataset, range(n), batch_size):
                sample = dataset.collater([dataset[i] for i in batch])
                net_input = {k: v.to(device) if torch.is_tensor(v) else v for k, v in sample["net_input"].items()}
                sample["net_input"] = net_input
                model(**net_input)
                for kind, (query_mask, key_mask) in masks_for(sample, pad).items():
                    layers = store.get(kind)
                    if not layers:
                        continue
                    if any(recorded is None for recorded in layers):
                        raise RuntimeError(f"{kind}: not every layer's attention was called in the forward pass")
                    attn = torch.stack([recorded.weights for recorded in layers])  # [N, n_h, B, T, S]
                    for i in range(len(layers)):
                        layers[i] = None
                    accumulator.add(kind, attn, query_mask, key_mask)
    finally:
        model.train(was_training)
    return accumulator.result()


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
    prog = os.path.basename(sys.argv[0]) or "sdma-redundancy"
    try:
        result = attention_redundancy(
            args.path, None, args.subset, args.max_sentences, data=args.data, batch_size=args.batch_size,
            device="cpu" if args.cpu else None, user_dir=args.user_dir,
            return_matrices=args.hr_matrix or bool(args.heatmap),
        )
        write_outputs(result, args, str(Path(Path(args.path).parent.name, Path(args.path).name)))
    except (FileNotFoundError, RedundancyError) as error:
        return command_error(prog, error)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
