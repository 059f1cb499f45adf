"""The hand-written backwards of the SDMA regularisers (``latent_core.sdma.regularisers``) against autograd's
backward of the direct forms of eq. (20)-(23): the code they replaced, kept below as the reference."""

import math
from functools import partial
from typing import Optional, Tuple

import pytest
import torch
from torch import Tensor

from latent_core.sdma import regularisers
from latent_core.sdma.mixture import clusters_first, trace_precision
from latent_core.sdma.options import AUTHORS_EPS, LOG_2PI

# ---------------------------------------------------------------------------------------------------------------
# Reference: the direct forms, differentiated by autograd.
# ---------------------------------------------------------------------------------------------------------------


def direct_sentence_mean(per_token: Tensor, valid: Tensor) -> Tensor:
    n_q = valid.sum(0).clamp_min(1.0)  # [B]
    return ((per_token * valid).sum(1) / n_q).mean(0)


def direct_vade_kl(log_joint: Tensor, log_resp: Tensor, trace_precision: Tensor, dim: int,
            posterior_var, valid: Tensor, resp: Optional[Tensor] = None,
            authors_log_prior: Optional[Tensor] = None) -> Tensor:
    log_joint, log_resp = clusters_first(log_joint), clusters_first(log_resp)  # [C, L, T, B, H]
    resp = log_resp.exp() if resp is None else clusters_first(resp)
    log_marginal = log_joint[0] - log_resp[0]  # log p(z), [L, T, B, H]
    trace = (resp * trace_precision.permute(2, 0, 1)[:, :, None, None, :]).sum(0)
    if isinstance(posterior_var, Tensor):
        const = 0.5 * dim * (LOG_2PI + torch.log(posterior_var) + 1.0)
    else:
        const = 0.5 * dim * (LOG_2PI + math.log(posterior_var) + 1.0)
    per_token = 0.5 * posterior_var * trace - log_marginal - const
    if authors_log_prior is not None:
        log_prior = authors_log_prior.permute(2, 0, 1)[:, :, None, None, :]  # [C, L, 1, 1, H]
        forward_kl = (resp * (log_resp - log_prior)).sum(0)  # KL(gamma || pi), inside -log p(z)
        reverse_kl = (log_prior.exp() * (log_prior - log_resp)).sum(0)  # KL(pi || gamma)
        per_token = per_token - forward_kl + reverse_kl
    return direct_sentence_mean(per_token.mean(-1), valid)


def direct_cluster_diversity(resp: Tensor, valid: Tensor, alpha: float, beta: float, squared: bool = True) -> Tensor:
    diag_weight, off_weight = (alpha * alpha, beta * beta) if squared else (alpha, beta)
    resp = clusters_first(resp) * valid[None, None, :, :, None]  # [C, L, T, B, H]
    self_sim = (resp * resp).sum(0)  # s_i, [L, T, B, H]
    gram = torch.einsum("cltbh,kltbh->cklbh", resp, resp)  # C^T C, [C, C, L, B, H]
    diag = diag_weight * ((self_sim - 1.0) ** 2 * valid[None, :, :, None]).sum(1)  # [L, B, H]
    off = off_weight * ((gram * gram).sum((0, 1)) - (self_sim * self_sim).sum(1))
    n_q = valid.sum(0).clamp_min(1.0)[None, :, None]  # [1, B, 1]
    return ((diag + off) / (n_q * n_q)).mean((0, 2))


def direct_token_given_cluster(log_joint_q: Tensor, valid: Tensor) -> Tensor:
    pad = (valid <= 0)[None, None, :, :, None]
    p_token_given_c = torch.softmax(log_joint_q.masked_fill(pad, float("-inf")), dim=2)
    return p_token_given_c.masked_fill(pad, 0.0)  # sentences of length 0 stay finite


def direct_authors_token_given_cluster(log_joint_q: Tensor) -> Tuple[Tensor, Tensor]:
    layer_max = log_joint_q.detach().amax(dim=(0, 2, 3, 4), keepdim=True)  # one max per layer
    joint = torch.exp(log_joint_q - layer_max)
    norm = joint.sum(2, keepdim=True)
    clamped = norm < AUTHORS_EPS
    return joint / norm.clamp_min(AUTHORS_EPS), clamped


def direct_head_mi(p_token_given_c: Tensor, resp_q: Tensor, valid: Tensor, authors: bool) -> Tensor:
    """Eq. (21) from p(q_i^h | c) and p(c | q_i^h'), both clusters-first ``[C, L, T, B, H]``."""
    n_h = resp_q.size(-1)
    p_pair = (p_token_given_c[..., :, None] * resp_q[..., None, :]).sum(0)  # [L, T, B, H, H']
    off_diag = 1.0 - torch.eye(n_h, device=p_pair.device, dtype=p_pair.dtype)
    if authors:
        neg_log = -torch.log(1.0 - p_pair.clamp(max=1.0) + AUTHORS_EPS) * off_diag
    else:
        neg_log = -torch.log1p(-p_pair.clamp(max=1.0 - 1e-6)) * off_diag
    return direct_sentence_mean(neg_log.sum((-1, -2)) / (n_h * n_h), valid)


def direct_head_mi_upper_bound(log_joint_q: Tensor, resp_q: Tensor, valid: Tensor, authors: bool = False,
                        p_token_given_c: Optional[Tensor] = None) -> Tensor:
    log_joint_q, resp_q = clusters_first(log_joint_q), clusters_first(resp_q)  # [C, L, T, B, H]
    if p_token_given_c is None:
        p_token_given_c = (direct_authors_token_given_cluster(log_joint_q)[0] if authors
                           else direct_token_given_cluster(log_joint_q, valid))
    return direct_head_mi(p_token_given_c, resp_q, valid, authors)


def direct_query_input_mi_lower_bound(resp_q: Tensor, valid: Tensor) -> Tensor:
    resp_q = clusters_first(resp_q)  # [C, L, T, B, H]
    # f(q_i, x_j) as [L, T_i, T_j, B, H]: one multiply-add per cluster over long rows
    critic = resp_q[0, :, :, None] * resp_q[0, :, None]
    for c in range(1, resp_q.size(0)):
        critic = torch.addcmul(critic, resp_q[c, :, :, None], resp_q[c, :, None])
    key_pad = (valid <= 0)[None, None, :, :, None]  # [1, 1, T_j, B, 1]
    log_norm = torch.logsumexp(critic.masked_fill(key_pad, float("-inf")), dim=2)  # [L, T, B, H]
    log_ratio = (resp_q * resp_q).sum(0) - log_norm  # f(q_i, x_i) - log sum_j exp f(q_i, x_j)
    return direct_sentence_mean(log_ratio.mean(-1), valid)


def _direct_head_mi_of_weights(p_token_given_c: Tensor, resp_q: Tensor, weights, authors: bool) -> Tensor:
    return direct_head_mi(p_token_given_c, resp_q, weights.valid, authors)


# group_terms with these in place of the hand-written backwards is the reference of the whole attention type.
# ``weights.valid`` is the mask group_terms forms (all ones in the authors' reading, so ``unmasked`` changes nothing).
DIRECT_TERMS = regularisers.RegulariserTerms(
    trace_precision=lambda log_vars: trace_precision(torch.stack(log_vars)),
    vade_kl=lambda log_joint, log_resp, resp, trace, posterior_var, authors_log_prior, weights, dim: direct_vade_kl(
        log_joint, log_resp, trace, dim, posterior_var, weights.valid, resp, authors_log_prior),
    cluster_diversity=lambda resp, weights, alpha, beta, squared, unmasked: direct_cluster_diversity(
        resp, weights.valid, alpha, beta, squared),
    token_given_cluster=direct_token_given_cluster,
    authors_token_given_cluster=direct_authors_token_given_cluster,
    head_mi=_direct_head_mi_of_weights,
    head_mi_value=_direct_head_mi_of_weights,
    query_input_mi=lambda resp_q, weights, unmasked: direct_query_input_mi_lower_bound(resp_q.movedim(0, -1),
                                                                                       weights.valid),
)


# ---------------------------------------------------------------------------------------------------------------
# Inputs: clustering tensors of L layers, ``[L, T, B, H, C]`` views of clusters-first storage, as the records hold.
# ---------------------------------------------------------------------------------------------------------------

LAYERS, LENGTH, BATCH, HEADS, CLUSTERS, HEAD_DIM = 2, 5, 3, 3, 4, 8


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


def _clustering(generator, dtype, layers=LAYERS, length=LENGTH, batch=BATCH, heads=HEADS, clusters=CLUSTERS,
                spread=6.0):
    """(log_joint, log_resp) leaves ``[L, T, B, H, C]`` (clusters-first storage) with soft, unequal clusters."""
    shape = (clusters, layers, length, batch, heads)
    log_joint = (torch.randn(shape, generator=generator, dtype=torch.float64) * spread - 20.0)
    log_resp = torch.log_softmax(log_joint, dim=0)
    leaf = lambda t: t.to(dtype).movedim(0, -1).detach().requires_grad_(True)
    return leaf(log_joint), leaf(log_resp)


def _padded(length=LENGTH, batch=BATCH, dtype=torch.float64):
    """``[T, B]``: one full sentence, the others shorter."""
    valid = torch.ones(length, batch, dtype=dtype)
    for b in range(1, batch):
        valid[length - b:, b] = 0.0
    return valid


def _grads(outputs: Tensor, inputs, seed=1):
    weights = torch.rand(outputs.shape, generator=_generator(seed), dtype=outputs.dtype)
    inputs = [x for x in inputs if isinstance(x, Tensor) and x.requires_grad]
    return torch.autograd.grad((outputs * weights).sum(), inputs, allow_unused=True)


def _assert_same(new_value, new_grads, reference_value, reference_grads, rtol=1e-10, atol=1e-12):
    torch.testing.assert_close(new_value, reference_value, rtol=rtol, atol=atol)
    assert len(new_grads) == len(reference_grads)
    for new, reference in zip(new_grads, reference_grads):
        if reference is None:
            assert new is None or not new.any()
            continue
        torch.testing.assert_close(new, reference, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------------------------
# Each term in float64: the same values and gradients as autograd's backward of the direct form, and gradcheck.
# ---------------------------------------------------------------------------------------------------------------


def _vade_inputs(authors, learned_var, generator):
    log_joint, log_resp = _clustering(generator, torch.float64)
    trace = (torch.rand(LAYERS, HEADS, CLUSTERS, generator=generator, dtype=torch.float64) * 3 + 0.5).requires_grad_()
    if learned_var:
        posterior_var = (torch.rand(LAYERS, LENGTH, BATCH, HEADS, generator=generator, dtype=torch.float64) * 0.2
                         + 0.01).requires_grad_()
    else:
        posterior_var = 0.05
    log_prior_ = (torch.log_softmax(torch.randn(LAYERS, HEADS, CLUSTERS, generator=generator, dtype=torch.float64), -1)
                  .requires_grad_() if authors else None)
    return log_joint, log_resp, trace, posterior_var, log_prior_


@pytest.mark.parametrize("authors", [False, True], ids=["paper", "authors"])
@pytest.mark.parametrize("learned_var", [False, True], ids=["fixed_var", "learned_var"])
@pytest.mark.parametrize("resp_given", [False, True], ids=["resp_inside", "resp_given"])
def test_vade_kl_eq20(authors, learned_var, resp_given):
    log_joint, log_resp, trace, posterior_var, log_prior_ = _vade_inputs(authors, learned_var, _generator())
    valid = _padded()
    inputs = (log_joint, log_resp, trace, posterior_var, log_prior_)

    def run(fn):
        resp = clusters_first(log_resp).exp().movedim(0, -1) if resp_given else None
        value = fn(log_joint, log_resp, trace, HEAD_DIM, posterior_var, valid, resp, log_prior_)
        return value, _grads(value, inputs)

    _assert_same(*run(regularisers.vade_kl), *run(direct_vade_kl))
    differentiable = [x for x in inputs if isinstance(x, Tensor)]

    def as_function(*args):
        values = dict(zip([id(x) for x in differentiable], args))
        pick = lambda x: values.get(id(x), x) if isinstance(x, Tensor) else x
        return regularisers.vade_kl(pick(log_joint), pick(log_resp), pick(trace), HEAD_DIM, pick(posterior_var),
                                    valid, None, pick(log_prior_))

    assert torch.autograd.gradcheck(as_function, differentiable, fast_mode=True)


@pytest.mark.parametrize("squared", [True, False], ids=["paper", "authors"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_cluster_diversity_eq23(squared, padded):
    _, log_resp = _clustering(_generator(2), torch.float64)
    resp = clusters_first(log_resp).exp().movedim(0, -1).detach().requires_grad_()
    valid = _padded() if padded else torch.ones(LENGTH, BATCH, dtype=torch.float64)

    def run(fn):
        value = fn(resp, valid, 1.25, 0.75, squared)
        return value, _grads(value, [resp])

    _assert_same(*run(regularisers.cluster_diversity), *run(direct_cluster_diversity))
    assert torch.autograd.gradcheck(lambda r: regularisers.cluster_diversity(r, valid, 1.25, 0.75, squared), (resp,),
                                    fast_mode=True)


@pytest.mark.parametrize("squared", [False, True], ids=["authors_form", "squared"])
def test_cluster_diversity_eq23_unmasked(squared):
    """The authors' padded length: no mask at all (``unmasked``) equals the direct form with every position real."""
    _, log_resp = _clustering(_generator(4), torch.float64)
    resp = clusters_first(log_resp).exp().movedim(0, -1).detach().requires_grad_()
    valid = torch.ones(LENGTH, BATCH, dtype=torch.float64)

    def unmasked(r, v, alpha, beta, squared):
        weights = regularisers._SentenceWeights(v, r.size(0), r.size(-2))
        return regularisers._cluster_diversity(r, weights, alpha, beta, squared, unmasked=True)

    def run(fn):
        value = fn(resp, valid, 1.25, 0.75, squared)
        return value, _grads(value, [resp])

    _assert_same(*run(unmasked), *run(direct_cluster_diversity))
    assert torch.autograd.gradcheck(lambda r: unmasked(r, valid, 1.25, 0.75, squared), (resp,), fast_mode=True)


def _far_below_the_layer_max(log_joint_q):
    """Shift one sentence far below the others, so the authors' normalisers of that sentence sit at their clamp."""
    shift = torch.zeros_like(log_joint_q)
    shift[:, :, :, 0] = -40.0
    return (log_joint_q.detach() + shift).requires_grad_()


@pytest.mark.parametrize("clamped_normalisers", [False, True], ids=["unclamped", "clamped"])
def test_authors_token_given_cluster_eq17(clamped_normalisers):
    log_joint_q = clusters_first(_clustering(_generator(3), torch.float64, spread=1.0)[0]).detach().requires_grad_()
    if clamped_normalisers:
        log_joint_q = _far_below_the_layer_max(log_joint_q)
    p_new, clamped_new = regularisers.authors_token_given_cluster(log_joint_q)
    p_ref, clamped_ref = direct_authors_token_given_cluster(log_joint_q)
    assert torch.equal(clamped_new, clamped_ref) and bool(clamped_ref.any()) == clamped_normalisers
    _assert_same(p_new, _grads(p_new, [log_joint_q]), p_ref, _grads(p_ref, [log_joint_q]))
    assert torch.autograd.gradcheck(lambda x: regularisers.authors_token_given_cluster(x)[0], (log_joint_q,),
                                    fast_mode=True)


def test_token_given_cluster_eq17_over_real_tokens():
    log_joint_q = clusters_first(_clustering(_generator(4), torch.float64)[0]).detach().requires_grad_()
    valid = _padded()
    valid[:, -1] = 0.0  # a sentence of length 0 stays finite
    p_new = regularisers.token_given_cluster(log_joint_q, valid)
    p_ref = direct_token_given_cluster(log_joint_q, valid)
    _assert_same(p_new, _grads(p_new, [log_joint_q]), p_ref, _grads(p_ref, [log_joint_q]))
    assert torch.isfinite(p_new).all()
    assert torch.autograd.gradcheck(lambda x: regularisers.token_given_cluster(x, valid), (log_joint_q,),
                                    fast_mode=True)


@pytest.mark.parametrize("authors", [False, True], ids=["paper", "authors"])
@pytest.mark.parametrize("p_given", [False, True], ids=["p_inside", "p_given"])
def test_head_mi_upper_bound_eq21(authors, p_given):
    log_joint_q, log_resp_q = _clustering(_generator(5), torch.float64, spread=2.0)
    resp_q = clusters_first(log_resp_q).exp().movedim(0, -1).detach().requires_grad_()
    valid = torch.ones(LENGTH, BATCH, dtype=torch.float64) if authors else _padded()

    def run(head_mi, normaliser):
        p = None
        if p_given:
            p = normaliser(clusters_first(log_joint_q))
        value = head_mi(log_joint_q, resp_q, valid, authors, p_token_given_c=p)
        return value, _grads(value, [log_joint_q, resp_q])

    new_normaliser = (lambda x: regularisers.authors_token_given_cluster(x)[0]) if authors else \
        (lambda x: regularisers.token_given_cluster(x, valid))
    reference_normaliser = (lambda x: direct_authors_token_given_cluster(x)[0]) if authors else \
        (lambda x: direct_token_given_cluster(x, valid))
    _assert_same(*run(regularisers.head_mi_upper_bound, new_normaliser),
                 *run(direct_head_mi_upper_bound, reference_normaliser))
    assert torch.autograd.gradcheck(lambda x, r: regularisers.head_mi_upper_bound(x, r, valid, authors),
                                    (log_joint_q, resp_q), fast_mode=True)


@pytest.mark.parametrize("authors", [False, True], ids=["paper", "authors"])
def test_head_mi_value_of_the_diagnostics_eq21(authors):
    """The forward-only L_Dqq of the diagnostics (the other reading's) equals the direct form's value."""
    log_joint_q, log_resp_q = _clustering(_generator(9), torch.float64, spread=2.0)
    resp_q = clusters_first(log_resp_q).exp().detach()
    valid = torch.ones(LENGTH, BATCH, dtype=torch.float64) if authors else _padded()
    log_joint_cf = clusters_first(log_joint_q).detach()
    p = (regularisers.authors_token_given_cluster(log_joint_cf)[0] if authors
         else regularisers.token_given_cluster(log_joint_cf, valid))
    weights = regularisers._SentenceWeights(valid, LAYERS, HEADS).per_head_pair
    value = regularisers._head_mi_value(p, resp_q, weights, authors)
    reference = direct_head_mi_upper_bound(log_joint_q.detach(), resp_q.movedim(0, -1), valid, authors,
                                           p_token_given_c=p)
    torch.testing.assert_close(value, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_query_input_mi_lower_bound_eq22(padded):
    _, log_resp_q = _clustering(_generator(6), torch.float64, spread=2.0)
    resp_q = clusters_first(log_resp_q).exp().movedim(0, -1).detach().requires_grad_()
    valid = _padded() if padded else torch.ones(LENGTH, BATCH, dtype=torch.float64)

    def run(fn):
        value = fn(resp_q, valid)
        return value, _grads(value, [resp_q])

    _assert_same(*run(regularisers.query_input_mi_lower_bound), *run(direct_query_input_mi_lower_bound))
    assert torch.autograd.gradcheck(lambda r: regularisers.query_input_mi_lower_bound(r, valid), (resp_q,),
                                    fast_mode=True)


# ---------------------------------------------------------------------------------------------------------------
# One attention type's group_terms in float32 on a realistic shape, both readings: the same losses, diagnostic
# sums and gradients (to float32 rounding) as the direct forms.
# ---------------------------------------------------------------------------------------------------------------


def _group_inputs(authors, learned_var, cross, generator, layers=2, length=12, batch=8, heads=4, clusters=4,
                  head_dim=64):
    def per_layer(spread):
        joints, resps = [], []
        for _ in range(layers):
            log_joint, log_resp = _clustering(generator, torch.float32, 1, length, batch, heads, clusters, spread)
            joints.append(clusters_first(log_joint)[:, 0].detach().requires_grad_())  # stored clusters-first
            resps.append(clusters_first(log_resp)[:, 0].detach().requires_grad_())
        return joints, resps

    leaves = {}
    for kind, spread in (("z", 6.0), ("q", 2.0)) + ((("k", 6.0),) if cross else ()):
        leaves["log_joint_" + kind], leaves["log_resp_" + kind] = per_layer(spread)
    if cross and not authors:
        del leaves["log_joint_k"]  # the paper reading records only the keys' responsibilities
    log_vars = {}
    if learned_var:
        log_vars = {kind: [(torch.randn(length, batch, heads, generator=generator) * 0.3 - 3.0).requires_grad_()
                           for _ in range(layers)] for kind in ("z", "q") + (("k",) if cross else ())}
    gmm = {"z": ([(torch.randn(heads, clusters, head_dim, generator=generator) * 4).requires_grad_()
                  for _ in range(layers)],  # beyond the log-variance clamp in places
                 [torch.randn(heads, clusters, generator=generator).requires_grad_() for _ in range(layers)]),
           "q": ([torch.randn(1, clusters, head_dim, generator=generator).requires_grad_() for _ in range(layers)],
                 [torch.randn(1, clusters, generator=generator).requires_grad_() for _ in range(layers)])}
    real = _padded(length, batch, torch.float32)
    options = dict(authors=authors, head_dim=head_dim, num_heads=heads, posterior_var=0.01 if authors else 0.1,
                   alpha=1.25, beta=0.75, diagnose=True)
    return leaves, log_vars, gmm, real, options


@pytest.mark.parametrize("authors", [False, True], ids=["paper", "authors"])
@pytest.mark.parametrize("learned_var", [False, True], ids=["fixed_var", "learned_var"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_group_terms_match_the_direct_forms_in_float32(authors, learned_var, cross):
    leaves, log_vars, gmm, real, options = _group_inputs(authors, learned_var, cross, _generator(7))
    inputs = [x for group in leaves.values() for x in group] + [x for group in log_vars.values() for x in group] + \
             [x for pair in gmm.values() for group in pair for x in group]

    def run(fn):
        layers = {name: [x.movedim(0, -1) for x in group] for name, group in leaves.items()}
        losses, sums = fn(layers, log_vars, gmm, real, **options)
        total = sum((value * (index + 1.0)) for index, (_, value) in enumerate(sorted(losses.items())))
        return losses, sums, _grads(total, inputs)

    new_losses, new_sums, new_grads = run(regularisers.group_terms)
    ref_losses, ref_sums, ref_grads = run(partial(regularisers.group_terms, terms=DIRECT_TERMS))
    assert new_losses.keys() == ref_losses.keys() and new_sums.keys() == ref_sums.keys()
    for name in ref_losses:
        torch.testing.assert_close(new_losses[name], ref_losses[name], rtol=1e-5, atol=1e-6)
    for name in ref_sums:
        torch.testing.assert_close(new_sums[name], ref_sums[name], rtol=1e-5, atol=1e-6)
    for new, reference in zip(new_grads, ref_grads):
        assert (new is None) == (reference is None)
        if reference is not None:
            # float32 rounding, relative to the gradient's own scale
            scale = reference.abs().max().item()
            torch.testing.assert_close(new, reference, rtol=1e-4, atol=1e-5 * scale)
