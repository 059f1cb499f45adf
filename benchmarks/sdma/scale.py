"""What the paper's base configurations cost per GPU: FLOPs per token and training memory (``sdma-bench --scale``).

For each base row (IWSLT'14 De-En, WMT'14 En-De; Table I) and model (V-T, SDMA-T) one training
batch of ``tokens_per_batch`` target tokens is built on the CPU through fairseq (the registered
architecture, criterion ``sdma_label_smoothed_cross_entropy``) and measured:

* FLOPs of one training update per target token (``torch.utils.flop_counter``, matrix products
  only, as in ``flops.py``);
* parameter memory (fp32 weights) and what Adam training adds (gradients + two moments: 3x);
* activation memory: the bytes of every tensor autograd saves for the backward pass during the
  criterion's forward (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once,
  parameters excluded). This is what ``torch.cuda.max_memory_allocated`` adds to the weights on a
  GPU for that batch, less allocator fragmentation and the transient buffers of single kernels.

The paper gives neither its batch size nor its sentence lengths: ``tokens_per_batch`` defaults
to 4096 (fairseq's IWSLT'14 recipe, ``--max-tokens 4096``, on the authors' single 24 GB GPU),
as ``sentences`` x ``tokens`` (source and target) of the values below.
"""

from dataclasses import dataclass
from typing import Dict, List

import torch

from benchmarks.op_counts import count_flops

from benchmarks.sdma.flops import FlopsSetting, build_with_batch


@dataclass(frozen=True)
class BaseRow:
    arch: str
    src_vocab: int  # dictionary entries (Table I "BPE")
    tgt_vocab: int
    shared: bool  # --share-all-embeddings (one dictionary for both sides)
    sentences: int
    tokens: int  # per sentence, each side, EOS included


BASE_ROWS = {
    "IWSLT'14 De-En base": BaseRow("sdma_transformer_iwslt_de_en", 6000, 8000, False, 160, 26),
    "WMT'14 En-De base": BaseRow("sdma_transformer_wmt_en_de", 44000, 44000, True, 128, 32),
}
MODELS = {"V-T": "none", "SDMA-T": "sdma"}


def saved_activation_bytes(fn, exclude: List[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs (``exclude``: parameters)."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    seen: Dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(seen.values())


def measure_row(name: str, row: BaseRow, model_name: str, reading: str = "authors") -> Dict:
    setting = FlopsSetting(src_vocab=row.src_vocab, tgt_vocab=row.tgt_vocab, sentences=row.sentences,
                           src_tokens=row.tokens, tgt_tokens=row.tokens)
    model, criterion, sample = build_with_batch(row.arch, MODELS[model_name], setting,
                                                [*(["--share-all-embeddings"] if row.shared else []),
                                                 "--sdma-reading", reading])
    model.train()
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    losses = []
    # one forward: its FLOPs counted and its saved tensors measured together
    forward_flops, _, activations = count_flops(
        lambda: saved_activation_bytes(lambda: losses.append(criterion(model, sample)[0]), params))
    backward_flops = count_flops(losses[0].backward)[0]
    model.zero_grad(set_to_none=True)
    ntokens = sample["ntokens"]
    return {
        "config": name, "model": model_name, "arch": row.arch, "reading": reading,
        "params": n_params, "target_tokens": ntokens, "sentences": row.sentences, "tokens_per_sentence": row.tokens,
        "train_flops_per_target_token": (forward_flops + backward_flops) / ntokens,
        "param_mb": 4 * n_params / 2**20,
        "param_grad_adam_mb": 16 * n_params / 2**20,
        "activation_mb": activations / 2**20,
    }


def scale_table(reading: str = "authors") -> List[Dict]:
    """One row per base configuration and model (see the module docstring), SDMA-T in ``reading``; each row's
    ``activation_ratio`` is its activation memory over V-T's of the same configuration."""
    rows = [measure_row(name, row, model, reading) for name, row in BASE_ROWS.items() for model in MODELS]
    vt = {r["config"]: r["activation_mb"] for r in rows if r["model"] == "V-T"}
    for r in rows:
        r["activation_ratio"] = r["activation_mb"] / vt[r["config"]]
    return rows


def table_rows(rows: List[Dict]) -> List[Dict]:
    return [{
        "config": r["config"], "model": r["model"], "params": f"{r['params'] / 1e6:.1f}M",
        "batch (target tokens)": f"{r['target_tokens']} ({r['sentences']} x {r['tokens_per_sentence']})",
        "train GFLOPs/token": f"{r['train_flops_per_target_token'] / 1e9:.3f}",
        "weights MB": f"{r['param_mb']:.0f}",
        "+grads+Adam MB": f"{r['param_grad_adam_mb']:.0f}",
        "activations MB": f"{r['activation_mb']:.0f}",
        "vs V-T": f"{r['activation_ratio']:.2f}",
    } for r in rows]
