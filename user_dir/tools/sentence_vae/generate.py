"""Decoding from a sentence VAE's latent space (the ``vae-generate`` command).

Subcommands (every latent of the model, whatever its names):

* ``reconstruct``: each input sentence -> decode from its posterior means;
* ``sample``: z ~ N(0, I) for every latent, N sentences;
* ``interpolate A B --steps S``: z_tau = z_A (1 - tau) + z_B tau, tau = 0, 1/(S-1), ..., 1
  (Optimus Section 6.1 and Table 3), printed as ``tau<TAB>sentence``;
* ``analogy A B C``: z_D = z_B - z_A + z_C (Optimus Section 6.1, "A is to B as C is to D");
* ``transfer --latent NAME SRC OTHER``: latent NAME (repeatable, or comma-separated) from OTHER,
  every other latent from SRC (QKVAE's syntax/semantics transfer, Section 5, with
  ``--latent z_syn``: the syntax of OTHER with the semantics of SRC).

z_A etc. are posterior means. Decoding (:mod:`.decoding`) uses fairseq's own ``SequenceGenerator``
(``task.build_generator``): greedy by default (beam 1), beam search (``--beam N``), or
sampling (``--sampling``, restricted with ``--sampling-topk K`` or ``--sampling-topp P``,
``--temperature``). The latents travel in ``net_input["latents"]`` with an empty
``src_tokens`` (see :mod:`user_dir.sentence_vae.base`); ``reconstruct`` passes the sentences
themselves as ``src_tokens`` (the encoder then returns the posterior means).

Input and output text (the task's ``source_ids`` / ``target_text``): for ``sentence_vae``
checkpoints sentences are split on whitespace and mapped with the checkpoint's dictionary
(``dict.txt``), so they must be tokenised exactly like the text given to ``fairseq-preprocess``
(same tokenizer, lower-casing and BPE); out-of-vocabulary words become ``<unk>`` and are
reported on stderr. Outputs are the dictionary's tokens joined by spaces; ``--post-process``
(e.g. ``subword_nmt``, ``sentencepiece``) removes a BPE of the output. For ``optimus_lm``
checkpoints input is raw text (BERT's tokenizer, saved with the data) and output is GPT-2's
detokenised text.
"""

import argparse
import sys
from typing import List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from latent_core.vae import VAEConfigError

from user_dir.sentence_vae.checkpoint import load_sentence_vae
from user_dir.sentence_vae.decoding import LatentDecoder, Latents, generation_args
from user_dir.tools.sentence_vae import console_entry


# ------------------------------------------------------------------ latent arithmetic
def interpolate_latents(z_a: Mapping[str, Tensor], z_b: Mapping[str, Tensor], steps: int) -> Tuple[List[float], Latents]:
    """taus ``[S]`` and z_tau = z_A (1 - tau) + z_B tau for every latent, ``[D] -> [S, D]``."""
    if steps < 2:
        raise VAEConfigError(f"--steps={steps} must be >= 2 (tau = 0 and tau = 1 at least)")
    taus = [i / (steps - 1) for i in range(steps)]
    out = {}
    for name in z_a:
        t = torch.tensor(taus, dtype=z_a[name].dtype, device=z_a[name].device).unsqueeze(-1)  # [S, 1]
        out[name] = z_a[name].reshape(1, -1) * (1 - t) + z_b[name].reshape(1, -1) * t
    return taus, out


def analogy_latents(z_a: Mapping[str, Tensor], z_b: Mapping[str, Tensor], z_c: Mapping[str, Tensor]) -> Latents:
    """z_D = z_B - z_A + z_C for every latent."""
    return {name: z_b[name] - z_a[name] + z_c[name] for name in z_a}


def transfer_latents(z_src: Mapping[str, Tensor], z_other: Mapping[str, Tensor], names: Sequence[str]) -> Latents:
    """Latents ``names`` from ``z_other``, every other latent from ``z_src``."""
    unknown = [name for name in names if name not in z_src]
    if unknown or not names:
        raise VAEConfigError(f"--latent {','.join(names) or '(none)'}: the model's latents are "
                             f"{', '.join(z_src)}")
    return {name: (z_other[name] if name in names else z_src[name]) for name in z_src}


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--path", required=True, metavar="CKPT", help="fairseq checkpoint of a sentence VAE")
    common.add_argument("--data", help="directory of the checkpoint's dict.txt, if it moved since training")
    common.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is available")
    common.add_argument("--seed", type=int, default=1, help="seed of prior samples and sampling decoding")
    common.add_argument("--batch-size", type=int, default=64, help="sentences decoded at once")
    common.add_argument("--beam", type=int, default=1, help="beam size (1 and no sampling: greedy)")
    common.add_argument("--sampling", action="store_true", help="sample each token (ancestral sampling)")
    common.add_argument("--sampling-topk", type=int, default=-1, help="sample from the K most likely tokens")
    common.add_argument("--sampling-topp", type=float, default=-1.0,
                        help="sample from the smallest set of tokens with probability >= P (nucleus)")
    common.add_argument("--temperature", type=float, default=1.0, help="softmax temperature")
    common.add_argument("--max-len", type=int, default=200, help="longest output (tokens)")
    common.add_argument("--min-len", type=int, default=1, help="shortest output (tokens)")
    common.add_argument("--lenpen", type=float, default=1.0, help="beam search length penalty")
    common.add_argument("--no-repeat-ngram-size", type=int, default=0, help="forbid repeated n-grams")
    common.add_argument("--post-process", default=None,
                        help="remove this BPE from the output (fairseq's names: subword_nmt, sentencepiece, ...)")

    parser = argparse.ArgumentParser(
        description="Decode from a sentence VAE's latent space with fairseq's SequenceGenerator. "
                    "Input sentences must be tokenised like the training data (split on whitespace; "
                    "with --task optimus_lm checkpoints: raw text, tokenised by BERT's tokenizer and "
                    "detokenised by GPT-2's)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("reconstruct", parents=[common], help="decode sentences from their posterior means")
    p.add_argument("--input", default="-", help="file with one sentence a line (default: stdin)")
    p = sub.add_parser("sample", parents=[common], help="decode z ~ N(0, I)")
    p.add_argument("--num", type=int, default=10, help="number of sentences")
    p = sub.add_parser("interpolate", parents=[common], help="decode z_A (1 - tau) + z_B tau")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--steps", type=int, default=11, help="number of taus from 0 to 1 (11: 0.0, 0.1, ..., 1.0)")
    p = sub.add_parser("analogy", parents=[common], help="decode z_B - z_A + z_C")
    for name in ("a", "b", "c"):
        p.add_argument(name, metavar=name.upper())
    p = sub.add_parser("transfer", parents=[common],
                       help="decode latent(s) --latent of OTHER with the other latents of SRC")
    p.add_argument("--latent", action="append", required=True,
                   help="latent taken from OTHER (repeatable or comma-separated), e.g. z_syn")
    p.add_argument("src", metavar="SRC")
    p.add_argument("other", metavar="OTHER")
    return parser


def run(args: argparse.Namespace, out=None) -> List[str]:
    """Execute one parsed command; prints and returns the output lines."""
    gen_args = generation_args(args.beam, args.sampling, args.sampling_topk, args.sampling_topp, args.temperature,
                               args.max_len, args.min_len, args.lenpen, 0.0, args.no_repeat_ngram_size)
    torch.manual_seed(args.seed)
    model, task, _ = load_sentence_vae(args.path, data=args.data, cpu=args.cpu)
    decoder = LatentDecoder(model, task, gen_args, args.batch_size, args.post_process)
    if args.command == "reconstruct":
        stream = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
        with stream:
            sentences = [line.strip() for line in stream]
        lines = decoder.reconstruct(sentences) if sentences else []
    elif args.command == "sample":
        lines = decoder.decode(decoder.prior_samples(args.num, torch.Generator().manual_seed(args.seed)))
    elif args.command == "interpolate":
        taus, z = interpolate_latents(decoder.one(args.a), decoder.one(args.b), args.steps)
        lines = [f"{tau:.2f}\t{sentence}" for tau, sentence in zip(taus, decoder.decode(z))]
    elif args.command == "analogy":
        z = analogy_latents(decoder.one(args.a), decoder.one(args.b), decoder.one(args.c))
        lines = decoder.decode({name: value.unsqueeze(0) for name, value in z.items()})
    else:  # transfer
        names = [name.strip() for entry in args.latent for name in entry.split(",") if name.strip()]
        z = transfer_latents(decoder.one(args.src), decoder.one(args.other), names)
        lines = decoder.decode({name: value.unsqueeze(0) for name, value in z.items()})
    for line in lines:
        print(line, file=out or sys.stdout)
    return lines


def main(argv: Optional[List[str]] = None, out=None) -> List[str]:
    return run(build_parser().parse_args(argv), out)


cli_main = console_entry("vae-generate", main)


if __name__ == "__main__":
    raise SystemExit(cli_main())
