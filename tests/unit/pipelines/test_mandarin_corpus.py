"""Tests for pipelines.data.mandarin_synth (synth-mandarin-corpus: synthetic Mandarin ASR corpus)."""

import re
import shutil
import warnings
from pathlib import Path

import pytest
import soundfile

from pipelines.data import mandarin_synth as smc

TTS_MISSING = shutil.which("espeak-ng") is None or shutil.which("sox") is None
TTS_REASON = "espeak-ng and sox are needed to synthesise speech (apt-get install espeak-ng sox)"
needs_tts = pytest.mark.skipif(TTS_MISSING, reason=TTS_REASON)

# Six usable sentences, plus lines the cleaner must drop or normalise.
SENTENCES = """\
无法打开输入文件。
请输入新的密码：
“正在下载软件包”
磁盘空间不足，无法继续
正在读取软件包列表
无法创建临时目录
无法打开输入文件
Hello world
太短了
这是一个包含 空格 的句子
"""

KALDI_FILES = ("wav.scp", "text", "utt2spk", "spk2utt")


def read_table(path):
    """A Kaldi table as a list of (key, rest-of-line) pairs, in file order."""
    return [tuple(line.split(" ", 1)) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def sentences_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "sentences.txt"
    path.write_text(SENTENCES, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, sentences_file):
    """A 6-sentence x 2-speaker corpus, built once for the module."""
    if TTS_MISSING:
        pytest.skip(TTS_REASON)
    out = tmp_path_factory.mktemp("corpus")
    kwargs = dict(num_sentences=6, speakers_per_sentence=2, seed=1, sentences_file=str(sentences_file))
    return out, kwargs, smc.build_corpus(out, **kwargs)


def test_load_sentences_cleans_and_dedupes(sentences_file):
    pool = smc.load_sentences(str(sentences_file))
    assert pool == sorted(pool)
    assert len(pool) == 6
    assert "无法打开输入文件" in pool and "磁盘空间不足无法继续" in pool
    assert all(re.fullmatch(r"[\u4e00-\u9fff]{6,16}", s) for s in pool)


def test_load_sentences_from_gettext_catalogs():
    if not list(smc.LOCALE_DIR.glob("*.mo")):
        pytest.skip(f"no zh_CN gettext catalogs in {smc.LOCALE_DIR}")
    pool = smc.load_sentences(min_chars=6, max_chars=8)
    assert len(pool) >= 3
    assert all(re.fullmatch(r"[\u4e00-\u9fff]{6,8}", s) for s in pool)


def test_no_catalogs_error_names_directory_and_packages(tmp_path):
    (tmp_path / "broken.mo").write_bytes(b"not a catalog")
    with pytest.warns(UserWarning, match="broken.mo"):
        with pytest.raises(ValueError, match="coreutils") as err:
            smc.load_sentences(locale_dir=tmp_path)
    assert str(tmp_path) in str(err.value)


def test_empty_sentences_file_is_named(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(str(empty))):
        smc.load_sentences(str(empty))
    assert smc.main(["--out", str(tmp_path / "out"), "--sentences", str(empty)]) == 1
    assert str(empty) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_fewer_than_three_sentences(tmp_path):
    with pytest.raises(ValueError, match="at least 3 sentences"):
        smc.build_corpus(tmp_path, num_sentences=2)
    two = tmp_path / "two.txt"
    two.write_text("无法打开输入文件\n正在读取软件包列表\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"only 2 usable .*two\.txt.*at least 3"):
        smc.build_corpus(tmp_path / "out", num_sentences=10, sentences_file=str(two))


def test_split_sizes():
    assert smc.split_sizes(3, 0.1, 0.1) == {"train": 1, "dev": 1, "test": 1}
    assert smc.split_sizes(300, 0.1, 0.1) == {"train": 240, "dev": 30, "test": 30}
    with pytest.raises(ValueError, match="no training sentences"):
        smc.split_sizes(4, 0.5, 0.5)


def test_missing_tools_error_gives_install_command(monkeypatch):
    monkeypatch.setattr(smc.shutil, "which", lambda tool: None)
    with pytest.raises(RuntimeError, match="apt-get install espeak-ng sox"):
        smc.check_tools()


@needs_tts
def test_unknown_voice_variant_is_reported(monkeypatch):
    monkeypatch.setattr(smc, "SPEAKERS", (smc.Speaker("spk01", "cmn-latn-pinyin+nosuchvariant", 150, 50),))
    with pytest.raises(RuntimeError, match="nosuchvariant"):
        smc.check_tools()
    monkeypatch.undo()
    smc.check_tools()


@needs_tts
def test_synthesis_failure_names_sentence_and_stderr(tmp_path):
    speaker = smc.Speaker("spk99", "nosuchvoice", 150, 50)
    utt = smc.Utterance("spk99-s00000", speaker, "无法打开输入文件", "train")
    with pytest.raises(RuntimeError, match="无法打开输入文件.*voice does not exist"):
        smc.synthesize(utt, tmp_path / "x.wav")
    assert list(tmp_path.iterdir()) == []


def test_wavs_are_16k_mono_speech(corpus):
    out, _, info = corpus
    wavs = sorted((out / "wav").glob("*.wav"))
    assert len(wavs) == 12 == sum(c["utterances"] for c in info["counts"].values())
    for wav in wavs:
        meta = soundfile.info(str(wav))
        assert (meta.samplerate, meta.channels, meta.subtype) == (16000, 1, "PCM_16")
        assert 1.0 < meta.duration < 15.0
    assert not list((out / "wav").glob(".*")), "temporary files left behind"


def test_splits_disjoint_by_sentence_and_cover_all(corpus, sentences_file):
    out, _, info = corpus
    by_split = {}
    for split in smc.SPLITS:
        by_split[split] = {s for _, s in read_table(out / "data" / split / "text")}
        assert len(by_split[split]) == info["counts"][split]["sentences"] >= 1
    assert not (by_split["train"] & by_split["dev"] or by_split["train"] & by_split["test"]
                or by_split["dev"] & by_split["test"])
    assert set().union(*by_split.values()) == set(smc.load_sentences(str(sentences_file)))


def test_kaldi_files_sorted_and_consistent(corpus):
    out, _, _ = corpus
    for split in smc.SPLITS:
        d = out / "data" / split
        tables = {name: read_table(d / name) for name in KALDI_FILES}
        for name, rows in tables.items():
            keys = [k for k, _ in rows]
            assert keys == sorted(keys) and len(set(keys)) == len(keys), f"{split}/{name} not sorted/unique"
        utt2spk = dict(tables["utt2spk"])
        assert [k for k, _ in tables["wav.scp"]] == [k for k, _ in tables["text"]] == list(utt2spk)
        assert all(utt.startswith(spk + "-") for utt, spk in utt2spk.items())
        inverse = {}
        for utt, spk in utt2spk.items():
            inverse.setdefault(spk, []).append(utt)
        assert {spk: utts.split() for spk, utts in tables["spk2utt"]} == inverse
        for _, path in tables["wav.scp"]:
            assert Path(path).is_absolute() and Path(path).is_file()
        for _, sentence in tables["text"]:
            assert re.fullmatch(r"[\u4e00-\u9fff]+", sentence)


def test_corpus_json(corpus):
    out, kwargs, info = corpus
    assert (out / "corpus.json").is_file()
    assert info["options"]["num_sentences"] == 6 and info["options"]["seed"] == 1
    assert str(Path(kwargs["sentences_file"]).resolve()) in info["source"]
    assert {s["id"] for s in info["speakers"]} == {s.id for s in smc.SPEAKERS}
    assert all(c["seconds"] > 0 for c in info["counts"].values())


def test_rerun_is_idempotent(corpus):
    out, kwargs, info = corpus
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "wav").glob("*.wav")}
    assert mtimes, "the corpus has no wav files"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert smc.build_corpus(out, **kwargs) == info
    assert {p: p.stat().st_mtime_ns for p in (out / "wav").glob("*.wav")} == mtimes


def test_rerun_with_other_options_is_refused(corpus):
    out, kwargs, _ = corpus
    with pytest.raises(ValueError, match="other options"):
        smc.build_corpus(out, **{**kwargs, "seed": 2})


@needs_tts
def test_cli_builds_corpus(tmp_path, sentences_file, capsys):
    argv = ["--out", str(tmp_path), "--num-sentences", "3", "--speakers-per-sentence", "1",
            "--sentences", str(sentences_file), "--jobs", "1"]
    assert smc.main(argv) == 0
    assert "test: 1 sentences, 1 utterances" in capsys.readouterr().out
    assert len(list((tmp_path / "wav").glob("*.wav"))) == 3
