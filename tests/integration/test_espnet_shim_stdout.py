"""The asr.sh python shim leaves stdout to the tool it runs, and importing the plugin prints nothing there.

ESPnet's recipes pipe tools' stdout into their files (asr.sh stage 13: ``tokenize_text --output -`` into ref.trn and
hyp.trn; egs2 scripts read values from ``${python} -c``), so through ``python -m espnet_plugin.bin.python_shim``
stdout must be byte-identical to plain ``python``'s, although the ESPnet modules the plugin imports print
"Failed to import Flash Attention ..." to stdout where flash_attn is absent.
"""

import subprocess
import sys

import pytest

pytest.importorskip("espnet2")

from conftest import REPO  # noqa: E402

SHIM = ["-m", "espnet_plugin.bin.python_shim"]
TOOLS = {
    # char tokens of a text file with the options of asr.sh stage 13 (ref.trn / hyp.trn for the CER)
    "tokenize_text": ["-m", "espnet2.bin.tokenize_text", "--token_type", "char", "--input", "{text}", "--output", "-",
                      "--field", "2-", "--cleaner", "none", "--non_linguistic_symbols", "none",
                      "--remove_non_linguistic_symbols", "true"],
    # a value read through ${python} -c (egs2's uasr.sh, stage 4: the sampling rate)
    "python -c": ["-c", "import humanfriendly as h; print(h.parse_size('16k'))"],
}


@pytest.fixture(scope="module")
def stdout(tmp_path_factory):
    """{(tool, "plain" | "shim") or "import": stdout}; every process at once (each imports ESPnet, ~15 s)."""
    text = tmp_path_factory.mktemp("shim_stdout") / "text"
    text.write_text("utt1 今天 天气 很好\nutt2 我们 去 公园\nutt3 hello world\n", encoding="utf-8")
    commands = {"import": ["-c", "import espnet_plugin"]}
    for tool, args in TOOLS.items():
        args = [a.replace("{text}", str(text)) for a in args]
        commands[tool, "plain"], commands[tool, "shim"] = args, SHIM + args
    procs = {key: subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for key, args in commands.items()}
    outputs = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{key}:\n{err.decode()[-3000:]}"
        outputs[key] = out
    return outputs


@pytest.mark.parametrize("tool", list(TOOLS))
def test_stdout_through_the_shim_is_plain_pythons(stdout, tool):
    assert stdout[tool, "plain"].strip()  # the tool wrote something to compare
    assert stdout[tool, "shim"] == stdout[tool, "plain"]


def test_importing_the_plugin_prints_nothing_to_stdout(stdout):
    assert stdout["import"] == b""
