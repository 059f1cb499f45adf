"""pipelines/runs.py's runner (``run_streaming``, with ``benchmarks.peak_rss``) and its paths."""

import sys
from pathlib import Path

import pytest

import latent_core
from benchmarks import peak_rss
from pipelines import runs


def test_user_dir_is_the_package_next_to_latent_core():
    assert runs.USER_DIR == runs.REPO_ROOT / "user_dir"
    assert (runs.USER_DIR / "__init__.py").is_file()
    assert runs.REPO_ROOT / "latent_core" / "__init__.py" == Path(latent_core.__file__).resolve()


def test_run_streaming_logs_everything_and_echoes_what_is_asked(tmp_path, capsys):
    code = "import sys; print('kept 1'); print('echoed 2'); print('on stderr', file=sys.stderr)"
    result = runs.run_streaming([sys.executable, "-c", code], tmp_path / "a" / "run.log", echo_filter="echoed")
    assert result["lines"] == ["kept 1\n", "echoed 2\n", "on stderr\n"] and len(result["line_seconds"]) == 3
    assert (tmp_path / "a" / "run.log").read_text() == result["log"]
    assert capsys.readouterr().out == "    echoed 2\n"
    runs.run_streaming([sys.executable, "-c", code], tmp_path / "quiet.log", echo=False)
    assert capsys.readouterr().out == ""
    assert "peak_rss_mb" not in result


def test_run_streaming_failure_names_the_command_and_the_log(tmp_path):
    code = "import sys; print('last words'); sys.exit(3)"
    with pytest.raises(SystemExit, match=r"(?s)command failed \(3\): .* -c .*last words.*full log: .*run\.log"):
        runs.run_streaming([sys.executable, "-c", code], tmp_path / "run.log", echo=False)
    assert (tmp_path / "run.log").read_text() == "last words\n"


def test_wrap_rss_runs_a_console_script_by_its_entry_point(tmp_path):
    result = runs.run_streaming([runs.console_script("pip"), "--version"], tmp_path / "pip.log", echo=False,
                                wrap_rss=True)
    assert result["log"].startswith("pip ") and result["peak_rss_mb"] > 1


def test_peak_rss_refuses_what_is_not_a_console_script():
    with pytest.raises(SystemExit, match="usage: peak-rss CONSOLE_SCRIPT"):
        peak_rss.main([])
    with pytest.raises(SystemExit, match="no-such-tool is not a console script"):
        peak_rss.main(["/somewhere/no-such-tool", "--help"])


def test_console_script_names_a_missing_install():
    with pytest.raises(SystemExit, match="no-such-tool not found: run `make install` first"):
        runs.console_script("no-such-tool")


def test_peak_rss_of_a_child_does_not_include_its_large_parent(tmp_path):
    ballast = bytearray(600 * 2**20)  # this process: > 600 MiB resident
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])
    result = runs.run_streaming([runs.console_script("pip"), "--version"], tmp_path / "pip.log", echo=False,
                                wrap_rss=True)
    del ballast
    assert 1 < result["peak_rss_mb"] < 300  # pip itself, not the parent's 600 MiB
