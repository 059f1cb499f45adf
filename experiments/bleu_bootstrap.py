"""sacreBLEU's per-sentence statistics and a paired percentile bootstrap over test sentences, for run drivers that
compare systems trained over several seeds (``sdma-readings-runs``, ``sdma-learning-curves``, the demo,
``transformers-sdma-mt``). Imports no toolkit (sacreBLEU inside the functions)."""

from typing import Dict, List, Sequence, Tuple

import numpy as np


def sentence_statistics(hypotheses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """sacreBLEU's sufficient statistics per sentence, ``[N, 2 + 2 * 4]`` (what its own paired
    bootstrap resamples)."""
    from sacrebleu.metrics import BLEU

    if len(hypotheses) != len(references):
        raise SystemExit(f"{len(hypotheses)} hypotheses for {len(references)} references")
    return np.asarray(BLEU()._extract_corpus_statistics(list(hypotheses), [list(references)]), dtype=np.int64)


def corpus_bleu_of(stats: np.ndarray) -> float:
    from sacrebleu.metrics import BLEU

    return BLEU()._compute_score_from_stats(stats.sum(0).tolist()).score


def resampled_bleu(stats: Dict[str, List[np.ndarray]], resamples: int, seed: int) -> Dict[str, np.ndarray]:
    """BLEU of every run on ``resamples`` resamples of the test sentences, the same resamples for every run
    (paired): per system ``[runs, resamples]``, from each run's :func:`sentence_statistics`."""
    rng = np.random.default_rng(seed)
    n = next(iter(stats.values()))[0].shape[0]
    draws = {system: np.empty((len(runs), resamples)) for system, runs in stats.items()}
    for r in range(resamples):
        index = rng.integers(0, n, n)
        for system, runs in stats.items():
            for i, s in enumerate(runs):
                draws[system][i, r] = corpus_bleu_of(s[index])
    return draws


def _interval(values: np.ndarray, level: float) -> List[float]:
    return [float(np.percentile(values, 100 * (1 - level) / 2)), float(np.percentile(values, 100 * (1 + level) / 2))]


def paired_bootstrap(stats: Dict[str, List[np.ndarray]], resamples: int, seed: int,
                     comparisons: Sequence[Tuple[str, str]], level: float = 0.95) -> Dict:
    """Seed-mean BLEU of each system and of each difference ``a - b`` in ``comparisons``, with percentile
    intervals from ``resamples`` resamples of the test sentences shared by every run (paired).

    ``stats``: per system, each seed's :func:`sentence_statistics`."""
    draws = {system: runs.mean(0) for system, runs in resampled_bleu(stats, resamples, seed).items()}
    out = {"systems": {}, "comparisons": {}, "resamples": resamples, "level": level}
    for system, runs in stats.items():
        out["systems"][system] = {"bleu": float(np.mean([corpus_bleu_of(s) for s in runs])),
                                  "interval": _interval(draws[system], level)}
    out["comparisons"] = paired_differences(draws, {s: v["bleu"] for s, v in out["systems"].items()}, comparisons,
                                            level)
    return out


def paired_bootstrap_by_seed(stats: Dict[str, Dict[int, np.ndarray]], resamples: int, seed: int,
                             comparisons: Sequence[Tuple[str, str]], level: float = 0.95) -> Dict:
    """:func:`paired_bootstrap` where systems may have run different seeds (``stats``: per system, ``{seed: its
    sentence statistics}``): each system's BLEU is the mean over all its seeds (with the seeds in its entry), each
    difference ``a - b`` is taken over the seeds both ran (its entry's ``seeds``; left out where they share none),
    so a seed one of them lacks does not enter the difference. Every run is resampled once, on the same sentences,
    so with equal seeds the result is :func:`paired_bootstrap`'s."""
    stats = {system: dict(sorted(by_seed.items())) for system, by_seed in stats.items() if by_seed}
    if not stats:
        return {}
    per_run = resampled_bleu({system: list(by_seed.values()) for system, by_seed in stats.items()}, resamples, seed)
    row = {system: {k: i for i, k in enumerate(by_seed)} for system, by_seed in stats.items()}

    def draws_over(system: str, seeds: List[int]) -> np.ndarray:
        return per_run[system][[row[system][k] for k in seeds]].mean(0)

    def bleu_over(system: str, seeds: List[int]) -> float:
        return float(np.mean([corpus_bleu_of(stats[system][k]) for k in seeds]))

    out = {"systems": {}, "comparisons": {}, "resamples": resamples, "level": level}
    for system, by_seed in stats.items():
        seeds = list(by_seed)
        out["systems"][system] = {"bleu": bleu_over(system, seeds),
                                  "interval": _interval(draws_over(system, seeds), level), "seeds": seeds}
    for a, b in comparisons:
        common = sorted(set(stats.get(a, {})) & set(stats.get(b, {})))
        if common:
            pair = paired_differences({s: draws_over(s, common) for s in (a, b)},
                                      {s: bleu_over(s, common) for s in (a, b)}, [(a, b)], level)
            out["comparisons"][f"{a} - {b}"] = {**pair[f"{a} - {b}"], "seeds": common}
    return out


def paired_differences(draws: Dict[str, np.ndarray], points: Dict[str, float], comparisons: Sequence[Tuple[str, str]],
                       level: float = 0.95) -> Dict[str, Dict]:
    """``{"a - b": {difference, interval, share_of_resamples_above_zero}}`` for the pairs of ``comparisons`` both
    present, from each system's metric on the same resamples (``draws``) and on the whole test set (``points``)."""
    out = {}
    for a, b in comparisons:
        if a in draws and b in draws:
            diff = draws[a] - draws[b]
            out[f"{a} - {b}"] = {
                "difference": points[a] - points[b],
                "interval": _interval(diff, level),
                "share_of_resamples_above_zero": float((diff > 0).mean()),
            }
    return out
