"""Importing the fairseq plugin in a fresh interpreter prints no warnings of its own."""

import subprocess
import sys

from conftest import REPO


def test_import_prints_no_warnings_of_its_own():
    code = ("import warnings, fairseq; warnings.simplefilter('error'); "
            "import user_dir; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    noise = [line for line in proc.stderr.splitlines() if "user_dir" in line]
    assert not noise, noise
