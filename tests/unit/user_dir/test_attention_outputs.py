"""``attention_outputs``: the one documented output analysis reads. It records what each attention computed
without changing the model or its outputs: SDMA modules write their own A_hat (eq. 11), A (eq. 1), p(c|.)
and queries; fairseq's own attention is recomputed from its call's inputs."""

import pytest
import torch
from fairseq.modules.multihead_attention import MultiheadAttention

from tests.unit.user_dir.test_sdma_fairseq import batch, build
from user_dir.sdma.attention_outputs import AttentionOutputsError, attention_layers, attention_outputs
from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention


def _flags(model):
    return [(m.skip_embed_dim_check, float(m.sdma.mix_weight) if hasattr(m, "sdma") else None)
            for m in model.modules() if isinstance(m, MultiheadAttention)]


# the paper reading with the decoder's mask kept at inference: every attention applies SDMA in eval mode
READINGS = {"authors": ["--sdma-reading", "authors"],
            "paper": ["--sdma-reading", "paper", "--sdma-decoder-mask-at-inference"],
            "none": ["--sdma-mode", "none"]}


@pytest.fixture(scope="module", params=list(READINGS))
def recorded(request, tmp_path_factory):
    """A tiny model (SDMA in a reading, or the vanilla transformer) run once unrecorded and once recorded."""
    tmp_path = tmp_path_factory.mktemp(request.param)
    extra = READINGS[request.param]
    model, task, _ = build(tmp_path, *extra)
    for module in model.modules():  # a mixing weight as after training, so that A_hat differs from A
        if isinstance(module, SDMAMultiheadAttention):
            module.sdma.mix_weight.fill_(0.6)
    model.eval()
    src, lengths, prev = batch(task)
    with torch.no_grad():
        plain_out, plain_extra = model(src, lengths, prev)
        flags = _flags(model)
        with attention_outputs(model) as store:
            out, extra_out = model(src, lengths, prev)
            flags_inside = _flags(model)
    return {"reading": request.param, "model": model, "task": task, "batch": (src, lengths, prev),
            "unrecorded": (plain_out, plain_extra), "recorded_out": (out, extra_out), "store": store,
            "flags": (flags, flags_inside, _flags(model))}


def test_recording_changes_neither_the_outputs_nor_the_model(recorded):
    (plain_out, plain_extra), (out, extra_out) = recorded["unrecorded"], recorded["recorded_out"]
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    torch.testing.assert_close(extra_out["attn"][0], plain_extra["attn"][0], rtol=0, atol=0)
    before, inside, after = recorded["flags"]
    assert before == inside == after


def test_every_layer_and_type_with_documented_shapes(recorded):
    src, _, prev = recorded["batch"]
    B, S = src.shape
    T = prev.size(1)
    store = recorded["store"]
    shapes = {"encoder_self": (S, S), "decoder_self": (T, T), "decoder_cross": (T, S)}
    layers = attention_layers(recorded["model"])
    applies_sdma = {kind: [isinstance(m, SDMAMultiheadAttention) and m.sdma.active(training=False) for m in mods]
                    for kind, mods in layers.items()}
    assert applies_sdma["encoder_self"] == [recorded["reading"] != "none"] * 2
    if recorded["reading"] == "paper":
        assert all(all(flags) for flags in applies_sdma.values())
    for kind, (queries, keys) in shapes.items():
        assert len(store[kind]) == 2
        for outputs, sdma in zip(store[kind], applies_sdma[kind]):
            assert outputs.weights.shape == outputs.plain_weights.shape == (4, B, queries, keys)
            assert outputs.queries.shape == (queries, B, 4, 8) and outputs.query_input.shape == (queries, B, 32)
            rows = outputs.weights.sum(-1)
            torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-5, rtol=0)
            if sdma:
                assert outputs.query_resp.shape == (queries, B, 4, 4) and outputs.key_resp.shape == (keys, B, 4, 4)
                assert outputs.mix_weight == pytest.approx(0.6)
            else:
                assert outputs.query_resp is None and outputs.mix_weight is None
                assert outputs.plain_weights is outputs.weights


def test_weights_are_what_the_decoder_returns(recorded):
    """fairseq's decoder returns the last layer's cross-attention averaged over heads: the recorded
    weights (A_hat for SDMA) averaged over heads are the same numbers."""
    (_, extra) = recorded["unrecorded"]
    cross = recorded["store"]["decoder_cross"][-1].weights
    torch.testing.assert_close(cross.mean(0), extra["attn"][0].float(), atol=1e-6, rtol=1e-5)


def test_masks_mask(recorded):
    src, _, _ = recorded["batch"]
    pad = recorded["task"].source_dictionary.pad()
    store = recorded["store"]
    assert torch.all(store["decoder_self"][0].weights.triu(1) == 0)
    src_pad = src.eq(pad)
    assert src_pad.any()
    assert torch.all(store["decoder_cross"][1].weights.transpose(1, 2)[:, :, src_pad] == 0)


def test_sdma_plain_weights_are_the_model_with_g_zero(recorded):
    """A of eq. (1) in the record equals A_hat of a run with g = 0 in eq. (11), and differs from A_hat at g = 0.6."""
    if recorded["reading"] == "none":  # nothing is mixed: A is the weights themselves
        assert all(o.plain_weights is o.weights for kind in recorded["store"] for o in recorded["store"][kind])
        return
    model = recorded["model"]
    store = recorded["store"]
    saved = [(m, m.sdma.mix_weight.clone()) for m in model.modules() if isinstance(m, SDMAMultiheadAttention)]
    try:
        for module, _ in saved:
            module.sdma.mix_weight.zero_()
        with torch.no_grad(), attention_outputs(model) as at_zero:
            model(*recorded["batch"])
    finally:
        for module, g in saved:
            module.sdma.mix_weight.copy_(g)
    # the first encoder layer (later layers' inputs change with g)
    mixed, zero = store["encoder_self"][0], at_zero["encoder_self"][0]
    torch.testing.assert_close(mixed.plain_weights, zero.weights, atol=1e-6, rtol=1e-5)
    assert (mixed.weights - mixed.plain_weights).abs().max() > 1e-3


def test_queries_are_the_scaled_projection_of_the_input(recorded):
    model = recorded["model"]
    module = model.encoder.layers[1].self_attn
    outputs = recorded["store"]["encoder_self"][1]
    T, B, _ = outputs.query_input.shape
    expected = (module.q_proj(outputs.query_input) * module.scaling).view(T, B, 4, 8)
    torch.testing.assert_close(outputs.queries, expected.detach(), atol=1e-6, rtol=1e-5)


def test_only_records_the_chosen_layer(recorded):
    model = recorded["model"]
    with torch.no_grad(), attention_outputs(model, only=[("decoder_self", 1)]) as store:
        model(*recorded["batch"])
    assert store["decoder_self"][1] is not None
    assert all(o is None for kind in store for i, o in enumerate(store[kind]) if (kind, i) != ("decoder_self", 1))


def test_not_an_encoder_decoder_is_a_named_error():
    with pytest.raises(AttentionOutputsError, match="not a fairseq encoder-decoder"):
        with attention_outputs(torch.nn.Linear(2, 2)):
            pass


def test_quant_noise_keeps_calling_q_proj(tmp_path):
    """With fairseq's quant-noise on the projections, SDMA calls q_proj itself (its noise hook runs)
    instead of folding the query scaling into the weights."""
    plain, _, _ = build(tmp_path)
    (tmp_path / "q").mkdir()
    noisy, _, _ = build(tmp_path / "q", "--quant-noise-pq", "0.1", "--quant-noise-pq-block-size", "8")
    assert plain.encoder.layers[0].self_attn.fold_query_scaling
    module = noisy.encoder.layers[0].self_attn
    assert not module.fold_query_scaling
    calls = []
    handle = module.q_proj.register_forward_hook(lambda *_: calls.append(1))
    try:
        module(torch.randn(5, 2, 32), torch.randn(5, 2, 32), torch.randn(5, 2, 32))
    finally:
        handle.remove()
    assert calls
