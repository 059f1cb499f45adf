"""The four rows of Tables II/III on one corpus: V-T, SDMA-T, BV-T, BSDMA-T (command ``sdma-bert-runs``).

Stages (one ``[sdma]`` line each; every finished stage is reused when the command is run again):

1. Ding dictionary pairs (``prepare-ding``), split as the quickstart does;
2. two binarisations of the same pairs, English -> German: sentencepiece on both sides (V-T,
   SDMA-T) and BERT's own tokenizer on the source (``prepare-translation --src-bert-dir``;
   BV-T, BSDMA-T); the German side's sentencepiece model is trained on the same text with the
   same settings in both, so all four systems predict the same target pieces;
3. each system trained for the same ``--updates`` with the same optimisation and size
   (``fairseq-train``; an interrupted run resumes from its ``checkpoint_last.pt``);
4. ``fairseq-generate`` (beam 5) of the test split and sacreBLEU against the raw references;
5. LR/HR of the three attention types on the test split (``sdma-redundancy``'s measure, the
   paper's [0, 1] scale);

then a table, and ``OUT/results.json``: one entry per system (``V-T``, ``SDMA-T``, ``BV-T``,
``BSDMA-T``) with ``bleu``, ``lr``, ``hr`` (per attention type), ``train_wps``,
``trained_params`` (what the optimiser updates: BERT excluded when frozen, as the paper counts),
``updates`` and how each was measured.

V-T is ``sdma_transformer --sdma-mode none`` (the vanilla transformer, same parameters as
fairseq's ``transformer``) so that all four share one criterion and one code path; BV-T is
``bert_fused_transformer --sdma-mode none``.
"""

import argparse
import json
import math
from pathlib import Path
from typing import Dict, List

from pipelines.data import ding, translation
from latent_core.redundancy import ATTENTION_TYPES
from user_dir.tools.sdma.bleu import sacrebleu_score
from pipelines.runs import (
    USER_DIR,
    console_script,
    generate,
    last_num_updates,
    print_table,
    resumed_update,
    run_streaming,
    segment_words_per_second,
    stage,
    train_words_per_second,
    trained_parameters,
    write_json,
)
from experiments.sdma import quickstart

SYSTEMS = ("V-T", "SDMA-T", "BV-T", "BSDMA-T")
SRC, TGT = "en", "de"
# The demo's size and optimisation (quickstart.py: Table I's tiny width, 2+2 layers), without shared
# source/target embeddings (BERT's vocabulary is the source side of the BERT-fused rows).
MODEL_SIZE = [a for a in quickstart.MODEL_SIZE if a != "--share-all-embeddings"] + ["--share-decoder-input-output-embed"]
OPTIMIZATION = [*quickstart.OPTIMIZATION, "--criterion", "sdma_label_smoothed_cross_entropy"]


def system_arguments(system: str, bert_dir: str, fusion: str) -> List[str]:
    """The model options of one row."""
    sdma = [] if system in ("SDMA-T", "BSDMA-T") else ["--sdma-mode", "none"]
    if system in ("V-T", "SDMA-T"):
        return ["--arch", "sdma_transformer_iwslt_de_en_tiny", *sdma]
    return ["--arch", "bert_fused_transformer_tiny", "--bert-dir", bert_dir, "--bert-fusion", fusion, *sdma]


def prepare_data(out: Path, args: argparse.Namespace) -> Dict[str, Path]:
    """Ding pairs and their two binarisations; reuses what an earlier run finished."""
    raw, bert_dir, vocab_size = out / "raw", args.bert_dir, args.vocab_size
    if not (raw / "test.en").exists():
        stage("data 1/3: German-English pairs from the Ding dictionary (trans-de-en)")
        ding.build_corpus(raw, max_words=args.max_words, valid_size=args.valid_size, test_size=args.test_size,
                          seed=args.seed, report=True)
    common = dict(train_prefix=str(raw / "train"), valid_prefix=str(raw / "valid"), test_prefix=str(raw / "test"),
                  src=SRC, tgt=TGT, soft_vocab_limit=True, workers=2, overwrite=True)
    bins = {"spm": out / "spm" / "bin", "bert": out / "bert" / "bin"}
    if not (bins["spm"] / f"test.{SRC}-{TGT}.{TGT}.bin").exists():
        stage("data 2/3: sentencepiece on both sides (V-T, SDMA-T)")
        translation.prepare(translation.options(**common, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size,
                                                out_dir=out / "spm"))
    if not (bins["bert"] / f"test.{SRC}-{TGT}.{TGT}.bin").exists():
        stage(f"data 3/3: BERT's tokenizer on the source ({bert_dir}), sentencepiece on the target (BV-T, BSDMA-T)")
        translation.prepare(translation.options(**common, src_bert_dir=bert_dir, tgt_vocab_size=vocab_size,
                                                out_dir=out / "bert"))
    return bins


def train(system: str, data_bin: Path, save_dir: Path, model_args: List[str], updates: int, seed: int) -> Dict:
    """``fairseq-train`` up to ``updates`` (resuming ``save_dir/checkpoint_last.pt`` if there is one);
    its measurements are kept in ``save_dir/train.json`` and reused by a later call."""
    done_path = save_dir / "train.json"
    if done_path.exists():
        done = json.loads(done_path.read_text())
        if done.get("updates") == updates and done.get("model_args") == model_args:
            stage(f"{system}: reusing the trained model in {save_dir}")
            return done["measured"]
    log_path = save_dir / "train.log"
    cmd = [console_script("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--task", "translation",
           *model_args, *MODEL_SIZE, *OPTIMIZATION, "--seed", seed, "--cpu", "--save-dir", save_dir,
           "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", max(1, min(25, updates // 4)),
           "--no-progress-bar",
           "--max-update", updates, "--max-epoch", "1000"]
    stage(f"{system}: fairseq-train to {updates} updates -> {save_dir} (log {log_path})")
    run = run_streaming(cmd, log_path, echo_filter=r"train_inner|\| valid \||num\. (shared )?model params")
    reached = last_num_updates(run["log"])
    if reached != updates:
        raise SystemExit(f"{log_path}: training stopped at update {reached}, expected {updates} (a checkpoint "
                         f"with more updates in {save_dir}? remove it or raise --updates)")
    wps = segment_words_per_second(run["log"], start_update=resumed_update(run["log"]))["words_per_second"]
    if math.isnan(wps):  # too few logged intervals: fairseq's epoch summary
        wps = train_words_per_second(run["log"])
    measured = {"train_wps": wps,
                "trained_params": trained_parameters(run["log"]), "train_seconds": run["seconds"]}
    write_json(done_path, {"updates": updates, "model_args": model_args, "measured": measured})
    return measured


def evaluate(system: str, data_bin: Path, save_dir: Path, references: List[str], max_sentences: int,
             gen_max_len: int) -> Dict:
    from user_dir.tools.sdma.redundancy import attention_redundancy

    checkpoint = save_dir / "checkpoint_last.pt"
    stage(f"{system}: fairseq-generate (beam 5) + sacreBLEU on the test split")
    result = generate(data_bin, checkpoint, save_dir, extra=["--max-len-b", gen_max_len])
    bleu = sacrebleu_score(result["hypotheses"], references).score
    stage(f"{system}: LR/HR of the three attention types on the first {max_sentences} test sentences")
    redundancy = attention_redundancy(str(checkpoint), data=str(data_bin), subset="test",
                                      max_sentences=max_sentences, device="cpu", user_dir=str(USER_DIR))
    return {
        "bleu": bleu,
        "lr": {kind: redundancy[kind]["LR"] for kind in ATTENTION_TYPES},
        "hr": {kind: redundancy[kind]["HR"] for kind in ATTENTION_TYPES},
        "redundancy_sentences": redundancy["sentences"],
        "test_sentences": len(references),
        "generate_sentences_per_second": result["sentences_per_second"],
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bert-dir", required=True, help="local Hugging Face BERT-family directory (English)")
    p.add_argument("--out-dir", type=Path, default=Path("outputs") / "bsdma")
    p.add_argument("--updates", type=int, default=800, help="training updates of every system (default 800)")
    p.add_argument("--bert-fusion", choices=("embed", "attention"), default="embed",
                   help="fusion of the BERT rows (default: embed, the paper's description)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--max-words", type=int, default=10, help="keep Ding pairs of at most N words per side")
    p.add_argument("--vocab-size", type=int, default=2000, help="sentencepiece vocabulary of each side")
    p.add_argument("--valid-size", type=int, default=500, help="Ding validation pairs (default 500)")
    p.add_argument("--test-size", type=int, default=1000, help="Ding test pairs (default 1000)")
    p.add_argument("--gen-max-len", type=int, default=200,
                   help="longest hypothesis of fairseq-generate, in tokens (default 200, fairseq's)")
    p.add_argument("--redundancy-sentences", type=int, default=1000,
                   help="test sentences for LR/HR (default 1000: the whole Ding test split)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if min(args.updates, args.redundancy_sentences, args.gen_max_len, args.test_size, args.valid_size) < 1:
        p.error("--updates, --redundancy-sentences, --gen-max-len, --valid-size and --test-size must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out: Path = args.out_dir
    bins = prepare_data(out / "data", args)
    references = (out / "data" / "spm" / "spm" / f"test.{TGT}.raw").read_text(encoding="utf-8").splitlines()
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for system in args.systems:
        save_dir = out / system
        model_args = system_arguments(system, args.bert_dir, args.bert_fusion)
        settings = {"updates": args.updates, "model_args": model_args, "seed": args.seed}
        previous = results.get(system)
        if previous and all(previous.get(k) == v for k, v in settings.items()):
            stage(f"{system}: reusing the finished run in {save_dir}")
            continue
        data_bin = bins["bert" if system.startswith("B") else "spm"]
        entry = {**settings, "data": str(data_bin)}
        entry.update(train(system, data_bin, save_dir, model_args, args.updates, args.seed))
        entry.update(evaluate(system, data_bin, save_dir, references, args.redundancy_sentences, args.gen_max_len))
        entry["estimators"] = {
            "bleu": f"sacreBLEU (13a, detokenised) of beam-5 checkpoint_last hypotheses on the "
                    f"{len(references)} test pairs",
            "lr_hr": "latent_core.redundancy on the paper's [0, 1] scale, mean over test sentences",
            "train_wps": "target tokens per second of fairseq's logged intervals (first interval skipped) "
                         "of the last fairseq-train process",
            "trained_params": "fairseq's 'num. trained' (parameters with requires_grad; a frozen BERT "
                              "is excluded, as the paper counts)",
        }
        results[system] = entry
        write_json(results_path, results)
    rows = [{"system": name, "BLEU": r["bleu"], "LR enc": r["lr"]["encoder_self"], "HR enc": r["hr"]["encoder_self"],
             "LR cross": r["lr"]["decoder_cross"], "HR cross": r["hr"]["decoder_cross"],
             "trained params": r["trained_params"], "train wps": r["train_wps"], "updates": r["updates"]}
            for name, r in ((s, results[s]) for s in SYSTEMS if s in results)]
    print_table(rows, list(rows[0]), f"Ding {SRC}->{TGT}, {args.updates} updates each ({results_path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
