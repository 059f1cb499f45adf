"""sdma-readings-runs: sacreBLEU statistics per sentence and the paired bootstrap over seeds."""

import numpy as np
import pytest
import sacrebleu

from experiments.bleu_bootstrap import corpus_bleu_of, paired_bootstrap, sentence_statistics
from experiments.sdma.readings_runs import COMPARISONS

REFERENCES = ["the cat sat on the mat", "a dog ran in the park today", "we like green tea very much",
              "it rained all day long", "she reads a book at night", "they walk to school together"] * 5
GOOD = list(REFERENCES)
WORSE = [r.rsplit(" ", 2)[0] + " x y" for r in REFERENCES]  # the last two words wrong


def test_sentence_statistics_reproduce_corpus_bleu():
    stats = sentence_statistics(WORSE, REFERENCES)
    assert stats.shape == (len(REFERENCES), 10)
    assert corpus_bleu_of(stats) == pytest.approx(sacrebleu.corpus_bleu(WORSE, [REFERENCES]).score)


def test_paired_bootstrap_over_seeds():
    good, worse = sentence_statistics(GOOD, REFERENCES), sentence_statistics(WORSE, REFERENCES)
    out = paired_bootstrap({"V-T": [worse, worse], "SDMA-T paper": [worse, worse],
                            "SDMA-T authors": [good, worse]}, resamples=200, seed=1, comparisons=COMPARISONS)
    same = out["comparisons"]["SDMA-T paper - V-T"]
    assert same["difference"] == 0.0 and same["interval"] == [0.0, 0.0]
    better = out["comparisons"]["SDMA-T authors - V-T"]
    expected = (corpus_bleu_of(good) + corpus_bleu_of(worse)) / 2 - corpus_bleu_of(worse)  # seed mean
    assert better["difference"] == pytest.approx(expected)
    assert 0 < better["interval"][0] <= expected <= better["interval"][1]
    assert better["share_of_resamples_above_zero"] == 1.0
    low, high = out["systems"]["V-T"]["interval"]
    assert low <= out["systems"]["V-T"]["bleu"] <= high
    with pytest.raises(SystemExit, match="hypotheses for"):
        sentence_statistics(GOOD[:3], REFERENCES)
    assert isinstance(good, np.ndarray)
