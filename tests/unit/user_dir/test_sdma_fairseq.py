"""sdma_transformer inside fairseq: masks, incremental decoding, beam search, g restore."""

import pytest
import torch
from fairseq import options, tasks
from fairseq.sequence_generator import SequenceGenerator

from latent_core.sdma import SDMACore, SDMAConfigError, collect_sdma_losses, recording
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
    with recording() as records:
        model(src, lengths, prev)
    losses = collect_sdma_losses(model, records)
    assert set(losses) == {"kl_z", "kl_q", "dqq", "dxq", "dv_z", "dv_q"}
    assert all(v.shape == (3,) and torch.isfinite(v).all() and v.requires_grad for v in losses.values())
    model(src, lengths, prev)  # outside a recording scope: nothing recorded
    assert collect_sdma_losses(model, records)["kl_z"].equal(losses["kl_z"])
    assert len(records) == 6  # 2 + 2 self-attentions, 2 cross-attentions: one record each


def test_cross_attention_regularisers_see_the_decoder_padding(tmp_path):
    """Cross-attention receives only the source padding; the decoder layer's real_queries scope
    gives its records the target's (right-padded) positions."""
    model, task, _ = build(tmp_path)
    model.train()
    src, lengths, prev = batch(task)
    prev[1, 4:] = task.target_dictionary.pad()
    with recording() as records:
        model(src, lengths, prev)
    for layer in model.decoder.layers:
        cross, own = records.get(layer.encoder_attn.sdma), records.get(layer.self_attn.sdma)
        expected = prev.ne(task.target_dictionary.pad()).t().float()  # [T, B]
        assert torch.equal(cross.valid, expected) and torch.equal(own.valid, expected)
        assert cross.valid[4:, 1].sum() == 0


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


READINGS = ["authors", "paper"]


@pytest.mark.parametrize("reading", READINGS)
@pytest.mark.parametrize("mask_at_inference", ["false", "true"])
def test_incremental_decoding_equals_full_scoring(tmp_path, mask_at_inference, reading):
    model, task, _ = build(tmp_path, "--sdma-decoder-mask-at-inference", mask_at_inference,
                           "--sdma-reading", reading)
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


@pytest.mark.parametrize("reading", READINGS)
@pytest.mark.parametrize("mask_at_inference", ["false", "true"])
def test_beam_search_scores_equal_forced_decoding(tmp_path, mask_at_inference, reading):
    """Beam search (reorder_incremental_state, beamable cross-attention) vs full scoring."""
    model, task, _ = build(tmp_path, "--sdma-decoder-mask-at-inference", mask_at_inference,
                           "--sdma-reading", reading)
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
    with recording() as records:
        model(src, lengths, prev)
    losses = collect_sdma_losses(model, records)
    assert losses["dqq"].abs().sum().item() == 0.0 and losses["kl_q"].abs().sum().item() == 0.0
    assert (losses["kl_z"] > 0).all()


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (["--sdma-clusters", "0"], "--sdma-clusters"),
        (["--sdma-query-clusters", "-1"], "--sdma-query-clusters"),
        (["--encoder-attention-heads", "5"], "--encoder-attention-heads"),
        (["--sdma-mix-max", "1.5"], "--sdma-mix-max"),
        (["--sdma-mix-max", "0"], "--sdma-mix-max"),
        (["--decoder-embed-dim", "48"], r"--encoder-embed-dim=32 and --decoder-embed-dim=48 differ"),
        (["--cross-self-attention"], r"--cross-self-attention is not implemented for SMA/SDMA"),
        (["--sdma-mode", "sma", "--cross-self-attention"], r"--cross-self-attention"),
    ],
)
def test_bad_model_options(tmp_path, extra, pattern):
    with pytest.raises(SDMAConfigError, match=pattern):
        build(tmp_path, *extra)


def test_vanilla_mode_keeps_fairseqs_options(tmp_path):
    """--sdma-mode none is fairseq's transformer: different widths and --cross-self-attention build."""
    build(tmp_path, "--sdma-mode", "none", "--decoder-embed-dim", "48", "--decoder-output-dim", "48")
    build(tmp_path, "--sdma-mode", "none", "--cross-self-attention")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forward_is_finite(tmp_path, dtype):
    model, task, _ = build(tmp_path)
    model.train()
    model.set_num_updates(3000)
    src, lengths, prev = batch(task)
    with recording() as records:
        if dtype is torch.float16:
            model = model.half()
            out = model(src, lengths, prev)[0]
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(src, lengths, prev)[0]
    losses = collect_sdma_losses(model, records)
    assert torch.isfinite(out.float()).all()
    assert all(torch.isfinite(v).all() for v in losses.values())
    (out.float().logsumexp(-1).mean() + sum(v.sum() for v in losses.values())).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g.float()).all() for g in grads)


def criterion_sample(task, src, lengths, prev):
    target = torch.cat([prev[:, 1:], torch.full((prev.size(0), 1), task.target_dictionary.eos())], 1)
    return {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
            "target": target, "ntokens": target.numel(), "id": torch.arange(src.size(0))}


def train_step_logging(tmp_path, *extra, copies=1):
    """The criterion's logging output for the test batch repeated ``copies`` times (noise and dropout off)."""
    model, task, args = build(tmp_path, "--sdma-noise-var", "0", "--attention-dropout", "0", *extra)
    criterion = task.build_criterion(args)
    model.train()
    model.set_num_updates(2000)
    src, lengths, prev = batch(task, bsz=2)
    src[0, :2] = src[0, 2:4]  # no padding: a copy of a left-padded row would change the batch's padding
    lengths = src.ne(task.source_dictionary.pad()).sum(1)
    sample = criterion_sample(task, src.repeat(copies, 1), lengths.repeat(copies), prev.repeat(copies, 1))
    _, _, log = criterion(model, sample)
    return log


def test_loss_is_extensive_in_the_batch_in_every_term(tmp_path):
    """The authors' scaling (default): two copies of a batch give twice the loss, twice every term."""
    one = train_step_logging(tmp_path)
    two = train_step_logging(tmp_path, copies=2)
    for key in ("loss", "ce_loss", "nll_loss", "sdma_reg", *("sdma_" + n for n in
                                                            ("kl_z", "kl_q", "dqq", "dxq", "dv_z", "dv_q"))):
        assert abs(float(one[key])) > 0, key
        assert float(two[key]) == pytest.approx(2 * float(one[key]), rel=1e-4), key


@pytest.mark.parametrize("scale,reading", [("sentence", "authors"), ("batch", "authors"), ("token", "authors"),
                                           ("sentence", "paper")])
def test_regulariser_scale_option(tmp_path, scale, reading):
    log = train_step_logging(tmp_path, "--sdma-regulariser-scale", scale, "--sdma-reading", reading)
    if reading == "authors":  # their IWSLT script's --mi_loss_weight 10 for every size
        weights = {"kl": 0.01, "dqq": 100.0, "dxq": 10.0, "dv": 1.0}
    else:
        weights = {"kl": 0.01, "dqq": 50.0, "dxq": 5.0, "dv": 1.0}  # Table I, IWSLT'14 tiny
    summed = (weights["kl"] * (log["sdma_kl_z"] + log["sdma_kl_q"]) + weights["dqq"] * log["sdma_dqq"]
              - weights["dxq"] * log["sdma_dxq"] + weights["dv"] * (log["sdma_dv_z"] + log["sdma_dv_q"]))
    expected = {"sentence": summed, "batch": summed / 2, "token": summed / 2 * log["ntokens"]}[scale]
    assert float(log["loss"] - log["ce_loss"]) == pytest.approx(float(expected), rel=1e-4)
    assert float(log["sdma_reg"]) == pytest.approx(float(expected), rel=1e-4)


def test_unknown_regulariser_scale_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        build(tmp_path, "--sdma-regulariser-scale", "tokens")


@pytest.mark.parametrize("reading", READINGS)
def test_inference_uses_weights_written_through_data_as_fp16_optimizer_does(tmp_path, reading):
    """FP16Optimizer copies the fp32 master weights with ``p.data.copy_``: no version bump, same
    storage. Validation and generation afterwards must use the new GMM parameters."""
    model, task, args = build(tmp_path, "--sdma-reading", reading)
    model.eval()
    model.set_num_updates(4000)
    src, lengths, prev = batch(task)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    beam = lambda m: SequenceGenerator([m], task.target_dictionary, beam_size=3, max_len_b=8).forward(sample)
    with torch.no_grad():
        model(src, lengths, prev)  # the first validation ...
        beam(model)  # ... and --eval-bleu generation
        for core in (m for m in model.modules() if isinstance(m, SDMACore)):
            core.feature_gmm.means.data.copy_(core.feature_gmm.means.data + torch.randn_like(core.feature_gmm.means))
            core.feature_gmm.log_vars.data.copy_(0.5 * torch.randn_like(core.feature_gmm.log_vars))
        after, hypos = model(src, lengths, prev)[0], beam(model)
        fresh = task.build_model(args)
        fresh.load_state_dict(model.state_dict())
        fresh.eval()
        expected, expected_hypos = fresh(src, lengths, prev)[0], beam(fresh)
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)
    for nbest, expected_nbest in zip(hypos, expected_hypos):
        for hyp, expected_hyp in zip(nbest, expected_nbest):
            assert torch.equal(hyp["tokens"], expected_hyp["tokens"])
            torch.testing.assert_close(hyp["positional_scores"], expected_hyp["positional_scores"])


def test_iwslt_base_defaults_reproduce_table_two_clusters(tmp_path):
    model, _, args = build(tmp_path, arch="sdma_transformer_iwslt_de_en")
    cores = [m for m in model.modules() if isinstance(m, SDMACore)]
    assert (args.sdma_clusters, args.sdma_query_clusters) == (4, 4)
    assert {c.feature_gmm.num_clusters for c in cores} == {4} and {c.query_gmm.num_clusters for c in cores} == {4}
    (tmp_path / "t1").mkdir()
    _, _, table_one = build(tmp_path / "t1", "--sdma-clusters", "8", "--sdma-query-clusters", "8",
                            arch="sdma_transformer_iwslt_de_en")
    assert (table_one.sdma_clusters, table_one.sdma_query_clusters) == (8, 8)




@pytest.mark.parametrize("num_updates", [0, 2000])
@pytest.mark.parametrize("mode", [["--sdma-mode", "sdma", "--sdma-reading", "authors"],
                                  ["--sdma-mode", "sdma", "--sdma-reading", "paper"], ["--sdma-mode", "sma"]],
                         ids=["sdma-authors", "sdma-paper", "sma"])
def test_every_trained_parameter_gets_a_gradient_for_ddp(tmp_path, mode, num_updates):
    """fairseq's GPU DDP runs with find_unused_parameters off: a trained parameter without a gradient
    in some step (g = 0 at the start, the mask's branch weighted by 0) would stop training there."""
    model, task, args = build(tmp_path, *mode)
    criterion = task.build_criterion(args)
    model.train()
    model.set_num_updates(num_updates)
    loss, _, _ = criterion(model, criterion_sample(task, *batch(task)))
    loss.backward()
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused, unused


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_attention_in_mode_none_is_fairseqs_multihead_attention_in_training(reading):
    """``SDMAOptions(mode="none")`` documents vanilla attention: the module computes fairseq's exactly."""
    from fairseq.modules.multihead_attention import MultiheadAttention

    from latent_core.sdma import SDMAOptions
    from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention

    torch.manual_seed(0)
    sdma = SDMAMultiheadAttention(8, 2, self_attention=True, sdma=SDMAOptions(mode="none", reading=reading),
                                  group="encoder_self")
    plain = MultiheadAttention(8, 2, self_attention=True)
    plain.load_state_dict({k: v for k, v in sdma.state_dict().items() if not k.startswith("sdma.")})
    x = torch.randn(5, 2, 8)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1, 3:] = True
    out_sdma, weights_sdma = sdma.train()(x, x, x, key_padding_mask=padding)
    out_plain, weights_plain = plain.train()(x, x, x, key_padding_mask=padding)
    torch.testing.assert_close(out_sdma, out_plain, rtol=0, atol=0)
    torch.testing.assert_close(weights_sdma, weights_plain, rtol=0, atol=0)


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_sdma_decoding_runs_exactly_the_operations_of_sma(tmp_path, reading):
    """Beam search skips the query mixture (SDMA-T's only addition to SMA-T), so decoding an SDMA-T
    model runs the same ATen operations, as many times, as decoding an SMA-T model of the same size
    (a measured decoding speed gap between the two is then measurement noise, not work)."""
    from torch.profiler import profile

    counts = {}
    for mode in ("sma", "sdma"):
        (tmp_path / mode).mkdir()
        model, task, _ = build(tmp_path / mode, "--sdma-mode", mode, "--sdma-reading", reading)
        src, lengths, _ = batch(task)
        generator = SequenceGenerator([model.eval()], task.target_dictionary, beam_size=3, min_len=5, max_len_b=5,
                                      max_len_a=0)
        with torch.no_grad(), profile() as prof:
            generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
        counts[mode] = {event.key: event.count for event in prof.key_averages()}
    assert counts["sdma"] == counts["sma"]
    assert sum(counts["sma"].values()) > 1000
