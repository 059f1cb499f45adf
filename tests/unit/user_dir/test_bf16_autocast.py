"""Mixed precision on a CPU: a few training updates and a decoding under ``torch.autocast("cpu",
dtype=torch.bfloat16)`` (what ``--amp``/``--use_amp`` do on a GPU with fp16) give finite losses
that fall, and the SDMA core keeps its GMM log-densities in fp32 inside autocast."""

import math

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from conftest import BF16_AUTOCAST, train_under_bf16_autocast
from test_bert_fused import bert_dir  # noqa: F401 (fixture)
from test_bert_fused import batch as bert_batch
from test_bert_fused import build as bert_build
from test_optimus import build as optimus_build
from test_optimus import make_batch
from test_qkvae import batch as vae_batch
from test_qkvae import build as vae_build
from test_sdma_fairseq import batch, build, criterion_sample

def criterion_loss(criterion, model, sample):
    def loss_fn():
        loss, sample_size, _ = criterion(model, sample)
        return loss / sample_size
    return loss_fn


def vae_loss(model, src, lengths, prev, target, pad):
    def loss_fn():
        logits, extra = model(src, lengths, prev)
        kl = sum(q.kl_standard_normal().sum(-1).mean() for q in extra["posteriors"].values())
        return torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), target, ignore_index=pad) + 0.1 * kl
    return loss_fn


MODES = {
    "sdma-authors": ["--sdma-mode", "sdma", "--sdma-reading", "authors"],
    "sdma-paper": ["--sdma-mode", "sdma", "--sdma-reading", "paper"],
    "sma": ["--sdma-mode", "sma"],
    "vanilla": ["--sdma-mode", "none"],
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sdma_transformer_trains_and_decodes_under_bf16_autocast(tmp_path, mode):
    model, task, args = build(tmp_path, *MODES[mode])
    criterion = task.build_criterion(args)
    sample = criterion_sample(task, *batch(task))
    model.set_num_updates(2000)
    recorded = []
    if mode.startswith("sdma"):
        core = model.encoder.layers[0].self_attn.sdma
        original = core.record
        core.record = lambda *a, **k: (recorded.append(a[0].dtype), original(*a, **k))[1]
    train_under_bf16_autocast(model, criterion_loss(criterion, model, sample), steps=6)
    assert len(recorded) == 6 * mode.startswith("sdma")
    assert all(dtype == torch.float32 for dtype in recorded)  # log p(c, z) in fp32 under autocast
    model.eval()
    src, lengths, _ = batch(task)
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=2, max_len_b=5)
    with torch.autocast(**BF16_AUTOCAST), torch.no_grad():
        hypos = generator.forward({"net_input": {"src_tokens": src, "src_lengths": lengths}})
    assert all(math.isfinite(float(h[0]["score"])) for h in hypos)


@pytest.mark.parametrize("kind", ["qkvae", "advae"])
def test_sentence_vaes_train_under_bf16_autocast(kind):
    model, d = vae_build(kind, word_dropout=0.0)
    train_under_bf16_autocast(model, vae_loss(model, *vae_batch(d), d.pad()), steps=8)


@pytest.mark.parametrize("fusion", ["embed", "attention"])
def test_bert_fused_transformer_trains_under_bf16_autocast(tmp_path, bert_dir, fusion):  # noqa: F811
    model, task, args = bert_build(tmp_path, bert_dir, "--bert-fusion", fusion)
    model.set_num_updates(2000)
    sample = criterion_sample(task, *bert_batch(task))
    train_under_bf16_autocast(model, criterion_loss(task.build_criterion(args), model, sample), steps=6)


def test_optimus_trains_under_bf16_autocast():
    model = optimus_build()
    train_under_bf16_autocast(model, vae_loss(model, *make_batch(model.decoder.dictionary), model.decoder.padding_idx),
                         steps=8, lr=1e-3)
