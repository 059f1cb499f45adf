"""``make gpu-check`` (``benchmarks/gpu_check.py``) calls programs that exist, with arguments their own
parsers accept. Checked on the CPU: every step runs with the command runner replaced, so the commands
are recorded instead of run."""

import argparse
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    return importlib.import_module("benchmarks.gpu_check")


def record_commands(gpu_check, tmp_path, monkeypatch):
    commands = []

    def fake_run(cmd, log, timeout):
        cmd = [str(c) for c in cmd]
        commands.append(cmd)
        if Path(cmd[0]).name == "prepare-english-vae-data":  # what the next command's parser checks
            out_dir = Path(cmd[cmd.index("--out-dir") + 1])
            (out_dir / "bin").mkdir(parents=True, exist_ok=True)
            (out_dir / "bin" / "dict.txt").write_text("the 10\n")
        # data preparation "succeeds" so the step goes on; the benchmarks "fail", so no result is read back
        return 0 if Path(cmd[0]).name.startswith("prepare-") else 1

    monkeypatch.setattr(gpu_check, "run", fake_run)
    args = argparse.Namespace(workers=1, sdma_updates=300, vae_updates=100, repeats=2, bert_dir=tmp_path / "bert",
                              step_timeout=60.0)
    for name in gpu_check.STEPS:
        getattr(gpu_check, f"step_{name}")(args, tmp_path)
    return commands


def parser_of(cmd):
    """(what the command is, its module's ``parse_args``) for a recorded command: ``python -m MODULE``
    or an installed console script."""
    if cmd[0] == sys.executable:
        assert cmd[1] == "-m", f"{cmd}: run a module of the project, not a file"
        assert importlib.util.find_spec(cmd[2]) is not None, f"no module {cmd[2]}"
        if cmd[2] == "pytest":
            return cmd[2], None
        return cmd[2], getattr(importlib.import_module(cmd[2]), "parse_args", None)
    program = Path(cmd[0])
    assert program.is_file(), f"{program} is not installed beside the interpreter"
    # the module the installed wrapper imports (pip writes ``from <module> import <function>``): what runs
    imported = re.search(r"^from (\S+) import ", program.read_text(), re.MULTILINE)
    assert imported, f"{program}: not a console-script wrapper"
    return program.name, getattr(importlib.import_module(imported.group(1)), "parse_args", None)


def test_every_step_runs_an_existing_program_with_arguments_it_accepts(gpu_check, tmp_path, monkeypatch):
    commands = record_commands(gpu_check, tmp_path, monkeypatch)
    names = []
    for cmd in commands:
        name, parse_args = parser_of(cmd)
        names.append(name)
        if name == "pytest":
            assert (REPO / cmd[3]).is_dir()
        else:
            assert parse_args is not None, f"{name}: no parse_args to check its arguments with"
            parse_args(cmd[3:] if cmd[0] == sys.executable else cmd[1:])
    assert names == ["pytest", "benchmarks.sdma.kernels_bench", "benchmarks.sdma.profile_update", "sdma-bench",
                     "prepare-english-vae-data", "vae-bench", "prepare-optimus-data", "optimus-bench",
                     "benchmarks.sdma.gpu_speed"]
