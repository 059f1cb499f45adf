"""The ``save_pretrained`` / ``from_pretrained_with_sdma`` round trip both model families' tests run."""

import torch

from transformers_plugin import from_pretrained_with_sdma


def save_and_reload(model, model_class, path):
    """Moves every trained parameter off its initial value (so nothing passes by being re-initialised alike), saves
    ``model`` to ``path``, reloads it as ``model_class`` and asserts that the SDMA options and every tensor of the
    state dict come back unchanged; returns the reloaded model."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:  # not Marian's sinusoidal positions, which from_pretrained recomputes
                parameter.add_(0.01 * torch.randn_like(parameter))
    model.save_pretrained(path)
    reloaded = from_pretrained_with_sdma(model_class, path)
    assert reloaded.config.sdma == model.config.sdma
    saved, loaded = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor, loaded[name]), name
    return reloaded
