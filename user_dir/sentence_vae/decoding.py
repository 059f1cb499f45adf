"""Decoding latents with fairseq's ``SequenceGenerator``: the generation options
(:func:`generation_args`) and :class:`LatentDecoder` (encode sentences to posterior means,
decode latents, reconstruct), shared by ``vae-generate`` (:mod:`user_dir.tools.sentence_vae.generate`) and the
reconstruction BLEU of ``vae-eval`` (:mod:`user_dir.tools.sentence_vae.evaluate`). See the former for how the
latents travel to the decoder and how text is tokenised."""

import argparse
import logging
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from fairseq.data import data_utils
from fairseq.ngram_repeat_block import NGramRepeatBlock
from torch import Tensor

from latent_core.vae import VAEConfigError

from .checkpoint import model_device

logger = logging.getLogger(__name__)

Latents = Dict[str, Tensor]


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


class GeneratedPrefixNGramBlock(NGramRepeatBlock):
    """fairseq's n-gram blocker, comparing only the tokens generated so far.

    ``SequenceGenerator`` hands the blocker its whole token buffer ``[bsz * beam, max_len + 2]``;
    fairseq's CPU path compares against the buffer's last n - 1 entries, which are padding, so
    ``--no-repeat-ngram-size`` never blocks anything off CUDA (fairseq issues #4709 and #5206,
    open), and with n = 1 its empty context never matches. Here the context is the last n - 1
    tokens of the generated prefix ``tokens[:, : step + 1]``; the CUDA kernel, which indexes by
    ``step`` itself, is kept where fairseq uses it.
    """

    def forward(self, tokens: Tensor, lprobs: Tensor, bsz: int, beam_size: int, step: int) -> Tensor:
        if self.use_extension:
            return super().forward(tokens, lprobs, bsz, beam_size, step)
        n = self.no_repeat_ngram_size
        for row, prefix in enumerate(tokens[:, : step + 1].tolist()):
            context = prefix[len(prefix) - n + 1:] if n > 1 else []
            banned = [prefix[i + n - 1] for i in range(len(prefix) - n + 1) if prefix[i:i + n - 1] == context]
            if banned:
                lprobs[row, banned] = -math.inf
        return lprobs


def with_generated_prefix_ngram_block(generator):
    """``generator`` (fairseq's ``SequenceGenerator``) with its n-gram blocker, if it has one,
    replaced by :class:`GeneratedPrefixNGramBlock`."""
    blocker = getattr(generator, "repeat_ngram_blocker", None)
    if blocker is not None:
        generator.repeat_ngram_blocker = GeneratedPrefixNGramBlock(blocker.no_repeat_ngram_size, blocker.use_extension)
    return generator


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
        """``sentence`` -> source ids + EOS ``[L + 1]`` (``task.source_ids``: whitespace-split for
        ``sentence_vae``, BERT's tokenizer for ``optimus_lm``); unknown tokens warned about."""
        ids = self.task.source_ids(sentence)
        limit = self.model.encoder.max_positions()
        if ids.numel() > limit:
            raise VAEConfigError(f"input of {ids.numel()} tokens (with EOS) is longer than the model's "
                                 f"{limit} positions: {sentence[:60]!r}...")
        unknown = int((ids == self.dictionary.unk()).sum())
        if unknown:
            logger.warning("%d token(s) not in the dictionary (read as <unk>) in: %s", unknown, sentence)
        return ids

    def batch(self, sentences: Sequence[str]) -> Tuple[Tensor, Tensor]:
        """``src_tokens [B, L]`` (padded like the task's data) and ``src_lengths [B]``."""
        items = [self.tokens(s) for s in sentences]
        src = data_utils.collate_tokens(items, self.dictionary.pad(), self.dictionary.eos(), left_pad=self.left_pad)
        lengths = torch.tensor([t.numel() for t in items])
        return src.to(self.device), lengths.to(self.device)

    def detokenize(self, tokens: Tensor) -> str:
        """Target ids -> text (``task.target_text``)."""
        return self.task.target_text(tokens.int().cpu(), self.post_process)

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
