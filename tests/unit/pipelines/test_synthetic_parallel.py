"""The IWSLT-like synthetic corpus of ``make gpu-speed`` (pipelines.data.synthetic_parallel): its lengths and its
determinism. The binarised corpus is made end to end in tests/integration/test_sdma_gpu_speed.py."""

import json

import numpy as np

from pipelines.data import synthetic_parallel


def test_sentence_lengths_are_iwslt_like_on_both_sides():
    source, target = synthetic_parallel.synthetic_pairs(4000, vocab_size=3000, seed=7)
    for lines in (source, target):
        lengths = np.array([len(line.split()) for line in lines])
        assert len(lengths) == 4000
        assert 25 <= lengths.mean() <= 29
        assert lengths.min() >= 5 and lengths.max() <= 60
        assert (lengths > 45).mean() > 0.02  # IWSLT's long right tail, not a narrow band around the mean
    tokens = {token for line in source + target for token in line.split()}
    assert tokens <= {f"w{rank}" for rank in range(1, 3001)} and len(tokens) > 2000


def test_same_seed_same_corpus_other_seed_other_corpus():
    first = synthetic_parallel.synthetic_pairs(300, vocab_size=500, seed=3)
    assert synthetic_parallel.synthetic_pairs(300, vocab_size=500, seed=3) == first
    assert synthetic_parallel.synthetic_pairs(300, vocab_size=500, seed=4) != first
    # a split's stream does not depend on another split's size
    assert synthetic_parallel.synthetic_pairs(300, vocab_size=500, seed=3, split=1) != first


def test_target_lengths_follow_source_lengths():
    source, target = synthetic_parallel.synthetic_pairs(2000, seed=1)
    correlation = np.corrcoef([len(s.split()) for s in source], [len(t.split()) for t in target])[0, 1]
    assert correlation > 0.9


def test_write_corpus_files_and_statistics(tmp_path):
    stats = synthetic_parallel.write_corpus(tmp_path, {"train": 50, "valid": 5, "test": 7}, vocab_size=100, seed=2)
    for split, count in (("train", 50), ("valid", 5), ("test", 7)):
        for side in ("src", "tgt"):
            lines = (tmp_path / "text" / f"{split}.{side}").read_text().splitlines()
            assert len(lines) == count and all(lines)
    assert json.loads((tmp_path / "stats.json").read_text()) == stats
    assert stats["splits"]["train"]["src"]["sentences"] == 50


def test_enough_training_pairs_for_the_updates():
    # a 4,096-token batch holds at most 4096 / 27 pairs of mean length 27 (longer side + EOS, padding)
    assert synthetic_parallel.sentences_for_updates(300, 4096) * 27 >= 300 * 4096
    assert synthetic_parallel.sentences_for_updates(1, 10) == 1
