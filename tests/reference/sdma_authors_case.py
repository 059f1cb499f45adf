"""One SDMA attention module on fixed weights, inputs and noise: the case that
``tests/reference/sdma_authors.py`` runs through the authors' ``DisentangledAttention`` and
``tests/unit/user_dir/test_sdma_authors_reading.py`` through ours (``reading="authors"``).

Float64 throughout; batch-first ``[B, T, E]`` tensors, as the authors' module takes them.
"""

from typing import Dict

import torch

EMBED, HEADS, CLUSTERS, BATCH = 16, 2, 3, 3
HEAD_DIM = EMBED // HEADS
NUM_UPDATES = 1000  # g = 1 - max(0.1, exp(-0.5)) = 0.393
# kind -> (attention, c_g, shift of the query GMM's log-variances)
CASES = {
    "encoder_self": ("encoder", 10.0, -1.0),
    "decoder_self": ("decoder", 10.0, -1.0),
    "decoder_cross": ("cross", 10.0, -1.0),
    # query variances ~0.015: most of the authors' L_Dqq normalisers sit at their 1e-6 clamp
    "dqq_clamped": ("encoder", 10.0, -4.2),
    # c_g = 1: their grad_multiplier == 1 branch (clusters x / 10, projects the noisy x)
    "centroid_scale_one": ("encoder", 1.0, -1.0),
}
PARAMETERS = ("tok_mu", "tok_log_var", "tok_log_prior", "head_mu", "head_log_var", "head_log_prior",
              "q.weight", "k.weight", "v.weight", "out.weight")
# The authors' ESPnet DisentangledMaskAttention with their Aishell-1 config (var_estimation, mu_grad 5)
ESPNET_CASES = {
    "espnet_encoder_self": "encoder",
    "espnet_decoder_self": "decoder",
    "espnet_decoder_cross": "cross",
}
ESPNET_CENTROID_GRAD_SCALE = 5.0
ESPNET_PARAMETERS = PARAMETERS + ("var.weight", "head_var.weight")


def build_case(name: str) -> Dict:
    """Weights, inputs, key padding and the noise draws of one case (a fixed generator)."""
    attention, centroid_grad_scale, head_log_var_shift = CASES[name]
    g = torch.Generator().manual_seed(7)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    E, H, C, B, D = EMBED, HEADS, CLUSTERS, BATCH, HEAD_DIM
    T = 5
    S = 6 if attention == "cross" else T
    weights = {
        "q.weight": draw(E, E) / 4, "q.bias": draw(E) / 10, "k.weight": draw(E, E) / 4, "k.bias": draw(E) / 10,
        "v.weight": draw(E, E) / 4, "v.bias": draw(E) / 10, "out.weight": draw(E, E) / 4, "out.bias": draw(E) / 10,
        "tok_log_prior": draw(H, C) / 2, "tok_log_var": draw(H, C, D) / 5, "tok_mu": draw(H, C, D) / 2,
        "head_log_prior": draw(1, C) / 2, "head_log_var": draw(1, C, D) / 5 + head_log_var_shift,
        "head_mu": draw(1, C, D) / 3,
    }
    x = draw(B, T, E)
    key = draw(B, S, E) if attention == "cross" else x
    lengths = torch.tensor([S, S - 3, S - 1]) if attention == "cross" else torch.tensor([T, T - 2, T - 1])
    # noise, in the authors' [B, H, L, d_k] layout: the attention input, (the keys), the scaled queries
    noise = {"query": draw(B, H, T, D), "key": draw(B, H, S, D), "scaled_query": draw(B, H, T, D)}
    return {
        "attention": attention, "centroid_grad_scale": centroid_grad_scale, "weights": weights, "x": x,
        "key": key, "key_padding_mask": torch.arange(S)[None, :] >= lengths[:, None],  # [B, S], True = pad
        "noise": noise, "output_weight": draw(B, T, E),
    }


def build_espnet_case(name: str) -> Dict:
    """An ESPnet case: the weights of :func:`build_case` plus their variance heads (log-variances
    near -3), ESPnet's boolean masks (True = attend; the decoder's (B, T, T) subsequent-and-padding
    mask, as ESPnet builds it)."""
    attention = ESPNET_CASES[name]
    case = build_case({"encoder": "encoder_self", "decoder": "decoder_self", "cross": "decoder_cross"}[attention])
    case["centroid_grad_scale"] = ESPNET_CENTROID_GRAD_SCALE
    g = torch.Generator().manual_seed(13)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    for head in ("var", "var_k", "head_var"):
        case["weights"][f"{head}.weight"] = draw(HEADS, EMBED) / 20
        case["weights"][f"{head}.bias"] = draw(HEADS) / 10 - 3.0
    valid = ~case["key_padding_mask"]  # [B, S]
    if attention == "decoder":
        T = valid.size(1)
        case["mask"] = valid[:, None, :] & torch.ones(T, T, dtype=torch.bool).tril()[None]
    else:
        case["mask"] = valid[:, None, :]
    return case


def noise_order(case: Dict):
    """The noise draws in the order the authors' module makes them."""
    keys = ["query"] + (["key"] if case["attention"] == "cross" else []) + ["scaled_query"]
    return [case["noise"][k] for k in keys]


def objective(output, kl, diversity, mi):
    """What is differentiated: a fixed linear read-out of the output plus the authors' criterion
    weights (0.01 KL + diversity + mi_loss_weight 10 x mi_loss)."""
    return output, 0.01 * kl.sum() + diversity.sum() + 10.0 * mi.sum()


def summary(case: Dict, output, kl, diversity, mi, gradients: Dict[str, torch.Tensor]) -> Dict:
    """The numbers compared: per-sentence terms (``kl`` = token + key + query KL, ``diversity`` the
    same for eq. 23, ``mi`` = 10 L_Dqq - L_Dxq, the authors' ``mi_loss``), the read-out of the output
    and, per parameter, the dot product of its gradient with a fixed random tensor."""
    g = torch.Generator().manual_seed(11)
    dots = {}
    for name in [n for n in ESPNET_PARAMETERS if n in gradients]:
        grad = gradients[name]
        dots[name] = float((grad * torch.randn(grad.shape, generator=g, dtype=torch.float64)).sum())
    return {
        "kl": [float(v) for v in kl.detach()], "diversity": [float(v) for v in diversity.detach()],
        "mi": [float(v) for v in mi.detach()],
        "output": float((output.detach() * case["output_weight"]).sum()),
        "gradients": dots,
    }


def assert_matches(ours: Dict, theirs: Dict) -> None:
    """Our :func:`summary` against the authors' (terms and output to 1e-6, gradient read-outs to
    1e-5: our attention scores are float32)."""
    import pytest

    for key in ("kl", "diversity", "mi"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-6), key
    assert ours["output"] == pytest.approx(theirs["output"], rel=1e-6, abs=1e-6)
    for parameter, value in theirs["gradients"].items():
        assert ours["gradients"][parameter] == pytest.approx(value, rel=1e-5, abs=1e-5), parameter
