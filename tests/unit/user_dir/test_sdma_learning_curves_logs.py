"""sdma-learning-curves reads its runs' state from fairseq's logs: the checkpoint's update count and the validation
curve (fabricated logs in fairseq's simple format)."""

from experiments.sdma.learning_curves import checkpoint_updates, validation_curve

VALID = ("2026-11-27 07:16:16 | INFO | valid | epoch 006 | valid on 'valid' subset | loss 7.121 | nll_loss {nll} | "
         "ce_loss 7.121 | sdma_reg 0 | ppl 84.99 | wps 5296.7 | wpb 2323 | bsz 165.3 | num_updates {updates}\n")
SAVED = ("2026-11-27 07:27:31 | INFO | fairseq.checkpoint_utils | Saved checkpoint out/V-T/seed1/checkpoint_{kind}.pt "
         "(epoch 12 @ {updates} updates, score 6.134) (writing took 0.05 seconds)\n")
TRAIN = ("2026-11-27 07:09:00 | INFO | train_inner | epoch 002:      7 / 43 loss=10.557, nll_loss=10.414, "
         "num_updates={updates}, lr=0.00025\n")


def test_the_checkpoint_is_at_its_last_save_not_at_the_last_logged_update(tmp_path):
    assert checkpoint_updates(tmp_path) == 0  # no checkpoint
    (tmp_path / "checkpoint_last.pt").write_bytes(b"")
    (tmp_path / "train-1.log").write_text(SAVED.format(kind="best", updates=500) + SAVED.format(kind="last",
                                                                                               updates=1000))
    # a second process killed after 400 more updates: it logged them but saved nothing
    (tmp_path / "train-2.log").write_text(TRAIN.format(updates=1400))
    assert checkpoint_updates(tmp_path) == 1000


def test_validation_curve_of_every_log(tmp_path):
    (tmp_path / "train-1.log").write_text(VALID.format(nll=6.409, updates=250) + VALID.format(nll=5.137, updates=500))
    (tmp_path / "train-2.log").write_text(TRAIN.format(updates=600) + VALID.format(nll=4.9, updates=750))
    assert validation_curve(tmp_path) == {250: 6.409, 500: 5.137, 750: 4.9}


def test_a_difference_to_vt_is_over_the_seeds_both_reached():
    """V-T has seeds 1 and 2 at update 500, SDMA-T seed 1 only: SDMA-T - V-T is seed 1's difference, V-T's own
    BLEU the mean of its two seeds."""
    import pytest

    from experiments.bleu_bootstrap import corpus_bleu_of, sentence_statistics
    from experiments.sdma.learning_curves import paired_bleu

    references = ["the cat sat on the mat today", "a dog ran in the park", "we like green tea a lot"] * 4
    hypotheses = {("V-T", 1): ["the cat sat on a mat today", "a dog ran in a park", "we like tea a lot"] * 4,
                  ("V-T", 2): ["the cat sat on the mat", "the dog ran in the park", "we like green tea"] * 4,
                  ("SDMA-T", 1): ["a cat sat on the mat today", "a dog ran in the park", "we like green tea"] * 4}
    runs = {}
    for (system, seed), hyps in hypotheses.items():
        runs.setdefault(system, {})[seed] = {"at": {500: {"hypotheses": hyps}}, "valid": {}}
    out = paired_bleu(runs, references, 500, resamples=50)
    bleu = {key: corpus_bleu_of(sentence_statistics(h, references)) for key, h in hypotheses.items()}
    assert out["systems"]["V-T"]["bleu"] == pytest.approx((bleu["V-T", 1] + bleu["V-T", 2]) / 2)
    assert out["systems"]["V-T"]["seeds"] == [1, 2] and out["systems"]["SDMA-T"]["seeds"] == [1]
    row = out["comparisons"]["SDMA-T - V-T"]
    assert row["seeds"] == [1] and row["difference"] == pytest.approx(bleu["SDMA-T", 1] - bleu["V-T", 1])
    assert row["interval"][0] <= row["difference"] <= row["interval"][1]
