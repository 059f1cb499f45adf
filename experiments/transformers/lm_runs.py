#!/usr/bin/env python3
"""A tiny GPT-2 trained from scratch on the English side of the Ding pairs, vanilla vs SDMA through ``attach_sdma``,
in a plain PyTorch loop (``transformers-sdma-lm``).

The sentences are the tokenised English side of the Ding German-English dictionary (``ding_sentences``, as the
sentence-VAE data), split into train / valid / test by a seeded shuffle; the vocabulary is the training words
seen at least twice (others ``<unk>``). Each run trains ``GPT2LMHeadModel`` (``--embed-dim``, ``--layers``,
``--heads``) for ``--updates`` updates with AdamW (linear warm-up, then constant) on the LM loss plus, for SDMA,
``sdma_loss(model)`` (eq. 24), g following ``set_sdma_updates`` with the paper's schedule. Every
``--validate-interval-updates`` it measures the valid perplexity and keeps the best weights (fairseq's
``checkpoint_best``: a model this small overfits these sentences long before the last update). It reports, for
the best-valid weights, on the test sentences: perplexity per token (the ``</s>`` included; exp of the mean
natural-log NLL) and bits per token, with a 95% bootstrap interval over sentences per run and a 95% t-interval over
seeds per system, and LR/HR of the decoder self-attention heads (the SDMA paper's Tables II-IV metric, from the
model's own ``output_attentions``); the last update's test perplexity beside it; and SDMA minus vanilla perplexity
paired by seed.
At inference the decoder's semantic mask is off, as in the paper (``attach_sdma``'s ``decoder_mask_at_inference``),
so both systems are evaluated with softmax attention.

    transformers-sdma-lm --out-dir outputs/transformers_sdma_lm --seeds 1 2 3
"""

import argparse
import json
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

from latent_core.errors import command_error
from latent_core.redundancy import RedundancyAccumulator
from experiments.transformers.runs import run_missing, seed_interval
from pipelines.runs import write_json

SYSTEMS = ("vanilla", "SDMA")
PAD, BOS, EOS, UNK = 0, 1, 2, 3


def build_vocabulary(sentences: List[List[str]], min_count: int = 2) -> Dict[str, int]:
    counts = Counter(word for sentence in sentences for word in sentence)
    words = sorted(w for w, c in counts.items() if c >= min_count)
    return {word: i for i, word in enumerate(["<pad>", "<s>", "</s>", "<unk>", *words])}


def encode(sentences: List[List[str]], vocabulary: Dict[str, int], max_tokens: int) -> List[List[int]]:
    """``<s> w1 .. wn </s>``, at most ``max_tokens`` ids."""
    return [([BOS] + [vocabulary.get(w, UNK) for w in sentence] + [EOS])[:max_tokens] for sentence in sentences]


def batches(encoded: List[List[int]], size: int, rng: random.Random = None):
    order = list(range(len(encoded)))
    if rng is not None:
        rng.shuffle(order)
    for start in range(0, len(order), size):
        rows = [encoded[i] for i in order[start:start + size]]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), PAD)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = torch.tensor(row)
        mask = ids.ne(PAD).long()
        yield ids, mask


def sentence_nll(model, ids: torch.Tensor, mask: torch.Tensor, attentions: bool = False):
    """Summed next-token NLL (nats) and the number of predicted tokens, per sentence (and the heads' weights)."""
    out = model(input_ids=ids, attention_mask=mask, output_attentions=attentions)
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1)
    real = mask[:, 1:].bool()
    token_nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) * real
    return token_nll.sum(1), real.sum(1), out.attentions


def valid_perplexity(model, encoded: List[List[int]], batch_size: int) -> float:
    """Perplexity per token of ``encoded`` in eval mode, with the model's own attention implementation."""
    model.eval()
    nll = tokens = 0.0
    with torch.no_grad():
        for ids, mask in batches(encoded, batch_size):
            sums, counts, _ = sentence_nll(model, ids, mask)
            nll, tokens = nll + float(sums.sum()), tokens + float(counts.sum())
    model.train()
    return math.exp(nll / tokens)


def evaluate(model, encoded: List[List[int]], batch_size: int, seed: int) -> dict:
    """Per-sentence NLL sums and token counts -> perplexity with a bootstrap interval; LR/HR of the heads."""
    model.eval()
    # GPT-2 asks no attention function for weights (it records the modules' outputs): transformers' eager attention
    # returns them; at inference it is what both systems compute (the decoder's semantic mask is off)
    model.set_attn_implementation("eager")
    nll, tokens, accumulator = [], [], RedundancyAccumulator()
    with torch.no_grad():
        for ids, mask in batches(encoded, batch_size):
            sums, counts, attentions = sentence_nll(model, ids, mask, attentions=True)
            nll.append(sums)
            tokens.append(counts)
            attn = torch.stack([a.transpose(0, 1) for a in attentions])  # [layers, heads, B, T, T]
            valid = mask.bool()
            accumulator.add("decoder_self", attn, valid, valid)
    nll, tokens = torch.cat(nll).double().numpy(), torch.cat(tokens).double().numpy()
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(1000):
        idx = rng.integers(0, len(nll), len(nll))
        boot.append(math.exp(nll[idx].sum() / tokens[idx].sum()))
    lrhr = accumulator.result()["decoder_self"]
    mean_nll = nll.sum() / tokens.sum()
    return {"perplexity": math.exp(mean_nll), "perplexity_ci95": [float(np.percentile(boot, 2.5)),
                                                                   float(np.percentile(boot, 97.5))],
            "bits_per_token": mean_nll / math.log(2), "sentences": len(nll), "tokens": int(tokens.sum()),
            "LR": lrhr["LR"], "HR": lrhr["HR"]}


def run_one(args, system: str, seed: int, data: dict, vocabulary: Dict[str, int]) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from transformers_plugin import attach_sdma, sdma_loss, set_sdma_updates

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = GPT2Config(vocab_size=len(vocabulary), n_positions=args.max_tokens, n_embd=args.embed_dim,
                        n_layer=args.layers, n_head=args.heads, bos_token_id=BOS, eos_token_id=EOS,
                        pad_token_id=PAD, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config)
    if system == "SDMA":
        attach_sdma(model, mode="sdma", reading=args.reading)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup))
    model.train()
    started, update, curve = time.time(), 0, []
    best = {"valid_perplexity": math.inf}
    while update < args.updates:
        for ids, mask in batches(data["train"], args.batch_size, rng):
            out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
            loss = out.loss + (sdma_loss(model) if system == "SDMA" else 0.0)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            update += 1
            if system == "SDMA":
                set_sdma_updates(model, update)
            if update % args.validate_interval_updates == 0 or update == args.updates:
                valid = valid_perplexity(model, data["valid"], args.batch_size)
                if not math.isfinite(valid):
                    raise FloatingPointError(f"{system} seed {seed}: the valid perplexity is {valid} at update "
                                             f"{update}; training diverged (try a lower --lr)")
                curve.append({"update": update, "lm_loss": float(out.loss.detach()), "valid_perplexity": valid})
                if valid < best["valid_perplexity"]:
                    best = {"valid_perplexity": valid, "update": update,
                            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
            if update >= args.updates:
                break
    seconds = time.time() - started
    last = evaluate(model, data["test"], args.batch_size, seed)
    reported = last
    if best["update"] != update:
        model.load_state_dict(best["weights"])
        reported = evaluate(model, data["test"], args.batch_size, seed)
    return {"system": system, "seed": seed, "updates": update, "train_seconds": round(seconds, 1),
            "parameters": sum(p.numel() for p in model.parameters()), "curve": curve,
            "best_update": best["update"], "valid_perplexity": best["valid_perplexity"], **reported,
            "last": {key: last[key] for key in ("perplexity", "perplexity_ci95", "LR", "HR")}}


def format_interval(entry: dict) -> str:
    """A ``seed_interval`` entry as ``mean [low, high]`` (the mean alone for one seed)."""
    ci = f" [{entry['ci95'][0]:.2f}, {entry['ci95'][1]:.2f}]" if entry["ci95"] else ""
    return f"{entry['mean']:>8.2f}{ci:>18}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="transformers-sdma-lm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("outputs") / "transformers_sdma_lm")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--reading", choices=["authors", "paper"], default="authors")
    p.add_argument("--updates", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--validate-interval-updates", type=int, default=300,
                   help="measure the valid perplexity (and keep the best weights) every N updates")
    p.add_argument("--embed-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24, help="ids per sentence, <s> and </s> included")
    p.add_argument("--valid", type=int, default=1000, help="held-out sentences (default 1000)")
    p.add_argument("--test", type=int, default=1000, help="test sentences (default 1000)")
    p.add_argument("--max-sentences", type=int, default=None, help="use the first N sentences (quick checks)")
    p.add_argument("--source", type=Path, default=None, help="the Ding file (default: the trans-de-en package's)")
    args = p.parse_args(argv)
    if min(args.updates, args.batch_size, args.warmup, args.validate_interval_updates) < 1 or args.lr <= 0:
        p.error("--updates, --batch-size, --warmup, --validate-interval-updates and --lr must be positive")
    if args.valid < 1:
        p.error("--valid must be at least 1: the weights reported are those with the best valid perplexity")
    if args.embed_dim % args.heads:
        p.error(f"--heads {args.heads} must divide --embed-dim {args.embed_dim}")
    if args.max_tokens < 3:
        p.error("--max-tokens must be at least 3 (<s>, a word, </s>)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipelines.data.english_vae import ding_sentences

    try:
        sentences = ding_sentences(args.source)
    except Exception as error:  # the Ding file missing or unreadable: one line, exit 2
        return command_error("transformers-sdma-lm", f"reading the Ding sentences: {error}")
    random.Random(0).shuffle(sentences)
    if args.max_sentences:
        sentences = sentences[:args.max_sentences]
    held_out = args.valid + args.test
    if len(sentences) <= held_out:
        return command_error("transformers-sdma-lm", f"{len(sentences)} sentences leave none for training after "
                                                     f"--valid {args.valid} and --test {args.test}")
    split = {"test": sentences[:args.test], "valid": sentences[args.test:held_out], "train": sentences[held_out:]}
    vocabulary = build_vocabulary(split["train"])
    data = {name: encode(part, vocabulary, args.max_tokens) for name, part in split.items()}
    results_path = args.out_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"runs": []}
    results["data"] = {name: len(part) for name, part in data.items()} | {"vocabulary": len(vocabulary)}
    run_missing(results, results_path, args.systems, args.seeds, "transformers-sdma-lm",
                lambda system, seed: run_one(args, system, seed, data, vocabulary))
    summary = {}
    for system in SYSTEMS:
        runs = [r for r in results["runs"] if r["system"] == system]
        if runs:
            summary[system] = {key: seed_interval([r[key] for r in runs])
                               for key in ("perplexity", "LR", "HR", "best_update")}
            summary[system]["last_perplexity"] = seed_interval([r["last"]["perplexity"] for r in runs])
    by_seed = {(r["system"], r["seed"]): r["perplexity"] for r in results["runs"]}
    paired = sorted(seed for system, seed in by_seed if system == "SDMA" and ("vanilla", seed) in by_seed)
    if paired:
        summary["SDMA_minus_vanilla_perplexity"] = seed_interval(
            [by_seed["SDMA", seed] - by_seed["vanilla", seed] for seed in paired]) | {"seeds": paired}
    results["summary"] = summary
    write_json(results_path, results)
    print(f"\nDing English, {results['data']['test']} test sentences, best-valid weights; mean over seeds "
          f"[95% t-interval]")
    print(f"{'system':8} {'seeds':>5} {'perplexity':>26} {'LR':>7} {'HR':>7} {'best update':>11} "
          f"{'last-update perplexity':>26}")
    for system in SYSTEMS:
        if system in summary:
            row = summary[system]
            print(f"{system:8} {row['perplexity']['n']:>5} {format_interval(row['perplexity'])} "
                  f"{row['LR']['mean']:7.3f} {row['HR']['mean']:7.3f} {row['best_update']['mean']:>11.0f} "
                  f"{format_interval(row['last_perplexity'])}")
    if paired:
        print(f"SDMA minus vanilla perplexity, paired by seed ({len(paired)} seeds): "
              f"{format_interval(summary['SDMA_minus_vanilla_perplexity']).strip()}")
    print(f"wrote {results_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
