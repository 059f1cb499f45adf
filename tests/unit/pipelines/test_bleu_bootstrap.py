"""experiments.bleu_bootstrap: the paired bootstrap over test sentences when systems ran different seeds."""

import pytest

from experiments.bleu_bootstrap import corpus_bleu_of, paired_bootstrap, paired_bootstrap_by_seed, sentence_statistics

REFERENCES = ["the cat sat on the mat today", "a dog ran in the park", "we like green tea a lot",
              "it rained all day long"] * 3
HYPOTHESES = {("V-T", 1): ["the cat sat on a mat today", "a dog ran in a park", "we like tea a lot",
                           "it rained all day"] * 3,
              ("V-T", 2): ["the cat sat on the mat", "the dog ran in the park", "we like green tea",
                           "it rained the day long"] * 3,
              ("B", 1): ["a cat sat on the mat today", "a dog ran in the park", "we like green tea",
                         "rain all day long"] * 3,
              ("B", 2): ["the cat sat on the mat today", "a dog in the park", "we like green tea a lot",
                         "it rained all day long"] * 3,
              ("C", 3): ["the cat", "a dog ran", "we like", "it rained"] * 3}


def stats(*keys):
    out = {}
    for system, seed in keys:
        out.setdefault(system, {})[seed] = sentence_statistics(HYPOTHESES[system, seed], REFERENCES)
    return out


def test_a_difference_is_over_the_seeds_both_systems_ran():
    out = paired_bootstrap_by_seed(stats(("V-T", 1), ("V-T", 2), ("B", 1), ("C", 3)), 60, seed=1,
                                   comparisons=[("B", "V-T"), ("C", "V-T")])
    bleu = {key: corpus_bleu_of(sentence_statistics(h, REFERENCES)) for key, h in HYPOTHESES.items()}
    assert out["systems"]["V-T"]["bleu"] == pytest.approx((bleu["V-T", 1] + bleu["V-T", 2]) / 2)
    assert out["systems"]["V-T"]["seeds"] == [1, 2] and out["systems"]["C"]["seeds"] == [3]
    row = out["comparisons"]["B - V-T"]
    assert row["seeds"] == [1] and row["difference"] == pytest.approx(bleu["B", 1] - bleu["V-T", 1])
    assert "C - V-T" not in out["comparisons"]  # no seed in common: no difference


def test_with_equal_seeds_it_is_the_plain_paired_bootstrap():
    by_seed = stats(("V-T", 1), ("V-T", 2), ("B", 1), ("B", 2))
    want = paired_bootstrap({system: list(runs.values()) for system, runs in by_seed.items()}, 60, seed=1,
                            comparisons=[("B", "V-T")])
    got = paired_bootstrap_by_seed(by_seed, 60, seed=1, comparisons=[("B", "V-T")])
    assert got["comparisons"]["B - V-T"] == {**want["comparisons"]["B - V-T"], "seeds": [1, 2]}
    for system in ("B", "V-T"):
        assert got["systems"][system] == {**want["systems"][system], "seeds": [1, 2]}
