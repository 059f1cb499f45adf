"""The SDMA core against the paper's equations, computed the direct (slow) way."""

import math

import pytest
import torch

from latent_core import sdma as core
from latent_core.sdma import mixture
from latent_core.sdma import GaussianMixture, SDMACore, SDMAOptions
from latent_core.sdma.core import add_standard_normal
from latent_core.sdma.reference import log_joint_direct


@pytest.fixture
def gmm():
    torch.manual_seed(0)
    g = GaussianMixture(3, 4, 5)
    with torch.no_grad():
        g.log_vars.normal_(0, 0.3)
        g.prior_logits.normal_()
    return g


def test_log_joint_and_responsibilities_eq9(gmm):
    z = torch.randn(7, 2, 3, 5, requires_grad=True)
    expected = log_joint_direct(gmm, z)
    normal = torch.distributions.Normal(gmm.means, (0.5 * gmm.log_vars).exp())
    by_hand = normal.log_prob(z[..., None, :]).sum(-1) + torch.log_softmax(gmm.prior_logits, -1)
    assert torch.allclose(expected, by_hand, atol=1e-5)
    assert torch.allclose(gmm.log_joint(z), expected, atol=1e-4)
    weight = torch.randn(expected.shape)
    inputs = [z, *gmm.parameters()]
    fast = torch.autograd.grad((gmm.log_joint(z) * weight).sum(), inputs)
    direct = torch.autograd.grad((expected * weight).sum(), inputs)
    for a, b in zip(fast, direct):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    resp = torch.softmax(gmm.log_joint(z), -1)
    assert torch.allclose(resp.sum(-1), torch.ones(7, 2, 3))


def test_vade_kl_eq20_matches_direct_formula(gmm):
    z = torch.randn(7, 2, 3, 5)
    log_joint = gmm.log_joint(z)
    log_resp = torch.log_softmax(log_joint, -1)
    resp = log_resp.exp()
    s2 = 0.1
    var = gmm.log_vars.exp()
    kl_gauss = 0.5 * (var.log() - math.log(s2) + (s2 + (z[..., None, :] - gmm.means) ** 2) / var - 1).sum(-1)
    kl_cat = resp * (log_resp - torch.log_softmax(gmm.prior_logits, -1))
    per_token_head = (resp * kl_gauss).sum(-1) + kl_cat.sum(-1)  # [T, B, H]
    valid = torch.ones(7, 2)
    valid[5:, 1] = 0  # sentence 1 has 5 tokens
    direct = torch.stack([per_token_head[:7, 0].mean(), per_token_head[:5, 1].mean()])  # one value per sentence
    kl = core.vade_kl(log_joint[None], log_resp[None], gmm.trace_precision()[None], gmm.dim, s2, valid)
    assert kl.shape == (2,)
    assert torch.allclose(kl, direct, atol=1e-4)


def test_cluster_diversity_eq23_matches_masked_matrix(gmm):
    resp = torch.softmax(torch.randn(6, 2, 3, 4), -1)
    valid = torch.ones(6, 2)
    valid[4:, 1] = 0
    alpha, beta = 1.25, 0.75
    per_sentence = []
    for b in range(2):
        n = int(valid[:, b].sum())
        per_head = []
        for h in range(3):
            c = resp[:n, b, h]
            eye = torch.eye(n)
            mask = alpha * eye + beta * (1 - eye)
            per_head.append(((mask * (c @ c.T - eye)) ** 2).sum() / n**2)
        per_sentence.append(torch.stack(per_head).mean())
    assert torch.allclose(core.cluster_diversity(resp[None], valid, alpha, beta), torch.stack(per_sentence),
                          atol=1e-6)


def test_head_mi_upper_bound_eq21_16_17(gmm):
    log_joint = torch.randn(5, 2, 3, 4)
    resp = torch.softmax(log_joint, -1)
    valid = torch.ones(5, 2)
    valid[3:, 0] = 0
    per_sentence = []
    for b in range(2):
        total, count = 0.0, 0
        n = int(valid[:, b].sum())
        lj = log_joint[:n, b]  # [n, H, C]
        p_given_c = torch.softmax(lj, dim=0)  # eq. 17: normalised over tokens
        for i in range(n):
            acc = 0.0
            for h in range(3):
                for h2 in range(3):
                    if h != h2:
                        p = (p_given_c[i, h] * resp[i, b, h2]).sum()  # eq. 16
                        acc += -torch.log(1 - p)
            total += acc / 9
            count += 1
        per_sentence.append(total / count)
    assert torch.allclose(core.head_mi_upper_bound(log_joint[None], resp[None], valid),
                          torch.stack(per_sentence).detach(), atol=1e-5)


def test_query_input_mi_lower_bound_eq22_19():
    resp = torch.softmax(torch.randn(5, 2, 3, 4), -1)
    valid = torch.ones(5, 2)
    valid[4:, 1] = 0
    per_sentence = []
    for b in range(2):
        n = int(valid[:, b].sum())
        vals = []
        for i in range(n):
            per_head = []
            for h in range(3):
                f = resp[:n, b, h] @ resp[i, b, h]  # f(q_i, x_j), eq. 19
                per_head.append(torch.log_softmax(f, 0)[i])
            vals.append(torch.stack(per_head).mean())
        per_sentence.append(torch.stack(vals).mean())
    assert torch.allclose(core.query_input_mi_lower_bound(resp[None], valid), torch.stack(per_sentence), atol=1e-6)


def test_masked_attention_eq2_and_mixing_eq11():
    scores = torch.randn(6, 4, 5)
    rq = torch.softmax(torch.randn(6, 4, 3), -1)
    rk = torch.softmax(torch.randn(6, 5, 3), -1)
    a = torch.softmax(scores, -1)
    m = core.semantic_mask(rq, rk)  # eq. 10
    assert torch.allclose(m.sum(-1), torch.ones(6, 4))
    a_bar = a * m / (a * m).sum(-1, keepdim=True)  # eq. 2
    g = torch.tensor(0.3)
    expected = (1 - g) * a + g * a_bar  # eq. 11
    product = core.semantic_mask_product(rq, rk)  # M up to its row normaliser
    assert torch.allclose(core.mix_attention(scores, product, g), expected, atol=1e-6)
    assert torch.allclose(core.mix_attention_direct(scores, product, g), expected, atol=1e-6)
    # the additive form the fused kernels use: softmax(scores + log M) is A_bar
    assert torch.allclose(torch.softmax(scores + product.log(), -1), a_bar, atol=1e-6)


def test_mixing_schedule():
    assert core.mixing_weight(0) == 0.0
    assert core.mixing_weight(1000) == pytest.approx(1 - math.exp(-0.5))
    assert core.mixing_weight(10**6) == pytest.approx(0.9)  # capped at nu
    assert core.mixing_weight(10**6, mix_max=0.5) == pytest.approx(0.5)


def test_centroid_gradient_multiplier():
    torch.manual_seed(0)
    z = torch.randn(4, 2, 3)
    grads = []
    for scale in (1.0, 10.0):
        torch.manual_seed(1)
        g = GaussianMixture(2, 3, 3, centroid_grad_scale=scale)
        g.log_joint(z).logsumexp(-1).sum().backward()
        grads.append((g.means.grad.clone(), g.log_vars.grad.clone()))
    assert torch.allclose(grads[1][0], 10 * grads[0][0])
    assert torch.allclose(grads[1][1], grads[0][1])  # only the means are scaled


def test_collapsed_cluster_and_low_precision_stay_finite():
    core_mod = SDMACore(16, 2, SDMAOptions(clusters=3, query_clusters=3))
    with torch.no_grad():
        core_mod.feature_gmm.means[:, 0] = 1e4  # a cluster nobody belongs to
        core_mod.feature_gmm.prior_logits[:, 1] = -1e4  # and one with no prior mass
        core_mod.feature_gmm.log_vars[:, 2] = -50.0  # and one that collapsed to a point
    x = torch.randn(5, 2, 16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        lj, lr = core_mod.cluster(x.to(dtype))
        q = x.to(dtype).view(5, 2, 2, 8)
        ljq, lrq = core_mod.cluster_queries(q)
        losses = core_mod.regularisers(lj, lr, torch.ones(5, 2), ljq, lrq)
        for name, value in losses.items():
            assert torch.isfinite(value).all(), (dtype, name)
        resp = core_mod.heads_first(lr.exp())
        att = core.mix_attention(torch.randn(4, 5, 5), core.semantic_mask_product(resp, resp), torch.tensor(0.9))
        assert torch.isfinite(att).all()
        assert torch.allclose(att.sum(-1), torch.ones(4, 5), atol=1e-5)


def test_gradients_reach_both_gmms_and_inputs():
    torch.manual_seed(0)
    core_mod = SDMACore(16, 2, SDMAOptions(clusters=3, query_clusters=3))
    x = torch.randn(5, 2, 16, requires_grad=True)
    q = torch.randn(5, 2, 2, 8, requires_grad=True)
    lj, lr = core_mod.cluster(x)
    ljq, lrq = core_mod.cluster_queries(q)
    losses = core_mod.regularisers(lj, lr, torch.ones(5, 2), ljq, lrq)
    sum(v.sum() for v in losses.values()).backward()
    for name, p in core_mod.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0 and q.grad.abs().sum() > 0


def test_sma_mode_has_no_query_gmm():
    assert SDMACore(16, 2, SDMAOptions(mode="sma")).query_gmm is None
    assert SDMACore(16, 2, SDMAOptions(mode="sdma")).query_gmm is not None


@pytest.mark.parametrize(
    "kwargs, option",
    [
        (dict(clusters=0), "--sdma-clusters"),
        (dict(query_clusters=-2), "--sdma-query-clusters"),
        (dict(mix_max=0.0), "--sdma-mix-max"),
        (dict(mix_max=1.5), "--sdma-mix-max"),
        (dict(noise_var=-1.0), "--sdma-noise-var"),
        (dict(mode="sparse"), "--sdma-mode"),
    ],
)
def test_bad_options_name_the_option(kwargs, option):
    with pytest.raises(core.SDMAConfigError, match=option):
        SDMAOptions(**kwargs).validate()


def test_heads_must_divide_embedding():
    with pytest.raises(core.SDMAConfigError, match=r"num_heads=3 must be >= 1 and divide embed_dim=10 \(choose one of 1, 2, 5, 10\)"):
        SDMACore(10, 3, SDMAOptions())


def test_layer_batched_losses_equal_the_mean_of_per_layer_losses():
    torch.manual_seed(0)
    cores = [SDMACore(16, 2, SDMAOptions(clusters=3, query_clusters=3)) for _ in range(3)]
    valid = torch.ones(5, 2)
    valid[3:, 1] = 0
    inputs = []
    for c in cores:
        x = torch.randn(5, 2, 16)
        lj, lr = c.cluster(x)
        ljq, lrq = c.cluster_queries(torch.randn(5, 2, 2, 8))
        inputs.append((lj, lr, valid, ljq, lrq))
    single = [c.regularisers(*args) for c, args in zip(cores, inputs)]
    with core.recording() as records:
        for c, args in zip(cores, inputs):
            c.record(*args)
    batched = core.sdma_losses([(c, records.get(c)) for c in cores])
    for name in core.LOSS_NAMES:
        assert batched[name].shape == (2,), name
        assert torch.allclose(batched[name], torch.stack([s[name] for s in single]).mean(0), atol=1e-5), name


def _log_joint_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(6, 2 * 3, dtype=torch.double, generator=g)
    means = torch.randn(2, 4, 3, dtype=torch.double, generator=g)
    log_vars = 0.3 * torch.randn(2, 4, 3, dtype=torch.double, generator=g)
    prior = torch.randn(2, 4, dtype=torch.double, generator=g)
    return flat, means, log_vars, prior


def _log_joint_node(flat, means, log_vars, prior, *more_rows, scale=1.0):
    return mixture._GaussianLogJoint.apply(scale, means, log_vars, prior, flat, *more_rows)


@pytest.mark.parametrize("needs_grad", [(True, True, True, True), (False, True, True, True),
                                        (True, False, False, False), (False, False, True, False)],
                         ids=["all", "parameters", "input", "log_vars"])
def test_gaussian_log_joint_gradients(needs_grad):
    """The written-out backward pass against finite differences, for any subset of inputs needing a gradient."""
    inputs = [t.requires_grad_(n) for t, n in zip(_log_joint_inputs(), needs_grad)]
    assert torch.autograd.gradcheck(_log_joint_node, inputs)


def test_gaussian_log_joint_gradients_of_several_inputs_at_a_scale():
    """Two inputs (a cross-attention's queries and keys, saved apart) and the authors' 1/10 folded in."""
    inputs = [t.requires_grad_() for t in _log_joint_inputs()]
    keys = torch.randn(4, 6, dtype=torch.double, generator=torch.Generator().manual_seed(5)).requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: _log_joint_node(*a, scale=0.1), [*inputs, keys])
    flat, means, log_vars, prior = inputs
    joint = _log_joint_node(flat, means, log_vars, prior, keys, scale=0.1)
    apart = [_log_joint_node(x * 0.1, means, log_vars, prior) for x in (flat, keys)]
    torch.testing.assert_close(joint, torch.cat(apart))


def test_gaussian_log_joint_gradients_at_the_log_variance_clamp():
    """Log-variances beyond the clamp range get no gradient (as torch.clamp), those inside one."""
    flat, means, log_vars, prior = _log_joint_inputs()
    low, high = mixture.LOGVAR_RANGE
    log_vars[0, 0, 0], log_vars[1, 2, 1] = high + 3.0, low - 1.0
    inputs = [t.requires_grad_(True) for t in (flat, means, log_vars, prior)]
    assert torch.autograd.gradcheck(_log_joint_node, inputs)
    grad = torch.autograd.grad(_log_joint_node(*inputs).sum(), log_vars)[0]
    assert grad[0, 0, 0] == 0 and grad[1, 2, 1] == 0 and (grad != 0).sum() == grad.numel() - 2


def test_gaussian_log_joint_half_precision_parameters_get_their_own_dtype():
    """fairseq --fp16 keeps the GMM in float16: the density is computed in float32 and each
    parameter's gradient comes back in float16, equal to the float32 direct formula's."""
    torch.manual_seed(0)
    half = GaussianMixture(3, 4, 5).half()
    with torch.no_grad():
        half.log_vars.normal_(0, 0.3)
    full = GaussianMixture(3, 4, 5)
    full.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    z = torch.randn(7, 2, 3, 5, requires_grad=True)
    out = half.log_joint(z)
    assert out.dtype == torch.float32
    weight = torch.randn_like(out)
    grads = torch.autograd.grad((out * weight).sum(), [z, *half.parameters()])
    expected = torch.autograd.grad((log_joint_direct(full, z) * weight).sum(), [z, *full.parameters()])
    assert [g.dtype for g in grads] == [torch.float32, torch.float16, torch.float16, torch.float16]
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3 * float(want.abs().max()))


def test_joint_clustering_equals_clustering_each_input():
    """A cross-attention's queries [T, B, E] and keys [S, B, E] clustered in one density evaluation
    give each one's log-joint and log p(c|z), and the same gradients, as two separate calls."""
    torch.manual_seed(0)
    module = SDMACore(12, 3, SDMAOptions(clusters=4))
    with torch.no_grad():
        module.feature_gmm.log_vars.normal_(0, 0.3)
    queries, keys = torch.randn(5, 2, 12, requires_grad=True), torch.randn(7, 2, 12, requires_grad=True)
    inputs = [queries, keys, *module.feature_gmm.parameters()]
    joint = module.cluster_jointly([queries, keys])
    separate = [module.cluster(queries), module.cluster(keys)]
    weights = [torch.randn(n, 2, 3, 4) for n in (5, 7)]

    def loss(clustered):
        return sum(((j + r.exp()) * w).sum() for (j, r), w in zip(clustered, weights))

    for (j1, r1), (j2, r2) in zip(joint, separate):
        assert j1.shape == j2.shape and r1.shape == r2.shape
        torch.testing.assert_close(j1, j2)
        torch.testing.assert_close(r1, r2)
    for a, b in zip(torch.autograd.grad(loss(joint), inputs), torch.autograd.grad(loss(separate), inputs)):
        torch.testing.assert_close(a, b)
    single = module.cluster_jointly([queries])
    assert len(single) == 1 and torch.equal(single[0][0], separate[0][0])


@pytest.mark.parametrize("groups", [1, 3], ids=["query GMM", "feature GMM"])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_log_joint_is_stored_clusters_first_and_equals_the_direct_form(groups, grad):
    """The transposed products (W^T z^T) give the direct form's values and gradients, stored clusters-first (one
    group: the product itself, no copy)."""
    torch.manual_seed(0)
    gmm = GaussianMixture(groups, 4, 6)
    with torch.no_grad():
        gmm.log_vars.normal_(0, 0.3)
    z = torch.randn(9, 2, groups, 6, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        out = gmm.log_joint(z)
    assert out.shape == (9, 2, groups, 4) and mixture.clusters_first(out).is_contiguous()
    torch.testing.assert_close(out, log_joint_direct(gmm, z), rtol=1e-4, atol=1e-4)
    if grad:
        weight = torch.randn(out.shape)
        inputs = [z, *gmm.parameters()]
        for a, b in zip(torch.autograd.grad((out * weight).sum(), inputs),
                        torch.autograd.grad((log_joint_direct(gmm, z) * weight).sum(), inputs)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_noise_is_drawn_in_the_input_layout():
    """eq. (8)'s eps is laid out as x (fairseq's transposed [T, B, C] view), N(0, sigma^2), fresh at each call; for a
    contiguous x it is torch.randn's draw of x's shape (the same stream as before the layout rule)."""
    module = SDMACore(16, 2, SDMAOptions(noise_var=0.04))
    x = torch.zeros(300, 20, 16).transpose(0, 1)  # [T, B, C] over [B, T, C] storage
    assert add_standard_normal(x, 0.2).stride() == x.stride()  # one layout: the add reads both in one order
    # the sum is written into the draw, not into a view of it (that would cost a clone and a copy in backward)
    traced = add_standard_normal(x.clone().requires_grad_(True), 0.2)
    assert "CopySlices" not in type(traced.grad_fn.next_functions[0][0]).__name__
    noisy = module.perturb(x, training=True)
    assert noisy.shape == x.shape and noisy.stride() == x.stride()
    assert abs(float(noisy.mean())) < 0.01 and abs(float(noisy.std()) - 0.2) < 0.01
    assert not torch.equal(noisy, module.perturb(x, training=True))
    assert torch.equal(module.perturb(x, training=False), x)
    plain = torch.zeros(5, 3, 16)
    torch.manual_seed(7)
    drawn = module.perturb(plain, training=True)
    torch.manual_seed(7)
    torch.testing.assert_close(drawn, 0.2 * torch.randn(5, 3, 16))


def test_learned_variance_noise_is_per_position_and_head():
    """The authors' ESPnet ``var_estimation``: z = x + exp(log_var / 2) eps, one standard deviation per position
    and head (``log_var [..., n_h]``), eps the stream of ``torch.randn(x.shape)``; the gradient reaches x and
    log_var. Also for fairseq's transposed x."""
    module = SDMACore(16, 2, SDMAOptions(noise_var=0.04))
    for x in (torch.randn(5, 3, 16), torch.randn(3, 5, 16).transpose(0, 1)):
        x.requires_grad_(True)
        log_var = torch.randn(5, 3, 2, requires_grad=True)
        torch.manual_seed(3)
        noisy = module.perturb(x, training=True, log_var=log_var)
        torch.manual_seed(3)
        eps = torch.randn(5, 3, 2, 8)
        expected = x + (eps * torch.exp(0.5 * log_var)[..., None]).view(5, 3, 16)
        torch.testing.assert_close(noisy, expected)
        weight = torch.randn(5, 3, 16)
        got = torch.autograd.grad((noisy * weight).sum(), (x, log_var))
        want = torch.autograd.grad((expected * weight).sum(), (x, log_var))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_inference_uses_parameters_written_through_data(gmm):
    """fairseq's FP16Optimizer writes the fp32 master weights with ``p.data.copy_``: neither the
    version counter nor the storage changes, so inference must not reuse earlier weights."""
    z = torch.randn(4, 2, 3, 5)
    with torch.no_grad():
        gmm.log_joint(z)  # an earlier validation pass
        new_means = gmm.means.detach() + 0.5
        gmm.means.data.copy_(new_means)
        gmm.log_vars.data.mul_(0.5)
        gmm.prior_logits.data.add_(torch.randn_like(gmm.prior_logits))
        after = gmm.log_joint(z)
    assert torch.allclose(after, log_joint_direct(gmm, z), atol=1e-4)
    assert torch.allclose(after, gmm.log_joint(z).detach(), atol=1e-5)  # grad-mode path agrees


def test_sentence_scaled_regulariser_is_extensive():
    """Two copies of a batch give twice the 'sentence' term; 'batch' stays; 'token' scales with tokens."""
    per_sentence = torch.tensor([0.5, 2.0, 1.5])
    doubled = per_sentence.repeat(2)
    assert core.scale_regulariser(per_sentence, "sentence", 12) == pytest.approx(4.0)
    assert core.scale_regulariser(doubled, "sentence", 24) == pytest.approx(8.0)
    assert core.scale_regulariser(doubled, "batch", 24) == pytest.approx(4.0 / 3)
    assert core.scale_regulariser(per_sentence, "token", 12) == pytest.approx(16.0)
    assert core.scale_regulariser(torch.zeros(()), "sentence", 12) == 0.0  # V-T: no SDMA module ran
    with pytest.raises(core.SDMAConfigError, match="tokens"):
        core.scale_regulariser(per_sentence, "tokens", 12)


def test_nan_diagnosis_names_the_first_non_finite_parameter_or_activation():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    assert core.first_nonfinite_parameter(model) is None
    assert core.first_nonfinite_activation(model, lambda: model(x)) is None
    assert core.diagnose_nonfinite(model, lambda: model(x)).startswith("All parameters are finite and re-running")

    with torch.no_grad():  # an overflow inside the network: finite parameters, inf activation
        model[0].weight.fill_(1e38)
    message = core.diagnose_nonfinite(model, lambda: model(x * 10))
    assert "first non-finite activation: output of 0 (Linear)" in message and "its inputs were finite" in message

    with torch.no_grad():
        model[0].weight.fill_(0.1)
        model[2].bias[1] = float("nan")
    assert core.diagnose_nonfinite(model, lambda: model(x)) == \
        "First non-finite parameter 2.bias [2]: 1 of 2 values non-finite"
    assert "its inputs were already non-finite" in core.first_nonfinite_activation(
        model, lambda: model(x.masked_fill(torch.zeros_like(x, dtype=torch.bool).index_fill(1, torch.tensor([0]), True),
                                           float("nan"))))


def test_check_finite_runs_the_diagnosis_only_on_failure():
    def diagnose():
        raise AssertionError("the hot path must not diagnose")

    core.check_finite({"kl_z": torch.zeros(3)}, "advice", diagnose=diagnose)
    with pytest.raises(FloatingPointError, match=r"SDMA loss term 'dqq' is nan .* First non-finite buffer b \[1\]"):
        core.check_finite({"kl_z": torch.zeros(3), "dqq": torch.tensor([0.0, float("nan")])}, "advice",
                          diagnose=lambda: "First non-finite buffer b [1]: 1 of 1 values non-finite")


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "1"])
def test_one_loss_weight_validator_names_the_option_and_the_symbol(value):
    with pytest.raises(core.SDMAConfigError, match=r"model_conf\.sdma_dqq_weight=.*lambda_q of eq\. \(24\)"):
        core.check_loss_weight("sdma_dqq_weight", value, "model_conf.sdma_dqq_weight")
    assert core.check_loss_weight("sdma_dqq_weight", 30, "--sdma-dqq-weight") == 30.0


def test_mixed_attention_gradients_equal_autograd_of_eq_2_and_11():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    scores[0, :, -2:] = float("-inf")  # padded keys
    mask = torch.rand(3, 4, 6, generator=g, dtype=torch.float64) + 1e-6
    mix = torch.tensor(0.35, dtype=torch.float64)
    s1, m1 = scores.clone().requires_grad_(), mask.clone().requires_grad_()
    out = core.mix_attention(s1, m1, mix)
    s2, m2 = scores.clone().requires_grad_(), mask.clone().requires_grad_()
    expected = core.mix_attention_direct(s2, m2, mix)
    torch.testing.assert_close(out, expected)
    weight = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    torch.testing.assert_close(s1.grad, s2.grad)
    torch.testing.assert_close(m1.grad, m2.grad)
    assert s1.grad[0, :, -2:].abs().max() == 0
    finite = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    positive = (torch.rand(2, 3, 5, dtype=torch.float64) + 0.1).requires_grad_()
    assert torch.autograd.gradcheck(lambda s, m: core.mix_attention(s, m, torch.tensor(0.6, dtype=torch.float64)),
                                    (finite, positive))


def test_a_deep_copy_keeps_the_centroid_gradient_scale():
    """c_g is applied where the means are used, not hooked onto the parameter: copy.deepcopy (fairseq's EMA, PEFT's
    modules_to_save of a frozen core) and a copy frozen then unfrozen keep it, and it is applied once."""
    import copy

    torch.manual_seed(0)
    gmm = GaussianMixture(2, 3, 4, centroid_grad_scale=10.0)
    frozen = copy.deepcopy(gmm).requires_grad_(False)
    copied, thawed = copy.deepcopy(copy.deepcopy(gmm)), copy.deepcopy(frozen).requires_grad_(True)
    z = torch.randn(5, 2, 4)
    for module in (gmm, copied, thawed):
        module.log_joint(z).sum().backward()
    torch.testing.assert_close(copied.means.grad, gmm.means.grad)
    torch.testing.assert_close(thawed.means.grad, gmm.means.grad)
    plain = GaussianMixture(2, 3, 4)
    plain.load_state_dict(gmm.state_dict())
    plain.log_joint(z).sum().backward()
    torch.testing.assert_close(gmm.means.grad, 10 * plain.means.grad)


@pytest.mark.parametrize("path", ["autograd node", "no grad"])
def test_an_input_scale_is_folded_into_the_density(gmm, path):
    """log_joint(z, scale=s) == log_joint(s z) (the authors' x / 10) in values and in the gradients of z and of
    every GMM parameter, on each of log_joint's two paths, without materialising s z."""
    z = torch.randn(7, 2, 3, 5, requires_grad=True)
    weight = torch.randn(7, 2, 3, 4)
    inputs = [z, *gmm.parameters()]
    with torch.set_grad_enabled(path != "no grad"):
        folded = gmm.log_joint(z, scale=0.1)
        scaled = log_joint_direct(gmm, z * 0.1)
    torch.testing.assert_close(folded, scaled, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(log_joint_direct(gmm, z, scale=0.1), scaled)
    if path == "no grad":
        return
    got = torch.autograd.grad((folded * weight).sum(), inputs)
    want = torch.autograd.grad((scaled * weight).sum(), inputs)
    for name, a, b in zip(("z", "prior_logits", "means", "log_vars"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


def test_the_authors_clean_clustering_input_is_clustered_at_a_tenth():
    """Authors reading with c_g <= 1: the clean x, clustered as x / 10 (their grad_multiplier == 1 branch)."""
    core = SDMACore(8, 2, SDMAOptions(clusters=3, reading="authors", centroid_grad_scale=1.0, noise_var=0.5))
    x = torch.randn(5, 2, 8)
    cluster_input, z = core.sample(x, training=True)
    assert cluster_input is x and not torch.equal(z, x) and core.clustering_scale == 0.1
    torch.testing.assert_close(core.cluster(x, scale=core.clustering_scale)[0], core.cluster(x / 10)[0],
                               rtol=1e-5, atol=1e-5)
    for options in (SDMAOptions(clusters=3, reading="authors"), SDMAOptions(clusters=3, reading="paper")):
        assert SDMACore(8, 2, options).clustering_scale == 1.0
