import math
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# `make test` runs pytest-xdist workers, one per core: each worker (and what it starts) computes
# on one thread, so the workers do not oversubscribe the cores. A plain `pytest` uses two. The
# xdist controller loads this file too, before it starts the workers, which inherit its
# environment: its default must not pass for a user's choice there (two threads per worker
# made files 8-17x slower beside the other worker). A user's OMP_NUM_THREADS is kept everywhere.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_THREADS_CHOSEN_HERE = "LATENT_TESTS_DEFAULT_THREADS"
if "OMP_NUM_THREADS" not in os.environ or os.environ.get(_THREADS_CHOSEN_HERE) == os.environ["OMP_NUM_THREADS"]:
    os.environ["OMP_NUM_THREADS"] = os.environ[_THREADS_CHOSEN_HERE] = "1" if XDIST_WORKER else "2"
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Where no GPU is, the Triton kernels (attention_kernel=triton) run in Triton's interpreter: the variable must be
# set before latent_core.sdma.triton_kernels is first imported (and it is inherited by the CLIs the tests start).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pipelines.data.preprocess import fairseq_preprocess  # noqa: E402

TESTS = Path(__file__).resolve().parent
INTEGRATION = TESTS / "integration"
GPU = TESTS / "gpu"
# The GPU tier (tests/gpu, `make test-gpu`) runs where CUDA is; GPU_TESTS_DEVICE=cpu runs it on the
# CPU instead (to check the tier's own code; fp16 cases are then skipped). Elsewhere its tests are
# deselected, not skipped: a machine without a GPU has nothing missing.
GPU_TESTS_DEVICE = os.environ.get("GPU_TESTS_DEVICE", "cuda")
# Under CI=true a skip is an error: CI installs every resource (make install), so a skipped
# end-to-end test (missing Ding dictionary, espeak-ng, MiniLM weights) means a broken install.
STRICT_SKIPS = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _gpu_tier_runs() -> bool:
    if GPU_TESTS_DEVICE == "cpu":
        return True
    import torch

    return torch.cuda.is_available()


def pytest_configure(config):
    """Registers the plugin's models, criterions and safe globals (``import user_dir``) where tests run: not in
    the xdist controller, which only schedules and reports (the import takes it ~5 of its ~12 s of startup,
    before any worker starts)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import user_dir  # noqa: F401


def pytest_collection_modifyitems(config, items):
    """Everything under tests/integration/ carries the ``integration`` marker, everything under
    tests/gpu/ the ``gpu`` marker (both registered in pytest.ini); the gpu tier is deselected
    where it cannot run (no CUDA and no GPU_TESTS_DEVICE=cpu)."""
    gpu_items = []
    for item in items:
        parents = Path(str(item.fspath)).resolve().parents
        if INTEGRATION in parents:
            item.add_marker(pytest.mark.integration)
        if GPU in parents:
            item.add_marker(pytest.mark.gpu)
            gpu_items.append(item)
    if gpu_items and not _gpu_tier_runs():
        config.hook.pytest_deselected(items=gpu_items)
        gpu_ids = {id(item) for item in gpu_items}
        items[:] = [item for item in items if id(item) not in gpu_ids]


def _fail_skip(report, what: str) -> None:
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = (f"{what} skipped under CI=true ({reason}): CI must install everything "
                       "`make install` installs (the Ding dictionary, espeak-ng, sox, the MiniLM weights)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT_SKIPS and report.skipped and not hasattr(report, "wasxfail"):
        _fail_skip(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if STRICT_SKIPS and report.skipped:  # a module-level skip or importorskip
        _fail_skip(report, collector.nodeid)


BF16_AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


def train_under_bf16_autocast(model, loss_fn, steps, lr=3e-3, check_falls=True):
    """``steps`` Adam updates with ``loss_fn()`` computed under bf16 autocast on the CPU (what
    ``--amp`` / ``--use_amp`` do on a GPU with fp16); asserts finite losses that fall (unless
    ``check_falls`` is off: for noisy training losses, check a deterministic one instead), returns them."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        with torch.autocast(**BF16_AUTOCAST):
            loss = loss_fn()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] or not check_falls, losses
    return losses


def parameter_gradients(model) -> dict:
    """``{name: grad}`` of the parameters that received a gradient."""
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_same_step(want, got, parameter: str, rtol: float, atol: float) -> None:
    """Two training steps, each ``(output, parameter_gradients(model))``, are the same: outputs within ``rtol`` /
    ``atol``, the same parameters with gradients (one named like ``parameter`` among them), every gradient within
    1e-3 relative, absolute errors against its largest entry."""
    (want_out, want_grads), (got_out, got_grads) = want, got
    torch.testing.assert_close(got_out, want_out, rtol=rtol, atol=atol)
    assert set(got_grads) == set(want_grads) and any(parameter in name for name in got_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-3, atol=1e-5 * max(float(grad.abs().max()), 1.0),
                                   msg=name)


def planted_copy(module, replacements, name: str):
    """A copy of ``module``, registered as ``name``, from its source with ``replacements`` ((old, new) strings)
    applied: a planted defect, for a test to show that its checks fail on it. Every ``old`` must occur in the
    source. The source is executed from memory; linecache holds it under a pseudo-file name, where Triton's
    ``@jit`` reads its functions' source."""
    import linecache
    import types

    source = Path(module.__file__).read_text()
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    filename = f"<planted {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    planted = types.ModuleType(name)
    planted.__file__ = filename
    sys.modules[name] = planted
    exec(compile(source, filename, "exec"), planted.__dict__)
    return planted


def fuzz_examples(examples: int) -> int:
    """Hypothesis examples for a fuzz test: ``examples`` in ``make test`` (CI), a quarter (at least 20) in ``make
    test-fast`` (``TEST_TIER=fast``), which keeps every fuzz test at fewer inputs to stay within its 3 minutes."""
    return max(20, examples // 4) if os.environ.get("TEST_TIER") == "fast" else examples


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a test's DDP rendezvous; xdist
    workers run DDP tests at the same time, so a port fixed or derived from the pid can clash)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def venv_bin(name: str) -> str:
    """A console script of the running interpreter's environment (fairseq-train, ...)."""
    return str(Path(sys.executable).with_name(name))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def save_tiny_bert(path: Path, words) -> Path:
    """A tiny random BERT config (2 layers, hidden 32, no dropout) and a WordPiece tokenizer over
    ``words`` (specials first) saved in ``path``: the stand-in encoder of the hf_sentence tests."""
    from transformers import BertConfig, BertTokenizerFast

    BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(str(path))
    BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0).save_pretrained(str(path))  # no dropout: learns in few epochs
    return path


DING_DE_EN = Path("/usr/share/trans/de-en")  # the Debian Ding dictionary (apt-get install trans-de-en)


def english_phrases(n: int, min_words: int = 4, max_words: int = 10):
    """The first ``n`` English sides of the Ding dictionary with ``min_words``..``max_words`` words:
    first alternative, annotations dropped, lower-cased (the sentence-VAE tests' corpus)."""
    import re

    out = []
    with open(DING_DE_EN, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#") or "::" not in line:
                continue
            first = re.split(r"[|;]", line.split("::", 1)[1])[0]
            first = re.sub(r"\[[^\]]*\]|\{[^}]*\}|<[^>]*>|\([^)]*\)", " ", first).lower()
            words = re.findall(r"[a-z]+", first)
            if min_words <= len(words) <= max_words:
                out.append(" ".join(words))
                if len(out) == n:
                    break
    return out


def recipe_fairseq_train_argv(script_argv, tmp_path, env=None) -> list:
    """The fairseq-train arguments a recipe script (``bash`` + ``script_argv``) runs, through its FAIRSEQ_TRAIN
    hook: a stub that records them instead of training."""
    stub, out = Path(tmp_path) / "fairseq-train", Path(tmp_path) / "argv"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > {out}\n')
    stub.chmod(0o755)
    subprocess.run(["bash", *map(str, script_argv)], check=True, capture_output=True,
                   env={**os.environ, "FAIRSEQ_TRAIN": str(stub), **(env or {})})
    return out.read_bytes().decode().split("\0")[:-1]


def run_checked(cmd, timeout=600, **kwargs):
    """Run a command (paths allowed); AssertionError with the output's tail when it fails."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def prepare_ding_bin(work: Path, *, src: str = "de", tgt: str = "en", max_words: int = 8, valid_size: int = 50,
                     test_size: int = 50, vocab_size: int = 300, train_pairs=None) -> Path:
    """Ding pairs (``prepare-ding``; the first ``train_pairs`` training pairs when given), joint
    sentencepiece and fairseq binaries (``prepare-translation``) under ``work``; the data-bin path."""
    run_checked([venv_bin("prepare-ding"), "--out-dir", work / "all", "--max-words", max_words,
                 "--valid-size", valid_size, "--test-size", test_size])
    raw = work / "all"
    if train_pairs is not None:
        raw = work / "raw"
        raw.mkdir()
        for split in ("train", "valid", "test"):
            for lang in ("de", "en"):
                lines = (work / "all" / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(True)
                keep = lines[:train_pairs] if split == "train" else lines
                (raw / f"{split}.{lang}").write_text("".join(keep), encoding="utf-8")
    run_checked([venv_bin("prepare-translation"), "--train-prefix", raw / "train", "--valid-prefix", raw / "valid",
                 "--test-prefix", raw / "test", "--src", src, "--tgt", tgt, "--joint", "--vocab-size", vocab_size,
                 "--out-dir", work / "prep", "--workers", "1"])
    return work / "prep" / "bin"


def prepare_bert_ding_bin(work: Path, bert_dir, pairs: int) -> Path:
    """The first ``pairs`` Ding pairs English -> German (at most 8 words; 50 valid, 50 test):
    ``bert_dir``'s WordPiece source, a 300-piece sentencepiece target (``prepare-translation
    --src-bert-dir``) under ``work``; the data-bin path."""
    run_checked([venv_bin("prepare-ding"), "--out-dir", work / "all", "--max-words", 8, "--valid-size", 50,
                 "--test-size", 50])
    raw = work / "raw"
    raw.mkdir()
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            lines = (work / "all" / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(True)
            (raw / f"{split}.{lang}").write_text("".join(lines[:pairs]), encoding="utf-8")
    proc = run_checked([venv_bin("prepare-translation"), "--train-prefix", raw / "train", "--valid-prefix",
                        raw / "valid", "--test-prefix", raw / "test", "--src", "en", "--tgt", "de",
                        "--src-bert-dir", bert_dir, "--tgt-vocab-size", 300, "--soft-vocab-limit",
                        "--out-dir", work / "prep", "--workers", 1])
    assert "--srcdict" in proc.stdout
    return work / "prep" / "bin"


@pytest.fixture(scope="session")
def small_translation_bin(tmp_path_factory):
    """400 training pairs of the Ding dictionary (at most 8 words; 50 valid, 50 test),
    sentencepiece (joint, 300), binarized by ``prepare-translation``."""
    return prepare_ding_bin(tmp_path_factory.mktemp("ding_small"), train_pairs=400)


@pytest.fixture(scope="session")
def small_vae_bin(tmp_path_factory):
    """240 English Ding phrases (200 train, 40 valid), binarized with ``fairseq-preprocess --only-source``."""
    root = tmp_path_factory.mktemp("vae_small")
    lines = english_phrases(240)
    (root / "train.txt").write_text("\n".join(lines[:200]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[200:]) + "\n")
    fairseq_preprocess(["--only-source", "--trainpref", root / "train.txt", "--validpref", root / "valid.txt",
                        "--destdir", root / "bin", "--workers", "1"], AssertionError)
    return root / "bin"


# ----------------------------------------------------------------------------
# tiny data and two tiny fairseq checkpoints (``transformer`` and ``sdma_transformer``,
# fairseq-train --max-update 5, trained in parallel) once per session: the SDMA analysis tests
# (integration/test_sdma_redundancy.py, integration/test_sdma_analysis.py)
# ----------------------------------------------------------------------------

TINY_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

TRAIN_COMMON = [
    "--task", "translation", "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "400", "--max-update", "5", "--seed", "1",
    "--cpu", "--no-progress-bar", "--no-epoch-checkpoints", "--disable-validation",
    "--num-workers", "0", "--no-save-optimizer-state",
]
ARCHS = {
    "transformer": ["--arch", "transformer"],
    "sdma": ["--arch", "sdma_transformer_iwslt_de_en_tiny", "--user-dir", str(REPO / "user_dir"),
             "--criterion", "sdma_label_smoothed_cross_entropy", "--sdma-clusters", "3",
             "--sdma-query-clusters", "3", "--sdma-mix-rate", "0.5"],  # g > 0.8 after 5 updates
}


def _communicate_checked(proc, what):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
    return out, err


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("redundancy")
    rng = random.Random(0)
    for split, n in (("train", 64), ("valid", 8), ("test", 12)):
        with open(root / f"{split}.src", "w") as fs, open(root / f"{split}.tgt", "w") as ft:
            for _ in range(n):
                words = [f"w{rng.randrange(12)}" for _ in range(rng.randint(2, 9))]
                fs.write(" ".join(words) + "\n")
                ft.write(" ".join(reversed(words)) + "\n")
    data = root / "bin"
    fairseq_preprocess(["--source-lang", "src", "--target-lang", "tgt", "--trainpref", root / "train", "--validpref",
                        root / "valid", "--testpref", root / "test", "--destdir", data, "--workers", "1"],
                       AssertionError)
    procs = {}
    for name, extra in ARCHS.items():  # both trainings at once (2 cores)
        procs[name] = subprocess.Popen(
            [venv_bin("fairseq-train"), str(data), *TRAIN_COMMON, *extra, "--save-dir", str(root / name)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=TINY_ENV, cwd=root)
    for name, proc in procs.items():
        _communicate_checked(proc, f"fairseq-train {name}")
    ckpts = {name: root / name / "checkpoint_last.pt" for name in ARCHS}
    for path in ckpts.values():
        assert path.is_file()
    # start sdma-redundancy on both checkpoints now: the subprocesses run while
    # the in-process tests do (collected by ``script_runs``)
    scripts = {}
    for name, path in ckpts.items():
        with open(root / f"{name}.out", "w") as out, open(root / f"{name}.err", "w") as err:
            scripts[name] = subprocess.Popen(
                [venv_bin("sdma-redundancy"), "--path", str(path), str(data),
                 "--subset", "test", "--batch-size", "5", "--json", str(root / f"{name}.json"),
                 "--heatmap", str(root / f"{name}.png")],
                stdout=out, stderr=err, env=TINY_ENV, cwd=REPO)
    yield {"root": root, "data": str(data), "scripts": scripts, **{k: str(v) for k, v in ckpts.items()}}
    for proc in scripts.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def loaded(tiny):
    """In-process (models, task) of both tiny checkpoints."""
    from user_dir.tools.sdma import redundancy as ar

    out = {}
    for name in ARCHS:
        models, _cfg, task = ar.load_models(tiny[name], tiny["data"])
        out[name] = (models[0].eval(), task)
    return out


@pytest.fixture(scope="session")
def script_runs(tiny):
    """sdma-redundancy on both checkpoints (subprocesses): {name: (rc, stdout, stderr)}."""
    results = {}
    for name, proc in tiny["scripts"].items():
        proc.wait(timeout=300)
        root = tiny["root"]
        results[name] = (proc.returncode, (root / f"{name}.out").read_text(), (root / f"{name}.err").read_text())
    return results
