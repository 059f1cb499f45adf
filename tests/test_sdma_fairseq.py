"""sdma_transformer inside fairseq: masks, incremental decoding, beam search, g restore."""

import pytest
import torch
from fairseq import options, tasks
from fairseq.sequence_generator import SequenceGenerator

from user_dir.sdma.core import SDMACore, SDMAConfigError
from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention

VOCAB = 30


def write_dicts(path):
    for lang in ("src", "tgt"):
        with open(path / f"dict.{lang}.txt", "w") as f:
            for i in range(VOCAB):
                f.write(f"w{i} {100 - i}\n")


def build(tmp_path, *extra, arch="sdma_transformer_iwslt_de_en_tiny"):
    write_dicts(tmp_path)
    parser = options.get_training_parser()
    argv = [
        str(tmp_path), "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
        "--arch", arch, "--encoder-layers", "2", "--decoder-layers", "2",
        "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--dropout", "0", "--criterion", "sdma_label_smoothed_cross_entropy", *extra,
    ]
    args = options.parse_args_and_arch(parser, argv)
    task = tasks.setup_task(args)
    torch.manual_seed(0)
    model = task.build_model(args)
    return model, task, args


def batch(task, bsz=3, src_len=7, tgt_len=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    src = torch.randint(d.nspecial, len(d), (bsz, src_len), generator=g)
    src[0, :2] = d.pad()  # left-padded source, as fairseq batches it
    tgt = torch.randint(d.nspecial, len(d), (bsz, tgt_len), generator=g)
    prev = torch.cat([torch.full((bsz, 1), d.eos()), tgt[:, :-1]], 1)
    lengths = src.ne(d.pad()).sum(1)
    return src, lengths, prev


def test_all_three_attentions_are_sdma(tmp_path):
    model, _, _ = build(tmp_path)
    groups = [m.sdma.sdma_group for m in model.modules() if isinstance(m, SDMAMultiheadAttention)]
    assert sorted(groups) == ["decoder_cross"] * 2 + ["decoder_self"] * 2 + ["encoder_self"] * 2


def test_mode_none_is_the_vanilla_transformer(tmp_path):
    sdma, _, _ = build(tmp_path)
    none, _, _ = build(tmp_path, "--sdma-mode", "none")
    (tmp_path / "v").mkdir()
    vanilla, _, _ = build(tmp_path / "v", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
                          arch="transformer")
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert not any(isinstance(m, SDMACore) for m in none.modules())
    assert count(none) == count(vanilla)
    gmm_params = sum(p.numel() for m in sdma.modules() if isinstance(m, SDMACore) for p in m.parameters())
    assert count(sdma) == count(vanilla) + gmm_params


def test_training_forward_reports_every_loss(tmp_path):
    model, task, _ = build(tmp_path)
    model.train()
    model.set_num_updates(2000)
    src, lengths, prev = batch(task)
    model(src, lengths, prev)
    losses = model.sdma_losses()
    assert set(losses) == {"kl_z", "kl_q", "dqq", "dxq", "dv_z", "dv_q"}
    assert all(torch.isfinite(v) and v.requires_grad for v in losses.values())
    assert model.sdma_losses()["kl_z"].item() == 0.0  # popped


def test_padding_does_not_leak(tmp_path):
    model, task, _ = build(tmp_path)
    model.eval()
    model.set_num_updates(4000)
    src, lengths, prev = batch(task)
    out = model(src, lengths, prev)[0]
    src2 = src.clone()
    src2[0, :2] = task.source_dictionary.pad()  # same padding, the pads' content can't matter
    src3 = src.clone()
    # change the content of padded *positions* through the embedding: swap the pad index row
    with torch.no_grad():
        emb = model.encoder.embed_tokens.weight
        saved = emb[task.source_dictionary.pad()].clone()
        emb[task.source_dictionary.pad()] = torch.randn_like(saved)
        out3 = model(src3, lengths, prev)[0]
        emb[task.source_dictionary.pad()] = saved
    assert torch.allclose(out, out3, atol=1e-5)


def test_causal_mask_future_tokens_do_not_change_the_past(tmp_path):
    model, task, _ = build(tmp_path, "--sdma-decoder-mask-at-inference", "true")
    model.eval()
    model.set_num_updates(4000)
    src, lengths, prev = batch(task)
    out = model(src, lengths, prev)[0]
    prev2 = prev.clone()
    prev2[:, 4:] = (prev2[:, 4:] + 1 - 4) % (VOCAB - 4) + 4
    out2 = model(src, lengths, prev2)[0]
    assert torch.allclose(out[:, :4], out2[:, :4], atol=1e-5)
    assert not torch.allclose(out[:, 4:], out2[:, 4:], atol=1e-3)


@pytest.mark.parametrize("mask_at_inference", ["false", "true"])
def test_incremental_decoding_equals_full_scoring(tmp_path, mask_at_inference):
    model, task, _ = build(tmp_path, "--sdma-decoder-mask-at-inference", mask_at_inference)
    model.eval()
    model.set_num_updates(4000)  # g = 0.86: the mask matters
    src, lengths, prev = batch(task)
    with torch.no_grad():
        full = model(src, lengths, prev)[0].log_softmax(-1)
        enc = model.encoder(src, lengths)
        state = {}
        steps = []
        for t in range(prev.size(1)):
            logits = model.decoder(prev[:, : t + 1], enc, incremental_state=state)[0]
            steps.append(logits[:, -1].log_softmax(-1))
    incremental = torch.stack(steps, 1)
    assert torch.allclose(full, incremental, atol=1e-5)


def test_mask_option_changes_inference(tmp_path):
    outs = []
    for flag in ("false", "true"):
        model, task, _ = build(tmp_path, "--sdma-decoder-mask-at-inference", flag)
        model.eval()
        model.set_num_updates(4000)
        src, lengths, prev = batch(task)
        with torch.no_grad():
            outs.append(model(src, lengths, prev)[0])
    assert not torch.allclose(outs[0], outs[1], atol=1e-4)


@pytest.mark.parametrize("mask_at_inference", ["false", "true"])
def test_beam_search_scores_equal_forced_decoding(tmp_path, mask_at_inference):
    """Beam search (reorder_incremental_state, beamable cross-attention) vs full scoring."""
    model, task, _ = build(tmp_path, "--sdma-decoder-mask-at-inference", mask_at_inference)
    model.eval()
    model.set_num_updates(4000)
    src, lengths, _ = batch(task)
    tgt_dict = task.target_dictionary
    generator = SequenceGenerator([model], tgt_dict, beam_size=3, max_len_b=8, normalize_scores=False)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    with torch.no_grad():
        hypos = generator.forward(sample)
        for i, nbest in enumerate(hypos):
            for hyp in nbest:
                tokens = hyp["tokens"][None]
                prev = torch.cat([torch.tensor([[tgt_dict.eos()]]), tokens[:, :-1]], 1)
                lprobs = model(src[i : i + 1], lengths[i : i + 1], prev)[0].log_softmax(-1)
                forced = lprobs[0].gather(-1, tokens[0, :, None])[:, 0]
                assert torch.allclose(forced, hyp["positional_scores"], atol=1e-4)


def test_mixing_weight_is_saved_and_restored(tmp_path):
    model, task, args = build(tmp_path)
    model.set_num_updates(3000)
    state = model.state_dict()
    keys = [k for k in state if k.endswith("sdma.mix_weight")]
    assert len(keys) == 6
    assert all(abs(state[k].item() - (1 - 0.22313016)) < 1e-5 for k in keys)
    fresh = task.build_model(args)  # a new model starts at g = 0 ...
    assert all(fresh.state_dict()[k].item() == 0.0 for k in keys)
    fresh.load_state_dict(state)  # ... and gets the trained g back from the checkpoint
    assert all(abs(fresh.state_dict()[k].item() - state[k].item()) < 1e-7 for k in keys)


def test_sma_mode_reports_zero_disentanglement_terms(tmp_path):
    model, task, _ = build(tmp_path, "--sdma-mode", "sma")
    model.train()
    src, lengths, prev = batch(task)
    model(src, lengths, prev)
    losses = model.sdma_losses()
    assert losses["dqq"].item() == 0.0 and losses["kl_q"].item() == 0.0
    assert losses["kl_z"].item() > 0


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (["--sdma-clusters", "0"], "--sdma-clusters"),
        (["--sdma-query-clusters", "-1"], "--sdma-query-clusters"),
        (["--encoder-attention-heads", "5"], "--encoder-attention-heads"),
        (["--sdma-mix-max", "1.5"], "--sdma-mix-max"),
        (["--sdma-mix-max", "0"], "--sdma-mix-max"),
    ],
)
def test_bad_model_options(tmp_path, extra, pattern):
    with pytest.raises(SDMAConfigError, match=pattern):
        build(tmp_path, *extra)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forward_is_finite(tmp_path, dtype):
    model, task, _ = build(tmp_path)
    model.train()
    model.set_num_updates(3000)
    src, lengths, prev = batch(task)
    if dtype is torch.float16:
        model = model.half()
        out = model(src, lengths, prev)[0]
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(src, lengths, prev)[0]
    losses = model.sdma_losses()
    assert torch.isfinite(out.float()).all()
    assert all(torch.isfinite(v) for v in losses.values())
    (out.float().logsumexp(-1).mean() + sum(losses.values())).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g.float()).all() for g in grads)


def test_import_prints_no_warnings_of_its_own():
    import subprocess
    import sys

    code = ("import warnings, fairseq; warnings.simplefilter('error'); "
            "import user_dir; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(__import__('conftest').REPO))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    noise = [l for l in proc.stderr.splitlines() if "user_dir" in l]
    assert not noise, noise
