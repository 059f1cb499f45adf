"""The ESPnet ASR recipe stages on synthetic Mandarin speech: SDMA-T vs a vanilla transformer.

ESPnet's ``asr.sh`` and Kaldi's ``utils/`` are not in the pip wheel, so this driver runs
the same stages through ESPnet's own Python entry points (``espnet2.bin.*``, via the
plugin's launchers), one subprocess per stage as ``asr.sh`` does:

1. ``data``    synthetic Mandarin corpus (``pipelines.data.mandarin_synth``: real
               Chinese UI-translation sentences spoken by espeak-ng, several voices,
               speeds and pitches, 16 kHz; train/dev/test split by sentence), as
               Kaldi-style data directories (wav.scp, text, utt2spk, spk2utt)
2. ``tokens``  character token list (``espnet2.bin.tokenize_text --token_type char``)
3. ``stats``   shapes and feature statistics (``asr_train --collect_stats true``)
4. ``train``   one model per system (``espnet_plugin.bin.asr_train``)
5. ``decode``  joint CTC/attention beam search (``espnet_plugin.bin.asr_inference``)
6. ``score``   character error rate with the ``editdistance`` package

It prints a CER table and writes ``results.json`` in the work directory. The corpus is
small and synthetic: the numbers show the pipeline working and compare two models of
identical size on the same data; they are not Aishell-1 results.

    python examples/aishell_sdma/asr1/run_synthetic.py --work-dir outputs/aishell_sdma_synthetic

(the recipe's file is a thin wrapper of :func:`main`; the configurations stay in the recipe's
``conf/synthetic``; stage commands run in the current directory).
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

from latent_core.errors import option_flag
from pipelines import kaldi_data as kaldi  # the Kaldi data-directory reader (toolkit-free)
from experiments.bleu_bootstrap import paired_differences
from pipelines.runs import REPO_ROOT, run_streaming

RECIPE = REPO_ROOT / "examples" / "aishell_sdma" / "asr1"  # its conf/synthetic/*.yaml are the defaults
STAGES = ("data", "tokens", "stats", "train", "decode", "score")
SPLITS = ("train", "dev", "test")
# system name -> training config (conf/synthetic/), identical sizes
SYSTEMS = {"sdma": "train_asr_sdma_transformer.yaml", "vanilla": "train_asr_transformer.yaml",
           "sdma_conformer": "train_asr_sdma_conformer.yaml", "conformer": "train_asr_conformer.yaml"}
DEFAULT_SYSTEMS = ("sdma", "vanilla")  # the reported transformer pair; add the Conformer pair with --systems
PAIRS = (("sdma", "vanilla"), ("sdma_conformer", "conformer"))  # the CER differences the score stage reports


class PipelineError(RuntimeError):
    """A stage failed or its inputs are unusable; the message names the file or option."""


# ----------------------------------------------------------------------------- checks


def check_data_dir(data_dir: Path) -> int:
    """Validate an ESPnet data directory (wav.scp and text, utt2spk when present, read as ESPnet
    reads them, with the same utterance ids; every audio file exists); returns the number of
    utterances."""
    try:
        data = kaldi.read_data_dir(data_dir)
    except kaldi.KaldiDataDirError as error:
        raise PipelineError(str(error)) from error
    for uttid, wav in data.wav_scp.items():
        if not Path(wav).is_file():
            raise PipelineError(f"{data_dir / 'wav.scp'}: {uttid}: audio file {wav} does not exist")
    return len(data)


def check_model_files(asr_train_config: Path, asr_model_file: Path) -> None:
    """Refuse a model file whose vocabulary or feature size disagrees with its config."""
    import torch
    import yaml

    for path in (asr_train_config, asr_model_file):
        if not Path(path).is_file():
            raise PipelineError(f"{path}: missing")
    with open(asr_train_config, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    token_list = config.get("token_list")
    if isinstance(token_list, str):
        token_list = Path(token_list).read_text(encoding="utf-8").split()
    state = torch.load(asr_model_file, map_location="cpu", weights_only=True)
    for key in ("ctc.ctc_lo.weight", "decoder.output_layer.weight"):
        if key in state and state[key].shape[0] != len(token_list):
            raise PipelineError(
                f"{asr_model_file}: {key} has {state[key].shape[0]} outputs but the token list of "
                f"{asr_train_config} has {len(token_list)} tokens: the token list does not match the model"
            )
    n_mels = (config.get("frontend_conf") or {}).get("n_mels", 80)
    conv = state.get("encoder.embed.conv.0.weight")
    linear = state.get("encoder.embed.out.0.weight")
    if conv is not None and linear is not None:
        channels = conv.shape[0]
        freq = linear.shape[1] // channels
        expected = ((n_mels - 1) // 2 - 1) // 2
        if freq != expected:
            raise PipelineError(
                f"{asr_model_file}: the conv2d subsampling was trained on features whose size gives "
                f"{freq} frequency bins after subsampling, but frontend_conf.n_mels={n_mels} in "
                f"{asr_train_config} gives {expected}: the feature dimension does not match the config"
            )


# ----------------------------------------------------------------------------- running


def run(cmd: Sequence[str], log: Path) -> None:
    """Run one stage command through the drivers' runner (its output in ``log``, nothing echoed);
    PipelineError with the command and the log's tail when it fails."""
    print(f"[run] {' '.join(map(str, cmd))}\n      log: {log}", flush=True)
    try:
        run_streaming(cmd, log, echo=False)
    except SystemExit as failure:
        raise PipelineError(str(failure)) from None


def python_module(args, module: str) -> List[str]:
    return [args.python, "-m", module]


def data_args(data: Path, split: str, prefix: str) -> List[str]:
    return [f"--{prefix}_data_path_and_name_and_type", f"{data / split / 'wav.scp'},speech,sound",
            f"--{prefix}_data_path_and_name_and_type", f"{data / split / 'text'},text,text"]


def stage_data(args, work: Path) -> Dict[str, int]:
    from pipelines.data import mandarin_synth

    mandarin_synth.build_corpus(work / "corpus", num_sentences=args.num_sentences,
                                speakers_per_sentence=args.speakers_per_sentence, seed=args.seed,
                                jobs=args.jobs)
    return {split: check_data_dir(work / "corpus" / "data" / split) for split in SPLITS}


def stage_tokens(args, work: Path) -> None:
    data = work / "corpus" / "data"
    run(python_module(args, "espnet2.bin.tokenize_text") + [
        "--token_type", "char", "--input", data / "train" / "text", "--output", work / "tokens.txt",
        "--field", "2-", "--cleaner", "none", "--g2p", "none", "--write_vocabulary", "true",
        "--add_symbol", "<blank>:0", "--add_symbol", "<unk>:1", "--add_symbol", "<sos/eos>:-1",
    ], work / "logs" / "tokens.log")


def common_train_args(args, work: Path) -> List[str]:
    return ["--use_preprocessor", "true", "--token_type", "char", "--token_list", work / "tokens.txt",
            "--non_linguistic_symbols", "none", "--cleaner", "none", "--g2p", "none",
            "--ngpu", args.ngpu, "--num_workers", "0", "--seed", args.seed, "--use_tensorboard", "false"]


def stage_stats(args, work: Path) -> None:
    data, stats = work / "corpus" / "data", work / "stats"
    run(python_module(args, "espnet_plugin.bin.asr_train") + common_train_args(args, work) + [
        "--collect_stats", "true", "--config", args.conf_dir / SYSTEMS["sdma"],
        "--train_shape_file", data / "train" / "wav.scp", "--valid_shape_file", data / "dev" / "wav.scp",
        "--output_dir", stats, "--batch_size", "8",
    ] + data_args(data, "train", "train") + data_args(data, "dev", "valid"), work / "logs" / "stats.log")
    vocab = len((work / "tokens.txt").read_text(encoding="utf-8").split())
    for split in ("train", "valid"):  # as asr.sh: text shapes carry the vocabulary size
        lines = (stats / split / "text_shape").read_text(encoding="utf-8").splitlines()
        (stats / split / "text_shape.char").write_text("".join(f"{line},{vocab}\n" for line in lines))


def stage_train(args, work: Path, system: str) -> None:
    data, stats = work / "corpus" / "data", work / "stats"
    extra = ["--max_epoch", args.max_epoch] if args.max_epoch else []
    run(python_module(args, "espnet_plugin.bin.asr_train") + common_train_args(args, work) + [
        "--config", args.conf_dir / SYSTEMS[system], "--output_dir", work / "exp" / system,
        "--frontend_conf", "fs=16k", "--normalize", "global_mvn",
        "--normalize_conf", f"stats_file={stats / 'train' / 'feats_stats.npz'}",
        "--train_shape_file", stats / "train" / "speech_shape",
        "--train_shape_file", stats / "train" / "text_shape.char",
        "--valid_shape_file", stats / "valid" / "speech_shape",
        "--valid_shape_file", stats / "valid" / "text_shape.char",
        "--fold_length", "80000", "--fold_length", "150",  # asr.sh's raw-speech / text fold lengths
        "--resume", "true", "--use_amp", str(args.use_amp).lower(),
    ] + extra + data_args(data, "train", "train") + data_args(data, "dev", "valid"),
        work / "logs" / f"train_{system}.log")


def trained_model(work: Path, system: str) -> Path:
    exp = work / "exp" / system
    for name in ("valid.acc.ave.pth", "valid.acc.best.pth"):
        if (exp / name).exists():
            return exp / name
    raise PipelineError(f"{exp}: no valid.acc.ave.pth / valid.acc.best.pth; run the train stage first")


def stage_decode(args, work: Path, system: str) -> None:
    exp, data = work / "exp" / system, work / "corpus" / "data"
    model = trained_model(work, system)
    check_model_files(exp / "config.yaml", model)
    out = exp / "decode_test"
    shutil.rmtree(out, ignore_errors=True)
    run(python_module(args, "espnet_plugin.bin.asr_inference") + [
        "--ngpu", args.ngpu, "--batch_size", "1", "--config", args.conf_dir / "decode_asr.yaml",
        "--data_path_and_name_and_type", f"{data / 'test' / 'wav.scp'},speech,sound",
        "--key_file", data / "test" / "wav.scp",
        "--asr_train_config", exp / "config.yaml", "--asr_model_file", model, "--output_dir", out,
    ], work / "logs" / f"decode_{system}.log")


def read_kaldi_text(path: Path) -> Dict[str, str]:
    """``{uttid: characters}`` of a Kaldi ``text`` file, spaces between tokens removed."""
    try:
        table = kaldi.read_kaldi_table(path, value_required=False, what="transcript")
    except kaldi.KaldiDataDirError as error:
        raise PipelineError(str(error)) from error
    return {uttid: text.replace(" ", "") for uttid, text in table.items()}


def utterance_errors(refs: Dict[str, str], hyps: Dict[str, str]) -> np.ndarray:
    """``[N, 2]`` int64: character edits and reference characters of each test utterance (sorted ids); a missing
    hypothesis counts as empty."""
    import editdistance

    return np.array([[editdistance.eval(refs[uttid], hyps.get(uttid, "")), len(refs[uttid])]
                     for uttid in sorted(refs)], dtype=np.int64).reshape(-1, 2)


def character_error_rate(refs: Dict[str, str], hyps: Dict[str, str]) -> Dict[str, float]:
    """Corpus CER (edits / reference characters) and sentence error rate; missing hypotheses count as empty."""
    edits, chars = utterance_errors(refs, hyps).sum(0).tolist()
    wrong = sum(hyps.get(uttid, "") != ref for uttid, ref in refs.items())
    return {"cer": 100.0 * edits / max(chars, 1), "ser": 100.0 * wrong / max(len(refs), 1),
            "edits": edits, "ref_chars": chars, "utterances": len(refs)}


def paired_cer_bootstrap(errors: Dict[str, np.ndarray], resamples: int, seed: int = 1,
                         level: float = 0.95) -> Dict[str, dict]:
    """Percentile intervals of each system's corpus CER (%) and of ``SDMA - its vanilla pair`` from ``resamples``
    resamples of the test utterances, the same utterances for every system (paired).

    ``errors``: per system, :func:`utterance_errors` over the same utterances. Returns ``{"systems": {name:
    [low, high]}, "comparisons": {"a - b": {"difference", "interval", "share_of_resamples_above_zero"}}}``."""
    sizes = {len(e) for e in errors.values()}
    if len(sizes) != 1 or 0 in sizes:
        raise PipelineError(f"CER bootstrap: the systems were scored on {sorted(sizes)} utterances; "
                            "decode every system on the same, non-empty test set")
    n = sizes.pop()
    index = np.random.default_rng(seed).integers(0, n, (resamples, n))
    cer = {}
    for system, e in errors.items():
        totals = e[index].sum(1)  # [resamples, 2]
        cer[system] = 100.0 * totals[:, 0] / np.maximum(totals[:, 1], 1)
    low, high = 100 * (1 - level) / 2, 100 * (1 + level) / 2
    points = {s: 100.0 * e[:, 0].sum() / max(e[:, 1].sum(), 1) for s, e in errors.items()}
    return {"systems": {s: [float(np.percentile(v, low)), float(np.percentile(v, high))] for s, v in cer.items()},
            "comparisons": paired_differences(cer, points, PAIRS, level), "resamples": resamples, "level": level}


def stage_score(args, work: Path, systems: Sequence[str]) -> Dict[str, dict]:
    refs = read_kaldi_text(work / "corpus" / "data" / "test" / "text")
    results, errors = {}, {}
    for system in systems:
        hyp_file = work / "exp" / system / "decode_test" / "1best_recog" / "text"
        if not hyp_file.is_file():
            raise PipelineError(f"{hyp_file}: missing; run the decode stage for {system}")
        hyps = read_kaldi_text(hyp_file)
        results[system] = character_error_rate(refs, hyps)
        errors[system] = utterance_errors(refs, hyps)
    bootstrap = paired_cer_bootstrap(errors, args.bootstrap_resamples)
    for system, interval in bootstrap["systems"].items():
        results[system]["cer_interval"] = interval
    return {"systems": results, "comparisons": bootstrap["comparisons"],
            "bootstrap": {"resamples": bootstrap["resamples"], "level": bootstrap["level"], "unit": "utterance"}}


def format_results(scored: Dict[str, dict]) -> str:
    level = round(100 * scored["bootstrap"]["level"])
    lines = [f"{'system':<14} {'CER %':>7} {f'{level}% interval':>15} {'SER %':>7} {'edits':>7} {'chars':>7} "
             f"{'utts':>5}"]
    for system, r in scored["systems"].items():
        low, high = r["cer_interval"]
        lines.append(f"{system:<14} {r['cer']:7.2f} {low:7.2f}-{high:<7.2f} {r['ser']:7.2f} {r['edits']:7d} "
                     f"{r['ref_chars']:7d} {r['utterances']:5d}")
    for name, c in scored["comparisons"].items():
        lines.append(f"{name}: {c['difference']:+.2f} CER points ({c['interval'][0]:+.2f} to {c['interval'][1]:+.2f}; "
                     f"{100 * c['share_of_resamples_above_zero']:.1f}% of resamples above 0)")
    lines.append(f"paired bootstrap over the {next(iter(scored['systems'].values()))['utterances']} test utterances, "
                 f"{scored['bootstrap']['resamples']} resamples, percentile intervals")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=Path("outputs") / "aishell_sdma_synthetic")
    parser.add_argument("--conf-dir", type=Path, default=RECIPE / "conf" / "synthetic",
                        help="directory with train_asr_sdma_transformer.yaml, train_asr_transformer.yaml, "
                             "decode_asr.yaml")
    parser.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=list(SYSTEMS),
                        help="default: %(default)s (SDMA-T and V-T); conformer, sdma_conformer: the Conformer encoder")
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--speakers-per-sentence", type=int, default=2)
    parser.add_argument("--max-epoch", type=int, default=None, help="override the configs' max_epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="parallel speech synthesis jobs")
    parser.add_argument("--stage", choices=STAGES, default=STAGES[0], help="first stage to run")
    parser.add_argument("--stop-stage", choices=STAGES, default=STAGES[-1], help="last stage to run")
    parser.add_argument("--bootstrap-resamples", type=int, default=10000,
                        help="resamples of the test utterances for the CER intervals (paired bootstrap)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with ESPnet and this repo")
    parser.add_argument("--ngpu", type=int, choices=(0, 1), default=0,
                        help="GPUs of every ESPnet stage (its --ngpu): statistics, training, decoding")
    parser.add_argument("--use-amp", action="store_true",
                        help="train with ESPnet's --use_amp true (CUDA autocast + GradScaler; needs --ngpu 1)")
    args = parser.parse_args(argv)
    for name in ("num_sentences", "speakers_per_sentence", "jobs", "bootstrap_resamples"):
        if getattr(args, name) < 1:
            parser.error(f"{option_flag(name)} must be >= 1")
    if args.use_amp and args.ngpu == 0:
        parser.error("--use-amp needs --ngpu 1 (ESPnet's mixed precision runs on CUDA)")
    if args.max_epoch is not None and args.max_epoch < 1:
        parser.error("--max-epoch must be >= 1")
    # the chosen systems' configs, the SDMA one (its --collect_stats gives every system's feature statistics)
    for name in dict.fromkeys([SYSTEMS[s] for s in args.systems] + [SYSTEMS["sdma"], "decode_asr.yaml"]):
        if not (args.conf_dir / name).is_file():
            parser.error(f"--conf-dir {args.conf_dir}: {name} is missing")
    if STAGES.index(args.stage) > STAGES.index(args.stop_stage):
        parser.error(f"--stage {args.stage} comes after --stop-stage {args.stop_stage}")
    return args


def main(argv=None) -> int:
    """Command line: 0, or 1 after one ``error: ...`` line when a stage fails."""
    args = parse_args(argv)
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    selected = STAGES[STAGES.index(args.stage): STAGES.index(args.stop_stage) + 1]
    timings = {}
    try:
        for stage in selected:
            start = time.time()
            print(f"=== stage {stage}", flush=True)
            if stage == "data":
                print("utterances per split:", stage_data(args, work))
            elif stage == "tokens":
                stage_tokens(args, work)
            elif stage == "stats":
                stage_stats(args, work)
            elif stage in ("train", "decode"):
                for system in args.systems:
                    (stage_train if stage == "train" else stage_decode)(args, work, system)
                    timings[f"{stage}_{system}_s"] = round(time.time() - start, 1)
                    start = time.time()
                continue
            elif stage == "score":
                scored = stage_score(args, work, args.systems)
                print(format_results(scored))
                summary = {"results": scored["systems"], "comparisons": scored["comparisons"],
                           "bootstrap": scored["bootstrap"], "timings": timings,
                           "options": {k: str(v) for k, v in vars(args).items()}}
                (work / "results.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
                print(f"wrote {work / 'results.json'}")
            timings[f"{stage}_s"] = round(time.time() - start, 1)
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
