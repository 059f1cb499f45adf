"""GLUE-style TSV files -> Hugging Face fast-tokenizer encodings -> fairseq batches.

**Layouts** (0-based columns; :data:`GLUE_TASKS`). A labelled file has a fixed number of
columns, except MNLI's, whose count is the header's (``train.tsv`` 12, ``dev_matched.tsv``
16: one to five annotator labels) and whose gold label is the last column; every row must
have the header's count. GLUE's ``test.tsv`` files have an ``index`` (QQP: ``id``) column
and no label, and are recognised by that first header field and their column count (the
labelled QNLI/RTE/MNLI files start with ``index`` too, and differ in count):

======  ===========================================  ==========================  ===============
task    labelled (train/dev)                         unlabelled test.tsv         classes
======  ===========================================  ==========================  ===============
MRPC    header; Quality, #1 ID, #2 ID, #1/#2 String  header; index, ids, strings 2 (0/1)
STS-B   header; 10 cols, sentences 7, 8, score 9     header; 9 cols              regression 0..5
QQP     header; id qid1 qid2 question1/2 is_dup.     header; id question1/2      2 (0/1)
SST-2   header; sentence label                       header; index sentence      2 (0/1)
CoLA    NO header; source label orig-label sentence  header; index sentence      2 (0/1)
MNLI    header; 12 (train) or 16 (dev) cols,         header; 10 cols, index 0,   3 (contradiction,
        sentences 8, 9, gold label LAST column       sentences 8, 9              entailment, neutral)
QNLI    header; index question sentence label        header; index question      2 (entailment,
                                                     sentence                    not_entailment)
RTE     header; index sentence1 sentence2 label      header; 3 cols              2 (as QNLI)
======  ===========================================  ==========================  ===============

MNLI's splits are named after its files: ``--valid-subset dev_matched`` (or
``dev_mismatched``) reads ``dev_matched.tsv``, ``--split test_matched`` (glue_predict.py)
``test_matched.tsv``.

``custom`` takes ``--sentence1-column``, ``--sentence2-column``, ``--label-column`` and
``--skip-header``; its column count is the first row's, and a file whose rows are too short
to hold the label column (a test file) is read without labels. Files are read with
``csv.QUOTE_NONE`` (GLUE sentences contain unbalanced quotes), UTF-8 with an optional BOM;
lines end at ``\\n``, ``\\r\\n`` or ``\\r``; blank lines are skipped (with a warning naming the
first); line numbers in errors are the file's physical lines (1-based). Every problem with a
file's contents (bytes that are not UTF-8, a row with the wrong number of columns, a label
outside the classes or the range, a score float32 cannot hold, a field over the csv module's
131072-character limit) raises :class:`GlueDataError` naming ``file:line``.

**Pieces and words.** Each example is encoded with the tokenizer's own single/pair encoding
(``[CLS] a [SEP] b [SEP]`` for BERT), truncated to ``max_positions`` pieces
('longest_first' for pairs). Beside the piece ids every piece carries its sentence
(``encoding.sequence_ids``: 0/1, -1 for special tokens) and its word within that sentence
(``encoding.word_ids``: the tokenizer's pre-tokenisation words, -1 for special tokens).
With topic features, the words themselves (``encoding.word_to_chars`` spans of the original
text, lower-cased) are looked up by a subclass of the task (``user_dir/topic_vq/task.py``).

Everything is stored in flat numpy arrays (:class:`Ragged`), a few bytes per piece, so QQP's
400k pairs fit comfortably in memory.
"""

import codecs
import csv
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from fairseq.data import FairseqDataset, data_utils

from latent_core.errors import PluginConfigError

logger = logging.getLogger(__name__)

INDEX_FIELDS = ("index", "id")  # first header field of GLUE's unlabelled test files
ENCODE_CHUNK = 2048  # examples per tokenizer call


class GlueDataError(PluginConfigError):
    """A TSV file that cannot be read with its layout or label spec; the message names ``file:line``
    (a ``ValueError``, as every :class:`~latent_core.errors.PluginConfigError`)."""


# ----------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """Where the fields of a TSV file are. ``num_columns`` None: the first row's (the header's)
    count. A negative ``label`` counts from the end (-1: the last column, MNLI's gold label)."""

    num_columns: Optional[int]
    header: bool
    sentence1: int
    sentence2: Optional[int] = None
    label: Optional[int] = None
    index: Optional[int] = None  # column holding the example's GLUE index (unlabelled test files)

    def label_column(self, num_columns: int) -> Optional[int]:
        """The label's 0-based column in rows of ``num_columns`` columns (None: no label)."""
        if self.label is None or self.label >= 0:
            return self.label
        return num_columns + self.label

    def describe(self) -> str:
        """E.g. ``sentence1=8, sentence2=9, label=last column, with a header line (every row
        has the header's column count)``."""
        parts = [f"sentence1={self.sentence1}"]
        if self.sentence2 is not None:
            parts.append(f"sentence2={self.sentence2}")
        if self.label is not None:
            parts.append("label=" + ("last column" if self.label == -1 else
                                     f"column {-self.label} from the end" if self.label < 0 else str(self.label)))
        text = ", ".join(parts) + (", with a header line" if self.header else ", no header")
        if self.num_columns is None:
            text += f" (every row has the {'header' if self.header else 'first row'}'s column count)"
        return text


@dataclass(frozen=True)
class GlueTask:
    """A GLUE task's layouts, classes (``label_names``; empty for regression) and range."""

    name: str
    labelled: Layout
    unlabelled: Optional[Layout]
    label_names: Tuple[str, ...] = ()
    label_range: Optional[Tuple[float, float]] = None
    report_mcc: bool = False

    @property
    def num_classes(self) -> int:
        return len(self.label_names) or 1


BINARY = ("0", "1")
NLI = ("contradiction", "entailment", "neutral")  # class ids 0, 1, 2
NLI_BINARY = ("entailment", "not_entailment")
GLUE_TASKS: Dict[str, GlueTask] = {
    "MRPC": GlueTask("MRPC", Layout(5, True, 3, 4, label=0), Layout(5, True, 3, 4, index=0), BINARY),
    "STS-B": GlueTask("STS-B", Layout(10, True, 7, 8, label=9), Layout(9, True, 7, 8, index=0),
                      label_range=(0.0, 5.0)),
    "QQP": GlueTask("QQP", Layout(6, True, 3, 4, label=5), Layout(3, True, 1, 2, index=0), BINARY),
    "SST-2": GlueTask("SST-2", Layout(2, True, 0, label=1), Layout(2, True, 1, index=0), BINARY),
    "CoLA": GlueTask("CoLA", Layout(4, False, 3, label=1), Layout(2, True, 1, index=0), BINARY,
                     report_mcc=True),
    "MNLI": GlueTask("MNLI", Layout(None, True, 8, 9, label=-1), Layout(10, True, 8, 9, index=0), NLI),
    "QNLI": GlueTask("QNLI", Layout(4, True, 1, 2, label=3), Layout(3, True, 1, 2, index=0), NLI_BINARY),
    "RTE": GlueTask("RTE", Layout(4, True, 1, 2, label=3), Layout(3, True, 1, 2, index=0), NLI_BINARY),
}
TASK_CHOICES = tuple(GLUE_TASKS) + ("custom",)

SPLIT_FILES = {"train": "train.tsv", "valid": "dev.tsv", "dev": "dev.tsv", "test": "test.tsv"}


def split_file(split: str) -> str:
    """fairseq split name -> file name: train/valid(dev)/test -> train/dev/test.tsv, X -> X.tsv."""
    return SPLIT_FILES.get(split, f"{split}.tsv")


# ----------------------------------------------------------------------------- reading
@dataclass
class Examples:
    """The raw fields of one TSV file, one entry per example."""

    path: str
    sentences1: List[str]
    sentences2: Optional[List[str]]
    labels: Optional[List[str]]  # the label column's strings; None: the file has no labels
    lines: List[int]  # physical line number of each example (1-based)
    indices: List[str]  # submission index: the file's index column, else the 0-based row number

    def __len__(self) -> int:
        return len(self.sentences1)

    def where(self, i: int) -> str:
        return f"{self.path}:{self.lines[i]}"


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def _not_utf8(path: str) -> GlueDataError:
    """The error for a file that is not UTF-8, naming the line (and character) of the first bad byte."""
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        before = data[:error.start].decode("utf-8")
        line = len(_LINE_BREAK.findall(before)) + 1
        column = len(before) - max(before.rfind("\n"), before.rfind("\r"))
        return GlueDataError(f"{path}:{line}: not UTF-8 (byte 0x{data[error.start]:02x} at character "
                             f"{column} of the line)")
    return GlueDataError(f"{path}: not UTF-8")  # not reached: the text reader failed on these bytes


def tsv_rows(path: str):
    """(line number, fields) of the non-blank lines of a TSV file."""
    blank, first_blank = 0, None
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        try:
            for row in reader:
                if row:
                    yield reader.line_num, row
                else:  # blank lines are skipped, and counted
                    blank += 1
                    first_blank = first_blank or reader.line_num
        except UnicodeDecodeError:
            raise _not_utf8(path) from None
        except csv.Error as error:  # e.g. a field over csv.field_size_limit() characters
            raise GlueDataError(f"{path}:{reader.line_num}: {error}") from None
    if blank:
        logger.warning("%s: skipped %d blank line(s), the first at line %d", path, blank, first_blank)


def read_tsv(path: str, layout: Layout, unlabelled: Optional[Layout] = None) -> Examples:
    """Read ``path`` with ``layout``, or with ``unlabelled`` when the file is a GLUE test file
    (first header field ``index``/``id`` and ``unlabelled.num_columns`` columns).

    Raises :class:`GlueDataError` naming ``file:line`` for a row with the wrong number of
    columns, for bytes that are not UTF-8, and for a file without examples.
    """
    rows = tsv_rows(path)
    try:
        first = next(rows)
    except StopIteration:
        raise GlueDataError(f"{path}: empty file, no examples") from None
    head = first[1]
    if (unlabelled is not None and len(head) == unlabelled.num_columns
            and head[0].strip().lower() in INDEX_FIELDS):
        layout = unlabelled
    expected = layout.num_columns or len(head)
    if layout.num_columns is None:  # custom / MNLI: the header's (first row's) count
        needed = max(c for c in (layout.sentence1, layout.sentence2) if c is not None)
        if expected <= needed:
            raise GlueDataError(f"{path}:{first[0]}: {expected} tab-separated columns, but the sentence "
                                f"columns need at least {needed + 1} ({layout.describe()})")
        if layout.label is not None and expected <= layout.label:  # custom: rows too short -> no labels
            layout = Layout(None, layout.header, layout.sentence1, layout.sentence2, None)
    label = layout.label_column(expected)
    if label is not None and label in (layout.sentence1, layout.sentence2):
        raise GlueDataError(f"{path}:{first[0]}: {expected} tab-separated columns: the label column {label} "
                            f"would be a sentence column ({layout.describe()}); is this the right "
                            f"file/layout?")
    out = Examples(path, [], [] if layout.sentence2 is not None else None,
                   [] if layout.label is not None else None, [], [])

    def add(line: int, row: List[str]) -> None:
        if len(row) != expected:
            raise GlueDataError(f"{path}:{line}: {len(row)} tab-separated columns, expected {expected} "
                                f"({layout.describe()})")
        out.sentences1.append(row[layout.sentence1])
        if out.sentences2 is not None:
            out.sentences2.append(row[layout.sentence2])
        if out.labels is not None:
            out.labels.append(row[label].strip())
        out.indices.append(row[layout.index].strip() if layout.index is not None else str(len(out.lines)))
        out.lines.append(line)

    if layout.header:
        if len(head) != expected:  # a GLUE file's header (custom files take their count from it)
            raise GlueDataError(f"{path}:{first[0]}: header has {len(head)} columns, expected {expected}")
    else:
        add(*first)
    for line, row in rows:
        add(line, row)
    if not len(out):
        raise GlueDataError(f"{path}: no examples (only a header line)")
    return out


# ------------------------------------------------------------------------------ labels
@dataclass(frozen=True)
class LabelSpec:
    """Classes (``names``, in class-id order) or, with no names, a regression ``range``."""

    names: Tuple[str, ...] = ()
    range: Optional[Tuple[float, float]] = None

    @property
    def is_regression(self) -> bool:
        return not self.names

    @property
    def num_classes(self) -> int:
        return len(self.names) or 1


def parse_labels(examples: Examples, spec: LabelSpec) -> np.ndarray:
    """The label column as class ids (int64 ``[N]``) or scores (float32 ``[N]``).

    Raises :class:`GlueDataError` naming ``file:line`` for a label outside the classes or the
    range, and for a score that is not a finite float32.
    """
    assert examples.labels is not None
    if not spec.is_regression:
        index = {name: i for i, name in enumerate(spec.names)}
        out = np.empty(len(examples), dtype=np.int64)
        for i, value in enumerate(examples.labels):
            if value not in index:
                raise GlueDataError(f"{examples.where(i)}: label {value!r} is not one of the "
                                    f"{len(spec.names)} classes {list(spec.names)}")
            out[i] = index[value]
        return out
    out = np.empty(len(examples), dtype=np.float32)
    for i, value in enumerate(examples.labels):
        try:
            score = float(value)
        except ValueError:
            raise GlueDataError(f"{examples.where(i)}: label {value!r} is not a number "
                                f"(regression task)") from None
        if not math.isfinite(score):
            raise GlueDataError(f"{examples.where(i)}: label {value!r} is not finite")
        if spec.range is not None and not spec.range[0] <= score <= spec.range[1]:
            raise GlueDataError(f"{examples.where(i)}: label {score:g} outside the label range "
                                f"[{spec.range[0]:g}, {spec.range[1]:g}] (--label-range)")
        with np.errstate(over="ignore"):
            stored = np.float32(score)
        if not np.isfinite(stored):  # finite as a float64, infinite as the float32 target
            raise GlueDataError(f"{examples.where(i)}: label {value!r} is too large for a float32 "
                                f"score (|score| <= {float(np.finfo(np.float32).max):g})")
        out[i] = stored
    return out


# ---------------------------------------------------------------------------- encoding
@dataclass
class Ragged:
    """Rows of different lengths in one array: row i is ``values[offsets[i]:offsets[i+1]]``."""

    values: np.ndarray
    offsets: np.ndarray  # int64 [N + 1]

    @classmethod
    def from_rows(cls, rows: Sequence[np.ndarray], dtype, width: int = 0) -> "Ragged":
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        shape = (int(offsets[-1]),) + ((width,) if width else ())
        values = np.concatenate(rows).astype(dtype) if len(rows) and offsets[-1] else np.zeros(shape, dtype)
        return cls(values.reshape(shape), offsets)

    @classmethod
    def concat(cls, parts: Sequence["Ragged"]) -> "Ragged":
        starts = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
        offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, starts)])
        return cls(np.concatenate([p.values for p in parts]), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


# columns of Encoded.pieces
IDS, TYPES, SENTENCE, WORD = range(4)


@dataclass
class Encoded:
    """A tokenised split.

    * ``pieces``: per example ``[T, 4]`` int32: input id, token type, sentence (0/1, -1
      special), word index within its sentence (-1 special);
    * ``words[s]`` (when words were kept): per example the word ids of sentence s (in word
      order) into ``lexicon``, the split's distinct lower-cased words.
    """

    pieces: Ragged
    num_sentences: int
    words: Optional[List[Ragged]] = None
    lexicon: List[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.pieces)

    def word_lists(self, sentence: int):
        """Iterate over the examples' word lists (strings) of ``sentence`` (0 or 1)."""
        lexicon, rows = self.lexicon, self.words[sentence]
        for i in range(len(rows)):
            yield [lexicon[w] for w in rows[i]]


def encode(tokenizer, examples: Examples, max_positions: int, keep_words: bool = False) -> Encoded:
    """Tokenise every example (pairs with the tokenizer's pair encoding), truncating to
    ``max_positions`` pieces ('longest_first' for pairs); see :class:`Encoded`."""
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer: the word "
                        f"alignment needs encoding.word_ids / sequence_ids")
    pair = examples.sentences2 is not None
    has_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ("token_type_ids",))
    num_sentences = 2 if pair else 1
    lexicon: Dict[str, int] = {}
    piece_parts: List[Ragged] = []
    word_rows: List[List[np.ndarray]] = [[] for _ in range(num_sentences)]
    for start in range(0, len(examples), ENCODE_CHUNK):
        first = examples.sentences1[start:start + ENCODE_CHUNK]
        second = examples.sentences2[start:start + ENCODE_CHUNK] if pair else None
        batch = tokenizer(first, second, truncation="longest_first" if pair else True,
                          max_length=max_positions, add_special_tokens=True)
        rows = []
        for i, enc in enumerate(batch.encodings):
            sentence = np.array([-1 if s is None else s for s in enc.sequence_ids], dtype=np.int32)
            word = np.array([-1 if w is None else w for w in enc.word_ids], dtype=np.int32)
            types = np.array(enc.type_ids, dtype=np.int32) if has_types else np.zeros(len(word), np.int32)
            rows.append(np.stack([np.array(enc.ids, dtype=np.int32), types, sentence, word], axis=1))
            if keep_words:
                texts = (first[i], second[i]) if pair else (first[i],)
                for s in range(num_sentences):
                    in_s = word[sentence == s]
                    count = int(in_s.max()) + 1 if len(in_s) else 0
                    ids = np.empty(count, dtype=np.int32)
                    for w in range(count):
                        span = enc.word_to_chars(w, s)
                        text = texts[s][span[0]:span[1]].lower() if span is not None else ""
                        ids[w] = lexicon.setdefault(text, len(lexicon))
                    word_rows[s].append(ids)
        piece_parts.append(Ragged.from_rows(rows, np.int32, width=4))
    pieces = Ragged.concat(piece_parts)
    if keep_words:
        words = [Ragged.from_rows(rows, np.int32) for rows in word_rows]
        return Encoded(pieces, num_sentences, words, list(lexicon))
    return Encoded(pieces, num_sentences)


# ----------------------------------------------------------------------------- dataset
class HFSentenceDataset(FairseqDataset):
    """Encoded examples, their targets (or None: unlabelled) and optional topic features.

    A batch (:meth:`collater`) is ``{"id": [B] (dataset indices), "split_size" (N, the
    number of examples of the dataset: evaluation outputs are vectors over all of them),
    "nsentences", "ntokens", "target": [B] (int64 classes or float32 scores; absent when
    unlabelled), "net_input": {...}}`` with ``net_input`` (B x T right-padded, T the longest
    example of the batch):

    * ``src_tokens`` int64 B x T, padded with the tokenizer's ``pad_token_id``;
    * ``attention_mask`` int64 B x T (1 = real piece), ``token_type_ids`` int64 B x T (0 pad);
    * ``src_lengths`` int64 B;
    * ``piece_sentence`` int64 B x T: 0/1 = sentence 1/2, -1 = special token or padding;
    * ``piece_word`` int64 B x T: word index within its own sentence, -1 special/padding;
    * with topic features, for each sentence s = 1 (, 2): ``words_s`` int64 B x W_s, the VQ
      ids of the sentence's words in order (0 = pad, 1 = unk; ``words_s[b, piece_word]`` is a
      piece's word), and ``bow_s`` float32 B x V_topic bag-of-words counts.
    """

    def __init__(self, encoded: Encoded, targets: Optional[np.ndarray], pad_id: int,
                 shuffle: bool = False, topic=None):
        # topic: None, or per-sentence arrays with .vq, .topic (lists of Ragged) and .topic_size
        # (user_dir/topic_vq/task.py: TopicArrays)
        super().__init__()
        if targets is not None and len(targets) != len(encoded):
            raise ValueError(f"{len(targets)} targets for {len(encoded)} examples")
        self.encoded, self.targets, self.pad_id = encoded, targets, int(pad_id)
        self.shuffle, self.topic = shuffle, topic
        self.sizes = encoded.pieces.lengths()

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, index: int) -> dict:
        pieces = torch.from_numpy(self.encoded.pieces[index].astype(np.int64))
        item = {"id": index, "pieces": pieces}
        if self.targets is not None:
            item["target"] = self.targets[index]
        if self.topic is not None:
            item["words"] = [torch.from_numpy(r[index].astype(np.int64)) for r in self.topic.vq]
            item["topics"] = [torch.from_numpy(r[index].astype(np.int64)) for r in self.topic.topic]
        return item

    def collater(self, samples: List[dict]) -> dict:
        if not samples:
            return {}
        pieces = [s["pieces"] for s in samples]
        lengths = torch.tensor([len(p) for p in pieces], dtype=torch.long)

        def column(c: int, pad: int) -> torch.Tensor:
            return data_utils.collate_tokens([p[:, c] for p in pieces], pad)

        net_input = {
            "src_tokens": column(IDS, self.pad_id),
            "attention_mask": data_utils.collate_tokens([torch.ones(len(p), dtype=torch.long) for p in pieces], 0),
            "token_type_ids": column(TYPES, 0),
            "src_lengths": lengths,
            "piece_sentence": column(SENTENCE, -1),
            "piece_word": column(WORD, -1),
        }
        if self.topic is not None:
            for s in range(self.encoded.num_sentences):
                words = [x["words"][s] for x in samples]
                net_input[f"words_{s + 1}"] = data_utils.collate_tokens(
                    words, 0, pad_to_length=1)  # at least one column, even for empty sentences
                bow = torch.zeros(len(samples), self.topic.topic_size)
                for b, x in enumerate(samples):
                    ids = x["topics"][s]
                    ids = ids[ids >= 0]
                    bow[b].index_add_(0, ids, torch.ones(len(ids)))
                net_input[f"bow_{s + 1}"] = bow
        batch = {
            "id": torch.tensor([s["id"] for s in samples], dtype=torch.long),
            "split_size": len(self),
            "nsentences": len(samples),
            "ntokens": int(lengths.sum()),
            "net_input": net_input,
        }
        if self.targets is not None:
            batch["target"] = torch.from_numpy(np.array([s["target"] for s in samples]))
        return batch

    def num_tokens(self, index: int) -> int:
        return int(self.sizes[index])

    def num_tokens_vec(self, indices):
        return self.sizes[indices]

    def size(self, index: int) -> int:
        return int(self.sizes[index])

    def batch_by_size(self, indices, max_tokens=None, max_sentences=None, required_batch_size_multiple=1):
        """fairseq's batching, plus the examples it leaves out: fairseq 0.12's batch_by_size
        drops the last examples when they do not fill a multiple of
        ``--required-batch-size-multiple`` (e.g. 60 examples, batch size 16, multiple 8 -> 56);
        they become one more batch (or more, within the size limits)."""
        batches = list(super().batch_by_size(indices, max_tokens, max_sentences, required_batch_size_multiple))
        covered = sum(len(b) for b in batches)
        if covered < len(indices):
            seen = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
            missing = np.asarray(indices)[~np.isin(indices, seen)]
            batches += list(super().batch_by_size(missing, max_tokens, max_sentences, 1))
        return batches

    def ordered_indices(self) -> np.ndarray:
        """Sorted by length (stable); in random order within a length when shuffling (fairseq
        seeds numpy around this call)."""
        order = np.random.permutation(len(self)) if self.shuffle else np.arange(len(self))
        return order[np.argsort(self.sizes[order], kind="mergesort")]
