"""``tpr-roles-pos`` (``user_dir.tools.tpr.roles_pos``): role types vs POS tags (HUBERT, Section 4.5 / Figure 4).

Pure parts (alignment on a real WordPiece tokenizer, top-K role tuples, tag merging, tally and
association scores) and one end-to-end run: a tiny ``tpr_classifier`` trained for a few
updates with fairseq-train, then the command as a subprocess on a tiny OANC-format file.
"""

import argparse
import json
import os
import random
from collections import Counter

import pytest
import torch

from conftest import REPO, run_checked, save_tiny_bert, venv_bin
from user_dir.tools.tpr import roles_pos as trp

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = SPECIAL + ("the and a with . , ' s un ##believ ##able play ##ing ##s ##ed man driver "
                   "cat dog bird horse cow car bus train plane boat").split()
TOPICS = {"animal": "cat dog bird horse cow".split(), "vehicle": "car bus train plane boat".split()}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
MAX_POS = 16
OANC = """\
The/DT cat/NN plays/VBZ with/IN a/DT dog/NN ./.
Unbelievable/JJ cats/NNS and/CC dogs/NNS !/.

the/DT bus/NN 's/POS driver/NN ,/, a/DT man/NN ,/, played/VBD ./.
the/DT cat/NN and/CC the/DT dog/NN and/CC the/DT bird/NN and/CC the/DT horse/NN and/CC the/DT cow/NN ./.
A/DT horse/NN playing/VBG |/SYM|NN
"""
KEPT_WORDS = 7 + 5 + 10 + 4  # all lines but the 15-word one (17 pieces > MAX_POS): skipped


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), WORDS)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from user_dir.hf_sentence.task import load_tokenizer

    return load_tokenizer(str(tiny))


# ------------------------------------------------------------------- (a) alignment
def test_last_piece_alignment_on_a_real_wordpiece_tokenizer(tokenizer):
    sentence = trp.TaggedSentence(["The", "cat", "'s", "Unbelievable", "plays", "."],
                                  ["DT", "NN", "POS", "JJ", "VBZ", "."], 1)
    [(pieces, word_ids, n_words)] = trp.encode_words(tokenizer, [sentence])
    tokens = tokenizer.convert_ids_to_tokens(pieces[:, 0].tolist())
    assert tokens == ["[CLS]", "the", "cat", "'", "s", "un", "##believ", "##able", "play", "##s", ".", "[SEP]"]
    assert n_words == 6 and word_ids == [None, 0, 1, 2, 2, 3, 3, 3, 4, 4, 5, None]
    last = trp.last_piece_indices(word_ids, n_words)
    assert last == [1, 2, 4, 7, 9, 10]
    assert [tokens[p] for p in last] == ["the", "cat", "s", "##able", "##s", "."]  # the LAST sub-token
    # the rows have the task's Encoded layout: id, token type, sentence (-1 special), word (-1 special)
    assert pieces.shape == (12, 4) and pieces[:, 1].tolist() == [0] * 12
    assert pieces[:, 2].tolist() == [-1] + [0] * 10 + [-1]
    assert pieces[:, 3].tolist() == [-1 if w is None else w for w in word_ids]
    # a word without pieces gets -1; a piece pointing past the words is an error
    assert trp.last_piece_indices([None, 0, 2, 2, None], 3) == [1, -1, 3]
    with pytest.raises(ValueError, match="maps to word 3, but the sentence has 3 words"):
        trp.last_piece_indices([None, 0, 3], 3)


# -------------------------------------------------------------------- (b) top-K
def test_top_k_role_tuples_are_ordered_by_weight():
    a_R = torch.tensor([[0.10, 0.50, 0.30, 0.10],
                        [0.60, 0.05, 0.05, 0.30],
                        [0.20, 0.25, 0.15, 0.40]])  # [n_words 3, n_R 4]
    assert trp.top_k_roles(a_R, 2) == [(1, 2), (0, 3), (3, 1)]
    assert trp.top_k_roles(a_R, 1) == [(1,), (0,), (3,)]
    assert trp.top_k_roles(a_R, 3)[2] == (3, 1, 0)
    assert trp.role_type_name((12, 3)) == "r12+r3" and trp.role_type_name((7,)) == "r7"
    with pytest.raises(ValueError, match=r"--top-k 5: must lie in 1\.\.4"):
        trp.top_k_roles(a_R, 5)
    with pytest.raises(ValueError, match=r"\[n_words, n_R\]"):
        trp.top_k_roles(a_R[0], 1)


# ---------------------------------------------------------------- (c) tag merging
def test_tag_merging_follows_figure_4():
    cases = {"NN": "NN", "NNS": "NN", "NNP": "NN", "NNPS": "NN", "VB": "VB", "VBD": "VB", "VBZ": "VB",
             "VBN": "VB", "JJR": "JJ", "JJS": "JJ", "RBR": "RB", "RBS": "RB", "PRP": "PRP", "PRP$": "PRP",
             "WDT": "WH", "WP": "WH", "WP$": "WH", "WRB": "WH", ".": ".", ",": ".", ":": ".", "``": ".",
             "''": ".", '"': ".", "(": ".", ")": ".", "$": "SYM", "IN": "IN", "DT": "DT", "POS": "POS",
             "VBG|NN": "VB", "NN|CD": "NN", "XYZ": "XYZ"}
    for tag, merged in cases.items():
        assert trp.merge_tag(tag) == merged, tag
    assert trp.merge_tag("NNS", merge=False) == "NNS" and trp.merge_tag("VBG|NN", merge=False) == "VBG"
    ptb = ("CC CD DT EX FW IN JJ JJR JJS LS MD NN NNS NNP NNPS PDT POS PRP PRP$ RB RBR RBS RP SYM TO UH "
           "VB VBD VBG VBN VBP VBZ WDT WP WP$ WRB").split()
    assert len(ptb) == 36 and {trp.merge_tag(t) for t in ptb} | {"."} == set(trp.PTB_MERGE.values())
    assert len(set(trp.PTB_MERGE.values())) == 21  # the paper's 21 categories


def test_words_and_types_skip_words_without_pieces_and_merge_on_request():
    sentences = [trp.TaggedSentence(["Cats", "ran", "."], ["NNS", "VBD", "."], 1),
                 trp.TaggedSentence(["\u200b", "dogs"], ["SYM", "NNS"], 2)]
    roles = [[(0, 1), (2, 0), (1, 2)], [None, (0, 1)]]
    assert trp.words_and_types(sentences, roles, merge=True) == (["NN", "VB", ".", "NN"],
                                                                 ["r0+r1", "r2+r0", "r1+r2", "r0+r1"])
    assert trp.words_and_types(sentences, roles, merge=False)[0] == ["NNS", "VBD", ".", "NNS"]


def test_reading_the_oanc_format_and_its_errors(tmp_path):
    path = tmp_path / "tagged.txt"
    path.write_text(OANC)
    sentences = trp.read_tagged(path)
    assert len(sentences) == 5 and sentences[2].line == 4  # blank line 3 skipped, numbers are physical lines
    assert sentences[0].words[0] == "The" and sentences[2].words[2] == "'s" and sentences[2].tags[2] == "POS"
    assert sentences[4].words[-1] == "|" and sentences[4].tags[-1] == "SYM|NN"  # last '/' splits
    bad = tmp_path / "bad.txt"
    bad.write_text("The/DT cat/NN\nthe dog/NN\n")
    with pytest.raises(ValueError, match=r"bad\.txt:2: 'the' is not word/TAG"):
        trp.read_tagged(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"empty\.txt: no tagged sentences"):
        trp.read_tagged(empty)
    assert trp.main([str(tmp_path / "none.pt"), "--out-dir", str(tmp_path / "o"), "--oanc-file", str(bad)]) == 2


# ------------------------------------------------------------ (d) tally and NMI
def test_tally_summary_and_association():
    tags = ["NN"] * 6 + ["VB"] * 3 + ["."] * 3
    types = ["r0+r1"] * 5 + ["r2+r0"] + ["r2+r0"] * 3 + ["r3+r1"] * 3
    table = trp.tally(tags, types)
    assert table == {"NN": Counter({"r0+r1": 5, "r2+r0": 1}), "VB": Counter({"r2+r0": 3}), ".": Counter({"r3+r1": 3})}
    assert trp.ordered_tags(table) == ["NN", ".", "VB"] and trp.ordered_types(table) == ["r0+r1", "r2+r0", "r3+r1"]
    summary = trp.summarize(table, top_types=2)
    assert summary["per_pos"]["NN"] == {"count": 6, "top_role_type": "r0+r1", "share": 5 / 6, "role_types": 2}
    assert [t["role_type"] for t in summary["top_role_types"]] == ["r0+r1", "r2+r0"]
    assert summary["top_role_types"][1]["pos_distribution"] == {"VB": 0.75, "NN": 0.25}
    with pytest.raises(ValueError, match="one of each per word"):
        trp.tally(tags, types[:-1])

    # role types that determine the POS one-to-one: NMI = AMI = 1
    rng = random.Random(0)
    pos = [rng.choice(["NN", "VB", "JJ", "."]) for _ in range(400)]
    rename = {"NN": "r0+r1", "VB": "r1+r0", "JJ": "r2+r5", ".": "r4+r3"}
    scores = trp.association(pos, [rename[p] for p in pos])
    assert scores["nmi"] == pytest.approx(1.0) and scores["ami"] == pytest.approx(1.0)
    # two role types per POS: the role type still determines the POS (homogeneity 1), NMI < 1
    split = [rename[p] + ("a" if rng.random() < 0.5 else "b") for p in pos]
    scores = trp.association(pos, split)
    assert scores["homogeneity"] == pytest.approx(1.0) and 0.5 < scores["nmi"] < 1.0
    # role types independent of the POS (every pair equally often): NMI = AMI = 0
    grid = [(p, r) for p in ("NN", "VB", "JJ") for r in ("r0+r1", "r1+r2", "r2+r0", "r3+r0") for _ in range(25)]
    scores = trp.association([p for p, _ in grid], [r for _, r in grid])
    assert scores["nmi"] == pytest.approx(0.0, abs=1e-9) and scores["ami"] == pytest.approx(0.0, abs=1e-2)
    # the shuffle baseline of a perfect association sits near chance, far below 1
    baseline = trp.shuffle_baseline(pos, [rename[p] for p in pos], repeats=3, seed=0)
    assert len(baseline["nmi"]) == 3 and baseline["nmi_mean"] < 0.05


def test_a_checkpoint_that_is_not_tpr_classifier_is_refused(tmp_path, tiny, tokenizer, monkeypatch):
    from user_dir.tools.hf_sentence import predict as glue_predict
    from user_dir.hf_sentence.model import HFSentenceClassifier

    class Task:  # what the classifier's build reads of hf_sentence_prediction
        num_classes, is_regression, padding_idx = 2, False, 0

        def __init__(self):
            self.tokenizer = tokenizer

        def max_positions(self):
            return MAX_POS

    parser = argparse.ArgumentParser()
    HFSentenceClassifier.add_args(parser)
    args = parser.parse_args(["--hf-config", str(tiny)])
    args.arch = "hf_sentence_classifier"
    plain = HFSentenceClassifier.build_model(args, Task())
    monkeypatch.setattr(glue_predict, "load", lambda *a, **k: (plain, Task()))
    ckpt = tmp_path / "plain.pt"
    ckpt.write_bytes(b"")
    with pytest.raises(ValueError, match="HFSentenceClassifier model, not a tpr_classifier"):
        trp.load_tpr(ckpt, tmp_path, None, True)
    with pytest.raises(ValueError, match="no such checkpoint file"):
        trp.load_tpr(tmp_path / "missing.pt", tmp_path, None, True)


# ------------------------------------------------------------------- (e) end to end
def run(cmd):
    proc = run_checked(cmd, env=ENV, cwd=REPO)
    return proc.stdout


def test_end_to_end_tiny_tpr_checkpoint(tmp_path, tiny):
    data = tmp_path / "data"
    data.mkdir()
    rng = random.Random(3)
    for split, n in (("train", 32), ("dev", 8)):
        rows = []
        for _ in range(n):
            topic = rng.choice(sorted(TOPICS))
            a, b = rng.sample(TOPICS[topic], 2)
            rows.append(f"the {a} and a {b} .\t{int(topic == 'animal')}")
        (data / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    run([venv_bin("fairseq-train"), data, "--user-dir", REPO / "user_dir", "--task", "hf_sentence_prediction",
         "--hf-tokenizer-dir", tiny, "--sentence1-column", "0", "--label-column", "1", "--skip-header",
         "--num-classes", "2", "--max-positions", str(MAX_POS), "--arch", "tpr_classifier", "--hf-config", tiny,
         "--tpr-symbols", "6", "--tpr-roles", "5", "--tpr-symbol-dim", "4", "--tpr-role-dim", "4",
         "--tpr-heads", "2", "--criterion", "hf_sentence_prediction", "--optimizer", "adam", "--lr", "2e-3",
         "--batch-size", "16", "--max-update", "4", "--cpu", "--no-progress-bar", "--log-format", "simple",
         "--save-dir", tmp_path / "ckpt", "--seed", "1", "--no-epoch-checkpoints", "--num-workers", "0",
         "--required-batch-size-multiple", "1", "--disable-validation"])
    oanc = tmp_path / "tagged.txt"
    oanc.write_text(OANC)
    out = tmp_path / "analysis"
    stdout = run([venv_bin("tpr-roles-pos"), tmp_path / "ckpt" / "checkpoint_last.pt",
                  "--oanc-file", oanc, "--out-dir", out, "--top-k", "2", "--batch-size", "3", "--cpu",
                  "--shuffle-baseline", "--top-types", "3"])
    report = json.loads((out / "roles_pos.json").read_text())
    assert report["sentences"] == 4 and report["sentences_skipped_too_long"] == 1
    assert report["words"] == KEPT_WORDS and report["words_without_pieces"] == 0
    assert report["n_roles"] == 5 and report["possible_role_types"] == 20 and report["top_k"] == 2
    counts = report["counts"]
    assert sum(sum(c.values()) for c in counts.values()) == KEPT_WORDS
    assert counts.keys() == {"DT", "NN", "VB", "IN", ".", "JJ", "CC", "POS", "SYM"}  # merged: NNS, VBZ, "," gone
    assert sum(counts["NN"].values()) == 2 + 2 + 3 + 1 and sum(counts["."].values()) == 2 + 3
    assert all(len(t.split("+")) == 2 for c in counts.values() for t in c)
    assert report["role_types_used"] == len({t for c in counts.values() for t in c})
    assert 0 <= report["association"]["nmi"] <= 1 and len(report["shuffle_baseline"]["nmi"]) == 5
    assert len(report["top_role_types"]) == min(3, report["role_types_used"])
    lines = (out / "roles_pos.tsv").read_text().splitlines()
    header = lines[0].split("\t")
    assert header[0] == "pos" and len(lines) == 1 + len(counts)
    assert sum(int(v) for line in lines[1:] for v in line.split("\t")[1:]) == KEPT_WORDS
    assert (out / "roles_pos.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "NMI(POS, role type)" in stdout and "shuffled role types" in stdout
