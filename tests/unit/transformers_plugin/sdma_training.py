"""The short training run the ``attach_sdma`` tests of the model families share."""

import torch

from transformers_plugin import sdma_loss, set_sdma_updates


def assert_training_lowers_the_loss(model, batch, steps: int = 30, every_parameter_gets_a_gradient: bool = False):
    """Trains ``model`` with Adam (lr 3e-3) on its loss plus :func:`sdma_loss` for ``steps`` steps of ``batch(0)``,
    ``batch(1)``, ``batch(0)``, ... and asserts that its loss (the regularisers left out) drops by more than 0.5: the
    lowest of the last five steps against the first. ``every_parameter_gets_a_gradient``: and that the first step
    gives every parameter a gradient."""
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        set_sdma_updates(model, 2000 + step)
        optimizer.zero_grad()
        out = model(**batch(step % 2))
        (out.loss + sdma_loss(model)).backward()
        if step == 0 and every_parameter_gets_a_gradient:
            missing = [n for n, p in model.named_parameters() if p.grad is None]
            assert not missing, missing
        losses.append(float(out.loss.detach()))
        optimizer.step()
    assert min(losses[-5:]) < losses[0] - 0.5
