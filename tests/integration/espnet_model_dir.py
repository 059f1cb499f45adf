"""A tiny untrained ESPnet model directory with the plugin's SDMA encoder and decoder, as asr_train writes one
(``config.yaml`` + ``valid.acc.ave.pth``): what ``Speech2Text`` reads in the pages' snippets."""

from pathlib import Path

import torch
import yaml


def tiny_sdma_model_dir(directory: Path) -> Path:
    from tests.unit.espnet_plugin.test_sdma_espnet import tiny_args

    from espnet_plugin.tasks.sdma_asr import SDMAASRTask

    directory.mkdir(parents=True, exist_ok=True)
    args = tiny_args()
    torch.manual_seed(0)
    model = SDMAASRTask.build_model(args)
    with open(directory / "config.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump({k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, dict,
                                                                                   type(None)))}, f,
                       allow_unicode=True)
    torch.save(model.state_dict(), directory / "valid.acc.ave.pth")
    return directory
