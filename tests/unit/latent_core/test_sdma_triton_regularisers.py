"""The fused feature-GMM regularisers (eq. 20 and 23, :func:`feature_terms`) equal the eager terms, in Triton's
interpreter on the CPU.

Values and the gradients of log p(z, c), log p(c|z), the GMMs' log-variances and prior logits against ``_VadeKL`` and
``_ClusterDiversity`` (which tests/unit/latent_core/test_sdma_regulariser_functions.py holds to the direct forms):
both readings (the authors' categorical term, their unsquared and unmasked diversity), padded sentences, lengths
across several position tiles and ending inside one, one GMM per head and one shared by the heads (the query GMM),
log-variances outside the clamp's range, one cluster more than a power of two. Planted defects in the kernels (a dropped position weight, the Gram
term's weight on the diagonal one, a dropped prior term) make the same checks fail.
"""

import pytest
import torch

import latent_core.sdma.triton_kernels as triton_kernels
from latent_core.sdma import regularisers
from latent_core.sdma.triton_kernels import LaunchConfig
from tests.conftest import planted_copy

if not triton_kernels.INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it)", allow_module_level=True)

import latent_core.sdma.triton_regularisers as triton_regularisers  # noqa: E402

pytestmark = pytest.mark.interpreter
DEVICE = "cpu" if triton_kernels.INTERPRETED else "cuda"
SMALL_TILES = {kernel: LaunchConfig(16, 0, 4, 1) for kernel in triton_regularisers.LAUNCH}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """16 positions per step: the lengths below span several steps and end inside one."""
    monkeypatch.setattr(triton_regularisers, "LAUNCH", SMALL_TILES)


def inputs(L=2, T=37, B=3, H=2, C=5, d=16, seed=0, shared=False, authors=True):
    """log p(z, c), log p(c|z) (clusters-first), the layers' GMM log-variances (some outside the clamp's range) and
    prior logits (``shared``: one GMM for all heads), the real tokens."""
    g = torch.Generator().manual_seed(seed)
    G = 1 if shared else H
    log_joint = (3.0 * torch.randn(C, L, T, B, H, generator=g) - 20.0).to(DEVICE).requires_grad_()
    log_resp = torch.log_softmax(2.0 * torch.randn(C, L, T, B, H, generator=g), 0).to(DEVICE).requires_grad_()
    log_vars = (3.0 * torch.randn(L, G, C, d, generator=g)).to(DEVICE)
    log_vars[0, 0, 0, :3] = torch.tensor([-12.0, 11.0, 9.5])  # clamped: no gradient
    log_vars.requires_grad_()
    prior_logits = torch.randn(L, G, C, generator=g).to(DEVICE).requires_grad_()
    valid = torch.ones(T, B, device=DEVICE)
    valid[T - 9:, 1] = 0.0  # a padded sentence
    valid[1:, 2] = 0.0  # a one-token sentence
    return log_joint, log_resp, log_vars, (prior_logits if authors else None), valid


def both(log_joint, log_resp, log_vars, prior_logits, valid, squared, unmasked, posterior_var=1.0):
    """(eager KL, eager diversity), (fused KL, fused diversity). The eager terms run in float64 (from the same float32
    leaves): the authors' KL subtracts sum_c pi_c s2/2 tr_c from a sum that carries it, with traces of 10^4 here, which
    costs the float32 eager gradients of log pi more than the kernels' direct form."""
    L, H, d = log_joint.size(1), log_joint.size(-1), log_vars.size(-1)
    trace = regularisers._StackedTracePrecision.apply(*log_vars.unbind(0)).double().expand(L, H, -1)
    log_prior = None if prior_logits is None else torch.log_softmax(prior_logits.double(), -1).expand(L, H, -1)
    weights = regularisers._SentenceWeights(valid.double(), L, H)
    alpha, beta = 1.0, 0.7
    diag_weight, off_weight = (alpha * alpha, beta * beta) if squared else (alpha, beta)
    log_joint_64, log_resp_64 = log_joint.double(), log_resp.double()
    eager = (regularisers._VadeKL.apply(log_joint_64, log_resp_64, log_resp_64.exp(), trace, posterior_var, log_prior,
                                        weights.per_head, d).float(),
             regularisers._ClusterDiversity.apply(log_resp_64.exp(), None if unmasked else valid.double(), diag_weight,
                                                  off_weight, weights.per_gram).float())
    fused = triton_regularisers.feature_terms(log_joint, log_resp, log_vars, prior_logits, valid, not unmasked,
                                              posterior_var, diag_weight, off_weight)
    return eager, fused


def gradients(outputs, tensors, seed=1):
    g = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(o.shape, generator=g).to(o.device) for o in outputs]
    return torch.autograd.grad(outputs, tensors, cotangents, allow_unused=True)


CASES = [  # (authors, squared, unmasked, shared trace): the authors' reading runs unsquared and unmasked
    (True, False, True, False),
    (False, True, False, False),
    (True, False, True, True),
    (False, True, False, True),
]


@pytest.mark.parametrize("authors, squared, unmasked, shared", CASES)
def test_values_and_gradients_equal_the_eager_terms(authors, squared, unmasked, shared):
    log_joint, log_resp, log_vars, prior_logits, valid = inputs(shared=shared, authors=authors)
    (kl, dv), (fused_kl, fused_dv) = both(log_joint, log_resp, log_vars, prior_logits, valid, squared, unmasked,
                                          posterior_var=0.8)
    torch.testing.assert_close(fused_kl, kl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_dv, dv, rtol=1e-5, atol=1e-5)
    wrt = [log_joint, log_resp, log_vars] + ([prior_logits] if authors else [])
    for fused, eager in zip(gradients((fused_kl, fused_dv), wrt), gradients((kl, dv), wrt)):
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-6)


def test_one_term_alone_has_a_gradient():
    log_joint, log_resp, log_vars, prior_logits, valid = inputs(T=5)
    (_, dv), (_, fused_dv) = both(log_joint, log_resp, log_vars, prior_logits, valid, squared=False, unmasked=True)
    torch.testing.assert_close(torch.autograd.grad(fused_dv.sum(), log_resp)[0],
                               torch.autograd.grad(dv.sum(), log_resp)[0], rtol=1e-4, atol=1e-6)


def _planted(old: str, new: str):
    """triton_regularisers with ``old`` replaced by ``new`` in its source, on small tiles."""
    module = planted_copy(triton_regularisers, [(old, new)], "planted_triton_regularisers")
    module.LAUNCH = SMALL_TILES
    return module


PLANTED = [
    ("a dropped position weight", "kl += real * (per_token - constant)", "kl += (per_token - constant)"),
    ("the log-variance clamp dropped in backward", "tl.where(inside, -grad_trace[:, None] * tl.exp(-log_vars), 0.0)",
     "-grad_trace[:, None] * tl.exp(-log_vars)"),
    ("the Gram term weighted as the diagonal", "+ off_weight * tl.dot(masked, gram",
     "+ diag_weight * tl.dot(masked, gram"),
    ("a dropped prior term", "(resp * slope - resp - pi[None, :])", "(resp * slope - resp)"),
]


@pytest.mark.parametrize("what, old, new", PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_defect_fails(what, old, new):
    module = _planted(old, new)
    log_joint, log_resp, log_vars, prior_logits, valid = inputs(T=20)
    (kl, dv), _ = both(log_joint, log_resp, log_vars, prior_logits, valid, squared=False, unmasked=True)
    fused = module.feature_terms(log_joint, log_resp, log_vars, prior_logits, valid, False, 1.0, 1.0, 0.7)
    wrt = [log_joint, log_resp, log_vars, prior_logits]
    values_equal = all(torch.allclose(f, e, rtol=1e-5, atol=1e-5) for f, e in zip(fused, (kl, dv)))
    grads_equal = all(torch.allclose(f, e, rtol=1e-4, atol=1e-6)
                      for f, e in zip(gradients(fused, wrt), gradients((kl, dv), wrt)))
    assert not (values_equal and grads_equal), what


def records(authors, L=2, T=9, S=11, B=2, H=2, C=3, Cq=5, d=8, seed=3):
    """group_terms' inputs of an SDMA attention type: the feature, query and (the authors' cross-attention) key
    clustering per layer, with the GMMs' parameters."""
    g = torch.Generator().manual_seed(seed)
    leaf = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE).requires_grad_()
    layers = {"log_joint_z": [leaf(T, B, H, C) for _ in range(L)], "log_resp_z": [leaf(T, B, H, C) for _ in range(L)],
              "log_joint_q": [leaf(T, B, H, Cq) for _ in range(L)], "log_resp_q": [leaf(T, B, H, Cq) for _ in range(L)]}
    if authors:
        layers.update(log_joint_k=[leaf(S, B, H, C) for _ in range(L)], log_resp_k=[leaf(S, B, H, C) for _ in range(L)])
    parameters = {"z": ([leaf(H, C, d) for _ in range(L)], [leaf(H, C) for _ in range(L)]),
                  "q": ([leaf(1, Cq, d) for _ in range(L)], [leaf(1, Cq) for _ in range(L)])}
    valid = torch.ones(T, B, device=DEVICE)
    valid[6:, 1] = 0.0
    return layers, parameters, valid


@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
def test_group_terms_fused_equal_eager(authors):
    """All terms of an attention type (eq. 20-23 of the feature, query and key clustering) with ``fused`` (the
    kernels) and without: values, the diagnostic sums, and every input's gradient."""
    layers, parameters, valid = records(authors)
    results = {}
    for fused in (False, True):
        normalised = {name: [torch.log_softmax(t, -1) if "resp" in name else t for t in tensors]
                      for name, tensors in layers.items()}
        losses, sums = regularisers.group_terms(normalised, {}, parameters, valid, authors=authors, head_dim=8,
                                             num_heads=2, posterior_var=1.0, alpha=1.0, beta=0.5, diagnose=True,
                                             fused=fused)
        leaves = [t for tensors in layers.values() for t in tensors] + [
            t for kind in parameters.values() for group in kind for t in group]
        total = sum((i + 1.0) * value.sum() for i, (_, value) in enumerate(sorted(losses.items())))
        results[fused] = ({k: v.detach() for k, v in {**losses, **sums}.items()},
                          torch.autograd.grad(total, leaves, allow_unused=True))  # the paper's prior: unused
    (eager, eager_grads), (fused, fused_grads) = results[False], results[True]
    assert eager.keys() == fused.keys() and {"kl_z", "dv_z", "kl_q", "dv_q", "dqq", "dxq", "dqq_clamped",
                                             "dqq_exact", "dqq_authors", "hardness_sum"} <= set(fused)
    for name in eager:  # the losses and the diagnostic sums (a count: float from the kernel, int64 eager)
        torch.testing.assert_close(fused[name].float(), eager[name].float(), rtol=1e-5, atol=1e-5, msg=name)
    assert [g is None for g in fused_grads] == [g is None for g in eager_grads]
    for fused_grad, eager_grad in zip(fused_grads, eager_grads):
        if eager_grad is not None:
            torch.testing.assert_close(fused_grad, eager_grad, rtol=1e-4, atol=1e-6)


def query_inputs(L=2, T=37, B=3, H=3, C=5, seed=4, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    log_joint = (spread * torch.randn(C, L, T, B, H, generator=g) - 30.0).to(DEVICE).requires_grad_()
    log_resp = torch.log_softmax(2.0 * torch.randn(C, L, T, B, H, generator=g), 0).to(DEVICE).requires_grad_()
    valid = torch.ones(T, B, device=DEVICE)
    valid[T - 9:, 1] = 0.0
    valid[1:, 2] = 0.0
    return log_joint, log_resp, valid


def eager_query_terms(log_joint, log_resp, valid, authors):
    """(L_Dqq, L_Dxq, L_Dqq in the other reading, clamped normalisers) of the eager terms, as group_terms forms
    them (the authors' reading normalises over the padded length: ``valid`` all ones there)."""
    L, H = log_joint.size(1), log_joint.size(-1)
    weights = regularisers._SentenceWeights(valid, L, H)
    theirs, clamped = regularisers.authors_token_given_cluster(log_joint)
    exact = regularisers.token_given_cluster(log_joint, valid)
    resp = log_resp.exp()
    dqq = regularisers._HeadMI.apply(theirs if authors else exact, resp, weights.per_head_pair, authors)
    dxq = regularisers._QueryInputMI.apply(resp, None if authors else valid, weights.per_head)
    with torch.no_grad():
        other = regularisers._head_mi_value(exact if authors else theirs, resp, weights.per_head_pair, not authors)
    return dqq, dxq, other, clamped.sum()


@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
@pytest.mark.parametrize("spread", [3.0, 40.0], ids=["spread", "clamped"])
def test_query_terms_equal_the_eager_terms(authors, spread):
    """Eq. (21) and (22): values, the other reading's L_Dqq, the count of the authors' clamped normalisers (spread
    40: most of them), and the gradients of log p(q, c) and log p(c|q)."""
    log_joint, log_resp, valid = query_inputs(spread=spread)
    if authors:
        valid = torch.ones_like(valid)
    dqq, dxq, other, clamped = eager_query_terms(log_joint, log_resp, valid, authors)
    fused = triton_regularisers.query_terms(log_joint, log_resp, valid, authors)
    fused = (*fused[:3], fused[3].sum())
    normalisers = log_joint.numel() // log_joint.size(2)  # one per cluster, layer, sentence and head
    assert (0 < int(clamped) < normalisers) if spread > 10 else int(clamped) == 0
    for name, got, want in zip(("dqq", "dxq", "other", "clamped"), fused, (dqq, dxq, other, clamped)):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5, msg=name)
    wrt = [log_joint, log_resp]
    for got, want in zip(gradients(fused[:2], wrt), gradients((dqq, dxq), wrt)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


QUERY_PLANTED = [
    ("the critic's transposed term dropped", "+ tl.where(key_valid_i[:, None], exp_critic * column_weight[None, :], 0.0)",
     ""),
    ("the pair weights of eq. (21) as eq. (22)'s", "w_pair = valid * per_head / H", "w_pair = valid * per_head"),
    ("the authors' clamp ignored in backward", "through_norm = tl.where(raw < EPS, 0.0, through_norm)",
     "through_norm = through_norm"),
    ("padded keys in eq. (22)'s normaliser", "norm += tl.sum(tl.where(key_valid[None, :], tl.exp(critic), 0.0), 1)",
     "norm += tl.sum(tl.where(mask_j[None, :], tl.exp(critic), 0.0), 1)"),
]


@pytest.mark.parametrize("what, old, new", QUERY_PLANTED, ids=[p[0] for p in QUERY_PLANTED])
def test_a_planted_defect_in_the_query_terms_fails(what, old, new):
    authors = "authors" in what
    module = _planted(old, new)
    log_joint, log_resp, valid = query_inputs(T=20, spread=40.0 if authors else 3.0)
    if authors:
        valid = torch.ones_like(valid)
    expected = eager_query_terms(log_joint, log_resp, valid, authors)[:2]
    fused = module.query_terms(log_joint, log_resp, valid, authors)[:2]
    wrt = [log_joint, log_resp]
    values_equal = all(torch.allclose(f, e, rtol=1e-5, atol=1e-5) for f, e in zip(fused, expected))
    grads_equal = all(torch.allclose(f, e, rtol=1e-4, atol=1e-6)
                      for f, e in zip(gradients(fused, wrt), gradients(expected, wrt)))
    assert not (values_equal and grads_equal), what
