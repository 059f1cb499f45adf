"""The subprocess layer of the sweep scripts (``topic_vq_runs.py``, ``tpr_transfer_runs.py``):
one ``fairseq-train`` run logged to a file and recognised as finished, and the test-split scores
of a checkpoint from ``glue_predict.py``."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, Sequence

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def finished(log: Path) -> bool:
    """True when ``log`` is the log of a ``fairseq-train`` run that reached its end."""
    return log.is_file() and "done training" in log.read_text()


def fairseq_train(arguments: Sequence[str], log: Path) -> None:
    """``fairseq-train ARGUMENTS`` with stdout and stderr in ``log``; RuntimeError with its tail."""
    with open(log, "w") as out:
        proc = subprocess.run([str(VENV_BIN / "fairseq-train"), *map(str, arguments)], stdout=out,
                              stderr=subprocess.STDOUT, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-train failed ({log}):\n{log.read_text()[-3000:]}")


def test_scores(checkpoint: Path, data: Path, out: Path) -> Dict[str, float]:
    """``glue_predict.py`` on ``data``'s test split (predictions in ``out``) -> its metrics;
    {} for an unlabelled test file (GLUE's)."""
    cmd = [sys.executable, str(REPO / "scripts" / "glue_predict.py"), "--path", str(checkpoint), "--data", str(data),
           "--split", "test", "--out", str(out), "--cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"glue_predict.py failed on {checkpoint}: {proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}
