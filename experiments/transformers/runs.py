"""What the two run drivers (``transformers-sdma-sts``, ``transformers-sdma-lm``) share: keeping finished runs in
their ``results.json`` and the mean over seeds with its t-interval."""

import math
from pathlib import Path
from typing import Dict, List

import numpy as np

from pipelines.runs import write_json


def seed_interval(values: List[float]) -> Dict[str, object]:
    """Mean over seeds with a 95% t-interval (None for one seed)."""
    from scipy.stats import t

    mean = float(np.mean(values))
    if len(values) < 2:
        return {"mean": mean, "ci95": None, "n": len(values)}
    half = float(t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values)))
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": len(values)}


def run_missing(results: dict, results_path: Path, systems, seeds, prog: str, run) -> None:
    """``run(system, seed)`` for every pair ``results["runs"]`` lacks, appending its result and writing
    ``results_path`` after each (finished runs are kept across calls)."""
    done = {(r["system"], r["seed"]) for r in results["runs"]}
    for system in systems:
        for seed in seeds:
            if (system, seed) in done:
                continue
            print(f"[{prog}] {system} seed {seed}", flush=True)
            results["runs"].append(run(system, seed))
            write_json(results_path, results)
