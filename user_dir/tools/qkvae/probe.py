"""The embedding-space test of QKVAE's Table 2 (Felhi et al., NAACL 2022, arXiv:2205.05943, Section 5.2).

For (target, sem_src, syn_src) triplets -- sem_src a paraphrase of target, syn_src a
syntactically similar but semantically different sentence -- and each latent representation,
the probability x 100 that target's posterior mean is closer (L2) to sem_src's than to
syn_src's (ties count as "not closer"). A semantic latent should score high, a syntactic one
low (paper, test set: QKVAE z_sem 89.2, z_syn 26.4; ADVAE's slots about 40).

Reported latents: every latent of the model (QKVAE: ``z_syn``, ``z_sem``; ADVAE: ``z``; any other
sentence VAE, e.g. Optimus: its latents whole) and, for latents made of several slots, every
slot separately (``z[0]`` .. ``z[L-1]``, ``z_sem[l]``). The paper picks ADVAE's semantic (resp.
syntactic) variable as the slot with the highest (resp. lowest) score on the development set:
with ``--dev-triplets`` the slots are chosen on those and scored on ``--triplets`` (disjoint
sets; ``slot_selection`` names the chosen slots and their test scores); without, the choice is
made on the scored triplets themselves and the JSON says so (``selected_on``). Every score
comes with a 95% percentile-bootstrap interval over triplets (1,000 resamples, ``ci95``).

Input: a UTF-8 TSV, one triplet per line: ``target<TAB>semantic source<TAB>syntactic source``
(blank lines are skipped). Sentences are split on whitespace and looked up in the
checkpoint's dictionary, so they must be tokenised as the training data were (for a BART
vocabulary: ``python -m pipelines.data.bart_data tokenize``); unknown tokens become <unk> and
are counted in the output.

    qkvae-probe --checkpoint checkpoints/checkpoint_best.pt \\
        --data data-bin/paranmt --triplets test_triplets.tsv --json probe.json
"""

import argparse
import json
import os
import sys
from argparse import Namespace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from fairseq import checkpoint_utils
from fairseq.data import Dictionary, data_utils
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

from latent_core.errors import command_error
import user_dir  # noqa: F401  (registers the models; allow-lists checkpoint types)
from latent_core.safe_loading import model_config
from user_dir.sentence_vae.base import SentenceVAEModel

Triplet = Tuple[str, str, str]
FIELDS = ("target", "semantic source", "syntactic source")


class TripletFormatError(ValueError):
    """A malformed line of the triplet TSV (the message names the file and line number)."""


def read_triplets(path: str) -> List[Triplet]:
    """``target<TAB>sem_src<TAB>syn_src`` lines -> triplets; blank lines are skipped."""
    triplets: List[Triplet] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 3:
                raise TripletFormatError(
                    f"{path} line {number}: expected 3 tab-separated fields ({', '.join(FIELDS)}), "
                    f"got {len(fields)}"
                )
            for name, field in zip(FIELDS, fields):
                if not field.strip():
                    raise TripletFormatError(f"{path} line {number}: the {name} is empty")
            triplets.append((fields[0].strip(), fields[1].strip(), fields[2].strip()))
    if not triplets:
        raise TripletFormatError(f"{path}: no triplets")
    return triplets


def load_dictionary(data_dir: str = None, dict_path: str = None) -> Dictionary:
    """The checkpoint's dictionary: ``--dict FILE`` or ``DATA_DIR/dict.txt``."""
    if dict_path is None:
        if data_dir is None:
            raise ValueError("give --data DIR (with dict.txt) or --dict FILE")
        dict_path = os.path.join(data_dir, "dict.txt")
    if not os.path.isfile(dict_path):
        raise FileNotFoundError(f"dictionary {dict_path} not found (pass --dict FILE for another name)")
    return Dictionary.load(dict_path)


def _model_args(state) -> Namespace:
    model_cfg = model_config(state)
    if model_cfg is None:
        raise ValueError("the checkpoint has no model configuration (cfg.model / args)")
    if isinstance(model_cfg, Namespace):
        return Namespace(**vars(model_cfg))
    from omegaconf import OmegaConf

    return Namespace(**OmegaConf.to_container(model_cfg, resolve=True))


def load_model(checkpoint: str, dictionary: Dictionary, device: str = "cpu"):
    """Rebuild a ``qkvae`` / ``advae`` model from a fairseq checkpoint, in eval mode.

    The model is built directly from the checkpoint's model arguments (no task needed);
    ``bart_dir`` is ignored, the checkpoint's weights are loaded.
    """
    state = checkpoint_utils.load_checkpoint_to_cpu(checkpoint)
    args = _model_args(state)
    arch = getattr(args, "arch", None) or getattr(args, "_name", None)
    if arch not in ARCH_MODEL_REGISTRY:
        raise ValueError(f"{checkpoint}: unknown architecture {arch!r}")
    args.arch = arch
    args.bart_dir = args.bert_dir = args.gpt2_dir = None  # the checkpoint holds every weight
    ARCH_CONFIG_REGISTRY[arch](args)
    task = Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
    model = ARCH_MODEL_REGISTRY[arch].build_model(args, task)
    if not isinstance(model, SentenceVAEModel):
        raise ValueError(f"{checkpoint}: architecture {arch!r} is not a sentence VAE")
    model.load_state_dict(state["model"], strict=True, model_cfg=args)
    return model.to(device).eval()


def encode(dictionary: Dictionary, sentence: str) -> torch.Tensor:
    """Whitespace tokens + EOS (the training ``src`` format)."""
    return dictionary.encode_line(sentence, add_if_not_exist=False, append_eos=True).long()


@torch.no_grad()
def posterior_means(model, dictionary: Dictionary, sentences: Sequence[str], batch_size: int = 64,
                    device: str = "cpu") -> Dict[str, torch.Tensor]:
    """``{latent name: posterior means [N, D]}`` of ``sentences`` (in order)."""
    encoded = [encode(dictionary, s) for s in sentences]
    chunks: Dict[str, List[torch.Tensor]] = {name: [] for name in model.latent_sizes}
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start:start + batch_size]
        tokens = data_utils.collate_tokens(batch, dictionary.pad(), dictionary.eos(), left_pad=False)
        lengths = torch.tensor([t.numel() for t in batch])
        means, _ = model.encoder.posterior_parameters(tokens.to(device), lengths.to(device))
        for name in chunks:
            chunks[name].append(means[name].float().cpu())
    return {name: torch.cat(parts, dim=0) for name, parts in chunks.items()}


def latent_views(model) -> List[Tuple[str, str, slice]]:
    """``(label, latent name, dimensions)``: each latent whole, then each of its slots."""
    views = []
    slots_of = getattr(model, "latent_slots", None) or {name: (1, size) for name, size in model.latent_sizes.items()}
    for name, (slots, slot_dim) in slots_of.items():
        views.append((name, name, slice(0, slots * slot_dim)))
        if slots > 1:
            views += [(f"{name}[{l}]", name, slice(l * slot_dim, (l + 1) * slot_dim)) for l in range(slots)]
    return views


def _closer(target: torch.Tensor, sem: torch.Tensor, syn: torch.Tensor) -> torch.Tensor:
    """Per row of ``[N, D]`` tensors: ||target - sem||_2 < ||target - syn||_2 (ties: False)."""
    return (target - sem).norm(dim=-1) < (target - syn).norm(dim=-1)


def bootstrap_interval(hits: torch.Tensor, resamples: int = 1000, seed: int = 1, level: float = 0.95):
    """Percentile bootstrap interval (x100) of the mean of per-triplet 0/1 ``hits``."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, hits.numel(), (resamples, hits.numel()), generator=generator)
    means = 100.0 * hits.double()[picks].mean(1)
    tail = (1 - level) / 2
    return float(torch.quantile(means, tail)), float(torch.quantile(means, 1 - tail))


def score_views(model, dictionary: Dictionary, triplets: Sequence[Triplet], batch_size: int = 64,
                device: str = "cpu") -> Tuple[Dict[str, float], Dict[str, Tuple[float, float]], Dict[str, int]]:
    """(score, 95% bootstrap interval, size) of every latent view on ``triplets``."""
    n = len(triplets)
    sentences = [t[0] for t in triplets] + [t[1] for t in triplets] + [t[2] for t in triplets]
    means = posterior_means(model, dictionary, sentences, batch_size, device)
    scores, intervals, dims = {}, {}, {}
    for label, name, dims_slice in latent_views(model):
        m = means[name][:, dims_slice]
        hits = _closer(m[:n], m[n:2 * n], m[2 * n:])
        scores[label] = 100.0 * hits.double().mean().item()
        intervals[label] = bootstrap_interval(hits)
        dims[label] = dims_slice.stop - dims_slice.start
    return scores, intervals, dims


def probe(model, dictionary: Dictionary, triplets: Sequence[Triplet], batch_size: int = 64,
          device: str = "cpu", dev_triplets: Optional[Sequence[Triplet]] = None) -> dict:
    """The Table-2 scores of every latent view, with token statistics; multi-slot latents'
    semantic / syntactic slots chosen on ``dev_triplets`` (or on ``triplets`` when None)."""
    scores, intervals, dims = score_views(model, dictionary, triplets, batch_size, device)
    dev_scores = (score_views(model, dictionary, dev_triplets, batch_size, device)[0]
                  if dev_triplets is not None else None)
    choosing = dev_scores if dev_scores is not None else scores
    slots: Dict[str, List[str]] = {}
    for label, name, _ in latent_views(model):
        if label != name:
            slots.setdefault(name, []).append(label)
    selection = {}
    for name, labels in slots.items():
        semantic = max(labels, key=lambda k: choosing[k])
        syntactic = min(labels, key=lambda k: choosing[k])
        selection[name] = {"semantic": semantic, "syntactic": syntactic,
                           "semantic_score": scores[semantic], "syntactic_score": scores[syntactic]}
    sentences = [s for t in triplets for s in t]
    tokens = [encode(dictionary, s) for s in sentences]
    return {
        "num_triplets": len(triplets),
        "num_dev_triplets": len(dev_triplets) if dev_triplets is not None else 0,
        "estimator": "100 x share of triplets whose target posterior mean is closer (L2) to the semantic "
                     "source's than to the syntactic source's; ci95: percentile bootstrap over triplets, "
                     "1,000 resamples",
        "scores": scores,
        "ci95": intervals,
        "dims": dims,
        "dev_scores": dev_scores,
        "slot_selection": selection,
        "selected_on": "dev triplets" if dev_triplets is not None else "the scored triplets themselves",
        "tokens": int(sum(t.numel() - 1 for t in tokens)),
        "unknown_tokens": int(sum(int(t.eq(dictionary.unk()).sum()) for t in tokens)),
    }


def format_table(result: dict) -> str:
    lines = [
        f"P(target closer to sem_src than to syn_src) x 100, L2 between posterior means, "
        f"{result['num_triplets']} triplets ({result['unknown_tokens']}/{result['tokens']} tokens unknown)",
        f"{'latent':<12} {'dim':>6} {'score':>7}  95% interval",
    ]
    for label, score in result["scores"].items():
        low, high = result["ci95"][label]
        lines.append(f"{label:<12} {result['dims'][label]:>6} {score:>7.1f}  {low:.1f}-{high:.1f}")
    for name, chosen in result["slot_selection"].items():
        lines.append(f"{name}: most semantic slot {chosen['semantic']} ({chosen['semantic_score']:.1f}), most "
                     f"syntactic slot {chosen['syntactic']} ({chosen['syntactic_score']:.1f}), chosen on "
                     f"{result['selected_on']}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="fairseq checkpoint of a qkvae/advae model")
    parser.add_argument("--data", help="the binarised data directory (its dict.txt is the model's dictionary)")
    parser.add_argument("--dict", help="the dictionary file, instead of DATA/dict.txt")
    parser.add_argument("--triplets", required=True, help="TSV: target<TAB>semantic source<TAB>syntactic source")
    parser.add_argument("--dev-triplets", help="TSV of development triplets (disjoint from --triplets) on which "
                                               "multi-slot latents' semantic/syntactic slots are chosen")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    return args


def run(args: argparse.Namespace) -> dict:
    """The probe of parsed ``args``: prints the table, writes ``--json``, returns the result."""
    triplets = read_triplets(args.triplets)
    dev_triplets = read_triplets(args.dev_triplets) if args.dev_triplets else None
    if dev_triplets is not None and set(dev_triplets) & set(triplets):
        raise ValueError(f"{args.dev_triplets} and {args.triplets} share "
                         f"{len(set(dev_triplets) & set(triplets))} triplet(s): slots must be chosen on other data")
    dictionary = load_dictionary(args.data, args.dict)
    model = load_model(args.checkpoint, dictionary, args.device)
    result = probe(model, dictionary, triplets, args.batch_size, args.device, dev_triplets)
    result = {"checkpoint": args.checkpoint, "arch": model.args.arch, "triplets_file": args.triplets,
              "dev_triplets_file": args.dev_triplets, **result}
    print(format_table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result


def main(argv=None) -> int:
    """The ``qkvae-probe`` command: 0, or 2 after a one-line error for a bad triplet file,
    dictionary or checkpoint."""
    args = parse_args(argv)
    try:
        run(args)
    except (TripletFormatError, FileNotFoundError, ValueError) as err:
        return command_error("qkvae_probe", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
