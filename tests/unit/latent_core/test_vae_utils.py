"""The shared VAE utilities (latent_core/vae) against hand-computed values and closed forms."""

import math

import pytest
import torch
from torch.distributions import MultivariateNormal, Normal, kl_divergence

from latent_core.vae import (
    AutoEncoderPhase,
    ConstantSchedule,
    CyclicalSchedule,
    DiagonalGaussian,
    KLRegularizer,
    LinearSchedule,
    VAEConfigError,
    active_units,
    elbo_terms,
    importance_weighted_log_likelihood,
    mutual_information,
    parse_beta_schedules,
    parse_schedule,
    perplexity,
    principal_variance_shares,
    regularize_latents,
    standard_normal_log_prob,
)


def generator(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------
# Distributions
# ----------------------------------------------------------------------------


@pytest.fixture
def gaussian():
    torch.manual_seed(0)
    return torch.randn(4, 3), torch.randn(4, 3) * 0.5


def test_log_prob_kl_entropy_match_torch_distributions(gaussian):
    mean, logvar = gaussian
    q = DiagonalGaussian(mean, logvar)
    ref = Normal(mean, torch.exp(0.5 * logvar))
    z = torch.randn(5, 4, 3)  # a leading sample dimension broadcasts over the batch
    assert torch.allclose(q.log_prob(z), ref.log_prob(z).sum(-1), atol=1e-5)
    assert torch.allclose(q.kl_standard_normal(), kl_divergence(ref, Normal(0.0, 1.0)), atol=1e-6)
    assert torch.allclose(q.entropy(), ref.entropy().sum(-1), atol=1e-6)
    assert torch.allclose(standard_normal_log_prob(z), Normal(0.0, 1.0).log_prob(z).sum(-1))


def test_rsample_shapes_and_gradients_reach_mean_and_logvar(gaussian):
    mean, logvar = (t.clone().requires_grad_(True) for t in gaussian)
    q = DiagonalGaussian(mean, logvar)
    assert q.rsample().shape == (4, 3)
    z = q.rsample(5, generator=generator(1))
    assert z.shape == (5, 4, 3)
    z.sum().backward()
    eps = torch.randn(5, 4, 3, generator=generator(1))
    assert torch.allclose(mean.grad, torch.full((4, 3), 5.0))
    # dz/dlogvar = eps * sigma / 2
    assert torch.allclose(logvar.grad, (eps * 0.5 * torch.exp(0.5 * logvar.detach())).sum(0), atol=1e-6)


def test_extreme_logvar_is_clamped_and_half_precision_is_computed_in_float32():
    q = DiagonalGaussian(torch.zeros(2, 2), torch.tensor([[1000.0, -1000.0], [50.0, -50.0]]))
    assert torch.isfinite(q.kl_standard_normal()).all() and torch.isfinite(q.log_prob(torch.ones(2, 2))).all()
    half = DiagonalGaussian(torch.zeros(3, dtype=torch.float16), torch.full((3,), 15.0, dtype=torch.float16))
    kl = half.kl_standard_normal()  # exp(15) overflows float16
    assert kl.dtype == torch.float32 and torch.isfinite(kl).all()
    assert half.rsample().dtype == torch.float16


# ----------------------------------------------------------------------------
# KL regularisers. Per-dimension KL of 2 examples x 3 dimensions:
#   row sums 1.32 and 0.82; batch means per dimension 0.07, 0.15, 0.85; mean row sum 1.07
# ----------------------------------------------------------------------------

KL = [[0.02, 0.30, 1.00], [0.12, 0.00, 0.70]]


@pytest.mark.parametrize("variant, lam, scope, granularity, penalty", [
    ("beta", 0.0, "example", "dimension", 2.14),
    ("beta", 0.1, "batch", "latent", 2.14),  # lambda and scope do not matter
    # max(0.1, .): (0.1 + 0.3 + 1.0) + (0.12 + 0.1 + 0.7)
    ("free_bits", 0.1, "example", "dimension", 2.32),
    # KL [KL > 0.1]: (0 + 0.3 + 1.0) + (0.12 + 0 + 0.7)
    ("hinge", 0.1, "example", "dimension", 2.12),
    # 2 x (max(0.1, 0.07) + 0.15 + 0.85)
    ("free_bits", 0.1, "batch", "dimension", 2.2),
    # 2 x (0 + 0.15 + 0.85)
    ("hinge", 0.1, "batch", "dimension", 2.0),
    # max(1.2, 1.32) + max(1.2, 0.82)
    ("free_bits", 1.2, "example", "latent", 2.52),
    # 1.32 + 0
    ("hinge", 1.2, "example", "latent", 1.32),
    # 2 x max(1.2, 1.07)
    ("free_bits", 1.2, "batch", "latent", 2.4),
    # 2 x 1.07 [1.07 > 1.0], then 2 x 0
    ("hinge", 1.0, "batch", "latent", 2.14),
    ("hinge", 1.2, "batch", "latent", 0.0),
])
def test_kl_variants_and_scopes_by_hand(variant, lam, scope, granularity, penalty):
    term = KLRegularizer(variant, lam, scope, granularity)(torch.tensor(KL), beta=0.5, name="z")
    assert term.penalty.item() == pytest.approx(penalty, abs=1e-6)
    assert term.loss.item() == pytest.approx(0.5 * penalty, abs=1e-6)
    assert term.kl.tolist() == pytest.approx([1.32, 0.82], abs=1e-6)  # raw, for logging


def test_free_bits_and_hinge_give_no_gradient_below_lambda():
    for variant in ("free_bits", "hinge"):
        kl = torch.tensor(KL, requires_grad=True)
        KLRegularizer(variant, 0.1)(kl, beta=0.5).loss.backward()
        assert kl.grad.tolist() == [[0.0, 0.5, 0.5], [0.5, 0.0, 0.5]]


def test_regularize_latents_weights_each_latent_by_its_beta():
    kls = {"z_sem": torch.tensor(KL), "z_syn": torch.tensor(KL) * 2}
    total, terms = regularize_latents(kls, {"z_sem": 0.6, "z_syn": 0.0}, KLRegularizer("free_bits", 0.1))
    assert total.item() == pytest.approx(0.6 * 2.32, abs=1e-6)
    assert terms["z_syn"].loss.item() == 0.0
    assert terms["z_syn"].kl.tolist() == pytest.approx([2.64, 1.64], abs=1e-6)
    with pytest.raises(VAEConfigError, match="no beta for latent.*z_syn"):
        regularize_latents(kls, {"z_sem": 0.6}, KLRegularizer())


@pytest.mark.parametrize("kwargs, match", [
    (dict(variant="free-bits"), r"--kl-variant='free-bits' is not one of beta, free_bits, hinge"),
    (dict(scope="dataset"), r"--kl-scope='dataset' is not one of example, batch"),
    (dict(granularity="group"), r"--kl-granularity='group' is not one of dimension, latent"),
    (dict(threshold=-0.05), r"--kl-threshold=-0.05"),
])
def test_regularizer_config_errors_name_the_option(kwargs, match):
    with pytest.raises(VAEConfigError, match=match):
        KLRegularizer(**kwargs)
    assert issubclass(VAEConfigError, ValueError)


def test_negative_beta_and_non_finite_kl_name_the_latent():
    reg = KLRegularizer("free_bits", 0.05)
    with pytest.raises(VAEConfigError, match="beta of latent z_syn is -0.1"):
        reg(torch.tensor(KL), beta=-0.1, name="z_syn")
    for bad, word in ((float("nan"), "nan"), (float("inf"), "inf")):
        kl = torch.tensor(KL)
        kl[1, 2] = bad
        with pytest.raises(FloatingPointError, match=f"KL of latent z_syn is {word}"):
            reg(kl, beta=0.3, name="z_syn")


# ----------------------------------------------------------------------------
# Beta schedules
# ----------------------------------------------------------------------------


def test_linear_schedule_qkvae_window():
    s = LinearSchedule(3000, 6000, 0.6)
    expected = {0: 0.0, 3000: 0.0, 3001: 0.0002, 4500: 0.3, 6000: 0.6, 20000: 0.6}
    for step in (20000, 0, 4500, 3001, 6000, 3000):  # a pure function: any order
        assert s(step) == pytest.approx(expected[step])
    assert repr(s) == "LinearSchedule(start=3000, end=6000, beta_max=0.6)"


def test_cyclical_schedule_boundaries():
    s = CyclicalSchedule(n_cycles=10, total_steps=1000)  # period 100: 50 zero, 25 up, 25 flat
    expected = {0: 0.0, 49: 0.0, 50: 0.0, 60: 0.4, 70: 0.8, 74: 0.96, 75: 1.0, 99: 1.0,
                100: 0.0, 149: 0.0, 160: 0.4, 975: 1.0, 999: 1.0, 1000: 1.0, 5000: 1.0}
    assert {t: s(t) for t in expected} == pytest.approx(expected)
    assert CyclicalSchedule(10, 1000, beta_max=0.5)(60) == pytest.approx(0.2)
    uneven = CyclicalSchedule(3, 100)  # period 33.33: zeros 0-16, the ramp from 17
    assert uneven(17) == 0.0 and uneven(18) == pytest.approx(0.12) and uneven(33) == 0.0  # as Optimus: a cycle at
    # int(c * period), its ramp from one 0 (tests/unit/latent_core/test_optimus_schedule.py)


def test_constant_and_autoencoder_phase():
    assert ConstantSchedule(0.3)(123456) == 0.3
    s = AutoEncoderPhase(100, ConstantSchedule(0.5))
    assert (s(0), s(99), s(100)) == (0.0, 0.0, 0.5)


def test_parse_qkvae_spec_one_window_per_latent():
    spec = "z_sem=linear:3000:6000:0.6,z_syn=linear:7000:20000:0.3"
    betas = parse_beta_schedules(spec, ["z_syn", "z_sem"])
    assert betas["z_sem"] == LinearSchedule(3000, 6000, 0.6)
    assert betas["z_syn"] == LinearSchedule(7000, 20000, 0.3)
    assert (betas["z_sem"](4500), betas["z_syn"](4500)) == (pytest.approx(0.3), 0.0)


def test_parse_cyclical_default_and_autoencoder_steps():
    betas = parse_beta_schedules("cyclical:10:0.5:0.25:0.25", ["z"], ae_steps=160, total_updates=1000)
    assert betas["z"] == AutoEncoderPhase(160, CyclicalSchedule(10, 1000))
    assert (betas["z"](75), betas["z"](160), betas["z"](175)) == (0.0, pytest.approx(0.4), 1.0)
    explicit = parse_schedule("cyclical:1:0.5:0.25:0.25:0.8:400", total_updates=1000)
    assert explicit == CyclicalSchedule(1, 400, beta_max=0.8)
    mixed = parse_beta_schedules("constant:0.1, z_syn=linear:0:10:1", ["z_sem", "z_syn"])
    assert mixed == {"z_sem": ConstantSchedule(0.1), "z_syn": LinearSchedule(0, 10, 1.0)}


@pytest.mark.parametrize("spec, match", [
    ("sigmoid:1", r"unknown schedule 'sigmoid'; known: constant, linear, cyclical"),
    ("linear:6000:3000:0.6", r"end=3000 must be > start=6000"),
    ("linear:3000:3000:0.6", r"end=3000 must be > start=3000"),
    ("linear:0:10:-1", r"beta_max=-1.0 must be a finite number >= 0"),
    ("constant:-0.5", r"beta=-0.5 must be"),
    ("constant:abc", r"BETA='abc' is not a number"),
    ("linear:3000.5:6000:0.6", r"START='3000.5' is not an integer"),
    ("linear:3000:6000", r"expected linear:START:END:BETA_MAX"),
    ("cyclical:10:0.5:0.3:0.3", r"must sum to 1"),
    ("cyclical:10:1.5:-0.25:-0.25", r"zero_ratio=1.5 must lie in \[0, 1\]"),
    ("cyclical:0:0.5:0.25:0.25:1:100", r"n_cycles=0 must be an integer >= 1"),
    ("zsyn=constant:0.1", r"unknown latent 'zsyn'; the latents are z_sem, z_syn"),
    ("z_sem=constant:0.1", r"no schedule for latent\(s\) z_syn"),
    ("z_sem=constant:0.1,z_sem=constant:0.2", r"two schedules for z_sem"),
])
def test_schedule_spec_errors(spec, match):
    with pytest.raises(VAEConfigError, match=match) as err:
        parse_beta_schedules(spec, ["z_sem", "z_syn"], total_updates=1000)
    assert "--beta-schedule" in str(err.value)


def test_cyclical_without_length_and_negative_autoencoder_steps():
    with pytest.raises(VAEConfigError, match="--beta-schedule.*needs the total number of updates"):
        parse_beta_schedules("cyclical:10:0.5:0.25:0.25", ["z"])
    with pytest.raises(VAEConfigError, match="--ae-steps=-1"):
        parse_beta_schedules("constant:1", ["z"], ae_steps=-1)


# ----------------------------------------------------------------------------
# Importance-weighted bound on a linear-Gaussian model with a closed-form log p(x):
#   z ~ N(0, I_3), x | z ~ N(W z + b, s^2 I_4), log p(x) = log N(x; b, W W^T + s^2 I).
# W has orthogonal columns, so the exact posterior is diagonal:
#   precision 1 + |w_j|^2 / s^2, mean = Sigma W^T (x - b) / s^2.
# The latent is split into two named latents, "a" (2 dims) and "b" (1 dim).
# ----------------------------------------------------------------------------


class LinearGaussian:
    def __init__(self, batch=8):
        g = generator(3)
        q, _ = torch.linalg.qr(torch.randn(4, 3, generator=g, dtype=torch.float64))
        self.w = q * torch.tensor([1.5, 0.7, 2.0], dtype=torch.float64)
        self.b = torch.randn(4, generator=g, dtype=torch.float64)
        self.s = 0.6
        z = torch.randn(batch, 3, generator=g, dtype=torch.float64)
        self.x = z @ self.w.T + self.b + self.s * torch.randn(batch, 4, generator=g, dtype=torch.float64)

    def log_px(self):
        cov = self.w @ self.w.T + self.s ** 2 * torch.eye(4, dtype=torch.float64)
        return MultivariateNormal(self.b, cov).log_prob(self.x).float()

    def log_likelihood(self, samples):  # name -> [n, B, D] -> [n, B]
        z = torch.cat([samples["a"], samples["b"]], -1).double()
        return Normal(z @ self.w.T + self.b, self.s).log_prob(self.x).sum(-1).float()

    def posteriors(self, mean_shift=0.0, logvar_shift=0.0):
        precision = 1.0 + (self.w * self.w).sum(0) / self.s ** 2
        mean = ((self.x - self.b) @ self.w / self.s ** 2 / precision).float() + mean_shift
        logvar = (-precision.log()).float().expand_as(mean) + logvar_shift
        return {"a": DiagonalGaussian(mean[:, :2], logvar[:, :2]),
                "b": DiagonalGaussian(mean[:, 2:], logvar[:, 2:])}


@pytest.fixture(scope="module")
def model():
    return LinearGaussian()


@pytest.mark.parametrize("k", [1, 7, 50])
def test_iw_with_exact_posterior_is_log_px_for_any_k(model, k):
    iw = importance_weighted_log_likelihood(model.log_likelihood, model.posteriors(), k, chunk_size=4,
                                            generator=generator())
    assert iw.shape == (8,)
    assert torch.allclose(iw, model.log_px(), atol=1e-4)


def test_iw_with_worse_proposal_is_below_log_px_and_tightens_with_k(model):
    proposal = model.posteriors(mean_shift=1.0)  # ~2.7 posterior standard deviations off

    def bound(k):
        return importance_weighted_log_likelihood(model.log_likelihood, proposal, k, chunk_size=50,
                                                  generator=generator()).mean().item()

    log_px = model.log_px().mean().item()
    assert bound(1) < bound(10) < bound(200) < log_px
    assert log_px - bound(200) < 0.5 * (log_px - bound(1))


def test_iw_chunks_match_one_chunk_and_call_the_model_per_chunk(model):
    sizes = []

    def log_likelihood(samples):
        sizes.append(samples["a"].shape[:2])
        return model.log_likelihood(samples)

    proposal = model.posteriors(mean_shift=0.3, logvar_shift=0.5)
    one = importance_weighted_log_likelihood(log_likelihood, proposal, 50, chunk_size=50, generator=generator())
    sizes.clear()
    chunked = importance_weighted_log_likelihood(log_likelihood, proposal, 50, chunk_size=7, generator=generator())
    assert sizes == [(7, 8)] * 7 + [(1, 8)]
    assert torch.allclose(one, chunked, atol=1e-5)


def test_iw_argument_errors(model):
    with pytest.raises(VAEConfigError, match="num_samples=0"):
        importance_weighted_log_likelihood(model.log_likelihood, model.posteriors(), 0)
    with pytest.raises(ValueError, match=r"must return \[n, B\]"):
        importance_weighted_log_likelihood(lambda s: torch.zeros(3), model.posteriors(), 4)


def test_elbo_terms_and_perplexity(model):
    posteriors = model.posteriors(mean_shift=0.2)
    terms = elbo_terms(model.log_likelihood, posteriors, generator=generator(5))
    eps = torch.randn(1, 8, 2, generator=(g := generator(5))), torch.randn(1, 8, 1, generator=g)
    samples = {name: q.reparameterize(e) for (name, q), e in zip(posteriors.items(), eps)}
    assert torch.allclose(terms.reconstruction, model.log_likelihood(samples)[0])
    for name, q in posteriors.items():
        ref = kl_divergence(Normal(q.mean, q.std), Normal(0.0, 1.0)).sum(-1)
        assert torch.allclose(terms.kl[name], ref, atol=1e-6)
    assert torch.allclose(terms.elbo, terms.reconstruction - terms.kl["a"] - terms.kl["b"])
    # exp(-(-2 - 4) / 3)
    assert perplexity(torch.tensor([-2.0, -4.0]), num_tokens=3) == pytest.approx(math.e ** 2)
    assert perplexity(-6.0, num_tokens=3) == pytest.approx(math.e ** 2)


# ----------------------------------------------------------------------------
# Mutual information and active units
# ----------------------------------------------------------------------------


def test_mi_is_exactly_zero_when_all_posteriors_are_identical_even_in_128_dimensions():
    # the analytic-entropy estimator (Optimus' calc_mi) gave -0.27 here with one sample
    means = (torch.randn(1, 128, generator=generator()) * 0.3).expand(100, 128)
    logvars = torch.zeros(100, 128)
    mi = mutual_information(means, logvars, num_samples=1, generator=generator(3))
    assert abs(mi.value) < 1e-9 and mi.standard_error < 1e-9
    assert (mi.num_examples, mi.num_samples) == (100, 1)
    assert mi.log_n == pytest.approx(math.log(100))


def test_mi_never_exceeds_the_average_kl_on_a_near_collapsed_posterior():
    # I_q(x; z) <= E_x KL(q(z|x) || p(z)); the analytic-entropy estimator gave 1.24 here (bound 0.31)
    means = torch.randn(100, 128, generator=generator(5)) * 0.07
    logvars = torch.zeros(100, 128)
    average_kl = float(DiagonalGaussian(means, logvars).kl_standard_normal().sum(-1).mean())
    for seed in range(5):
        mi = mutual_information(means, logvars, num_samples=1, generator=generator(seed))
        assert mi.value <= average_kl + 3 * mi.standard_error, (seed, mi, average_kl)


def test_mi_reaches_log_n_for_separated_posteriors_and_never_more():
    means = torch.arange(50, dtype=torch.float32)[:, None] * 100.0  # far apart, unit variance
    mi = mutual_information(means, torch.zeros(50, 1), num_samples=20, generator=generator())
    assert mi.value == pytest.approx(math.log(50), abs=1e-6)
    assert mi.value <= mi.log_n + 1e-9


def test_mi_of_a_gaussian_channel_matches_its_closed_form():
    # x's means m ~ N(0, s^2 I), q(z|x) = N(m, I): as N grows, I = D/2 log(1 + s^2)
    s2, dim, n = 1.0, 2, 3000
    means = torch.randn(n, dim, generator=generator(11)) * math.sqrt(s2)
    mi = mutual_information(means, torch.zeros(n, dim), num_samples=4, generator=generator())
    exact = 0.5 * dim * math.log(1.0 + s2)
    assert 0 < mi.standard_error < 0.05
    assert abs(mi.value - exact) < 3 * mi.standard_error + 0.02


def test_mi_matches_numerical_integration_on_two_examples():
    means, logvars = torch.tensor([[-1.0], [1.5]]), torch.tensor([[math.log(0.5)], [math.log(2.0)]])
    z = torch.linspace(-20, 20, 400001, dtype=torch.float64)
    q = torch.stack([Normal(m.double(), (0.5 * lv).exp().double()).log_prob(z).exp()
                     for m, lv in zip(means[:, 0], logvars[:, 0])])  # [2, grid]
    mixture = q.mean(0)
    exact = 0.5 * sum(torch.trapezoid(qi * (qi.log() - mixture.log()), z) for qi in q).item()
    estimate = mutual_information(means, logvars, num_samples=20000, chunk_size=4096, generator=generator())
    assert estimate.value == pytest.approx(exact, abs=0.02)


def test_mi_equals_the_direct_formula_and_does_not_depend_on_chunking():
    g = generator(7)
    means, logvars = torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g) * 0.3
    mi = mutual_information(means, logvars, num_samples=4, chunk_size=5, generator=generator())
    z = means + (0.5 * logvars).exp() * torch.randn(4, 6, 3, generator=generator())  # [S, N, D]
    dist = Normal(means.double(), (0.5 * logvars).exp().double())
    pairwise = dist.log_prob(z.double()[:, :, None, :]).sum(-1)  # [S, N (sample of x_i), N (density j)]
    log_q_own = pairwise.diagonal(dim1=1, dim2=2)  # [S, N]
    log_qz = torch.logsumexp(pairwise, dim=-1) - math.log(6)
    per_example = (log_q_own - log_qz).mean(0)
    assert mi.value == pytest.approx(per_example.mean().item(), abs=1e-6)
    assert mi.standard_error == pytest.approx(per_example.std().item() / math.sqrt(6), abs=1e-6)
    other = mutual_information(means, logvars, 4, chunk_size=1000, generator=generator())
    assert mi.value == pytest.approx(other.value, abs=1e-9)


def test_active_units_by_hand():
    means = torch.tensor([[0.0, 0.0, 1.0, 0.0],
                          [0.0, 0.1, -1.0, 0.2],
                          [0.0, 0.0, 1.0, 0.0],
                          [0.0, 0.1, -1.0, 0.2]])
    count, variances = active_units(means)
    # unbiased variances: 0, 4 * 0.05^2 / 3, 4 / 3, 4 * 0.1^2 / 3
    assert variances.tolist() == pytest.approx([0.0, 0.01 / 3, 4.0 / 3, 0.04 / 3])
    assert count == 2
    assert active_units(means, threshold=0.001)[0] == 3


def test_principal_variance_shares_see_one_direction_spread_over_many_units():
    generator = torch.Generator().manual_seed(0)
    length = torch.randn(200, 1, generator=generator)
    on_a_line = length * torch.linspace(0.5, 1.5, 16)  # 16 active units, one direction
    assert active_units(on_a_line)[0] == 16
    shares = principal_variance_shares(on_a_line)
    assert shares[0] == pytest.approx(1.0) and shares.sum() == pytest.approx(1.0)
    isotropic = principal_variance_shares(torch.randn(5000, 4, generator=generator))
    assert isotropic.tolist() == pytest.approx([0.25] * 4, abs=0.02)
    assert torch.all(isotropic[:-1] >= isotropic[1:])
    assert principal_variance_shares(torch.ones(3, 2)).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="N >= 2"):
        principal_variance_shares(torch.zeros(1, 4))
