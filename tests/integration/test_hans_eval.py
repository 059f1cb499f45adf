"""GLUE NLI layouts (MNLI, QNLI, RTE) and ``hans-eval`` (``user_dir.tools.hf_sentence.hans``: HANS, McCoy et al. 2019).

Files are small ones written here with the real column structure of GLUE's MNLI/QNLI/RTE
TSVs and of HANS's ``heuristics_evaluation_set.txt``; the end-to-end test trains a tiny
random BERT for a few updates on an MNLI-layout directory and runs the command on it.
"""

import json
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import REPO, run_checked, save_tiny_bert, venv_bin
from user_dir.tools.hf_sentence import hans as hans_eval
from user_dir.tools.hf_sentence import predict as glue_predict
from user_dir.hf_sentence.data import GLUE_TASKS, TASK_CHOICES, read_tsv
from user_dir.tools.hf_sentence.hans import ENTAILMENT as ENT, NON_ENTAILMENT as NON, HansRecord
from user_dir.hf_sentence.task import HFSentencePredictionConfig, HFSentencePredictionTask

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
WORDS = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
         + "the a doctor president actor lawyer advised saw near who . , if since and".split())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), WORDS)


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# --------------------------------------------------------------------- GLUE NLI files
MNLI_HEAD = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
             "sentence1_parse\tsentence2_parse\tsentence1\tsentence2")


def binary_parse(sentence):
    return "( " + " ".join(sentence.split()) + " )"


def parse(sentence):
    return "(ROOT (S " + " ".join(f"(NN {w})" for w in sentence.split()) + "))"


def mnli_row(i, s1, s2, labels, genre="slate"):
    """A GLUE MNLI row: 10 leading fields, then the annotator labels and the gold label
    (``labels``: train 2 fields label1 gold_label, dev 6 fields label1..label5 gold_label)."""
    return "\t".join([str(i), str(63735 + i), f"{63735 + i}n", genre, binary_parse(s1), binary_parse(s2),
                      parse(s1), parse(s2), s1, s2, *labels])


MNLI_TRAIN = [MNLI_HEAD + "\tlabel1\tgold_label",
              mnli_row(0, 'Conceptually cream "skimming has two basic dimensions.', "Product and geography .",
                       ["neutral", "neutral"], genre="government"),
              mnli_row(1, "you know during the season", "You lose the things .", ["entailment", "entailment"])]
MNLI_DEV = [MNLI_HEAD + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label",
            mnli_row(0, "The new rights are nice enough", "Everyone really likes the newest benefits ",
                     ["neutral", "entailment", "neutral", "neutral", "neutral", "neutral"]),
            mnli_row(1, "This site includes a list .", "The Government Executive articles are not on the site .",
                     ["contradiction", "contradiction", "contradiction", "contradiction", "neutral",
                      "contradiction"])]
MNLI_TEST = [MNLI_HEAD, mnli_row(7, "Hierbas , ans seco are names .", "Hierbas is a name .", [])]
QNLI = (["index\tquestion\tsentence\tlabel",
         "0\tWhat came into force after the new constitution was herald?\tAs of that day, the new "
         "constitution heralding the Second Republic came into force.\tentailment",
         '1\tWhat is the "first major city?\tThe city of Dublin.\tnot_entailment'],
        ["index\tquestion\tsentence", "5\tWhat is the capital?\tParis is."])
RTE = (["index\tsentence1\tsentence2\tlabel",
        "0\tNo Weapons of Mass Destruction Found in Iraq Yet.\tWeapons of Mass Destruction Found in Iraq."
        "\tnot_entailment",
        "1\tA place of sorrow, after Pope John Paul II died.\tPope Benedict XVI is the new leader.\tentailment"],
       ["index\tsentence1\tsentence2", "3\tMaude died.\tMaude lived."])


def test_nli_tasks_are_choices_with_classes_in_order():
    assert {"MNLI", "QNLI", "RTE"} <= set(TASK_CHOICES) and TASK_CHOICES[-1] == "custom"
    assert GLUE_TASKS["MNLI"].label_names == ("contradiction", "entailment", "neutral")
    assert GLUE_TASKS["QNLI"].label_names == GLUE_TASKS["RTE"].label_names == ("entailment", "not_entailment")
    assert GLUE_TASKS["MNLI"].labelled.describe() == (
        "sentence1=8, sentence2=9, label=last column, with a header line (every row has the header's column count)")


def test_mnli_train_dev_and_test_files(tmp_path):
    mnli = GLUE_TASKS["MNLI"]
    train = read_tsv(str(write(tmp_path / "train.tsv", MNLI_TRAIN)), mnli.labelled, mnli.unlabelled)
    assert train.sentences1 == ['Conceptually cream "skimming has two basic dimensions.', "you know during the season"]
    assert train.sentences2 == ["Product and geography .", "You lose the things ."]
    assert train.labels == ["neutral", "entailment"] and train.lines == [2, 3] and train.indices == ["0", "1"]
    dev = read_tsv(str(write(tmp_path / "dev_matched.tsv", MNLI_DEV)), mnli.labelled, mnli.unlabelled)
    assert dev.labels == ["neutral", "contradiction"]  # gold_label (column 15), not label1
    assert dev.sentences2[0] == "Everyone really likes the newest benefits "
    test = read_tsv(str(write(tmp_path / "test_matched.tsv", MNLI_TEST)), mnli.labelled, mnli.unlabelled)
    assert test.labels is None and test.indices == ["7"] and test.sentences2 == ["Hierbas is a name ."]


@pytest.mark.parametrize("name", ["QNLI", "RTE"])
def test_qnli_rte_files(tmp_path, name):
    labelled, unlabelled = QNLI if name == "QNLI" else RTE
    glue = GLUE_TASKS[name]
    dev = read_tsv(str(write(tmp_path / "dev.tsv", labelled)), glue.labelled, glue.unlabelled)
    assert dev.sentences1 == [line.split("\t")[1] for line in labelled[1:]]
    assert dev.sentences2 == [line.split("\t")[2] for line in labelled[1:]]
    assert dev.labels == [line.split("\t")[3] for line in labelled[1:]]
    test = read_tsv(str(write(tmp_path / "test.tsv", unlabelled)), glue.labelled, glue.unlabelled)
    assert test.labels is None and test.indices == [unlabelled[1].split("\t")[0]]


def test_mnli_rows_must_have_the_headers_column_count(tmp_path):
    mnli = GLUE_TASKS["MNLI"]
    short = MNLI_DEV[2].rsplit("\t", 1)[0]  # 15 columns: gold label missing
    bad = write(tmp_path / "dev_matched.tsv", MNLI_DEV + [short])
    with pytest.raises(ValueError, match=re.escape(f"{bad}:4: 15 tab-separated columns, expected 16 (sentence1=8, "
                                                   f"sentence2=9, label=last column, with a header line")):
        read_tsv(str(bad), mnli.labelled, mnli.unlabelled)
    mixed = write(tmp_path / "train.tsv", MNLI_TRAIN + [MNLI_DEV[1]])  # a 16-column dev row in train.tsv
    with pytest.raises(ValueError, match=re.escape(f"{mixed}:4: 16 tab-separated columns, expected 12")):
        read_tsv(str(mixed), mnli.labelled, mnli.unlabelled)
    ten = write(tmp_path / "y.tsv", ["x" + MNLI_HEAD, MNLI_TEST[1]])  # 10 columns, not an index header
    with pytest.raises(ValueError, match=re.escape(f"{ten}:1: 10 tab-separated columns: the label column 9 would "
                                                   f"be a sentence column")):
        read_tsv(str(ten), mnli.labelled, mnli.unlabelled)


def test_task_parses_nli_labels_and_glue_predict_writes_them(tmp_path, tiny):
    write(tmp_path / "dev_matched.tsv", MNLI_DEV)
    cfg = HFSentencePredictionConfig(data=str(tmp_path), hf_tokenizer_dir=str(tiny), train_subset="train",
                                     glue_task="MNLI")
    task = HFSentencePredictionTask.setup_task(cfg)
    assert task.num_classes == 3 and task.is_pair
    assert task.load_dataset("dev_matched").targets.tolist() == [2, 0]  # neutral, contradiction
    assert glue_predict.submission_values(task, np.array([0, 1, 2])) == ["contradiction", "entailment", "neutral"]
    write(tmp_path / "dev.tsv", RTE[0][:1] + [RTE[0][1].replace("not_entailment", "contradiction")])
    rte = HFSentencePredictionTask.setup_task(HFSentencePredictionConfig(
        data=str(tmp_path), hf_tokenizer_dir=str(tiny), train_subset="train", glue_task="RTE"))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'dev.tsv'}:2: label 'contradiction' is not one of "
                                                   f"the 2 classes ['entailment', 'not_entailment']")):
        rte.load_dataset("valid")


# ------------------------------------------------------------------------- HANS files
HANS_HEAD = ("gold_label\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\tsentence2_parse\t"
             "sentence1\tsentence2\tpairID\theuristic\tsubcase\ttemplate")


def hans_line(gold, s1, s2, pair, heuristic, subcase, template="temp1"):
    """A line of heuristics_evaluation_set.txt (parses simplified, same columns)."""
    return "\t".join([gold, binary_parse(s1), binary_parse(s2), parse(s1), parse(s2), s1, s2, pair, heuristic,
                      subcase, template])


HANS_LINES = [
    HANS_HEAD,
    hans_line(NON, "The president advised the doctor .", "The doctor advised the president .", "ex0",
              "lexical_overlap", "ln_subject/object_swap"),
    hans_line(ENT, "The doctor near the actor saw the lawyer .", "The doctor saw the lawyer .", "ex5000",
              "lexical_overlap", "le_around_prepositional_phrase"),
    hans_line(NON, "The doctor near the actor saw the lawyer .", "The actor saw the lawyer .", "ex10000",
              "subsequence", "sn_PP_on_subject", "temp13"),
    hans_line(ENT, "The president and the actor saw the doctor .", "The actor saw the doctor .", "ex15000",
              "subsequence", "se_conjunction"),
    hans_line(NON, "If the actor saw the doctor , the lawyer advised the president .", "The actor saw the doctor .",
              "ex20000", "constituent", "cn_embedded_under_if"),
    hans_line(ENT, "Since the actor saw the doctor , the lawyer advised the president .",
              "The actor saw the doctor .", "ex25000", "constituent", "ce_embedded_under_since"),
]


def test_read_hans_real_format(tmp_path):
    path = write(tmp_path / "heuristics_evaluation_set.txt", HANS_LINES + [""])  # trailing blank line
    records = hans_eval.read_hans(str(path))
    assert [r.pair_id for r in records] == ["ex0", "ex5000", "ex10000", "ex15000", "ex20000", "ex25000"]
    assert records[0] == HansRecord(NON, "The president advised the doctor .", "The doctor advised the president .",
                                    "ex0", "lexical_overlap", "ln_subject/object_swap", "temp1", 2)
    assert records[2].template == "temp13" and [r.line for r in records] == [2, 3, 4, 5, 6, 7]
    examples = hans_eval.hans_examples(str(path), records)
    assert examples.labels is None and examples.indices[4] == "ex20000" and examples.where(4) == f"{path}:6"


def test_read_hans_errors_name_file_and_line(tmp_path):
    def fails(lines, message):
        path = write(tmp_path / "hans.txt", lines)
        with pytest.raises(ValueError, match=re.escape(message.format(path=path))):
            hans_eval.read_hans(str(path))

    fails(HANS_LINES[1:], "{path}:1: no header line: expected the HANS header 'gold_label sentence1_binary_parse")
    fails(HANS_LINES[:2] + [HANS_LINES[2].rsplit("\t", 1)[0]], "{path}:3: 10 tab-separated columns, expected 11")
    fails(HANS_LINES[:2] + [HANS_LINES[2].replace(ENT, "neutral", 1)],
          "{path}:3: gold label 'neutral' is not one of ['entailment', 'non-entailment']")
    fails(HANS_LINES[:2] + [HANS_LINES[2].replace("lexical_overlap", "lexical", 1)],
          "{path}:3: heuristic 'lexical' is not one of ['lexical_overlap', 'subsequence', 'constituent']")
    fails([HANS_HEAD.replace("pairID", "pair_id")] + HANS_LINES[1:], "{path}:1: the header lacks the column(s) ['pairID']")
    fails(HANS_LINES[:1], "{path}: no HANS pairs (only a header line)")
    fails([], "{path}: empty file")
    with pytest.raises(FileNotFoundError, match="not found"):
        hans_eval.read_hans(str(tmp_path / "missing.txt"))


# ---------------------------------------------------------------------------- scoring
def record(gold, heuristic, subcase, i=0):
    return HansRecord(gold, "a", "b", f"ex{i}", heuristic, subcase, "temp1", i + 2)


def test_score_counts_each_cell_and_subcase_by_hand():
    lex, sub, con = "lexical_overlap", "subsequence", "constituent"
    cases = [  # (gold, heuristic, subcase, prediction)
        (ENT, lex, "le_passive", ENT), (ENT, lex, "le_passive", NON), (ENT, lex, "le_conjunction", ENT),  # 2/3
        (NON, lex, "ln_passive", ENT), (NON, lex, "ln_preposition", ENT),  # 0/2
        (ENT, sub, "se_adjective", ENT),  # 1/1
        (NON, sub, "sn_NP/S", NON), (NON, sub, "sn_NP/S", ENT),  # 1/2
        (NON, con, "cn_adverb", NON), (NON, con, "cn_disjunction", NON),  # 2/2; constituent/entailment: none
    ]
    records = [record(g, h, s, i) for i, (g, h, s, _) in enumerate(cases)]
    result = hans_eval.score(records, [p for *_, p in cases])
    cells = {(h, g): (c["correct"], c["total"]) for h, by in result["cells"].items() for g, c in by.items()}
    assert cells == {(lex, ENT): (2, 3), (lex, NON): (0, 2), (sub, ENT): (1, 1), (sub, NON): (1, 2),
                     (con, ENT): (0, 0), (con, NON): (2, 2)}
    assert result["cells"][lex][ENT]["accuracy"] == pytest.approx(200 / 3)
    assert result["cells"][lex][NON]["accuracy"] == 0.0 and result["cells"][con][ENT]["accuracy"] is None
    assert result["nonempty_cells"] == 5
    assert result["average"] == pytest.approx((200 / 3 + 0 + 100 + 50 + 100) / 5)
    assert result["overall"] == {"correct": 6, "total": 10, "accuracy": 60.0}
    assert result["subcases"][lex][ENT] == {"le_passive": {"correct": 1, "total": 2, "accuracy": 50.0},
                                            "le_conjunction": {"correct": 1, "total": 1, "accuracy": 100.0}}
    assert result["subcases"][sub][NON] == {"sn_NP/S": {"correct": 1, "total": 2, "accuracy": 50.0}}
    assert result["subcases"][con][ENT] == {}
    table = hans_eval.format_report(result)
    assert "lexical_overlap" in table and " 66.67 (3)" in table and "average of the 5 cells (paper's Acc.): 63.33" in table
    with pytest.raises(ValueError, match="9 predictions for 10 HANS pairs"):
        hans_eval.score(records, [p for *_, p in cases][:9])
    with pytest.raises(ValueError, match=r"predictions \['neutral'\] are not HANS labels"):
        hans_eval.score(records[:1], ["neutral"])


def test_every_class_but_entailment_is_non_entailment():
    assert hans_eval.binary_labels(np.array([0, 1, 2, 1]), 1) == [NON, ENT, NON, ENT]
    mnli = SimpleNamespace(is_regression=False, is_pair=True, label_names=GLUE_TASKS["MNLI"].label_names,
                           cfg=SimpleNamespace(glue_task="MNLI"))
    assert hans_eval.check_task(mnli, "entailment") == 1
    with pytest.raises(ValueError, match=re.escape("--entailment-label 'entails' is not one of the model's classes "
                                                   "['contradiction', 'entailment', 'neutral']")):
        hans_eval.check_task(mnli, "entails")
    single = SimpleNamespace(is_regression=False, is_pair=False, label_names=("0", "1"), cfg=SimpleNamespace(glue_task="SST-2"))
    with pytest.raises(ValueError, match="not a sentence-pair classification"):
        hans_eval.check_task(single, "1")


# ------------------------------------------------------------------------- end to end
def run(cmd):
    proc = run_checked(cmd, env={**os.environ, **ENV}, cwd=REPO)
    return proc


def test_fairseq_train_mnli_then_hans_eval(tmp_path, tiny):
    data = tmp_path / "mnli"
    data.mkdir()
    gold = ["contradiction", "entailment", "neutral"]
    pairs = [("the doctor saw the actor .", "the actor saw the doctor ."), ("the lawyer advised a president .",
                                                                           "a president advised the lawyer .")]
    write(data / "train.tsv", [MNLI_TRAIN[0]] + [mnli_row(i, *pairs[i % 2], [gold[i % 3]] * 2) for i in range(24)])
    write(data / "dev_matched.tsv", [MNLI_DEV[0]] + [mnli_row(i, *pairs[i % 2], [gold[i % 3]] * 6) for i in range(6)])
    save_dir = tmp_path / "ckpt"
    run([venv_bin("fairseq-train"), data, "--user-dir", REPO / "user_dir", "--task", "hf_sentence_prediction",
         "--glue-task", "MNLI", "--valid-subset", "dev_matched", "--hf-tokenizer-dir", tiny,
         "--arch", "hf_sentence_classifier", "--hf-config", tiny, "--criterion", "hf_sentence_prediction",
         "--optimizer", "adam", "--lr", "1e-3", "--batch-size", "8", "--max-update", "3", "--max-positions", "32",
         "--cpu", "--no-progress-bar", "--save-dir", save_dir, "--seed", "1", "--no-epoch-checkpoints",
         "--num-workers", "0", "--required-batch-size-multiple", "1"])
    (tmp_path / "hans").mkdir()
    hans = write(tmp_path / "hans" / "heuristics_evaluation_set.txt", HANS_LINES + HANS_LINES[1:])  # each pair twice
    out, predictions = tmp_path / "hans.json", tmp_path / "hans_predictions.tsv"
    proc = run([venv_bin("hans-eval"), "--path", save_dir / "checkpoint_last.pt",
                "--hans", hans, "--out", out, "--predictions", predictions, "--cpu", "--batch-size", "5"])
    result = json.loads(out.read_text())
    assert result["classes"] == gold and "average of the 6 cells" in proc.stdout
    cells = [c for by_gold in result["cells"].values() for c in by_gold.values()]
    assert len(cells) == 6 and all(c["total"] == 2 for c in cells)
    assert result["overall"]["total"] == 12 == sum(c["total"] for c in cells)
    assert result["overall"]["correct"] == sum(c["correct"] for c in cells)
    subcases = [s for by_gold in result["subcases"].values() for by in by_gold.values() for s in by.values()]
    assert len(subcases) == 6 and sum(s["total"] for s in subcases) == 12
    lines = predictions.read_text().splitlines()
    assert lines[0] == "pairID\tprediction\tclass" and len(lines) == 13
    rows = [line.split("\t") for line in lines[1:]]
    assert all(cls in gold and label == (ENT if cls == "entailment" else NON) for _, label, cls in rows)
    records = hans_eval.read_hans(str(hans))
    assert [r[0] for r in rows] == [r.pair_id for r in records]
    rescored = hans_eval.score(records, [label for _, label, _ in rows])
    assert {k: rescored[k] for k in ("cells", "subcases", "overall")} == {
        k: result[k] for k in ("cells", "subcases", "overall")}
    # the same pair twice gets the same prediction (batching/ordering does not mix examples up)
    assert [r[1:] for r in rows[:6]] == [r[1:] for r in rows[6:]]
