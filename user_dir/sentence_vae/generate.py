"""Decoding from a sentence VAE's latent space (library of ``scripts/vae_generate.py``).

Subcommands (every latent of the model, whatever its names):

* ``reconstruct``: each input sentence -> decode from its posterior means;
* ``sample``: z ~ N(0, I) for every latent, N sentences;
* ``interpolate A B --steps S``: z_tau = z_A (1 - tau) + z_B tau, tau = 0, 1/(S-1), ..., 1
  (Optimus Section 6.1 and Table 3), printed as ``tau<TAB>sentence``;
* ``analogy A B C``: z_D = z_B - z_A + z_C (Optimus Section 6.1, "A is to B as C is to D");
* ``transfer --latent NAME SRC OTHER``: latent NAME (repeatable, or comma-separated) from OTHER,
  every other latent from SRC (QKVAE's syntax/semantics transfer, Section 5, with
  ``--latent z_syn``: the syntax of OTHER with the semantics of SRC).

z_A etc. are posterior means. Decoding uses fairseq's own ``SequenceGenerator``
(``task.build_generator``): greedy by default (beam 1), beam search (``--beam N``), or
sampling (``--sampling``, restricted with ``--sampling-topk K`` or ``--sampling-topp P``,
``--temperature``). The latents travel in ``net_input["latents"]`` with an empty
``src_tokens`` (see :mod:`user_dir.sentence_vae.base`); ``reconstruct`` passes the sentences
themselves as ``src_tokens`` (the encoder then returns the posterior means).

Input and output text: sentences are split on whitespace and mapped with the checkpoint's
dictionary (``dict.txt``), so they must be tokenised exactly like the text given to
``fairseq-preprocess`` (same tokenizer, lower-casing and BPE); out-of-vocabulary words become
``<unk>`` and are reported on stderr. Outputs are the dictionary's tokens joined by spaces;
``--post-process`` (e.g. ``subword_nmt``, ``sentencepiece``) removes a BPE of the output.
"""

import argparse
import logging
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from fairseq.data import data_utils
from torch import Tensor

from latent_core.vae import VAEConfigError

from .evaluate import load_sentence_vae, model_device

logger = logging.getLogger(__name__)

Latents = Dict[str, Tensor]


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


# ------------------------------------------------------------------------ generator
def generation_args(beam: int = 1, sampling: bool = False, sampling_topk: int = -1, sampling_topp: float = -1.0,
                    temperature: float = 1.0, max_len: int = 200, min_len: int = 1, lenpen: float = 1.0,
                    unkpen: float = 0.0, no_repeat_ngram_size: int = 0) -> argparse.Namespace:
    """The generation options ``task.build_generator`` reads. ``sampling_topk > 0`` or
    ``sampling_topp > 0`` implies ``sampling``; greedy decoding is beam 1 without sampling."""
    if beam < 1:
        raise VAEConfigError(f"--beam={beam} must be >= 1")
    if sampling_topk == 0 or sampling_topk < -1:
        raise VAEConfigError(f"--sampling-topk={sampling_topk} must be >= 1 (or -1: off)")
    if sampling_topp != -1.0 and not 0.0 < sampling_topp <= 1.0:
        raise VAEConfigError(f"--sampling-topp={sampling_topp} must lie in (0, 1] (or -1: off)")
    if temperature <= 0:
        raise VAEConfigError(f"--temperature={temperature} must be > 0")
    if max_len < min_len or min_len < 0:
        raise VAEConfigError(f"--max-len={max_len} must be >= --min-len={min_len} >= 0")
    sampling = sampling or sampling_topk > 0 or sampling_topp > 0
    return argparse.Namespace(
        beam=beam, sampling=sampling, sampling_topk=sampling_topk, sampling_topp=sampling_topp,
        temperature=temperature, max_len_a=0, max_len_b=max_len, min_len=min_len, lenpen=lenpen,
        unkpen=unkpen, no_repeat_ngram_size=no_repeat_ngram_size,
    )


class LatentDecoder:
    """Encode sentences to posterior means and decode latents with fairseq's SequenceGenerator."""

    def __init__(self, model, task, gen_args: argparse.Namespace, batch_size: int = 64,
                 post_process: Optional[str] = None):
        self.model, self.task = model.eval(), task
        self.dictionary = task.source_dictionary
        self.generator = task.build_generator([model], gen_args)
        self.batch_size = batch_size
        self.post_process = post_process
        self.device = model_device(model)
        self.left_pad = bool(getattr(task.cfg, "left_pad_source", False))

    # ------------------------------------------------------------------ text
    def tokens(self, sentence: str) -> Tensor:
        """Whitespace-split ``sentence`` -> ids + EOS ``[L + 1]``; unknown words warned about."""
        ids = self.dictionary.encode_line(sentence, add_if_not_exist=False, append_eos=True).long()
        limit = self.model.encoder.max_positions()
        if ids.numel() > limit:
            raise VAEConfigError(f"input of {ids.numel()} tokens (with EOS) is longer than the model's "
                                 f"{limit} positions: {sentence[:60]!r}...")
        unknown = [w for w, i in zip(sentence.split(), ids.tolist()) if i == self.dictionary.unk()]
        if unknown:
            logger.warning("not in the dictionary (decoded as <unk>): %s", " ".join(unknown))
        return ids

    def batch(self, sentences: Sequence[str]) -> Tuple[Tensor, Tensor]:
        """``src_tokens [B, L]`` (padded like the task's data) and ``src_lengths [B]``."""
        items = [self.tokens(s) for s in sentences]
        src = data_utils.collate_tokens(items, self.dictionary.pad(), self.dictionary.eos(), left_pad=self.left_pad)
        lengths = torch.tensor([t.numel() for t in items])
        return src.to(self.device), lengths.to(self.device)

    def detokenize(self, tokens: Tensor) -> str:
        return self.dictionary.string(tokens.int().cpu(), bpe_symbol=self.post_process)

    # ------------------------------------------------------------- encode/decode
    @torch.no_grad()
    def encode(self, sentences: Sequence[str]) -> Latents:
        """Posterior means {latent: ``[N, D]``}."""
        out: Dict[str, List[Tensor]] = {}
        for first in range(0, len(sentences), self.batch_size):
            src, lengths = self.batch(sentences[first:first + self.batch_size])
            means = self.model.encoder(src, lengths)["posterior_mean"]
            for name, mean in means.items():
                out.setdefault(name, []).append(mean)
        return {name: torch.cat(parts) for name, parts in out.items()}

    def _generate(self, net_input: Dict) -> List[str]:
        try:
            hypos = self.task.inference_step(self.generator, [self.model], {"net_input": net_input})
        except KeyError as err:
            if err.args != ("attn",):
                raise
            raise TypeError(f"{type(self.model.decoder).__name__} returns no extra['attn'], which fairseq's "
                            "SequenceGenerator reads: return base.decoder_extra(encoder_out) as extra") from err
        return [self.detokenize(h[0]["tokens"]) for h in hypos]

    @torch.no_grad()
    def decode(self, latents: Mapping[str, Tensor]) -> List[str]:
        """One sentence per row of the latents {latent: ``[N, D]``} (every latent of the model)."""
        missing = [name for name in self.model.latent_sizes if name not in latents]
        if missing:
            raise VAEConfigError(f"no value for latent(s) {', '.join(missing)}")
        n = next(iter(latents.values())).size(0)
        outputs = []
        for first in range(0, n, self.batch_size):
            z = {name: latents[name][first:first + self.batch_size].to(self.device) for name in self.model.latent_sizes}
            rows = next(iter(z.values())).size(0)
            outputs += self._generate({
                "src_tokens": torch.empty(rows, 0, dtype=torch.long, device=self.device),
                "src_lengths": torch.zeros(rows, dtype=torch.long, device=self.device),
                "latents": z,
            })
        return outputs

    @torch.no_grad()
    def reconstruct(self, sentences: Sequence[str]) -> List[str]:
        """Decode every sentence from its posterior means (the sentences are the source)."""
        outputs = []
        for first in range(0, len(sentences), self.batch_size):
            outputs += self.reconstruct_batch(*self.batch(sentences[first:first + self.batch_size]))
        return outputs

    @torch.no_grad()
    def reconstruct_batch(self, src_tokens: Tensor, src_lengths: Tensor) -> List[str]:
        """Reconstructions of an already binarized batch ``src_tokens [B, L]``, ``src_lengths [B]``."""
        return self._generate({"src_tokens": src_tokens.to(self.device), "src_lengths": src_lengths.to(self.device)})

    def prior_samples(self, num: int, generator: Optional[torch.Generator] = None) -> Latents:
        """z ~ N(0, I) {latent: ``[num, D]``}."""
        if num < 1:
            raise VAEConfigError(f"--num={num} must be >= 1")
        dtype = next(self.model.parameters()).dtype
        return {name: torch.randn(num, size, generator=generator, dtype=dtype).to(self.device)
                for name, size in self.model.latent_sizes.items()}

    def one(self, sentence: str) -> Latents:
        """Posterior means of one sentence, {latent: ``[D]``}."""
        return {name: z[0] for name, z in self.encode([sentence]).items()}


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
                    "Input sentences must be tokenised like the training data (split on whitespace)."
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


def cli_main() -> None:
    try:
        main()
    except (VAEConfigError, OSError) as err:  # bad option, missing checkpoint/data file
        print(f"vae_generate.py: error: {err}", file=sys.stderr)
        sys.exit(2)
