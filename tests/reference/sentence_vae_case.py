"""What the QKVAE and Optimus reference cases share (``qkvae_authors_case.py``,
``optimus_authors_case.py``): the word dictionary, parameters drawn from a fixed generator, the
token batch, the gradient probes, per-sentence log-likelihood and the comparison of numbers."""

from typing import Optional, Callable, Dict, List, Sequence

import torch
from fairseq.data import Dictionary, data_utils

RTOL, ATOL = 1e-5, 1e-5  # the reference tests' tolerance (float64 on both sides)


def word_dictionary(words: Sequence[str]) -> Dictionary:
    d = Dictionary()
    for word in words:
        d.add_symbol(word)
    return d


def fill_parameters(model, seed: int, is_layer_norm: Callable[[str], bool],
                    scale_of: Callable[[str], float] = lambda name: 0.3) -> None:
    """Every parameter, in sorted-name order, from one generator: layer norms 1 (weights) or 0
    (biases) + 0.1 N(0, 1), the rest ``scale_of(name)`` N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=g, dtype=torch.float64)
            if is_layer_norm(name):
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            else:
                param.copy_(scale_of(name) * noise)


def token_batch(d: Dictionary, sentences: Sequence[str]) -> Dict[str, torch.Tensor]:
    """src = sentence + EOS, prev = EOS + sentence, target = sentence + EOS (no padding wanted)."""
    lines = [d.encode_line(s, add_if_not_exist=False).long() for s in sentences]
    src = data_utils.collate_tokens(lines, d.pad(), d.eos())
    prev = data_utils.collate_tokens(lines, d.pad(), d.eos(), move_eos_to_beginning=True)
    return {"src": src, "lengths": torch.tensor([t.numel() for t in lines]), "prev": prev, "target": src}


def gradient_probes(model, names: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The fixed random tensors the gradients of ``names`` (those the model has) are dotted with."""
    g = torch.Generator().manual_seed(13)
    params = dict(model.named_parameters())
    return {name: torch.randn(params[name].shape, generator=g, dtype=torch.float64)
            for name in names if name in params}


def sentence_log_likelihood(logits: torch.Tensor, target: torch.Tensor, pad: Optional[int] = None) -> torch.Tensor:
    """log p(x|z) per sentence, ``[B, T, V], [B, T] -> [B]`` (positions holding ``pad`` left out)."""
    token = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if pad is not None:
        token = token.masked_fill(target.eq(pad), 0.0)
    return token.sum(-1)


def as_floats(t: torch.Tensor) -> List[float]:
    return [float(v) for v in t.detach().reshape(-1)]


def close(ours, theirs) -> bool:
    return torch.allclose(torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64),
                          rtol=RTOL, atol=ATOL)
