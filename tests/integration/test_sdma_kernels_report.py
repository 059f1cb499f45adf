"""Every Triton launch the adapters' models make, compiled for the A100 (sm_80) and the H100 (sm_90) at head dims 32,
64 and 128 in fp16 and bf16 (``sdma-kernels-report``): no register spills, shared memory within the architecture's
per-block limit. No GPU is needed: ``triton.compile`` targets a card without a driver, and ``ptxas -v`` reports what
the card would run. About 6 minutes on 2 cores alone (the models' calls recorded in Triton's interpreter, about a
minute; then 558 launches per architecture compiled, one process each, about 330 s alone: the regularisers' kernels
are compiled per GMM dtype and head dim), up to 2x that beside the other tests: hence its own time limit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sdma.kernels_report import ARCHS, HEAD_DIMS, MODEL_STEPS, warps_per_sm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[2]


def without_interpreter():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # tests/conftest.py sets it; the compile step must see Triton's JIT kernels
    return env


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels_report")
    subprocess.run([sys.executable, "-m", "benchmarks.sdma.kernels_report", "--inputs", "fp16", "bf16",
                    "--json", str(out / "report.json")], cwd=ROOT, env=without_interpreter(), check=True)
    return json.loads((out / "report.json").read_text())


def test_every_adapters_model_was_recorded(report):
    models = {model for call in report["calls"] for model in call["models"]}
    assert models == set(MODEL_STEPS)
    kinds = {(call["kind"], call.get("authors"), call.get("score_bias") is not None) for call in report["calls"]}
    assert {("clustering", None, False), ("attention", True, False), ("attention", False, False),
            ("attention", True, True), ("feature_terms", True, False),
            ("feature_terms", False, False), ("query_terms", True, False),
            ("query_terms", False, False), ("noise", None, False)} <= kinds  # both readings, the Conformer's
    # score bias, eq. (20)-(23), eq. (8)'s noise


def test_every_launch_compiles_without_spills_within_shared_memory(report):
    launches = report["launches"]
    covered = {(row["inputs"], row["head_dim"], row["arch"]) for row in launches}
    assert covered == {(inputs, d, f"sm_{arch}") for inputs in ("fp16", "bf16") for d in HEAD_DIMS for arch in ARCHS}
    kernels = {row["kernel"] for row in launches}
    assert kernels == {"attention_forward", "attention_row_sums", "attention_backward_keys",
                       "attention_backward_queries", "attention_weights", "clustering_forward", "clustering_backward",
                       "clustering_parameter_grads", "feature_terms_forward", "feature_terms_backward",
                       "feature_parameter_grads", "query_normalisers", "query_terms_forward", "query_terms_backward",
                       "sampling_noise"}
    spilling = [(r["kernel"], r["inputs"], r["head_dim"], r["arch"], r["spill_stores"]) for r in launches
                if r["spill_stores"] or r["spill_loads"]]
    assert not spilling, spilling
    over = [(r["kernel"], r["head_dim"], r["arch"], r["shared"]) for r in launches if r["shared"] > r["shared_limit"]]
    assert not over, over
    assert all(r["warps_per_sm"] >= 4 for r in launches)


def test_the_report_sees_a_spill(tmp_path):
    """The measurement itself: the forward kernel at 64 x 64 tiles on 4 warps, head dim 64 (the first report's
    row, before the search), cannot fit 255 registers, and the report says so (seconds to compile; 128 x 128 at
    head dim 128 took a minute and a half)."""
    script = """
import json, sys
from latent_core.sdma import triton_kernels
from benchmarks.sdma.kernels_report import compile_calls
call = {"kind": "attention", "clusters": 4, "authors": True, "blocked": [1, 0, 0, 1], "score_bias": None,
        "dropout": True, "backward": False, "bias_grad": False}
triton_kernels.LAUNCH[("attention_forward", "half", 64)] = triton_kernels.LaunchConfig(64, 64, 4, 2)
rows = compile_calls([call], ["fp16"], [64], [90])
json.dump(rows, sys.stdout)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=without_interpreter(), check=True,
                            capture_output=True, text=True)
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(rows) == 1 and rows[0]["kernel"] == "attention_forward"
    assert rows[0]["spill_stores"] > 0 and rows[0]["registers"] == 255


def test_occupancy_from_registers_and_shared_memory():
    assert warps_per_sm(64, 0, 4, 90) == 32  # 64 registers x 128 threads: 8 blocks of 4 warps
    assert warps_per_sm(255, 0, 8, 90) == 8  # 256 x 32 x 8 = 64K registers: one block
    assert warps_per_sm(32, 100 * 1024, 4, 80) == 4  # 164 KB of shared memory hold one 100 KB block
    assert warps_per_sm(32, 100 * 1024, 4, 90) == 8  # 228 KB hold two
