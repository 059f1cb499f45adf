"""``pip install .`` into an environment that already has the stack (the README's second install
path): the package builds from ``pyproject.toml`` alone, and its console commands and
``fairseq-train --user-dir`` run from the installed copy, not from the checkout."""

import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_checked, venv_bin

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The project copied without its tests, checkpoints or virtual environment (what an sdist
    carries), installed with ``pip install --no-deps --no-build-isolation --prefix``."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy(REPO / name, source / name)
    for package in ("latent_core", "pipelines", "user_dir", "espnet_plugin"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    prefix = root / "prefix"
    # --ignore-installed: without it pip uninstalls the environment's own (editable) install first
    run_checked([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                 "--ignore-installed", "--no-index", "--disable-pip-version-check", "--prefix", prefix, source])
    assert Path(venv_bin("vae-eval")).exists(), "the environment's own install was removed"
    site = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return {"prefix": prefix, "site": site, "env": env, "cwd": root}


def test_the_packages_import_from_the_installed_copy(installed):
    code = "import latent_core, user_dir, espnet_plugin; print(user_dir.__file__); print(espnet_plugin.__file__)"
    out = run_checked([sys.executable, "-c", code], env=installed["env"], cwd=installed["cwd"]).stdout
    paths = [line for line in out.splitlines() if line.endswith("__init__.py")]
    assert len(paths) == 2 and all(path.startswith(str(installed["site"])) for path in paths), out


def test_console_commands_and_fairseq_user_dir_run_from_the_installed_copy(installed):
    vae_eval = installed["prefix"] / "bin" / "vae-eval"
    assert vae_eval.is_file()
    help_text = run_checked([vae_eval, "--help"], env=installed["env"], cwd=installed["cwd"]).stdout
    assert "--k" in help_text
    user_dir = run_checked([sys.executable, "-m", "user_dir"], env=installed["env"],
                           cwd=installed["cwd"]).stdout.strip().splitlines()[-1]  # the README's --user-dir value
    assert user_dir == str(installed["site"] / "user_dir")
    code = ("import sys; from fairseq import options; import user_dir; "
            "args = options.parse_args_and_arch(options.get_training_parser(), sys.argv[1:]); "
            "print(args.task, args.arch, args.criterion, args.qkvae_reading, user_dir.__file__)")
    out = run_checked([sys.executable, "-c", code, "DATA", "--user-dir", user_dir, "--task", "sentence_vae",
                       "--arch", "qkvae_small", "--criterion", "sentence_vae"],
                      env=installed["env"], cwd=installed["cwd"]).stdout.split()
    assert out[:4] == ["sentence_vae", "qkvae_small", "sentence_vae", "authors"], out
    assert out[4].startswith(user_dir), out


def test_setup_py_shim_reports_the_pyproject_version():
    """``python setup.py --version`` (tools that still call setup.py) reads pyproject.toml."""
    import re
    import subprocess

    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == version
