"""Reference numbers of the authors' SDMA attention for ``tests/unit/user_dir/test_sdma_authors_reading.py``.

Runs the cases of ``tests/reference/sdma_authors_case.py`` through ``DisentangledAttention`` of the
authors' fairseq code (NYCU-MLLab/Disentangled-Mask-Attention-in-Transformers,
``MT/Fairseq/examples/translation/disentangled_transformer/modules/disentangled_attention.py``,
plain PyTorch) and the ESPnet cases through ``DisentangledMaskAttention`` of their ESPnet1 code
(``ASR/ESPNet/espnet/nets/pytorch_backend/disentangled_transformer/attention.py``; it imports
ESPnet's ``MultiHeadedAttention``, which the installed ESPnet provides), and prints the dictionary
the tests hold as ``AUTHORS_REFERENCE``. Their code is
read from a checkout you point to; nothing of it is in this repository::

    .venv/bin/python -m tests.reference.sdma_authors --authors-dir /path/to/Disentangled-Mask-Attention-in-Transformers
"""

import argparse
import contextlib
import importlib.util
import io
import pprint
from pathlib import Path

import torch

from tests.reference.sdma_authors_case import (
    CASES, CLUSTERS, EMBED, ESPNET_CASES, HEADS, NUM_UPDATES, build_case, build_espnet_case, noise_order, objective,
    summary,
)

MODULE = "MT/Fairseq/examples/translation/disentangled_transformer/modules/disentangled_attention.py"
ESPNET_MODULE = "ASR/ESPNet/espnet/nets/pytorch_backend/disentangled_transformer/attention.py"
ESPNET_LINEARS = {"q": "linear_q", "k": "linear_k", "v": "linear_v", "out": "linear_out",
                  "var": "linear_semantic_var", "var_k": "linear_semantic_var_k", "head_var": "linear_head_var"}
ESPNET_GMM = {"tok_mu": "semantic_mu", "tok_log_var": "semantic_log_var", "tok_log_prior": "semantic_log_prior",
              "head_mu": "head_mu", "head_log_var": "head_log_var", "head_log_prior": "head_log_prior"}
LINEARS = {"q": "linear_query", "k": "linear_key", "v": "linear_value", "out": "linear_output"}


def load_authors_module(authors_dir: Path, module: str = MODULE):
    path = authors_dir / module
    if not path.is_file():
        raise SystemExit(f"{path}: not found; --authors-dir must be a checkout of the authors' repository")
    spec = importlib.util.spec_from_file_location("authors_disentangled_attention", path)
    module = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(io.StringIO()):  # ESPnet prints a notice on import
        spec.loader.exec_module(module)
    return module


def run_case(authors, name: str):
    case = build_case(name)
    attention = case["attention"]
    module = authors.DisentangledAttention(
        HEADS, EMBED, CLUSTERS, causal=attention == "decoder", self_attention=attention != "cross",
        encoder_decoder_attention=attention == "cross", grad_multiplier=case["centroid_grad_scale"]).double()
    with torch.no_grad():
        for short, attr in LINEARS.items():
            getattr(module, attr).weight.copy_(case["weights"][f"{short}.weight"])
            getattr(module, attr).bias.copy_(case["weights"][f"{short}.bias"])
        for name_ in ("tok_mu", "tok_log_var", "tok_log_prior", "head_mu", "head_log_var", "head_log_prior"):
            getattr(module, name_).copy_(case["weights"][name_])
        module.num_updates.fill_(NUM_UPDATES)
    module.train()
    draws = noise_order(case)

    def reparameterize(x, log_var):  # their normal_reparameterizing, with the case's draws
        eps = draws.pop(0)
        if eps.shape != x.shape:  # the c_g <= 1 branch perturbs [B, L, E]
            eps = eps.transpose(1, 2).reshape(x.shape)
        return x + (log_var / 2.0).exp() * eps

    module.normal_reparameterizing = reparameterize
    padding = case["key_padding_mask"].double()[:, None, :]  # [B, 1, S], 1 = pad
    output, _, outputs = module(case["x"], case["key"], case["key"], padding_mask=padding)
    kl, diversity, mi = (outputs[k].view(-1) for k in ("cluster_loss", "cluster_div_loss", "mi_loss"))
    readout, regulariser = objective(output, kl, diversity, mi)
    ((readout * case["output_weight"]).sum() + regulariser).backward()
    gradients = {name_: getattr(module, name_).grad for name_ in
                 ("tok_mu", "tok_log_var", "tok_log_prior", "head_mu", "head_log_var", "head_log_prior")}
    for short, attr in LINEARS.items():
        gradients[f"{short}.weight"] = getattr(module, attr).weight.grad
    return summary(case, output, kl, diversity, mi, gradients)


def run_espnet_case(authors, name: str):
    """Their ESPnet ``DisentangledMaskAttention`` (``var_estimation=True``, ``mu_grad=5``)."""
    case = build_espnet_case(name)
    attention = ESPNET_CASES[name]
    module = authors.DisentangledMaskAttention(
        HEADS, EMBED, 0.0, clusters=CLUSTERS, encoder_decoder_attention=attention == "cross",
        causal=attention == "decoder", var_estimation=True, mu_grad=case["centroid_grad_scale"]).double()
    with torch.no_grad():
        for short, attr in ESPNET_LINEARS.items():
            if hasattr(module, attr):
                getattr(module, attr).weight.copy_(case["weights"][f"{short}.weight"])
                getattr(module, attr).bias.copy_(case["weights"][f"{short}.bias"])
        for ours, theirs in ESPNET_GMM.items():
            getattr(module, theirs).copy_(case["weights"][ours])
        module.num_updates.fill_(NUM_UPDATES)
    module.train()
    draws = noise_order(case)
    module.normal_reparameterizing = lambda x, log_var: x + (log_var / 2.0).exp() * draws.pop(0)
    output = module(case["x"], case["key"], case["key"], case["mask"])
    outputs = module.outputs_dict
    kl, diversity, mi = (outputs[k].view(-1) for k in ("loss_kl", "loss_div", "loss_mi"))
    readout, regulariser = objective(output, kl, diversity, mi)
    ((readout * case["output_weight"]).sum() + regulariser).backward()
    gradients = {ours: getattr(module, theirs).grad for ours, theirs in ESPNET_GMM.items()}
    for short, attr in ESPNET_LINEARS.items():
        if hasattr(module, attr) and short != "var_k":
            gradients[f"{short}.weight"] = getattr(module, attr).weight.grad
    return summary(case, output, kl, diversity, mi, gradients)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--authors-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    authors = load_authors_module(args.authors_dir)
    reference = {name: run_case(authors, name) for name in CASES}
    espnet = load_authors_module(args.authors_dir, ESPNET_MODULE)
    reference.update({name: run_espnet_case(espnet, name) for name in ESPNET_CASES})
    pprint.pprint(reference, width=110, sort_dicts=False)


if __name__ == "__main__":
    main()
