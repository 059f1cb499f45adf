"""Fairseq data with a Hugging Face BART vocabulary, for QKVAE / ADVAE's ``--bart-dir``
(:mod:`user_dir.qkvae.bart_init`): a ``dict.txt`` whose index i is BART's token id i, and text as
BART's byte-level BPE tokens.

    python -m pipelines.data.bart_data dict BART_DIR data-bin/dict.bart.txt
    python -m pipelines.data.bart_data tokenize BART_DIR < train.txt > train.bpe
"""

import argparse
import sys
from typing import Iterable, List

from latent_core.errors import PluginConfigError, command_error

FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
PROG = "python -m pipelines.data.bart_data"


class BartDataError(PluginConfigError):
    """A BART directory whose tokenizer cannot give a fairseq dictionary (the message names the directory)."""


def _bart_tokenizer(bart_dir: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(bart_dir)
    except Exception as err:  # noqa: BLE001  (re-raised with the directory named)
        raise BartDataError(f"--bart-dir {bart_dir!r}: cannot load BART's tokenizer (vocab.json + merges.txt "
                            f"or tokenizer.json): {err}") from err


def bart_vocabulary(bart_dir: str) -> List[str]:
    """BART's tokens in id order (its tokenizer's vocabulary), checked against fairseq's specials."""
    vocab = _bart_tokenizer(bart_dir).get_vocab()
    by_id = sorted(vocab.items(), key=lambda item: item[1])
    ids = [i for _, i in by_id]
    if ids != list(range(len(ids))):
        raise BartDataError(f"{bart_dir}: the tokenizer's ids are not 0..{len(ids) - 1} without gaps")
    tokens = [t for t, _ in by_id]
    if tuple(tokens[:4]) != FAIRSEQ_SPECIALS:
        raise BartDataError(f"{bart_dir}: token ids 0-3 are {tokens[:4]}, expected {list(FAIRSEQ_SPECIALS)}")
    for token in tokens:
        if not token or any(ch.isspace() for ch in token):
            raise BartDataError(f"{bart_dir}: token {token!r} cannot be written to a fairseq dictionary")
    return tokens


def write_fairseq_dictionary(bart_dir: str, out_path: str) -> int:
    """Write a fairseq ``dict.txt`` whose index i is BART's token id i; returns its size."""
    tokens = bart_vocabulary(bart_dir)
    with open(out_path, "w", encoding="utf-8") as f:
        for token in tokens[len(FAIRSEQ_SPECIALS):]:
            f.write(f"{token} 1\n")
    return len(tokens)


def tokenize_lines(bart_dir: str, lines: Iterable[str]) -> Iterable[str]:
    """BART's byte-level BPE tokens of each line, space separated."""
    tokenizer = _bart_tokenizer(bart_dir)
    for line in lines:
        yield " ".join(tokenizer.tokenize(line.rstrip("\n")))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Prepare fairseq data with a Hugging Face BART vocabulary.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_dict = sub.add_parser("dict", help="write a fairseq dict.txt aligned with BART's token ids")
    p_dict.add_argument("bart_dir")
    p_dict.add_argument("out")
    p_tok = sub.add_parser("tokenize", help="stdin text -> BART BPE tokens (space separated) on stdout")
    p_tok.add_argument("bart_dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "dict":
            size = write_fairseq_dictionary(args.bart_dir, args.out)
            print(f"wrote {args.out}: {size} symbols with the specials", file=sys.stderr)
        else:
            for line in tokenize_lines(args.bart_dir, sys.stdin):
                sys.stdout.write(line + "\n")
    except BartDataError as error:
        return command_error(PROG, error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
