"""The ``authors`` reading of the ESPnet SDMA attention against their ESPnet1 ``DisentangledMaskAttention``.

``AUTHORS_REFERENCE`` (``tests/reference/sdma_authors_reference.py``, with the command that produced
it) holds what their module computes with their Aishell-1 config (``var_estimation: True``,
``mu_grad: 5``) on the ESPnet cases of ``tests/reference/sdma_authors_case.py``: learned per-position
variances of the noise and of the posteriors, the second draw on the queries, clean k/v, their mask,
KL, diversity and L_Dqq forms, and the cross-attention keys' terms.
"""

import pytest
import torch

from espnet_plugin.asr.sdma_attention import SDMAMultiHeadedAttention
from latent_core.sdma import SDMAOptions, recording, sdma_losses
from tests.reference.sdma_authors_case import (
    CLUSTERS, EMBED, ESPNET_CASES, HEADS, NUM_UPDATES, build_espnet_case, noise_order, objective, summary,
)
from tests.reference.sdma_authors_case import assert_matches
from tests.reference.sdma_authors_reference import AUTHORS_REFERENCE

GROUPS = {"encoder": "encoder_self", "decoder": "decoder_self", "cross": "decoder_cross"}
GMM = {"tok_mu": ("feature_gmm", "means"), "tok_log_var": ("feature_gmm", "log_vars"),
       "tok_log_prior": ("feature_gmm", "prior_logits"), "head_mu": ("query_gmm", "means"),
       "head_log_var": ("query_gmm", "log_vars"), "head_log_prior": ("query_gmm", "prior_logits")}
LINEARS = {"q": "linear_q", "k": "linear_k", "v": "linear_v", "out": "linear_out"}
VARIANCE_HEADS = {"var": "noise_log_var", "var_k": "key_noise_log_var", "head_var": "query_noise_log_var"}


def run_ours(name):
    case = build_espnet_case(name)
    attention = ESPNET_CASES[name]
    module = SDMAMultiHeadedAttention(
        HEADS, EMBED, 0.0, group=GROUPS[attention],
        sdma=SDMAOptions(clusters=CLUSTERS, query_clusters=CLUSTERS,
                         centroid_grad_scale=case["centroid_grad_scale"])).double()
    core = module.sdma
    with torch.no_grad():
        for short, attr in LINEARS.items():
            getattr(module, attr).weight.copy_(case["weights"][f"{short}.weight"])
            getattr(module, attr).bias.copy_(case["weights"][f"{short}.bias"])
        for short, attr in VARIANCE_HEADS.items():
            head = getattr(core, attr)
            if head is not None:
                head.weight.copy_(case["weights"][f"{short}.weight"])
                head.bias.copy_(case["weights"][f"{short}.bias"])
        for name_, (gmm, attr) in GMM.items():
            getattr(getattr(core, gmm), attr).copy_(case["weights"][name_])
    core.set_num_updates(NUM_UPDATES)
    module.train()
    draws = [e.permute(0, 2, 1, 3) for e in noise_order(case)]  # (B, T, H, d_k), ESPnet's layout

    def perturb(x, training, log_var=None):
        eps = draws.pop(0)
        return x + (eps * torch.exp(0.5 * log_var)[..., None]).reshape(x.shape)

    core.perturb = perturb
    with recording() as records:
        output = module(case["x"], case["key"], case["key"], case["mask"])
    terms = sdma_losses([(core, records.get(core))])
    kl, diversity = terms["kl_z"] + terms["kl_q"], terms["dv_z"] + terms["dv_q"]
    mi = 10.0 * terms["dqq"] - terms["dxq"]
    readout, regulariser = objective(output, kl, diversity, mi)
    ((readout * case["output_weight"]).sum() + regulariser).backward()
    gradients = {n: getattr(getattr(core, gmm), attr).grad for n, (gmm, attr) in GMM.items()}
    gradients.update({f"{short}.weight": getattr(module, attr).weight.grad for short, attr in LINEARS.items()})
    gradients["var.weight"] = core.noise_log_var.weight.grad
    gradients["head_var.weight"] = core.query_noise_log_var.weight.grad
    return summary(case, output, kl, diversity, mi, gradients)


@pytest.mark.parametrize("name", list(ESPNET_CASES))
def test_espnet_authors_reading_reproduces_their_attention(name):
    assert_matches(run_ours(name), AUTHORS_REFERENCE[name])


def test_espnet_authors_initialisation():
    """Their init_params: xavier_normal_ (gain 1) on the projections and the GMMs, gain 0.01 on the
    variance heads, whose biases (nn.Linear's) start the noise variance near exp(0) = 1."""
    torch.manual_seed(0)
    E = 256
    module = SDMAMultiHeadedAttention(4, E, 0.0, sdma=SDMAOptions(clusters=8), group="decoder_cross")
    assert module.linear_q.weight.std().item() == pytest.approx((1 / E) ** 0.5, rel=0.05)
    heads = [module.sdma.noise_log_var, module.sdma.key_noise_log_var, module.sdma.query_noise_log_var]
    for head in heads:
        assert head.weight.std().item() == pytest.approx(0.01 * (2 / (E + 4)) ** 0.5, rel=0.2)
    self_attention = SDMAMultiHeadedAttention(4, E, 0.0, sdma=SDMAOptions(), group="encoder_self")
    assert self_attention.sdma.key_noise_log_var is None
    paper = SDMAMultiHeadedAttention(4, E, 0.0, sdma=SDMAOptions(reading="paper"), group="encoder_self")
    assert not hasattr(paper.sdma, "noise_log_var")


def test_espnet_global_init_keeps_the_authors_attention_init():
    """ESPnet's ``init: xavier_uniform`` re-draws every 2-D weight; the module's
    ``espnet_initialization_fn`` restores the authors' attention init afterwards."""
    from espnet2.torch_utils.initialize import initialize

    torch.manual_seed(0)
    E = 256
    module = SDMAMultiHeadedAttention(4, E, 0.0, sdma=SDMAOptions(clusters=8), group="encoder_self")
    initialize(module, "xavier_uniform")
    assert module.sdma.noise_log_var.weight.std().item() < 0.01  # gain 0.01, not xavier_uniform's gain 1
    assert module.sdma.feature_gmm.means.std().item() == pytest.approx((2 / ((4 + 8) * 64)) ** 0.5, rel=0.1)


def test_a_paper_reading_model_file_loaded_as_authors_says_what_to_change():
    """Model files from before the readings (the paper reading) have no variance heads: loading one
    into the authors reading (the new default) names the YAML key to set, instead of a bare
    missing-keys error; with `reading: paper` it loads."""
    from espnet_plugin.asr.sdma_attention import ESPnetConfigError

    old = SDMAMultiHeadedAttention(2, 16, 0.0, sdma=SDMAOptions(reading="paper"), group="encoder_self")
    with pytest.raises(ESPnetConfigError, match=r"reading: paper.*encoder_conf\.sdma_conf"):
        SDMAMultiHeadedAttention(2, 16, 0.0, sdma=SDMAOptions(), group="encoder_self").load_state_dict(
            old.state_dict())
    SDMAMultiHeadedAttention(2, 16, 0.0, sdma=SDMAOptions(reading="paper"), group="encoder_self").load_state_dict(
        old.state_dict())
