"""sdma-learning-curves end to end on a tiny budget: segments, the records of every checkpoint, the kept runs reused."""

import json
import math
import subprocess

import pytest

from conftest import run_checked, venv_bin

pytestmark = pytest.mark.integration

SMALL = ["--updates", 4, "--segment", 2, "--record-every", 2, "--seeds", 1, "--systems", "V-T", "SDMA-T authors",
         "--max-words", 4, "--vocab-size", 200, "--valid-size", 30, "--test-size", 30, "--gen-max-len", 8,
         "--diagnostic-sentences", 10, "--gradient-batches", 1, "--bootstrap-resamples", 20]


def test_learning_curves_record_every_segment_and_reuse_them(tmp_path):
    out = tmp_path / "curves"
    proc = run_checked([venv_bin("sdma-learning-curves"), "--out-dir", out, *SMALL], timeout=1800)
    results = json.loads((out / "results.json").read_text())
    assert sorted(results["table"]) == ["2", "4"]
    for system in ("V-T", "SDMA-T authors"):
        run = results["runs"][system]["1"]
        # validation cross-entropy every --record-every updates, from the logs of both segments
        assert sorted(run["valid_nll_bits"], key=int) == ["2", "4"]
        assert all(math.isfinite(v) and v > 0 for v in run["valid_nll_bits"].values())
        for update in ("2", "4"):
            at = run["at"][update]
            assert at["updates"] == int(update) and at["bleu"] >= 0
            encoder = at["attention"]["encoder_self"]
            assert len(encoder["entropy_bits_per_layer"]) == 2 and len(encoder["collapsed_share_per_layer"]) == 2
            assert all(0 <= share <= 1 for share in encoder["collapsed_share_per_layer"])
    sdma = results["runs"]["SDMA-T authors"]["1"]["at"]["4"]
    assert 0 < sdma["gradient"]["reg_share"] < 1 and -1 <= sdma["gradient"]["cosine"] <= 1
    assert all(0.25 <= h <= 1 for h in sdma["attention"]["encoder_self"]["hardness_per_layer"])  # 4 clusters
    assert results["runs"]["V-T"]["1"]["at"]["4"]["gradient"] is None  # no regularisers
    # which part of eq. (24) grows the encoder's queries: CE and every weighted term, per encoder layer
    pull = sdma["gradient"]["query_pull"]
    assert {"ce", "kl_z", "kl_q", "dqq", "dxq"} <= set(pull)
    assert all(len(values) == 2 and all(math.isfinite(v) for v in values) for values in pull.values())
    for system in ("V-T", "SDMA-T authors"):
        scale = results["runs"][system]["1"]["at"]["4"]["query_scale"]
        assert all(len(scale[key]) == 2 and min(scale[key]) > 0
                   for key in ("query_norm_per_layer", "key_norm_per_layer", "score_spread_per_layer"))
    row = results["table"]["4"]["bleu"]["comparisons"]["SDMA-T authors - V-T"]
    assert row["interval"][0] <= row["difference"] <= row["interval"][1]
    assert (out / "learning_curves.png").stat().st_size > 10_000
    # the second segment resumed the first one's checkpoint
    logs = sorted((out / "SDMA-T-authors" / "seed1").glob("train-*.log"))
    assert len(logs) == 2 and "num_updates 4" in logs[1].read_text()
    assert "SDMA learning curves" in proc.stdout
    again = run_checked([venv_bin("sdma-learning-curves"), "--out-dir", out, *SMALL])
    assert "fairseq-train" not in again.stdout  # every segment kept: nothing retrained


@pytest.mark.parametrize("argv, message", [(["--updates", "10", "--segment", "3"], "--segment 3 must divide --updates 10"),
                                           (["--record-every", "0"], "--record-every must be >= 1")])
def test_bad_options_are_refused_with_one_line(argv, message):
    proc = subprocess.run([str(venv_bin("sdma-learning-curves")), *argv], capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr


def test_query_scale_and_query_pull_measure_what_they_say(tmp_path):
    """On a trained tiny SDMA-T: doubling layer 0's query projection doubles its query norm and score spread and
    leaves its keys; the CE part of ``query_pull`` is the derivative of L_CE along that scaling (central
    difference, same noise and dropout)."""
    import torch

    from experiments.sdma.learning_curves import encoder_query_scale, gradient_share
    from user_dir.tools.sdma.redundancy import load_models

    out = tmp_path / "curves"
    run_checked([venv_bin("sdma-learning-curves"), "--out-dir", out, *SMALL, "--updates", 2,
                 "--systems", "SDMA-T authors"], timeout=1800)  # the later options win
    models, cfg, task = load_models(out / "SDMA-T-authors" / "seed1" / "checkpoint_last.pt",
                                    str(out / "data" / "prep" / "bin"))
    model = models[0]
    task.load_dataset("test")
    before = encoder_query_scale(model, task, 10)
    proj = model.encoder.layers[0].self_attn.q_proj
    with torch.no_grad():
        proj.weight.mul_(2.0)
        proj.bias.mul_(2.0)
    after = encoder_query_scale(model, task, 10)
    assert after["query_norm_per_layer"][0] == pytest.approx(2 * before["query_norm_per_layer"][0], rel=1e-5)
    assert after["score_spread_per_layer"][0] == pytest.approx(2 * before["score_spread_per_layer"][0], rel=1e-5)
    assert after["key_norm_per_layer"][0] == pytest.approx(before["key_norm_per_layer"][0], rel=1e-6)
    with torch.no_grad():
        proj.weight.mul_(0.5)
        proj.bias.mul_(0.5)

    pull = gradient_share(model, cfg, task, batches=1, sentences_per_batch=16)["query_pull"]["ce"][0]
    criterion = task.build_criterion(cfg.criterion)
    sample = task.dataset("train").collater([task.dataset("train")[i] for i in range(16)])
    eps, weight = 0.03, proj.weight.detach().clone()  # fairseq's log-softmax is float32: not smaller
    losses = []
    for factor in (1 + eps, 1 - eps):
        with torch.no_grad():
            proj.weight.copy_(weight * factor)
        torch.manual_seed(0)
        with torch.no_grad():
            losses.append(float(criterion.loss_parts(model, sample).ce_loss))
    assert pull == pytest.approx((losses[0] - losses[1]) / (2 * eps), rel=0.03)
