"""user_dir/tools/sdma/analysis.py, user_dir/tools/sdma/plot_query_tsne.py (``sdma-plot-tsne``, Figs. 8/9) and
user_dir/tools/sdma/cluster_tokens.py (``sdma-cluster-tokens``, Section IV-B1, cluster usage).

The end-to-end tests reuse the tiny data and the two tiny checkpoints (``transformer``
and ``sdma_transformer`` with 3 clusters, 2 layers, 4 heads) of ``test_redundancy.py``'s
session fixtures.
"""

import json
import math

import numpy as np
import pytest
import torch

from latent_core.sdma import SDMACore, SDMAOptions
from user_dir.tools.sdma import analysis, plot_query_tsne
from user_dir.tools.sdma import cluster_tokens as sdma_cluster_tokens

HEADS, HEAD_DIM, CLUSTERS = 4, 3, 5


def _core_with_one_cluster_near_origin():
    """An SDMA core whose feature GMMs put cluster 0 at the origin and the others far away."""
    core = SDMACore(HEADS * HEAD_DIM, HEADS, SDMAOptions(mode="sma", clusters=CLUSTERS))
    with torch.no_grad():
        gmm = core.feature_gmm
        gmm.prior_logits.zero_()
        gmm.log_vars.zero_()
        gmm.means.copy_(torch.arange(CLUSTERS, dtype=torch.float32)[None, :, None].expand(HEADS, CLUSTERS, HEAD_DIM)
                        * 100.0)
    return core


# ----------------------------------------------------------------------------
# pure functions on synthetic tensors
# ----------------------------------------------------------------------------


def test_cluster_usage_is_one_for_one_hot_and_n_c_for_uniform_responsibilities():
    core = _core_with_one_cluster_near_origin()
    T, B = 6, 3
    x = 0.1 * torch.randn(T, B, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    valid = torch.ones(T, B, dtype=torch.bool)
    valid[4:, 0] = False
    x[4:, 0] = 100.0  # padding positions sit on cluster 1's mean: they must not count
    with torch.no_grad():
        resp = analysis.inference_responsibilities(core, x)  # [T, B, n_h, C]
    assert resp.shape == (T, B, HEADS, CLUSTERS)
    assert torch.all(resp[valid].argmax(-1) == 0)
    torch.testing.assert_close(analysis.cluster_usage(resp, valid), torch.ones(HEADS, dtype=torch.float64))
    assert torch.all(analysis.cluster_usage(resp) > 1.1)  # with the padding counted, two clusters are used

    with torch.no_grad():  # identical components and priors: p(c | z) = 1 / n_c exactly
        core.feature_gmm.means.zero_()
        uniform = analysis.inference_responsibilities(core, x)
    torch.testing.assert_close(uniform, torch.full_like(uniform, 1.0 / CLUSTERS))
    torch.testing.assert_close(analysis.cluster_usage(uniform, valid),
                               torch.full((HEADS,), float(CLUSTERS), dtype=torch.float64))


def test_cluster_usage_counts_effective_clusters_per_head():
    eye = torch.eye(CLUSTERS)
    # head 0: half of the tokens one-hot on cluster 0, half on cluster 1 -> 2 clusters used;
    # head 1: every token on cluster 3 -> 1; head 2: every token uniform -> n_c
    resp = torch.stack([
        torch.stack([eye[0], eye[0], eye[1], eye[1]]),
        eye[3].expand(4, CLUSTERS),
        torch.full((4, CLUSTERS), 1.0 / CLUSTERS),
    ], dim=1)  # [N=4, n_h=3, C]
    usage = analysis.cluster_usage(resp)
    torch.testing.assert_close(usage, torch.tensor([2.0, 1.0, float(CLUSTERS)], dtype=torch.float64))
    with pytest.raises(analysis.AnalysisError, match="zero tokens"):
        analysis.cluster_usage(resp, torch.zeros(4, dtype=torch.bool))


def test_argmax_token_counts_and_table():
    resp = torch.tensor([[[0.9, 0.1]], [[0.2, 0.8]], [[0.7, 0.3]], [[0.6, 0.4]]])  # [N=4, n_h=1, C=2]
    tokens = torch.tensor([2, 3, 2, 1])
    counts = analysis.argmax_token_counts(resp, tokens, vocab_size=4)
    assert counts.shape == (1, 2, 4)
    assert counts[0, 0].tolist() == [0, 1, 2, 0] and counts[0, 1].tolist() == [0, 0, 0, 1]
    table = analysis.cluster_token_table(counts, ["<pad>", "a", "b", "c"], top=5)
    assert table[0][0] == {"cluster": 0, "count": 3, "share": 0.75, "top_tokens": [["b", 2], ["a", 1]]}
    assert table[0][1] == {"cluster": 1, "count": 1, "share": 0.25, "top_tokens": [["c", 1]]}


def test_head_silhouette_separated_and_overlapping_heads():
    g = torch.Generator().manual_seed(0)
    N, H, D = 60, 4, 6
    centres = 10.0 * torch.eye(H, D)
    separate = centres[None] + 0.1 * torch.randn(N, H, D, generator=g)
    overlapping = torch.randn(N, H, D, generator=g)
    high = analysis.head_silhouette(separate)
    low = analysis.head_silhouette(overlapping)
    assert 0.9 < high <= 1.0
    assert -1.0 <= low < 0.1
    # the subsample is drawn with a fixed seed
    assert analysis.head_silhouette(overlapping, sample_size=100, seed=3) == analysis.head_silhouette(
        overlapping, sample_size=100, seed=3)


def test_subsample_and_tsne_are_deterministic():
    keep = analysis.subsample_indices(100, 10, seed=1)
    assert len(keep) == 10 and len(set(keep.tolist())) == 10 and np.all(np.diff(keep) > 0)
    assert np.array_equal(keep, analysis.subsample_indices(100, 10, seed=1))
    assert np.array_equal(analysis.subsample_indices(5, None, seed=1), np.arange(5))
    points = np.random.default_rng(0).normal(size=(20, 5))
    xy = analysis.tsne_2d(points, seed=0)  # perplexity lowered below n
    assert xy.shape == (20, 2)
    np.testing.assert_allclose(xy, analysis.tsne_2d(points, seed=0))


# ----------------------------------------------------------------------------
# the tiny real models
# ----------------------------------------------------------------------------


def _test_batch(task):
    dataset = analysis.load_subset(task, "test")
    return dataset, next(analysis.subset_batches(dataset, range(len(dataset)), batch_size=len(dataset)))


@pytest.mark.parametrize("name", ["transformer", "sdma"])
def test_captured_queries_are_the_scaled_projection_of_the_attention_input(loaded, name):
    model, task = loaded[name]
    dataset, sample = _test_batch(task)
    net = sample["net_input"]
    layer, _layers, module = analysis.select_attention(model, "decoder_self", -1)
    modules = {("decoder_self", layer): module}
    with torch.no_grad(), analysis.capture_inputs(modules) as inputs:
        model(**net)
        x = inputs[("decoder_self", layer)]  # [T, B, E]
        manual = module.q_proj(x) * module.scaling
    T, B, E = x.shape
    valid = net["prev_output_tokens"].ne(task.target_dictionary.pad())
    manual = manual.view(T, B, module.num_heads, module.head_dim).transpose(0, 1)[valid]  # [N, n_h, d_k]

    queries, tokens = analysis.collect_queries(model, [sample], "decoder_self", -1)
    assert queries.shape == (int(valid.sum()), 4, E // 4)
    assert int(valid.sum()) == int(dataset.tgt_sizes.sum())  # one query per decoder input, padding excluded
    torch.testing.assert_close(queries, manual.float())
    assert torch.equal(tokens, net["prev_output_tokens"][valid])
    assert module.skip_embed_dim_check is False  # restored after the capture
    assert (queries[:, 0] - queries[:, 1]).abs().max() > 1e-4  # the heads are really split


def test_vanilla_encoder_queries_match_the_embedding_projection(loaded):
    """Independent of the hooks: layer 0's input is the scaled, positioned embedding."""
    model, task = loaded["transformer"]
    _dataset, sample = _test_batch(task)
    src = sample["net_input"]["src_tokens"]
    module = model.encoder.layers[0].self_attn
    with torch.no_grad():
        x = model.encoder.forward_embedding(src)[0].transpose(0, 1)  # [S, B, E]
        manual = (module.q_proj(x) * module.scaling).view(*x.shape[:2], 4, -1)
    valid = src.ne(task.source_dictionary.pad())
    queries, _ = analysis.collect_queries(model, [sample], "encoder_self", 0)
    torch.testing.assert_close(queries, analysis.real_positions(manual, valid))


def test_cluster_statistics_on_the_real_model(loaded):
    model, task = loaded["sdma"]
    dataset, sample = _test_batch(task)
    stats = analysis.collect_cluster_statistics(model, [sample], ("encoder_self", -1))
    real_source = int(dataset.src_sizes.sum())
    real_target = int(dataset.tgt_sizes.sum())
    assert stats.tokens == {"encoder_self": real_source, "decoder_self": real_target, "decoder_cross": real_target}
    assert stats.argmax_counts.shape == (4, 3, len(task.source_dictionary))
    assert stats.argmax_counts.sum((1, 2)).tolist() == [real_source] * 4  # every token in one cluster per head
    assert stats.argmax_counts[:, :, task.source_dictionary.pad()].sum() == 0

    usage = stats.usage()
    assert set(usage) == set(analysis.ATTENTION_TYPES)
    for kind, values in usage.items():
        assert values.shape == (2, 4)
        assert torch.all(values >= 1.0 - 1e-9) and torch.all(values <= 3.0 + 1e-9), (kind, values)

    # the corpus accumulation equals cluster_usage on the module's responsibilities
    module = model.encoder.layers[1].self_attn
    with torch.no_grad(), analysis.capture_inputs({("encoder_self", 1): module}) as inputs:
        model(**sample["net_input"])
        resp = analysis.inference_responsibilities(module.sdma, inputs[("encoder_self", 1)])
    valid = sample["net_input"]["src_tokens"].ne(task.source_dictionary.pad()).t()  # [S, B]
    torch.testing.assert_close(usage["encoder_self"][1], analysis.cluster_usage(resp, valid))

    by_split = analysis.model_cluster_usage(model, task, "test", batch_size=5, device="cpu")
    for kind in analysis.ATTENTION_TYPES:  # batching (padding) does not change it
        np.testing.assert_allclose(by_split[kind], usage[kind].numpy(), rtol=1e-6)


def test_select_sentences_caps_tokens(loaded):
    _model, task = loaded["sdma"]
    dataset = analysis.load_subset(task, "test")
    cap = int(dataset.tgt_sizes[:3].sum())
    assert analysis.select_sentences(dataset, "decoder_self", max_tokens_total=cap) == [0, 1, 2]
    assert analysis.select_sentences(dataset, "decoder_self", max_sentences=2) == [0, 1]
    with pytest.raises(analysis.AnalysisError, match="smaller than the first sentence"):
        analysis.select_sentences(dataset, "encoder_self", max_tokens_total=int(dataset.src_sizes[0]) - 1)


def test_library_errors(loaded):
    vanilla, task = loaded["transformer"]
    with pytest.raises(analysis.AnalysisError, match="not an SDMA checkpoint"):
        analysis.collect_cluster_statistics(vanilla, [])
    with pytest.raises(analysis.AnalysisError, match="decoder_self layer 2 is out of range"):
        analysis.select_attention(vanilla, "decoder_self", 2)
    with pytest.raises(analysis.AnalysisError, match="subset 'nope' not found"):
        analysis.load_subset(task, "nope")
    assert issubclass(analysis.AnalysisError, ValueError)


# ----------------------------------------------------------------------------
# the scripts end to end
# ----------------------------------------------------------------------------


def test_plot_query_tsne_script(tiny, loaded, capsys):
    root = tiny["root"]
    png, out_json = root / "fig8.png", root / "fig8.json"
    code = plot_query_tsne.main([
        tiny["data"], "--vanilla-path", tiny["transformer"], "--path", tiny["sdma"],
        "--out", str(png), "--json", str(out_json), "--cpu", "--batch-size", "5",
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out_json.read_text())
    _model, task = loaded["sdma"]
    real_target = int(analysis.load_subset(task, "test").tgt_sizes.sum())
    assert (result["attention"], result["layer"], result["layers"], result["sentences"]) == ("decoder_self", 1, 2, 12)
    assert [c["label"].split(":")[0] for c in result["checkpoints"]] == ["V-T", "SDMA-T"]
    for checkpoint in result["checkpoints"]:
        assert checkpoint["tokens"] == real_target and checkpoint["heads"] == 4
        assert checkpoint["tsne_points"] == real_target * 4
        for key in ("silhouette_query_space", "silhouette_tsne"):
            assert math.isfinite(checkpoint[key]) and -1.0 <= checkpoint[key] <= 1.0
        assert f"{checkpoint['silhouette_query_space']:.4f}" in captured.out
    assert "silhouette" in captured.out


def test_sdma_cluster_tokens_script(tiny, loaded, capsys):
    out_json = tiny["root"] / "clusters.json"
    code = sdma_cluster_tokens.main([
        tiny["data"], "--path", tiny["sdma"], "--layer", "-1", "--top", "4", "--json", str(out_json), "--cpu",
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out_json.read_text())
    _model, task = loaded["sdma"]
    real_source = int(analysis.load_subset(task, "test").src_sizes.sum())
    assert (report["attention"], report["layer"], report["num_clusters"]) == ("encoder_self", 1, 3)
    assert report["tokens"] == real_source
    assert [h["head"] for h in report["heads"]] == [0, 1, 2, 3]
    symbols = set(task.source_dictionary.symbols)
    for head in report["heads"]:
        assert sum(c["count"] for c in head["clusters"]) == real_source
        assert sum(c["share"] for c in head["clusters"]) == pytest.approx(1.0)
        for cluster in head["clusters"]:
            assert len(cluster["top_tokens"]) <= 4
            assert all(symbol in symbols and count > 0 for symbol, count in cluster["top_tokens"])
        assert 1.0 <= head["usage_perplexity"] <= 3.0
    for kind in analysis.ATTENTION_TYPES:
        assert len(report["cluster_usage"][kind]) == 2
        assert all(1.0 - 1e-9 <= v <= 3.0 + 1e-9 for layer in report["cluster_usage"][kind] for v in layer)
        assert kind in captured.out
    assert "top tokens" in captured.out and "cluster usage" in captured.out

    code = sdma_cluster_tokens.main([tiny["data"], "--path", tiny["sdma"], "--head", "2", "--cpu"])
    assert code == 0
    assert "head 2 (of 4)" in capsys.readouterr().out


@pytest.mark.parametrize("script, argv, message", [
    (sdma_cluster_tokens, ["--path", "{transformer}"], "not an SDMA checkpoint"),
    (sdma_cluster_tokens, ["--path", "{sdma}", "--layer", "2"], "encoder_self layer 2 is out of range"),
    (sdma_cluster_tokens, ["--path", "{sdma}", "--head", "4"], "--head 4 is out of range"),
    (sdma_cluster_tokens, ["--path", "{root}/missing.pt"], "checkpoint not found"),
    (sdma_cluster_tokens, ["--path", "{sdma}", "--subset", "nope"], "nope.src-tgt.src.bin"),
    (plot_query_tsne, ["--path", "{sdma}", "--layer", "-3"], "decoder_self layer -3 is out of range"),
    (plot_query_tsne, ["--path", "{root}/missing.pt"], "checkpoint not found"),
    (plot_query_tsne, ["--path", "{transformer}", "--subset", "nope"], "nope.src-tgt.src.bin"),
    (plot_query_tsne, [], "at least one checkpoint"),
])
def test_script_errors_exit_2_without_traceback(tiny, capsys, script, argv, message):
    paths = {"transformer": tiny["transformer"], "sdma": tiny["sdma"], "root": str(tiny["root"])}
    argv = [a.format(**paths) for a in argv]
    assert script.main([tiny["data"], *argv, "--cpu"]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and message in err and "Traceback" not in err
