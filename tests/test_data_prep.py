"""Data preparation for the SDMA translation recipes (scripts/prepare_*.py, extract, averaging).

Everything runs on tiny hand-written or generated files; the only heavy step is
one real sentencepiece + fairseq-preprocess run per vocabulary layout.
"""

import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import average_checkpoints  # noqa: E402
import extract_iwslt14  # noqa: E402
import prepare_ding_de_en as ding  # noqa: E402
import prepare_translation as pt  # noqa: E402

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


def write_corpus(directory: Path, lines: int = 200, seed: int = 0):
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", lines), ("valid", 20), ("test", 20)):
        de, en = [], []
        for _ in range(count):
            length = rng.randint(3, 9)
            de.append(" ".join(rng.choice(WORDS_DE) for _ in range(length)).capitalize() + ".")
            en.append(" ".join(rng.choice(WORDS_EN) for _ in range(length)).capitalize() + ".")
        (directory / f"{split}.de").write_text("\n".join(de) + "\n", encoding="utf-8")
        (directory / f"{split}.en").write_text("\n".join(en) + "\n", encoding="utf-8")
    return directory


def corpus_args(raw: Path, out: Path, *extra: str):
    return pt.parse_args([
        "--train-prefix", str(raw / "train"), "--valid-prefix", str(raw / "valid"),
        "--test-prefix", str(raw / "test"), "--src", "de", "--tgt", "en", "--out-dir", str(out),
        "--workers", "1", "--soft-vocab-limit", *extra,
    ])


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
