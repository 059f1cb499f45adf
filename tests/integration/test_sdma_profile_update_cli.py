"""``python -m benchmarks.sdma.profile_update`` as a user starts it on a CPU, without TRITON_INTERPRET in the
environment: the Triton variant is counted in the interpreter (the in-process test in
tests/unit/user_dir/test_sdma_bench_measures.py has the variable set by conftest before anything imports Triton)."""

import json
import os
import subprocess
import sys

from conftest import REPO


def test_the_cli_counts_a_triton_variant_on_a_cpu_in_a_fresh_interpreter(tmp_path):
    out = tmp_path / "profile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sdma.profile_update", "--config", "tiny2x2",
                           "--device", "cpu", "--sentences", "2", "--tokens", "6", "--updates", "1", "--warmup", "0",
                           "--models", "V-T", "SMA-T triton", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    models = json.loads(out.read_text())["models"]
    triton = models["SMA-T triton"]
    assert triton["interpreted"] and triton["triton_kernels"] > 0
    assert triton["model_launches"] > triton["vt_model_launches_same_batch"] > 0
    assert "counted in Triton's interpreter" in proc.stdout
