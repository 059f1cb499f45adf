"""The Triton kernels (``attention_kernel=triton``) equal the explicit path, in Triton's interpreter on the CPU.

The masked mixture of eq. (1), (2), (10), (11) (:func:`mixed_attention`, through the core's entry point
:func:`sdma_attention`) against the explicit row: the output and the gradients of q, k, v and both responsibilities,
both readings, no mask / key padding / causal, T and S across several tiles and not multiples of them (the tiles are
shrunk to 16 here), T = 1 (incremental decoding), S = 1, a query whose keys are all blocked, attention dropout (the
kernel's Philox mask replayed on the explicit path), float16/bfloat16 inputs, and the near-empty rows of the authors'
reading: masked mass below their eps, with the mask's row normaliser below eps (both clamps) and above it (the
normaliser's own gradient). The clustering of eq. (9) (:func:`gaussian_clustering`) against the GMM's log-joint and
a log-softmax, with every parameter gradient, the input scale of the authors' reading and clamped log-variances.
The noise of eq. (8) (:func:`sampling_noise`) against its Philox draw added in torch, in x's layout and dtype, and as
a distribution (Kolmogorov-Smirnov against N(0, 1), a fresh draw per seed and per block).
Planted defects in the kernels' source (a dropped eps branch, an off-by-one tile edge, a mask ignored past the first
key tile, a dropped log-variance clamp) make the same checks fail, so they can fail.

Kept small: the interpreter runs every program of a grid in Python (about a minute for the file on 2 cores; in
``make test``, not ``make test-fast``, which has the adapters' quick Triton cases).
"""

import sys
from pathlib import Path

import pytest
import torch

import latent_core.sdma.triton_kernels as triton_kernels
from tests.conftest import planted_copy
from latent_core.sdma import AUTHORS_EPS, GaussianMixture, SDMAConfigError, log_softmax_clusters, sdma_attention
from latent_core.sdma.reference import dropout_scales, log_joint_direct, sampling_noise_direct
from latent_core.sdma.triton_kernels import LaunchConfig, gaussian_clustering, mixed_attention, sampling_noise

if not triton_kernels.INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it)", allow_module_level=True)

pytestmark = pytest.mark.interpreter
DEVICE = "cpu" if triton_kernels.INTERPRETED else "cuda"
SMALL_TILES = {key: LaunchConfig(16, 16 if cfg.block_cols else 0, cfg.num_warps, cfg.num_stages)
               for key, cfg in triton_kernels.LAUNCH.items()}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """16 x 16 tiles: the shapes below then span several tiles and end inside one."""
    for key, cfg in SMALL_TILES.items():
        monkeypatch.setitem(triton_kernels.LAUNCH, key, cfg)


def attention_inputs(B=2, H=2, T=5, S=7, D=8, C=4, seed=0, near_empty=None):
    """q, k, v, p(c|z_i), p(c|z_j) (float32). ``near_empty``: ``"both"`` puts queries and keys on different clusters
    (overlap ~1e-13: the mask's row normaliser and the masked mass below eps); ``"mass"`` gives every query one key
    of its own cluster that it barely attends to (normaliser ~1, mass ~1e-9 < eps)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (T, S, S))
    spread = 2.0 if near_empty is None else 0.5
    logits_q, logits_k = (spread * torch.randn(B, H, n, C, generator=g) for n in (T, S))
    if near_empty == "both":
        logits_q[..., 0] += 30.0
        logits_k[..., 1] += 30.0
        logits_q[..., :1, 1] += 30.0  # the first query of each head shares the keys' cluster: an ordinary row
    elif near_empty == "mass":
        logits_q[..., 0] += 30.0
        logits_k[..., 1] += 30.0
        logits_k[..., 0, 0] += 60.0  # key 0 is the queries' cluster ...
        k[..., 0, :] = -q.mean(2) * 20.0  # ... and scores far below the others
    resp_q, resp_k = torch.softmax(logits_q, -1), torch.softmax(logits_k, -1)
    return [t.to(DEVICE) for t in (q, k, v, resp_q, resp_k)]


def blocked_keys(kind, B, T, S):
    if kind == "none":
        return None
    blocked = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    blocked[1, ..., -2:] = True  # the second sentence's last two keys are padding
    if kind == "causal":
        blocked = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)[None, None]
    elif kind == "padding_and_causal":
        blocked = blocked | torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)[None, None]
    return blocked.to(DEVICE)


def run(kernel, tensors, mix, blocked, authors, dropout=None, dtype=torch.float32, score_bias=None, scale=1.0,
        log_responsibilities=False):
    """(A_hat V, the gradients of q, k, v and both responsibilities, and of ``score_bias`` where one is added to the
    scores) through :func:`sdma_attention`."""
    inputs = [t.detach().to(dtype if i < 3 else torch.float32).requires_grad_() for i, t in enumerate(tensors)]
    bias = None if score_bias is None else score_bias.detach().to(dtype).requires_grad_()
    out, _ = sdma_attention(*inputs, mix, authors=authors, blocked=blocked, kernel=kernel, need_weights=False,
                            dropout=dropout or (lambda a: a), dropout_p=0.0, score_bias=bias, scale=scale,
                            log_responsibilities=log_responsibilities)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    (out.float() * weights).sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in inputs] + ([] if bias is None else [bias.grad.float()])


NAMES = ("output", "q", "k", "v", "resp_q", "resp_k")


def assert_close(got, want, rtol=1e-5, scale_atol=1e-5):
    """Each tensor to ``rtol``, absolute errors measured against its largest entry (or 1: S = 1 makes d q exactly 0)."""
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=scale_atol * max(float(b.abs().max()), 1.0), msg=name)


def compare(authors, masking, shape, mix=0.7, near_empty=None):
    B, H, T, S = shape
    tensors = attention_inputs(B, H, T, S, near_empty=near_empty)
    blocked = blocked_keys(masking, B, T, S)
    mix = torch.tensor(mix, device=DEVICE)
    return run("triton", tensors, mix, blocked, authors), run("explicit", tensors, mix, blocked, authors)


@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
def test_the_kernel_equals_explicit_across_tiles(authors, masking):
    # 20 queries and 35 keys: two and three 16-wide tiles, each ending inside a tile
    assert_close(*compare(authors, masking, (2, 1, 20, 35 if masking != "causal" else 20)))


@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
@pytest.mark.parametrize("masking", ["padding", "causal"])
def test_unscaled_queries_and_log_responsibilities_are_read_as_they_are(authors, masking):
    """The adapters' raw inputs (``scale`` 1/sqrt(d_k) with unscaled q, ``log_responsibilities`` with log p(c|.)):
    the kernel reads them as they are, the explicit row gets q scaled and p(c|.); values and the gradients of the raw
    inputs agree (d log p = p d p, d q = s d(s q)), and equal the scaled inputs' own run."""
    B, H, T, S, D = 2, 2, 20, 35 if masking != "causal" else 20, 8
    tensors = attention_inputs(B, H, T, S, D=D)
    raw = [tensors[0] * 3.0, tensors[1], tensors[2], tensors[3].log(), tensors[4].log()]
    blocked, mix, scale = blocked_keys(masking, B, T, S), torch.tensor(0.7, device=DEVICE), 1 / 3.0
    got = run("triton", raw, mix, blocked, authors, scale=scale, log_responsibilities=True)
    want = run("explicit", raw, mix, blocked, authors, scale=scale, log_responsibilities=True)
    assert_close(got, want)
    scaled = run("explicit", tensors, mix, blocked, authors)
    torch.testing.assert_close(got[0], scaled[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], scaled[1] * scale, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[4], scaled[4] * tensors[3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
@pytest.mark.parametrize("masking", ["padding_and_causal", "biased"])
def test_the_weights_kernel_gives_the_explicit_rows_weights(authors, masking):
    """need_weights: A_hat from the row statistics equals the explicit row's (0 at blocked keys, rows across
    tiles, raw inputs), the output and gradients are unchanged by asking, and a loss on the weights is refused."""
    B, H, T, S = 2, 2, 20, 20
    tensors = attention_inputs(B, H, T, S)
    raw = [tensors[0] * 2.0, tensors[1], tensors[2], tensors[3].log(), tensors[4].log()]
    blocked = blocked_keys("padding_and_causal", B, T, S)
    bias = torch.randn(1, H, T, S, generator=torch.Generator().manual_seed(3)).to(DEVICE) if masking == "biased" \
        else None
    mix = torch.tensor(0.6, device=DEVICE)
    weights = {}
    for kernel in ("triton", "explicit"):
        inputs = [t.detach().clone().requires_grad_() for t in raw]
        out, weights[kernel] = sdma_attention(
            *inputs, mix, authors=authors, blocked=blocked, kernel=kernel, need_weights=True, dropout=lambda a: a,
            dropout_p=0.0, score_bias=bias, scale=0.5, log_responsibilities=True)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)).sum().backward()
        if kernel == "triton":
            grads = [t.grad for t in inputs]
            assert_close([out.detach()] + grads, run("triton", raw, mix, blocked, authors, score_bias=bias, scale=0.5,
                                                     log_responsibilities=True)[:6])
    torch.testing.assert_close(weights["triton"], weights["explicit"].detach(), rtol=1e-5, atol=1e-6)
    assert torch.all(weights["triton"].masked_select(blocked.expand(B, H, T, S)) == 0)
    inputs = [t.detach().clone().requires_grad_() for t in raw]
    out, attn = sdma_attention(*inputs, mix, authors=authors, blocked=blocked, kernel="triton", need_weights=True,
                               dropout=lambda a: a, dropout_p=0.0, scale=0.5, log_responsibilities=True)
    with pytest.raises(SDMAConfigError, match="sdma-attention-kernel explicit"):
        (out.sum() + attn.mean(1).sum()).backward()


def test_a_self_attentions_log_responsibilities_are_exponentiated_once_for_the_other_rows():
    """Two views of one log p(c|.) (a self-attention's queries and keys) cost the explicit row one exp, not two."""
    from benchmarks.op_counts import count_launches

    q, k, v, resp, _ = attention_inputs(1, 2, 6, 6)
    log_resp = resp.log().requires_grad_()
    mix = torch.tensor(0.5, device=DEVICE)

    def launches(keys):
        return count_launches(lambda: sdma_attention(
            q, k, v, log_resp.view(1, 2, 6, -1), keys, mix, authors=True, blocked=None, kernel="explicit",
            need_weights=False, dropout=lambda a: a, dropout_p=0.0, log_responsibilities=True))["launches"]

    assert launches(log_resp.view(1, 2, 6, -1)) == launches(log_resp.clone().view(1, 2, 6, -1)) - 1


@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
@pytest.mark.parametrize("shape", [(2, 2, 1, 9), (2, 2, 6, 1), (1, 2, 1, 1)], ids=["T=1", "S=1", "T=S=1"])
def test_single_query_and_single_key(authors, shape):
    assert_close(*compare(authors, "none", shape))
    if shape[3] > 2:  # incremental decoding: one query over a padded cache
        assert_close(*compare(authors, "padding", shape))


@pytest.mark.parametrize("near_empty", ["both", "mass"])
def test_the_near_empty_rows_of_the_authors_reading(near_empty):
    B, H, T, S = 2, 2, 6, 7
    tensors = attention_inputs(B, H, T, S, near_empty=near_empty)
    blocked = blocked_keys("padding", B, T, S)
    q, k, _, resp_q, resp_k = tensors
    scores = (q @ k.transpose(-1, -2)).masked_fill(blocked, float("-inf"))
    product = (resp_q @ resp_k.transpose(-1, -2)).masked_fill(blocked, 0.0)
    row_norm = product.sum(-1)
    mass = (torch.softmax(scores, -1) * product / row_norm.clamp_min(AUTHORS_EPS)[..., None]).sum(-1)
    assert (mass < AUTHORS_EPS).float().mean() >= 0.5  # the case is one: most rows are not renormalised ...
    if near_empty == "both":
        assert (row_norm < AUTHORS_EPS).float().mean() >= 0.5  # ... and their mask's normaliser is clamped too
    else:
        assert (row_norm > 0.5).all()  # ... while the normaliser is not: its own gradient matters
    mix = torch.tensor(0.7, device=DEVICE)
    assert_close(run("triton", tensors, mix, blocked, True), run("explicit", tensors, mix, blocked, True),
                 rtol=1e-4, scale_atol=1e-5)


def test_the_paper_readings_near_empty_rows_against_float64():
    """The paper reading's d/dp(c|z_i) divides by masses at its 1e-6 floor: it is a difference of terms as large as
    d/dp(c|z_j) (about 1e6 here) that cancel to about 0.2, so any float32 evaluation is off by a few float32 ulps of
    1e6 (0.1-1). Both float32 paths are held to the float64 explicit path, the kernel to 3x the explicit path's own
    error (measured on seeds 0-5 of this case: kernel 0.23-0.75, explicit 0.25-0.56, ratio at most 2.5)."""
    tensors = attention_inputs(2, 2, 6, 7, near_empty="both")
    mix = torch.tensor(0.7, device=DEVICE)
    got = run("triton", tensors, mix, None, False)
    want = run("explicit", [t.double() for t in tensors], mix.double(), None, False, dtype=torch.float64)
    explicit32 = run("explicit", tensors, mix, None, False)
    for name, a, b, c in zip(NAMES, got, want, explicit32):
        error, reference_error = (a.double() - b).abs().max(), (c.double() - b).abs().max()
        assert error <= max(3 * reference_error, 1e-5 * b.abs().max()), name


def test_a_query_with_every_key_blocked_gets_zero():
    B, H, T, S = 1, 2, 3, 4
    tensors = attention_inputs(B, H, T, S)
    blocked = torch.zeros(1, 1, T, S, dtype=torch.bool, device=DEVICE)
    blocked[..., 1, :] = True
    got = run("triton", tensors, torch.tensor(0.5, device=DEVICE), blocked, True)
    want = run("explicit", tensors, torch.tensor(0.5, device=DEVICE), blocked, True)
    assert torch.all(got[0][:, :, 1] == 0) and torch.isfinite(torch.cat([g.flatten() for g in got])).all()
    assert_close(got, want)


@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
def test_dropout_is_the_explicit_paths_dropout_of_a_hat_with_the_kernels_mask(authors):
    B, H, T, S, p = 2, 2, 6, 18, 0.3
    q, k, v, resp_q, resp_k = attention_inputs(B, H, T, S)
    blocked = blocked_keys("padding", B, T, S)
    mix = torch.tensor(0.6, device=DEVICE)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, resp_q, resp_k)]
    out = mixed_attention(*inputs, mix, authors=authors, blocked=blocked, dropout_p=p, seed=1234)
    out.sum().backward()
    scales = dropout_scales(1234, p, B, H, T, S, device=DEVICE)
    kept = scales > 0
    assert 0.55 < kept.float().mean() < 0.85
    torch.testing.assert_close(scales[kept], torch.full_like(scales[kept], 1 / (1 - p)))
    replay = [t.clone().requires_grad_() for t in (q, k, v, resp_q, resp_k)]
    ref, _ = sdma_attention(*replay, mix, authors=authors, blocked=blocked, kernel="explicit", need_weights=False,
                            dropout=lambda a: a * scales, dropout_p=0.0)
    ref.sum().backward()
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    for name, a, b in zip(NAMES[1:], inputs, replay):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5 * float(b.grad.abs().max()), msg=name)
    other = mixed_attention(q, k, v, resp_q, resp_k, mix, authors=authors, blocked=blocked, dropout_p=p, seed=99)
    assert not torch.allclose(other, out.detach())  # another seed, another mask


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
def test_half_precision_inputs_accumulate_in_float32(dtype, tol):
    tensors = attention_inputs(2, 2, 6, 7)
    blocked = blocked_keys("padding", 2, 6, 7)
    mix = torch.tensor(0.7, device=DEVICE)
    half = run("triton", tensors, mix, blocked, True, dtype=dtype)
    reference = run("explicit", tensors, mix, blocked, True)
    for name, a, b in zip(NAMES, half, reference):
        assert torch.isfinite(a).all(), name
        assert (a - b).abs().max() <= 4 * tol * b.abs().max(), name
    out = sdma_attention(*[t.to(dtype) if i < 3 else t for i, t in enumerate(tensors)], mix, authors=True,
                         blocked=blocked, kernel="triton", need_weights=False, dropout=lambda a: a, dropout_p=0.0)[0]
    assert out.dtype == dtype


# -- a score bias (T5's position bias, the Conformer's matrix_bd) --------------------------------------------

BIAS_SHAPES = {"per_head": lambda B, H, T, S: (1, H, T, S), "per_sentence": lambda B, H, T, S: (B, 1, T, S),
               "full": lambda B, H, T, S: (B, H, T, S)}


def biased_case(masking, shape, bias_shape="per_head"):
    B, H, T, S = shape
    tensors = attention_inputs(B, H, T, S)
    bias = 2.0 * torch.randn(BIAS_SHAPES[bias_shape](B, H, T, S), generator=torch.Generator().manual_seed(5))
    return tensors, bias.to(DEVICE), blocked_keys(masking, B, T, S), torch.tensor(0.7, device=DEVICE)


def assert_biased_close(got, want, rtol=1e-5, scale_atol=1e-5):
    assert_close(got[:-1], want[:-1], rtol, scale_atol)
    torch.testing.assert_close(got[-1], want[-1], rtol=rtol, atol=scale_atol * max(float(want[-1].abs().max()), 1.0),
                               msg="score_bias")


@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
def test_a_score_bias_equals_the_explicit_row_with_it_across_tiles(authors, masking):
    tensors, bias, blocked, mix = biased_case(masking, (2, 2, 20, 35 if masking != "causal" else 20))
    got = run("triton", tensors, mix, blocked, authors, score_bias=bias)
    want = run("explicit", tensors, mix, blocked, authors, score_bias=bias)
    assert_biased_close(got, want)
    # the bias matters here: without it the output moves
    assert (run("triton", tensors, mix, blocked, authors)[0] - got[0]).abs().max() > 1e-2


@pytest.mark.parametrize("bias_shape", ["per_sentence", "full"])
def test_a_score_bias_broadcast_over_heads_or_sentences_gets_its_summed_gradient(bias_shape):
    tensors, bias, blocked, mix = biased_case("padding", (2, 2, 6, 7), bias_shape)
    got = run("triton", tensors, mix, blocked, True, score_bias=bias)
    assert got[-1].shape == bias.shape
    assert_biased_close(got, run("explicit", tensors, mix, blocked, True, score_bias=bias))


def test_a_score_bias_in_half_precision_and_one_without_a_gradient():
    tensors, bias, blocked, mix = biased_case("padding", (2, 2, 6, 7))
    half = run("triton", tensors, mix, blocked, False, dtype=torch.float16, score_bias=bias)
    reference = run("explicit", tensors, mix, blocked, False, score_bias=bias)
    for name, a, b in zip(NAMES + ("score_bias",), half, reference):
        assert torch.isfinite(a).all() and (a - b).abs().max() <= 2e-2 * b.abs().max(), name
    q, k, v, resp_q, resp_k = tensors
    fixed = mixed_attention(q, k, v, resp_q, resp_k, mix, authors=False, blocked=blocked, score_bias=bias)
    torch.testing.assert_close(fixed, reference[0], rtol=1e-5, atol=1e-5)  # a bias that is not learned (ALiBi)


def test_bad_inputs_raise_named_errors():
    q, k, v, resp_q, resp_k = attention_inputs()
    mix = torch.tensor(0.5, device=DEVICE)
    with pytest.raises(SDMAConfigError, match="float64"):
        mixed_attention(q.double(), k.double(), v.double(), resp_q, resp_k, mix, authors=True)
    with pytest.raises(SDMAConfigError, match=r"k and v must be \[B, H, S, D\]"):
        mixed_attention(q, k[..., :3], v, resp_q, resp_k, mix, authors=True)
    with pytest.raises(SDMAConfigError, match="responsibilities"):
        mixed_attention(q, k, v, resp_q[..., :2], resp_k, mix, authors=True)
    with pytest.raises(SDMAConfigError, match="dropout_p"):
        mixed_attention(q, k, v, resp_q, resp_k, mix, authors=True, dropout_p=1.0)
    with pytest.raises(SDMAConfigError, match="score_bias of shape .* does not broadcast"):
        mixed_attention(q, k, v, resp_q, resp_k, mix, authors=True, score_bias=torch.zeros(1, 2, 5, 6, device=DEVICE))
    means = torch.zeros(2, 4, 3)
    with pytest.raises(SDMAConfigError, match=r"x must be \[N, G\*d\]"):
        gaussian_clustering(torch.zeros(5, 7), means, torch.zeros(2, 4, 3), torch.zeros(2, 4))


# -- the clustering of eq. (9) ---------------------------------------------------------------------------

def clustering_case(groups=3, clusters=4, dim=5, rows=37, seed=0, clamp=False):
    torch.manual_seed(seed)
    gmm = GaussianMixture(groups, clusters, dim, init="authors").to(DEVICE)
    with torch.no_grad():
        gmm.means.normal_(0.0, 1.0)
        gmm.log_vars.uniform_(-1.0, 1.0)
        gmm.prior_logits.normal_()
        if clamp:  # entries beyond the +-9 clamp: no gradient there
            gmm.log_vars[0, 0, :2] = torch.tensor([12.0, -11.0])
    x = torch.randn(rows, groups * dim, device=DEVICE)
    return gmm, x


def clustering_gradients(gmm, x, log_joint, log_resp, inputs):
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(t.shape, generator=g).to(t.device) for t in (log_joint, log_resp)]
    loss = (log_joint * weights[0]).sum() + (log_resp * weights[1]).sum()
    return [log_joint.detach(), log_resp.detach(), *torch.autograd.grad(loss, inputs)]


@pytest.mark.parametrize("scale", [1.0, 0.1])
@pytest.mark.parametrize("clamp", [False, True], ids=["in_range", "clamped"])
@pytest.mark.parametrize("centroid_grad_scale", [1.0, 5.0], ids=["c_g=1", "c_g=5"])
def test_the_clustering_kernel_equals_the_gmm(scale, clamp, centroid_grad_scale):
    """Values and every gradient, the means' times c_g (the GMM's ``scaled_means``, here in the backward kernel)."""
    gmm, x = clustering_case(clamp=clamp)
    gmm.centroid_grad_scale = centroid_grad_scale
    inputs = [x.requires_grad_(), gmm.means, gmm.log_vars, gmm.prior_logits]
    log_joint, log_resp = gaussian_clustering(x, gmm.means, gmm.log_vars, gmm.prior_logits, scale,
                                              mean_grad_scale=centroid_grad_scale)
    got = clustering_gradients(gmm, x, log_joint, log_resp, inputs)
    heads = x.view(x.size(0), gmm.groups, gmm.dim)
    want_joint = gmm.log_joint(heads, scale=scale)
    want = clustering_gradients(gmm, x, want_joint, log_softmax_clusters(want_joint), inputs)
    assert log_joint.shape == want_joint.shape and log_joint.stride() == want_joint.stride()  # clusters-first
    for name, a, b in zip(("log_joint", "log_resp", "x", "means", "log_vars", "prior_logits"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * max(float(b.abs().max()), 1.0), msg=name)
    if clamp:
        assert torch.all(got[4][0, 0, :2] == 0) and got[4][0, 0, 2:].abs().sum() > 0


def test_the_parameters_the_clustering_read_carry_their_other_gradients_back_through_it():
    """``parameters_read``: log-variances and prior logits come back as views; a loss on them (the regularisers')
    adds its gradient inside the backward kernel, the same sum autograd forms when the parameters are used twice."""
    gmm, x = clustering_case(clamp=True)
    x.requires_grad_()
    weights = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(DEVICE)
               for i, p in enumerate((gmm.log_vars, gmm.prior_logits))]
    grads = []
    for read in (True, False):
        gmm.zero_grad()
        x.grad = None
        log_joint, log_resp, *parameters = gaussian_clustering(x, gmm.means, gmm.log_vars, gmm.prior_logits, 0.1,
                                                               parameters_read=True)
        if read:
            assert parameters[0]._base is gmm.log_vars and parameters[1]._base is gmm.prior_logits
        else:
            parameters = [gmm.log_vars, gmm.prior_logits]
        loss = log_joint.sum() + (log_resp.exp() * 2).sum()
        loss = loss + sum((p.exp() * w).sum() for p, w in zip(parameters, weights))
        loss.backward()
        grads.append([t.grad.clone() for t in (x, gmm.means, gmm.log_vars, gmm.prior_logits)])
    for name, a, b in zip(("x", "means", "log_vars", "prior_logits"), *grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert grads[0][2].abs().sum() > 0 and grads[0][3].abs().sum() > 0


def test_the_clustering_kernel_against_eq_9_written_out():
    gmm, x = clustering_case(groups=2, clusters=3, dim=4, rows=5)
    log_joint, log_resp = gaussian_clustering(x, gmm.means, gmm.log_vars, gmm.prior_logits, 0.1)
    want = log_joint_direct(gmm, x.view(5, 2, 4), scale=0.1)
    torch.testing.assert_close(log_joint, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(log_resp.exp().sum(-1), torch.ones(5, 2, device=DEVICE))


@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
def test_an_adapters_layout_is_kept_for_the_output_and_every_gradient(authors):
    """fairseq's layout: q, k, v and p(c|.) as [B, H, T, .] views of [T, B, H, .] storage (the responsibilities
    clusters-first, [C, T, B, H]). The output and each gradient come back in its input's layout (so the adapter's
    reshapes copy nothing), with the explicit row's values; an expanded p(c|z_j) (stride 0) is copied first."""
    B, H, T, S, C = 2, 2, 19, 17, 4
    tensors = attention_inputs(B, H, T, S, C=C)
    as_fairseq = [t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for t in tensors[:3]]
    as_fairseq += [t.permute(3, 2, 0, 1).contiguous().permute(2, 3, 1, 0) for t in tensors[3:]]
    blocked, mix = blocked_keys("padding", B, T, S), torch.tensor(0.6, device=DEVICE)
    inputs = [t.detach().requires_grad_() for t in as_fairseq]
    out = mixed_attention(*inputs, mix, authors=authors, blocked=blocked)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    (out * weights).sum().backward()
    assert out.stride() == inputs[0].stride()
    for name, t in zip(NAMES[1:], inputs):
        assert t.grad.stride() == t.stride(), name
    got = [out.detach()] + [t.grad for t in inputs]
    assert_close(got, run("explicit", tensors, mix, blocked, authors))
    # a cross-attention's p(c|.): slices of one clusters-first [C, T + S, B, H] clustering output, read in place (no
    # copy) and their gradients written with the same gaps
    rows = torch.cat([tensors[3].permute(3, 2, 0, 1), tensors[4].permute(3, 2, 0, 1)], 1).detach().requires_grad_()
    sliced = [rows[:, :T].permute(2, 3, 1, 0), rows[:, T:].permute(2, 3, 1, 0)]
    assert triton_kernels._non_overlapping(sliced[1]) is sliced[1]
    out = mixed_attention(*tensors[:3], *sliced, mix, authors=authors, blocked=blocked)
    (out * weights).sum().backward()
    want = run("explicit", tensors, mix, blocked, authors)
    torch.testing.assert_close(out.detach(), want[0], rtol=1e-5, atol=1e-5)
    grad_rows = rows.grad.permute(1, 2, 3, 0)
    torch.testing.assert_close(grad_rows[:T].permute(1, 2, 0, 3), want[4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_rows[T:].permute(1, 2, 0, 3), want[5], rtol=1e-5, atol=1e-5)
    shared_keys = tensors[4][:, :1].detach().requires_grad_()  # one head's p(c|z_j) for both heads
    out = mixed_attention(*tensors[:4], shared_keys.expand(B, H, S, C), mix, authors=authors, blocked=blocked)
    out.sum().backward()
    want = run("explicit", tensors[:4] + [shared_keys.detach().expand(B, H, S, C)], mix, blocked, authors)
    torch.testing.assert_close(out.detach(), want[0], rtol=1e-5, atol=1e-5)
    assert shared_keys.grad.shape == (B, 1, S, C) and torch.isfinite(shared_keys.grad).all()


@pytest.mark.parametrize("layout", ["rows_first", "stacked_clusters_first", "expanded", "each_its_own"])
def test_the_clustering_backward_reads_its_gradients_in_any_layout(layout):
    """The output gradients come as autograd hands them: rows-first ([N, G, C] contiguous), a layer's slice of the
    regularisers' clusters-first stack, or expanded (a plain sum's backward, stride 0); read by their strides."""
    gmm, x = clustering_case()
    inputs = [x.requires_grad_(), gmm.means, gmm.log_vars, gmm.prior_logits]
    g = torch.Generator().manual_seed(5)

    def loss(log_joint, log_resp):
        if layout == "rows_first":
            return (log_joint * torch.randn(log_joint.shape, generator=g)).sum() + log_resp.pow(2).sum()
        if layout == "expanded":
            return log_joint.sum() + 0.5 * log_resp.sum()
        if layout == "each_its_own":  # log p(z, c) from a stack, log p(c|z) rows-first: two layouts in one call
            stacked = torch.stack([log_joint.movedim(-1, 0)] * 2, dim=1)  # [C, 2, N, G]
            rows = log_resp.permute(1, 0, 2).contiguous().permute(1, 0, 2)  # [N, G, C] stored [G, N, C]
            return (stacked * torch.randn(stacked.shape, generator=g)).sum() + (rows * rows.detach()).sum()
        stacked = torch.stack([t.movedim(-1, 0) for t in (log_joint, log_resp)], dim=1)  # [C, 2, N, G]
        return (stacked * torch.randn(stacked.shape, generator=g)).sum()

    log_joint, log_resp = gaussian_clustering(x, gmm.means, gmm.log_vars, gmm.prior_logits, 0.1)
    got = torch.autograd.grad(loss(log_joint, log_resp), inputs)
    g.manual_seed(5)
    want_joint = gmm.log_joint(x.view(x.size(0), gmm.groups, gmm.dim), scale=0.1)
    want = torch.autograd.grad(loss(want_joint, log_softmax_clusters(want_joint)), inputs)
    for name, a, b in zip(("x", "means", "log_vars", "prior_logits"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * max(float(b.abs().max()), 1.0), msg=name)


# -- planted defects ---------------------------------------------------------------------------------------

def planted(replacements):
    """A copy of the kernels' module with ``replacements`` ((old, new) source strings) applied."""
    module = planted_copy(triton_kernels, replacements, "planted_triton_kernels")
    for key, cfg in SMALL_TILES.items():
        module.LAUNCH[key] = cfg
    return module


def planted_attention(module, authors, masking, shape, near_empty=None):
    B, H, T, S = shape
    tensors = attention_inputs(B, H, T, S, near_empty=near_empty)
    blocked = blocked_keys(masking, B, T, S)
    mix = torch.tensor(0.7, device=DEVICE)
    inputs = [t.clone().requires_grad_() for t in tensors]
    out = module.mixed_attention(*inputs, mix, authors=authors, blocked=blocked)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    (out * weights).sum().backward()
    return [out.detach()] + [t.grad for t in inputs], run("explicit", tensors, mix, blocked, authors)


@pytest.mark.parametrize("defect,case", [
    ("dropped_eps", dict(authors=True, masking="padding", shape=(2, 2, 6, 7), near_empty="both")),
    ("tile_edge", dict(authors=False, masking="none", shape=(2, 1, 20, 35))),
    ("mask_past_first_tile", dict(authors=True, masking="causal", shape=(2, 1, 20, 20))),
])
def test_planted_attention_defects_fail(defect, case):
    replacements = {
        "dropped_eps": [("norm_z = tl.maximum(mass, EPS)", "norm_z = mass")],
        "tile_edge": [("        mask_s = offs_s < S\n", "        mask_s = offs_s < S - 1\n")],
        "mask_past_first_tile": [("allowed = allowed & (blocked == 0)",
                                  "allowed = allowed & ((blocked == 0) | (offs_s[None, :] >= 16))")],
    }[defect]
    got, want = planted_attention(planted(replacements), **case)
    with pytest.raises(AssertionError):
        assert_close(got, want, rtol=1e-4)
    assert_close(*planted_attention(triton_kernels, **case), rtol=1e-4)  # the real kernels pass the same case


def test_a_planted_bias_defect_in_backward_fails():
    """The bias left out of the backward's recomputed scores: the forward is right, every gradient wrong."""
    module = planted([("""    scores = _dot(q, tl.trans(k), DOT_PRECISION) * sm_scale
    scores = _add_score_bias(scores, BIAS, bias_strides, offs_t, offs_s, mask_t, mask_s, HAS_BIAS)
""", """    scores = _dot(q, tl.trans(k), DOT_PRECISION) * sm_scale
""")])
    tensors, bias, blocked, mix = biased_case("padding", (2, 2, 6, 7))
    inputs = [t.clone().requires_grad_() for t in tensors]
    out = module.mixed_attention(*inputs, mix, authors=True, blocked=blocked, score_bias=bias)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    (out * weights).sum().backward()
    want = run("explicit", tensors, mix, blocked, True, score_bias=bias)
    torch.testing.assert_close(out.detach(), want[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        assert_close([out.detach()] + [t.grad for t in inputs], want[:-1], rtol=1e-4)


def test_a_planted_clustering_defect_fails():
    module = planted([("lv = tl.minimum(tl.maximum(lv, lv_min), lv_max)\n        precision",
                       "lv = lv\n        precision")])
    gmm, x = clustering_case(clamp=True)
    got = module.gaussian_clustering(x, gmm.means, gmm.log_vars, gmm.prior_logits)[0]
    want = gmm.log_joint(x.view(x.size(0), gmm.groups, gmm.dim))
    assert not torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_an_interpreter_switched_on_after_triton_language_was_imported_is_refused_by_name():
    """Triton makes its own functions (tl.max, ...) for the interpreter only if TRITON_INTERPRET=1 when
    triton.language is first imported (torch.utils.flop_counter imports it): set later, a kernel would fail
    inside the interpreter with "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    import os
    import subprocess

    code = ("import torch.utils.flop_counter, os; os.environ['TRITON_INTERPRET'] = '1'; import torch; "
            "from latent_core.sdma.triton_kernels import check_supported; check_supported(torch.zeros(2))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode != 0
    assert "SDMAConfigError: attention_kernel=triton: TRITON_INTERPRET=1 was set after triton.language" in proc.stderr


# -- the sampling noise of eq. (8) -------------------------------------------------------------------------

def noise_input(layout, dtype):
    """33,600 elements (33 blocks of 1,024, the last partial), contiguous or as fairseq hands them ([T, B, C] over
    [B, T, C] storage)."""
    stored = torch.randn(3, 700, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    return (stored if layout == "contiguous" else stored.transpose(0, 1)).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_the_noise_kernel_is_x_plus_sigma_times_its_philox_draw_in_xs_layout(layout, dtype):
    x = noise_input(layout, dtype).requires_grad_()
    z = sampling_noise(x, 0.1, seed=11)
    assert z.dtype == dtype and z.shape == x.shape and z.stride() == x.stride()
    torch.testing.assert_close(z.detach(), sampling_noise_direct(x.detach(), 0.1, 11))
    assert (z.detach().float() - x.detach().float()).abs().max() > 0.2  # noise there (sigma 0.1, 33,600 draws)
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.device, dtype)
    (z * weights).sum().backward()
    assert torch.equal(x.grad, weights)  # dz/dx = 1


def test_the_noise_is_standard_normal_fresh_per_seed_and_repeatable_from_torchs_seed():
    from scipy import stats

    zeros = torch.zeros(100_000, device=DEVICE)
    eps = sampling_noise(zeros, 1.0, seed=3).cpu()
    assert stats.kstest(eps.numpy(), "norm").pvalue > 1e-3  # N(0, 1): Kolmogorov-Smirnov over 100,000 draws
    blocks = eps[:97 * 1024].view(97, 1024)
    assert torch.corrcoef(blocks[:4]).triu(1).abs().max() < 0.15  # each block its own draws, not one repeated
    assert torch.equal(sampling_noise(zeros, 1.0, seed=3).cpu(), eps)
    other = sampling_noise(zeros, 1.0, seed=4).cpu()
    assert abs(float(torch.corrcoef(torch.stack([eps, other]))[0, 1])) < 0.02
    torch.testing.assert_close(sampling_noise(zeros, 0.1, seed=3).cpu(), 0.1 * eps)  # sigma, not the variance
    torch.manual_seed(5)
    first, second = sampling_noise(zeros[:2048], 1.0), sampling_noise(zeros[:2048], 1.0)
    torch.manual_seed(5)
    assert torch.equal(sampling_noise(zeros[:2048], 1.0), first) and not torch.equal(first, second)


@pytest.mark.parametrize("defect", ["one_block_repeated", "variance_for_sigma"])
def test_planted_noise_defects_fail(defect):
    draw = "(x + sigma * tl.randn(seed, offs))"
    replacements = {"one_block_repeated": [(draw, "(x + sigma * tl.randn(seed, offs % BLOCK_N))")],
                    "variance_for_sigma": [(draw, "(x + sigma * sigma * tl.randn(seed, offs))")]}[defect]
    x = noise_input("transposed", torch.float32)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(planted(replacements).sampling_noise(x, 0.1, seed=11),
                                   sampling_noise_direct(x, 0.1, 11))


def test_the_noise_kernel_takes_an_empty_batch_and_refuses_float64_by_name():
    assert sampling_noise(torch.zeros(0, 3, 8, device=DEVICE), 0.1).shape == (0, 3, 8)
    with pytest.raises(SDMAConfigError, match=r"attention_kernel=triton \(the noise of eq. 8\): float64"):
        sampling_noise(torch.zeros(4, 8, dtype=torch.float64, device=DEVICE), 0.1)


def test_the_cores_noise_with_the_triton_kernel_is_the_kernels_draw_from_torchs_seed():
    from latent_core.sdma import SDMACore, SDMAOptions
    from latent_core.sdma.triton_kernels import philox_seed

    core = SDMACore(32, 2, SDMAOptions(mode="sdma", attention_kernel="triton", noise_var=0.04))
    x = torch.randn(7, 3, 32, device=DEVICE).transpose(0, 1)
    torch.manual_seed(2)
    z = core.perturb(x, training=True, scale=0.5)
    torch.manual_seed(2)
    torch.testing.assert_close(z, sampling_noise_direct(x, 0.2 / 0.5, philox_seed()))
    assert core.perturb(x, training=False) is x
