#!/usr/bin/env python3
"""Score translations two ways: sacreBLEU and the paper's tokenized BLEU.

* sacreBLEU (detokenised, 13a; ``zh`` for a Chinese target): the standard, comparable
  across papers.
* tokenized BLEU (fairseq-style, as the SDMA paper's Tables II-IV): Moses-tokenised
  hypotheses vs Moses-tokenised references, BLEU-4 without smoothing (fairseq-generate /
  multi-bleu.perl); ``--compound-split`` adds the ``##AT##-##AT##`` compound splitting of
  WMT'14 En-De (fairseq's compound_split_bleu.sh). See ``user_dir/sdma/bleu.py``.

usage: scripts/translation_bleu.py --hyp hyp.txt --ref ref.txt --lang en [--compound-split]
       [--tokenizer auto|moses|zh|none] [--sacrebleu-tokenize 13a] [--out-dir DIR]

Prints one labelled line per score. With ``--out-dir``: ``bleu_tokenized.txt`` (the
tokenized-BLEU line), ``bleu.json`` (both scores), ``hyp.tok.txt`` / ``ref.tok.txt`` (the
text the tokenized BLEU was computed on).
"""

import argparse
import json
import sys
from pathlib import Path


from user_dir.sdma.bleu import (
    PAPER_LABEL,
    SACREBLEU_LABEL,
    TOKENIZERS,
    BLEUDependencyError,
    BLEUInputError,
    default_sacrebleu_tokenize,
    sacrebleu_score,
    tokenized_bleu,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hyp", type=Path, required=True, help="hypotheses, one detokenised sentence per line")
    p.add_argument("--ref", type=Path, required=True, help="references, line-aligned with --hyp")
    p.add_argument("--lang", required=True, help="target language code (Moses rules, zh detection)")
    p.add_argument("--compound-split", action="store_true",
                   help="##AT##-##AT## compound splitting on both sides (WMT'14 En-De, as the paper)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="auto",
                   help="tokeniser of the tokenized BLEU (auto: zh for a Chinese target, else moses)")
    p.add_argument("--sacrebleu-tokenize", default=None,
                   help="sacreBLEU tokeniser (default: zh for a Chinese target, else 13a)")
    p.add_argument("--out-dir", type=Path, default=None)
    return p.parse_args(argv)


def read_lines(path: Path):
    """Lines of a UTF-8 file without line endings; a named error when it is missing."""
    if not path.is_file():
        raise BLEUInputError(f"{path} not found")
    with open(path, encoding="utf-8", newline="\n") as handle:
        return [line.rstrip("\n").rstrip("\r") for line in handle]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        hyps, refs = read_lines(args.hyp), read_lines(args.ref)
        sacre_tok = args.sacrebleu_tokenize or default_sacrebleu_tokenize(args.lang)
        sacre = sacrebleu_score(hyps, refs, sacre_tok)
        tokenized = {}
        paper = tokenized_bleu(hyps, refs, args.lang, args.tokenizer, args.compound_split, tokenized)
    except (BLEUInputError, BLEUDependencyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sacre_line = f"{SACREBLEU_LABEL.format(tokenize=sacre_tok)}: {sacre.score:.2f}  ({sacre})"
    paper_line = f"{PAPER_LABEL}: {paper.score:.2f}  ({paper.fairseq_string()}; {paper.describe()})"
    print(sacre_line)
    print(paper_line)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "bleu_tokenized.txt").write_text(paper_line + "\n", encoding="utf-8")
        (args.out_dir / "hyp.tok.txt").write_text("".join(l + "\n" for l in tokenized["hyp"]), encoding="utf-8")
        (args.out_dir / "ref.tok.txt").write_text("".join(l + "\n" for l in tokenized["ref"]), encoding="utf-8")
        payload = {
            "sacrebleu": {"score": float(sacre.score), "tokenize": sacre_tok, "text": str(sacre)},
            "tokenized_bleu": paper.to_dict(),
        }
        (args.out_dir / "bleu.json").write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
