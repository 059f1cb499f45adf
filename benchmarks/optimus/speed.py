"""Training speed of the BERT + GPT-2 pairing against the same GPT-2 trained alone, in one process
(command ``optimus-bench --data DIR --bert-dir DIR``; merged into ``outputs/bench/vae.json``).

The two models take turns on one real batch of an ``optimus_lm`` corpus, so machine drift
between them cancels (the method of ``benchmarks/sdma/step_timing.py``):

* **Optimus**: built by fairseq (``--task optimus_lm --arch optimus_small --bert-dir BERT``,
  criterion ``sentence_vae``); one update = criterion forward (BERT, the posterior, z, GPT-2 with
  memory + embedding injection, KL) + backward + Adam step;
* **GPT-2 alone**: a ``transformers.GPT2LMHeadModel`` with exactly the configuration of
  Optimus' decoder (layers, width, heads, vocabulary, positions), fed the same decoder input and
  target; one update = causal-LM cross-entropy per target token + backward + Adam step.

Per round each model runs ``updates_per_round`` updates; the words/s ratio (Optimus / GPT-2 =
GPT-2's time / Optimus' time, words = target tokens) is taken within each round and reported as
min / median / max. The FLOPs of one update of each (``torch.utils.flop_counter``, matrix
products only) give the arithmetic bound of that ratio: the pairing runs a BERT besides the
GPT-2, so its ratio cannot exceed GPT-2 FLOPs / Optimus FLOPs whatever the implementation.
"""

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Dict, Sequence

import torch
import torch.nn.functional as F
from fairseq import options, tasks, utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from transformers import GPT2LMHeadModel

from benchmarks.op_counts import count_flops
from pipelines.runs import USER_DIR, print_table, write_json

DECODER_4x256 = ["--decoder-layers", "4", "--decoder-embed-dim", "256", "--decoder-attention-heads", "4",
                 "--decoder-ffn-embed-dim", "1024"]


def build_pair(data: str, bert_dir: str, extra: Sequence[str] = DECODER_4x256):
    """(task, Optimus model, criterion) through fairseq's own builders."""
    argv = [str(data), "--user-dir", str(USER_DIR), "--task", "optimus_lm", "--criterion", "sentence_vae",
            "--arch", "optimus_small", "--bert-dir", str(bert_dir), *extra, "--beta-schedule", "constant:1.0",
            "--optimizer", "adam", "--lr", "1e-4"]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    return task, model, task.build_criterion(cfg.criterion)


def real_batch(task, sentences: int, split: str = "train"):
    task.load_dataset(split)
    dataset = task.dataset(split)
    if len(dataset) < sentences:
        raise ValueError(f"split {split!r} has {len(dataset)} sentences, fewer than the {sentences} asked for")
    return dataset.collater([dataset[i] for i in range(sentences)])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpt2_update(gpt2, optimizer, sample, pad: int) -> None:
    prev = sample["net_input"]["prev_output_tokens"]
    logits = gpt2(input_ids=prev, attention_mask=prev.ne(pad).long()).logits
    loss = F.cross_entropy(logits.transpose(1, 2), sample["target"], ignore_index=pad, reduction="sum")
    (loss / sample["ntokens"]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _optimus_update(model, criterion, optimizer, sample) -> None:
    loss, sample_size, _ = criterion(model, sample)
    (loss / sample_size).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def time_pair_vs_gpt2(data: str, bert_dir: str, sentences: int = 64, rounds: int = 5, updates_per_round: int = 2,
                      seed: int = 1, extra: Sequence[str] = DECODER_4x256, device: str = "cpu") -> Dict:
    """Interleaved update timing of Optimus and GPT-2 alone (module doc); ratios Optimus / GPT-2.
    ``device``: where both models, the batch and the optimisers live (``cuda`` on a GPU; fp32)."""
    if min(sentences, rounds, updates_per_round) < 1:
        raise ValueError("sentences, rounds and updates_per_round must be >= 1")
    torch.manual_seed(seed)
    task, model, criterion = build_pair(data, bert_dir, extra)
    device = torch.device(device)
    sample = utils.move_to_cuda(real_batch(task, sentences), device=device) if device.type == "cuda" else \
        real_batch(task, sentences)
    config = model.decoder.gpt2.config
    gpt2 = GPT2LMHeadModel(config)
    model.to(device)
    gpt2.to(device)
    model.train()
    gpt2.train()
    pad = task.target_dictionary.pad()
    runs = {
        "optimus": (lambda opt=torch.optim.Adam(model.parameters(), lr=1e-4): _optimus_update(model, criterion, opt, sample)),
        "gpt2": (lambda opt=torch.optim.Adam(gpt2.parameters(), lr=1e-4): _gpt2_update(gpt2, opt, sample, pad)),
    }
    flops = {name: count_flops(step)[0] for name, step in runs.items()}
    for step in runs.values():
        step()  # warm-up outside the timed rounds
    wall = {name: [] for name in runs}
    for _ in range(rounds):
        for name, step in runs.items():
            _sync(device)
            start = time.perf_counter()
            for _ in range(updates_per_round):
                step()
            _sync(device)
            wall[name].append((time.perf_counter() - start) / updates_per_round)
    ratios = [g / o for g, o in zip(wall["gpt2"], wall["optimus"])]
    ntokens = int(sample["ntokens"])
    return {
        "wps_ratio": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
                      "per_round": ratios},
        "words_per_second": {name: ntokens / statistics.median(times) for name, times in wall.items()},
        "seconds_per_update": wall,
        "flops_per_update": flops,
        "flops_bound": flops["gpt2"] / flops["optimus"],
        "params": {"optimus": sum(p.numel() for p in model.parameters()),
                   "optimus_encoder": sum(p.numel() for p in model.encoder.parameters()),
                   "gpt2": sum(p.numel() for p in gpt2.parameters())},
        "decoder": {"n_layer": config.n_layer, "n_embd": config.n_embd, "n_head": config.n_head,
                    "vocab_size": config.vocab_size},
        "batch": {"sentences": sentences, "target_tokens": ntokens,
                  "source_tokens": int(sample["net_input"]["src_lengths"].sum())},
        "rounds": rounds, "updates_per_round": updates_per_round, "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "estimator": "words = target (GPT-2) tokens of one real batch; ratio = GPT-2-alone seconds / Optimus "
                     "seconds per update within each round, min/median/max over rounds; FLOPs: FlopCounterMode, "
                     "matrix products only",
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="optimus-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="an optimus_lm corpus (prepare-optimus-data)")
    p.add_argument("--bert-dir", type=Path, required=True, help="the pairing's local BERT directory")
    p.add_argument("--sentences", type=int, default=64, help="sentences of the timed batch")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--updates-per-round", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (fp32 on the GPU)")
    p.add_argument("--out", type=Path, default=Path("outputs") / "bench" / "vae.json")
    args = p.parse_args(argv)
    if min(args.sentences, args.rounds, args.updates_per_round) < 1:
        p.error("--sentences, --rounds and --updates-per-round must be >= 1")
    return args


def main(argv=None) -> int:
    """``optimus-bench``: print the comparison and merge it into ``--out`` (``outputs/bench/vae.json``,
    beside ``vae-bench``'s results) as ``optimus_pair`` and ``optimus_pair_wps_ratio``."""
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"optimus-bench: --device {args.device}: no CUDA device is visible")
    pair = time_pair_vs_gpt2(str(args.data), str(args.bert_dir), args.sentences, args.rounds, args.updates_per_round,
                             device=args.device)
    ratio = pair["wps_ratio"]
    print_table([{"model": name, "words/s": pair["words_per_second"][name],
                  "GFLOPs/update": pair["flops_per_update"][name] / 1e9, "params": pair["params"][name]}
                 for name in ("optimus", "gpt2")], ["model", "words/s", "GFLOPs/update", "params"],
                f"BERT + GPT-2 vs the same GPT-2 alone ({pair['device']}): words/s ratio {ratio['min']:.3f} / {ratio['median']:.3f} / "
                f"{ratio['max']:.3f} (min/median/max over rounds), FLOPs bound {pair['flops_bound']:.3f}")
    payload = json.loads(args.out.read_text()) if args.out.exists() else {}
    payload["optimus_pair"] = pair
    payload["optimus_pair_wps_ratio"] = ratio["median"]
    write_json(args.out, payload)
    print(f"[optimus] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
