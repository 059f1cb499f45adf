"""LR / HR: the metric (latent_core.redundancy), its fairseq capture and command
(user_dir.sdma.redundancy, ``sdma-redundancy``), the HR heat maps (latent_core.redundancy_plot,
``sdma-plot-heads``; Figs. 10-11) and Fig. 6 (user_dir.sdma.plot_attention, ``sdma-plot``).

The end-to-end tests build their own tiny data (fairseq-preprocess) and two tiny
checkpoints (fairseq-train --max-update 5, ``transformer`` and
``sdma_transformer``, trained in parallel) once per session.
"""

import itertools
import json
import math
import os
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon

from conftest import REPO, venv_bin
from latent_core import redundancy as core
from latent_core import redundancy_plot as phr
from user_dir.sdma import plot_attention as psa
from user_dir.sdma import redundancy as ar

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


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


# ----------------------------------------------------------------------------
# tiny data and checkpoints (session)
# ----------------------------------------------------------------------------

TRAIN_COMMON = [
    "--task", "translation", "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "400", "--max-update", "5", "--seed", "1",
    "--cpu", "--no-progress-bar", "--no-epoch-checkpoints", "--disable-validation",
    "--num-workers", "0", "--no-save-optimizer-state",
]
ARCHS = {
    "transformer": ["--arch", "transformer"],
    "sdma": ["--arch", "sdma_transformer_iwslt_de_en_tiny", "--user-dir", str(REPO / "user_dir"),
             "--criterion", "sdma_label_smoothed_cross_entropy", "--sdma-clusters", "3",
             "--sdma-query-clusters", "3", "--sdma-mix-rate", "0.5"],  # g > 0.8 after 5 updates
}


def _check(proc, what):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    return out, err


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("redundancy")
    rng = random.Random(0)
    for split, n in (("train", 64), ("valid", 8), ("test", 12)):
        with open(root / f"{split}.src", "w") as fs, open(root / f"{split}.tgt", "w") as ft:
            for _ in range(n):
                words = [f"w{rng.randrange(12)}" for _ in range(rng.randint(2, 9))]
                fs.write(" ".join(words) + "\n")
                ft.write(" ".join(reversed(words)) + "\n")
    data = root / "bin"
    _check(subprocess.Popen(
        [venv_bin("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
         "--trainpref", str(root / "train"), "--validpref", str(root / "valid"),
         "--testpref", str(root / "test"), "--destdir", str(data), "--workers", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=root), "fairseq-preprocess")
    procs = {}
    for name, extra in ARCHS.items():  # both trainings at once (2 cores)
        procs[name] = subprocess.Popen(
            [venv_bin("fairseq-train"), str(data), *TRAIN_COMMON, *extra, "--save-dir", str(root / name)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=root)
    for name, proc in procs.items():
        _check(proc, f"fairseq-train {name}")
    ckpts = {name: root / name / "checkpoint_last.pt" for name in ARCHS}
    for path in ckpts.values():
        assert path.is_file()
    # start sdma-redundancy on both checkpoints now: the subprocesses run while
    # the in-process tests do (collected by ``script_runs``)
    scripts = {}
    for name, path in ckpts.items():
        with open(root / f"{name}.out", "w") as out, open(root / f"{name}.err", "w") as err:
            scripts[name] = subprocess.Popen(
                [venv_bin("sdma-redundancy"), "--path", str(path), str(data),
                 "--subset", "test", "--batch-size", "5", "--json", str(root / f"{name}.json"),
                 "--heatmap", str(root / f"{name}.png")],
                stdout=out, stderr=err, env=ENV, cwd=REPO)
    yield {"root": root, "data": str(data), "scripts": scripts, **{k: str(v) for k, v in ckpts.items()}}
    for proc in scripts.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def loaded(tiny):
    """In-process (models, task) of both tiny checkpoints."""
    out = {}
    for name in ARCHS:
        models, _cfg, task = ar.load_models(tiny[name], tiny["data"])
        out[name] = (models[0].eval(), task)
    return out


@pytest.fixture(scope="session")
def script_runs(tiny):
    """sdma-redundancy on both checkpoints (subprocesses): {name: (rc, stdout, stderr)}."""
    results = {}
    for name, proc in tiny["scripts"].items():
        proc.wait(timeout=300)
        root = tiny["root"]
        results[name] = (proc.returncode, (root / f"{name}.out").read_text(), (root / f"{name}.err").read_text())
    return results


# ----------------------------------------------------------------------------
# capture and corpus-level measurement
# ----------------------------------------------------------------------------


def _sample(task, n=5, subset="test"):
    task.load_dataset(subset)
    ds = task.dataset(subset)
    return ds.collater([ds[i] for i in range(n)])


def test_capture_gives_per_head_weights_of_each_attention_type(loaded):
    model, task = loaded["transformer"]
    sample = _sample(task)
    net = sample["net_input"]
    with torch.no_grad(), ar.capture_attention(model) as store:
        _, extra = model(**net, features_only=False)
        weights = {k: [w.clone() for w in v] for k, v in store.items()}
    B, S = net["src_tokens"].shape
    T = net["prev_output_tokens"].size(1)
    pad = task.source_dictionary.pad()
    assert [w.shape for w in weights["encoder_self"]] == [(4, B, S, S)] * 2
    assert [w.shape for w in weights["decoder_self"]] == [(4, B, T, T)] * 2
    assert [w.shape for w in weights["decoder_cross"]] == [(4, B, T, S)] * 2
    # heads really differ (not a head average broadcast)
    assert (weights["encoder_self"][0][0] - weights["encoder_self"][0][1]).abs().max() > 1e-4
    # decoder self-attention is causal; padding keys get no weight
    assert torch.all(weights["decoder_self"][1].triu(1) == 0)
    src_pad = net["src_tokens"].eq(pad)
    assert src_pad.any()
    assert torch.all(weights["encoder_self"][0][:, src_pad.unsqueeze(1).expand(B, S, S)] == 0)
    # the last layer's cross-attention averaged over heads is what fairseq itself returns
    torch.testing.assert_close(weights["decoder_cross"][-1].mean(0), extra["attn"][0].float())
    # the encoder's first-layer input is the embedding: compare with the module's own
    # head-averaged fast path on that input
    x = model.encoder.forward_embedding(net["src_tokens"])[0].transpose(0, 1)
    layer = model.encoder.layers[0]
    _, avg = layer.self_attn(x, x, x, key_padding_mask=src_pad, need_weights=True)
    assert layer.self_attn.skip_embed_dim_check is False  # restored
    rows = ~src_pad  # compare real query rows only
    torch.testing.assert_close(weights["encoder_self"][0].mean(0)[rows], avg[rows], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(ARCHS))
def test_three_attention_types_are_measured_separately(loaded, name):
    model, task = loaded[name]
    result = ar.attention_redundancy(model, task, "test")
    assert result["sentences"] == 12
    assert set(result) == {"encoder_self", "decoder_self", "decoder_cross", "sentences",
                           "LR_scale", "HR_scale", "compare_with_paper", "notes"}
    assert result["compare_with_paper"] == "encoder_self" and "enc_attn" in result["notes"]
    assert "/ log2 n_h" in result["LR_scale"] and "[0, 1]" in result["LR_scale"]
    values = {k: (result[k]["LR"], result[k]["HR"]) for k in ar.ATTENTION_TYPES}
    for k, (lr, hr) in values.items():
        assert 0.0 <= lr <= 1.0 and 0.0 <= hr <= 1.0, (k, lr, hr)  # the paper's scale for both
        assert (result[k]["layers"], result[k]["heads"]) == (2, 4)
        assert result[k]["LR_bits"] == pytest.approx(2.0 * lr)  # log2 4 = 2 bits
        assert "HR_matrix" not in result[k]
    for a, b in itertools.combinations(ar.ATTENTION_TYPES, 2):  # the authors' code reported one number thrice
        assert abs(values[a][0] - values[b][0]) > 1e-4 and abs(values[a][1] - values[b][1]) > 1e-4, (a, b, values)


def test_results_do_not_depend_on_padding(loaded):
    """Batching sentences of different lengths (padding) gives the per-sentence results of batch size 1."""
    model, task = loaded["sdma"]
    alone = ar.attention_redundancy(model, task, "test", max_sentences=8, batch_size=1)
    padded = ar.attention_redundancy(model, task, "test", max_sentences=8, batch_size=8)
    for kind in ar.ATTENTION_TYPES:
        for metric in ("LR", "LR_bits", "HR"):
            assert padded[kind][metric] == pytest.approx(alone[kind][metric], abs=1e-5)
    # with an extra padding column appended to every sentence's keys
    task.load_dataset("test")
    ds = task.dataset("test")
    sample = ds.collater([ds[i] for i in range(8)])
    net = sample["net_input"]
    pad = task.source_dictionary.pad()
    with torch.no_grad(), ar.capture_attention(model) as store:
        model(**net)
        base = torch.stack(store["encoder_self"])
        net2 = dict(net, src_tokens=torch.cat([torch.full_like(net["src_tokens"][:, :1], pad), net["src_tokens"]], 1))
        model(**net2)
        more = torch.stack(store["encoder_self"])
    m1, m2 = net["src_tokens"].ne(pad), net2["src_tokens"].ne(pad)
    torch.testing.assert_close(ar.layer_redundancy(more, m2, m2), ar.layer_redundancy(base, m1, m1))
    torch.testing.assert_close(ar.head_redundancy(more, m2, m2), ar.head_redundancy(base, m1, m1))


def test_sdma_weights_are_the_mixed_attention(loaded):
    """For SDMA the measured attention is A_hat (eq. 11); the mixing weight matters."""
    model, task = loaded["sdma"]
    encoder_attn = model.encoder.layers[0].self_attn
    assert encoder_attn.sdma.mix_weight.item() > 0.5  # --sdma-mix-rate 0.5: g ~ 0.9 after 4-5 updates
    with_mask = ar.attention_redundancy(model, task, "test", max_sentences=4)
    saved = [m.sdma.mix_weight.clone() for m in model.modules() if hasattr(m, "sdma")]
    try:
        for m in model.modules():
            if hasattr(m, "sdma"):
                m.sdma.mix_weight.zero_()
        without = ar.attention_redundancy(model, task, "test", max_sentences=4)
    finally:
        for m, g in zip([m for m in model.modules() if hasattr(m, "sdma")], saved):
            m.sdma.mix_weight.copy_(g)
    assert abs(with_mask["encoder_self"]["LR"] - without["encoder_self"]["LR"]) > 1e-4


def test_errors(tiny, loaded, capsys):
    model, task = loaded["transformer"]
    with pytest.raises(FileNotFoundError, match=r"nope\.src-tgt\.src\.bin"):
        ar.attention_redundancy(model, task, "nope")
    with pytest.raises(ar.RedundancyError, match="not a fairseq encoder-decoder"):
        ar.attention_redundancy(torch.nn.Linear(2, 2), task, "test")
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        ar.attention_redundancy(str(tiny["root"] / "missing.pt"), data=tiny["data"])
    assert ar.main(["--path", str(tiny["root"] / "missing.pt"), tiny["data"]]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    assert ar.main(["--path", tiny["transformer"], tiny["data"], "--subset", "nope"]) == 2
    assert "nope.src-tgt.src.bin" in capsys.readouterr().err


# ----------------------------------------------------------------------------
# the commands end to end
# ----------------------------------------------------------------------------


def _assert_png(path):
    """``path`` is a PNG that decodes to an RGB(A) image."""
    import matplotlib.image

    assert path.is_file() and path.stat().st_size > 10_000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.fixture
def drawn(monkeypatch):
    """Records the matrices ``latent_core.redundancy_plot.draw_heatmaps`` really hands to matplotlib."""
    calls = []
    original = phr.draw_heatmaps

    def spy(panels, out, **kwargs):
        result = original(panels, out, **kwargs)
        calls.append({"out": out, "titles": [p[0] for p in panels], "labels": [p[2] for p in panels],
                      "matrices": result})
        return result

    monkeypatch.setattr(phr, "draw_heatmaps", spy)
    return calls


@pytest.mark.parametrize("name", list(ARCHS))
def test_redundancy_script_end_to_end(tiny, script_runs, name):
    code, out, err = script_runs[name]
    assert code == 0, err[-3000:]
    result = json.loads((tiny["root"] / f"{name}.json").read_text())
    assert result["sentences"] == 12 and result["compare_with_paper"] == "encoder_self"
    header = next(line for line in out.splitlines() if line.startswith("attention")).split()
    assert header == ["attention", "heads", "LR", "[0,1]", "LR", "bits", "HR", "[0,1]"]
    assert "compare them with encoder_self" in out
    for kind in ar.ATTENTION_TYPES:
        assert kind in out
        entry = result[kind]
        assert set(entry) == {"LR", "LR_bits", "HR", "layers", "heads", "HR_matrix", "HR_matrix_labels"}
        assert 0.0 <= entry["LR"] <= 1.0 and 0.0 <= entry["HR"] <= 1.0
        assert entry["LR_bits"] == pytest.approx(2.0 * entry["LR"])
        row = next(line.split() for line in out.splitlines() if line.startswith(kind))
        assert [float(v) for v in row[2:]] == pytest.approx([entry["LR"], entry["LR_bits"], entry["HR"]], abs=1e-4)
        matrix = np.array(entry["HR_matrix"])
        assert matrix.shape == (8, 8) and matrix.mean() == pytest.approx(entry["HR"], abs=1e-6)  # float32
        assert entry["HR_matrix_labels"] == [f"L{n}H{h}" for n in range(2) for h in range(4)]
    _assert_png(tiny["root"] / f"{name}.png")  # --heatmap: the encoder self-attention's matrix


def test_heatmap_option_plots_the_json_matrices(loaded, tiny, drawn, capsys):
    """``--heatmap OUT.png --heatmap-kind all``: one panel per type, each the JSON's HR_matrix."""
    png, out = tiny["root"] / "heat" / "all.png", tiny["root"] / "heat" / "all.json"
    code = ar.main(["--path", tiny["sdma"], tiny["data"], "--max-sentences", "4", "--cpu",
                    "--json", str(out), "--heatmap", str(png), "--heatmap-kind", "all"])
    assert code == 0, capsys.readouterr().err
    assert f"wrote {png}" in capsys.readouterr().out
    _assert_png(png)
    result = json.loads(out.read_text())
    (call,) = drawn
    assert call["out"] == str(png) and len(call["matrices"]) == 3
    for kind, matrix, labels, title in zip(ar.ATTENTION_TYPES, call["matrices"], call["labels"], call["titles"]):
        np.testing.assert_array_equal(matrix, np.array(result[kind]["HR_matrix"]))
        assert labels == result[kind]["HR_matrix_labels"] and kind in title
    # without HR_matrix in a JSON the plotting script says how to get it
    bare = tiny["root"] / "heat" / "bare.json"
    bare.write_text(json.dumps(ar.attention_redundancy(*loaded["sdma"], "test", max_sentences=2)))
    assert phr.main([str(bare), "--out", str(tiny["root"] / "heat" / "x.png")]) == 2
    assert "--hr-matrix" in capsys.readouterr().err


def test_plot_head_redundancy_side_by_side(tiny, script_runs, drawn, capsys):
    """Figs. 10-11: V-T and SDMA-T encoder matrices from the two JSON files, one colour scale."""
    assert all(code == 0 for code, _, _ in script_runs.values())
    png = tiny["root"] / "fig10.png"
    files = [str(tiny["root"] / f"{name}.json") for name in ("transformer", "sdma")]
    assert phr.main([*files, "--names", "V-T", "SDMA-T", "--out", str(png)]) == 0, capsys.readouterr().err
    _assert_png(png)
    (call,) = drawn
    assert [t.split(":")[0] for t in call["titles"]] == ["V-T", "SDMA-T"]
    for path, matrix in zip(files, call["matrices"]):
        np.testing.assert_array_equal(matrix, np.array(json.loads(Path(path).read_text())["encoder_self"]["HR_matrix"]))
    assert phr.main([*files, "--names", "V-T", "--out", str(png)]) == 2
    assert "1 --names for 2 result files" in capsys.readouterr().err


def test_plot_script_writes_png(tiny, capsys):
    png = tiny["root"] / "fig6.png"
    code = psa.main([
        "--path", tiny["sdma"], tiny["data"], "--subset", "test", "--index", "0", "--layer", "-1",
        "--head", "0", "--vanilla-path", tiny["transformer"], "--mixed", "--out", str(png),
    ])
    assert code == 0, capsys.readouterr().err
    assert png.is_file() and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # panels (a)/(b) need an SDMA checkpoint
    assert psa.main(["--path", tiny["transformer"], tiny["data"], "--out", str(tiny["root"] / "x.png")]) == 2
    assert "is not an SDMA model" in capsys.readouterr().err


def test_plot_panels(loaded):
    model, task = loaded["sdma"]
    sample, labels = psa.sentence(task, "test", 1)
    panels = psa.sdma_panels(model, sample, -1, 0)
    T = len(labels)
    assert labels[-1] == "</s>"
    assert panels["resp"].shape == (T, 3) and panels["mask"].shape == (T, T) and panels["attn"].shape == (T, T)
    for key in ("resp", "mask", "attn", "mixed"):
        torch.testing.assert_close(panels[key].sum(-1), torch.ones(T))
    assert (panels["attn"] - panels["mixed"]).abs().max() > 1e-4  # g = 0.9: A differs from A_hat
    assert model.encoder.layers[-1].self_attn.sdma.mix_weight.item() == pytest.approx(panels["mix_weight"])
    vanilla_model, _ = loaded["transformer"]
    with pytest.raises(psa.PlotError, match="not an SDMA model"):
        psa.sdma_panels(vanilla_model, sample, -1, 0)
    assert psa.vanilla_attention(vanilla_model, sample, -1, 0)["attn"].shape == (T, T)
