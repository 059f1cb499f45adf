"""ESPnet under torch's distributed launcher on CPUs: ``torchrun --nproc_per_node 2 -m espnet_plugin.bin.asr_train
--ngpu 0 --dist_backend gloo`` (ESPnet reads WORLD_SIZE / RANK / MASTER_* from the environment:
espnet2/train/distributed_utils.py) trains as one process does with the same global batch.

ESPnet splits each global mini-batch across the ranks (``batch[rank::world_size]``, espnet2/tasks/abs_task.py),
averages the stats weighted by the ranks' batch sizes and scales the loss so that DDP's mean gradient is the global
batch's. So with the same ``--batch_size`` the two runs see the same batches, and the logged losses and the trained
parameters agree to fp32 round-off (measured: at most 4e-7 apart after 4 steps that moved the parameters by 9e-3 at
the median, 0.24 at most). Nothing random may differ between them: no dropout, and SDMA's sampling noise off
(``noise_var: 0`` in the paper reading; the authors reading always samples). The optimizer is SGD: Adam divides each
gradient by its own scale, so the round-off in gradients that are zero in exact arithmetic (the key projections'
biases: a softmax ignores a shift shared by all keys) became steps of the learning rate's size (3e-4 apart).
"""

import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

pytest.importorskip("espnet2")

from conftest import REPO, venv_bin  # noqa: E402

CHARS = list("一二三四五六七八九十")
BATCH = 4  # the global mini-batch; each of the 2 ranks gets 2 of its utterances


def write_split(root, split, n, rng):
    """A Kaldi-style data directory of ``n`` noise utterances of 0.4 s (16 kHz) with 2-5 random characters, and the
    shape files ESPnet's samplers read. The audio is all one length: ESPnet's STFT (``center=True``) pads each
    waveform's end by reflection only where it is the longest of its batch, so the features of shorter waveforms
    depend on the batch they are in, and a rank's half batch is not the global batch."""
    import soundfile

    data = root / split
    data.mkdir(parents=True)
    wav_scp, text, speech_shape, text_shape = [], [], [], []
    for i in range(n):
        uid = f"{split}{i:02d}"
        audio = (0.1 * rng.standard_normal(6400)).astype(np.float32)
        soundfile.write(data / f"{uid}.wav", audio, 16000)
        chars = list(rng.choice(CHARS, size=int(rng.integers(2, 6))))
        wav_scp.append(f"{uid} {data / f'{uid}.wav'}")
        text.append(f"{uid} {''.join(chars)}")
        speech_shape.append(f"{uid} {len(audio)}")
        text_shape.append(f"{uid} {len(chars)},{len(CHARS) + 3}")
    for name, lines in (("wav.scp", wav_scp), ("text", text), ("speech_shape", speech_shape),
                        ("text_shape.char", text_shape)):
        (data / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return data


def tiny_config():
    """SDMA-T (paper reading, no sampling noise), 1 + 1 layers of width 32, no dropout, SGD at a fixed rate."""
    sdma = {"mode": "sdma", "reading": "paper", "clusters": 3, "query_clusters": 3, "noise_var": 0.0,
            "mix_rate": 0.5}
    no_dropout = {"dropout_rate": 0.0, "positional_dropout_rate": 0.0}
    return {
        "frontend": "default", "frontend_conf": {"n_fft": 400, "hop_length": 160, "n_mels": 40, "fs": "16k"},
        "encoder": "sdma_transformer",
        "encoder_conf": {"output_size": 32, "attention_heads": 2, "linear_units": 64, "num_blocks": 1,
                         "attention_dropout_rate": 0.0, "input_layer": "conv2d", "sdma_conf": sdma, **no_dropout},
        "decoder": "sdma_transformer",
        "decoder_conf": {"attention_heads": 2, "linear_units": 64, "num_blocks": 1, "self_attention_dropout_rate": 0.0,
                         "src_attention_dropout_rate": 0.0, "sdma_conf": sdma, **no_dropout},
        "model": "sdma", "model_conf": {"ctc_weight": 0.3, "lsm_weight": 0.1, "length_normalized_loss": False},
        "batch_type": "unsorted", "batch_size": BATCH, "max_epoch": 1, "log_interval": 1, "num_att_plot": 0,
        "optim": "sgd", "optim_conf": {"lr": 0.1}, "seed": 0,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same training as one process and under ``torchrun --nproc_per_node 2`` (both at once):
    {"single" | "torchrun": (output_dir, rank 0's log)}."""
    root = tmp_path_factory.mktemp("espnet_torchrun")
    rng = np.random.default_rng(0)
    train, valid = write_split(root, "train", 4 * BATCH, rng), write_split(root, "valid", BATCH, rng)
    tokens = root / "tokens.txt"
    tokens.write_text("".join(f"{t}\n" for t in ["<blank>", "<unk>", *CHARS, "<sos/eos>"]), encoding="utf-8")
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(), allow_unicode=True), encoding="utf-8")

    def train_args(out):
        args = ["-m", "espnet_plugin.bin.asr_train", "--config", config, "--output_dir", out, "--ngpu", "0",
                "--use_preprocessor", "true", "--token_type", "char", "--token_list", tokens, "--cleaner", "none",
                "--g2p", "none", "--non_linguistic_symbols", "none", "--num_workers", "0",
                "--use_tensorboard", "false", "--resume", "false"]
        for split, data in (("train", train), ("valid", valid)):
            args += [f"--{split}_data_path_and_name_and_type", f"{data / 'wav.scp'},speech,sound",
                     f"--{split}_data_path_and_name_and_type", f"{data / 'text'},text,text",
                     f"--{split}_shape_file", data / "speech_shape", f"--{split}_shape_file", data / "text_shape.char"]
        return args

    commands = {
        "single": [sys.executable, *train_args(root / "single")],
        "torchrun": [venv_bin("torchrun"), "--standalone", "--nnodes", "1", "--nproc_per_node", "2",
                     *train_args(root / "torchrun"), "--dist_backend", "gloo"],
    }
    procs = {name: subprocess.Popen([str(c) for c in command], cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for name, command in commands.items()}
    logs = {name: proc.communicate(timeout=600)[0] for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}:\n{logs[name][-4000:]}"
    return {name: (root / name, logs[name]) for name in commands}


def step_losses(log):
    """The train loss of every iteration, as rank 0 logs it (log_interval 1)."""
    return [float(m.group(1)) for m in re.finditer(r"1epoch:train:\d+-\d+batch:.*?\bloss=([-+0-9.e]+)", log)]


def test_torchrun_trains_distributed_with_one_process_losses(runs):
    (_, single_log), (_, dist_log) = runs["single"], runs["torchrun"]
    assert ":0/2]" in dist_log, dist_log[-3000:]  # ESPnet's log prefix [host:rank/world_size]: it ran distributed
    single, dist = step_losses(single_log), step_losses(dist_log)
    assert len(single) == len(dist) == 4, (single, dist)  # 16 utterances, global batches of 4
    np.testing.assert_allclose(dist, single, rtol=1e-4)  # ESPnet logs 3 decimals (losses ~40)


def test_torchrun_parameters_equal_one_process(runs):
    import torch

    single = torch.load(runs["single"][0] / "1epoch.pth", map_location="cpu", weights_only=True)
    dist = torch.load(runs["torchrun"][0] / "1epoch.pth", map_location="cpu", weights_only=True)
    assert set(single) == set(dist) and int(dist["num_updates"]) == int(single["num_updates"]) == 4
    for name, value in single.items():
        if value.is_floating_point():
            torch.testing.assert_close(dist[name], value, rtol=1e-4, atol=1e-6, msg=name)
