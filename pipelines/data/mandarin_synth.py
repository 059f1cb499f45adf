"""Build a small synthetic Mandarin ASR corpus in ESPnet/Kaldi data-directory format.

What the data is: real, human-written Simplified Chinese sentences read aloud by a
formant synthesiser.  The sentences are the zh_CN translations of software user
interfaces shipped as gettext catalogs (``/usr/share/locale/zh_CN/LC_MESSAGES/*.mo``,
installed by Debian packages such as coreutils and apt), or lines of a user's own
``--sentences`` file.  Only strings made entirely of CJK ideographs (U+4E00-U+9FFF)
after punctuation is removed are kept.  The audio is rendered by
``espeak-ng -v cmn-latn-pinyin`` with a handful of voice/speed/pitch "speakers" and
resampled by sox to 16 kHz mono 16-bit.

It exercises a Mandarin ASR pipeline end to end (character vocabulary, tones,
several speakers, train/dev/test splits) without any download.  It is NOT a
benchmark: the speech is robotic, the speakers are synthetic and the text is UI
jargon, so error rates on it say nothing about real Mandarin ASR.

Output under ``--out DIR``::

    DIR/wav/<uttid>.wav                      16 kHz mono 16-bit PCM
    DIR/data/{train,dev,test}/wav.scp        uttid ABSOLUTE_PATH
    DIR/data/{train,dev,test}/text           uttid SENTENCE (no spaces)
    DIR/data/{train,dev,test}/utt2spk        uttid spkid
    DIR/data/{train,dev,test}/spk2utt        spkid uttid uttid ...
    DIR/corpus.json                          counts, speakers, options, source

Utterance ids are ``<spkid>-s<sentence index>`` (e.g. ``spk03-s00042``); splits are
made by sentence, so every recording of a sentence lands in the same split.
Re-running with the same options skips wav files that already exist.

Example::

    synth-mandarin-corpus --out data/mandarin_synth --num-sentences 300
"""

import argparse
import gettext
import json
import os
import random
import re
import shutil
import string
import subprocess
import sys
import warnings
import wave
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from pipelines import kaldi_data as kaldi  # the Kaldi data-directory reader (toolkit-free)

LOCALE_DIR = Path("/usr/share/locale/zh_CN/LC_MESSAGES")
SAMPLE_RATE = 16000
SPLITS = ("train", "dev", "test")
BASE_VOICE = "cmn-latn-pinyin"

_CJK_ONLY = re.compile(r"[\u4e00-\u9fff]+")
_PUNCTUATION = re.compile(
    "["
    + re.escape(string.punctuation)
    + "，。、？！：；“”‘’（）《》〈〉【】「」『』〔〕…—–～·・"
    + "\u3000-\u303f"  # CJK symbols and punctuation
    + "\uff01-\uff0f\uff1a-\uff20\uff3b-\uff40\uff5b-\uff65"  # full-width ASCII punctuation
    + "]"
)


@dataclass(frozen=True)
class Speaker:
    """A synthetic speaker: an espeak-ng voice (with variant), speed (-s) and pitch (-p)."""

    id: str
    voice: str
    speed: int
    pitch: int


SPEAKERS = (
    Speaker("spk01", BASE_VOICE, 160, 50),
    Speaker("spk02", BASE_VOICE + "+f2", 170, 65),
    Speaker("spk03", BASE_VOICE + "+m3", 150, 35),
    Speaker("spk04", BASE_VOICE + "+f4", 180, 60),
    Speaker("spk05", BASE_VOICE, 140, 40),
    Speaker("spk06", BASE_VOICE + "+f2", 150, 70),
    Speaker("spk07", BASE_VOICE + "+m3", 185, 45),
    Speaker("spk08", BASE_VOICE + "+f4", 145, 55),
)


@dataclass(frozen=True)
class Utterance:
    """One recording: a sentence spoken by a speaker, assigned to a split."""

    id: str
    speaker: Speaker
    sentence: str
    split: str


# ---------------------------------------------------------------------------
# Sentences
# ---------------------------------------------------------------------------


def clean_sentence(line: str, min_chars: int, max_chars: int) -> Optional[str]:
    """Strip punctuation from ``line``; return it if it is min..max CJK ideographs, else None."""
    text = _PUNCTUATION.sub("", line).strip()
    if _CJK_ONLY.fullmatch(text) and min_chars <= len(text) <= max_chars:
        return text
    return None


def catalog_strings(locale_dir: Path) -> list[str]:
    """All translated strings of the readable ``*.mo`` catalogs in ``locale_dir``."""
    strings = []
    for path in sorted(locale_dir.glob("*.mo")):
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except (OSError, UnicodeDecodeError, ValueError) as e:
            warnings.warn(f"skipping unreadable gettext catalog {path}: {e}")
            continue
        # The "" key is the catalog header; plural entries have (msgid, n) keys.
        strings.extend(value for key, value in catalog.items() if key != "")
    return strings


def load_sentences(
    sentences_file: Optional[str] = None,
    min_chars: int = 6,
    max_chars: int = 16,
    locale_dir: Path = LOCALE_DIR,
) -> list[str]:
    """The sorted, de-duplicated pool of usable sentences.

    Reads ``sentences_file`` (UTF-8, one sentence per line) if given, otherwise the
    zh_CN gettext catalogs in ``locale_dir``.  Every line is cleaned with
    :func:`clean_sentence`; raises ValueError if nothing usable is left.
    """
    if sentences_file is not None:
        lines = Path(sentences_file).read_text(encoding="utf-8").splitlines()
    else:
        lines = [line for value in catalog_strings(Path(locale_dir)) for line in value.split("\n")]
    pool = sorted({s for s in (clean_sentence(line, min_chars, max_chars) for line in lines) if s})
    if not pool:
        rule = f"lines of {min_chars}-{max_chars} CJK ideographs once punctuation is removed"
        if sentences_file is not None:
            raise ValueError(f"no usable sentences in {sentences_file} (need {rule})")
        raise ValueError(
            f"no usable sentences in the zh_CN gettext catalogs under {locale_dir} (need {rule}); "
            "Debian packages with zh_CN translations (e.g. coreutils, apt) install them, "
            "or pass --sentences FILE with your own text"
        )
    return pool


def describe_source(sentences_file: Optional[str], locale_dir: Path = LOCALE_DIR) -> str:
    """A human-readable description of where the sentences come from (for corpus.json)."""
    if sentences_file is not None:
        return f"user sentences file {Path(sentences_file).resolve()}"
    return f"zh_CN gettext catalogs (software UI translations) {locale_dir}/*.mo"


def sample_sentences(
    pool: Sequence[str], num_sentences: int, seed: int, sentences_file: Optional[str] = None
) -> list[str]:
    """``num_sentences`` sentences drawn from ``pool`` with ``seed`` (all if fewer, but >= 3)."""
    if len(pool) < 3:
        raise ValueError(
            f"only {len(pool)} usable sentence(s) in {describe_source(sentences_file)}; "
            "need at least 3 (one per train/dev/test split)"
        )
    if len(pool) < num_sentences:
        warnings.warn(f"only {len(pool)} usable sentences available; using all of them")
    return random.Random(seed).sample(list(pool), min(num_sentences, len(pool)))


# ---------------------------------------------------------------------------
# Corpus plan: sentences -> utterances with speakers and splits
# ---------------------------------------------------------------------------


def split_sizes(n: int, dev_fraction: float, test_fraction: float) -> dict[str, int]:
    """Sentences per split; at least one each, so ``n`` must be >= 3."""
    if n < 3:
        raise ValueError(f"need at least 3 sentences (one per train/dev/test split), got {n}")
    if not (0 <= dev_fraction < 1 and 0 <= test_fraction < 1):
        raise ValueError("--dev-fraction and --test-fraction must lie in [0, 1)")
    dev = max(1, round(n * dev_fraction))
    test = max(1, round(n * test_fraction))
    if dev + test >= n:
        raise ValueError(
            f"dev ({dev}) + test ({test}) sentences leave no training sentences out of {n}"
        )
    return {"train": n - dev - test, "dev": dev, "test": test}


def plan_utterances(
    sentences: Sequence[str],
    speakers_per_sentence: int,
    seed: int,
    dev_fraction: float,
    test_fraction: float,
) -> list[Utterance]:
    """Assign each sentence a split and ``speakers_per_sentence`` distinct speakers."""
    if not 1 <= speakers_per_sentence <= len(SPEAKERS):
        raise ValueError(f"--speakers-per-sentence must be between 1 and {len(SPEAKERS)}")
    sizes = split_sizes(len(sentences), dev_fraction, test_fraction)
    order = list(range(len(sentences)))
    random.Random(f"{seed}-splits").shuffle(order)
    split_of = {}
    for split in SPLITS:
        split_of.update((i, split) for i in order[: sizes[split]])
        order = order[sizes[split] :]

    speaker_rng = random.Random(f"{seed}-speakers")
    utterances = []
    for i, sentence in enumerate(sentences):
        for spk in sorted(speaker_rng.sample(SPEAKERS, speakers_per_sentence), key=lambda s: s.id):
            utterances.append(Utterance(f"{spk.id}-s{i:05d}", spk, sentence, split_of[i]))
    return utterances


# ---------------------------------------------------------------------------
# Synthesis
# ---------------------------------------------------------------------------


def check_tools() -> None:
    """Raise RuntimeError unless espeak-ng (with the needed voices) and sox are usable."""
    missing = [tool for tool in ("espeak-ng", "sox") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(
            f"{' and '.join(missing)} not found on PATH; install with: apt-get install espeak-ng sox"
        )
    # espeak-ng silently falls back to the plain voice for an unknown +variant, so check.
    known = set()
    for listing in ("--voices=variant", "--voices=cmn"):
        out = subprocess.run(["espeak-ng", listing], capture_output=True, text=True, check=True).stdout
        known.update(token.rsplit("/", 1)[-1].lower() for token in out.split())  # e.g. "!v/f2" -> "f2"
    wanted = {part.lower() for spk in SPEAKERS for part in spk.voice.split("+")}
    unknown = sorted(wanted - known)
    if unknown:
        raise RuntimeError(f"espeak-ng lacks voice(s)/variant(s) {unknown}; a newer espeak-ng is needed")


def _run(cmd: list[str], utt: Utterance) -> None:
    """Run ``cmd``; on failure raise RuntimeError naming the sentence and the stderr."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"synthesis of {utt.id} ({utt.sentence}) failed: {' '.join(cmd)} "
            f"exited with {proc.returncode}: {proc.stderr.strip()}"
        )


def synthesize(utt: Utterance, wav_path: Path) -> None:
    """Speak ``utt`` with espeak-ng and resample it with sox to 16 kHz mono 16-bit ``wav_path``.

    The file appears atomically, so an interrupted run never leaves a partial wav behind.
    """
    raw = wav_path.with_name(f".{utt.id}.raw.wav")
    tmp = wav_path.with_name(f".{utt.id}.tmp.wav")
    spk = utt.speaker
    try:
        _run(["espeak-ng", "-v", spk.voice, "-s", str(spk.speed), "-p", str(spk.pitch),
              "-w", str(raw), utt.sentence], utt)
        _run(["sox", str(raw), "-r", str(SAMPLE_RATE), "-c", "1", "-b", "16", str(tmp)], utt)
        os.replace(tmp, wav_path)
    finally:
        raw.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def synthesize_all(utterances: Sequence[Utterance], wav_dir: Path, jobs: int) -> int:
    """Synthesise the utterances whose wav is missing, ``jobs`` at a time; return how many."""
    todo = [u for u in utterances if not (wav_dir / f"{u.id}.wav").exists()]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(synthesize, u, wav_dir / f"{u.id}.wav") for u in todo]
        try:
            for future in as_completed(futures):
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return len(todo)


def wav_seconds(path: Path) -> float:
    """Duration of a PCM wav file in seconds."""
    with wave.open(str(path), "rb") as w:
        return w.getnframes() / w.getframerate()


# ---------------------------------------------------------------------------
# Kaldi data directories
# ---------------------------------------------------------------------------


def _write_lines(path: Path, lines: Sequence[str]) -> None:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


def write_data_dir(data_dir: Path, utterances: Sequence[Utterance], wav_dir: Path) -> None:
    """Write wav.scp, text, utt2spk and spk2utt, sorted by id in C-locale (code point) order,
    and read wav.scp, text and utt2spk back as ESPnet will (``pipelines/kaldi_data.py``):
    a KaldiDataDirError (a ValueError) if they do not hold exactly what was meant."""
    data_dir.mkdir(parents=True, exist_ok=True)
    utts = sorted(utterances, key=lambda u: u.id)
    columns = {
        "wav.scp": lambda u: str((wav_dir / f"{u.id}.wav").resolve()),
        "text": lambda u: u.sentence,
        "utt2spk": lambda u: u.speaker.id,
    }
    for name, value in columns.items():
        _write_lines(data_dir / name, [f"{u.id} {value(u)}" for u in utts])
    spk2utt: dict[str, list[str]] = {}
    for u in utts:
        spk2utt.setdefault(u.speaker.id, []).append(u.id)
    _write_lines(data_dir / "spk2utt", [f"{spk} {' '.join(ids)}" for spk, ids in sorted(spk2utt.items())])
    written = kaldi.read_data_dir(data_dir)  # refuses repeated ids, ids missing from a file, ...
    tables = {"wav.scp": written.wav_scp, "text": written.text, "utt2spk": written.utt2spk}
    for name, value in columns.items():
        for u in utts:
            if tables[name].get(u.id) != value(u):
                raise kaldi.KaldiDataDirError(f"{data_dir / name}: utterance {u.id} would be read back as "
                                              f"{tables[name].get(u.id)!r}, not {value(u)!r}")


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def build_corpus(
    out_dir,
    num_sentences: int = 300,
    speakers_per_sentence: int = 2,
    seed: int = 0,
    dev_fraction: float = 0.1,
    test_fraction: float = 0.1,
    min_chars: int = 6,
    max_chars: int = 16,
    jobs: int = 2,
    sentences_file: Optional[str] = None,
) -> dict:
    """Build the corpus under ``out_dir`` and return the content of its corpus.json.

    Samples ``num_sentences`` sentences (all of them if fewer are available) with
    ``seed``, has each spoken by ``speakers_per_sentence`` speakers, splits by
    sentence and writes the Kaldi data directories.  Existing wavs are reused, so
    calling it twice with the same options is cheap; reusing ``out_dir`` with other
    options raises ValueError, since its wavs would no longer match the text.
    """
    if num_sentences < 3:
        raise ValueError(
            f"need at least 3 sentences (one per train/dev/test split), got num_sentences={num_sentences}"
        )
    out_dir = Path(out_dir)
    options = {
        "num_sentences": num_sentences,
        "speakers_per_sentence": speakers_per_sentence,
        "seed": seed,
        "dev_fraction": dev_fraction,
        "test_fraction": test_fraction,
        "min_chars": min_chars,
        "max_chars": max_chars,
        "sentences_file": str(Path(sentences_file).resolve()) if sentences_file else None,
    }
    sentences = sample_sentences(
        load_sentences(sentences_file, min_chars, max_chars), num_sentences, seed, sentences_file
    )
    utterances = plan_utterances(sentences, speakers_per_sentence, seed, dev_fraction, test_fraction)
    _check_reusable(out_dir, options)

    check_tools()
    wav_dir = out_dir / "wav"
    wav_dir.mkdir(parents=True, exist_ok=True)
    synthesize_all(utterances, wav_dir, jobs)

    counts = {}
    for split in SPLITS:
        utts = [u for u in utterances if u.split == split]
        write_data_dir(out_dir / "data" / split, utts, wav_dir)
        counts[split] = {
            "sentences": len({u.sentence for u in utts}),
            "utterances": len(utts),
            "seconds": round(sum(wav_seconds(wav_dir / f"{u.id}.wav") for u in utts), 2),
        }
    corpus = {
        "description": "synthetic espeak-ng speech of real zh_CN sentences; not a benchmark",
        "source": describe_source(sentences_file),
        "sample_rate": SAMPLE_RATE,
        "counts": counts,
        "speakers": [asdict(s) for s in SPEAKERS],
        "options": options,
    }
    manifest = json.dumps(corpus, ensure_ascii=False, indent=2) + "\n"
    (out_dir / "corpus.json").write_text(manifest, encoding="utf-8")
    return corpus


def _check_reusable(out_dir: Path, options: dict) -> None:
    """Raise ValueError if ``out_dir`` holds a corpus built with different options."""
    manifest = out_dir / "corpus.json"
    if manifest.exists():
        previous = json.loads(manifest.read_text(encoding="utf-8")).get("options")
        if previous != options:
            raise ValueError(
                f"{out_dir} holds a corpus built with other options ({previous}); "
                "use a fresh --out directory or delete it first"
            )


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-sentences", type=int, default=300, help="sentences to sample (default 300)")
    p.add_argument("--speakers-per-sentence", type=int, default=2,
                   help=f"speakers reading each sentence, 1-{len(SPEAKERS)} (default 2)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--dev-fraction", type=float, default=0.1, help="share of sentences in dev (default 0.1)")
    p.add_argument("--test-fraction", type=float, default=0.1, help="share of sentences in test (default 0.1)")
    p.add_argument("--min-chars", type=int, default=6, help="shortest sentence in characters (default 6)")
    p.add_argument("--max-chars", type=int, default=16, help="longest sentence in characters (default 16)")
    p.add_argument("--jobs", type=int, default=2, help="parallel synthesis processes (default 2)")
    p.add_argument("--sentences", metavar="FILE",
                   help="UTF-8 file, one sentence per line, instead of the zh_CN gettext catalogs")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point (``synth-mandarin-corpus``); prints a summary and returns the exit status."""
    args = parse_args(argv)
    try:
        corpus = build_corpus(
            args.out,
            num_sentences=args.num_sentences,
            speakers_per_sentence=args.speakers_per_sentence,
            seed=args.seed,
            dev_fraction=args.dev_fraction,
            test_fraction=args.test_fraction,
            min_chars=args.min_chars,
            max_chars=args.max_chars,
            jobs=args.jobs,
            sentences_file=args.sentences,
        )
    except (OSError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for split, c in corpus["counts"].items():
        print(f"{split}: {c['sentences']} sentences, {c['utterances']} utterances, "
              f"{c['seconds'] / 60:.1f} min")
    print(f"wrote {Path(args.out) / 'data'} and {Path(args.out) / 'corpus.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
