"""Kaldi-style data directories (``wav.scp``, ``text``, ``utt2spk``): the plugin's one reader.

Plain Python (no ESPnet, no fairseq), so the corpus builder and the recipe driver use it
without loading ESPnet.

**Tables** (:func:`read_kaldi_table`) are read the way ESPnet reads them
(``espnet2.fileio.read_text.read_2columns_text``), so that a file accepted here means the same
to ESPnet:

* UTF-8; lines end at ``\\n``, ``\\r\\n`` or ``\\r`` (Python's universal newlines, as ESPnet's
  ``open(path, "r")``);
* a line is ``line.rstrip().split(maxsplit=1)``: the key (utterance id) is its first field
  (fields are separated by any Unicode whitespace, ``str.split``), the value is the rest of the
  line without its leading and trailing whitespace; whitespace inside the value is kept (a
  ``text`` transcript, a ``wav.scp`` command such as ``sox a.flac -t wav - |``);
* a line with a key alone has the empty value, as in ESPnet: allowed in ``text`` (an empty
  transcript), refused where a value is required (``wav.scp``, ``utt2spk``);
* ``utt2spk`` values are one field (the speaker id), as Kaldi's ``validate_data_dir.sh`` wants.

Refused with :class:`KaldiDataDirError` naming ``file:line``, where ESPnet raises an unrelated
error or silently reads something else: bytes that are not UTF-8 (ESPnet:
``UnicodeDecodeError`` without a line), a blank or whitespace-only line (ESPnet: ``not enough
values to unpack``), a repeated utterance id (ESPnet: ``RuntimeError``), a leading byte-order
mark (ESPnet: part of the first utterance id) and a missing value where one is required.

**Directories** (:func:`read_data_dir`): ``wav.scp`` and ``text`` are required, ``utt2spk``
is read when present; none may be empty, and all must hold the same utterance ids (the error
names the ids missing from each file, the first few, and the line of the first).
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from latent_core.errors import PluginConfigError

PathLike = Union[str, Path]

REQUIRED_FILES = ("wav.scp", "text")
OPTIONAL_FILES = ("utt2spk",)
# what the value of each table is (error messages) and whether it may be empty
VALUE_NAMES = {"wav.scp": "wav path or command", "text": "transcript", "utt2spk": "speaker-id"}
EMPTY_VALUE_ALLOWED = {"text"}
SINGLE_FIELD = {"utt2spk"}
SHOWN_IDS = 5  # ids named in a mismatch message

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class KaldiDataDirError(PluginConfigError):
    """A Kaldi data directory or table that cannot be read; the message names ``file:line``."""


def _text_of(path: PathLike) -> str:
    """The file's text; KaldiDataDirError for an unreadable file or bytes that are not UTF-8."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise KaldiDataDirError(f"{path}: cannot read: {error.strerror or error}") from error
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        before = data[:error.start].decode("utf-8")
        line = len(_LINE_BREAK.findall(before)) + 1
        column = len(before) - max(before.rfind("\n"), before.rfind("\r"))
        raise KaldiDataDirError(f"{path}:{line}: not UTF-8 (byte 0x{data[error.start]:02x} at "
                                f"character {column} of the line)") from None
    if text.startswith("\ufeff"):
        raise KaldiDataDirError(f"{path}:1: starts with a byte-order mark (U+FEFF), which ESPnet would "
                                f"read as part of the first utterance id; save the file without it")
    return text


def _lines(text: str) -> List[str]:
    """The lines of ``text`` without their ends (universal newlines; no line after a final end)."""
    lines = _LINE_BREAK.split(text)
    if lines[-1] == "":  # the text ends with a line end (or is empty)
        lines.pop()
    return lines


def read_kaldi_entries(path: PathLike, value_required: bool = True, what: str = "value",
                       single_field: bool = False) -> Dict[str, Tuple[int, str]]:
    """``{key: (line number, value)}`` of a Kaldi table, in file order (see the module doc).

    ``value_required``: refuse a line with a key alone (else its value is ""); ``what`` names
    the value in messages; ``single_field``: the value must be one field (``utt2spk``).
    """
    entries: Dict[str, Tuple[int, str]] = {}
    for number, line in enumerate(_lines(_text_of(path)), 1):
        fields = line.rstrip().split(maxsplit=1)
        if not fields:
            raise KaldiDataDirError(f"{path}:{number}: blank line (every line is '<utterance-id> <{what}>')")
        key, value = fields[0], fields[1] if len(fields) > 1 else ""
        if key in entries:
            raise KaldiDataDirError(f"{path}:{number}: utterance id {key} repeated (first at line "
                                    f"{entries[key][0]})")
        if value_required and not value:
            raise KaldiDataDirError(f"{path}:{number}: utterance {key} has no {what} "
                                    f"(expected '<utterance-id> <{what}>')")
        if single_field and len(value.split()) > 1:
            raise KaldiDataDirError(f"{path}:{number}: expected '<utterance-id> <{what}>', got "
                                    f"{1 + len(value.split())} fields: {line!r}")
        entries[key] = (number, value)
    return entries


def read_kaldi_table(path: PathLike, value_required: bool = True, what: str = "value",
                     single_field: bool = False) -> Dict[str, str]:
    """``{key: value}`` of a Kaldi table (``wav.scp``, ``text``, ``utt2spk``), in file order.

    Agrees with ESPnet's ``read_2columns_text`` on every file it accepts; raises
    :class:`KaldiDataDirError` naming ``file:line`` otherwise (see the module doc).
    """
    return {key: value for key, (_, value) in
            read_kaldi_entries(path, value_required, what, single_field).items()}


def read_table_file(path: PathLike) -> Dict[str, str]:
    """A data-directory table, with the rules of its file name (``text``: empty transcripts
    allowed; ``utt2spk``: one speaker field; otherwise a value is required)."""
    name = Path(path).name
    return read_kaldi_table(path, name not in EMPTY_VALUE_ALLOWED, VALUE_NAMES.get(name, "value"),
                            name in SINGLE_FIELD)


@dataclass
class KaldiDataDir:
    """The tables of a data directory; ``uttids`` in the order of ``text``."""

    path: Path
    wav_scp: Dict[str, str]
    text: Dict[str, str]
    utt2spk: Optional[Dict[str, str]]
    uttids: List[str]

    def __len__(self) -> int:
        return len(self.uttids)


def _shown(ids: Sequence[str]) -> str:
    return ", ".join(ids[:SHOWN_IDS]) + (f" ... ({len(ids)} in all)" if len(ids) > SHOWN_IDS else "")


def read_data_dir(data_dir: PathLike, required: Sequence[str] = REQUIRED_FILES,
                  optional: Sequence[str] = OPTIONAL_FILES) -> KaldiDataDir:
    """Read and cross-check ``wav.scp``, ``text`` (required) and ``utt2spk`` (when present).

    Raises :class:`KaldiDataDirError` for a missing directory or required file, every
    :func:`read_kaldi_table` error, an empty table, and utterance ids not in every file (e.g.
    ``utterance ids of data/test/text missing from data/test/wav.scp: u7, u9 (first: utterance
    u7 at data/test/text:7)``).
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise KaldiDataDirError(f"{root}: not a directory (a Kaldi data directory holds "
                                f"{', '.join(required)})")
    entries: Dict[str, Dict[str, Tuple[int, str]]] = {}
    for name in list(required) + list(optional):
        path = root / name
        if not path.is_file():
            if name in required:
                raise KaldiDataDirError(f"{path}: missing (a Kaldi data directory needs "
                                        f"{' and '.join(required)})")
            continue
        table = read_kaldi_entries(path, name not in EMPTY_VALUE_ALLOWED, VALUE_NAMES.get(name, "value"),
                                   name in SINGLE_FIELD)
        if not table:
            raise KaldiDataDirError(f"{path}: empty (no utterances)")
        entries[name] = table
    names = list(entries)
    reference = "text" if "text" in entries else names[0]
    for other in names:  # every file against the reference, both ways
        for a, b in ((reference, other), (other, reference)):
            if a == b:
                continue
            missing = [key for key in entries[a] if key not in entries[b]]
            if missing:
                first = missing[0]
                raise KaldiDataDirError(
                    f"utterance ids of {root / a} missing from {root / b}: {_shown(missing)} "
                    f"(first: utterance {first} at {root / a}:{entries[a][first][0]})")

    def values(name: str) -> Optional[Dict[str, str]]:
        return {key: value for key, (_, value) in entries[name].items()} if name in entries else None

    return KaldiDataDir(root, values("wav.scp"), values("text"), values("utt2spk"),
                        list(entries[reference]))
