"""FLOPs of V-T, SMA-T and SDMA-T, counted by PyTorch (``torch.utils.flop_counter``).

Nothing here is counted by hand: the models are built through fairseq's own machinery
(``options.parse_args_and_arch`` -> ``tasks.setup_task`` -> ``task.build_model`` /
``task.build_criterion``, i.e. ``ARCH_MODEL_REGISTRY``) and one training step on a fixed
synthetic batch runs under :class:`torch.utils.flop_counter.FlopCounterMode`:

* **training** (``forward``, ``backward``, ``total``, ``per_target_token``): the
  ``sdma_label_smoothed_cross_entropy`` criterion's forward (model forward *and* the
  SDMA regularisers of eq. 20-24) and ``loss.backward()``, in training mode (sampling
  noise, dropout, the semantic mask everywhere). ``per_target_token`` is
  ``total / ntokens`` (fairseq's ``ntokens``: the batch's target tokens, EOS included),
  so the encoder's cost is spread over the target tokens.
* **inference forward** (``inference_forward``, ``inference_forward_per_sentence``): one
  teacher-forced ``model(**net_input)`` in eval mode without gradients, i.e. the model as
  it is used after training (the decoder self-attention's semantic mask is dropped unless
  ``--sdma-decoder-mask-at-inference true``). Per sentence, this is the quantity closest
  to the paper's FLOPs column (Tables II-IV, e.g. IWSLT'14 base 2.2G V-T / 2.3G SDMA-T),
  which reads like one forward pass per sentence; the paper does not give its sentence
  length or tool, so only the ratios are comparable.

``FlopCounterMode`` counts matrix-multiplication-type ops only (``mm``, ``addmm``,
``bmm``, ``baddbmm``, convolutions, fused attention kernels), as ``2 * M * N * K`` per
product; elementwise ops (softmax, exp/log, dropout, the sampling noise, layer norm,
additions) are **not** counted. Attention runs with PyTorch's math SDPA backend while
counting, because ``FlopCounterMode`` has no formula for the CPU flash-attention kernel
and would otherwise miss V-T's attention products.

Synthetic setting (:class:`FlopsSetting`, defaults): dictionaries of the paper's
IWSLT'14 De-En size, 6,000 (source) / 8,000 (target) entries including fairseq's four
special symbols (Table II "6/8K"), separate embeddings as in the IWSLT recipe; a batch of
16 sentences of 25 source and 25 target tokens (EOS included, no padding), random
token ids from a fixed seed. FLOPs do not depend on the token ids or on the number of
updates (the mixing weight g only scales tensors).
"""

import logging
import math
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from benchmarks.op_counts import count_flops

# model name -> --sdma-mode (same architecture, same sizes)
MODELS = {"V-T": "none", "SMA-T": "sma", "SDMA-T": "sdma"}
# configuration -> fairseq architecture (IWSLT'14 De-En rows of Table I)
CONFIGS = {
    "tiny": "sdma_transformer_iwslt_de_en_tiny",
    "small": "sdma_transformer_iwslt_de_en_small",
    "base": "sdma_transformer_iwslt_de_en",
}
COUNTED_OPS = ("matrix products only (mm, addmm, bmm, baddbmm, convolution, fused attention), "
               "2*M*N*K each; elementwise ops (softmax, exp/log, dropout, noise, layer norm) not counted")


class FlopsError(ValueError):
    """An impossible FLOPs-counting setting or an unknown model / configuration name."""


@dataclass(frozen=True)
class FlopsSetting:
    """Synthetic dictionary sizes and the fixed batch the FLOPs are counted on."""

    src_vocab: int = 6000  # dictionary entries incl. fairseq's 4 specials (IWSLT'14 de, Table II)
    tgt_vocab: int = 8000  # (IWSLT'14 en)
    sentences: int = 16
    src_tokens: int = 25  # per sentence, EOS included
    tgt_tokens: int = 25
    seed: int = 0

    def validate(self) -> "FlopsSetting":
        """Raise :class:`FlopsError` naming the first impossible field."""
        for name in ("src_vocab", "tgt_vocab"):
            if getattr(self, name) < 5:
                raise FlopsError(f"{name}={getattr(self, name)}: a dictionary needs the 4 special "
                                 "symbols and at least one word")
        for name in ("sentences", "src_tokens", "tgt_tokens"):
            if getattr(self, name) < 1:
                raise FlopsError(f"{name}={getattr(self, name)} must be >= 1")
        return self


def _write_dictionary(path: Path, size: int) -> None:
    """A fairseq dictionary file whose loaded ``Dictionary`` has exactly ``size`` entries."""
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(size - 4):  # fairseq adds <s>, <pad>, </s>, <unk>
            handle.write(f"w{i} {size - i}\n")


def resolve_arch(config_or_arch: str) -> str:
    """An ``sdma_transformer`` architecture from a configuration name (``tiny``, ``base``...)
    or an architecture name (e.g. ``sdma_transformer_wmt_en_de``)."""
    from fairseq.models import ARCH_MODEL_INV_REGISTRY

    import user_dir  # noqa: F401  (registers the sdma_transformer architectures with fairseq)

    arch = CONFIGS.get(config_or_arch, config_or_arch)
    if arch not in ARCH_MODEL_INV_REGISTRY.get("sdma_transformer", ()):
        raise FlopsError(f"unknown configuration or sdma_transformer architecture {config_or_arch!r} "
                         f"(configurations: {', '.join(CONFIGS)})")
    return arch


def resolve_mode(model_or_mode: str) -> str:
    """``--sdma-mode`` from a model name (``V-T``, ``SMA-T``, ``SDMA-T``) or a mode."""
    mode = MODELS.get(model_or_mode, model_or_mode)
    if mode not in MODELS.values():
        raise FlopsError(f"unknown model {model_or_mode!r}: one of {', '.join(MODELS)} "
                         f"(or --sdma-mode {', '.join(MODELS.values())})")
    return mode


def build_translation_model(arch: str, mode: str, setting: FlopsSetting, data_dir: Path,
                            extra_args: Sequence[str] = ()):
    """(model, criterion, task) built by fairseq from parsed command-line options.

    ``data_dir`` receives the synthetic ``dict.de.txt`` / ``dict.en.txt``. The criterion
    is ``sdma_label_smoothed_cross_entropy`` with label smoothing 0.1, as in the recipes.
    """
    from fairseq import options, tasks

    _write_dictionary(data_dir / "dict.de.txt", setting.src_vocab)
    _write_dictionary(data_dir / "dict.en.txt", setting.tgt_vocab)
    argv = [
        str(data_dir), "--task", "translation", "--source-lang", "de", "--target-lang", "en",
        "--arch", resolve_arch(arch), "--sdma-mode", resolve_mode(mode),
        "--criterion", "sdma_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        *extra_args,
    ]
    with _quiet_fairseq():
        args = options.parse_args_and_arch(options.get_training_parser(), argv)
        task = tasks.setup_task(args)
        torch.manual_seed(setting.seed)
        model = task.build_model(args)
        criterion = task.build_criterion(args)
    return model, criterion, task


@contextmanager
def _quiet_fairseq():
    """fairseq's INFO lines (dictionary sizes...) off while building, restored after."""
    logger = logging.getLogger("fairseq")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def model_dimensions(model) -> Dict[str, int]:
    """Sizes that FLOPs scale with: layers, embedding size, heads, SDMA clusters (0 for V-T)."""
    from latent_core.sdma import SDMACore

    cores = [m for m in model.modules() if isinstance(m, SDMACore)]
    query = [c.query_gmm.num_clusters for c in cores if c.query_gmm is not None]
    return {
        "encoder_layers": len(model.encoder.layers),
        "decoder_layers": len(model.decoder.layers),
        "embed_dim": model.decoder.embed_dim,
        "ffn_dim": model.decoder.layers[0].fc1.out_features,
        "heads": model.decoder.layers[0].self_attn.num_heads,
        "sdma_attention_modules": len(cores),
        "clusters": max((c.feature_gmm.num_clusters for c in cores), default=0),
        "query_clusters": max(query, default=0),
    }


def synthetic_batch(task, setting: FlopsSetting, device="cpu") -> Dict:
    """A fairseq translation sample: random words then EOS on both sides, no padding.

    ``prev_output_tokens`` is the target shifted right with EOS first, as fairseq's
    ``LanguagePairDataset`` collates it.
    """
    gen = torch.Generator().manual_seed(setting.seed)
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    n = setting.sentences

    def sentences(dictionary, length):
        words = torch.randint(dictionary.nspecial, len(dictionary), (n, length - 1), generator=gen)
        return torch.cat([words, torch.full((n, 1), dictionary.eos())], 1)

    src = sentences(src_dict, setting.src_tokens)
    tgt = sentences(tgt_dict, setting.tgt_tokens)
    prev = torch.cat([torch.full((n, 1), tgt_dict.eos()), tgt[:, :-1]], 1)
    return {
        "id": torch.arange(n, device=device),
        "nsentences": n,
        "ntokens": int(tgt.ne(tgt_dict.pad()).sum()),
        "net_input": {
            "src_tokens": src.to(device),
            "src_lengths": src.ne(src_dict.pad()).sum(1).to(device),
            "prev_output_tokens": prev.to(device),
        },
        "target": tgt.to(device),
    }


def build_with_batch(arch: str, mode: str, setting: FlopsSetting, extra_args: Sequence[str] = (),
                     device: str = "cpu"):
    """(model, criterion, sample): :func:`build_translation_model` on synthetic dictionaries in a
    temporary directory, on ``device``, with :func:`synthetic_batch` of ``setting``."""
    with tempfile.TemporaryDirectory(prefix="sdma_flops_") as tmp:
        model, criterion, task = build_translation_model(arch, mode, setting, Path(tmp), extra_args)
    return model.to(device), criterion, synthetic_batch(task, setting, device)


def _merge(*dicts: Dict[str, int]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for d in dicts:
        for key, value in d.items():
            out[key] = out.get(key, 0) + value
    return dict(sorted(out.items()))


def count_training_flops(arch: str, mode: str, setting: Optional[FlopsSetting] = None,
                         extra_args: Sequence[str] = (), device: str = "cpu") -> Dict:
    """FLOPs of one training step and of one inference forward of one model.

    ``arch``: a configuration of :data:`CONFIGS` (``tiny``, ``small``, ``base``) or a
    fairseq architecture; ``mode``: a model of :data:`MODELS` (``V-T``, ``SMA-T``,
    ``SDMA-T``) or an ``--sdma-mode``; ``extra_args``: further fairseq options.

    Returns a dict: ``forward`` / ``backward`` / ``total`` (training step: criterion
    forward incl. the SDMA regularisers, then ``loss.backward()``), ``per_target_token``
    (``total / target_tokens``), ``inference_forward`` and
    ``inference_forward_per_sentence`` (eval mode, no gradients), ``by_op`` (training
    step), ``params``, ``dims`` (:func:`model_dimensions`), ``target_tokens``, ``sentences``,
    ``arch``, ``mode``.
    """
    setting = (setting or FlopsSetting()).validate()
    model, criterion, sample = build_with_batch(arch, mode, setting, extra_args, device)

    model.train()
    forward, fwd_ops, (loss, _, _) = count_flops(lambda: criterion(model, sample))
    backward, bwd_ops, _ = count_flops(loss.backward)
    model.zero_grad(set_to_none=True)

    model.eval()
    with torch.no_grad():
        inference, _, _ = count_flops(lambda: model(**sample["net_input"]))

    total = forward + backward
    ntokens = sample["ntokens"]
    return {
        "arch": resolve_arch(arch),
        "mode": resolve_mode(mode),
        "params": sum(p.numel() for p in model.parameters()),
        "dims": model_dimensions(model),
        "sentences": setting.sentences,
        "target_tokens": ntokens,
        "forward": forward,
        "backward": backward,
        "total": total,
        "per_target_token": total / ntokens,
        "inference_forward": inference,
        "inference_forward_per_sentence": inference / setting.sentences,
        "by_op": _merge(fwd_ops, bwd_ops),
    }


def flops_table(configs: Iterable[str] = ("tiny", "base"), models: Iterable[str] = tuple(MODELS),
                setting: Optional[FlopsSetting] = None, device: str = "cpu") -> Dict:
    """FLOPs of every model at every configuration, with ratios to V-T of the same configuration.

    Returns ``{"setting": ..., "counted": ..., "configs": {config: {model: result}}}``; each
    result is :func:`count_training_flops`'s dict plus ``ratio_to_vt`` (training,
    per target token) and ``inference_ratio_to_vt`` when V-T is among ``models``.
    """
    setting = (setting or FlopsSetting()).validate()
    models = list(models)
    for name in models:
        resolve_mode(name)
    table: Dict[str, Dict[str, Dict]] = {}
    for config in configs:
        results = {name: count_training_flops(config, name, setting, device=device) for name in models}
        vanilla = results.get("V-T")
        for result in results.values():
            if vanilla is not None:
                result["ratio_to_vt"] = result["per_target_token"] / vanilla["per_target_token"]
                result["inference_ratio_to_vt"] = (result["inference_forward_per_sentence"]
                                                   / vanilla["inference_forward_per_sentence"])
        table[config] = results
    return {"setting": asdict(setting), "counted": COUNTED_OPS, "configs": table}


def table_rows(table: Dict) -> List[Dict[str, str]]:
    """Printable rows of :func:`flops_table`'s result (GFLOPs, ratios to V-T), as strings."""
    rows = []
    for config, results in table["configs"].items():
        for name, r in results.items():
            rows.append({
                "config": config,
                "model": name,
                "params": f"{r['params']:,}",
                "train GFLOPs/tgt token (fwd+bwd)": f"{r['per_target_token'] / 1e9:.4f}",
                "ratio to V-T": f"{r.get('ratio_to_vt', math.nan):.4f}",
                "fwd GFLOPs/sentence (eval)": f"{r['inference_forward_per_sentence'] / 1e9:.3f}",
                "fwd ratio to V-T": f"{r.get('inference_ratio_to_vt', math.nan):.4f}",
            })
    return rows


def describe_setting(table: Dict) -> str:
    """One line saying what the FLOPs were counted on."""
    s = table["setting"]
    return (f"synthetic batch of {s['sentences']} sentences x {s['src_tokens']} source / "
            f"{s['tgt_tokens']} target tokens (EOS incl.), dictionaries {s['src_vocab']}/{s['tgt_vocab']}; "
            f"counted: {table['counted']}")
