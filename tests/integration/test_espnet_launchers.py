"""The ESPnet plugin's launchers in fresh interpreters: spawned workers, one-line configuration errors, the asr.sh python shim, every option of ESPnet's entry points."""

import pickle
import subprocess
import sys

import pytest

pytest.importorskip("espnet2")

from espnet_plugin.tasks.sdma_asr import SDMAASRTask  # noqa: E402

from conftest import REPO  # noqa: E402

TOKENS = ["<blank>", "<unk>"] + list("一二三四五六七八九十") + ["<sos/eos>"]


def test_spawned_worker_target_registers_the_classes_on_unpickling():
    """Multi-GPU ESPnet pickles ``cls.main_worker``; a fresh interpreter must find the classes."""
    payload = pickle.dumps(SDMAASRTask.main_worker)
    code = (
        "import pickle, sys\n"
        "target = pickle.loads(sys.stdin.buffer.read())\n"
        "from espnet2.tasks.asr import encoder_choices, decoder_choices, model_choices\n"
        "assert encoder_choices.classes['sdma_transformer'].__name__ == 'SDMATransformerEncoder'\n"
        "assert decoder_choices.classes['sdma_transformer'].__name__ == 'SDMATransformerDecoder'\n"
        "assert model_choices.classes['sdma'].__name__ == 'ESPnetSDMAASRModel'\n"
        "print('ok', target.__self__.__name__, target.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert b"ok SDMAASRTask main_worker" in out.stdout


def test_configuration_errors_reach_the_user_as_one_line(tmp_path):
    """Through ESPnet's own launcher: exit status 2, ``asr_train.py: error: <key> ...``, no traceback."""
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("".join(f"{t}\n" for t in TOKENS), encoding="utf-8")
    command = [sys.executable, "-m", "espnet_plugin.bin.asr_train", "--dry_run", "true", "--ngpu", "0",
               "--token_list", tokens, "--token_type", "char", "--output_dir", tmp_path / "exp",
               "--encoder", "sdma_transformer", "--encoder_conf", "output_size=32", "--encoder_conf", "attention_heads=3",
               "--decoder", "sdma_transformer", "--model", "sdma"]
    for split in ("train", "valid"):  # required by ESPnet's parser; a dry run reads no data
        command += [f"--{split}_data_path_and_name_and_type", "wav.scp,speech,sound", f"--{split}_shape_file", "x"]
    out = subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "asr_train: error: encoder_conf.attention_heads=3 must be >= 1 and divide encoder_conf.output_size=32")


def test_python_shim_runs_espnet_tools_with_the_plugin():
    out = subprocess.run(
        [sys.executable, "-m", "espnet_plugin.bin.python_shim", "-m", "espnet2.bin.asr_train", "--help"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sdma_transformer" in out.stdout


def test_launchers_accept_every_option_of_espnets_entry_points():
    from espnet2.bin import asr_inference, asr_train

    from espnet_plugin.bin import asr_inference as plugin_inference
    from espnet_plugin.bin import asr_train as plugin_train

    def options(parser):
        return {s for action in parser._actions for s in action.option_strings}

    assert options(asr_train.get_parser()) <= options(plugin_train.get_parser())
    assert options(asr_inference.get_parser()) <= options(plugin_inference.get_parser())
