"""fairseq-hydra-train runs the SDMA translation config of examples/ and builds the same model
as fairseq-train with the same architecture (the options come from one dataclass). fairseq-hydra-train
reads the model's fields, not an architecture's: the row of Table I is written out under model."""

import torch

from conftest import REPO, run_checked, venv_bin
from user_dir.model_config import config_fields
from user_dir.sdma.model import SDMATransformerConfig

CONFIG_DIR = REPO / "examples" / "sdma_translation" / "config"
TINY = {"encoder_layers": 1, "decoder_layers": 1, "encoder_embed_dim": 32, "decoder_embed_dim": 32,
        "encoder_ffn_embed_dim": 64, "decoder_ffn_embed_dim": 64}
# the rest of sdma_transformer_iwslt_de_en_tiny's row in the authors reading (their scripts' lambda_q and
# lambda_x; the YAML has its 4 heads): keys the YAML does not set, added with +
TINY_ROW = {"sdma_dqq_weight": 100.0, "sdma_dxq_weight": 10.0}


def _checkpoint(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_hydra_config_trains_the_table_one_model(tmp_path, small_translation_bin):
    save_dir = tmp_path / "hydra"
    proc = run_checked(
        [venv_bin("fairseq-hydra-train"), "--config-dir", CONFIG_DIR, "--config-name", "iwslt14_de_en",
         f"common.user_dir={REPO / 'user_dir'}", f"task.data={small_translation_bin}",
         *(f"model.{k}={v}" for k, v in TINY.items()), *(f"+model.{k}={v}" for k, v in TINY_ROW.items()),
         "optimization.max_update=2", "dataset.max_tokens=512", f"checkpoint.save_dir={save_dir}",
         "common.cpu=true", "common.log_interval=1", "checkpoint.no_epoch_checkpoints=true"],
        cwd=tmp_path,  # hydra writes its outputs/ folder here
    )
    log = proc.stdout + proc.stderr
    assert "sdma_kl_z=" in log and "sdma_dxq=" in log, log[-2000:]
    hydra = _checkpoint(save_dir / "checkpoint_last.pt")
    model_cfg = hydra["cfg"]["model"]
    # the tiny row in the authors reading (default): n_c 4, their scripts' lambda_q 100, lambda_x 10, c_g 10, 5e-4
    assert model_cfg["sdma_reading"] == "authors"
    assert (model_cfg["sdma_clusters"], model_cfg["sdma_dqq_weight"], model_cfg["sdma_dxq_weight"]) == (4, 100.0, 10.0)
    assert (model_cfg["sdma_centroid_grad_scale"], model_cfg["sdma_mix_rate"]) == (10.0, 5e-4)

    argparse_dir = tmp_path / "argparse"
    run_checked([venv_bin("fairseq-train"), small_translation_bin, "--user-dir", REPO / "user_dir",
                 "--task", "translation", "--arch", "sdma_transformer_iwslt_de_en_tiny",
                 *(x for k, v in TINY.items() for x in (f"--{k.replace('_', '-')}", str(v))),
                 "--criterion", "sdma_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
                 "--optimizer", "adam", "--lr", "5e-4", "--max-update", "2", "--max-tokens", "512",
                 "--save-dir", argparse_dir, "--cpu", "--no-epoch-checkpoints"])
    plain = _checkpoint(argparse_dir / "checkpoint_last.pt")
    shapes = {k: tuple(v.shape) for k, v in hydra["model"].items()}
    assert shapes == {k: tuple(v.shape) for k, v in plain["model"].items()}
    assert any(".sdma.feature_gmm.means" in k for k in shapes)
    plain_cfg = plain["cfg"]["model"]
    assert (model_cfg["_name"], plain_cfg["_name"]) == ("sdma_transformer", "sdma_transformer_iwslt_de_en_tiny")
    fields = [f.name for f in config_fields(SDMATransformerConfig)]
    assert len([name for name in fields if name.startswith("sdma_")]) == 22  # SDMAOptions', per side, eq. (24), mask
    assert {name: model_cfg[name] for name in fields} == {name: plain_cfg[name] for name in fields}
