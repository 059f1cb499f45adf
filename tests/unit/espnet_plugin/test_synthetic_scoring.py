"""The synthetic-speech recipe's score stage: corpus CER with paired-bootstrap intervals over test utterances."""

import numpy as np
import pytest

from experiments.espnet import synthetic_asr as driver

REFS = {f"utt{i:02d}": "我们今天去北京"[: 3 + i % 5] for i in range(40)}


def test_cer_is_edits_over_reference_characters():
    hyps = dict(REFS, utt00="", utt01=REFS["utt01"] + "好")
    errors = driver.utterance_errors(REFS, hyps)
    scored = driver.character_error_rate(REFS, hyps)
    assert errors.shape == (40, 2) and errors[:, 1].sum() == scored["ref_chars"]
    assert scored["edits"] == len(REFS["utt00"]) + 1
    assert scored["cer"] == pytest.approx(100 * scored["edits"] / scored["ref_chars"])
    missing = driver.character_error_rate(REFS, {})  # no hypothesis reads as empty: every character deleted
    assert missing["cer"] == pytest.approx(100.0) and missing["ser"] == pytest.approx(100.0)


def test_paired_intervals_contain_the_point_and_order_the_pair():
    rng = np.random.default_rng(0)
    chars = rng.integers(5, 15, 200)
    vanilla = np.stack([rng.binomial(chars, 0.3), chars], 1)
    better = np.stack([np.maximum(vanilla[:, 0] - rng.integers(0, 3, 200), 0), chars], 1)
    out = driver.paired_cer_bootstrap({"vanilla": vanilla, "sdma": better, "conformer": vanilla}, resamples=2000)
    for system, e in (("vanilla", vanilla), ("sdma", better)):
        low, high = out["systems"][system]
        assert low < 100 * e[:, 0].sum() / e[:, 1].sum() < high
    pair = out["comparisons"]["sdma - vanilla"]
    assert pair["difference"] == pytest.approx(100 * (better[:, 0].sum() - vanilla[:, 0].sum()) / chars.sum())
    assert pair["interval"][1] < 0 and pair["share_of_resamples_above_zero"] == 0.0
    assert set(out["comparisons"]) == {"sdma - vanilla"}  # sdma_conformer was not scored
    same = driver.paired_cer_bootstrap({"sdma_conformer": vanilla, "conformer": vanilla.copy()}, resamples=500)
    assert same["comparisons"]["sdma_conformer - conformer"]["interval"] == [0.0, 0.0]  # paired: same draws


def test_unpaired_or_empty_scores_are_refused():
    with pytest.raises(driver.PipelineError, match="same, non-empty test set"):
        driver.paired_cer_bootstrap({"sdma": np.ones((3, 2), int), "vanilla": np.ones((4, 2), int)}, 10)
    with pytest.raises(driver.PipelineError, match="same, non-empty test set"):
        driver.paired_cer_bootstrap({"sdma": np.zeros((0, 2), int)}, 10)


def test_the_table_prints_intervals_and_the_difference():
    errors = {"sdma": np.array([[1, 10], [0, 5]]), "vanilla": np.array([[2, 10], [1, 5]])}
    boot = driver.paired_cer_bootstrap(errors, resamples=100)
    systems = {s: {"cer": 100 * e[:, 0].sum() / 15, "ser": 50.0, "edits": int(e[:, 0].sum()), "ref_chars": 15,
                   "utterances": 2, "cer_interval": boot["systems"][s]} for s, e in errors.items()}
    table = driver.format_results({"systems": systems, "comparisons": boot["comparisons"],
                                   "bootstrap": {"resamples": 100, "level": 0.95}})
    assert "95% interval" in table and "sdma - vanilla: -13.33 CER points" in table
    assert "2 test utterances, 100 resamples" in table


def test_bootstrap_resamples_must_be_positive():
    with pytest.raises(SystemExit):
        driver.parse_args(["--bootstrap-resamples", "0"])
