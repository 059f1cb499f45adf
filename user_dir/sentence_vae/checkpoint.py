"""Loading a sentence-VAE checkpoint for the tools (``vae-eval``: :mod:`user_dir.tools.sentence_vae.evaluate`,
``vae-generate``: :mod:`user_dir.tools.sentence_vae.generate`, and the reconstructions of :mod:`.decoding`)."""

from typing import Optional

import torch
from fairseq import checkpoint_utils

from .base import SentenceVAEModel


def load_sentence_vae(path: str, data: Optional[str] = None, cpu: bool = False):
    """(model in eval mode on its device, task, saved cfg) from a fairseq checkpoint.

    ``data`` overrides the checkpoint's data directory (where ``dict.txt`` and the splits are).
    """
    overrides = {"data": data} if data else None
    try:
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"loading {path}: {err}") from err
    model = models[0]
    if not isinstance(model, SentenceVAEModel):
        raise TypeError(f"{path} holds a {type(model).__name__}, not a sentence VAE "
                        "(see user_dir/sentence_vae/base.py)")
    device = torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")
    model.to(device).eval()
    return model, task, cfg


def model_device(model) -> torch.device:
    return next(model.parameters()).device
