"""``pipelines.data.preprocess.fairseq_preprocess``: fairseq-preprocess in the calling process writes what the
command writes, leaves the caller's stdout and logging as they were, and names a failure in the caller's error."""

import logging
import sys

import pytest

from pipelines.data.preprocess import PREPROCESS_LOGGER, fairseq_preprocess
from tests.conftest import REPO, english_phrases, run_checked, venv_bin


class CallerError(RuntimeError):
    pass


@pytest.fixture()
def text(tmp_path):
    lines = english_phrases(60)
    (tmp_path / "train.txt").write_text("\n".join(lines[:50]) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(lines[50:]) + "\n")
    return tmp_path


def argv(text, dest):
    return ["--only-source", "--trainpref", text / "train.txt", "--validpref", text / "valid.txt", "--destdir", dest,
            "--workers", "1"]


def test_binarises_without_touching_stdout_or_the_callers_logging(text, capfd):
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    preprocess_handlers = list(logging.getLogger(PREPROCESS_LOGGER).handlers)
    for call in range(2):  # a second call adds no handler either
        dest = text / f"bin{call}"
        fairseq_preprocess(argv(text, dest), CallerError)
        assert sorted(p.name for p in dest.iterdir()) == [
            "dict.txt", "preprocess.log", "train.bin", "train.idx", "valid.bin", "valid.idx"]
        assert "Wrote preprocessed data" in (dest / "preprocess.log").read_text()
    assert capfd.readouterr().out == ""
    assert list(root.handlers) == handlers and root.level == level
    assert list(logging.getLogger(PREPROCESS_LOGGER).handlers) == preprocess_handlers


def test_a_failure_is_the_callers_error_naming_the_command_and_its_cause(text):
    preprocess_handlers = list(logging.getLogger(PREPROCESS_LOGGER).handlers)  # other callers' in this worker
    missing = text / "absent.txt"
    with pytest.raises(CallerError, match=r"fairseq-preprocess --only-source --trainpref .*absent\.txt.* failed: "
                                          r"FileNotFoundError"):
        fairseq_preprocess(["--only-source", "--trainpref", missing, "--destdir", text / "bin"], CallerError)
    with pytest.raises(CallerError, match="fairseq refused the arguments"):
        fairseq_preprocess(["--no-such-flag"], CallerError)
    assert list(logging.getLogger(PREPROCESS_LOGGER).handlers) == preprocess_handlers  # the failed call's file closed


@pytest.mark.integration
def test_writes_the_same_files_as_the_command(text):
    fairseq_preprocess(argv(text, text / "here"), CallerError)
    run_checked([venv_bin("fairseq-preprocess"), *argv(text, text / "command")])
    for name in ("dict.txt", "train.bin", "train.idx", "valid.bin", "valid.idx"):
        assert (text / "here" / name).read_bytes() == (text / "command" / name).read_bytes(), name


@pytest.mark.integration
def test_in_a_fresh_interpreter_fairseqs_import_leaves_no_stdout_handler(text):
    """fairseq_cli.preprocess calls logging.basicConfig(stream=sys.stdout) when first imported: in a process whose
    root logger has no handler yet (a command's), a later logging.warning would then write to stdout."""
    script = ("import logging, sys\n"
              "from pipelines.data.preprocess import fairseq_preprocess\n"
              f"fairseq_preprocess({[str(a) for a in argv(text, text / 'fresh')]!r}, RuntimeError)\n"
              "logging.getLogger('after').warning('to stderr')\n"
              "print(len(logging.getLogger().handlers), logging.getLogger().level)\n")
    proc = run_checked([sys.executable, "-c", script], cwd=REPO)
    assert proc.stdout == f"0 {logging.WARNING}\n"
    assert "to stderr" in proc.stderr
