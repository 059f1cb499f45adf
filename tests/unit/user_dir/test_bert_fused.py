"""bert_fused_transformer (BV-T / BSDMA-T) in-process, with tiny BERT directories saved from a config."""

import argparse
import json

import pytest
import torch
from fairseq import options, tasks
from fairseq.sequence_generator import SequenceGenerator

from pipelines.data import bert_source
from latent_core.sdma import SDMACore, collect_sdma_losses, recording
from user_dir.sdma.bert_fused import (
    BertFusedAttention,
    BertFusedConfigError,
    dropnet_weights,
    parameter_counts,
    validate_bert_args,
)

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", ".", "##s", "##ed", "big", "small", "red", "in"]
BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
TGT_VOCAB = 30
BERT_POSITIONS = 16  # at most 15 source pieces with </s>


def save_tiny_bert(path, seed=0, hidden=24):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(BERT_VOCAB)}).save_pretrained(str(path))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(BERT_VOCAB), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=BERT_POSITIONS)
    BertModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


def write_data_dir(path, bert):
    path.mkdir(parents=True, exist_ok=True)
    bert_source.write_dictionary(bert_source.load_tokenizer(bert), path / "dict.src.txt")
    with open(path / "dict.tgt.txt", "w") as f:
        for i in range(TGT_VOCAB):
            f.write(f"w{i} {100 - i}\n")
    return path


def build(tmp_path, bert, *extra, arch="bert_fused_transformer_tiny", data=None):
    data = data or write_data_dir(tmp_path / "data", bert)
    argv = [
        str(data), "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
        "--arch", arch, "--bert-dir", str(bert), "--encoder-layers", "2", "--decoder-layers", "2",
        "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--dropout", "0", "--criterion", "sdma_label_smoothed_cross_entropy", *extra,
    ]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    task = tasks.setup_task(args)
    torch.manual_seed(0)
    return task.build_model(args), task, args


def batch(task, bsz=3, src_len=7, tgt_len=6, seed=0):
    """Left-padded sources of real BERT pieces ending in </s>, as fairseq batches them."""
    g = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    word_ids = torch.tensor([d.index(w) for w in WORDS])
    src = word_ids[torch.randint(len(word_ids), (bsz, src_len), generator=g)]
    src[:, -1] = d.eos()
    src[0, :2] = d.pad()
    tgt = torch.randint(task.target_dictionary.nspecial, TGT_VOCAB, (bsz, tgt_len), generator=g)
    prev = torch.cat([torch.full((bsz, 1), task.target_dictionary.eos()), tgt[:, :-1]], 1)
    return src, src.ne(d.pad()).sum(1), prev


def bert_params(model):
    return dict(model.encoder.bert.bert.named_parameters())


# ------------------------------------------------------------------------------- BERT side
def test_bert_is_frozen_by_default_and_left_out_of_checkpoints(tmp_path, bert_dir):
    model, task, _ = build(tmp_path, bert_dir)
    assert all(not p.requires_grad for p in bert_params(model).values())
    model.train()
    assert not model.encoder.bert.bert.training  # no BERT dropout when frozen
    before = {k: v.clone() for k, v in bert_params(model).items()}
    optimiser = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    src, lengths, prev = batch(task)
    model(src, lengths, prev)[0].sum().backward()
    optimiser.step()
    assert all(torch.equal(before[k], v) for k, v in bert_params(model).items())
    state = model.state_dict()
    assert not any(k.startswith("encoder.bert.bert.") for k in state)
    assert "encoder.bert.bert_fingerprint" in state
    counts = parameter_counts(model)
    assert counts["trained"] == counts["total"] - counts["bert"] > 0


def test_finetune_trains_and_saves_bert(tmp_path, bert_dir):
    model, task, _ = build(tmp_path, bert_dir, "--bert-finetune", "true")
    model.train()
    src, lengths, prev = batch(task)
    model(src, lengths, prev)[0].sum().backward()
    grads = [p.grad for p in bert_params(model).values()]
    assert all(p.requires_grad for p in bert_params(model).values())
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0
    assert any(k.startswith("encoder.bert.bert.") for k in model.state_dict())
    counts = parameter_counts(model)
    assert counts["trained"] == counts["total"]


def test_bert_sees_cls_pieces_sep_at_its_own_positions(tmp_path, bert_dir):
    """The model's BERT input is [CLS] pieces [SEP], right-padded, whatever fairseq's padding side."""
    from transformers import AutoModel, AutoTokenizer

    model, task, _ = build(tmp_path, bert_dir)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(bert_dir))
    reference = AutoModel.from_pretrained(str(bert_dir)).eval()
    src, _, _ = batch(task)
    d = task.source_dictionary
    with torch.no_grad():
        states = model.encoder.bert(src)
        for row in range(src.size(0)):
            pieces = [d[i] for i in src[row].tolist() if i not in (d.pad(), d.eos())]
            ids = tokenizer.convert_tokens_to_ids(["[CLS]"] + pieces + ["[SEP]"])
            assert tokenizer.unk_token_id not in ids and len(set(ids)) > 3
            expected = reference(input_ids=torch.tensor([ids])).last_hidden_state[0, 1:]
            real = src[row].ne(d.pad())
            assert torch.allclose(states[row][real], expected, atol=1e-5)
            assert torch.all(states[row][~real] == 0)


@pytest.mark.parametrize("fusion", ["embed", "attention"])
def test_padding_never_changes_a_real_tokens_output(tmp_path, bert_dir, fusion):
    model, task, _ = build(tmp_path, bert_dir, "--bert-fusion", fusion)
    model.eval()
    model.set_num_updates(4000)
    src, lengths, prev = batch(task, bsz=2, src_len=8)
    d = task.source_dictionary
    short = src[1:2, 3:]  # the second sentence, shortened
    padded = torch.cat([torch.full((1, 3), d.pad()), short], 1)
    together = torch.cat([src[:1], padded])
    with torch.no_grad():
        alone_bert = model.encoder.bert(short)
        batched_bert = model.encoder.bert(together)
        alone = model.encoder(short, short.ne(d.pad()).sum(1))["encoder_out"][0][:, 0]
        batched = model.encoder(together, together.ne(d.pad()).sum(1))["encoder_out"][0][3:, 1]
    assert torch.allclose(alone_bert[0], batched_bert[1, 3:], atol=1e-5)
    assert torch.allclose(alone, batched, atol=1e-5)


# --------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("fusion", ["embed", "attention"])
@pytest.mark.parametrize("mode", ["sdma", "none"])
def test_incremental_decoding_equals_full_scoring(tmp_path, bert_dir, fusion, mode):
    model, task, _ = build(tmp_path, bert_dir, "--bert-fusion", fusion, "--sdma-mode", mode)
    model.eval()
    model.set_num_updates(4000)
    src, lengths, prev = batch(task)
    with torch.no_grad():
        full = model(src, lengths, prev)[0].log_softmax(-1)
        enc = model.encoder(src, lengths)
        state, steps = {}, []
        for t in range(prev.size(1)):
            steps.append(model.decoder(prev[:, : t + 1], enc, incremental_state=state)[0][:, -1].log_softmax(-1))
    assert torch.allclose(full, torch.stack(steps, 1), atol=1e-5)


@pytest.mark.parametrize("fusion", ["embed", "attention"])
def test_beam_search_scores_equal_forced_decoding(tmp_path, bert_dir, fusion):
    """fairseq's beam search (encoder_out reordering incl. BERT's output, beamable attentions)."""
    model, task, _ = build(tmp_path, bert_dir, "--bert-fusion", fusion)
    model.eval()
    model.set_num_updates(4000)
    src, lengths, _ = batch(task)
    tgt_dict = task.target_dictionary
    generator = SequenceGenerator([model], tgt_dict, beam_size=3, max_len_b=8, normalize_scores=False)
    with torch.no_grad():
        hypos = generator.forward({"net_input": {"src_tokens": src, "src_lengths": lengths}})
        for i, nbest in enumerate(hypos):
            for hyp in nbest:
                tokens = hyp["tokens"][None]
                prev = torch.cat([torch.tensor([[tgt_dict.eos()]]), tokens[:, :-1]], 1)
                lprobs = model(src[i:i + 1], lengths[i:i + 1], prev)[0].log_softmax(-1)
                forced = lprobs[0].gather(-1, tokens[0, :, None])[:, 0]
                assert torch.allclose(forced, hyp["positional_scores"], atol=1e-4)


# ---------------------------------------------------------------------------- fusion layers
def test_attention_fusion_adds_a_bert_attention_to_every_layer(tmp_path, bert_dir):
    model, _, _ = build(tmp_path, bert_dir, "--bert-fusion", "attention")
    fused = [m for m in model.modules() if isinstance(m, BertFusedAttention)]
    assert len(fused) == 4  # 2 encoder self-attentions, 2 decoder cross-attentions
    groups = sorted(m.sdma.sdma_group for m in model.modules() if hasattr(m, "sdma") and isinstance(m.sdma, SDMACore))
    assert groups.count("encoder_bert") == 2 and groups.count("decoder_bert") == 2
    embed, _, _ = build(tmp_path / "e", bert_dir)
    assert not any(isinstance(m, BertFusedAttention) for m in embed.modules())
    assert embed.encoder.embed_tokens is None and embed.encoder.embed_positions is None


def test_dropnet_picks_one_branch_in_training_and_averages_at_inference():
    torch.manual_seed(0)
    picks = [dropnet_weights(1.0, training=True) for _ in range(400)]
    assert set(picks) == {(1.0, 0.0), (0.0, 1.0)}
    assert 150 < picks.count((1.0, 0.0)) < 250
    assert {dropnet_weights(1.0, training=False) for _ in range(20)} == {(0.5, 0.5)}
    assert {dropnet_weights(0.0, training=True) for _ in range(20)} == {(0.5, 0.5)}


@pytest.mark.parametrize("fusion", ["embed", "attention"])
def test_every_trained_parameter_gets_a_gradient_in_every_step(tmp_path, bert_dir, fusion):
    """Both drop-net branches are computed, so DDP never sees an unused parameter."""
    model, task, _ = build(tmp_path, bert_dir, "--bert-fusion", fusion)
    model.train()
    model.set_num_updates(4000)
    src, lengths, prev = batch(task)
    for step in range(3):
        model.zero_grad()
        with recording() as records:
            out = model(src, lengths, prev)[0]
        losses = collect_sdma_losses(model, records)
        (out.sum() + sum(v.sum() for v in losses.values())).backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, missing[:5]


def test_trained_parameters_exclude_the_source_embedding_and_count_the_projection(tmp_path, bert_dir):
    """As the paper counts BV-T: V-T's parameters minus the source embedding, plus BERT's projection."""
    bv_t, task, _ = build(tmp_path, bert_dir, "--sdma-mode", "none")
    write_data_dir(tmp_path / "v", bert_dir)
    argv = [str(tmp_path / "v"), "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
            "--arch", "transformer", "--encoder-layers", "2", "--decoder-layers", "2",
            "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
            "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    vanilla = tasks.setup_task(args).build_model(args)
    source_embedding = vanilla.encoder.embed_tokens.weight.numel()
    projection = 24 * 32 + 32
    assert parameter_counts(bv_t)["trained"] == sum(p.numel() for p in vanilla.parameters()) - source_embedding \
        + projection


# ------------------------------------------------------------------------- checkpoints
def test_checkpoint_reloads_through_the_safe_loader(tmp_path, bert_dir):
    model, task, _ = build(tmp_path, bert_dir, "--bert-fusion", "attention")
    model.set_num_updates(3000)
    torch.save({"model": model.state_dict()}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    fresh, _, _ = build(tmp_path / "fresh", bert_dir, "--bert-fusion", "attention")
    fresh.load_state_dict(state, strict=True)
    src, lengths, prev = batch(task)
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.allclose(model(src, lengths, prev)[0], fresh(src, lengths, prev)[0], atol=1e-6)


def test_other_bert_weights_are_refused_when_loading(tmp_path, bert_dir):
    model, _, _ = build(tmp_path, bert_dir)
    other = save_tiny_bert(tmp_path / "other_bert", seed=1)
    wrong, _, _ = build(tmp_path / "w", other)
    with pytest.raises(BertFusedConfigError, match="differ from the ones the checkpoint was trained with"):
        wrong.load_state_dict(model.state_dict())


def test_a_checkpoint_of_an_fp16_model_reloads(tmp_path, bert_dir):
    """fairseq --fp16 halves every float buffer: the BERT fingerprint is an integer and survives it."""
    model, _, _ = build(tmp_path, bert_dir)
    fingerprint = model.encoder.bert.bert_fingerprint.clone()
    state = model.half().state_dict()
    assert torch.equal(state["encoder.bert.bert_fingerprint"], fingerprint)
    fresh, _, _ = build(tmp_path / "fresh", bert_dir)
    fresh.load_state_dict(state, strict=True)


# ----------------------------------------------------------------------------- bad input
def test_a_directory_that_is_not_bert_is_refused(tmp_path, bert_dir):
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    data = write_data_dir(tmp_path / "data", bert_dir)
    with pytest.raises(BertFusedConfigError, match="--bert-dir .*gpt2.* not a BERT-family"):
        build(tmp_path, gpt, data=data)
    with pytest.raises(BertFusedConfigError, match="--bert-dir .*no such directory.*model-overrides"):
        build(tmp_path, tmp_path / "missing", data=data)


def test_a_source_dictionary_from_another_tokenizer_is_refused(tmp_path, bert_dir):
    data = write_data_dir(tmp_path / "data", bert_dir)
    (data / "dict.src.txt").write_text("▁the 5\n▁cat 4\nthe 3\n")  # sentencepiece pieces
    with pytest.raises(BertFusedConfigError, match="2 of the 3 symbols .* not tokens of this BERT's vocabulary"):
        build(tmp_path, bert_dir, data=data)


def test_sources_longer_than_berts_positions_are_refused(tmp_path, bert_dir):
    model, task, _ = build(tmp_path, bert_dir)
    assert model.max_positions()[0] == BERT_POSITIONS - 1
    src, lengths, prev = batch(task, bsz=1, src_len=BERT_POSITIONS + 2)  # 2 pads: 16 pieces
    with pytest.raises(BertFusedConfigError, match="16 pieces .* at most 15 after \\[CLS\\]"):
        model(src, lengths, prev)


@pytest.mark.parametrize("changes, pattern", [
    ({"bert_fusion": "concat"}, "--bert-fusion='concat'"),
    ({"bert_dropnet": 1.5}, "--bert-dropnet=1.5"),
    ({"bert_dropnet": -0.1}, "--bert-dropnet=-0.1"),
    ({"bert_finetune": "maybe"}, "--bert-finetune='maybe'"),
    ({"share_all_embeddings": True}, "--share-all-embeddings"),
])
def test_impossible_bert_options_are_named(changes, pattern):
    args = argparse.Namespace(bert_fusion="embed", bert_dropnet=1.0, bert_finetune=False,
                              share_all_embeddings=False)
    vars(args).update(changes)
    with pytest.raises(BertFusedConfigError, match=pattern.replace("[", "\\[")):
        validate_bert_args(args)


def test_unknown_fusion_is_an_argparse_error(tmp_path, bert_dir, capsys):
    with pytest.raises(SystemExit):
        build(tmp_path, bert_dir, "--bert-fusion", "concat")
    assert "--bert-fusion" in capsys.readouterr().err


def test_redundancy_capture_reads_the_layers_own_attentions_under_fusion(tmp_path, bert_dir):
    """sdma-redundancy's LR/HR measure the paper's three attention types inside the fusion wrappers."""
    from user_dir.sdma.attention_outputs import attention_outputs
    from user_dir.tools.sdma.redundancy import head_weight_modules

    model, task, _ = build(tmp_path, bert_dir, "--bert-fusion", "attention")
    model.eval()
    modules = head_weight_modules(model)
    assert not any(isinstance(m, BertFusedAttention) for mods in modules.values() for m in mods)
    src, lengths, prev = batch(task)
    with torch.no_grad(), attention_outputs(model) as store:
        model(src, lengths, prev)
    assert [recorded.weights.shape for recorded in store["encoder_self"]] == [(4, 3, 7, 7)] * 2
    assert [recorded.weights.shape for recorded in store["decoder_cross"]] == [(4, 3, 6, 7)] * 2
