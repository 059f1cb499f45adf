"""What loading the plugin costs a model that does not use it: ``fairseq-train --arch transformer``
(fairseq's own model) with and without ``--user-dir user_dir``, same data, seed and options.

    python -m benchmarks.plugin_overhead --data DATA_BIN [--epochs 10] [--rounds 3] [--json PATH]

Each round runs both, in alternating order, and records the wall time of the whole command
(import, data loading, every epoch's training and validation, exit) and the final validation loss.
The table gives the median wall time of each and the per-round ratio plugin / plain (min, median,
max); the losses must be equal (the plugin changes nothing in a continuous run:
``user_dir/exact_resume.py``). Without ``--data`` it prepares 400 Ding dictionary pairs
(``prepare-ding``, ``prepare-translation``; needs ``apt-get install trans-de-en``) under ``--out-dir``.
The options are fairseq's defaults but the sizes (a 1-layer, 32-wide transformer) and
``--max-tokens 800``, so per-epoch overheads show and the model's compute does not hide them.
"""

import argparse
import re
import statistics
from pathlib import Path
from typing import Dict, List

from pipelines.runs import USER_DIR, console_script, fairseq_train, print_table, ratio_stats, run_streaming, \
    write_json

TINY_TRANSFORMER = ["--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
                    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
                    "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]


def prepare_data(out_dir: Path) -> Path:
    """400 Ding pairs (at most 8 words), a joint 300-piece sentencepiece, fairseq binaries."""
    data_bin = out_dir / "prep" / "bin"
    if (data_bin / "train.de-en.de.bin").is_file():
        return data_bin
    run_streaming([console_script("prepare-ding"), "--out-dir", out_dir / "all", "--max-words", 8,
                   "--valid-size", 50, "--test-size", 50], out_dir / "logs" / "prepare-ding.log", echo=False)
    raw = out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, keep in (("train", 400), ("valid", None), ("test", None)):
        for lang in ("de", "en"):
            lines = (out_dir / "all" / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(True)
            (raw / f"{split}.{lang}").write_text("".join(lines[:keep]), encoding="utf-8")
    run_streaming([console_script("prepare-translation"), "--train-prefix", raw / "train", "--valid-prefix",
                   raw / "valid", "--test-prefix", raw / "test", "--src", "de", "--tgt", "en", "--joint",
                   "--vocab-size", 300, "--out-dir", out_dir / "prep", "--workers", 1],
                  out_dir / "logs" / "prepare-translation.log", echo=False)
    return data_bin


def train_once(data: Path, epochs: int, plugin: bool, out_dir: Path, round_index: int) -> Dict:
    name = ("plugin" if plugin else "plain") + f"_round{round_index}"
    arguments = [data, "--task", "translation", *TINY_TRANSFORMER, "--optimizer", "adam", "--lr", "1e-3",
                 "--max-tokens", "800", "--max-epoch", epochs, "--seed", "1", "--cpu", "--no-progress-bar",
                 "--no-save", "--log-format", "simple", "--save-dir", out_dir / "checkpoints" / name]
    if plugin:
        arguments += ["--user-dir", USER_DIR]
    run = fairseq_train(arguments, out_dir / "logs" / f"{name}.log")
    losses = re.findall(r"\| valid on 'valid' subset \| loss ([0-9.]+)", run["log"])
    updates = re.findall(r"num_updates (\d+)", run["log"])
    if not losses or not updates:
        raise SystemExit(f"no validation loss in {out_dir / 'logs' / f'{name}.log'}")
    return {"seconds": run["seconds"], "valid_loss": float(losses[-1]), "updates": int(updates[-1])}


def measure(data: Path, epochs: int, rounds: int, out_dir: Path) -> Dict:
    plain: List[Dict] = []
    plugin: List[Dict] = []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)  # alternate: drift in machine load hits both
        for with_plugin in order:
            (plugin if with_plugin else plain).append(train_once(data, epochs, with_plugin, out_dir, r))
    ratios = ratio_stats([b["seconds"] / a["seconds"] for a, b in zip(plain, plugin)])
    same_losses = all(a["valid_loss"] == b["valid_loss"] for a, b in zip(plain, plugin))
    return {"epochs": epochs, "rounds": rounds, "updates": plain[0]["updates"], "plain": plain, "plugin": plugin,
            "ratio_plugin_over_plain": ratios, "same_valid_loss": same_losses}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="a binarised de-en translation directory (default: prepare one)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/plugin_overhead"))
    parser.add_argument("--json", type=Path, help="default: OUT_DIR/plugin_overhead.json")
    args = parser.parse_args(argv)
    for name in ("epochs", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    data = args.data or prepare_data(args.out_dir / "data")
    result = measure(data, args.epochs, args.rounds, args.out_dir)
    rows = [{"run": name, "wall s (median)": statistics.median(r["seconds"] for r in result[name]),
             "valid loss": result[name][-1]["valid_loss"]} for name in ("plain", "plugin")]
    ratios = result["ratio_plugin_over_plain"]
    print_table(rows, ["run", "wall s (median)", "valid loss"],
                f"fairseq-train --arch transformer, {args.epochs} epochs ({result['updates']} updates), "
                f"{args.rounds} rounds: without / with --user-dir user_dir")
    print(f"plugin / plain wall time: median {ratios['median']:.3f} (min {ratios['min']:.3f}, max {ratios['max']:.3f}); "
          f"validation losses {'identical' if result['same_valid_loss'] else 'DIFFER'}")
    write_json(args.json or args.out_dir / "plugin_overhead.json", result)
    return 0 if result["same_valid_loss"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
