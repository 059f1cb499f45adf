"""SDMATrainer and SDMASeq2SeqTrainer under the launchers Hugging Face users scale out with: ``torchrun`` and
``accelerate launch`` with 2 CPU processes (gloo) train to the parameters of one process with the same global batch.

Before the query clustering was tied to the attention output (``latent_core.sdma.tie_to_output``) both ranks failed
in the first backward: the Trainer's DDP looks for unused parameters, counted the query GMM unused (it reaches the
loss only through the regularisers, computed after the forward) and then saw its gradient "marked as ready twice".
"""

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, free_port, venv_bin

DRIVER = REPO / "tests" / "integration" / "hf_distributed_train.py"


def train(tmp_path, name, launcher, family, batch, *extra):
    out = tmp_path / f"{name}.pt"
    command = [*launcher, str(DRIVER), "--family", family, "--batch", str(batch), "--out", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(out, weights_only=True)


def torchrun():
    return [venv_bin("torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port())]


def assert_same_training(one, two):
    assert one["world_size"] == 1 and two["world_size"] == 2
    for name, parameter in one["parameters"].items():
        torch.testing.assert_close(two["parameters"][name], parameter, rtol=1e-4, atol=2e-5, msg=name)
    # the regularisers as logged: each term under its own key, averaged over the processes, and g
    for a, b in zip(one["logs"], two["logs"]):
        for key in ("loss", "sdma/kl_z", "sdma/dqq", "sdma/dxq", "sdma/dv_z", "sdma/regulariser", "sdma/g"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_torchrun_two_processes_equal_one_with_the_same_global_batch(tmp_path, family):
    """``SDMATrainer`` (a Llama with grouped-query attention) and ``SDMASeq2SeqTrainer`` (a BART: the three
    attention types) under ``torchrun --nproc_per_node 2``."""
    one = train(tmp_path, "one", [sys.executable], family, 8)
    two = train(tmp_path, "two", torchrun(), family, 4)
    assert_same_training(one, two)
    moved = [n for n, p in one["parameters"].items() if ".sdma." in n]
    assert any("query_gmm" in n for n in moved)


def test_accelerate_launch_and_gradient_accumulation_equal_one_process(tmp_path):
    one = train(tmp_path, "one", [sys.executable], "llama", 8)
    # accelerate's multi-process launcher (torch's elastic agent); its --cpu path needs MPI
    launcher = [venv_bin("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    assert_same_training(one, train(tmp_path, "accelerate", launcher, "llama", 4))
    accumulated = train(tmp_path, "accumulated", [sys.executable], "llama", 4, "--accumulate", "2")
    for name, parameter in one["parameters"].items():
        torch.testing.assert_close(accumulated["parameters"][name], parameter, rtol=1e-4, atol=2e-5, msg=name)


def test_fsdp2_two_processes_equal_one(tmp_path):
    """torch's FSDP2 (``fully_shard`` on each decoder layer and the model; 2 CPU processes, gloo) in a plain loop
    trains to one process's parameters. The regularisers read the GMMs after the forward, where FSDP has sharded
    them again: sdma_loss gathers the layers that hold SDMA cores while it builds them; c_g reaches the means
    through FSDP's own parameters (an op at each use, not a hook on the original parameter)."""
    driver = REPO / "tests" / "integration" / "hf_fsdp_train.py"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'integration'}", "OMP_NUM_THREADS": "1"}
    outs = {}
    for name, launcher in (("one", [sys.executable]), ("two", torchrun())):
        outs[name] = tmp_path / f"{name}.pt"
        run = subprocess.run([*launcher, str(driver), str(outs[name])], capture_output=True, text=True, cwd=REPO,
                             env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
    one, two = (torch.load(outs[name], weights_only=True) for name in ("one", "two"))
    assert one["world_size"] == 1 and two["world_size"] == 2
    for name, parameter in one["parameters"].items():
        torch.testing.assert_close(two["parameters"][name], parameter, rtol=1e-4, atol=2e-5, msg=name)
