"""Data preparation for the SDMA translation recipes (pipelines.data, the scripts/prepare_*.sh recipes,
extract, averaging).

Everything runs on tiny hand-written or generated files; the only heavy step is
one real sentencepiece + fairseq-preprocess run per vocabulary layout.
"""

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from pipelines.data import ding, iwslt14 as extract_iwslt14, lee_sts, pattern3, translation as pt
from user_dir.tools import average_checkpoints
from conftest import REPO

SCRIPTS = REPO / "scripts"

DING_LINES = """\
# Version :: devel 2023-01-30
# License :: GPL Version 2 or later; GNU General Public License
Haus {n} | Häuser {pl} | Das Haus ist sehr groß. | Wir wohnen in einem Haus [ugs.]. :: house | houses | The house is very big. | We live in a house [coll.].
Ja, das stimmt schon.; Genau, so ist es. :: Yes, that is right.; Exactly, that is it.
Hör auf! | Das ist nicht dein Ernst! :: Stop it! | You can't be serious!
Satz {m} | Das ist ein Satz hier. :: sentence | This is a sentence here. | extra entry
Ich habe es dir/euch gesagt. :: I told you so, really.
Sie kam (gestern) nach Hause zurück. :: She came back home yesterday.
Er hat es mit etw. zu tun. :: He has to do with sth. here.
Wie spät ist es jetzt? :: What time is it now?
Wie spät ist es jetzt? :: What time is it now?
Kein Satz hier {adj} :: no sentence here at all
"""


@pytest.fixture()
def ding_file(tmp_path):
    path = tmp_path / "de-en"
    path.write_text(DING_LINES, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- Ding


def test_ding_parser_keeps_aligned_clean_sentences(ding_file):
    stats = Counter()
    pairs = ding.read_pairs(ding_file, stats=stats)
    assert pairs == [
        ("Das Haus ist sehr groß.", "The house is very big."),
        ("Wir wohnen in einem Haus.", "We live in a house."),  # [ugs.]/[coll.] stripped, no space before '.'
        ("Das ist nicht dein Ernst!", "You can't be serious!"),
        ("Wie spät ist es jetzt?", "What time is it now?"),
    ]
    assert stats["semicolon"] == 1  # the ';' alternatives line
    assert stats["too_short"] == 1  # "Hör auf!" / "Stop it!"
    assert stats["slash"] == 1 and stats["parenthesis"] == 1 and stats["template"] == 1
    assert stats["duplicate"] == 1


def test_ding_misaligned_line_gives_no_pairs():
    assert ding.aligned_subentries("Satz {m} | Das ist ein Satz hier. :: sentence | This is a sentence. | x") == []
    assert ding.aligned_subentries("# comment :: line") == []
    assert ding.aligned_subentries("Das ist gut so. [ugs.] :: That is good. [coll.]") == [
        ("Das ist gut so.", "That is good.")
    ]


def test_ding_max_words(ding_file):
    assert len(ding.read_pairs(ding_file, max_words=5)) == 4
    with pytest.raises(ding.EmptyCorpusError, match=r"too_long.*--max-words 4"):
        ding.read_pairs(ding_file, max_words=4)


def test_ding_split_is_deterministic():
    pairs = [(f"Das ist Satz {i}.", f"This is sentence {i}.") for i in range(100)]
    first = ding.split_pairs(pairs, valid_size=10, test_size=20, seed=3)
    again = ding.split_pairs(pairs, valid_size=10, test_size=20, seed=3)
    other = ding.split_pairs(pairs, valid_size=10, test_size=20, seed=4)
    assert first == again
    assert first != other
    assert {k: len(v) for k, v in first.items()} == {"test": 20, "valid": 10, "train": 70}
    assert sorted(sum(first.values(), [])) == sorted(pairs)


def test_ding_split_too_small():
    with pytest.raises(ValueError, match="at least one training pair"):
        ding.split_pairs([("a b c d.", "a b c d.")] * 5, valid_size=2, test_size=3)


def test_ding_build_corpus_writes_aligned_files(ding_file, tmp_path):
    counts = ding.build_corpus(tmp_path / "out", source=ding_file, valid_size=1, test_size=1, seed=1)
    assert counts == {"test": 1, "valid": 1, "train": 2}
    for split, count in counts.items():
        de = (tmp_path / "out" / f"{split}.de").read_text(encoding="utf-8").splitlines()
        en = (tmp_path / "out" / f"{split}.en").read_text(encoding="utf-8").splitlines()
        assert len(de) == len(en) == count


def test_ding_missing_source(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "de-en"
    with pytest.raises(ding.MissingSourceError, match="apt-get install trans-de-en"):
        ding.read_pairs(missing)
    with pytest.raises(SystemExit) as exit_info:
        ding.main(["--source", str(missing), "--out-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "apt-get install trans-de-en" in capsys.readouterr().err


def test_ding_empty_result_names_the_filter(tmp_path):
    source = tmp_path / "de-en"
    source.write_text("Hör auf! :: Stop it!\nGeh weg! :: Go away!\n", encoding="utf-8")
    with pytest.raises(ding.EmptyCorpusError, match="too_short"):
        ding.read_pairs(source)


# ----------------------------------------------------------------------------- prepare_translation

WORDS_DE = "der die das haus katze hund baum sieht hat ist groß klein rot blau".split()
WORDS_EN = "the a house cat dog tree sees has is big small red blue".split()


def write_corpus(directory: Path, lines: int = 200, seed: int = 0, valid: int = 20):
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", lines), ("valid", valid), ("test", 20)):
        de, en = [], []
        for _ in range(count):
            length = rng.randint(3, 9)
            de.append(" ".join(rng.choice(WORDS_DE) for _ in range(length)).capitalize() + ".")
            en.append(" ".join(rng.choice(WORDS_EN) for _ in range(length)).capitalize() + ".")
        (directory / f"{split}.de").write_text("".join(line + "\n" for line in de), encoding="utf-8")
        (directory / f"{split}.en").write_text("".join(line + "\n" for line in en), encoding="utf-8")
    return directory


def corpus_args(raw: Path, out: Path, *extra: str):
    return pt.parse_args([
        "--train-prefix", str(raw / "train"), "--valid-prefix", str(raw / "valid"),
        "--test-prefix", str(raw / "test"), "--src", "de", "--tgt", "en", "--out-dir", str(out),
        "--workers", "1", "--soft-vocab-limit", *extra,
    ])


@pytest.mark.integration  # the whole preparation: sentencepiece training and fairseq-preprocess
def test_prepare_translation_separate_vocabularies(tmp_path, capsys):
    raw = write_corpus(tmp_path / "raw")
    bin_dir = pt.prepare(corpus_args(raw, tmp_path / "out", "--src-vocab-size", "60",
                                     "--tgt-vocab-size", "60", "--model-type", "unigram"))
    assert bin_dir == tmp_path / "out" / "bin"
    for name in ("dict.de.txt", "dict.en.txt", "train.de-en.de.bin", "train.de-en.en.bin",
                 "valid.de-en.de.idx", "test.de-en.en.bin"):
        assert (bin_dir / name).is_file(), name
    spm_dir = tmp_path / "out" / "spm"
    assert (spm_dir / "spm.de.model").is_file() and (spm_dir / "spm.en.model").is_file()
    reference = (spm_dir / "test.en.raw").read_text(encoding="utf-8")
    assert reference == (raw / "test.en").read_text(encoding="utf-8")
    assert "▁" in (spm_dir / "train.de").read_text(encoding="utf-8")
    stages = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[prepare] stage:")]
    assert len(stages) >= 5


@pytest.mark.integration  # the whole preparation: sentencepiece training and fairseq-preprocess
def test_prepare_translation_joint_dictionary(tmp_path):
    raw = write_corpus(tmp_path / "raw", lines=100)
    bin_dir = pt.prepare(corpus_args(raw, tmp_path / "out", "--joint", "--vocab-size", "80", "--lowercase",
                                     "--max-len", "12"))
    assert (bin_dir / "dict.de.txt").read_text() == (bin_dir / "dict.en.txt").read_text()
    assert (tmp_path / "out" / "spm" / "spm.joint.model").is_file()
    assert (tmp_path / "out" / "spm" / "test.en.raw").read_text(encoding="utf-8").islower()
    train = (tmp_path / "out" / "spm" / "train.de").read_text(encoding="utf-8").splitlines()
    assert 0 < len(train) <= 100 and all(len(line.split()) <= 12 for line in train)
    with pytest.raises(pt.PrepareError, match="--overwrite"):
        pt.prepare(corpus_args(raw, tmp_path / "out", "--joint", "--vocab-size", "80"))


def test_prepare_translation_mismatched_lines(tmp_path):
    raw = write_corpus(tmp_path / "raw")
    (raw / "valid.en").write_text("only one line\n", encoding="utf-8")
    with pytest.raises(pt.PrepareError) as error:
        pt.prepare(corpus_args(raw, tmp_path / "out", "--vocab-size", "60"))
    message = str(error.value)
    assert "valid.de has 20 lines" in message and "valid.en has 1" in message


def test_prepare_translation_missing_file(tmp_path):
    raw = write_corpus(tmp_path / "raw")
    (raw / "test.de").unlink()
    with pytest.raises(pt.PrepareError, match="test.de"):
        pt.check_parallel(str(raw / "test"), "de", "en", "test")


def test_prepare_translation_option_errors():
    base = ["--train-prefix", "a", "--valid-prefix", "b", "--test-prefix", "c", "--out-dir", "o"]
    with pytest.raises(SystemExit):
        pt.parse_args(base + ["--src", "de", "--tgt", "en", "--joint"])
    with pytest.raises(SystemExit):
        pt.parse_args(base + ["--src", "de", "--tgt", "en", "--vocab-size", "100", "--jieba"])
    with pytest.raises(SystemExit):
        pt.parse_args(base + ["--src", "de", "--tgt", "en", "--src-vocab-size", "100"])
    args = pt.parse_args(base + ["--src", "zh", "--tgt", "en", "--vocab-size", "100", "--jieba"])
    assert (args.src_vocab_size, args.tgt_vocab_size) == (100, 100)
    assert pt.character_coverage(["zh"]) == 0.9995 and pt.character_coverage(["de", "en"]) == 1.0


def test_jieba_segmentation():
    line = "我们今天去北京大学参观。"
    segmented = pt.segment_zh(line)
    assert " " in segmented and segmented.replace(" ", "") == line
    assert list(pt.normalise_lines(["  我们今天去北京大学参观。 "], jieba=True)) == [segmented]


def test_filter_by_length(tmp_path):
    (tmp_path / "a").write_text("x y\n\nx y z w\nx\n", encoding="utf-8")
    (tmp_path / "b").write_text("p\nq\nr\ns t u v w\n", encoding="utf-8")
    kept, dropped = pt.filter_by_length(tmp_path / "a", tmp_path / "b", tmp_path / "a2", tmp_path / "b2", 4)
    assert (kept, dropped) == (2, 2)
    assert (tmp_path / "a2").read_text() == "x y\nx y z w\n"
    assert (tmp_path / "b2").read_text() == "p\nr\n"


# ----------------------------------------------------------------------------- IWSLT'14 extraction


def test_extract_iwslt14_split(tmp_path):
    release = tmp_path / "de-en"
    release.mkdir()
    for lang in ("de", "en"):
        lines = ["<url>http://www.ted.com/talks/x.html</url>", "<keywords>talks</keywords>",
                 "<speaker>Someone</speaker>", "<talkid>1</talkid>",
                 f"<title>Title {lang}</title>", f"<description>About {lang}.</description>"]
        lines += [f"{lang} sentence number {i} ." for i in range(50)]
        (release / f"train.tags.de-en.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
        for index, name in enumerate(extract_iwslt14.TEST_SETS):
            body = "\n".join(f'<seg id="{j}"> {name} {lang} {j} it’s </seg>' for j in range(index + 1))
            (release / f"{name}.de-en.{lang}.xml").write_text(
                f'<?xml version="1.0"?>\n<mteval>\n<doc docid="1">\n<talkid>1</talkid>\n{body}\n</doc>\n</mteval>\n',
                encoding="utf-8")
    splits = extract_iwslt14.iwslt14_split(extract_iwslt14.find_release_dir(tmp_path))
    cleaned = [("Title de", "Title en"), ("About de.", "About en.")]
    cleaned += [(f"de sentence number {i} .", f"en sentence number {i} .") for i in range(50)]
    assert splits["valid"] == [cleaned[22], cleaned[45]]  # every 23rd cleaned line (1-based)
    assert len(splits["train"]) == len(cleaned) - 2
    assert len(splits["test"]) == 1 + 2 + 3 + 4 + 5
    assert splits["test"][0] == ("IWSLT14.TED.dev2010 de 0 it's", "IWSLT14.TED.dev2010 en 0 it's")


def test_extract_iwslt14_missing_release(tmp_path):
    with pytest.raises(extract_iwslt14.ExtractError, match="train.tags.de-en.de"):
        extract_iwslt14.find_release_dir(tmp_path)


def test_prepare_scripts_print_usage_without_arguments():
    for script in ("prepare_iwslt14_de_en.sh", "prepare_wmt14_en_de.sh", "prepare_wmt17_zh_en.sh"):
        result = subprocess.run(["bash", str(SCRIPTS / script)], capture_output=True, text=True)
        assert result.returncode == 2, script
        assert "usage:" in result.stderr, script


# ----------------------------------------------------------------------------- checkpoint averaging


def test_average_checkpoints(tmp_path):
    for epoch in range(1, 5):
        state = {"model": {"w": torch.full((2, 2), float(epoch)), "steps": torch.tensor(epoch)},
                 "extra_state": {"epoch": epoch}}
        torch.save(state, tmp_path / f"checkpoint{epoch}.pt")
    torch.save({"model": {}}, tmp_path / "checkpoint_best.pt")
    paths = average_checkpoints.last_epoch_checkpoints(tmp_path, 3)
    assert [path.name for path in paths] == ["checkpoint4.pt", "checkpoint3.pt", "checkpoint2.pt"]
    averaged = average_checkpoints.average_checkpoints(paths)
    assert torch.allclose(averaged["model"]["w"], torch.full((2, 2), 3.0))
    assert averaged["model"]["steps"].item() == 4 and averaged["extra_state"]["epoch"] == 4
    with pytest.raises(average_checkpoints.AverageError, match="5 requested"):
        average_checkpoints.last_epoch_checkpoints(tmp_path, 5)


# ----------------------------------------------------------------------------- bad data named early


def run_main(module, argv, capsys):
    """``module.main(argv)`` -> (exit status, stderr lines)."""
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()


def cli_args(raw: Path, out: Path, *extra: str):
    return ["--train-prefix", str(raw / "train"), "--valid-prefix", str(raw / "valid"),
            "--test-prefix", str(raw / "test"), "--src", "de", "--tgt", "en", "--out-dir", str(out),
            "--workers", "1", "--soft-vocab-limit", "--vocab-size", "60", *extra]


def test_prepare_translation_non_utf8_line_is_named_with_file_and_line(tmp_path, capsys):
    raw = write_corpus(tmp_path / "raw")
    lines = (raw / "train.en").read_bytes().split(b"\n")
    lines[6] = lines[6][:3] + b"\xe9" + lines[6][3:]  # a Latin-1 byte on line 7
    (raw / "train.en").write_bytes(b"\n".join(lines))
    with pytest.raises(pt.PrepareError, match=r"train\.en:7: not valid UTF-8 \(byte 0xe9 at byte 4 of the line\)"):
        pt.check_parallel(str(raw / "train"), "de", "en", "train")
    code, err = run_main(pt, cli_args(raw, tmp_path / "out"), capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"prepare-translation: error: {raw / 'train.en'}:7: not valid UTF-8")
    assert not (tmp_path / "out" / "spm").exists()  # refused in the check stage, before sentencepiece


@pytest.mark.parametrize("content, problem", [("", "is empty (0 lines)"),
                                              ("\n \n\t\n" * 10, "has 30 line(s), all blank")])
def test_prepare_translation_refuses_an_empty_split_naming_the_file(tmp_path, capsys, no_binarise, content, problem):
    raw = write_corpus(tmp_path / "raw", valid=content.count("\n"))
    (raw / "valid.de").write_text(content, encoding="utf-8")
    code, err = run_main(pt, cli_args(raw, tmp_path / "out"), capsys)
    assert code == 2 and len(err) == 1
    assert f"error: valid: {raw / 'valid.de'} {problem}" in err[0] and "--valid-prefix" in err[0]
    assert not (tmp_path / "out" / "spm").exists()


def test_prepare_translation_line_count_mismatch_names_both_files_and_counts(tmp_path, capsys):
    raw = write_corpus(tmp_path / "raw")
    (raw / "test.en").write_text("one line\ntwo lines\n", encoding="utf-8")
    code, err = run_main(pt, cli_args(raw, tmp_path / "out"), capsys)
    assert code == 2 and len(err) == 1
    assert f"test: {raw / 'test.de'} has 20 lines but {raw / 'test.en'} has 2" in err[0]
    assert "fix one of the files" in err[0]


def long_sentence_corpus(tmp_path):
    """The test corpus with a 60-word German sentence on line 4 of valid and line 9 of test."""
    raw = write_corpus(tmp_path / "raw")
    for split, line in (("valid", 3), ("test", 8)):
        lines = (raw / f"{split}.de").read_text(encoding="utf-8").splitlines()
        lines[line] = " ".join(["haus"] * 60) + "."
        (raw / f"{split}.de").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return raw


@pytest.fixture()
def no_binarise(monkeypatch):
    """Record fairseq-preprocess calls instead of running it: these tests stop before or check the text."""
    calls = []
    monkeypatch.setattr(pt, "run_fairseq_preprocess",
                        lambda spm_dir, bin_dir, *args, **kwargs: calls.append(spm_dir) or bin_dir)
    return calls


def test_prepare_translation_refuses_sentences_over_max_positions(tmp_path, capsys, no_binarise):
    raw = long_sentence_corpus(tmp_path)
    code, err = run_main(pt, cli_args(raw, tmp_path / "out", "--max-positions", "30"), capsys)
    assert code == 2 and len(err) == 1 and no_binarise == []  # fairseq-preprocess never ran
    message = err[0]
    assert "2 sentence pair(s) have a side longer than --max-positions 30 tokens" in message
    assert "(train 0, valid 1, test 1)" in message
    tokens = int(message.split(f"the first is {raw / 'valid.de'}:4 with ")[1].split(" tokens")[0])
    assert tokens > 30
    assert "--truncate (cut them to 29 pieces)" in message and "--skip (drop those pairs from both sides)" in message


def test_prepare_translation_max_positions_truncate_or_skip(tmp_path, capsys, no_binarise):
    raw = long_sentence_corpus(tmp_path)
    pt.main(cli_args(raw, tmp_path / "cut", "--max-positions", "30", "--truncate"))
    assert "length: 2 pair(s) truncated to 29 pieces + </s> (train 0, valid 1, test 1)" in capsys.readouterr().out
    spm = tmp_path / "cut" / "spm"
    for split in ("valid", "test"):
        pieces = (spm / f"{split}.de").read_text(encoding="utf-8").splitlines()
        assert len(pieces) == 20 and max(len(line.split()) for line in pieces) == 29
        reference = (spm / f"{split}.de.raw").read_text(encoding="utf-8")
        assert reference == (raw / f"{split}.de").read_text(encoding="utf-8")  # the reference stays whole

    pt.main(cli_args(raw, tmp_path / "skip", "--max-positions", "30", "--skip"))
    assert "length: 2 pair(s) skipped (both sides)" in capsys.readouterr().out
    spm = tmp_path / "skip" / "spm"
    for split, dropped in (("valid", 3), ("test", 8)):
        for lang in ("de", "en"):
            assert len((spm / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()) == 19
            raw_lines = (raw / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()
            assert (spm / f"{split}.{lang}.raw").read_text(encoding="utf-8").splitlines() == \
                raw_lines[:dropped] + raw_lines[dropped + 1:]  # references stay aligned

    with pytest.raises(SystemExit):
        pt.parse_args(cli_args(raw, tmp_path / "x", "--truncate", "--skip"))
    with pytest.raises(SystemExit):
        pt.parse_args(cli_args(raw, tmp_path / "x", "--max-positions", "1"))
    assert pt.parse_args(cli_args(raw, tmp_path / "x")).max_positions == 1024


def test_fit_split_counts_lines_of_the_raw_files(tmp_path):
    spm = tmp_path
    (spm / "train.de.pieces").write_text("a b\n\na b c d e\na\na b c\n", encoding="utf-8")
    (spm / "train.en.pieces").write_text("x\ny\nx y\nx y z w\nx\n", encoding="utf-8")
    stats = pt.fit_split("train", spm, ["de", "en"], [Path("r.de"), Path("r.en")], max_positions=4, max_len=4)
    # line 2 (empty) and 3 (5 pieces > --max-len 4) are cleaned away; line 4 has 4 + 1 tokens on the en side
    assert (stats["passed"], stats["dropped"], stats["too_long"], stats["first"]) == (3, 2, 1, (Path("r.en"), 4, 5))
    assert not (spm / "train.de.pieces").exists()


def test_shell_recipes_pass_max_positions_options_and_refuse_bad_data(tmp_path):
    raw = write_corpus(tmp_path / "raw")
    for name in ("valid", "test"):
        for lang in ("de", "en"):
            (raw / f"{name}.{lang}").rename(raw / f"newstest201{3 if name == 'valid' else 4}.{lang}")
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "WORKERS": "1"}
    script = str(SCRIPTS / "prepare_wmt14_en_de.sh")
    bad = subprocess.run(["bash", script, str(raw), str(tmp_path / "out")], capture_output=True, text=True,
                         env={**env, "TOO_LONG": "cut"})
    assert bad.returncode == 2 and "TOO_LONG must be truncate or skip, not 'cut'" in bad.stderr
    (raw / "train.en").write_text("", encoding="utf-8")
    empty = subprocess.run(["bash", script, str(raw), str(tmp_path / "out")], capture_output=True, text=True,
                           env={**env, "TOO_LONG": "skip", "MAX_POSITIONS": "64"})
    assert empty.returncode == 2
    assert f"prepare-translation: error: train: {raw / 'train.en'} is empty (0 lines)" in empty.stderr


# ----------------------------------------------------------------------------- Ding: named errors, nothing silent


def test_ding_non_utf8_line_and_malformed_lines(tmp_path, capsys):
    source = tmp_path / "de-en"
    source.write_bytes(DING_LINES.encode("utf-8") + b"Gr\xf6\xdfe {f} :: size\n")
    with pytest.raises(ding.DingDataError, match=r"de-en:13: not valid UTF-8 \(byte 0xf6 at byte 3"):
        ding.read_pairs(source)
    code, err = run_main(ding, ["--source", str(source), "--out-dir", str(tmp_path / "out")], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("prepare-ding: error: ")

    source.write_text(DING_LINES + "no separator here.\nA | B :: only one\n", encoding="utf-8")
    stats = Counter()
    ding.read_pairs(source, stats=stats)
    assert (stats["malformed"], stats["misaligned"]) == (1, 2)  # + the 3-vs-2 sub-entry line of DING_LINES


def test_ding_cli_refuses_empty_splits_and_prints_rejections(tmp_path, ding_file, capsys):
    for option in ("--valid-size", "--test-size"):
        code, err = run_main(ding, ["--source", str(ding_file), "--out-dir", str(tmp_path / "o"), option, "0"],
                             capsys)
        assert code == 2 and f"{option} must be >= 1" in err[-1]
    code, err = run_main(ding, ["--source", str(ding_file), "--out-dir", str(tmp_path / "o"), "--max-words", "4"],
                         capsys)
    assert code == 2 and err == [err[0]] and "too_long" in err[0]
    ding.main(["--source", str(ding_file), "--out-dir", str(tmp_path / "o"), "--valid-size", "1", "--test-size", "1"])
    out = capsys.readouterr().out
    assert "rejected: misaligned=1, not_sentence=" in out and "duplicate=1" in out


# ----------------------------------------------------------------------------- Lee and pattern3 corpora


def test_lee_documents_blank_line_non_utf8_and_bad_ratings(tmp_path, capsys):
    lee = lee_sts
    docs = tmp_path / "lee.cor"
    docs.write_bytes(b"first document\nsecond \xa33,000 document\nthird\n\n")
    assert lee.read_documents(docs) == ["first document", "second \ufffd3,000 document", "third"]
    assert f"prepare-lee-sts: warning: {docs}:2: byte 0xa3 at byte 8" in capsys.readouterr().err
    docs.write_text("first\n\nthird\n", encoding="utf-8")
    with pytest.raises(lee.DataError, match=r"lee\.cor:2: blank line before the last document"):
        lee.read_documents(docs)
    ratings = tmp_path / "sim.txt"
    ratings.write_text("1 0.5\n0.5 x\n", encoding="utf-8")
    with pytest.raises(lee.DataError, match=r"sim\.txt: not a matrix of numbers"):
        lee.read_pairs(ratings, 2)
    ratings.write_text("1 3.5\n3.5 1\n", encoding="utf-8")
    with pytest.raises(lee.DataError, match=r"1 rating\(s\) outside \[0, 1\], the first 3.5 at row 1, column 2"):
        lee.read_pairs(ratings, 2)
    with pytest.raises(lee.DataError, match=r"fold 0: the train split would be empty \(1 rated pairs for --folds=2"):
        lee.folds([(0, 1, 2.0)], num_folds=2, dev_fraction=0.1, seed=1)


def test_pattern3_non_utf8_line_and_empty_split(tmp_path, capsys):
    p3 = pattern3
    data = tmp_path / "polarity.csv"
    data.write_bytes(b'\xef\xbb\xbf"1","a good\nfilm ."\r\n"-1","caf\xe9 ."\r\n')
    with pytest.raises(p3.DataError, match=r"polarity\.csv:3: not valid UTF-8 \(byte 0xe9 at byte 10"):
        p3.read_corpus(data, p3.CORPORA["polarity"][1])
    data.write_text('"1","a good\nfilm ."\r\n"0","bad ."\r\n', encoding="utf-8")  # a record of two lines first
    with pytest.raises(p3.DataError, match=r"polarity\.csv:3: label '0' is not one of"):  # its line, not record 2
        p3.read_corpus(data, p3.CORPORA["polarity"][1])
    data.write_text('"1","good ."\n"-1","bad ."\n"1","good ."\n', encoding="utf-8")
    code = p3.main(["--out-dir", str(tmp_path / "out"), "--corpora", "polarity", "--polarity-file", str(data)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("prepare-pattern3: error: polarity: the dev split would be empty "
                             "(2 examples")


# ------------------------------------------------------------------- prepare_translation --src-bert-dir
def tiny_bert_tokenizer(path: Path, positions: int = 64) -> Path:
    """A WordPiece tokenizer over the English test words and a BERT config.json (no weights needed here)."""
    from conftest import save_tiny_bert

    save_tiny_bert(path, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + WORDS_EN + ["##s"])
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (path / "config.json").write_text(json.dumps(config))
    return path


def bert_argv(raw: Path, out: Path, bert: Path, *extra: str):
    return ["--train-prefix", str(raw / "train"), "--valid-prefix", str(raw / "valid"),
            "--test-prefix", str(raw / "test"), "--src", "en", "--tgt", "de", "--out-dir", str(out),
            "--workers", "1", "--soft-vocab-limit", "--src-bert-dir", str(bert), "--tgt-vocab-size", "60", *extra]


@pytest.mark.integration  # the whole preparation: sentencepiece training and fairseq-preprocess
def test_prepare_translation_bert_source_uses_berts_pieces_and_vocabulary(tmp_path, capsys):
    raw = write_corpus(tmp_path / "raw")
    bert = tiny_bert_tokenizer(tmp_path / "bert")
    bin_dir = pt.prepare(pt.parse_args(bert_argv(raw, tmp_path / "out", bert)))
    spm = tmp_path / "out" / "spm"
    assert not (spm / "spm.en.model").exists() and (spm / "spm.de.model").is_file()
    first_raw = (raw / "train.en").read_text(encoding="utf-8").splitlines()[0]
    first_pieces = (spm / "train.en").read_text(encoding="utf-8").splitlines()[0]
    assert first_pieces == " ".join(first_raw.lower().replace(".", " .").split())  # uncased WordPiece
    symbols = [line.split()[0] for line in (bin_dir / "dict.en.txt").read_text(encoding="utf-8").splitlines()]
    assert symbols == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + WORDS_EN + ["##s"]  # BERT's id order
    assert "▁" in (spm / "train.de").read_text(encoding="utf-8")
    assert "bert: en side with the tokenizer of" in capsys.readouterr().out


def test_prepare_translation_bert_source_limit_is_berts_positions(tmp_path, capsys, no_binarise):
    raw = write_corpus(tmp_path / "raw")
    lines = (raw / "test.en").read_text(encoding="utf-8").splitlines()
    lines[2] = " ".join(["house"] * 12) + "."
    (raw / "test.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    bert = tiny_bert_tokenizer(tmp_path / "bert", positions=12)  # 11 pieces with </s> after [CLS]
    code, err = run_main(pt, bert_argv(raw, tmp_path / "x", bert), capsys)
    assert code == 2
    assert "(train 0, valid 0, test 1)" in err[0] and f"{raw / 'test.en'}:3 with 14 tokens" in err[0]
    assert "the source side's limit is --src-bert-dir's BERT: 11 tokens" in err[0]
    pt.main(bert_argv(raw, tmp_path / "cut", bert, "--truncate"))
    assert "truncated to 1023 (source: 10) pieces" in capsys.readouterr().out
    assert max(len(line.split()) for line in (tmp_path / "cut" / "spm" / "test.en").read_text().splitlines()) == 10


@pytest.mark.parametrize("extra, message", [
    (["--joint", "--vocab-size", "60"], "no --joint sentencepiece model"),
    (["--src-vocab-size", "60"], "drop --src-vocab-size"),
])
def test_prepare_translation_bert_source_option_errors(tmp_path, extra, message, capsys):
    raw = write_corpus(tmp_path / "raw")
    argv = bert_argv(raw, tmp_path / "o", tmp_path, *extra)
    argv.remove("--tgt-vocab-size"), argv.remove("60")
    with pytest.raises(SystemExit):
        pt.parse_args(argv)
    assert message in capsys.readouterr().err


def test_prepare_translation_bert_source_not_a_tokenizer(tmp_path, capsys, no_binarise):
    raw = write_corpus(tmp_path / "raw")
    (tmp_path / "empty").mkdir()
    code, err = run_main(pt, bert_argv(raw, tmp_path / "o", tmp_path / "empty"), capsys)
    assert code == 2 and "--src-bert-dir" in err[0] and "empty" in err[0]
