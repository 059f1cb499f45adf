"""qkvae-probe as a command: a malformed triplet file is refused naming its line."""

import subprocess

from conftest import venv_bin


def test_probe_cli_reports_line_number(tmp_path):
    tsv = tmp_path / "bad.tsv"
    tsv.write_text("a\tb\tc\na\tb\n", encoding="utf-8")
    proc = subprocess.run([venv_bin("qkvae-probe"), "--checkpoint", "x.pt",
                           "--dict", "x.txt", "--triplets", str(tsv)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "line 2: expected 3 tab-separated fields" in proc.stderr
