"""Shared by the GPU tier: the ``device`` fixture (CUDA, or the CPU under GPU_TESTS_DEVICE=cpu),
the precisions, and the command-line flags that put fairseq and ESPnet on that device."""

import pytest
import torch

from conftest import GPU_TESTS_DEVICE

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device(GPU_TESTS_DEVICE)


def needs_cuda_for(precision: str) -> None:
    """fp16 matrix kernels (and fairseq's --fp16 / --amp) need CUDA: skipped in a CPU run of the tier."""
    if precision in ("fp16", "amp") and GPU_TESTS_DEVICE == "cpu":
        pytest.skip(f"{precision} needs CUDA (GPU_TESTS_DEVICE=cpu)")


ON_CPU = GPU_TESTS_DEVICE == "cpu"
# fairseq-train's precision flags per precision name (amp: torch autocast + GradScaler, fairseq's --amp)
FAIRSEQ_PRECISION = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"], "amp": ["--amp"]}


def fairseq_device_flags() -> list:
    return ["--cpu"] if ON_CPU else []
