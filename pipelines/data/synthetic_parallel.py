"""An IWSLT-like synthetic parallel corpus: random tokens, IWSLT sentence lengths, binarised for fairseq.

What it is for: timing. A translation model's speed on a GPU depends on the batch's shape (sentences x
tokens) and the dictionary's size, not on what the tokens mean, and the Ding pairs of the demo and
``sdma-bench`` (about 12 tokens a sentence) are the short, launch-bound extreme. This corpus has the length
profile of IWSLT'14 De-En subword text (sentences of 5-60 tokens, mean about 27, a long right tail) on both
sides, without the corpus. It is NOT a translation task: the target is unrelated to the source, so BLEU on
it means nothing.

* lengths: a gamma distribution (shape 4, mean 28) rounded, redrawn outside [5, 60] (mean about 27 after
  the cut); each target length is its source length times a log-normal factor (sigma 0.15), cut to [5, 60],
  so pairs have similar lengths as real ones do;
* tokens: ``w1`` ... ``wV`` (``--vocab-size`` V types, default 6,000, one inventory for both sides, like a
  joint subword vocabulary), drawn with Zipf frequencies (p ~ 1/rank);
* everything is drawn from ``numpy.random.default_rng([seed, split])``: the same seed gives the same files,
  and a split does not change when another split's size does.

Output under ``--out-dir DIR``::

    DIR/text/{train,valid,test}.{src,tgt}   one sentence a line, tokens separated by spaces
    DIR/stats.json                          options, sentences and length statistics per split
    DIR/bin/                                fairseq-preprocess --joined-dictionary (with --binarize)

    python -m pipelines.data.synthetic_parallel --out-dir data/synthetic --train-sentences 45000 --binarize
"""

import argparse
import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from latent_core.errors import command_error
from pipelines.data.translation import PrepareError, run_fairseq_preprocess

PROG = "python -m pipelines.data.synthetic_parallel"
MIN_LENGTH, MAX_LENGTH = 5, 60
# gamma(shape 4) with mean 28 before the cut to [5, 60] has a mean of about 27 after it
GAMMA_SHAPE, GAMMA_MEAN = 4.0, 28.0
TARGET_LENGTH_SIGMA = 0.15
SPLITS = ("train", "valid", "test")
SOURCE, TARGET = "src", "tgt"


def sentence_lengths(count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` source lengths in [MIN_LENGTH, MAX_LENGTH] (gamma, redrawn outside the range)."""
    lengths = np.empty(0, dtype=np.int64)
    while len(lengths) < count:
        drawn = np.rint(rng.gamma(GAMMA_SHAPE, GAMMA_MEAN / GAMMA_SHAPE, size=2 * (count - len(lengths)) + 16))
        kept = drawn[(drawn >= MIN_LENGTH) & (drawn <= MAX_LENGTH)].astype(np.int64)
        lengths = np.concatenate([lengths, kept])
    return lengths[:count]


def synthetic_pairs(count: int, vocab_size: int = 6000, seed: int = 1, split: int = 0) -> Tuple[List[str], List[str]]:
    """``count`` (source, target) sentences as two lists of lines; ``split`` separates the random streams of
    the splits of one seed."""
    if count < 1 or vocab_size < 2:
        raise ValueError(f"count={count} must be >= 1 and vocab_size={vocab_size} >= 2")
    rng = np.random.default_rng([seed, split])
    source_lengths = sentence_lengths(count, rng)
    factors = np.exp(rng.normal(0.0, TARGET_LENGTH_SIGMA, size=count))
    target_lengths = np.clip(np.rint(source_lengths * factors), MIN_LENGTH, MAX_LENGTH).astype(np.int64)
    frequencies = 1.0 / np.arange(1, vocab_size + 1)
    types = np.array([f"w{rank}" for rank in range(1, vocab_size + 1)], dtype=object)

    def lines(lengths: np.ndarray) -> List[str]:
        tokens = types[rng.choice(vocab_size, size=int(lengths.sum()), p=frequencies / frequencies.sum())]
        ends = np.cumsum(lengths)
        return [" ".join(tokens[end - length:end]) for end, length in zip(ends, lengths)]

    return lines(source_lengths), lines(target_lengths)


def length_statistics(lines: Sequence[str]) -> Dict[str, float]:
    lengths = np.array([len(line.split()) for line in lines])
    return {"sentences": len(lengths), "mean": float(lengths.mean()), "min": int(lengths.min()),
            "max": int(lengths.max()), "median": float(np.median(lengths))}


def write_corpus(out_dir: Path, sizes: Dict[str, int], vocab_size: int = 6000, seed: int = 1) -> Dict:
    """Write ``out_dir/text/{split}.{src,tgt}`` for each split of ``sizes`` and ``out_dir/stats.json``;
    return the statistics."""
    text = Path(out_dir) / "text"
    text.mkdir(parents=True, exist_ok=True)
    stats = {"options": {"sizes": dict(sizes), "vocab_size": vocab_size, "seed": seed}, "splits": {}}
    for split, count in sizes.items():
        source, target = synthetic_pairs(count, vocab_size, seed, SPLITS.index(split))
        (text / f"{split}.{SOURCE}").write_text("\n".join(source) + "\n")
        (text / f"{split}.{TARGET}").write_text("\n".join(target) + "\n")
        stats["splits"][split] = {SOURCE: length_statistics(source), TARGET: length_statistics(target)}
    (Path(out_dir) / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return stats


def prepare(out_dir: Path, train_sentences: int, valid_sentences: int = 200, test_sentences: int = 1000,
            vocab_size: int = 6000, seed: int = 1, workers: int = 1) -> Path:
    """The corpus written and binarised (``fairseq-preprocess --joined-dictionary``); returns ``out_dir/bin``.
    A finished earlier run with the same options is reused."""
    out_dir = Path(out_dir)
    bin_dir = out_dir / "bin"
    sizes = {"train": train_sentences, "valid": valid_sentences, "test": test_sentences}
    options = {"sizes": sizes, "vocab_size": vocab_size, "seed": seed}
    stats_path = out_dir / "stats.json"
    if (bin_dir / f"test.{SOURCE}-{TARGET}.{TARGET}.bin").exists() and stats_path.exists() and \
            json.loads(stats_path.read_text())["options"] == options:
        print(f"[synthetic_parallel] reusing {bin_dir}", flush=True)
        return bin_dir
    stats = write_corpus(out_dir, sizes, vocab_size, seed)
    for split, sides in stats["splits"].items():
        print(f"[synthetic_parallel] {split}: {sides[SOURCE]['sentences']} pairs, mean length "
              f"{sides[SOURCE]['mean']:.1f} / {sides[TARGET]['mean']:.1f} tokens", flush=True)
    if bin_dir.exists():  # fairseq-preprocess refuses an existing dictionary; these options differ
        for path in bin_dir.iterdir():
            path.unlink()
    return run_fairseq_preprocess(out_dir / "text", bin_dir, SOURCE, TARGET, joint=True, workers=workers)


def sentences_for_updates(updates: int, max_tokens: int) -> int:
    """Training pairs for one epoch of at least ``updates`` batches of ``max_tokens`` tokens: a batch holds at
    most ``max_tokens / 27`` pairs, since each pair takes its longer side plus EOS (more than the mean
    length) and padding only adds."""
    return max(1, math.ceil(updates * max_tokens / 27))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--train-sentences", type=int, default=45000,
                   help="training pairs (default %(default)s: 300 updates of 4,096-token batches)")
    p.add_argument("--valid-sentences", type=int, default=200)
    p.add_argument("--test-sentences", type=int, default=1000)
    p.add_argument("--vocab-size", type=int, default=6000, help="token types (default %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--binarize", action="store_true", help="also run fairseq-preprocess into OUT_DIR/bin")
    p.add_argument("--workers", type=int, default=1, help="fairseq-preprocess workers")
    args = p.parse_args(argv)
    for name in ("train_sentences", "valid_sentences", "test_sentences"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1: fairseq-preprocess cannot binarise an empty split")
    if args.vocab_size < 2:
        p.error("--vocab-size must be >= 2")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.binarize:
        try:
            bin_dir = prepare(args.out_dir, args.train_sentences, args.valid_sentences, args.test_sentences,
                              args.vocab_size, args.seed, args.workers)
        except PrepareError as error:
            return command_error(PROG, error)
        print(f"[synthetic_parallel] done: {bin_dir}")
        return 0
    stats = write_corpus(args.out_dir, {"train": args.train_sentences, "valid": args.valid_sentences,
                                        "test": args.test_sentences}, args.vocab_size, args.seed)
    print(json.dumps(stats["splits"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
