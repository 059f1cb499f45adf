"""Integration: the ESPnet recipe stages on synthetic Mandarin speech, SDMA and vanilla, tiny.

Runs ``examples/aishell_sdma/asr1/run_synthetic.py`` (the driver ``experiments.espnet.synthetic_asr``:
ESPnet's own entry points for tokenize_text, collect_stats, training and joint CTC/attention decoding), then decodes
with ``Speech2Text`` from Python and measures LR/HR on the trained SDMA model.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, free_port

pytest.importorskip("espnet2")
pytestmark = pytest.mark.skipif(
    shutil.which("espeak-ng") is None or shutil.which("sox") is None,
    reason="needs espeak-ng and sox (apt-get install espeak-ng sox)",
)

from espnet_plugin.tools import redundancy  # noqa: E402
from experiments.espnet import synthetic_asr as driver  # noqa: E402

RECIPE = REPO / "examples" / "aishell_sdma" / "asr1"


def write_tiny_configs(conf_dir):
    conf_dir.mkdir(parents=True)
    for name in ("train_asr_sdma_transformer.yaml", "train_asr_transformer.yaml", "decode_asr.yaml"):
        config = yaml.safe_load((RECIPE / "conf" / "synthetic" / name).read_text(encoding="utf-8"))
        if "encoder_conf" in config:
            config["encoder_conf"].update(output_size=32, attention_heads=2, linear_units=64, num_blocks=1)
            config["decoder_conf"].update(attention_heads=2, linear_units=64, num_blocks=1)
            config["frontend_conf"]["n_mels"] = 40
            config.update(max_epoch=2, batch_size=4, keep_nbest_models=1)
        else:
            config["beam_size"] = 2
        (conf_dir / name).write_text(yaml.safe_dump(config), encoding="utf-8")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("asr_pipeline")
    write_tiny_configs(root / "conf")
    work = root / "work"
    out = subprocess.run(
        [sys.executable, str(RECIPE / "run_synthetic.py"), "--work-dir", str(work), "--conf-dir", str(root / "conf"),
         "--num-sentences", "12"],
        capture_output=True, text=True, cwd=REPO, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return work, out.stdout


def test_driver_prints_cer_for_sdma_and_vanilla(pipeline):
    work, stdout = pipeline
    assert "system" in stdout and "CER %" in stdout
    summary = json.loads((work / "results.json").read_text())
    results = summary["results"]
    assert set(results) == {"sdma", "vanilla"} and set(summary["comparisons"]) == {"sdma - vanilla"}
    assert "sdma - vanilla:" in stdout and "paired bootstrap over the" in stdout
    n_test = len((work / "corpus" / "data" / "test" / "text").read_text(encoding="utf-8").splitlines())
    for system, result in results.items():
        assert result["utterances"] == n_test and result["ref_chars"] > 0
        assert result["cer"] == pytest.approx(100.0 * result["edits"] / result["ref_chars"])
        assert result["cer_interval"][0] <= result["cer"] <= result["cer_interval"][1]
        hyps = (work / "exp" / system / "decode_test" / "1best_recog" / "text").read_text(encoding="utf-8")
        assert len(hyps.splitlines()) == n_test
    config = yaml.safe_load((work / "exp" / "sdma" / "config.yaml").read_text(encoding="utf-8"))
    assert (config["encoder"], config["decoder"], config["model"]) == ("sdma_transformer", "sdma_transformer", "sdma")
    log = (work / "logs" / "train_sdma.log").read_text(encoding="utf-8")
    assert "sdma_dqq=" in log and "sdma_reg=" in log  # the regularisers are reported as stats


def test_speech2text_decodes_with_the_plugin_and_matches_the_cli(pipeline):
    import soundfile
    from espnet2.bin.asr_inference import Speech2Text
    from espnet.nets.batch_beam_search import BatchBeamSearch

    import espnet_plugin  # noqa: F401
    from espnet_plugin.asr.decoder.sdma_transformer_decoder import SDMATransformerDecoder

    work, _ = pipeline
    exp = work / "exp" / "sdma"
    speech2text = Speech2Text(asr_train_config=exp / "config.yaml", asr_model_file=driver.trained_model(work, "sdma"),
                              device="cpu", beam_size=2, ctc_weight=0.5, nbest=1)
    assert isinstance(speech2text.asr_model.decoder, SDMATransformerDecoder)
    assert isinstance(speech2text.beam_search, BatchBeamSearch)
    assert "ctc" in speech2text.beam_search.full_scorers or "ctc" in speech2text.beam_search.part_scorers
    uttid, wav = (work / "corpus" / "data" / "test" / "wav.scp").read_text().splitlines()[0].split(maxsplit=1)
    speech, rate = soundfile.read(wav)
    assert rate == 16000
    text = speech2text(speech)[0][0]
    cli = driver.read_kaldi_text(exp / "decode_test" / "1best_recog" / "text")
    assert (text or "").replace(" ", "") == cli[uttid]


def test_attention_redundancy_on_the_espnet_model(pipeline):
    work, _ = pipeline
    result = redundancy.espnet_attention_redundancy(
        work / "exp" / "sdma" / "config.yaml", driver.trained_model(work, "sdma"), work / "corpus" / "data" / "test")
    for kind in ("encoder_self", "decoder_self", "decoder_cross"):
        assert 0.0 <= result[kind]["LR"] <= 1.0 + 1e-6  # log2(2 heads)
        assert 0.0 <= result[kind]["HR"] <= 1.0 + 1e-6


def test_mismatched_token_list_and_feature_size_are_refused(pipeline, tmp_path):
    work, _ = pipeline
    exp = work / "exp" / "sdma"
    model = driver.trained_model(work, "sdma")
    config = yaml.safe_load((exp / "config.yaml").read_text(encoding="utf-8"))
    short = dict(config, token_list=config["token_list"][:-3])
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(short), encoding="utf-8")
    with pytest.raises(driver.PipelineError, match="token list does not match the model"):
        driver.check_model_files(tmp_path / "short.yaml", model)
    wide = dict(config, frontend_conf=dict(config["frontend_conf"], n_mels=80))
    (tmp_path / "wide.yaml").write_text(yaml.safe_dump(wide), encoding="utf-8")
    with pytest.raises(driver.PipelineError, match="feature dimension does not match the config"):
        driver.check_model_files(tmp_path / "wide.yaml", model)
    with pytest.raises(driver.PipelineError, match="missing"):
        driver.check_model_files(exp / "config.yaml", tmp_path / "nope.pth")


def test_bad_data_directories_name_the_file(tmp_path):
    data = tmp_path / "train"
    data.mkdir()
    with pytest.raises(driver.PipelineError, match=r"wav\.scp: missing"):
        driver.check_data_dir(data)
    (data / "wav.scp").write_text(f"u1 {tmp_path / 'u1.wav'}\n")
    (data / "text").write_text("")
    with pytest.raises(driver.PipelineError, match=r"text: empty"):
        driver.check_data_dir(data)
    (data / "text").write_text("u1 你好\nu2 再见\n")
    with pytest.raises(driver.PipelineError, match="utterance u2"):
        driver.check_data_dir(data)
    (data / "text").write_text("u1 你好\n")
    with pytest.raises(driver.PipelineError, match="u1.wav does not exist"):
        driver.check_data_dir(data)


def test_driver_rejects_impossible_options(tmp_path):
    with pytest.raises(SystemExit):
        driver.parse_args(["--num-sentences", "0"])
    with pytest.raises(SystemExit):
        driver.parse_args(["--conf-dir", str(tmp_path)])


def train_command(work, out, launcher=("-m", "espnet_plugin.bin.asr_train")):
    """The recipe's training command (tiny SDMA config) on the pipeline's data, into ``out``."""
    data, stats = work / "corpus" / "data", work / "stats"
    command = [sys.executable, *launcher, "--use_preprocessor", "true", "--token_type", "char",
               "--token_list", str(work / "tokens.txt"), "--non_linguistic_symbols", "none", "--cleaner", "none",
               "--g2p", "none", "--ngpu", "0", "--num_workers", "0", "--use_tensorboard", "false",
               "--config", str(work.parent / "conf" / "train_asr_sdma_transformer.yaml"), "--output_dir", str(out),
               "--frontend_conf", "fs=16k", "--normalize", "global_mvn",
               "--normalize_conf", f"stats_file={stats / 'train' / 'feats_stats.npz'}",
               "--train_shape_file", str(stats / "train" / "speech_shape"),
               "--train_shape_file", str(stats / "train" / "text_shape.char"),
               "--valid_shape_file", str(stats / "valid" / "speech_shape"),
               "--valid_shape_file", str(stats / "valid" / "text_shape.char"),
               "--fold_length", "80000", "--fold_length", "150", "--max_epoch", "1"]
    for split, prefix in (("train", "train"), ("dev", "valid")):
        command += [f"--{prefix}_data_path_and_name_and_type", f"{data / split / 'wav.scp'},speech,sound",
                    f"--{prefix}_data_path_and_name_and_type", f"{data / split / 'text'},text,text"]
    return command


class CodeRunningPickle:
    """Unpickling it runs a shell command (``__reduce__`` -> ``os.system``)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        import os

        return (os.system, (self.command,))


def malicious_model_file(path, marker):
    """A model file whose pickle creates ``marker`` when loaded with ``weights_only=False``."""
    import torch

    torch.save({"encoder.embed.0.weight": CodeRunningPickle(f"touch {marker}")}, path)
    return path


def assert_refused(proc, marker, path):
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-2000:]
    assert "UnsafeModelFileError" in output and f"refused to load {path}" in output, output[-3000:]
    assert "posix.system" in output
    assert not marker.exists(), "the payload ran"


def test_malicious_model_file_is_refused_on_every_espnet_entry_point(pipeline, tmp_path):
    """asr_inference (direct and through the asr.sh shim), --resume, --init_param, the redundancy
    script and Speech2Text-style loading through the task: the payload never runs."""
    from espnet_plugin.safe_loading import UnsafeModelFileError
    from espnet_plugin.tasks.sdma_asr import SDMAASRTask

    work, _ = pipeline
    exp, data = work / "exp" / "sdma", work / "corpus" / "data"
    marker = tmp_path / "payload_ran"
    evil = malicious_model_file(tmp_path / "evil.pth", marker)

    def run_cli(command):
        return subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=REPO, timeout=600)

    decode = ["--ngpu", "0", "--batch_size", "1", "--asr_train_config", exp / "config.yaml", "--asr_model_file", evil,
              "--data_path_and_name_and_type", f"{data / 'test' / 'wav.scp'},speech,sound",
              "--key_file", data / "test" / "wav.scp", "--output_dir", tmp_path / "decode"]
    assert_refused(run_cli([sys.executable, "-m", "espnet_plugin.bin.asr_inference", *decode]), marker, evil)
    assert_refused(run_cli([sys.executable, "-m", "espnet_plugin.bin.python_shim", "-m", "espnet2.bin.asr_inference",
                            *decode]), marker, evil)
    # any command the shim runs for asr.sh, even one asking for weights_only=False
    assert_refused(run_cli([sys.executable, "-m", "espnet_plugin.bin.python_shim", "-c",
                            f"import torch; torch.load({str(evil)!r}, weights_only=False)"]), marker, evil)
    assert_refused(run_cli([Path(sys.executable).with_name("sdma-espnet-redundancy"),
                            "--asr-train-config", exp / "config.yaml", "--asr-model-file", evil,
                            "--data-dir", data / "test"]), marker, evil)

    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    malicious_model_file(resume_dir / "checkpoint.pth", marker)
    assert_refused(run_cli(train_command(work, resume_dir) + ["--resume", "true"]), marker,
                   resume_dir / "checkpoint.pth")
    assert_refused(run_cli(train_command(work, tmp_path / "init") + ["--init_param", str(evil)]), marker, evil)

    with pytest.raises(UnsafeModelFileError, match="posix.system"):
        SDMAASRTask.build_model_from_file(exp / "config.yaml", evil, "cpu")
    assert not marker.exists()


def test_real_checkpoints_load_with_the_allow_list(pipeline):
    """The resume state and the model files ESPnet wrote pass the safe loader; torch.load is restored after."""
    import torch

    from espnet_plugin.safe_loading import espnet_checkpoint_types, weights_only_loading

    work, _ = pipeline
    exp = work / "exp" / "sdma"
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in espnet_checkpoint_types()}
    # in a fresh interpreter: this one has registered the allow-list already
    unsafe = set(json.loads(subprocess.run(
        [sys.executable, "-c", "import json, sys, torch; print(json.dumps("
         "torch.serialization.get_unsafe_globals_in_checkpoint(sys.argv[1])))", str(exp / "checkpoint.pth")],
        capture_output=True, text=True, check=True).stdout))
    assert "datetime.timedelta" in unsafe and unsafe <= allowed
    original = torch.load
    with weights_only_loading():
        assert torch.load is not original
        state = torch.load(exp / "checkpoint.pth", map_location="cpu", weights_only=False)  # forced safe
        model = torch.load(driver.trained_model(work, "sdma"), map_location="cpu")
    assert torch.load is original
    assert {"model", "reporter", "optimizers", "schedulers"} <= set(state)
    assert "num_updates" in state["model"] and "num_updates" in model


def test_two_process_cpu_training_with_espnets_distributed_launcher(pipeline, tmp_path):
    """ESPnet DDP (gloo, 2 CPU processes): same stat keys on both ranks, update counter = optimizer steps."""
    import torch

    work, _ = pipeline
    port = free_port()
    out = tmp_path / "ddp"
    base = train_command(work, out) + [
        "--multiprocessing_distributed", "false", "--dist_world_size", "2", "--dist_backend", "gloo",
        "--dist_init_method", f"tcp://127.0.0.1:{port}"]
    procs = [subprocess.Popen(base + ["--dist_rank", str(r), "--local_rank", str(r)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank}:\n{log[-3000:]}"
    results = [line for line in logs[0].splitlines() if "1epoch results" in line]
    assert results and "sdma_dqq=" in results[0] and "sdma_reg=" in results[0]
    steps = int(results[0].split("total_count=")[1].split(",")[0])
    state = torch.load(out / "1epoch.pth", map_location="cpu", weights_only=True)
    assert steps > 0 and int(state["num_updates"]) == steps


def test_use_tensorboard_writes_the_sdma_stats(pipeline, tmp_path):
    """``--use_tensorboard true`` (needs the ``tensorboard`` package, in pyproject.toml): ESPnet's
    event files under OUT/tensorboard/{train,valid} hold the SDMA regularisers of the reporter."""
    import math

    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    from latent_core.sdma import LOSS_NAMES

    work, _ = pipeline
    out = tmp_path / "tb"
    proc = subprocess.run(train_command(work, out) + ["--use_tensorboard", "true"],  # argparse: the last one wins
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))["use_tensorboard"] is True
    for split in ("train", "valid"):
        acc = EventAccumulator(str(out / "tensorboard" / split), size_guidance={SCALARS: 0})
        acc.Reload()
        tags = set(acc.Tags()[SCALARS])
        expected = {"loss", "sdma_reg", "sdma_mix"} | {f"sdma_{name}" for name in LOSS_NAMES}
        assert expected <= tags, (split, sorted(expected - tags), sorted(tags))
        assert all(math.isfinite(e.value) for tag in expected for e in acc.Scalars(tag)), split


def test_the_removed_compile_option_stops_espnets_trainer_saying_why(pipeline, tmp_path):
    """``sdma_conf: {compile: ...}`` (an option SDMA no longer has): ESPnet's trainer stops before training with
    one line naming the YAML key and why it was removed, exit status 2, no traceback."""
    work, _ = pipeline
    config = yaml.safe_load((work.parent / "conf" / "train_asr_sdma_transformer.yaml").read_text(encoding="utf-8"))
    config["encoder_conf"]["sdma_conf"]["compile"] = False
    removed_config = tmp_path / "train_with_compile.yaml"
    removed_config.write_text(yaml.safe_dump(config), encoding="utf-8")
    command = train_command(work, tmp_path / "out")
    command[command.index("--config") + 1] = str(removed_config)
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "error: encoder_conf.sdma_conf.compile: this option was removed: running SDMA's training through " \
           "torch.compile took minutes" in last, proc.stderr[-2000:]
    assert not list((tmp_path / "out").glob("*.pth"))
