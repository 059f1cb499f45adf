"""A whole SDMA-T translation model on fixed weights, a padded batch and fixed noise: the case that
``tests/reference/sdma_model.py`` runs through the authors' fairseq model and criterion
(``DisentangledTransformerModel``, ``disentangled_label_smoothed_cross_entropy``) and
``tests/unit/user_dir/test_sdma_authors_model.py`` through ours (``sdma_transformer``,
``sdma_label_smoothed_cross_entropy``, ``--sdma-reading authors``).

Two encoder and two decoder layers (so that the regularisers' average over layers is tested),
embeddings 8, 2 heads, 3 clusters, no dropout, label smoothing 0.1, the authors' IWSLT'14 loss
weights (their ``--mi_loss_weight 10``: lambda_q 100, lambda_x 10; KL 0.01, diversity 1).
Weights are named as in our model; :func:`authors_name` gives the authors' name of each.
"""

import zlib
from typing import Dict, List, Tuple

import torch

EMBED, HEADS, FFN, LAYERS, CLUSTERS = 8, 2, 16, 2, 3
HEAD_DIM = EMBED // HEADS
WORDS = [f"w{i}" for i in range(6)]  # after fairseq's 4 specials: a vocabulary of 10
NUM_UPDATES = 1000
LABEL_SMOOTHING = 0.1
# eq. (24)'s weights as the authors' IWSLT'14 script sets them (their criterion's 0.01 KL and the
# factor 10 on L_Dqq inside their module included)
LOSS_WEIGHTS = {"kl": 0.01, "diversity": 1.0, "dqq": 100.0, "dxq": 10.0}
TERMS = ("ce", "kl", "diversity", "dqq", "dxq")  # each differentiated alone
NOISE_SEED = 5
BEAM, MAX_LEN = 3, 5  # the decoding case


def our_fairseq_argv(data_dir: str) -> List[str]:
    """``fairseq-train`` arguments that build our model for this case."""
    return [
        data_dir, "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
        "--arch", "sdma_transformer", "--sdma-reading", "authors",
        "--encoder-layers", str(LAYERS), "--decoder-layers", str(LAYERS),
        "--encoder-embed-dim", str(EMBED), "--decoder-embed-dim", str(EMBED),
        "--encoder-ffn-embed-dim", str(FFN), "--decoder-ffn-embed-dim", str(FFN),
        "--encoder-attention-heads", str(HEADS), "--decoder-attention-heads", str(HEADS),
        "--sdma-clusters", str(CLUSTERS), "--sdma-query-clusters", str(CLUSTERS),
        "--sdma-dqq-weight", str(LOSS_WEIGHTS["dqq"]), "--sdma-dxq-weight", str(LOSS_WEIGHTS["dxq"]),
        "--sdma-kl-weight", str(LOSS_WEIGHTS["kl"]), "--sdma-diversity-weight", str(LOSS_WEIGHTS["diversity"]),
        "--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
        "--criterion", "sdma_label_smoothed_cross_entropy", "--label-smoothing", str(LABEL_SMOOTHING),
    ]


def authors_argv() -> List[str]:
    """The authors' model arguments for the same case (their ``disentangled_transformer`` arch)."""
    return [
        "--encoder-embed-dim", str(EMBED), "--decoder-embed-dim", str(EMBED),
        "--encoder-ffn-embed-dim", str(FFN), "--decoder-ffn-embed-dim", str(FFN),
        "--encoder-layers", str(LAYERS), "--decoder-layers", str(LAYERS),
        "--encoder-attention-heads", str(HEADS), "--decoder-attention-heads", str(HEADS),
        "--clusters", str(CLUSTERS), "--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
        "--mi_loss_weight", "10", "--cluster_loss_weight", "1",
    ]


def write_dictionaries(directory) -> None:
    from pathlib import Path

    for lang in ("src", "tgt"):
        (Path(directory) / f"dict.{lang}.txt").write_text("".join(f"{w} {100 - i}\n" for i, w in enumerate(WORDS)))


def batch(pad: int = 1, eos: int = 2) -> Dict[str, torch.Tensor]:
    """Three sentences: sources left-padded and targets right-padded, as fairseq's translation
    task collates them (lengths 6/4/5 and 5/3/4 with </s>)."""
    src = torch.tensor([[4, 5, 6, 7, 8, eos], [pad, pad, 9, 4, 6, eos], [pad, 7, 7, 5, 9, eos]])
    target = torch.tensor([[5, 6, 4, 9, eos], [8, 4, eos, pad, pad], [6, 9, 7, eos, pad]])
    prev = torch.tensor([[eos, 5, 6, 4, 9], [eos, 8, 4, pad, pad], [eos, 6, 9, 7, pad]])
    return {
        "id": torch.arange(3), "nsentences": 3, "ntokens": int(target.ne(pad).sum()),
        "net_input": {"src_tokens": src, "src_lengths": src.ne(pad).sum(1), "prev_output_tokens": prev},
        "target": target,
    }


# our name part -> theirs: their attention wraps a DisentangledAttention as ``.attn`` with its own
# projection names and ``tok_*`` / ``head_*`` mixtures
AUTHORS_PARTS = [
    (".q_proj.", ".attn.linear_query."), (".k_proj.", ".attn.linear_key."),
    (".v_proj.", ".attn.linear_value."), (".out_proj.", ".attn.linear_output."),
    (".sdma.feature_gmm.means", ".attn.tok_mu"), (".sdma.feature_gmm.log_vars", ".attn.tok_log_var"),
    (".sdma.feature_gmm.prior_logits", ".attn.tok_log_prior"),
    (".sdma.query_gmm.means", ".attn.head_mu"), (".sdma.query_gmm.log_vars", ".attn.head_log_var"),
    (".sdma.query_gmm.prior_logits", ".attn.head_log_prior"),
]


def renamed(name: str, parts, to_authors: bool = True) -> str:
    """``name`` with every (ours, theirs) part of ``parts`` replaced, ours -> theirs or back."""
    for our_part, their_part in parts:
        name = name.replace(our_part, their_part) if to_authors else name.replace(their_part, our_part)
    return name


def authors_name(ours: str) -> str:
    """The authors' parameter name of one of ours."""
    return renamed(ours, AUTHORS_PARTS)


def our_name(theirs: str) -> str:
    return renamed(theirs, AUTHORS_PARTS, to_authors=False)


def weight(name: str, shape: Tuple[int, ...]) -> torch.Tensor:
    """A float64 value for the parameter ``name`` (our name), from a generator seeded by the name:
    projections ~ N(0, 1/fan_in), biases ~ N(0, 0.01), layer-norm gains 1 + N(0, 0.01), embeddings
    ~ N(0, 1/E), the mixtures as the module case draws them (query variances e^-1 smaller)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    z = torch.randn(*shape, generator=g, dtype=torch.float64)
    if "_layer_norm." in name:
        return 1.0 + z / 10 if name.endswith("weight") else z / 10
    if name.endswith("bias"):
        return z / 10
    if "embed_tokens" in name or "output_projection" in name:
        return z / EMBED ** 0.5
    if ".sdma." in name:
        scale = {"prior_logits": 0.5, "log_vars": 0.2, "means": 0.5}[name.rsplit(".", 1)[1]]
        if "query_gmm" in name:
            return z * scale - (1.0 if name.endswith("log_vars") else 0.0)
        return z * scale
    return z / shape[-1] ** 0.5


class NoiseStream:
    """The sampling noise of every reparameterisation in the order the models ask for it, drawn in
    the authors' ``[B, H, L, d_k]`` layout from one seeded generator."""

    def __init__(self, seed: int = NOISE_SEED):
        self.generator = torch.Generator().manual_seed(seed)
        self.shapes = []

    def draw(self, batch_size: int, length: int) -> torch.Tensor:
        self.shapes.append((batch_size, length))
        return torch.randn(batch_size, HEADS, length, HEAD_DIM, generator=self.generator, dtype=torch.float64)


def gradient_reference(named_parameters) -> Dict[str, torch.Tensor]:
    """Gradients by parameter name, as stored (float64; zeros where a term does not reach a parameter)."""
    return {name: torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.detach().double().clone()
            for name, p in named_parameters if p.requires_grad}


def pack_gradients(gradients: Dict[str, Dict[str, torch.Tensor]]) -> Dict:
    """{term: {name: gradient}} -> one float32 vector per term, with the names and shapes once."""
    first = next(iter(gradients.values()))
    return {"names": list(first), "shapes": [list(g.shape) for g in first.values()],
            "terms": {term: torch.cat([named[name].flatten() for name in first]).float()
                      for term, named in gradients.items()}}


def unpack_gradients(packed: Dict) -> Dict[str, Dict[str, torch.Tensor]]:
    """The inverse of :func:`pack_gradients`, in float64."""
    sizes = [int(torch.Size(shape).numel()) for shape in packed["shapes"]]
    return {term: {name: part.double().view(shape) for name, shape, part in
                   zip(packed["names"], packed["shapes"], flat.split(sizes))}
            for term, flat in packed["terms"].items()}
