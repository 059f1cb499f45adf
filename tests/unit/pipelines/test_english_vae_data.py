"""pipelines.data.english_vae (prepare-english-vae-data): OANC reading, splits, binarization, probe triplets."""

import random

import pytest

from pipelines.data import english_vae as prep

WORDS = {"DT": ["the", "a", "this", "that"], "NN": ["dog", "cat", "house", "tree", "car", "bird", "river"],
         "VBD": ["saw", "liked", "found", "left"], "JJ": ["red", "old", "big", "small"], "IN": ["near", "under"]}
PATTERNS = [["DT", "NN", "VBD", "DT", "NN", "."], ["DT", "JJ", "NN", "VBD", "IN", "DT", "NN", "."],
            ["NN", "VBD", "JJ", "."], ["DT", "NN", "IN", "DT", "NN", "VBD", "."]]


def tagged_corpus(path, n=120, seed=0):
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        tags = rng.choice(PATTERNS)
        lines.append(" ".join(f"{'.' if t == '.' else rng.choice(WORDS[t])}/{t}" for t in tags))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_oanc_splits_word_and_tag_on_the_last_slash(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("Has/VBZ the/DT and/or/CC ?/.\n")
    assert prep.read_oanc(path) == [(["has", "the", "and/or", "?"], ["VBZ", "DT", "CC", "."])]
    path.write_text("broken\n")
    with pytest.raises(prep.DataError, match=r"t\.txt:1: 'broken' is not word/TAG"):
        prep.read_oanc(path)


def test_triplets_take_the_closest_pos_sequence_with_low_overlap_and_a_word_shuffle():
    import editdistance

    target = (["the", "dog", "saw", "a", "cat", "."], ["DT", "NN", "VBD", "DT", "NN", "."])
    pool = [
        (["the", "dog", "saw", "the", "cat", "."], ["DT", "NN", "VBD", "DT", "NN", "."]),  # same words: excluded
        (["a", "bird", "liked", "this", "tree", "."], ["DT", "NN", "VBD", "DT", "NN", "."]),  # same tags, other words
        (["trees", "grow", "."], ["NNS", "VBP", "."]),
    ]
    (t, sem, syn), = prep.build_triplets([target], pool, max_overlap=0.2, seed=0)
    assert t == "the dog saw a cat ."
    assert syn == "a bird liked this tree ."
    assert sorted(sem.split()) == sorted(t.split()) and sem != t
    assert editdistance.eval(target[1], pool[1][1]) == 0


@pytest.mark.integration  # the whole preparation, fairseq-preprocess included
def test_prepare_writes_splits_binarized_data_and_triplets(tmp_path):
    oanc = tagged_corpus(tmp_path / "oanc.txt")
    summary = prep.prepare(tmp_path / "out", ["oanc"], valid_size=10, test_size=20, threshold=1,
                           probe_size=5, oanc_file=oanc, paraphrase_dev_size=0)
    out = tmp_path / "out"
    for split in ("train", "valid", "test"):
        assert (out / "bin" / f"{split}.bin").is_file()
    assert (out / "bin" / "dict.txt").is_file()
    texts = {s: set((out / "text" / f"{s}.txt").read_text().splitlines()) for s in ("train", "valid", "test")}
    assert not (texts["train"] & texts["test"]) and not (texts["valid"] & texts["test"])
    rows = (out / "probe_triplets.tsv").read_text().splitlines()
    assert summary["probe_triplets"] == len(rows) > 0
    for row in rows:
        target, sem, syn = row.split("\t")
        assert target in texts["test"] and syn in texts["train"]
        assert sorted(sem.split()) == sorted(target.split())


def test_bad_options_and_tiny_corpora_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        prep.parse_args(["--out-dir", str(tmp_path), "--min-tokens", "9", "--max-tokens", "3"])
    oanc = tagged_corpus(tmp_path / "oanc.txt", n=10)
    with pytest.raises(prep.DataError, match="fewer than --valid-size"):
        prep.prepare(tmp_path / "out", ["oanc"], valid_size=10, test_size=20, oanc_file=oanc, probe_size=0)


def test_non_utf8_line_is_named_with_file_and_line(tmp_path, capsys):
    oanc = tagged_corpus(tmp_path / "oanc.txt", n=30)
    lines = oanc.read_bytes().split(b"\n")
    lines[11] = b"caf\xe9/NN " + lines[11]
    oanc.write_bytes(b"\n".join(lines))
    with pytest.raises(prep.DataError, match=r"oanc\.txt:12: not valid UTF-8 \(byte 0xe9 at byte 4 of the line\)"):
        prep.read_oanc(oanc)
    code = prep.main(["--out-dir", str(tmp_path / "out"), "--sources", "oanc", "--oanc-file", str(oanc)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"prepare-english-vae-data: error: {oanc}:12: not valid UTF-8")
    assert not (tmp_path / "out" / "bin").exists()


def test_empty_splits_are_refused_before_binarization(tmp_path):
    for option in ("--valid-size", "--test-size"):
        with pytest.raises(SystemExit) as exit_info:
            prep.parse_args(["--out-dir", str(tmp_path), option, "0"])
        assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        prep.parse_args(["--out-dir", str(tmp_path), "--max-tokens", "1024"])  # > sentence_vae max positions - 1
    oanc = tagged_corpus(tmp_path / "oanc.txt", n=60)
    with pytest.raises(prep.DataError, match="every split needs at least one sentence"):
        prep.prepare(tmp_path / "out", ["oanc"], valid_size=0, test_size=5, oanc_file=oanc, probe_size=0)
    assert not (tmp_path / "out" / "bin").exists()


def test_ding_errors_reach_the_vae_prep_as_data_errors(tmp_path):
    source = tmp_path / "de-en"
    source.write_bytes(b"Das ist ein Satz hier. :: This is a sentence here.\nGr\xf6\xdfe :: size\n")
    with pytest.raises(prep.DataError, match=r"de-en:2: not valid UTF-8"):
        prep.prepare(tmp_path / "out", ["ding"], probe_size=0, ding_source=source)
    with pytest.raises(prep.DataError, match="apt-get install trans-de-en"):
        prep.prepare(tmp_path / "out", ["ding"], probe_size=0, ding_source=tmp_path / "missing")


def test_summary_counts_the_sentences_left_out(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "binarize", lambda *args, **kwargs: None)  # the text splits are what counts here
    oanc = tagged_corpus(tmp_path / "oanc.txt", n=120)
    with open(oanc, "a") as f:
        f.write("Dogs/NNS bark/VBP ./.\n")  # 3 tokens: under --min-tokens 4
    summary = prep.prepare(tmp_path / "out", ["oanc"], valid_size=5, test_size=5, threshold=1, probe_size=0,
                           oanc_file=oanc)
    sentences = [tuple(tokens) for tokens, _ in prep.read_oanc(oanc)]
    kept = sum(summary["sentences"].values())
    assert summary["dropped"]["length"] == sum(1 for s in sentences if not 4 <= len(s) <= 25) >= 1
    assert summary["dropped"]["duplicate"] > 0  # 120 draws from a few patterns repeat
    assert kept + summary["dropped"]["length"] + summary["dropped"]["duplicate"] == len(sentences)


DING = """# comment
Schön dich zu sehen! :: Good to see you again!; You are a sight for sore eyes!
Ich bin eben erst aufgestanden. :: I have only just got up.; I got up just now.; I just got up.
Er kam. :: He came.; He arrived.
jdm. helfen :: to help sb. out; to give sb. a hand.
Das ist es. | Geh! :: That is the thing.; That is the point. | Go!
Es regnet. :: It is raining here.; It is raining/pouring here.
"""


def test_ding_paraphrase_groups_are_real_alternatives_that_pass_the_sentence_filters():
    from collections import Counter

    from pipelines.data import ding

    stats = Counter()
    groups = ding.english_paraphrase_groups(DING.splitlines(), stats)
    assert groups == [
        ["Good to see you again!", "You are a sight for sore eyes!"],
        ["I have only just got up.", "I got up just now.", "I just got up."],
        ["That is the thing.", "That is the point."],
    ]
    # "He came." is too short, sb. is a placeholder, the slash an alternative: none left a pair
    assert stats["alternative_too_short"] == 2 and stats["alternative_slash"] == 1
    assert stats["alternative_template"] >= 1 and stats["groups"] == 3


def test_most_frequent_tagger_learns_tags_and_suffixes(tmp_path):
    corpus = prep.read_oanc(tagged_corpus(tmp_path / "oanc.txt", n=200))
    tagger = prep.MostFrequentTagger(corpus[:150])
    held_out = corpus[150:]
    correct = sum(p == t for tokens, tags in held_out for p, t in zip(tagger.tag(tokens), tags))
    assert correct / sum(len(tags) for _, tags in held_out) > 0.95
    tagger.suffixes["ing"] = "VBG"
    assert tagger.tag(["walking", "1984", "zzz"]) == ["VBG", "CD", "NN"]
    with pytest.raises(prep.DataError, match="tagged sentences"):
        prep.MostFrequentTagger([])


def test_paraphrase_triplets_pair_a_target_with_its_paraphrase_and_a_structural_twin(tmp_path):
    from pipelines.data import ding

    pool = prep.read_oanc(tagged_corpus(tmp_path / "oanc.txt", n=120))
    groups = ding.english_paraphrase_groups(DING.splitlines())
    tagged = pool + [(prep.tokenize(s), tags) for s, tags in (
        ("I got up just now.", ["PRP", "VBD", "RP", "RB", "RB", "."]),
        ("Good to see you again!", ["JJ", "TO", "VB", "PRP", "RB", "."]))]
    triplets = prep.build_paraphrase_triplets(groups, prep.MostFrequentTagger(tagged), pool, 0.2, seed=0)
    assert len(triplets) == 3
    for (target, paraphrase, syntactic), group in zip(triplets, groups):
        tokenised = {" ".join(prep.tokenize(s)) for s in group}
        assert target in tokenised and paraphrase in tokenised and target != paraphrase
        assert syntactic not in tokenised and prep.jaccard(target.split(), syntactic.split()) <= 0.2
        assert any(syntactic == " ".join(tokens) for tokens, _ in pool)
    dev, test = prep.split_dev_test(triplets, 1, seed=0)
    assert len(dev) == 1 and len(test) == 2 and not set(dev) & set(test)
    with pytest.raises(prep.DataError, match="--paraphrase-dev-size 3"):
        prep.split_dev_test(triplets, 3, seed=0)


@pytest.mark.integration  # the whole preparation, fairseq-preprocess included
def test_prepare_writes_the_paraphrase_probe_from_the_ding_file(tmp_path):
    source = tmp_path / "de-en"
    source.write_text(DING, encoding="utf-8")
    oanc = tagged_corpus(tmp_path / "oanc.txt", n=200)
    summary = prep.prepare(tmp_path / "out", ["oanc"], valid_size=10, test_size=20, threshold=1, probe_size=5,
                           oanc_file=oanc, ding_source=source, paraphrase_dev_size=1)
    dev = (tmp_path / "out" / "paraphrase_dev.tsv").read_text().splitlines()
    test = (tmp_path / "out" / "paraphrase_test.tsv").read_text().splitlines()
    assert summary["paraphrase_probe"]["groups"] == 3
    assert len(dev) == 1 and len(dev) + len(test) == summary["paraphrase_probe"]["triplets"]
