"""The SDMA quickstart (``make demo``): real German->English data, end to end on a CPU.

Stages (one ``[sdma]`` line each, fairseq's own progress in between):

1. German-English sentence pairs from the Ding dictionary (Debian ``trans-de-en``),
   deterministic train/valid/test split (``scripts/prepare_ding_de_en.py``);
2. a joint sentencepiece vocabulary and ``fairseq-preprocess``
   (``scripts/prepare_translation.py``);
3. a vanilla fairseq ``transformer`` trained for a wall-clock budget, then SDMA-T of the
   identical size for the SAME number of updates on the same batches;
4. ``fairseq-generate`` (beam 5) and sacreBLEU for both;
5. attention redundancy LR/HR (encoder self, decoder self, cross) for both;
6. the Fig. 6-style picture of one test sentence;

then a side-by-side table, also written to ``outputs/quickstart/results.json``.

``--minutes`` is the whole budget (``make demo DEMO_MINUTES=60`` for a longer run);
about 2 minutes go to data, decoding and analysis, the rest is split between the two
trainings (SDMA-T runs slower per update, so vanilla gets a bit less than half).
"""

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import prepare_ding_de_en  # noqa: E402
import prepare_translation  # noqa: E402
from sdma_runs import (  # noqa: E402
    REPO,
    USER_DIR,
    console_script,
    generate,
    last_num_updates,
    model_parameters,
    print_table,
    run_streaming,
    sacrebleu_score,
    stage,
    train_words_per_second,
    write_json,
)

# The demo model: the paper's "tiny" width (256/512, 4 heads) with 2+2 layers so that
# it learns something in minutes on 2 cores; joint 2k sentencepiece vocabulary.
MODEL_SIZE = [
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
    "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--share-all-embeddings",
]
OPTIMIZATION = [
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "2e-3",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "400", "--weight-decay", "1e-4",
    "--dropout", "0.1", "--label-smoothing", "0.1", "--max-tokens", "4096",
]
OVERHEAD_MINUTES = 2.0
SDMA_SLOWDOWN = 1.25  # expected SDMA-T / vanilla time per update on this CPU (see make bench)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="total wall-clock budget (default 10)")
    p.add_argument("--out-dir", type=Path, default=REPO / "outputs" / "quickstart")
    p.add_argument("--max-words", type=int, default=10, help="keep pairs of at most N words per side")
    p.add_argument("--vocab-size", type=int, default=2000, help="joint sentencepiece vocabulary")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.minutes <= OVERHEAD_MINUTES + 0.5:
        p.error(f"--minutes must be > {OVERHEAD_MINUTES + 0.5} (data, decoding and analysis take ~2 minutes)")
    return args


def prepare_data(out_dir: Path, max_words: int, vocab_size: int, seed: int = 1) -> Path:
    """Ding pairs -> sentencepiece -> fairseq-preprocess; reuses a finished earlier run."""
    raw, prep = out_dir / "raw", out_dir / "prep"
    bin_dir = prep / "bin"
    if (bin_dir / "train.de-en.de.bin").exists() and (raw / "test.en").exists():
        stage(f"data: reusing {bin_dir}")
        return bin_dir
    stage("data 1/2: German-English sentence pairs from the Ding dictionary (trans-de-en)")
    prepare_ding_de_en.main(["--out-dir", str(raw), "--max-words", str(max_words), "--seed", str(seed)])
    stage("data 2/2: joint sentencepiece vocabulary + fairseq-preprocess")
    prepare_translation.main([
        "--train-prefix", str(raw / "train"), "--valid-prefix", str(raw / "valid"),
        "--test-prefix", str(raw / "test"), "--src", "de", "--tgt", "en", "--joint",
        "--vocab-size", str(vocab_size), "--out-dir", str(prep), "--workers", "2",
    ])
    return bin_dir


def train(data_bin: Path, save_dir: Path, arch_args, seed: int, *limit) -> dict:
    shutil.rmtree(save_dir, ignore_errors=True)  # a fresh run, never a resumed one
    cmd = [
        console_script("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--task", "translation",
        *arch_args, *MODEL_SIZE, *OPTIMIZATION, "--seed", seed, "--cpu",
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--log-format", "simple",
        "--log-interval", "50", "--no-progress-bar", *limit,
    ]
    return run_streaming(cmd, save_dir / "train.log",
                         echo_filter=r"train_inner|\| valid \||done training|num\. (shared )?model params")


def main(argv=None):
    args = parse_args(argv)
    out = args.out_dir
    data_bin = prepare_data(out / "data", args.max_words, args.vocab_size, args.seed)
    references = (out / "data" / "raw" / "test.en").read_text().splitlines()

    train_minutes = args.minutes - OVERHEAD_MINUTES
    vanilla_minutes = train_minutes / (1.0 + SDMA_SLOWDOWN)
    stage(f"train 1/2: vanilla transformer (V-T) for {vanilla_minutes:.1f} minutes")
    runs = {}
    runs["V-T"] = train(data_bin, out / "vanilla", ["--arch", "transformer", "--criterion",
                                                    "label_smoothed_cross_entropy"], args.seed,
                        "--stop-time-hours", f"{vanilla_minutes / 60:.5f}", "--max-epoch", "1000")
    updates = last_num_updates(runs["V-T"]["log"])
    stage(f"train 2/2: SDMA-T, identical size, the same {updates} updates")
    runs["SDMA-T"] = train(data_bin, out / "sdma", ["--arch", "sdma_transformer_iwslt_de_en_tiny",
                                                    "--criterion", "sdma_label_smoothed_cross_entropy"],
                           args.seed, "--max-update", str(updates), "--max-epoch", "1000")

    from attention_redundancy import attention_redundancy

    rows, results = [], {"updates": updates, "data": str(data_bin), "minutes": args.minutes}
    for name, subdir in (("V-T", "vanilla"), ("SDMA-T", "sdma")):
        ckpt = out / subdir / "checkpoint_last.pt"
        stage(f"decode: fairseq-generate {name} (beam 5) + sacreBLEU")
        gen = generate(data_bin, ckpt, out / subdir)
        bleu = sacrebleu_score(gen["hypotheses"], references)
        stage(f"analysis: attention redundancy of {name}")
        redundancy = attention_redundancy(str(ckpt), data=str(data_bin), subset="test")
        row = {
            "model": name,
            "BLEU": bleu,
            "LR enc": redundancy["encoder_self"]["LR"],
            "HR enc": redundancy["encoder_self"]["HR"],
            "LR dec": redundancy["decoder_self"]["LR"],
            "HR dec": redundancy["decoder_self"]["HR"],
            "LR cross": redundancy["decoder_cross"]["LR"],
            "HR cross": redundancy["decoder_cross"]["HR"],
            "train words/s": train_words_per_second(runs[name]["log"]),
            "params": model_parameters(runs[name]["log"]),
        }
        rows.append(row)
        results[name] = {**row, "redundancy": redundancy, "generate_sentences_per_second":
                         gen["sentences_per_second"], "train_seconds": runs[name]["seconds"],
                         "sample_translations": gen["hypotheses"][:5]}

    stage("figure: clustering probabilities, semantic mask and attention (Fig. 6 style)")
    figure = out / "fig6_sdma.png"
    run_streaming([sys.executable, REPO / "scripts" / "plot_sdma_attention.py", "--path",
                   out / "sdma" / "checkpoint_last.pt", data_bin, "--subset", "test", "--index", "0",
                   "--layer", "-1", "--head", "0", "--vanilla-path", out / "vanilla" / "checkpoint_last.pt",
                   "--out", figure], out / "figure.log")
    results["figure"] = str(figure)
    print_table(rows, list(rows[0].keys()),
                f"SDMA quickstart: Ding de->en, {updates} updates each, test set of {len(references)} pairs")
    write_json(out / "results.json", results)
    stage(f"wrote {out / 'results.json'} and {figure}")


if __name__ == "__main__":
    main()
