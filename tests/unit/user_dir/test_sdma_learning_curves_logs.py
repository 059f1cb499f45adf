"""sdma-learning-curves reads its runs' state from fairseq's logs: the checkpoint's update count and the validation
curve (fabricated logs in fairseq's simple format)."""

from user_dir.tools.sdma.learning_curves import checkpoint_updates, validation_curve

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
