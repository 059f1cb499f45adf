"""End to end through fairseq's own command-line tools on real German-English pairs.

Data: the Ding dictionary's sentence pairs (Debian ``trans-de-en``, installed by
``make install``), sentencepiece subwords, ``fairseq-preprocess``. Everything is
tiny so the whole file runs in a few minutes on 2 CPU cores.
"""

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, free_port, prepare_ding_bin, run_checked, venv_bin
from latent_core.sdma import mixing_weight

DING = Path("/usr/share/trans/de-en")
pytestmark = pytest.mark.skipif(not DING.exists(), reason="apt-get install trans-de-en (make install does)")

TINY_MODEL = [
    "--arch", "sdma_transformer_iwslt_de_en_tiny",
    "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
]


def run(cmd, cwd=None, check=True, env=None):
    if not check:
        return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=env)
    return run_checked(cmd, cwd=cwd, env=env)


def train_cmd(data_bin, save_dir, *extra):
    return [
        venv_bin("fairseq-train"), data_bin, "--user-dir", REPO / "user_dir", *TINY_MODEL,
        "--task", "translation", "--criterion", "sdma_label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--optimizer", "adam", "--lr", "2e-3", "--max-tokens", "1500",
        "--cpu", "--no-progress-bar", "--log-interval", "1", "--log-format", "simple",
        "--save-dir", save_dir, "--seed", "1", *extra,
    ]


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    return prepare_ding_bin(tmp_path_factory.mktemp("ding"), valid_size=100, test_size=100, vocab_size=500)


@pytest.fixture(scope="session")
def trained(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("ckpt")
    proc = run(train_cmd(data_bin, save_dir, "--max-update", "40", "--max-epoch", "100",
                         "--eval-bleu", "--eval-bleu-remove-bpe", "sentencepiece",
                         "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric",
                         "--max-tokens", "1000"))
    return save_dir, proc.stdout + proc.stderr


def losses(log):
    return [float(m) for m in re.findall(r"train_inner \| .*? loss=([0-9.]+)", log)] or [
        float(m) for m in re.findall(r"\| loss ([0-9.]+) \| nll_loss", log)
    ]


def test_training_logs_every_term_and_loss_drops(trained):
    _, log = trained
    for term in ("ce_loss", "sdma_kl_z", "sdma_kl_q", "sdma_dqq", "sdma_dxq", "sdma_dv_z", "sdma_dv_q"):
        assert term + "=" in log, term
    # the clustering diagnostics, per update and per validation, each a share in [0, 1] or a ratio
    for term in ("sdma_dqq_clamped", "sdma_dqq_ratio", "sdma_hardness"):
        values = [float(v) for v in re.findall(term + r"=([0-9.]+)", log)]
        assert len(values) >= 20 and f"| {term} " in log, term
    hardness = [float(v) for v in re.findall(r"sdma_hardness=([0-9.]+)", log)]
    assert all(0.25 <= h <= 1.0 for h in hardness)  # 4 clusters: a max_c p(c|z) of at least 1/4
    assert all(0.0 <= float(v) <= 1.0 for v in re.findall(r"sdma_dqq_clamped=([0-9.]+)", log))
    values = losses(log)
    assert len(values) >= 20
    first, last = sum(values[:5]) / 5, sum(values[-5:]) / 5
    assert last < first - 0.5, values


def test_generate_and_interactive_load_with_the_safe_loader(trained, data_bin):
    save_dir, _ = trained
    ckpt = save_dir / "checkpoint_best.pt"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    gen = run([venv_bin("fairseq-generate"), data_bin, "--user-dir", REPO / "user_dir", "--path", ckpt,
               "--beam", "5", "--gen-subset", "test", "--cpu", "--max-tokens", "2000",
               "--remove-bpe", "sentencepiece", "--required-batch-size-multiple", "1"], env=env)
    hyps = [line for line in gen.stdout.splitlines() if line.startswith("H-")]
    assert len(hyps) == 100
    inter = subprocess.run(
        [venv_bin("fairseq-interactive"), str(data_bin), "--user-dir", str(REPO / "user_dir"), "--path", str(ckpt),
         "--beam", "2", "--cpu", "--source-lang", "de", "--target-lang", "en"],
        input="▁Das ▁ist ▁gut .\n", capture_output=True, text=True, env=env,
    )
    assert inter.returncode == 0, inter.stderr[-3000:]
    assert any(line.startswith("H-0") for line in inter.stdout.splitlines())


def test_checkpoint_contains_only_allowlisted_types(trained):
    from latent_core.safe_loading import checkpoint_types

    save_dir, _ = trained
    allowed = {f"{t.__module__}.{t.__name__}" for t in checkpoint_types()}
    checkpoints = sorted(save_dir.glob("checkpoint*.pt"))
    assert len(checkpoints) >= 2, checkpoints  # checkpoint1/_best/_last
    for ckpt in checkpoints:
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(ckpt)))
        assert unsafe <= allowed, unsafe - allowed
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        assert "model" in state


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/should_not_exist_sdma",))


def test_malicious_pickle_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"model": {}, "payload": _RunsCode()}, f)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, map_location="cpu")
    assert not Path("/tmp/should_not_exist_sdma").exists()
    from fairseq import checkpoint_utils

    with pytest.raises(pickle.UnpicklingError):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))


def test_every_fairseq_entry_point_refuses_a_code_running_checkpoint(data_bin, tmp_path):
    """fairseq's CLIs and the plugin's scripts: the payload never runs, the refusal is torch's safe loader."""
    marker = tmp_path / "payload_ran"

    class WritesMarker:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": WritesMarker()}, evil)
    commands = {
        "fairseq-generate": [venv_bin("fairseq-generate"), data_bin, "--user-dir", REPO / "user_dir", "--path", evil,
                             "--cpu", "--gen-subset", "valid", "--max-tokens", "500"],
        "fairseq-train --restore-file": train_cmd(data_bin, tmp_path / "ck", "--restore-file", evil,
                                                  "--max-update", "1"),
        "vae-eval": [venv_bin("vae-eval"), data_bin, "--path", evil, "--cpu"],
        "sdma-redundancy": [venv_bin("sdma-redundancy"), data_bin, "--path", evil],
        "glue-predict": [venv_bin("glue-predict"), "--path", evil, "--data", tmp_path, "--out", tmp_path / "out.tsv",
                         "--cpu"],
        "latent-average-checkpoints": [venv_bin("latent-average-checkpoints"), "--inputs", evil, evil,
                                       "--output", tmp_path / "avg.pt"],
    }
    for name, command in commands.items():
        proc = run(command, check=False)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, name
        assert "weights_only" in output or "Unpickl" in output, f"{name}: {output[-2000:]}"
        assert not marker.exists(), f"{name} ran the payload"


def test_restore_file_resumes_schedule_and_g(trained, data_bin, tmp_path):
    save_dir, _ = trained
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu")
    g = [v.item() for k, v in state["model"].items() if k.endswith("mix_weight")]
    num_updates = state["optimizer_history"][-1]["num_updates"]
    assert num_updates == 40
    # the last training forward ran at update_num = 39 (fairseq counts from 0): its g is kept
    assert g and all(abs(x - mixing_weight(num_updates - 1)) < 1e-6 for x in g)
    proc = run(train_cmd(data_bin, tmp_path, "--restore-file", save_dir / "checkpoint_last.pt",
                         "--max-update", "44", "--max-epoch", "100", "--no-epoch-checkpoints"))
    assert "loaded checkpoint" in (proc.stdout + proc.stderr).lower()
    resumed = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu")
    assert resumed["optimizer_history"][-1]["num_updates"] == 44


DDP_COMMON = ["--max-update", "3", "--dropout", "0", "--sdma-noise-var", "0", "--disable-validation",
              "--no-epoch-checkpoints", "--max-tokens", "600"]


def ddp_and_update_freq_two(data_bin, tmp_path, common, ddp_backend, launcher=()):
    """The final weights of 2 gloo processes (``--ddp-backend``, started with ``launcher`` before fairseq-train's
    arguments, or fairseq-train itself) and of one process with --update-freq 2 on the same batches."""
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    run(train_cmd(data_bin, single, *common, "--update-freq", "2"))
    port = free_port()
    procs = []
    for rank in (0, 1):
        command = train_cmd(data_bin, ddp, *common, "--distributed-world-size", "2", "--distributed-rank", str(rank),
                            "--distributed-no-spawn", "--distributed-init-method", f"tcp://127.0.0.1:{port}",
                            "--distributed-backend", "gloo", *ddp_backend)
        if launcher:
            command = [*launcher, *command[1:]]
        procs.append(subprocess.Popen([str(c) for c in command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    a, b = (torch.load(d / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"] for d in (single, ddp))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5), key
    return a


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_ddp_two_cpu_processes_match_update_freq_two(data_bin, tmp_path, reading):
    """fairseq DDP (gloo, 2 processes) == one process with --update-freq 2 on the same batches."""
    a = ddp_and_update_freq_two(data_bin, tmp_path, [*DDP_COMMON, "--sdma-reading", reading],
                                ["--ddp-backend", "legacy_ddp"])
    trained_keys = [k for k in a if "feature_gmm.means" in k]
    assert trained_keys


def test_pytorch_ddp_with_find_unused_parameters_matches_update_freq_two(data_bin, tmp_path):
    """torch's DDP with its unused-parameter search (``--ddp-backend pytorch_ddp --find-unused-parameters``, what
    transformers' Trainer runs by default), 2 CPU processes == one process with --update-freq 2. The query GMM
    reaches the loss only through the criterion's regularisers, after the forward; tied to the attention output
    (``latent_core.sdma.tie_to_output``) it counts as used instead of being "marked as ready twice"."""
    ddp_and_update_freq_two(data_bin, tmp_path, DDP_COMMON, ["--ddp-backend", "pytorch_ddp", "--find-unused-parameters"],
                            launcher=[sys.executable, REPO / "tests" / "integration" / "fairseq_cpu_ddp.py"])


def test_nan_loss_term_stops_training_naming_it(trained, data_bin, tmp_path):
    """A diverged checkpoint (a NaN GMM mean) stops training with the term's name."""
    save_dir, _ = trained
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu")
    key = next(k for k in state["model"] if k.endswith("self_attn.sdma.feature_gmm.means"))
    state["model"][key][0, 0, 0] = float("nan")
    torch.save(state, tmp_path / "diverged.pt")
    proc = run(train_cmd(data_bin, tmp_path / "ck", "--restore-file", tmp_path / "diverged.pt",
                         "--max-update", "45", "--max-epoch", "100", "--disable-validation"), check=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "SDMA loss term 'kl_z' is nan" in output
    assert f"First non-finite parameter {key} " in output  # the diagnosis names the poisoned tensor


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sdma-clusters", "0"], "--sdma-clusters"),
        (["--sdma-kl-weight", "-1"], "--sdma-kl-weight"),
        (["--sdma-mix-max", "1.2"], "--sdma-mix-max"),
        (["--encoder-attention-heads", "3"], "--encoder-attention-heads"),
        (["--arch", "sdma_transformer_iwslt_de_en_tinyy"], "invalid choice"),
        (["--sdma-compile"], "--sdma-compile: this option was removed: running SDMA's training through torch.compile"),
        (["--sdma-compile", "false"], "--sdma-compile: this option was removed"),
    ],
)
def test_bad_cli_options_fail_early_with_the_option_name(data_bin, tmp_path, extra, message):
    """Like argparse's own errors: one line ``fairseq-train: error: ...``, exit status 2, no traceback."""
    proc = run(train_cmd(data_bin, tmp_path, "--max-update", "1", *extra), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fairseq-train: error: ") and message in last, proc.stderr[-2000:]
    assert not list(tmp_path.glob("checkpoint*.pt"))


def test_other_exceptions_keep_their_traceback(tmp_path):
    """Only the plugin's configuration errors are shortened; a defect keeps its traceback."""
    code = ("import sys; import user_dir; from latent_core.errors import PluginConfigError; "
            "raise (PluginConfigError if sys.argv[1] == 'config' else KeyError)('--x=0 must be >= 1')")
    config = run([sys.executable, "-c", code, "config"], check=False)
    assert config.returncode == 2 and config.stderr.strip().splitlines()[-1] == "python: error: --x=0 must be >= 1"
    assert "Traceback" not in config.stderr
    defect = run([sys.executable, "-c", code, "defect"], check=False)
    assert defect.returncode == 1 and "Traceback" in defect.stderr and "KeyError" in defect.stderr


def test_missing_data_files_are_named(data_bin, tmp_path):
    """fairseq's own early errors name the missing file (no training starts)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run(train_cmd(empty, tmp_path / "ck", "--max-update", "1", "-s", "de", "-t", "en"), check=False)
    assert proc.returncode != 0 and "dict.de.txt" in proc.stderr
    dicts_only = tmp_path / "dicts_only"
    dicts_only.mkdir()
    for lang in ("de", "en"):
        (dicts_only / f"dict.{lang}.txt").write_text((data_bin / f"dict.{lang}.txt").read_text())
    proc = run(train_cmd(dicts_only, tmp_path / "ck", "--max-update", "1", "-s", "de", "-t", "en"), check=False)
    assert proc.returncode != 0 and re.search(r"Dataset not found: (train|valid)", proc.stderr)
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").glob("*.pt"))


def test_a_checkpoint_written_with_the_removed_compile_option_still_decodes(trained, data_bin, tmp_path):
    """A checkpoint whose ``cfg.model`` holds ``sdma_compile`` (written while ``--sdma-compile`` existed)
    decodes with ``fairseq-generate``: the key is ignored, the hypotheses are those without it."""
    save_dir, _ = trained
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert "sdma_compile" not in state["cfg"]["model"]
    state["cfg"]["model"]["sdma_compile"] = True
    old = tmp_path / "checkpoint_with_sdma_compile.pt"
    torch.save(state, old)

    def generate(path):
        out = run([venv_bin("fairseq-generate"), data_bin, "--user-dir", REPO / "user_dir", "--path", path,
                   "--beam", "2", "--gen-subset", "test", "--cpu", "--max-tokens", "2000",
                   "--required-batch-size-multiple", "1"])
        return sorted(line for line in out.stdout.splitlines() if line.startswith("H-"))

    hypotheses = generate(old)
    assert len(hypotheses) == 100 and hypotheses == generate(save_dir / "checkpoint_last.pt")


def test_the_triton_kernels_train_as_the_explicit_path_and_decode(data_bin, tmp_path):
    """``--sdma-attention-kernel triton`` under ``fairseq-train`` (Triton's interpreter here, where no GPU is: kept
    to 2 heads, 2 sentences a batch and 2 updates, as every program of a grid runs in Python): the same losses,
    update by update, as the explicit path from the same seed, and its checkpoint decodes with ``fairseq-interactive``
    (incremental decoding: one query a step over the cached keys). Without eq. (8)'s noise: the kernel draws it from
    Philox, the explicit path from torch's generator (the kernel's draw is held to its own reference in
    test_sdma_triton_kernels.py)."""
    small = ["--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--batch-size", "2",
             "--max-update", "2", "--disable-validation", "--no-save-optimizer-state", "--no-epoch-checkpoints",
             "--sdma-noise-var", "0"]
    runs = {}
    for kernel in ("explicit", "triton"):
        proc = run(train_cmd(data_bin, tmp_path / kernel, *small, "--sdma-attention-kernel", kernel))
        runs[kernel] = losses(proc.stdout + proc.stderr)
    assert len(runs["triton"]) == 2
    assert runs["triton"] == pytest.approx(runs["explicit"], abs=2e-3)  # the log's 3 decimals
    decoded = subprocess.run(
        [venv_bin("fairseq-interactive"), str(data_bin), "--user-dir", str(REPO / "user_dir"), "--path",
         str(tmp_path / "triton" / "checkpoint_last.pt"), "--beam", "2", "--cpu", "--source-lang", "de",
         "--target-lang", "en", "--max-len-b", "5"],
        input="▁Das ▁ist ▁gut .\n▁Ich ▁bin ▁hier .\n", capture_output=True, text=True)
    assert decoded.returncode == 0, decoded.stderr[-3000:]
    assert len([line for line in decoded.stdout.splitlines() if line.startswith("H-")]) == 2
