"""The Aishell-1 recipe's configs (examples/aishell_sdma/asr1/conf) are the authors' ESPnet1 setting where ESPnet2 can
express it, and ESPnet2 accepts every key: the optimizer's (their Noam Adam), the decoding's (Speech2Text's
arguments)."""

import inspect

import torch
import yaml

from conftest import REPO

CONF = REPO / "examples" / "aishell_sdma" / "asr1" / "conf"


def load(name):
    return yaml.safe_load((CONF / name).read_text(encoding="utf-8"))


def test_training_configs_use_their_optimizer_and_average_three():
    for name in ("tuning/train_asr_sdma_transformer.yaml", "tuning/train_asr_transformer.yaml"):
        config = load(name)
        assert config["optim"] == "adam" and config["scheduler"] == "warmuplr"
        optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], **config["optim_conf"])
        group = optimizer.param_groups[0]
        assert (tuple(group["betas"]), group["eps"], group["lr"]) == ((0.9, 0.98), 1e-9, 0.00079), name
        assert config["scheduler_conf"]["warmup_steps"] == 25000 and config["keep_nbest_models"] == 3, name
        assert (config["batch_size"], config["accum_grad"], config["grad_clip"], config["max_epoch"]) == (32, 2, 5, 20)


def test_decoding_config_is_theirs_and_speech2text_takes_every_key():
    from espnet2.bin.asr_inference import Speech2Text

    config = load("decode_asr_transformer.yaml")
    assert (config["beam_size"], config["ctc_weight"], config["lm_weight"], config["penalty"]) == (5, 0.5, 0.0, 0.0)
    assert set(config) <= set(inspect.signature(Speech2Text.__init__).parameters)


def test_run_sh_applies_their_speed_perturbation():
    assert '--speed_perturb_factors "0.9 1.0 1.1"' in (CONF.parent / "run.sh").read_text(encoding="utf-8")
