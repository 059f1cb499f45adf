"""fairseq's FP16Optimizer (``--fp16``) on SDMA and QKVAE, on the CPU: fp16 weights, fp32 master
copies, a dynamic loss scale, an overflow skipped with the scale halved, then finite updates.

What ``Trainer.train_step`` does with the optimizer is replayed here step by step
(``optimizer.backward`` scales the loss, ``clip_grad_norm`` unscales and raises ``OverflowError`` on
inf/NaN gradients after lowering the scale, ``step`` updates the fp32 masters and copies them back):
fairseq 0.12's trainer itself cannot take the overflow branch on a CPU (it builds
``torch.tensor(0.0).cuda()`` there), so the end-to-end ``fairseq-train --fp16`` run, overflow
included, is in the GPU tier (``tests/gpu/test_fairseq_gpu.py``). The fp32 masters are kept per
parameter (``--fp16-no-flatten-grads``): fairseq's flat master buffer is allocated on
``torch.cuda.current_device()``; the loss scaling and overflow logic are the same code.
"""

import math

import pytest
import torch
from fairseq import optim, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from test_qkvae import batch as vae_batch
from test_qkvae import build as vae_build
from test_sdma_fairseq import batch, build, criterion_sample


def fp16_optimizer(model, init_scale: float):
    argv = ["data", "--task", "translation", "--arch", "transformer", "--optimizer", "adam", "--lr", "1e-3",
            "--fp16", "--fp16-init-scale", str(int(init_scale)), "--fp16-scale-window", "1000",
            "--fp16-no-flatten-grads"]  # the flat fp32 master buffer is allocated with torch.cuda
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    params = [p for p in model.parameters() if p.requires_grad]
    return optim.FP16Optimizer.build_optimizer(cfg, params)


def run_fp16_updates(model, loss_fn, steps: int, init_scale: float):
    """The trainer's optimizer calls; returns (losses, number of skipped updates, final loss scale)."""
    model.half().train()
    optimizer = fp16_optimizer(model, init_scale)
    losses, skipped = [], 0
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn()
        optimizer.backward(loss)  # loss x scale
        try:
            optimizer.clip_grad_norm(0.0)  # unscales; OverflowError on inf/NaN (scale lowered)
            optimizer.step()
        except OverflowError:
            skipped += 1
        losses.append(float(loss.detach().float()))
    return losses, skipped, optimizer.scaler.loss_scale


def sdma_case(tmp_path):
    model, task, args = build(tmp_path, "--sdma-mode", "sdma")
    model.set_num_updates(2000)
    criterion = task.build_criterion(args)
    sample = criterion_sample(task, *batch(task))
    return model, lambda: criterion(model, sample)[0] / sample["ntokens"]


def qkvae_case(tmp_path):
    model, d = vae_build("qkvae", word_dropout=0.0)
    src, lengths, prev, target = vae_batch(d)

    def loss_fn():
        logits, extra = model(src, lengths, prev)
        kl = sum(q.kl_standard_normal().float().sum(-1).mean() for q in extra["posteriors"].values())
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), target, ignore_index=d.pad())
        return nll + 0.1 * kl

    return model, loss_fn


CASES = {"sdma": sdma_case, "qkvae": qkvae_case}


@pytest.mark.parametrize("family", sorted(CASES))
def test_fp16_optimizer_scales_updates_and_trains(tmp_path, family):
    model, loss_fn = CASES[family](tmp_path)
    losses, skipped, scale = run_fp16_updates(model, loss_fn, steps=8, init_scale=128)
    assert skipped == 0 and scale == 128
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert all(p.dtype == torch.float16 for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CASES))
def test_fp16_overflow_is_skipped_and_the_scale_comes_down(tmp_path, family):
    model, loss_fn = CASES[family](tmp_path)
    before = [p.detach().half() for p in model.parameters()]
    losses, skipped, scale = run_fp16_updates(model, loss_fn, steps=1, init_scale=2.0 ** 40)
    assert skipped == 1 and scale == 2.0 ** 39  # fp16 gradients x 2^40 overflow: update skipped, scale halved
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # nothing applied
    model, loss_fn = CASES[family](tmp_path)
    losses, skipped, scale = run_fp16_updates(model, loss_fn, steps=30, init_scale=2.0 ** 24)
    assert 0 < skipped < 30 and scale < 2.0 ** 24  # halved until the scaled gradients fit fp16, then trains
    assert all(math.isfinite(v) for v in losses)
