"""Tokenized BLEU as the SDMA paper reports it (Tables II-IV), next to sacreBLEU.

The paper's BLEU is "calculated by using the script provided by Fairseq", i.e. BLEU-4 of
the Moses-tokenised hypotheses against the Moses-tokenised references (what
``fairseq-generate`` prints, equal to ``multi-bleu.perl``), and for WMT'14 En-De "after
applying the compound splitting similar to [43]": fairseq's
``examples/translation/compound_split_bleu.sh`` (from tensor2tensor's ``get_ende_bleu.sh``)
rewrites ``(\\S)-(\\S)`` as ``\\1 ##AT##-##AT## \\2`` on both sides before scoring.

This project's data preparation (``prepare-translation``) keeps the
references as raw text (whitespace-normalised; lowercased for IWSLT'14) and the
hypotheses come out of ``fairseq-generate --remove-bpe sentencepiece`` detokenised, so
both sides are tokenised here:

* ``moses``: ``sacremoses.MosesTokenizer(lang)`` (``tokenizer.perl -l LANG``, no
  aggressive hyphen splitting, no XML escaping; escaping maps each special character to
  one token either way, so the score is the same);
* ``zh`` (default for a Chinese target): sacreBLEU's ``zh`` tokeniser (CJK characters
  split), since Moses does not segment Chinese;
* ``none``: the lines are already tokenised (e.g. fairseq-generate's ``T``/``H`` lines).

The n-gram statistics are sacreBLEU's with ``tokenize='none'`` and no smoothing, which
is BLEU-4 as ``multi-bleu.perl`` and fairseq's own scorer (``fairseq.scoring.bleu``)
compute it; the tests check the equality with fairseq's scorer.

The command ``sdma-bleu`` (:func:`main`; ``python -m user_dir.tools.sdma.bleu`` is the same
command) prints both scores; see :data:`CLI_DESCRIPTION`.
"""

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from latent_core.errors import command_error

TOKENIZERS = ("auto", "moses", "zh", "none")
_COMPOUND = re.compile(r"(\S)-(\S)")
PAPER_LABEL = "tokenized BLEU (fairseq-style, as the paper's Tables II-IV)"
SACREBLEU_LABEL = "sacreBLEU (detokenised, {tokenize})"


class BLEUInputError(ValueError):
    """Hypotheses and references that cannot be scored together, or a bad option."""


class BLEUDependencyError(ImportError):
    """A tokeniser package is missing; the message says what to install."""


def is_chinese(lang: str) -> bool:
    """True for ``zh`` language codes (``zh``, ``zh_cn``, ``zh-Hans``...)."""
    return lang.lower().startswith("zh")


def compound_split(line: str) -> str:
    """``(\\S)-(\\S)`` -> ``\\1 ##AT##-##AT## \\2``, as fairseq's ``compound_split_bleu.sh``.

    Matches do not overlap, exactly like the Perl one-liner ``s{(\\S)-(\\S)}{...}g``:
    ``a-b-c`` becomes ``a ##AT##-##AT## b-c``.
    """
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def resolve_tokenizer(tokenizer: str, lang: str) -> str:
    """``auto`` -> ``zh`` for a Chinese target language, else ``moses``."""
    if tokenizer not in TOKENIZERS:
        raise BLEUInputError(f"tokenizer {tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
    if tokenizer == "auto":
        return "zh" if is_chinese(lang) else "moses"
    return tokenizer


def _moses(lang: str):
    try:
        from sacremoses import MosesTokenizer
    except ImportError:
        raise BLEUDependencyError(
            "tokenized BLEU needs the Moses tokeniser: pip install sacremoses "
            "(or pass tokenizer='none' for text that is already tokenised)"
        ) from None
    tokenizer = MosesTokenizer(lang=lang)
    return lambda line: tokenizer.tokenize(line, return_str=True, escape=False,
                                           aggressive_dash_splits=False)


def _sacrebleu_zh():
    from sacrebleu.tokenizers.tokenizer_zh import TokenizerZh

    return TokenizerZh()


def tokenize_lines(lines: Sequence[str], lang: str, tokenizer: str = "auto") -> List[str]:
    """Tokenise ``lines`` of language ``lang`` for BLEU (see the module docstring)."""
    kind = resolve_tokenizer(tokenizer, lang)
    if kind == "none":
        return [" ".join(line.split()) for line in lines]
    tokenize = _moses(lang) if kind == "moses" else _sacrebleu_zh()
    return [" ".join(tokenize(line.strip()).split()) for line in lines]


@dataclass
class TokenizedBLEU:
    """Corpus BLEU-4 with its statistics (precisions in percent)."""

    score: float
    precisions: List[float]
    brevity_penalty: float
    ratio: float
    sys_len: int
    ref_len: int
    tokenizer: str
    lang: str
    compound_split: bool

    def fairseq_string(self) -> str:
        """``BLEU4 = 34.50, 70.1/45.0/30.1/20.0 (BP=1.000, ratio=1.010, syslen=.., reflen=..)``, as fairseq."""
        precisions = "/".join(f"{p:2.1f}" for p in self.precisions)
        return (f"BLEU4 = {self.score:2.2f}, {precisions} (BP={self.brevity_penalty:.3f}, "
                f"ratio={self.ratio:.3f}, syslen={self.sys_len}, reflen={self.ref_len})")

    def describe(self) -> str:
        """How the text was tokenised, e.g. ``Moses-tokenised en, compound splitting``."""
        how = {"moses": f"Moses-tokenised {self.lang}", "zh": "sacreBLEU zh tokeniser",
               "none": "pre-tokenised input"}[self.tokenizer]
        return how + (", compound splitting (##AT##-##AT##)" if self.compound_split else "")

    def to_dict(self) -> Dict:
        return asdict(self)


def _check_pair(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if len(hypotheses) != len(references):
        raise BLEUInputError(f"{len(hypotheses)} hypotheses but {len(references)} references: "
                             "the two files must be line-aligned")
    if not references:
        raise BLEUInputError("no references to score against")


def bleu_of_tokenized(hypotheses: Sequence[str], references: Sequence[str]):
    """sacreBLEU's corpus BLEU-4 of whitespace-tokenised text, no smoothing (= multi-bleu.perl)."""
    from sacrebleu.metrics import BLEU

    _check_pair(hypotheses, references)
    return BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(
        list(hypotheses), [list(references)])


def tokenized_bleu(hypotheses: Sequence[str], references: Sequence[str], lang: str,
                   tokenizer: str = "auto", split_compounds: bool = False,
                   tokenized_out: Optional[Dict[str, List[str]]] = None) -> TokenizedBLEU:
    """The paper's BLEU: tokenise both sides (``lang`` = target language), optionally
    compound-split them, then corpus BLEU-4. ``tokenized_out``, when given, receives the
    scored ``hyp`` and ``ref`` lines."""
    _check_pair(hypotheses, references)
    kind = resolve_tokenizer(tokenizer, lang)
    hyp = tokenize_lines(hypotheses, lang, kind)
    ref = tokenize_lines(references, lang, kind)
    if split_compounds:
        hyp = [compound_split(line) for line in hyp]
        ref = [compound_split(line) for line in ref]
    if tokenized_out is not None:
        tokenized_out.update(hyp=hyp, ref=ref)
    result = bleu_of_tokenized(hyp, ref)
    return TokenizedBLEU(
        score=float(result.score), precisions=[float(p) for p in result.precisions],
        brevity_penalty=float(result.bp), ratio=float(result.sys_len / result.ref_len),
        sys_len=int(result.sys_len), ref_len=int(result.ref_len), tokenizer=kind, lang=lang,
        compound_split=split_compounds,
    )


def default_sacrebleu_tokenize(lang: str) -> str:
    """sacreBLEU's tokeniser for a target language: ``zh`` for Chinese, else ``13a``."""
    return "zh" if is_chinese(lang) else "13a"


def sacrebleu_score(hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a"):
    """Standard detokenised sacreBLEU (default smoothing and tokeniser, as the ``sacrebleu`` CLI); a
    :class:`BLEUInputError` when the two lists differ in length or are empty."""
    import sacrebleu

    _check_pair(hypotheses, references)
    return sacrebleu.corpus_bleu(list(hypotheses), [list(references)], tokenize=tokenize)


# ----------------------------------------------------------------------------
# The command: sdma-bleu
# ----------------------------------------------------------------------------

CLI_DESCRIPTION = """Score translations two ways: sacreBLEU and the paper's tokenized BLEU.

* sacreBLEU (detokenised, 13a; ``zh`` for a Chinese target): the standard, comparable
  across papers.
* tokenized BLEU (fairseq-style, as the SDMA paper's Tables II-IV): Moses-tokenised
  hypotheses vs Moses-tokenised references, BLEU-4 without smoothing (fairseq-generate /
  multi-bleu.perl); ``--compound-split`` adds the ``##AT##-##AT##`` compound splitting of
  WMT'14 En-De (fairseq's compound_split_bleu.sh). See ``user_dir/tools/sdma/bleu.py``.

usage: sdma-bleu --hyp hyp.txt --ref ref.txt --lang en [--compound-split]
       [--tokenizer auto|moses|zh|none] [--sacrebleu-tokenize 13a] [--out-dir DIR]
       (python -m user_dir.tools.sdma.bleu is the same command)

Prints one labelled line per score. With ``--out-dir``: ``bleu_tokenized.txt`` (the
tokenized-BLEU line), ``bleu.json`` (both scores), ``hyp.tok.txt`` / ``ref.tok.txt`` (the
text the tokenized BLEU was computed on).
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=CLI_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        return command_error("sdma-bleu", error)
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
    raise SystemExit(main())
