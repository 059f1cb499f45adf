#!/usr/bin/env python3
"""A BART-shaped translation model trained from scratch with ``SDMASeq2SeqTrainer`` on the Ding German-English
pairs, vanilla against SDMA in both readings (``transformers-sdma-mt``): the transformers counterpart of the
fairseq ``sdma-readings-runs`` on the same data.

Data: the fairseq runs' own preparation (``prepare-ding`` pairs of at most ``--max-words`` words, 500 valid and
1,000 test pairs; one joint sentencepiece model of ``--vocab-size`` pieces), read as pieces; the ids are the
sentencepiece pieces after ``<pad> <s> </s> <unk>``. Model: ``BartForConditionalGeneration`` the size of the demo's
fairseq models (2+2 layers, d = 256, 4 heads, FFN 512, ReLU, dropout 0.1, shared embeddings scaled by sqrt(d),
learned positions: BART's), trained for ``--updates`` updates with the demo's optimisation (Adam (0.9, 0.98), lr
2e-3, inverse-sqrt warm-up 400, weight decay 1e-4, label smoothing 0.1) and a batch of as many pairs as fit
``--max-tokens`` tokens at the training set's mean pair length (fairseq's ``--max-tokens 4096`` by tokens; here a
fixed number of pairs). SDMA: ``attach_sdma`` on the encoder self-attention, the decoder self-attention and the
cross-attention, its regularisers added by ``SDMASeq2SeqTrainer`` weighed as fairseq's criterion weighs them (each
sentence's regularisers against its token-summed cross-entropy: ``sdma_regulariser_scale="sentence"``) with the
fairseq runs' lambdas (``paper``: Table I's tiny row, lambda_q 50, lambda_x 5; ``authors``: their script's 100, 10),
g following the updates.

Evaluation, as ``sdma-readings-runs``: beam-5 hypotheses of the last weights on the 1,000 test pairs,
sentencepiece-decoded, sacreBLEU (13a) against the raw references; a system's BLEU is the mean over its seeds, with
paired percentile bootstrap intervals over test sentences (``--bootstrap-resamples``, one resample applied to every
run; a difference between two systems is over the seeds both ran); validation NLL in bits per target token (no
label smoothing; ``</s>`` included); LR/HR of the encoder self-attention on the first ``--redundancy-sentences`` test
sources (the weights each attention returns: A_hat of eq. 11 with SDMA, whose encoder keeps its mask at inference).
``--fairseq-runs`` puts the ``sdma-readings-runs`` runs of the same seeds on the same data into the same bootstrap.

    transformers-sdma-mt --out-dir outputs/transformers_sdma_mt               # V-T, SDMA-T paper, authors x seeds 1 2
    transformers-sdma-mt --out-dir outputs/transformers_sdma_mt --fairseq-runs examples/sdma_translation/readings_runs
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

from latent_core.errors import command_error
from latent_core.sdma import AUTHORS_SCRIPT_LOSS_WEIGHTS, SMALLER_DISENTANGLEMENT_WEIGHTS
from latent_core.redundancy import RedundancyAccumulator
from experiments.bleu_bootstrap import corpus_bleu_of, paired_bootstrap_by_seed, sentence_statistics
from pipelines.runs import slug, write_json
from experiments.transformers.runs import run_missing, seed_interval

SYSTEMS = {"V-T": None, "SDMA-T paper": "paper", "SDMA-T authors": "authors"}
# the loss weights fairseq's sdma_transformer_iwslt_de_en_tiny gives each reading in sdma-readings-runs
LOSS_WEIGHTS = {"paper": SMALLER_DISENTANGLEMENT_WEIGHTS, "authors": AUTHORS_SCRIPT_LOSS_WEIGHTS}
PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def prepare(out: Path, max_words: int, vocab_size: int, valid: int, test: int, source: Optional[Path]) -> Path:
    """The fairseq runs' data (``prepare-ding`` + ``prepare-translation --joint``) under ``out``; reused when there.
    Returns the directory of the sentencepiece model, the pieces and the raw references."""
    from pipelines.data import ding

    spm_dir = out / "prep" / "spm"
    if not (spm_dir / "spm.joint.model").exists() or not (spm_dir / "test.en.raw").exists():
        ding.prepare_fairseq_data(out, max_words, vocab_size, seed=1, valid_size=valid, test_size=test, source=source)
    return spm_dir


class Pieces:
    """The joint sentencepiece vocabulary as model ids (the specials first) and back to detokenised text."""

    def __init__(self, model_file: Path):
        import sentencepiece

        self.processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        pieces = [self.processor.id_to_piece(i) for i in range(self.processor.get_piece_size())
                  if not (self.processor.is_control(i) or self.processor.is_unknown(i))]
        self.pieces = list(SPECIALS) + pieces
        self.ids = {piece: i for i, piece in enumerate(self.pieces)}

    def encode(self, line: str, max_tokens: int) -> List[int]:
        """Space-separated pieces -> ids and ``</s>``, at most ``max_tokens`` ids."""
        return [self.ids.get(piece, UNK) for piece in line.split()][:max_tokens - 1] + [EOS]

    def decode(self, ids: List[int]) -> str:
        """Generated ids (after the decoder's start token) up to ``</s>`` -> detokenised text."""
        ids = ids[:ids.index(EOS)] if EOS in ids else ids
        return self.processor.decode_pieces([self.pieces[i] for i in ids if i > UNK])


def read_split(spm_dir: Path, split: str, pieces: Pieces, max_tokens: int) -> List[Dict[str, List[int]]]:
    sources = (spm_dir / f"{split}.de").read_text(encoding="utf-8").splitlines()
    targets = (spm_dir / f"{split}.en").read_text(encoding="utf-8").splitlines()
    if len(sources) != len(targets) or not sources:
        raise ValueError(f"{spm_dir}/{split}.de and .en: {len(sources)} and {len(targets)} lines (need equal, > 0)")
    return [{"input_ids": pieces.encode(s, max_tokens), "labels": pieces.encode(t, max_tokens)}
            for s, t in zip(sources, targets)]


def collate(rows: List[Dict[str, List[int]]]) -> Dict[str, torch.Tensor]:
    """Right-padded source ids, their mask and the labels (-100 beyond the target)."""
    def pad(seqs, value):
        out = torch.full((len(seqs), max(map(len, seqs))), value)
        for r, seq in enumerate(seqs):
            out[r, :len(seq)] = torch.tensor(seq)
        return out

    ids, labels = pad([r["input_ids"] for r in rows], PAD), pad([r["labels"] for r in rows], -100)
    # the decoder's inputs, as DataCollatorForSeq2Seq gives them: with label smoothing the Trainer keeps the labels
    # from the model, which would otherwise shift the source
    decoder_input_ids = torch.cat([torch.full((len(rows), 1), EOS), labels[:, :-1].masked_fill(labels[:, :-1] < 0,
                                                                                              PAD)], 1)
    return {"input_ids": ids, "attention_mask": ids.ne(PAD).long(), "decoder_input_ids": decoder_input_ids,
            "labels": labels}


def build_model(args, vocabulary: int, system: str):
    from transformers import BartConfig, BartForConditionalGeneration

    from transformers_plugin import attach_sdma

    config = BartConfig(vocab_size=vocabulary, d_model=args.embed_dim, encoder_layers=args.layers,
                        decoder_layers=args.layers, encoder_attention_heads=args.heads,
                        decoder_attention_heads=args.heads, encoder_ffn_dim=args.ffn_dim,
                        decoder_ffn_dim=args.ffn_dim, activation_function="relu", dropout=0.1,
                        attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=args.max_tokens + 2,
                        scale_embedding=True, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
                        decoder_start_token_id=EOS, forced_eos_token_id=None, forced_bos_token_id=None,
                        tie_word_embeddings=True, attn_implementation="sdpa")
    model = BartForConditionalGeneration(config)
    if SYSTEMS[system] is not None:
        attach_sdma(model, mode="sdma", reading=SYSTEMS[system])
    return model


def batch_pairs(train: List[Dict[str, List[int]]], max_tokens: int) -> int:
    """Pairs per batch: ``max_tokens`` over the mean of max(source, target) length (fairseq counts the longer)."""
    mean = float(np.mean([max(len(r["input_ids"]), len(r["labels"])) for r in train]))
    return max(1, int(max_tokens / mean))


def valid_bits_per_token(model, rows, batch_size: int) -> float:
    model.eval()
    nll = tokens = 0.0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collate(rows[start:start + batch_size])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           labels=batch["labels"]).logits
            real = batch["labels"].ne(-100)
            logp = torch.log_softmax(logits.float(), -1)
            picked = logp.gather(-1, batch["labels"].clamp_min(0).unsqueeze(-1)).squeeze(-1)
            nll, tokens = nll - float(picked[real].sum()), tokens + float(real.sum())
    return nll / tokens / math.log(2)


def translate(model, rows, pieces: Pieces, beam: int, max_len: int, batch_size: int) -> List[str]:
    model.eval()
    hypotheses = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collate(rows[start:start + batch_size])
            out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 num_beams=beam, max_new_tokens=max_len, early_stopping=True)
            hypotheses += [pieces.decode(seq[1:].tolist()) for seq in out]
    return hypotheses


def encoder_redundancy(model, rows, batch_size: int) -> Dict[str, float]:
    """LR/HR of the encoder self-attention heads (the SDMA paper's Tables II-IV metric)."""
    model.eval()
    accumulator = RedundancyAccumulator()
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collate(rows[start:start + batch_size])
            out = model.model.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                      output_attentions=True)
            attn = torch.stack([a.transpose(0, 1) for a in out.attentions])  # [layers, heads, B, S, S]
            valid = batch["attention_mask"].bool()
            accumulator.add("encoder_self", attn.float(), valid, valid)
    return accumulator.result()["encoder_self"]


def run_one(args, system: str, seed: int, data: dict, pieces: Pieces, references: List[str]) -> dict:
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from transformers_plugin.trainer import SDMASeq2SeqTrainer

    torch.manual_seed(seed)
    model = build_model(args, len(pieces.pieces), system)
    run_dir = args.out_dir / system.replace(" ", "_") / f"seed{seed}"
    batch_size = batch_pairs(data["train"], args.max_tokens_per_batch)
    training = Seq2SeqTrainingArguments(
        output_dir=str(run_dir), max_steps=args.updates, per_device_train_batch_size=batch_size,
        learning_rate=args.lr, lr_scheduler_type="inverse_sqrt", warmup_steps=args.warmup, adam_beta1=0.9,
        adam_beta2=0.98, weight_decay=1e-4, label_smoothing_factor=0.1, max_grad_norm=0.0, logging_steps=100,
        save_strategy="no", report_to=[], use_cpu=True, seed=seed, data_seed=seed, dataloader_num_workers=0,
        remove_unused_columns=False, disable_tqdm=True)
    if SYSTEMS[system] is None:
        trainer = Seq2SeqTrainer(model=model, args=training, train_dataset=data["train"], data_collator=collate)
    else:  # the regularisers weighed as fairseq's criterion does (sentence scale: summed over the sentences)
        trainer = SDMASeq2SeqTrainer(model=model, args=training, train_dataset=data["train"], data_collator=collate,
                                     sdma_weights=LOSS_WEIGHTS[SYSTEMS[system]], sdma_regulariser_scale="sentence")
    started = time.time()
    trainer.train()
    seconds = time.time() - started
    hypotheses = translate(model, data["test"], pieces, args.beam, args.gen_max_len, args.eval_batch_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "hypotheses.txt").write_text("\n".join(hypotheses) + "\n", encoding="utf-8")
    stats = sentence_statistics(hypotheses, references)
    if SYSTEMS[system] is None:  # transformers' sdpa returns no weights: its eager attention computes the same
        model.set_attn_implementation("eager")
    redundancy = encoder_redundancy(model, data["test"][:args.redundancy_sentences], args.eval_batch_size)
    return {"system": system, "seed": seed, "updates": args.updates, "batch_pairs": batch_size,
            "train_seconds": round(seconds, 1), "parameters": sum(p.numel() for p in model.parameters()),
            "bleu": corpus_bleu_of(stats), "stats": stats.tolist(),
            "valid_bits_per_token": valid_bits_per_token(model, data["valid"], args.eval_batch_size),
            "LR": redundancy["LR"], "HR": redundancy["HR"],
            "log": [entry for entry in trainer.state.log_history if "loss" in entry]}


def fairseq_runs(folder: Path, seeds: List[int], references: List[str]) -> Dict[str, Dict[int, dict]]:
    """The ``sdma-readings-runs`` runs in ``folder`` of ``seeds`` (its layout: ``<system, spaces as dashes>/seed<k>/``
    with ``evaluation.json``, the beam-5 hypotheses and LR/HR, and ``train.json``, fairseq's last validation NLL in
    bits), each re-scored against ``references``: ``{"fairseq <system>": {seed: run}}`` with the fields of this
    tool's runs. Raises ValueError where the folder holds none of them or a run's hypotheses do not match."""
    found: Dict[str, Dict[int, dict]] = {}
    for system in SYSTEMS:
        for seed in seeds:
            run_dir = folder / slug(system) / f"seed{seed}"
            if not (run_dir / "evaluation.json").is_file():
                continue
            evaluation = json.loads((run_dir / "evaluation.json").read_text())
            trained = json.loads((run_dir / "train.json").read_text())
            if len(evaluation["hypotheses"]) != len(references):
                raise ValueError(f"{run_dir}/evaluation.json has {len(evaluation['hypotheses'])} hypotheses for "
                                 f"{len(references)} test references: not a run on the same data")
            stats = sentence_statistics(evaluation["hypotheses"], references)
            found.setdefault(f"fairseq {system}", {})[seed] = {
                "system": f"fairseq {system}", "seed": seed, "updates": trained["updates"], "stats": stats.tolist(),
                "bleu": corpus_bleu_of(stats), "valid_bits_per_token": trained["measured"]["valid_nll"],
                "LR": evaluation["lr"]["encoder_self"], "HR": evaluation["hr"]["encoder_self"],
                "train_seconds": trained["measured"]["train_seconds_last_process"], "source": str(run_dir)}
    if not found:
        raise ValueError(f"{folder} holds no sdma-readings-runs run of seeds {seeds} (expected "
                         f"{folder}/V-T/seed{seeds[0]}/evaluation.json and train.json)")
    return found


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="transformers-sdma-mt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("outputs") / "transformers_sdma_mt")
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--updates", type=int, default=1400, help="as sdma-readings-runs: g = 1 - exp(-5e-4 t) passes 0.5")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=400)
    p.add_argument("--max-tokens-per-batch", type=int, default=4096)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--ffn-dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=2, help="encoder layers, and as many decoder layers")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64, help="pieces per sentence, </s> included")
    p.add_argument("--max-words", type=int, default=10, help="keep Ding pairs of at most N words per side")
    p.add_argument("--vocab-size", type=int, default=2000, help="joint sentencepiece vocabulary")
    p.add_argument("--valid-size", type=int, default=500)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--source", type=Path, default=None, help="the Ding file (default: the trans-de-en package's)")
    p.add_argument("--max-train-pairs", type=int, default=None, help="use the first N training pairs (quick checks)")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--gen-max-len", type=int, default=60, help="longest hypothesis, in pieces")
    p.add_argument("--eval-batch-size", type=int, default=100)
    p.add_argument("--redundancy-sentences", type=int, default=500)
    p.add_argument("--bootstrap-resamples", type=int, default=1000)
    p.add_argument("--fairseq-runs", type=Path, default=None,
                   help="an sdma-readings-runs output folder on the same data: its runs of the same seeds are "
                        "re-scored against the same references and join the bootstrap as 'fairseq <system>'")
    args = p.parse_args(argv)
    if min(args.updates, args.warmup, args.max_tokens_per_batch, args.beam, args.gen_max_len, args.eval_batch_size,
           args.redundancy_sentences, args.bootstrap_resamples, args.valid_size, args.test_size) < 1 or args.lr <= 0:
        p.error("--updates, --warmup, --max-tokens-per-batch, --beam, --gen-max-len, --eval-batch-size, "
                "--redundancy-sentences, --bootstrap-resamples, --valid-size, --test-size and --lr must be positive")
    if args.embed_dim % args.heads:
        p.error(f"--heads {args.heads} must divide --embed-dim {args.embed_dim}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        spm_dir = prepare(args.out_dir / "data", args.max_words, args.vocab_size, args.valid_size, args.test_size,
                          args.source)
        pieces = Pieces(spm_dir / "spm.joint.model")
        data = {split: read_split(spm_dir, split, pieces, args.max_tokens) for split in ("train", "valid", "test")}
        references = (spm_dir / "test.en.raw").read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError, SystemExit) as error:
        return command_error("transformers-sdma-mt", f"preparing the Ding pairs: {error}")
    if args.max_train_pairs:
        data["train"] = data["train"][:args.max_train_pairs]
    if len(references) != len(data["test"]):
        return command_error("transformers-sdma-mt", f"{spm_dir}/test.en.raw has {len(references)} lines for "
                                                     f"{len(data['test'])} test pairs")
    results_path = args.out_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"runs": []}
    results["data"] = {split: len(rows) for split, rows in data.items()} | {"vocabulary": len(pieces.pieces)}
    run_missing(results, results_path, args.systems, args.seeds, "transformers-sdma-mt",
                lambda system, seed: run_one(args, system, seed, data, pieces, references))
    runs_of = {system: {run["seed"]: run for run in results["runs"] if run["system"] == system} for system in SYSTEMS}
    runs_of = {system: by_seed for system, by_seed in runs_of.items() if by_seed}
    pairs = [(a, "V-T") for a in SYSTEMS if a != "V-T"] + [("SDMA-T authors", "SDMA-T paper")]
    comparisons = list(pairs)
    if args.fairseq_runs is not None:
        try:
            runs_of.update(fairseq_runs(args.fairseq_runs, sorted({r["seed"] for r in results["runs"]}), references))
        except (OSError, ValueError, KeyError, SystemExit) as error:
            return command_error("transformers-sdma-mt", f"--fairseq-runs: {error}")
        comparisons += [(f"fairseq {a}", f"fairseq {b}") for a, b in pairs] + [(s, f"fairseq {s}") for s in SYSTEMS]
    stats = {system: {seed: np.asarray(run["stats"], dtype=np.int64) for seed, run in by_seed.items()}
             for system, by_seed in runs_of.items()}
    # a difference over the seeds both systems ran (runs of other --seeds may be in results.json)
    bleu = paired_bootstrap_by_seed(stats, args.bootstrap_resamples, seed=1, comparisons=comparisons)
    summary = {"bleu": bleu}
    if args.fairseq_runs is not None:
        summary["fairseq_runs"] = [{k: v for k, v in run.items() if k != "stats"} for name, by_seed in runs_of.items()
                                   if name.startswith("fairseq ") for run in by_seed.values()]
    for system, by_seed in runs_of.items():
        summary[system] = {key: seed_interval([r[key] for r in by_seed.values()])
                           for key in ("bleu", "valid_bits_per_token", "LR", "HR")}
    results["summary"] = summary
    write_json(results_path, results)
    print(f"\nDing de->en, {results['data']['test']} test pairs, beam {args.beam}, sacreBLEU 13a, last weights; "
          f"seed means, BLEU with paired bootstrap 95% intervals over sentences ({args.bootstrap_resamples} resamples)")
    print(f"{'system':24} {'seeds':>5} {'BLEU':>6} {'interval':>15} {'per seed':>20} {'valid bits/token':>16} "
          f"{'LR':>6} {'HR':>6}")
    for system in runs_of:
        row, interval = summary[system], bleu["systems"][system]["interval"]
        per_seed = " / ".join(f"{r['bleu']:.2f}" for _, r in sorted(runs_of[system].items()))
        print(f"{system:24} {row['bleu']['n']:>5} {bleu['systems'][system]['bleu']:6.2f} "
              f"{interval[0]:6.2f}-{interval[1]:<6.2f} {per_seed:>22} {row['valid_bits_per_token']['mean']:16.3f} "
              f"{row['LR']['mean']:6.3f} {row['HR']['mean']:6.3f}")
    for name, entry in bleu["comparisons"].items():
        print(f"{name}: {entry['difference']:+.2f} BLEU ({entry['interval'][0]:+.2f} to {entry['interval'][1]:+.2f}; "
              f"{100 * entry['share_of_resamples_above_zero']:.1f}% of resamples above 0; "
              f"seed{'s' if len(entry['seeds']) > 1 else ''} {', '.join(map(str, entry['seeds']))})")
    print(f"wrote {results_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
