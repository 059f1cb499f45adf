"""Importing the plugin undoes fairseq 0.12's root logger at DEBUG (its wav2vec2_classification module calls
logging.basicConfig(level=DEBUG) on import), so libraries' debug lines stay out of every command's output."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # each test starts a Python process that imports fairseq and the plugin

PROBE = """
import logging
import fairseq.models  # what sets the root logger to DEBUG
before = logging.getLogger().level
import user_dir
logging.getLogger("matplotlib").debug("a library's debug line")
print(before, logging.getLogger().level)
"""


def probe(**env):
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    return run.stdout.split()[-2:], run.stderr


def test_the_plugin_puts_fairseqs_debug_root_logger_back_to_info():
    (before, after), stderr = probe(LOGLEVEL="INFO")
    assert before == "10" and after == "20"  # fairseq's DEBUG, then INFO
    assert "DEBUG" not in stderr and "a library's debug line" not in stderr


def test_loglevel_debug_keeps_debug():
    (_, after), stderr = probe(LOGLEVEL="DEBUG")
    assert after == "10" and "a library's debug line" in stderr
