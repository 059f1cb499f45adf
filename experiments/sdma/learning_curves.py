"""Learning curves of V-T and SDMA-T in both readings (command ``sdma-learning-curves``): when SDMA pays off, and why.

The systems, data, model size and optimisation of ``sdma-readings-runs`` (the demo's: Table I's tiny width,
2+2 layers, joint 2k sentencepiece, Ding de->en), each trained from ``--seeds`` seeds to ``--updates``
(default 4,000) in segments of ``--segment`` updates (``fairseq-train --max-update END`` resuming its
``checkpoint_last.pt``; a resumed run is bit-identical to a continuous one), the systems taking turns segment by
segment (so wherever the runs stop, a seed's systems have about the same number of updates). Recorded:

* every ``--record-every`` updates (fairseq's ``--validate-interval-updates``): validation cross-entropy alone
  (fairseq's ``nll_loss``: no label smoothing, no regularisers), in bits per target token;
* at the end of every segment, from its checkpoint:

  - BLEU (sacreBLEU 13a, detokenised) of beam-5 ``fairseq-generate`` hypotheses of the test split, with paired
    percentile bootstrap intervals of each SDMA-T reading against V-T (one resample of the test sentences shared
    by every run; a system's BLEU is its seed mean);
  - per attention type and layer, on the first ``--diagnostic-sentences`` test sentences (teacher-forced,
    eval mode): the mean entropy of the attention rows (bits), the share of rows with more than 0.9 of their
    mass on one key (collapse; ``latent_core.redundancy.attention_focus``), LR/HR, and for SDMA-T the mean
    max_c p(c|z) of the feature GMMs (hardness);
  - per encoder layer, the size of the self-attention's scores (eval mode): mean query and key norms and the
    mean spread (standard deviation over real keys) of a row's scores q.k / sqrt(d_k) (``encoder_query_scale``);
  - for SDMA-T, the regularisers' share of the gradient on the parameters they share with L_CE (every parameter
    outside the SDMA cores): over ``--gradient-batches`` training batches in training mode (noise and dropout
    on, seed fixed), ||g_reg|| / (||g_CE|| + ||g_reg||) with g the gradients of the two parts of eq. (24) as
    the criterion adds them (``loss_parts``), and their cosine; and per part of eq. (24) and encoder layer its
    derivative along a uniform scaling of the query projection, <dL/dW_q, W_q> (``query_pull``: negative where
    the part grows the queries).

``--systems`` also takes two ablations of the ``authors`` reading, beside the three default systems:
``'SDMA-T authors no-Dxq'`` (lambda_x = 0), ``'SDMA-T authors no-noise'`` (``--sdma-noise-var 0``) and
``'SDMA-T authors paper-GMM-init'`` (``--sdma-gmm-init paper``).

Every finished segment is kept (``OUT/<system>/seed<k>/at-<updates>.json``) and reused, so the runs may span
sessions; ``--plot-only`` redraws the figure and table from the kept JSONs. Output: ``OUT/results.json`` (per run
and update, and the seed means with the bootstrap intervals), a table, and ``OUT/learning_curves.png``
(curves per system, the band spans the seeds).

    sdma-learning-curves --out-dir outputs/sdma_learning_curves                 # 3 systems x seeds 1 2, 4,000 updates
    sdma-learning-curves --out-dir outputs/sdma_learning_curves --seeds 1       # seed 1 only
    sdma-learning-curves --out-dir outputs/sdma_learning_curves --plot-only     # table and figure of what is there
    sdma-learning-curves --out-dir outputs/sdma_learning_curves --seeds 1 --updates 1000 --systems 'SDMA-T authors no-Dxq'
"""

import argparse
import json
import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from latent_core.errors import option_flag
from latent_core.redundancy import ATTENTION_TYPES, COLLAPSE_PEAK
from pipelines.data import ding
from experiments.bleu_bootstrap import corpus_bleu_of, paired_bootstrap_by_seed, sentence_statistics
from pipelines.runs import USER_DIR, console_script, generate, last_num_updates, print_table, run_streaming, slug
from pipelines.runs import stage, write_json
from experiments.sdma import quickstart
from experiments.sdma.readings_runs import ARCH, SYSTEMS

# one change to a reading, to test a reason the default runs suggest (not among the defaults; --systems)
ABLATIONS = {
    "SDMA-T authors no-Dxq": ["--sdma-reading", "authors", "--sdma-dxq-weight", "0"],
    "SDMA-T authors no-noise": ["--sdma-reading", "authors", "--sdma-noise-var", "0"],
    "SDMA-T authors paper-GMM-init": ["--sdma-reading", "authors", "--sdma-gmm-init", "paper"],
}
RUN_SYSTEMS = {**SYSTEMS, **ABLATIONS}
DEFAULT_SYSTEMS = ["V-T", "SDMA-T authors", "SDMA-T paper"]

VALID_LINE = re.compile(r"\| valid on 'valid' subset \|.*?\| nll_loss ([-+0-9.eE]+|nan|inf) \|.*?\| num_updates (\d+)")


class LearningCurvesError(ValueError):
    """Impossible options or kept results that do not match them."""


# ----------------------------------------------------------------------------
# Training in segments
# ----------------------------------------------------------------------------


SAVED = re.compile(r"Saved checkpoint \S*checkpoint_(?:last|best)\.pt \(epoch \d+ @ (\d+) updates")


def checkpoint_updates(save_dir: Path) -> int:
    """Updates of ``save_dir/checkpoint_last.pt``: the last save its training logs report (fairseq writes
    checkpoint_last at every save; a log cut short after it trained further saved nothing more); 0 without one."""
    if not (save_dir / "checkpoint_last.pt").exists():
        return 0
    saves = [int(u) for log in save_dir.glob("train-*.log") for u in SAVED.findall(log.read_text(errors="replace"))]
    return max(saves, default=0)


def train_to(system: str, seed: int, data_bin: Path, save_dir: Path, end: int, record_every: int) -> None:
    """``fairseq-train`` of ``system`` to update ``end``, resuming ``checkpoint_last.pt``; validation every
    ``record_every`` updates and at the end only (not at epoch ends), one checkpoint at the end."""
    start = checkpoint_updates(save_dir)
    if start >= end:
        return
    save_dir.mkdir(parents=True, exist_ok=True)
    log_path = save_dir / f"train-{len(list(save_dir.glob('train-*.log'))) + 1}.log"
    cmd = [console_script("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--task", "translation",
           *ARCH, *RUN_SYSTEMS[system], *quickstart.MODEL_SIZE, *quickstart.OPTIMIZATION, "--seed", seed, "--cpu",
           "--save-dir", save_dir, "--no-epoch-checkpoints", "--save-interval", 1_000_000,
           "--validate-interval", 1_000_000, "--validate-interval-updates", record_every,
           "--log-format", "simple", "--log-interval", 50, "--no-progress-bar",
           "--max-update", end, "--max-epoch", 100_000]
    stage(f"{system} seed {seed}: fairseq-train {start} -> {end} updates ({log_path})")
    run = run_streaming(cmd, log_path, echo_filter=r"\| valid \|")
    reached = last_num_updates(run["log"])
    if reached != end:
        raise SystemExit(f"{log_path}: training stopped at update {reached}, expected {end}")


def validation_curve(save_dir: Path) -> Dict[int, float]:
    """``{update: validation nll_loss (bits per target token)}`` of every training log of a run."""
    curve: Dict[int, float] = {}
    for log in sorted(save_dir.glob("train-*.log")):
        for nll, update in VALID_LINE.findall(log.read_text(errors="replace")):
            curve[int(update)] = float(nll)
    return dict(sorted(curve.items()))


# ----------------------------------------------------------------------------
# What a checkpoint shows
# ----------------------------------------------------------------------------


def attention_diagnostics(model, task, sentences: int) -> Dict:
    """LR/HR, row entropy and collapse per attention type and layer, and the feature GMMs' hardness per layer
    (SDMA-T), on the first ``sentences`` test sentences."""
    from user_dir.tools.sdma.analysis import collect_cluster_statistics, select_sentences, subset_batches
    from user_dir.tools.sdma.analysis import sdma_modules
    from user_dir.tools.sdma.redundancy import attention_redundancy

    redundancy = attention_redundancy(model, task, subset="test", max_sentences=sentences, device="cpu")
    out = {"sentences": redundancy["sentences"]}
    for kind in ATTENTION_TYPES:
        entry = redundancy[kind]
        out[kind] = {key: entry[key] for key in ("LR", "HR", "entropy_bits_per_layer", "collapsed_share_per_layer")}
    if sdma_modules(model):
        dataset = task.dataset("test")
        indices = select_sentences(dataset, "encoder_self", sentences)
        stats = collect_cluster_statistics(model, subset_batches(dataset, indices, 32, "cpu"))
        for kind, hardness in stats.hardness().items():
            out[kind]["hardness_per_layer"] = hardness.tolist()
    return out


def encoder_query_scale(model, task, sentences: int) -> Dict[str, List[float]]:
    """How large the encoder self-attention's scores are, per layer, on the first ``sentences`` test sentences
    (eval mode, so no sampling noise: q = W_q x / sqrt(d_k), k = W_k x in every system): the mean norm of the
    queries W_q x + b_q and of the keys, and the mean over query rows and heads of the standard deviation of the
    row's scores q.k over its real keys. A row's softmax can only put most of its mass on one key when that
    spread is large."""
    import torch

    from user_dir.tools.sdma.analysis import select_sentences, subset_batches

    dataset = task.dataset("test")
    layers = model.encoder.layers
    inputs: Dict[int, object] = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, kwargs, n=n: inputs.__setitem__(n, kwargs.get("query", args[0] if args else None)),
        with_kwargs=True) for n, layer in enumerate(layers)]
    sums = np.zeros((len(layers), 3))
    rows = 0
    model.eval()
    try:
        with torch.no_grad():
            for batch in subset_batches(dataset, select_sentences(dataset, "encoder_self", sentences), 32, "cpu"):
                src = batch["net_input"]["src_tokens"]
                real = src.ne(task.source_dictionary.pad())  # [B, S]
                model.encoder(src, src_lengths=batch["net_input"]["src_lengths"])
                for n, layer in enumerate(layers):
                    att, x = layer.self_attn, inputs[n]  # x [S, B, E]
                    heads, d = att.num_heads, att.head_dim
                    q = att.q_proj(x).view(x.size(0), x.size(1), heads, d).permute(1, 2, 0, 3)  # [B, H, S, D]
                    k = att.k_proj(x).view(x.size(0), x.size(1), heads, d).permute(1, 2, 0, 3)
                    scores = (q @ k.transpose(-1, -2)) * d ** -0.5  # [B, H, S, S]
                    keys = real[:, None, None, :].to(scores.dtype)
                    count = keys.sum(-1)
                    mean = (scores * keys).sum(-1) / count
                    spread = ((((scores - mean[..., None]) ** 2) * keys).sum(-1) / count).sqrt()  # [B, H, S]
                    query_rows = real[:, None, :].expand_as(spread)
                    sums[n] += [float(q.norm(dim=-1)[query_rows].sum()), float(k.norm(dim=-1)[query_rows].sum()),
                                float(spread[query_rows].sum())]
                rows += int(real.sum()) * layers[0].self_attn.num_heads
    finally:
        for hook in hooks:
            hook.remove()
    means = sums / max(rows, 1)
    return {"query_norm_per_layer": means[:, 0].tolist(), "key_norm_per_layer": means[:, 1].tolist(),
            "score_spread_per_layer": means[:, 2].tolist()}


def gradient_share(model, cfg, task, batches: int, sentences_per_batch: int = 64, seed: int = 0) -> Optional[Dict]:
    """The regularisers' share of the gradient on the parameters shared with L_CE (None for a model without
    regularisers, V-T), and which part of eq. (24) pulls the encoder's queries larger. Training mode, noise
    and dropout on, ``torch.manual_seed(seed)``; the first ``batches`` x ``sentences_per_batch`` training
    sentences.

    ``query_pull``: per part (``ce`` and each weighted regulariser term as it enters the loss) and encoder
    layer, <dL/dW_q, W_q> summed over the batches: the derivative of the part along a uniform scaling of the
    layer's query projection (negative: the part grows the queries, and with them the score spread)."""
    import torch

    from latent_core.sdma.regularisers import scale_regulariser, weighted_terms

    criterion = task.build_criterion(cfg.criterion)
    if not hasattr(criterion, "loss_parts"):
        return None
    model.train()
    shared = [p for name, p in model.named_parameters() if ".sdma." not in name and p.requires_grad]
    query_weights = [layer.self_attn.q_proj.weight for layer in model.encoder.layers]
    weights = criterion.loss_weights(model)
    task.load_dataset("train")
    dataset = task.dataset("train")
    torch.manual_seed(seed)
    ce_sq = reg_sq = dot = 0.0
    pull: Dict[str, np.ndarray] = {}
    for b in range(batches):
        indices = range(b * sentences_per_batch, min((b + 1) * sentences_per_batch, len(dataset)))
        sample = dataset.collater([dataset[i] for i in indices])
        if not sample:
            break
        parts = criterion.loss_parts(model, sample)
        if not parts.regulariser.requires_grad:  # V-T: SDMA off, no regulariser terms
            return None
        named = {"ce": parts.ce_loss, **{
            name: scale_regulariser(term, criterion.regulariser_scale, sample["ntokens"])
            for name, term in weighted_terms(parts.terms, weights).items() if term.requires_grad}}
        for name, loss in named.items():
            grads = torch.autograd.grad(loss, query_weights, retain_graph=True, allow_unused=True)
            radial = [0.0 if g is None else float((g * w.detach()).sum()) for g, w in zip(grads, query_weights)]
            pull[name] = pull.get(name, 0.0) + np.array(radial)
        g_ce = torch.autograd.grad(parts.ce_loss, shared, retain_graph=True, allow_unused=True)
        g_reg = torch.autograd.grad(parts.regulariser, shared, allow_unused=True)
        for a, r in zip(g_ce, g_reg):
            a = torch.zeros(()) if a is None else a
            r = torch.zeros(()) if r is None else r
            ce_sq += float((a * a).sum())
            reg_sq += float((r * r).sum())
            dot += float((a * r).sum())
    ce_norm, reg_norm = math.sqrt(ce_sq), math.sqrt(reg_sq)
    return {"ce_norm": ce_norm, "reg_norm": reg_norm,
            "reg_share": reg_norm / (ce_norm + reg_norm) if ce_norm + reg_norm > 0 else float("nan"),
            "cosine": dot / (ce_norm * reg_norm) if ce_norm * reg_norm > 0 else float("nan"),
            "query_pull": {name: values.tolist() for name, values in pull.items()},
            "batches": batches, "sentences_per_batch": sentences_per_batch}


def measure_segment(system: str, seed: int, data_bin: Path, save_dir: Path, updates: int,
                    references: Sequence[str], args) -> Dict:
    """BLEU hypotheses, attention diagnostics and the gradient share of ``checkpoint_last.pt`` at ``updates``
    (kept in ``save_dir/at-<updates>.json``)."""
    done = save_dir / f"at-{updates}.json"
    if done.exists():
        return json.loads(done.read_text())
    checkpoint = save_dir / "checkpoint_last.pt"
    stage(f"{system} seed {seed} at {updates}: fairseq-generate (beam 5), attention diagnostics, gradient share")
    gen = generate(data_bin, checkpoint, save_dir, extra=["--max-len-b", args.gen_max_len])
    from user_dir.tools.sdma.redundancy import load_models

    models, cfg, task = load_models(checkpoint, str(data_bin), str(USER_DIR))  # once for both measurements
    result = {
        "updates": updates, "system": system, "seed": seed,
        "bleu": corpus_bleu_of(sentence_statistics(gen["hypotheses"], references)),
        "hypotheses": gen["hypotheses"],
        "attention": attention_diagnostics(models[0], task, args.diagnostic_sentences),
        "query_scale": encoder_query_scale(models[0], task, args.diagnostic_sentences),
        "gradient": gradient_share(models[0], cfg, task, args.gradient_batches),
    }
    write_json(done, result)
    return result


# ----------------------------------------------------------------------------
# Summary: table, bootstrap, figure
# ----------------------------------------------------------------------------


def load_runs(out: Path, systems: Sequence[str], seeds: Sequence[int]) -> Dict[str, Dict[int, Dict]]:
    """``{system: {seed: {"valid": {update: bits}, "at": {update: segment JSON}}}}`` of what is kept."""
    runs: Dict[str, Dict[int, Dict]] = {}
    for system in systems:
        for seed in seeds:
            save_dir = out / slug(system) / f"seed{seed}"
            at = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in save_dir.glob("at-*.json")}
            valid_json = save_dir / "valid.json"
            valid = validation_curve(save_dir)
            if valid:
                write_json(valid_json, {str(k): v for k, v in valid.items()})
            elif valid_json.exists():  # logs not kept (a copied run): the kept curve
                valid = {int(k): v for k, v in json.loads(valid_json.read_text()).items()}
            if at or valid:
                runs.setdefault(system, {})[seed] = {"valid": valid, "at": dict(sorted(at.items()))}
    return runs


def paired_bleu(runs: Dict[str, Dict[int, Dict]], references: Sequence[str], update: int, resamples: int) -> Dict:
    """BLEU at ``update`` of every system (the mean over its seeds that reached it) and each other system - V-T
    over the seeds both reached (so a seed one of them lacks does not enter the difference), with paired
    percentile intervals over test sentences (:func:`experiments.bleu_bootstrap.paired_bootstrap_by_seed`)."""
    stats = {system: {seed: sentence_statistics(r["at"][update]["hypotheses"], references)
                      for seed, r in by_seed.items() if update in r["at"]}
             for system, by_seed in runs.items()}
    return paired_bootstrap_by_seed(stats, resamples, seed=1, comparisons=[(system, "V-T") for system in stats
                                                                         if system != "V-T"])


def layer_mean(values: Optional[List[float]]) -> float:
    return float(np.mean(values)) if values else float("nan")


def curve_points(by_seed: Dict[int, Dict], value) -> Dict[int, List[float]]:
    """``{update: [value of each seed that has it]}`` for ``value(segment JSON)``."""
    points: Dict[int, List[float]] = {}
    for run in by_seed.values():
        for update, segment in run["at"].items():
            v = value(segment)
            if v is not None and not (isinstance(v, float) and math.isnan(v)):
                points.setdefault(update, []).append(v)
    return dict(sorted(points.items()))


PANELS = (
    ("validation cross-entropy (bits/token)", None),
    ("BLEU (test, beam 5)", lambda s: s["bleu"]),
    ("encoder self-attention: rows with > 0.9 on one key", lambda s: layer_mean(
        s["attention"]["encoder_self"]["collapsed_share_per_layer"])),
    ("encoder self-attention: row entropy (bits)", lambda s: layer_mean(
        s["attention"]["encoder_self"]["entropy_bits_per_layer"])),
    ("regularisers' share of the shared gradient", lambda s: None if s["gradient"] is None
        else s["gradient"]["reg_share"]),
    ("feature GMM hardness (mean max p(c|z), encoder)", lambda s: layer_mean(
        s["attention"]["encoder_self"].get("hardness_per_layer"))),
    ("encoder self-attention: score spread (std of q.k/sqrt(d) per row)", lambda s: layer_mean(
        s.get("query_scale", {}).get("score_spread_per_layer"))),
)


def draw(runs: Dict[str, Dict[int, Dict]], path: Path, title: str) -> None:
    """One panel per measure of :data:`PANELS`; a line per system (seed mean), the band spans the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {system: f"C{i}" for i, system in enumerate(RUN_SYSTEMS)}
    columns = math.ceil(len(PANELS) / 2)
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 8))
    for ax, (label, value) in zip(axes.flat, PANELS):
        for system, by_seed in runs.items():
            if value is None:
                points: Dict[int, List[float]] = {}
                for run in by_seed.values():
                    for update, bits in run["valid"].items():
                        points.setdefault(update, []).append(bits)
                points = dict(sorted(points.items()))
            else:
                points = curve_points(by_seed, value)
            if not points:
                continue
            x = np.array(list(points))
            mean = np.array([np.mean(v) for v in points.values()])
            ax.plot(x, mean, marker="o" if value is not None else None, markersize=3, label=system,
                    color=colours[system])
            ax.fill_between(x, [min(v) for v in points.values()], [max(v) for v in points.values()], alpha=0.2,
                            color=colours[system])
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("updates")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(PANELS):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarise(runs: Dict[str, Dict[int, Dict]], references: Sequence[str], resamples: int) -> Dict:
    """Per update that every run of a system reached: the seed means, and the paired BLEU intervals."""
    updates = sorted({u for by_seed in runs.values() for r in by_seed.values() for u in r["at"]})
    table = {}
    for update in updates:
        row = {"bleu": paired_bleu(runs, references, update, resamples), "systems": {}}
        for system, by_seed in runs.items():
            have = [r for r in by_seed.values() if update in r["at"]]
            if not have:
                continue
            valid = [r["valid"][update] for r in have if update in r["valid"]]
            entry = {"seeds": len(have), "valid_nll_bits": float(np.mean(valid)) if valid else float("nan")}
            for label, value in PANELS[2:]:
                values = [value(r["at"][update]) for r in have]
                values = [v for v in values if v is not None and not math.isnan(v)]
                entry[label] = float(np.mean(values)) if values else None
            row["systems"][system] = entry
        table[str(update)] = row
    return table


def print_summary(table: Dict) -> None:
    rows = []
    for update, row in table.items():
        for system, entry in row["systems"].items():
            bleu = row["bleu"].get("systems", {}).get(system)
            diff = row["bleu"].get("comparisons", {}).get(f"{system} - V-T")
            rows.append({
                "updates": int(update), "system": system, "seeds": entry["seeds"],
                "valid CE bits": entry["valid_nll_bits"],
                "BLEU": bleu["bleu"] if bleu else float("nan"),
                "- V-T (95%)": (f"{diff['difference']:+.2f} ({diff['interval'][0]:+.2f} to {diff['interval'][1]:+.2f})"
                                if diff else "-"),
                "enc collapsed": entry[PANELS[2][0]], "enc entropy": entry[PANELS[3][0]],
                "reg share": entry[PANELS[4][0]], "hardness": entry[PANELS[5][0]],
                "enc score spread": entry[PANELS[6][0]],
            })
    if rows:
        print_table(rows, list(rows[0]), "SDMA learning curves (seed means; BLEU intervals paired over test sentences)")


# ----------------------------------------------------------------------------
# Command
# ----------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sdma-learning-curves", description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("outputs") / "sdma_learning_curves")
    p.add_argument("--updates", type=int, default=4000, help="training updates of every run (default 4000)")
    p.add_argument("--segment", type=int, default=500,
                   help="updates between BLEU/diagnostic checkpoints (default 500; must divide --updates)")
    p.add_argument("--record-every", type=int, default=250, help="updates between validations (default 250)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--systems", nargs="+", choices=list(RUN_SYSTEMS), default=DEFAULT_SYSTEMS,
                   help=f"default: {' '.join(repr(s) for s in DEFAULT_SYSTEMS)}; the ablations that test what grows the "
                        "authors reading's queries: 'SDMA-T authors no-Dxq' (lambda_x = 0, --sdma-dxq-weight 0), "
                        "'SDMA-T authors no-noise' (no sampling noise, --sdma-noise-var 0: neither eq. (8)'s draw "
                        "nor their second one on the queries), 'SDMA-T authors paper-GMM-init' (both GMMs start "
                        "as the paper reading's, --sdma-gmm-init paper)")
    p.add_argument("--max-words", type=int, default=10, help="keep Ding pairs of at most N words per side")
    p.add_argument("--vocab-size", type=int, default=2000, help="joint sentencepiece vocabulary")
    p.add_argument("--valid-size", type=int, default=ding.VALID_SIZE,
                   help="Ding validation pairs (default: %(default)s)")
    p.add_argument("--test-size", type=int, default=ding.TEST_SIZE, help="Ding test pairs (default: %(default)s)")
    p.add_argument("--gen-max-len", type=int, default=200, help="longest hypothesis, in tokens (fairseq's 200)")
    p.add_argument("--diagnostic-sentences", type=int, default=500, help="test sentences for the attention "
                   "diagnostics (default 500)")
    p.add_argument("--gradient-batches", type=int, default=4, help="training batches of 64 sentences for the "
                   "gradient share (default 4)")
    p.add_argument("--bootstrap-resamples", type=int, default=1000)
    p.add_argument("--plot-only", action="store_true", help="no training: table and figure of the kept runs")
    args = p.parse_args(argv)
    positive = ("updates", "segment", "record_every", "gen_max_len", "diagnostic_sentences", "gradient_batches",
                "bootstrap_resamples")
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"{option_flag(name)} must be >= 1, got {getattr(args, name)}")
    if min(args.seeds) < 1:
        p.error("--seeds must be >= 1")
    if args.updates % args.segment:
        p.error(f"--segment {args.segment} must divide --updates {args.updates}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out: Path = args.out_dir
    references_path = out / "data" / "raw" / "test.en"
    if args.plot_only and not references_path.exists():
        raise SystemExit(f"sdma-learning-curves: error: --plot-only needs the data of an earlier run "
                         f"({references_path} is missing); run without --plot-only first")
    data_bin = out / "data" / "prep" / "bin" if args.plot_only else ding.prepare_fairseq_data(
        out / "data", args.max_words, args.vocab_size, valid_size=args.valid_size, test_size=args.test_size,
        stage=stage)
    references = references_path.read_text(encoding="utf-8").splitlines()
    if not args.plot_only:
        # the systems take turns segment by segment, seed by seed: wherever the runs stop, the systems of a
        # seed have (nearly) the same number of updates and compare
        for seed in args.seeds:
            for end in range(args.segment, args.updates + 1, args.segment):
                for system in args.systems:
                    save_dir = out / slug(system) / f"seed{seed}"
                    if (save_dir / f"at-{end}.json").exists():
                        continue
                    train_to(system, seed, data_bin, save_dir, end, args.record_every)
                    measure_segment(system, seed, data_bin, save_dir, end, references, args)
    runs = load_runs(out, args.systems, args.seeds)
    if not runs:
        raise SystemExit(f"sdma-learning-curves: error: no kept runs in {out}")
    table = summarise(runs, references, args.bootstrap_resamples)
    results = {
        "table": table,
        "runs": {system: {str(seed): {"valid_nll_bits": {str(k): v for k, v in r["valid"].items()},
                                      "at": {str(u): {k: v for k, v in s.items() if k != "hypotheses"}
                                             for u, s in r["at"].items()}}
                          for seed, r in by_seed.items()} for system, by_seed in runs.items()},
        "estimators": {
            "valid_nll_bits": "fairseq's nll_loss on the valid split (cross-entropy without label smoothing or "
                              "regularisers), bits per target token",
            "bleu": f"sacreBLEU (13a, detokenised) of beam-5 hypotheses of the {len(references)} test pairs; a "
                    f"system's BLEU is the mean over its seeds that reached the update; a difference to V-T is "
                    f"over the seeds both reached; 95% percentile bootstrap, {args.bootstrap_resamples} "
                    "resamples of test sentences shared by every run (paired)",
            "attention": f"first {args.diagnostic_sentences} test sentences, teacher-forced, eval mode: "
                         f"row entropy (bits) and share of rows with > {COLLAPSE_PEAK} of their mass on one key "
                         "per layer over real queries and heads; LR/HR (latent_core.redundancy); hardness = mean "
                         "max_c p(c|z) of the feature GMMs per layer",
            "gradient": f"{args.gradient_batches} training batches of 64 sentences, training mode, seed 0: "
                        "||g_reg|| / (||g_CE|| + ||g_reg||) and cos(g_CE, g_reg) on the parameters outside the "
                        "SDMA cores",
        },
    }
    write_json(out / "results.json", results)
    print_summary(table)
    draw(runs, out / "learning_curves.png",
         f"Ding de->en, tiny 2+2 layers: seeds {', '.join(map(str, sorted({k for r in runs.values() for k in r})))} "
         "(band: min-max over seeds)")
    stage(f"wrote {out / 'results.json'} and {out / 'learning_curves.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
