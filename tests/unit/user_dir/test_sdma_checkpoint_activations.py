"""``--checkpoint-activations`` (and ``--offload-activations``) train the same model: loss and every
gradient equal those without checkpointing, for SDMA (both readings) and SMA, in ``sdma_transformer``
and ``bert_fused_transformer`` (both fusions), with noise and dropout on (the recomputation replays
the first pass's RNG state).

fairseq's own ``checkpoint_wrapper`` runs the first forward under ``no_grad``: the regularisers the
SDMA modules record there would reach the criterion without a graph (the query GMMs got no gradient).
"""

import pytest
import torch
from fairseq.modules.checkpoint_activations import unwrap_checkpoint

from test_bert_fused import batch as bert_batch
from test_bert_fused import bert_dir  # noqa: F401 (fixture)
from test_bert_fused import build as bert_build
from test_sdma_fairseq import batch, build, criterion_sample

MODES = {
    "sdma-authors": ["--sdma-mode", "sdma", "--sdma-reading", "authors"],
    "sdma-paper": ["--sdma-mode", "sdma", "--sdma-reading", "paper"],
    "sma": ["--sdma-mode", "sma"],
}
TRAINING = ["--dropout", "0.1", "--attention-dropout", "0.1"]


def loss_and_gradients(model, task, args, sample):
    criterion = task.build_criterion(args)
    model.train()
    model.set_num_updates(1500)  # g = 0.53: the mask matters
    torch.manual_seed(7)  # the same noise and dropout in both runs
    loss, _, log = criterion(model, sample)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), log, grads


def assert_same_training(plain, checkpointed):
    (loss_a, log_a, grads_a), (loss_b, log_b, grads_b) = plain, checkpointed
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    for key in ("sdma_reg", "sdma_kl_q", "sdma_dqq"):
        assert float(log_b[key]) == pytest.approx(float(log_a[key]), rel=1e-5, abs=1e-6), key
    assert grads_a.keys() == grads_b.keys()
    gmm = [n for n in grads_a if "query_gmm" in n or "feature_gmm" in n]
    assert gmm and all(grads_a[n].abs().sum() > 0 for n in gmm)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("offload", [False, True], ids=["checkpoint", "offload"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_checkpointing_trains_the_same_sdma_transformer(tmp_path, mode, offload):
    flags = ["--checkpoint-activations"] + (["--offload-activations"] if offload else [])
    runs = []
    for extra in ([], flags):
        model, task, args = build(tmp_path, *MODES[mode], *TRAINING, *extra)
        src, lengths, prev = batch(task)
        runs.append(loss_and_gradients(model, task, args, criterion_sample(task, src, lengths, prev)))
        layers = [*model.encoder.layers, *model.decoder.layers]
        assert all(hasattr(layer, "precheckpoint_forward") == bool(extra) for layer in layers)
    assert_same_training(*runs)


@pytest.mark.parametrize("fusion", ["embed", "attention"])
@pytest.mark.parametrize("mode", ["sdma-authors", "sma"])
def test_checkpointing_trains_the_same_bert_fused_transformer(tmp_path, bert_dir, mode, fusion):  # noqa: F811
    runs = []
    for extra in ([], ["--checkpoint-activations"]):
        model, task, args = bert_build(tmp_path / f"run{len(runs)}", bert_dir, *MODES[mode], *TRAINING,
                                       "--bert-fusion", fusion, *extra)
        src, lengths, prev = bert_batch(task)
        runs.append(loss_and_gradients(model, task, args, criterion_sample(task, src, lengths, prev)))
    assert_same_training(*runs)


def test_fairseqs_unwrap_undoes_the_wrapper(tmp_path):
    model, task, args = build(tmp_path, "--checkpoint-activations")
    unwrap_checkpoint(model)
    assert not any(hasattr(layer, "precheckpoint_forward") for layer in model.encoder.layers)
    src, lengths, prev = batch(task)
    model.eval()
    with torch.no_grad():
        model(src, lengths, prev)
