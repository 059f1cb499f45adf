"""LR / HR: the metric of latent_core.redundancy (pure functions, no toolkit)."""

import itertools
import json
import math

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon

from latent_core import redundancy as core


def _rows(*shape, seed=0, sparsity=0.0):
    """Random probability rows along the last dim, optionally with exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(*shape, generator=g, dtype=torch.float64)
    if sparsity:
        x = x * (torch.rand(*shape, generator=g, dtype=torch.float64) > sparsity)
        x[..., 0] += 1e-3  # no all-zero row
    return x / x.sum(-1, keepdim=True)


# ----------------------------------------------------------------------------
# pure functions
# ----------------------------------------------------------------------------


def test_js_divergence_matches_scipy():
    p, q = _rows(50, 9, seed=1, sparsity=0.4), _rows(50, 9, seed=2, sparsity=0.4)
    ours = core.js_divergence(p, q).numpy()
    ref = np.array([jensenshannon(a, b, base=2) ** 2 for a, b in zip(p.numpy(), q.numpy())])
    np.testing.assert_allclose(ours, ref, atol=1e-10)
    assert core.js_divergence(p, p).abs().max() < 1e-12
    one_hot = torch.eye(4, dtype=torch.float64)
    assert core.js_divergence(one_hot[0], one_hot[1]).item() == pytest.approx(1.0)  # bits: maximum is 1
    # the n-ary divergence of two distributions is the pairwise one
    both = torch.stack([p, q])
    np.testing.assert_allclose(core.generalized_js_divergence(both, member_dim=0).numpy(), ref, atol=1e-10)


def test_generalized_js_is_entropy_of_mean_minus_mean_entropy():
    dists = _rows(5, 7, 11, seed=3, sparsity=0.3)  # 5 members, 7 rows, 11 outcomes
    ours = core.generalized_js_divergence(dists, member_dim=0, dim=-1)
    d = dists.numpy()

    def h(p):
        p = p[p > 0]
        return -(p * np.log2(p)).sum()

    ref = [h(d[:, i].mean(0)) - np.mean([h(d[k, i]) for k in range(5)]) for i in range(7)]
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-10)
    # member dim after the distribution dim gives the same numbers
    moved = core.generalized_js_divergence(dists.permute(1, 2, 0), member_dim=-1, dim=1)
    np.testing.assert_allclose(moved.numpy(), ref, atol=1e-10)


@pytest.mark.parametrize("n_h", [2, 4, 8])
def test_layer_redundancy_on_the_papers_scale(n_h):
    """LR is the authors' (log2 n_h - JS) / log2 n_h in [0, 1]; LR_bits the undivided formula."""
    n_layers, T = 3, 4
    same = _rows(n_layers, 1, T, 6, seed=4).expand(n_layers, n_h, T, 6)
    assert core.layer_redundancy(same).item() == pytest.approx(1.0)
    assert core.layer_redundancy_bits(same).item() == pytest.approx(math.log2(n_h))
    # every head of a row attends to a different key (disjoint one-hot rows)
    eye = torch.eye(n_h, dtype=torch.float64)
    disjoint = eye[None, :, None, :].expand(n_layers, n_h, T, n_h)
    assert core.layer_redundancy(disjoint).item() == pytest.approx(0.0, abs=1e-12)
    assert core.layer_redundancy_bits(disjoint).item() == pytest.approx(0.0, abs=1e-12)
    for seed in range(5):
        attn = _rows(n_layers, n_h, 2, T, 6, seed=50 + seed, sparsity=0.5 * (seed % 2))
        lr, bits = core.layer_redundancy(attn), core.layer_redundancy_bits(attn)
        assert torch.all((lr > 0.0) & (lr < 1.0)), lr
        torch.testing.assert_close(lr, bits / math.log2(n_h))


def test_layer_redundancy_hand_computed():
    """4 heads, one row: three heads on key 0, one split over keys 0 and 1.

    mixture (7/8, 1/8): H = 7/8 log2(8/7) + 1/8 * 3; mean entropy (0 + 0 + 0 + 1) / 4;
    LR_bits = 2 - JS, LR = LR_bits / 2."""
    rows = torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0], [1.0, 0, 0, 0], [0.5, 0.5, 0, 0]], dtype=torch.float64)
    js = (7 / 8 * math.log2(8 / 7) + 3 / 8) - 1 / 4  # 0.29356...
    attn = rows[None, :, None, :]  # [N=1, n_h=4, T=1, S=4]
    assert core.layer_redundancy_bits(attn).item() == pytest.approx(2 - js, abs=1e-12)
    assert core.layer_redundancy(attn).item() == pytest.approx((2 - js) / 2, abs=1e-12)
    assert core.layer_redundancy(attn).item() == pytest.approx(0.8532178, abs=1e-7)
    # two pairs of identical one-hot heads: JS = 1 bit, LR = (2 - 1) / 2 = 0.5
    pairs = torch.eye(4, dtype=torch.float64)[[0, 0, 1, 1]][None, :, None, :]
    assert core.layer_redundancy(pairs).item() == pytest.approx(0.5)
    # 8 heads, four on each of two keys: JS = 1 bit, LR_bits = 3 - 1 = 2, LR = 2 / 3
    halves = torch.eye(8, dtype=torch.float64)[[0] * 4 + [1] * 4][None, :, None, :]
    assert core.layer_redundancy_bits(halves).item() == pytest.approx(2.0)
    assert core.layer_redundancy(halves).item() == pytest.approx(2 / 3)
    # layers are averaged: the four-head row above and a layer of identical heads
    two_layers = torch.cat([attn, rows[:1].expand(4, 4)[None, :, None, :]])
    assert core.layer_redundancy(two_layers).item() == pytest.approx(((2 - js) / 2 + 1.0) / 2, abs=1e-12)


def test_single_head_lr_is_undefined():
    """n_h = 1: log2 1 = 0, the normalised LR is undefined (named error / null), LR_bits = 0, HR defined."""
    attn = _rows(3, 1, 2, 5, 6, seed=11)  # [N=3, n_h=1, B=2, T=5, S=6]
    with pytest.raises(core.RedundancyError, match=r"undefined for n_h = 1"):
        core.layer_redundancy(attn)
    with pytest.raises(core.RedundancyError, match=r"undefined for n_h = 1"):
        core.lr_divisor(1)
    torch.testing.assert_close(core.layer_redundancy_bits(attn), torch.zeros(2, dtype=torch.float64))
    hr = core.head_redundancy(attn)  # 3 x 3 pairs of the layers' single heads
    assert torch.all((hr > 0.0) & (hr < 1.0))

    accumulator = core.RedundancyAccumulator(return_matrices=True)
    mask = torch.ones(2, 5, dtype=torch.bool)
    accumulator.add("encoder_self", attn, mask, torch.ones(2, 6, dtype=torch.bool))
    result = accumulator.result()
    entry = result["encoder_self"]
    assert entry["LR"] is None and entry["LR_bits"] == pytest.approx(0.0, abs=1e-12)
    assert "undefined for a single head" in entry["LR_note"]
    assert entry["HR"] == pytest.approx(hr.mean().item())
    assert (entry["layers"], entry["heads"]) == (3, 1) and entry["HR_matrix_labels"] == ["L0H0", "L1H0", "L2H0"]
    assert result["decoder_self"] is None and result["sentences"] == 2
    text = json.dumps(result, allow_nan=False)  # null, not NaN: strict JSON
    assert json.loads(text)["encoder_self"]["LR"] is None
    row = next(line for line in core.format_table(result).splitlines() if line.startswith("encoder_self"))
    assert row.split()[1:3] == ["1", "n/a"]


def test_hr_is_on_the_unit_interval():
    """1 - JS of two distributions, JS in bits, lies in [0, 1]: HR and every matrix cell do."""
    for seed, sparsity in ((12, 0.0), (13, 0.6), (14, 0.9)):
        attn = _rows(3, 4, 2, 6, 5, seed=seed, sparsity=sparsity)
        hr, matrix = core.head_redundancy(attn, return_matrix=True)
        assert torch.all((matrix >= 0.0) & (matrix <= 1.0)) and torch.all((hr >= 0.0) & (hr <= 1.0))
    disjoint = torch.eye(8, dtype=torch.float64).reshape(2, 4, 1, 8)  # 8 heads on 8 different keys
    hr, matrix = core.head_redundancy(disjoint, return_matrix=True)
    torch.testing.assert_close(matrix, torch.eye(8, dtype=torch.float64))  # off-diagonal 1 - JS = 1 - 1 = 0
    assert hr.item() == pytest.approx(1 / 8)


def test_head_redundancy_identical_heads_and_naive_reference():
    same = _rows(1, 1, 5, 6, seed=6).expand(2, 4, 5, 6)
    assert core.head_redundancy(same).item() == pytest.approx(1.0)
    assert core.head_redundancy(torch.eye(4)[None, :, None, :].expand(1, 4, 3, 4)).item() == pytest.approx(
        (4 * 1.0 + 12 * 0.0) / 16)  # only the identical pairs are redundant

    attn = _rows(2, 3, 5, 7, seed=7, sparsity=0.3)  # N=2, n_h=3, n_q=5, S=7
    a = attn.numpy()
    heads = [(n, h) for n in range(2) for h in range(3)]
    naive = np.mean([
        np.mean([1 - jensenshannon(a[n1, h1, i], a[n2, h2, i], base=2) ** 2 for i in range(5)])
        for (n1, h1), (n2, h2) in itertools.product(heads, heads)  # all ordered pairs, identical ones too
    ])
    hr, matrix = core.head_redundancy(attn, return_matrix=True)
    assert hr.item() == pytest.approx(naive, abs=1e-10)
    assert matrix.shape == (6, 6)
    assert torch.allclose(matrix.diagonal(), torch.ones(6, dtype=matrix.dtype))
    assert torch.allclose(matrix, matrix.T)
    assert matrix.mean().item() == pytest.approx(hr.item())
    naive_lr_bits = np.mean([
        math.log2(3) - np.mean([
            (lambda rows: (lambda h: h(rows.mean(0)) - np.mean([h(r) for r in rows]))(
                lambda p: -(p[p > 0] * np.log2(p[p > 0])).sum()))(a[n, :, i])
            for i in range(5)])
        for n in range(2)
    ])
    assert core.layer_redundancy_bits(attn).item() == pytest.approx(naive_lr_bits, abs=1e-10)
    assert core.layer_redundancy(attn).item() == pytest.approx(naive_lr_bits / math.log2(3), abs=1e-10)


def test_head_redundancy_is_chunked_without_changing_results(monkeypatch):
    attn = _rows(2, 4, 3, 9, 6, seed=8)
    full = core.head_redundancy(attn)
    monkeypatch.setattr(core, "_PAIR_CHUNK_ELEMENTS", 1)  # one row per chunk
    torch.testing.assert_close(core.head_redundancy(attn), full)


def test_padding_excluded_in_pure_functions():
    """Padded query rows and key columns (with arbitrary content) do not change LR / HR."""
    N, n_h = 2, 4
    lengths = [(5, 6), (3, 4)]  # (queries, keys) per sentence
    singles = [_rows(N, n_h, t, s, seed=10 + b, sparsity=0.2) for b, (t, s) in enumerate(lengths)]
    T, S = 8, 9
    batch = _rows(N, n_h, 2, T, S, seed=99)  # garbage everywhere ...
    query_mask = torch.zeros(2, T, dtype=torch.bool)
    key_mask = torch.zeros(2, S, dtype=torch.bool)
    for b, ((t, s), a) in enumerate(zip(lengths, singles)):
        batch[:, :, b, T - t:, :] = 0.0  # ... left-padded keys get weight 0 in real rows
        batch[:, :, b, T - t:, S - s:] = a
        query_mask[b, T - t:] = True
        key_mask[b, S - s:] = True
    lr = core.layer_redundancy(batch, query_mask, key_mask)
    hr = core.head_redundancy(batch, query_mask, key_mask)
    for b, a in enumerate(singles):
        assert lr[b].item() == pytest.approx(core.layer_redundancy(a).item(), abs=1e-12)
        assert hr[b].item() == pytest.approx(core.head_redundancy(a).item(), abs=1e-12)


def test_accumulator_reports_standard_errors_over_sentences_across_batches():
    from latent_core.redundancy import RedundancyAccumulator, head_redundancy, layer_redundancy_bits

    torch.manual_seed(0)
    attn = torch.softmax(torch.randn(2, 4, 7, 5, 6), dim=-1)  # [N, n_h, B, T, S]
    query_mask = torch.ones(7, 5, dtype=torch.bool)
    key_mask = torch.ones(7, 6, dtype=torch.bool)
    accumulator = RedundancyAccumulator()
    accumulator.add("encoder_self", attn[:, :, :3], query_mask[:3], key_mask[:3])
    accumulator.add("encoder_self", attn[:, :, 3:], query_mask[3:], key_mask[3:])
    entry = accumulator.result()["encoder_self"]
    lr = layer_redundancy_bits(attn, query_mask, key_mask).double()
    hr = head_redundancy(attn, query_mask, key_mask).double()
    assert entry["LR_bits_se"] == pytest.approx((lr.std() / 7 ** 0.5).item(), rel=1e-6)
    assert entry["HR_se"] == pytest.approx((hr.std() / 7 ** 0.5).item(), rel=1e-6)
    assert entry["LR_se"] == pytest.approx(entry["LR_bits_se"] / 2.0, rel=1e-9)  # / log2 4
    assert "standard deviation over sentences" in accumulator.result()["estimator"]
    single = RedundancyAccumulator()
    single.add("encoder_self", attn[:, :, :1], query_mask[:1], key_mask[:1])
    assert single.result()["encoder_self"]["HR_se"] is None


def test_attention_focus_entropy_and_collapse_per_layer():
    """Layer 0: every row one-hot (0 bits, collapsed); layer 1: uniform over the real keys (log2 of their number,
    not collapsed); the padded query row and the padding key do not count."""
    from latent_core.redundancy import attention_focus

    N, H, B, T, S = 2, 2, 1, 3, 4
    attn = torch.zeros(N, H, B, T, S)
    attn[0, ..., 1] = 1.0
    attn[1] = 1.0 / S
    query_mask = torch.tensor([[True, True, False]])
    key_mask = torch.tensor([[True, True, True, False]])
    entropy, peaked, rows = attention_focus(attn, query_mask, key_mask)
    assert rows == 2 * H
    torch.testing.assert_close(entropy / rows, torch.tensor([0.0, math.log2(3)]), check_dtype=False)
    torch.testing.assert_close(peaked / rows, torch.tensor([1.0, 0.0]), check_dtype=False)


def test_the_accumulator_reports_focus_per_layer():
    from latent_core.redundancy import RedundancyAccumulator

    acc = RedundancyAccumulator()
    attn = torch.softmax(torch.randn(3, 4, 2, 5, 5), -1)
    acc.add("encoder_self", attn, torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool))
    entry = acc.result()["encoder_self"]
    assert len(entry["entropy_bits_per_layer"]) == 3 and len(entry["collapsed_share_per_layer"]) == 3
    assert all(0 < e < math.log2(5) for e in entry["entropy_bits_per_layer"])
