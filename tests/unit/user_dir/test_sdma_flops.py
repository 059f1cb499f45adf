"""benchmarks/sdma/flops.py: training / inference FLOPs of V-T, SMA-T, SDMA-T (FlopCounterMode).

The numbers are counted by PyTorch; the tests check them against what a transformer and
the SDMA terms must cost (2 FLOPs per multiply-add, matrix products only):

* V-T's forward equals the standard transformer count exactly: every linear layer
  (q/k/v/out projections, FFN, output projection) on its tokens plus the two attention
  products per module. This also shows the attention products are seen (PyTorch's counter
  has no formula for the CPU flash-attention kernel; flops.py counts with the math backend).
* SDMA's extra forward FLOPs lie in a band derived from the paper's equations (see
  :func:`sdma_overhead_band`).
"""

import json
import math

import pytest

from benchmarks.sdma import bench as bench_sdma
from benchmarks.sdma.flops import (
    MODELS,
    FlopsError,
    FlopsSetting,
    count_training_flops,
    flops_table,
    resolve_arch,
    resolve_mode,
    table_rows,
)

# source and target lengths differ, so a cost put on the wrong side shows
UNEVEN = FlopsSetting(sentences=3, src_tokens=11, tgt_tokens=7)
SMALL = FlopsSetting(sentences=2, src_tokens=5, tgt_tokens=4)
pytestmark = pytest.mark.slow  # three models counted forward and backward at the tiny size (a quarter minute)


@pytest.fixture(scope="module")
def tiny():
    """The three models at the tiny configuration, default batch (16 x 25/25 tokens)."""
    return {name: count_training_flops("tiny", name) for name in MODELS}


@pytest.fixture(scope="module")
def tiny_uneven():
    return {name: count_training_flops("tiny", name, UNEVEN) for name in MODELS}


def vanilla_forward_flops(d, s: FlopsSetting) -> int:
    """The standard transformer's forward FLOPs (2 per multiply-add), matrix products only.

    Per source token, each encoder layer: q/k/v/out projections 4E^2, FFN 2EF; per decoder
    layer and target token: self-attention 4E^2, cross-attention q/out 2E^2 (its k/v 2E^2
    run on the source tokens), FFN 2EF; the output projection E*V per target token; each
    attention module adds QK^T and AV, 2 * queries * keys * E per sentence.
    """
    E, F, B, S, T = d["embed_dim"], d["ffn_dim"], s.sentences, s.src_tokens, s.tgt_tokens
    encoder = d["encoder_layers"] * (B * S * (4 * E * E + 2 * E * F) + 2 * B * S * S * E)
    decoder = d["decoder_layers"] * (B * T * (6 * E * E + 2 * E * F) + B * S * 2 * E * E
                                     + 2 * B * T * T * E + 2 * B * T * S * E)
    return 2 * (encoder + decoder + B * T * E * s.tgt_vocab)


def sdma_overhead_band(d, s: FlopsSetting, disentangle: bool):
    """(lower, upper) bound of the forward FLOPs SMA (``disentangle=False``) or SDMA adds to V-T.

    With E = n_h * d_k, H = n_h heads, C = n_c feature clusters, C_q query clusters:

    * feature GMM (eq. 9) on every clustered token (the queries of all 3 attention types and
      the encoder tokens used as cross-attention keys): the squared Mahalanobis distance to
      C diagonal Gaussians per head, expanded as z^2 . (1/sigma^2) - 2 z . (mu/sigma^2),
      is 2 products of length d_k per cluster and head: at least 4 * E * C FLOPs per token;
      at most 4 * E * H * C, what a block-diagonal [E, H*C] weight (zeros multiplied too)
      costs.
    * semantic mask (eq. 10) M = C_q C_k^T: 2 * H * C * queries * keys per sentence (needed).
    * cluster diversity (eq. 23) C^T C per sentence: 2 * H * C^2 * tokens, at most (an
      implementation may avoid the product; lower bound 0); the authors reading (default) adds
      the cross-attention keys' diversity, so the clustered keys count too.
    * SDMA only: the query GMM (eq. 18), one d_k-dimensional GMM applied to each head's
      query, 4 * E * C_q per query (exact); L_Dqq (eq. 21) 2 * H^2 * C_q per query, twice (the
      criterion also logs it in the other reading, a second p_hh' product of eq. 16), L_Dxq's
      critic (eq. 22) 2 * H * C_q * queries^2 per sentence, the query diversity
      2 * H * C_q^2 per query, all at most.
    """
    E, H, C, Cq = d["embed_dim"], d["heads"], d["clusters"], d["query_clusters"]
    B, S, T, Le, Ld = s.sentences, s.src_tokens, s.tgt_tokens, d["encoder_layers"], d["decoder_layers"]
    queries = B * (Le * S + 2 * Ld * T)  # per attention module, summed
    clustered = queries + B * Ld * S  # + the cross-attention keys
    square_pairs = B * (Le * S * S + Ld * T * T + Ld * T * S)  # queries x keys
    mask = 2 * H * C * square_pairs
    lower = 4 * E * C * clustered + mask
    upper = 4 * E * H * C * clustered + mask + 2 * H * C * C * clustered
    if disentangle:
        query_gmm = 4 * E * Cq * queries
        lower += query_gmm
        upper += (query_gmm + 2 * 2 * H * H * Cq * queries + 2 * H * Cq * B * (Le * S * S + 2 * Ld * T * T)
                  + 2 * H * Cq * Cq * queries)
    return lower, upper


def test_sdma_costs_more_than_sma_more_than_vanilla(tiny):
    for r in tiny.values():
        for key in ("forward", "backward", "total", "per_target_token", "inference_forward",
                    "inference_forward_per_sentence"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["mode"], key)
    for key in ("total", "per_target_token", "forward"):
        assert tiny["SDMA-T"][key] > tiny["SMA-T"][key] > tiny["V-T"][key], key
    # the query GMM only feeds the regularisers: a forward pass outside training computes SMA-T's products
    assert tiny["SDMA-T"]["inference_forward"] == tiny["SMA-T"]["inference_forward"] > tiny["V-T"]["inference_forward"]
    assert tiny["V-T"]["dims"]["clusters"] == 0 and tiny["SMA-T"]["dims"]["query_clusters"] == 0
    assert tiny["SDMA-T"]["dims"]["sdma_attention_modules"] == 18  # 6 + 6 + 6 (Table I: 6+6 layers)


def test_per_target_token_is_total_over_the_target_tokens(tiny):
    setting = FlopsSetting()
    for r in tiny.values():
        assert r["target_tokens"] == setting.sentences * setting.tgt_tokens
        assert r["per_target_token"] == r["total"] / r["target_tokens"]
        assert r["total"] == r["forward"] + r["backward"]
        assert r["inference_forward_per_sentence"] == r["inference_forward"] / setting.sentences
        assert sum(r["by_op"].values()) == r["total"]


def test_backward_is_counted(tiny):
    # every counted op is a matrix product whose backward is two products of its size
    # (input and weight gradients): exactly twice the forward for the vanilla transformer
    assert tiny["V-T"]["backward"] == 2 * tiny["V-T"]["forward"]
    for r in tiny.values():
        assert r["forward"] <= r["backward"] <= 2 * r["forward"]


def test_vanilla_forward_is_the_standard_transformer_count(tiny_uneven):
    r = tiny_uneven["V-T"]
    assert r["forward"] == vanilla_forward_flops(r["dims"], UNEVEN)
    assert r["inference_forward"] == r["forward"]  # no training-only matrix products in V-T


@pytest.mark.parametrize("name, disentangle", [("SMA-T", False), ("SDMA-T", True)])
def test_sdma_overhead_lies_in_the_derived_band(tiny_uneven, name, disentangle):
    vanilla, model = tiny_uneven["V-T"], tiny_uneven[name]
    lower, upper = sdma_overhead_band(model["dims"], UNEVEN, disentangle)
    assert lower <= model["forward"] - vanilla["forward"] <= upper
    # per target token, training: the extra products' backward costs 1x-2x their forward
    vt_forward = vanilla["forward"]
    ratio = model["per_target_token"] / vanilla["per_target_token"]
    assert 1 + 2 * lower / (3 * vt_forward) <= ratio <= 1 + upper / vt_forward


def test_sdma_ratio_band_at_the_default_batch(tiny):
    lower, upper = sdma_overhead_band(tiny["SDMA-T"]["dims"], FlopsSetting(), True)
    vt_forward = tiny["V-T"]["forward"]
    ratio = tiny["SDMA-T"]["per_target_token"] / tiny["V-T"]["per_target_token"]
    assert 1 + 2 * lower / (3 * vt_forward) <= ratio <= 1 + upper / vt_forward
    assert ratio < 1.1  # "very limited" overhead (Section IV-C2); Table II: +4.5% at base


def test_table_ratios_and_rows():
    table = flops_table(("tiny",), setting=SMALL)
    results = table["configs"]["tiny"]
    assert results["V-T"]["ratio_to_vt"] == 1.0
    sdma = results["SDMA-T"]
    assert sdma["ratio_to_vt"] == sdma["per_target_token"] / results["V-T"]["per_target_token"] > 1
    assert sdma["inference_ratio_to_vt"] > 1
    assert "not counted" in table["counted"] and table["setting"]["sentences"] == SMALL.sentences
    rows = table_rows(table)
    assert [row["model"] for row in rows] == list(MODELS)
    assert float(rows[2]["ratio to V-T"]) == pytest.approx(sdma["ratio_to_vt"], abs=1e-4)


@pytest.mark.parametrize("setting, pattern", [
    (FlopsSetting(sentences=0), "sentences"),
    (FlopsSetting(tgt_tokens=0), "tgt_tokens"),
    (FlopsSetting(src_vocab=4), "src_vocab"),
])
def test_bad_settings_are_named(setting, pattern):
    with pytest.raises(FlopsError, match=pattern):
        setting.validate()


def test_bad_names_are_named():
    with pytest.raises(FlopsError, match="huge"):
        resolve_arch("huge")
    with pytest.raises(FlopsError, match="'transformer'"):  # fairseq's own: has no --sdma-mode
        resolve_arch("transformer")
    assert resolve_arch("sdma_transformer_wmt_en_de") == "sdma_transformer_wmt_en_de"
    with pytest.raises(FlopsError, match="X-T"):
        resolve_mode("X-T")
    assert resolve_arch("base") == "sdma_transformer_iwslt_de_en" and resolve_mode("SDMA-T") == "sdma"


@pytest.mark.integration  # sdma-bench --flops-only: the tiny and the base models
def test_bench_flops_only_prints_and_updates_the_json(tmp_path, monkeypatch, capsys):
    real = bench_sdma.flops_table
    monkeypatch.setattr(bench_sdma, "flops_table", lambda configs: real(configs, setting=SMALL))
    out = tmp_path / "sdma.json"
    out.write_text(json.dumps({"train_wps_ratio": 0.9}))
    bench_sdma.main(["--flops-only", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "SDMA FLOPs" in printed and "train GFLOPs/tgt token (fwd+bwd)" in printed
    assert "fwd GFLOPs/sentence (eval)" in printed and "not counted" in printed
    payload = json.loads(out.read_text())
    assert payload["train_wps_ratio"] == 0.9  # the timing results are kept
    base = payload["flops"]["configs"]["base"]
    assert payload["flops_ratio"] == base["SDMA-T"]["per_target_token"] / base["V-T"]["per_target_token"] > 1
    assert set(payload["flops"]["configs"]) == {"tiny", "base"}
