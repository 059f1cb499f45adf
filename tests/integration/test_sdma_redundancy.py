"""LR / HR on real checkpoints: the fairseq capture and command (user_dir.tools.sdma.redundancy,
``sdma-redundancy``), the HR heat maps (latent_core.redundancy_plot and ``sdma-plot-heads``;
Figs. 10-11) and Fig. 6 (user_dir.tools.sdma.plot_attention, ``sdma-plot``), on the session's tiny
checkpoints (tests/integration/conftest.py)."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ARCHS
from latent_core import redundancy_plot as phr
from user_dir.sdma.attention_outputs import attention_outputs
from user_dir.tools.sdma import plot_attention as psa
from user_dir.tools.sdma import plot_heads
from user_dir.tools.sdma import redundancy as ar


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
    with torch.no_grad(), attention_outputs(model) as store:
        _, extra = model(**net, features_only=False)
        assert model.encoder.layers[0].self_attn.skip_embed_dim_check is False  # nothing switched meanwhile
        weights = {k: [recorded.weights.clone() for recorded in v] for k, v in store.items()}
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
    rows = ~src_pad  # compare real query rows only
    torch.testing.assert_close(weights["encoder_self"][0].mean(0)[rows], avg[rows], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(ARCHS))
def test_three_attention_types_are_measured_separately(loaded, name):
    model, task = loaded[name]
    result = ar.attention_redundancy(model, task, "test")
    assert result["sentences"] == 12
    assert set(result) == {"encoder_self", "decoder_self", "decoder_cross", "sentences",
                           "LR_scale", "HR_scale", "compare_with_paper", "notes", "estimator"}
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
    with torch.no_grad(), attention_outputs(model) as store:
        model(**net)
        base = torch.stack([recorded.weights for recorded in store["encoder_self"]])
        net2 = dict(net, src_tokens=torch.cat([torch.full_like(net["src_tokens"][:, :1], pad), net["src_tokens"]], 1))
        model(**net2)
        more = torch.stack([recorded.weights for recorded in store["encoder_self"]])
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
        assert set(entry) == {"LR", "LR_bits", "HR", "layers", "heads", "HR_matrix", "HR_matrix_labels",
                              "LR_se", "LR_bits_se", "HR_se", "entropy_bits_per_layer", "collapsed_share_per_layer"}
        assert len(entry["entropy_bits_per_layer"]) == len(entry["collapsed_share_per_layer"]) == 2
        assert all(0.0 <= share <= 1.0 for share in entry["collapsed_share_per_layer"])
        assert all(bits >= 0.0 for bits in entry["entropy_bits_per_layer"])
        assert entry["HR_se"] > 0 and entry["LR_se"] == pytest.approx(entry["LR_bits_se"] / 2.0)
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
    assert plot_heads.main([str(bare), "--out", str(tiny["root"] / "heat" / "x.png")]) == 2
    assert "--hr-matrix" in capsys.readouterr().err


def test_plot_head_redundancy_side_by_side(tiny, script_runs, drawn, capsys):
    """Figs. 10-11: V-T and SDMA-T encoder matrices from the two JSON files, one colour scale."""
    assert all(code == 0 for code, _, _ in script_runs.values())
    png = tiny["root"] / "fig10.png"
    files = [str(tiny["root"] / f"{name}.json") for name in ("transformer", "sdma")]
    assert plot_heads.main([*files, "--names", "V-T", "SDMA-T", "--out", str(png)]) == 0, capsys.readouterr().err
    _assert_png(png)
    (call,) = drawn
    assert [t.split(":")[0] for t in call["titles"]] == ["V-T", "SDMA-T"]
    for path, matrix in zip(files, call["matrices"]):
        np.testing.assert_array_equal(matrix, np.array(json.loads(Path(path).read_text())["encoder_self"]["HR_matrix"]))
    assert plot_heads.main([*files, "--names", "V-T", "--out", str(png)]) == 2
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
