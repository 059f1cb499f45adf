"""Under CI=true a skipped test or module is an error (tests/conftest.py), elsewhere a skip."""

import os
import shutil
import subprocess
import sys

from conftest import TESTS

SKIPPING_TESTS = '''
import pytest

def test_needs_a_resource():
    pytest.skip("apt-get install trans-de-en")

def test_runs():
    pass
'''
SKIPPING_MODULE = '''
import pytest

pytest.importorskip("no_such_module_for_this_test")

def test_never_collected():
    pass
'''


def _pytest(tmp_path, ci):
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def _suite(tmp_path, body):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_resource.py").write_text(body)


def test_a_skipped_test_fails_only_under_ci(tmp_path):
    _suite(tmp_path, SKIPPING_TESTS)
    local = _pytest(tmp_path, ci=False)
    assert local.returncode == 0 and "1 passed, 1 skipped" in local.stdout, local.stdout[-2000:]
    ci = _pytest(tmp_path, ci=True)
    assert ci.returncode == 1 and "1 failed, 1 passed" in ci.stdout, ci.stdout[-2000:]
    assert "test_needs_a_resource skipped under CI=true (Skipped: apt-get install trans-de-en)" in ci.stdout


def test_a_skipped_module_is_an_error_under_ci(tmp_path):
    _suite(tmp_path, SKIPPING_MODULE)
    local = _pytest(tmp_path, ci=False)
    assert local.returncode == 5 and "1 skipped" in local.stdout, local.stdout[-2000:]  # 5: no test ran
    ci = _pytest(tmp_path, ci=True)
    assert ci.returncode == 2 and "test_resource.py skipped under CI=true" in ci.stdout, ci.stdout[-2000:]
