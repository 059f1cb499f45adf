"""``lighten_interpreter``: Triton's interpreter gives the same results without the overflow checks it drops and
without patching the language again at each helper call; it patches once per launch and helper instead."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.integration  # a fresh interpreter: TRITON_INTERPRET is read when triton is first imported

SCRIPT = r"""
import json
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from latent_core.triton_interpreter import lighten_interpreter


@triton.jit
def _scaled(x, k):
    return x * k + 1


@triton.jit
def _kernel(X, OUT, n, seed, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    x = tl.load(X + offsets, mask=keep)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for step in range(3):  # the helpers called in a loop, in every program
        acc += _scaled(x, step) + tl.rand(seed, offsets * 3 + step)  # tl.rand: triton.language.random's helpers
    tl.store(OUT + offsets, acc, mask=keep)


calls = []
original = interpreter._patch_lang


def counting(fn):
    calls.append(fn.__name__)
    return original(fn)


interpreter._patch_lang = counting
x = torch.randn(50)


def run():
    out = torch.empty_like(x)
    _kernel[(4,)](x, out, x.numel(), 7, BLOCK=16)
    return out


before = run()
patches_before = len(calls)
lighten_interpreter()
lighten_interpreter()  # idempotent
calls.clear()
after = run()
first_launch = list(calls)
calls.clear()
again = run()
second_launch = list(calls)
failing = None
try:
    _kernel[(1,)](x, None, x.numel(), 7, BLOCK=16)  # a launch that fails midway
except Exception as error:
    failing = type(error).__name__
after_failure = run()  # the failed launch's patches were undone, and the next launch patches afresh
print(json.dumps({"equal": all(torch.equal(before, out) for out in (after, again, after_failure)),
                  "patches_before": patches_before, "first_launch": first_launch, "second_launch": second_launch,
                  "sanitize": interpreter.interpreter_builder.options.sanitize_overflow,
                  "debug": interpreter.interpreter_builder.options.debug, "failing": failing}))
"""


def test_results_equal_and_the_language_is_patched_once_per_launch_and_helper():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["equal"]
    assert report["sanitize"] is False and report["debug"] is False  # the checks were built and dropped unused
    # before: the launch, then every helper call (3 loop steps x 4 programs x (_scaled + tl.rand's helpers))
    assert report["patches_before"] > 4 * 3 * 2
    # after: once per launch for the kernel and for each helper it calls, in every launch
    first = report["first_launch"]
    assert first[0] == "_kernel" and "_scaled" in first and len(first) == len(set(first)) >= 3
    assert report["second_launch"] == first
    assert report["failing"] is not None
