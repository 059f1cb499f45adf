"""ESPnet on the GPU: the synthetic Mandarin recipe (``experiments.espnet.synthetic_asr``: ESPnet's own
``asr_train`` and ``asr_inference``) with ``--ngpu 1``, training with ``--use_amp true``, for SDMA (the
authors reading, the Aishell default) and vanilla; the SDMA model's decoding on CUDA equals its
decoding on the CPU.

The corpus is synthesised with espeak-ng and sox; where they are missing, GPU_TESTS_ESPNET_CORPUS
names a corpus folder made elsewhere by the driver's ``data`` stage (``--stop-stage data``).
"""

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from gpu_support import ON_CPU
from tests.integration.test_espnet_pipeline import RECIPE, write_tiny_configs

pytest.importorskip("espnet2")
CORPUS = os.environ.get("GPU_TESTS_ESPNET_CORPUS")


def _driver(work, conf, *extra):
    proc = subprocess.run([sys.executable, str(RECIPE / "run_synthetic.py"), "--work-dir", str(work),
                           "--conf-dir", str(conf), "--num-sentences", "12", *extra],
                          capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def gpu_pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_asr")
    write_tiny_configs(root / "conf")
    work = root / "work"
    if CORPUS:
        shutil.copytree(CORPUS, work / "corpus")
        for scp in (work / "corpus" / "data").glob("*/wav.scp"):  # absolute paths of the machine that made it
            lines = [line.split(maxsplit=1) for line in scp.read_text(encoding="utf-8").splitlines()]
            scp.write_text("".join(f"{utt} {work / 'corpus' / 'wav' / os.path.basename(path)}\n"
                                   for utt, path in lines), encoding="utf-8")
        first = ["--stage", "tokens"]
    elif shutil.which("espeak-ng") and shutil.which("sox"):
        first = []
    else:
        pytest.fail("no espeak-ng/sox to synthesise the corpus: set GPU_TESTS_ESPNET_CORPUS to a corpus folder")
    gpu = [] if ON_CPU else ["--ngpu", "1", "--use-amp"]
    stdout = _driver(work, root / "conf", *first, *gpu)
    return root, work, stdout


def test_recipe_trains_with_amp_and_decodes_on_the_gpu(gpu_pipeline):
    root, work, stdout = gpu_pipeline
    assert "sdma" in stdout and "vanilla" in stdout and "CER" in stdout, stdout[-3000:]
    log = (work / "logs" / "train_sdma.log").read_text(encoding="utf-8")
    config = yaml.safe_load((work / "exp" / "sdma" / "config.yaml").read_text(encoding="utf-8"))
    assert (config["ngpu"], config["use_amp"]) == ((0, False) if ON_CPU else (1, True))
    results = [line for line in log.splitlines() if "1epoch results" in line]
    assert results and "sdma_reg=" in results[0] and "nan" not in results[0].lower(), results
    for system in ("sdma", "vanilla"):
        hyps = work / "exp" / system / "decode_test" / "1best_recog" / "text"
        assert hyps.read_text(encoding="utf-8").splitlines(), system


@pytest.mark.skipif(ON_CPU, reason="compares CUDA with the CPU")
def test_sdma_decoding_on_cuda_equals_the_cpu(gpu_pipeline):
    root, work, _ = gpu_pipeline
    gpu_text = (work / "exp" / "sdma" / "decode_test" / "1best_recog" / "text").read_text(encoding="utf-8")
    cpu_work = root / "cpu_decode"
    cpu_work.mkdir()
    for name in ("corpus", "exp", "stats", "tokens.txt"):
        (cpu_work / name).symlink_to(work / name)
    shutil.move(str(work / "exp" / "sdma" / "decode_test"), str(work / "exp" / "sdma" / "decode_gpu"))
    _driver(cpu_work, root / "conf", "--stage", "decode", "--stop-stage", "decode", "--systems", "sdma")
    assert (work / "exp" / "sdma" / "decode_test" / "1best_recog" / "text").read_text(encoding="utf-8") == gpu_text
