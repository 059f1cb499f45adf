"""The kernels of eq. (11) on the GPU (``attention_kernel`` explicit / sdpa / lowrank / triton) in fp32,
fp16 and bf16: output and every gradient (q, k, v, both responsibilities) against a float64 CPU
reference, for both readings, with key padding and a causal mask.

Tolerance: max |error| / max |reference| per tensor, at most 2e-4 in fp32, 2e-2 in fp16 and 8e-2
in bf16 (bf16 keeps 8 mantissa bits: one rounding of q, k and v is already ~4e-3 relative, and the
scores' rounding is amplified by the softmax). The explicit path keeps the scores and the mixing in
fp32, as the adapters do. Every kernel runs through the core's entry point, :func:`sdma_attention`
(the float64 reference is its explicit row on float64 inputs).
"""

import pytest
import torch

from latent_core.sdma import sdma_attention

from gpu_support import DTYPES, device, needs_cuda_for  # noqa: F401 (fixture)

B, H, T, D, C = 4, 4, 48, 32, 4
TOLERANCE = {"fp32": 2e-4, "fp16": 2e-2, "bf16": 8e-2}


def _inputs(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    q = q / D ** 0.5
    resp_q, resp_k = (torch.softmax(2 * torch.randn(B, H, T, C, generator=g, dtype=torch.float64), -1)
                      for _ in range(2))
    tensors = [q.to(dtype), k.to(dtype), v.to(dtype), resp_q.float(), resp_k.float()]
    return [t.to(device).requires_grad_() for t in tensors]


def _allowed(device, causal):
    allowed = torch.ones(B, 1, 1, T, device=device)
    allowed[1, ..., -7:] = 0
    allowed[3, ..., -20:] = 0
    if causal:
        allowed = allowed * torch.ones(T, T, device=device).tril()
        allowed[..., 0] = 1.0  # every row keeps one key
    return allowed


def _run(kernel, q, k, v, resp_q, resp_k, mix, allowed, authors, score_bias=None):
    """A_hat V through the core's one entry point with ``kernel`` its row of the kernel table."""
    out, _ = sdma_attention(q, k, v, resp_q, resp_k, mix, authors=authors, blocked=allowed == 0, kernel=kernel,
                            need_weights=False, dropout=lambda a: a, dropout_p=0.0, score_bias=score_bias)
    return out


def _relative_error(got, want):
    return ((got.double().cpu() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("authors", [False, True], ids=["paper", "authors"])
@pytest.mark.parametrize("causal", [False, True], ids=["padding", "causal"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kernel", ["explicit", "sdpa", "lowrank", "triton"])
def test_kernel_matches_float64_reference(device, kernel, precision, causal, authors):
    needs_cuda_for(precision)
    cpu = torch.device("cpu")
    mix = torch.tensor(0.6)
    ref_in = [t.detach().double().requires_grad_() for t in _inputs(cpu, torch.float64)]
    ref = _run("explicit", *ref_in, mix.double(), _allowed(cpu, causal).double(), authors)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (ref * weights).sum().backward()

    got_in = _inputs(device, DTYPES[precision])
    got = _run(kernel, *got_in, mix.to(device), _allowed(device, causal), authors)
    assert got.dtype == DTYPES[precision] and got.device.type == device.type
    (got.float() * weights.to(device).float()).sum().backward()
    errors = {"out": _relative_error(got, ref)}
    for name, a, b in zip(("q", "k", "v", "resp_q", "resp_k"), ref_in, got_in):
        errors[name] = _relative_error(b.grad, a.grad)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE[precision], (kernel, precision, errors)


@pytest.mark.parametrize("authors", [False, True], ids=["paper", "authors"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kernel", ["explicit", "sdpa", "lowrank", "triton"])
def test_kernel_with_a_learned_score_bias_matches_float64_reference(device, kernel, precision, authors):
    """A per-head relative-position bias (T5's shape, [1, H, T, S]) added before eq. (1), key padding: the output,
    every input's gradient and the bias's own (summed over the sentences) against the float64 reference."""
    needs_cuda_for(precision)
    cpu = torch.device("cpu")
    mix = torch.tensor(0.6)
    bias = 2.0 * torch.randn(1, H, T, T, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref_bias = bias.clone().requires_grad_()
    ref_in = [t.detach().double().requires_grad_() for t in _inputs(cpu, torch.float64)]
    ref = _run("explicit", *ref_in, mix.double(), _allowed(cpu, False).double(), authors, score_bias=ref_bias)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (ref * weights).sum().backward()

    got_bias = bias.to(device, DTYPES[precision]).requires_grad_()
    got_in = _inputs(device, DTYPES[precision])
    got = _run(kernel, *got_in, mix.to(device), _allowed(device, False), authors, score_bias=got_bias)
    (got.float() * weights.to(device).float()).sum().backward()
    errors = {"out": _relative_error(got, ref), "score_bias": _relative_error(got_bias.grad, ref_bias.grad)}
    for name, a, b in zip(("q", "k", "v", "resp_q", "resp_k"), ref_in, got_in):
        errors[name] = _relative_error(b.grad, a.grad)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE[precision], (kernel, precision, errors)
