"""The ``authors`` reading of SDMA in fairseq against numbers computed by the authors' own code.

``AUTHORS_REFERENCE`` (``tests/reference/sdma_authors_reference.py``) holds what their fairseq
``DisentangledAttention`` computes on the cases of ``tests/reference/sdma_authors_case.py`` (fixed
weights, inputs and noise; float64), and the command that produced it. Our attention computes its
scores in float32, hence the tolerances.
"""

import math

import pytest
import torch

from latent_core.sdma import SDMAOptions, diagnostic_summary, recording, sdma_losses
from tests.reference.sdma_authors_case import (
    BATCH, CASES, CLUSTERS, EMBED, HEADS, NUM_UPDATES, build_case, noise_order, objective, summary,
)
from tests.reference.sdma_authors_case import assert_matches
from tests.reference.sdma_authors_reference import AUTHORS_REFERENCE
from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention

GROUPS = {"encoder": "encoder_self", "decoder": "decoder_self", "cross": "decoder_cross"}
GMM_PARAMETERS = {"tok_mu": ("feature_gmm", "means"), "tok_log_var": ("feature_gmm", "log_vars"),
                  "tok_log_prior": ("feature_gmm", "prior_logits"), "head_mu": ("query_gmm", "means"),
                  "head_log_var": ("query_gmm", "log_vars"), "head_log_prior": ("query_gmm", "prior_logits")}
PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "out": "out_proj"}


def our_module(case, reading="authors", **options):
    attention = case["attention"]
    module = SDMAMultiheadAttention(
        EMBED, HEADS, self_attention=attention != "cross", encoder_decoder_attention=attention == "cross",
        sdma=SDMAOptions(clusters=CLUSTERS, query_clusters=CLUSTERS, reading=reading,
                         centroid_grad_scale=case["centroid_grad_scale"], **options),
        group=GROUPS[attention], dropout=0.0).double()
    with torch.no_grad():
        for name, (gmm, attr) in GMM_PARAMETERS.items():
            getattr(getattr(module.sdma, gmm), attr).copy_(case["weights"][name])
        for short, attr in PROJECTIONS.items():
            getattr(module, attr).weight.copy_(case["weights"][f"{short}.weight"])
            getattr(module, attr).bias.copy_(case["weights"][f"{short}.bias"])
    module.sdma.set_num_updates(NUM_UPDATES)
    return module


def run_ours(name, reading="authors", diagnostics=None, **options):
    case = build_case(name)
    module = our_module(case, reading, **options)
    module.train()
    # the case's noise draws in our [T, B, E] layout, in the order the module asks for them
    draws = [e.permute(2, 0, 1, 3).reshape(e.size(2), BATCH, EMBED) for e in noise_order(case)]
    noise_std = math.sqrt(module.sdma.options.noise_var)
    module.sdma.perturb = lambda x, training, scale=1.0: x + noise_std / scale * draws.pop(0)
    x, key = case["x"].transpose(0, 1), case["key"].transpose(0, 1)
    attn_mask = None
    if case["attention"] == "decoder":
        attn_mask = torch.triu(torch.full((x.size(0), x.size(0)), float("-inf"), dtype=x.dtype), 1)
    with recording() as records:
        output, _ = module(x, key, key, key_padding_mask=case["key_padding_mask"], attn_mask=attn_mask,
                           need_weights=False)
    output = output.transpose(0, 1)
    terms = sdma_losses([(module.sdma, records.get(module.sdma))], diagnostics)
    kl, diversity = terms["kl_z"] + terms["kl_q"], terms["dv_z"] + terms["dv_q"]
    mi = 10.0 * terms["dqq"] - terms["dxq"]
    readout, regulariser = objective(output, kl, diversity, mi)
    ((readout * case["output_weight"]).sum() + regulariser).backward()
    gradients = {name_: getattr(getattr(module.sdma, gmm), attr).grad
                 for name_, (gmm, attr) in GMM_PARAMETERS.items()}
    gradients.update({f"{short}.weight": getattr(module, attr).weight.grad for short, attr in PROJECTIONS.items()})
    return summary(case, output, kl, diversity, mi, gradients)


@pytest.mark.parametrize("name", list(CASES))
def test_authors_reading_reproduces_their_attention(name):
    assert_matches(run_ours(name), AUTHORS_REFERENCE[name])


@pytest.mark.parametrize("name", ["encoder_self", "decoder_cross", "dqq_clamped"])
def test_paper_reading_is_a_different_computation(name):
    ours, theirs = run_ours(name, reading="paper"), AUTHORS_REFERENCE[name]
    for key in ("kl", "mi", "output"):
        assert ours[key] != pytest.approx(theirs[key], rel=1e-3), key


def test_dqq_diagnostics_show_the_authors_clamp():
    """With query variances ~0.015 most of their normalisers sit at the clamp and their L_Dqq falls
    far below the exact one; on the ordinary case none does and the two agree."""
    clamped, ordinary = {}, {}
    run_ours("dqq_clamped", diagnostics=clamped)
    run_ours("encoder_self", diagnostics=ordinary)
    clamped, ordinary = diagnostic_summary(clamped), diagnostic_summary(ordinary)
    assert clamped["dqq_clamped"] > 0.5 and clamped["dqq_ratio"] < 0.5
    assert ordinary["dqq_clamped"] == 0.0 and ordinary["dqq_ratio"] == pytest.approx(1.0, abs=0.05)
    assert 1.0 / CLUSTERS <= ordinary["hardness"] <= 1.0


def test_authors_initialisation():
    """xavier_normal_ on every GMM parameter (means near the origin, soft clusters) and on the four
    projections with gain 1/sqrt(2); the paper reading keeps N(0, 1) means."""
    torch.manual_seed(0)
    E, H, C = 512, 4, 4
    d = E // H
    authors = SDMAMultiheadAttention(E, H, self_attention=True, sdma=SDMAOptions(clusters=C), group="encoder_self")
    paper = SDMAMultiheadAttention(E, H, self_attention=True, sdma=SDMAOptions(clusters=C, reading="paper"),
                                   group="encoder_self")
    means = authors.sdma.feature_gmm.means
    assert means.std().item() == pytest.approx(math.sqrt(2 / ((H + C) * d)), rel=0.1)  # ~0.044
    assert paper.sdma.feature_gmm.means.std().item() == pytest.approx(1.0, rel=0.1)
    for proj in (authors.q_proj, authors.k_proj, authors.v_proj, authors.out_proj):
        assert proj.weight.std().item() == pytest.approx(math.sqrt(1 / (2 * E)), rel=0.05)
        assert proj.bias.abs().max().item() <= 1 / math.sqrt(E) and proj.bias.abs().max().item() > 0
    x = torch.randn(64, 2, E)
    hardness = [m.sdma.cluster(x)[1].exp().amax(-1).mean().item() for m in (authors, paper)]
    assert hardness[0] < 0.7 < hardness[1]


@pytest.mark.parametrize("group", ["decoder_cross", "encoder_self"])
def test_fused_kernels_match_explicit_in_the_authors_reading(group):
    case = build_case(group)
    outputs = []
    for kernel in ("explicit", "sdpa", "lowrank"):
        module = our_module(case, attention_kernel=kernel)
        module.eval()
        x = case["x"].transpose(0, 1)
        key = x if group == "encoder_self" else case["key"].transpose(0, 1)
        with torch.no_grad():
            outputs.append(module(x, key, key, key_padding_mask=case["key_padding_mask"], need_weights=False)[0])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outputs[2], outputs[0], rtol=1e-5, atol=1e-6)
