import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "2")

import user_dir  # noqa: E402,F401  (registers models, criterions, safe globals)


def venv_bin(name: str) -> str:
    """A console script of the running interpreter's environment (fairseq-train, ...)."""
    return str(Path(sys.executable).with_name(name))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO
