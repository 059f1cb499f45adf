"""Every fused kernel of eq. (1), (2), (10), (11) equals the explicit path in every row.

Every kernel runs through the core's one entry point, :func:`sdma_attention`, and the explicit row is
held to the equations written out by hand (:func:`mix_attention_direct`). The stress case: most query
rows share almost no cluster with any key, so in the authors reading their masked attention mass
sum_j A_ij M_ij falls below the authors' eps (1e-6), where their ``F.normalize`` stops renormalising
(A_bar = M o A / eps) and softmax(s + log M) would renormalise to 1; two rows share a cluster with the
keys (ordinary rows). Both fused kernels (``sdpa``: :func:`fused_mix_attention`; ``lowrank``:
:func:`lowrank_mix_attention`) against the explicit row: outputs and the gradients of q, k, v and both
responsibilities, float64, both readings, with no mask (every key allowed), key padding, and a causal
mask.
"""

import pytest
import torch

from latent_core.sdma import (
    AUTHORS_EPS,
    authors_semantic_mask,
    mix_attention_direct,
    sdma_attention,
    semantic_mask_product,
)

B, H, T, S, D, C = 2, 2, 6, 6, 4, 3
ORDINARY_ROWS = 2


def stress_inputs(seed=0):
    """q, k, v and responsibilities: queries on cluster 0, keys on cluster 1 (overlap ~1e-13), but for
    the first ORDINARY_ROWS queries, which share the keys' cluster."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (T, S, S))
    logits_q = 0.5 * torch.randn(B, H, T, C, generator=g, dtype=torch.float64)
    logits_q[..., 0] += 30.0
    logits_q[..., :ORDINARY_ROWS, 1] += 30.0
    logits_k = 0.5 * torch.randn(B, H, S, C, generator=g, dtype=torch.float64)
    logits_k[..., 1] += 30.0
    resp_q, resp_k = torch.softmax(logits_q, -1), torch.softmax(logits_k, -1)
    return [t.requires_grad_() for t in (q, k, v, resp_q, resp_k)]


def allowed_keys(masking):
    if masking == "none":
        return None
    allowed = torch.ones(B, 1, 1, S, dtype=torch.float64)
    allowed[1, ..., -2:] = 0  # the second sentence's last two keys are padding
    if masking == "causal":
        allowed = torch.ones(1, 1, T, S, dtype=torch.float64).tril()
    return allowed


def semantic_mask(resp_q, resp_k, allowed, authors):
    flat = lambda x: x.reshape(B * H, x.size(-2), C)  # noqa: E731
    if authors:
        return authors_semantic_mask(flat(resp_q), flat(resp_k), allowed).view(B, H, T, S)
    return semantic_mask_product(flat(resp_q), flat(resp_k)).view(B, H, T, S)


def run(kernel, tensors, mix, allowed, authors):
    """A_hat V through the core's one entry point, :func:`sdma_attention`, with ``kernel`` its row."""
    q, k, v, resp_q, resp_k = tensors
    blocked = None if allowed is None else allowed == 0
    out, _ = sdma_attention(q, k, v, resp_q, resp_k, mix, authors=authors, blocked=blocked, kernel=kernel,
                            need_weights=False, dropout=lambda a: a, dropout_p=0.0)
    return out


def direct(tensors, mix, allowed, authors):
    """The same by hand, with eq. (11) in its direct form (:func:`mix_attention_direct`): the reference
    the explicit row is held to."""
    q, k, v, resp_q, resp_k = tensors
    scores = q @ k.transpose(-1, -2)
    if allowed is not None:
        scores = scores.masked_fill(allowed == 0, float("-inf"))
    mask = semantic_mask(resp_q, resp_k, allowed, authors)
    return mix_attention_direct(scores, mask, mix, norm_floor=AUTHORS_EPS if authors else 0.0) @ v


def assert_values_and_gradients_close(got, got_inputs, want, want_inputs):
    """Outputs to 1e-9 and the gradients of q, k, v and both responsibilities to 1e-8 (atol: the paper
    reading's d/dresp divides by masses down to its 1e-6 floor, float64 rounding x 1e6)."""
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    weights = torch.randn_like(want)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    for name, a, b in zip(("q", "k", "v", "resp_q", "resp_k"), want_inputs, got_inputs):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-8, atol=1e-8, msg=name)


def masked_mass(tensors, allowed, authors):
    """sum_j A_ij M_ij of every row, ``[B, H, T]``."""
    q, k, _, resp_q, resp_k = (t.detach() for t in tensors)
    scores = q @ k.transpose(-1, -2)
    if allowed is not None:
        scores = scores.masked_fill(allowed == 0, float("-inf"))
    return (torch.softmax(scores, -1) * semantic_mask(resp_q, resp_k, allowed, authors)).sum(-1)


def test_the_stress_case_is_one():
    mass = masked_mass(stress_inputs(), allowed_keys("padding"), authors=True)
    below = (mass < AUTHORS_EPS).float().mean().item()
    assert below >= 0.6 and (mass[..., :ORDINARY_ROWS] > 1e-3).all()


@pytest.mark.parametrize("kernel", ["sdpa", "lowrank"])
@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
def test_kernel_equals_explicit_in_every_row(kernel, authors, masking):
    mix = torch.tensor(0.7, dtype=torch.float64)
    allowed = allowed_keys(masking)
    reference, fused = stress_inputs(), stress_inputs()
    want = run("explicit", reference, mix, allowed, authors)
    got = run(kernel, fused, mix, allowed, authors)
    assert_values_and_gradients_close(got, fused, want, reference)


@pytest.mark.parametrize("kernel", ["sdpa", "lowrank"])
@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
def test_kernel_equals_explicit_on_an_ordinary_batch(kernel, authors):
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (T, S, S)]
    tensors += [torch.softmax(torch.randn(B, H, n, C, generator=g, dtype=torch.float64), -1) for n in (T, S)]
    mix = torch.tensor(0.4, dtype=torch.float64)
    for masking in ("none", "padding", "causal"):
        allowed = allowed_keys(masking)
        torch.testing.assert_close(run(kernel, tensors, mix, allowed, authors),
                                   run("explicit", tensors, mix, allowed, authors), rtol=1e-10, atol=1e-12)


def test_the_option_names_every_row_of_the_kernel_table():
    from latent_core.sdma import ATTENTION_KERNELS, KERNELS

    assert set(ATTENTION_KERNELS) == {"auto", *KERNELS}


@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
def test_the_explicit_row_equals_the_equations_by_hand(authors, masking):
    mix = torch.tensor(0.7, dtype=torch.float64)
    allowed = allowed_keys(masking)
    reference, entry = stress_inputs(), stress_inputs()
    want, got = direct(reference, mix, allowed, authors), run("explicit", entry, mix, allowed, authors)
    assert got.dtype == torch.float64  # float64 inputs are scored in float64, not narrowed to float32
    assert_values_and_gradients_close(got, entry, want, reference)


@pytest.mark.parametrize("kernel", ["explicit", "sdpa", "lowrank", "auto"])
def test_the_entry_point_returns_weights_only_when_asked(kernel):
    tensors = [t.detach() for t in stress_inputs()]
    mix = torch.tensor(0.7, dtype=torch.float64)
    allowed = allowed_keys("padding")
    want = direct(tensors, mix, allowed, True)
    out, weights = sdma_attention(*tensors, mix, authors=True, blocked=allowed == 0, kernel=kernel,
                                  need_weights=False, dropout=lambda a: a, dropout_p=0.0)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-12)
    assert (weights is None) == (kernel in ("sdpa", "lowrank"))  # auto is explicit on a CPU
    out, weights = sdma_attention(*tensors, mix, authors=True, blocked=allowed == 0, kernel=kernel,
                                  need_weights=True, dropout=lambda a: a, dropout_p=0.0)
    assert weights.shape == (B, H, T, S) and torch.all(weights.masked_select((allowed == 0).expand(B, H, T, S)) == 0)


# -- an additive score bias (T5's position bias, the Conformer's matrix_bd, ALiBi) ----------------------------------


def score_bias(shape=(1, H, T, S), seed=5):
    """A bias of relative-position size (a few units) that reorders the scores, with its own gradient."""
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_()


def run_biased(kernel, tensors, bias, mix, allowed, authors):
    q, k, v, resp_q, resp_k = tensors
    blocked = None if allowed is None else allowed == 0
    out, _ = sdma_attention(q, k, v, resp_q, resp_k, mix, authors=authors, blocked=blocked, kernel=kernel,
                            need_weights=False, dropout=lambda a: a, dropout_p=0.0, score_bias=bias)
    return out


@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
def test_the_explicit_row_adds_the_bias_before_eq_1(authors, masking):
    """By hand: A = softmax(q k^T + bias) (eq. 1), then eq. (2), (10), (11) unchanged; the bias's gradient too."""
    mix = torch.tensor(0.7, dtype=torch.float64)
    allowed = allowed_keys(masking)
    reference, entry = stress_inputs(), stress_inputs()
    bias_want, bias_got = score_bias(), score_bias()
    q, k, v, resp_q, resp_k = reference
    scores = q @ k.transpose(-1, -2) + bias_want
    if allowed is not None:
        scores = scores.masked_fill(allowed == 0, float("-inf"))
    mask = semantic_mask(resp_q, resp_k, allowed, authors)
    want = mix_attention_direct(scores, mask, mix, norm_floor=AUTHORS_EPS if authors else 0.0) @ v
    got = run_biased("explicit", entry, bias_got, mix, allowed, authors)
    assert_values_and_gradients_close(got, entry, want, reference)
    torch.testing.assert_close(bias_got.grad, bias_want.grad, rtol=1e-8, atol=1e-10)
    # and it matters: without it the output differs
    assert (run("explicit", [t.detach() for t in entry], mix, allowed, authors) - got).abs().max() > 1e-2


@pytest.mark.parametrize("kernel", ["sdpa", "lowrank"])
@pytest.mark.parametrize("authors", [True, False], ids=["authors", "paper"])
@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
@pytest.mark.parametrize("bias_shape", [(1, H, T, S), (B, 1, T, S), (B, H, T, S)], ids=["per_head", "per_sentence", "full"])
def test_every_row_that_takes_a_bias_equals_explicit_with_it(kernel, authors, masking, bias_shape):
    mix = torch.tensor(0.7, dtype=torch.float64)
    allowed = allowed_keys(masking)
    reference, fused = stress_inputs(), stress_inputs()
    bias_want, bias_got = score_bias(bias_shape), score_bias(bias_shape)
    want = run_biased("explicit", reference, bias_want, mix, allowed, authors)
    got = run_biased(kernel, fused, bias_got, mix, allowed, authors)
    assert_values_and_gradients_close(got, fused, want, reference)
    torch.testing.assert_close(bias_got.grad, bias_want.grad, rtol=1e-8, atol=1e-10)


def test_a_fully_blocked_row_with_a_bias_stays_finite_in_half_precision():
    """fp16: bias + the dtype's smallest value would overflow to -inf (NaN rows); the blocked keys replace it."""
    q, k, v, resp_q, resp_k = (t.detach().half() for t in stress_inputs())
    blocked = torch.zeros(1, 1, T, S, dtype=torch.bool)
    blocked[..., 0, :] = True  # the first query may attend to nothing
    bias = -60000.0 * torch.ones(1, H, T, S, dtype=torch.float16)
    from latent_core.sdma import AttentionInputs

    x = AttentionInputs(q, k, v, resp_q, resp_k, torch.tensor(0.5), True, blocked, (~blocked).float(),
                        lambda a: a, 0.0, bias)
    mask = x.additive_mask()
    assert torch.isfinite(mask).all() and (mask[..., 0, :] == torch.finfo(torch.float16).min).all()


def test_a_row_that_takes_no_bias_refuses_one_by_name(monkeypatch):
    from latent_core.sdma import KERNELS, TAKES_SCORE_BIAS, SDMAConfigError, explicit_kernel

    assert set(KERNELS) == TAKES_SCORE_BIAS  # every row takes one today; a new row is put on one side on purpose
    monkeypatch.setitem(KERNELS, "unbiased", explicit_kernel)  # a row that is not in TAKES_SCORE_BIAS
    tensors = [t.detach() for t in stress_inputs()]
    with pytest.raises(SDMAConfigError, match="attention_kernel='unbiased' does not take a score bias"):
        run_biased("unbiased", tensors, score_bias().detach(), torch.tensor(0.5, dtype=torch.float64), None, True)
    # auto picks a row that takes it, and weights asked for come from the explicit row, with the bias
    out = run_biased("auto", tensors, score_bias().detach(), torch.tensor(0.5, dtype=torch.float64), None, True)
    torch.testing.assert_close(out, run_biased("explicit", tensors, score_bias().detach(),
                                               torch.tensor(0.5, dtype=torch.float64), None, True))


@pytest.mark.parametrize("shape", [(H, T, S), (1, H, T + 1, S), (3, H, T, S)])
def test_a_bias_that_does_not_broadcast_to_the_scores_is_refused(shape):
    from latent_core.sdma import SDMAConfigError

    tensors = [t.detach() for t in stress_inputs()]
    with pytest.raises(SDMAConfigError, match="does not broadcast to the scores"):
        run_biased("explicit", tensors, torch.zeros(shape, dtype=torch.float64),
                   torch.tensor(0.5, dtype=torch.float64), None, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_row_softmax_equals_atens_forward_and_backward(dtype):
    """The explicit row's softmax over the keys on a CPU (max, exp, division: ATen's last-dimension kernel is ~4x
    slower over short rows) and its backward, against ``torch.softmax`` and autograd, with blocked keys at the
    dtype's minimum as the explicit row writes them and one row whose keys are all blocked but one."""
    from latent_core.sdma.attention import row_softmax, row_softmax_backward

    g = torch.Generator().manual_seed(3)
    scores = 4 * torch.randn(3, 2, 5, 7, generator=g, dtype=dtype)
    scores[0, :, :, 4:] = torch.finfo(dtype).min
    scores[1, 1, 2, 1:] = torch.finfo(dtype).min
    grad = torch.randn(scores.shape, generator=g, dtype=dtype)
    reference = scores.clone().requires_grad_()
    want = torch.softmax(reference, -1)
    want.backward(grad)
    got = row_softmax(scores)
    tolerance = dict(rtol=1.3e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got, want.detach(), **tolerance)
    torch.testing.assert_close(row_softmax_backward(grad, got), reference.grad, **tolerance)
    assert got[1, 1, 2, 0] == 1 and (got[0, :, :, 4:] == 0).all()
