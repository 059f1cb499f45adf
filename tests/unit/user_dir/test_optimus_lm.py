"""``optimus_lm``: one sentence as BERT WordPiece (encoder input) and GPT-2 byte-level BPE
(decoder target) -- preparation (pipelines/data/optimus_text.py), the task
(user_dir/optimus/task.py) and the Optimus model built over it, on tiny saved BERT and GPT-2
directories (random weights, real tokenizers) and real English Ding phrases."""

import json
import math
import shutil

import pytest
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from pipelines.data.optimus_text import (
    OptimusDataError,
    gpt2_pieces,
    load_gpt2_tokenizer,
    prepare,
    train_gpt2_tokenizer,
)
from tests.conftest import REPO, english_phrases, save_tiny_bert
from user_dir.optimus.task import OptimusBinaryDataError as TaskDataError
from fairseq.ngram_repeat_block import NGramRepeatBlock

from user_dir.sentence_vae.decoding import GeneratedPrefixNGramBlock, LatentDecoder, generation_args
from user_dir.tools.sentence_vae.evaluate import evaluate_split

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """240 Ding phrases as raw text (200 train, 20 valid, 20 test), a WordPiece BERT over their
    words and a byte-level BPE (400 entries) trained on train, saved with a tiny GPT-2."""
    root = tmp_path_factory.mktemp("optimus_lm")
    lines = english_phrases(240)
    for name, part in (("train", lines[:200]), ("valid", lines[200:220]), ("test", lines[220:])):
        (root / f"{name}.txt").write_text("\n".join(part) + "\n")
    words = sorted({w for line in lines for w in line.split()})
    bert = save_tiny_bert(root / "bert", SPECIALS + words)
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(str(bert))).save_pretrained(str(bert))
    gpt2 = train_gpt2_tokenizer([root / "train.txt"], root / "gpt2", vocab_size=400)
    tokenizer = load_gpt2_tokenizer(gpt2)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                               bos_token_id=eos, eos_token_id=eos, resid_pdrop=0.0, embd_pdrop=0.0,
                               attn_pdrop=0.0)).save_pretrained(str(gpt2))
    data = root / "bin"
    summary = prepare(data, {s: root / f"{s}.txt" for s in ("train", "valid", "test")}, bert, gpt2)
    return {"root": root, "lines": lines, "bert": bert, "gpt2": gpt2, "data": data, "summary": summary}


def build(data, *extra):
    argv = [str(data), "--user-dir", str(REPO / "user_dir"), "--task", "optimus_lm", "--criterion", "sentence_vae",
            "--arch", "optimus_small", "--latent-dim", "8", "--dropout", "0", "--attention-dropout", "0",
            "--optimizer", "adam", "--lr", "0.001", *extra]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    return task, task.build_model(cfg.model)


def pretrained(corpus, *extra):
    return build(corpus["data"], "--bert-dir", str(corpus["bert"]), "--gpt2-dir", str(corpus["gpt2"]), *extra)


def first_batch(task, split="valid", size=5):
    task.load_dataset(split)
    dataset = task.dataset(split)
    return dataset.collater([dataset[i] for i in range(size)])


# ------------------------------------------------------------------------ tokenizers
def test_trained_bpe_is_saved_in_gpt2_format_and_round_trips(corpus, tmp_path):
    gpt2 = corpus["gpt2"]
    assert {"vocab.json", "merges.txt", "tokenizer.json"} <= {p.name for p in gpt2.iterdir()}
    only_gpt2_files = tmp_path / "gpt2_files"
    only_gpt2_files.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(gpt2 / name, only_gpt2_files / name)
    a, b = load_gpt2_tokenizer(gpt2), load_gpt2_tokenizer(only_gpt2_files)
    for line in corpus["lines"][:50]:
        tokens = a.tokenize(line)
        assert tokens == b.tokenize(line)
        assert a.convert_tokens_to_string(tokens) == line
    assert any(t.startswith("\u0120") for t in a.tokenize("the cat sat"))  # GPT-2's byte-level space


def test_gpt2_tokenizer_errors_name_the_problem(corpus, tmp_path):
    with pytest.raises(OptimusDataError, match="--gpt2-dir .*no such directory"):
        load_gpt2_tokenizer(tmp_path / "nowhere")
    no_merges = tmp_path / "no_merges"
    no_merges.mkdir()
    shutil.copy(corpus["gpt2"] / "vocab.json", no_merges)
    with pytest.raises(OptimusDataError, match="vocab.json without merges.txt"):
        load_gpt2_tokenizer(no_merges)
    with pytest.raises(OptimusDataError, match="not a BPE tokenizer"):
        load_gpt2_tokenizer(corpus["data"] / "bert_tokenizer")  # a WordPiece tokenizer.json
    with pytest.raises(OptimusDataError, match="--bpe-vocab-size 100"):
        train_gpt2_tokenizer([corpus["root"] / "train.txt"], tmp_path / "bpe", vocab_size=100)


# ------------------------------------------------------------------------ preparation
def test_prepare_writes_both_tokenizations_of_every_sentence(corpus):
    data, summary = corpus["data"], corpus["summary"]
    assert summary["splits"]["train"]["sentences"] == 200
    assert summary["splits"]["valid"]["sentences"] == summary["splits"]["test"]["sentences"] == 20
    bert_lines = (data / "text" / "train.bert").read_text().splitlines()
    gpt2_lines = (data / "text" / "train.gpt2").read_text().splitlines()
    tokenizer = load_gpt2_tokenizer(corpus["gpt2"])
    for line, bert_line, gpt2_line in zip(corpus["lines"][:200], bert_lines, gpt2_lines):
        assert bert_line == line  # every word is one WordPiece of the tiny BERT
        assert tokenizer.convert_tokens_to_string(gpt2_line.split()) == line
    for split in ("train", "valid", "test"):
        for lang in ("bert", "gpt2"):
            assert (data / f"{split}.bert-gpt2.{lang}.bin").stat().st_size > 0
    assert json.loads((data / "optimus_data.json").read_text())["dict_gpt2_symbols"] == summary["dict_gpt2_symbols"]
    assert "<|endoftext|>" not in (data / "dict.gpt2.txt").read_text().split()  # fairseq's </s> stands for it


@pytest.mark.integration  # runs the data preparation (fairseq-preprocess) again
def test_too_long_sentences_stop_the_preparation_with_their_line_or_are_counted(corpus, tmp_path):
    texts = {"train": corpus["root"] / "train.txt"}
    longest = max(len(gpt2_pieces(load_gpt2_tokenizer(corpus["gpt2"]), [l])[0].split())
                  for l in corpus["lines"][:200])
    limit = longest  # positions = tokens + end token + memory slot would be longest + 2
    with pytest.raises(OptimusDataError, match=r"train\.txt:\d+: .* GPT-2 tokens \(limit .*--skip-too-long"):
        prepare(tmp_path / "refuse", texts, corpus["bert"], corpus["gpt2"], gpt2_max_positions=limit)
    summary = prepare(tmp_path / "skip", texts, corpus["bert"], corpus["gpt2"], skip_too_long=True,
                      gpt2_max_positions=limit)
    dropped = summary["splits"]["train"]["dropped_too_long"]
    assert dropped >= 1 and summary["splits"]["train"]["sentences"] == 200 - dropped


def test_bad_text_is_named(corpus, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a good line\n\xff\xfe broken\n")
    with pytest.raises(OptimusDataError, match=r"bad\.txt:2: not UTF-8"):
        prepare(tmp_path / "out", {"train": bad}, corpus["bert"], corpus["gpt2"])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(OptimusDataError, match="no sentences left for the train split"):
        prepare(tmp_path / "out2", {"train": empty}, corpus["bert"], corpus["gpt2"])


# ------------------------------------------------------------------------ the task
def test_batches_carry_wordpiece_in_and_bpe_out_starting_from_bos(corpus):
    task, _ = build(corpus["data"])
    batch = first_batch(task)
    src, prev, target = batch["net_input"]["src_tokens"], batch["net_input"]["prev_output_tokens"], batch["target"]
    tgt_dict = task.target_dictionary
    assert task.source_dictionary is not tgt_dict
    assert bool((prev[:, 0] == tgt_dict.bos()).all())  # the authors' <BOS> x <EOS>
    valid = corpus["lines"][200:220]
    for row in range(src.size(0)):
        tokens = target[row][target[row].ne(tgt_dict.pad())]
        assert int(tokens[-1]) == tgt_dict.eos()
        assert torch.equal(prev[row, 1:tokens.numel()], tokens[:-1])
        text = task.target_text(tokens)
        assert text in valid
        assert torch.equal(task.source_ids(text), src[row][src[row].ne(task.source_dictionary.pad())])
        assert task.target_word_count(tokens) == len(text.split()) + 1
    eos_task, _ = build(corpus["data"], "--decoder-start", "eos")
    assert bool((first_batch(eos_task)["net_input"]["prev_output_tokens"][:, 0] == tgt_dict.eos()).all())


@pytest.mark.integration  # runs the data preparation (fairseq-preprocess) again
def test_mismatched_or_foreign_binaries_are_refused(corpus, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(corpus["data"], data)
    lines = (data / "dict.gpt2.txt").read_text().splitlines()
    (data / "dict.gpt2.txt").write_text("\n".join(lines[:20]) + "\n")
    task, _ = build(data)
    with pytest.raises(TaskDataError, match=r"valid\.bert-gpt2\.gpt2\.bin has token index \d+, but .*dict\.gpt2\.txt"):
        task.load_dataset("valid")
    other = tmp_path / "other"
    prepare(other, {"train": corpus["root"] / "train.txt", "valid": corpus["root"] / "test.txt"},
            corpus["bert"], corpus["gpt2"])
    shutil.copytree(corpus["data"], tmp_path / "mixed")
    short = tmp_path / "short.txt"
    short.write_text("\n".join(corpus["lines"][200:210]) + "\n")
    prepare(tmp_path / "short", {"train": corpus["root"] / "train.txt", "valid": short},
            corpus["bert"], corpus["gpt2"])
    for ext in ("bin", "idx"):
        shutil.copy(tmp_path / "short" / f"valid.bert-gpt2.gpt2.{ext}", tmp_path / "mixed" / f"valid.bert-gpt2.gpt2.{ext}")
    task, _ = build(tmp_path / "mixed")
    with pytest.raises(TaskDataError, match="20 BERT sentences but 10 GPT-2 sentences"):
        task.load_dataset("valid")
    with pytest.raises(FileNotFoundError, match="dict.bert.txt not found.*prepare-optimus-data"):
        build(corpus["root"])


# ------------------------------------------------------------------------ the model on the task
def test_pretrained_pair_maps_each_dictionary_onto_its_own_vocabulary(corpus):
    task, model = pretrained(corpus)
    bert_vocab = json.loads((corpus["data"] / "bert_tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    gpt2_vocab = json.loads((corpus["gpt2"] / "vocab.json").read_text())
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    rows = model.encoder.vocab_rows.tolist()
    assert rows[src_dict.bos()] == bert_vocab["[CLS]"] and rows[src_dict.eos()] == bert_vocab["[SEP]"]
    assert all(rows[i] == bert_vocab[src_dict[i]] for i in range(src_dict.nspecial, len(src_dict)))
    rows = model.decoder.vocab_rows.tolist()
    assert rows[tgt_dict.eos()] == gpt2_vocab["<|endoftext|>"]
    assert rows[tgt_dict.bos()] >= len(gpt2_vocab)  # <BOS>: a new GPT-2 row, as the authors added
    assert all(rows[i] == gpt2_vocab[tgt_dict[i]] for i in range(tgt_dict.nspecial, len(tgt_dict)))


def test_generation_starts_from_bos_and_scores_equal_forced_scoring(corpus):
    task, model = pretrained(corpus)
    model.eval()
    batch = first_batch(task, size=3)
    decoder = LatentDecoder(model, task, generation_args(beam=2, max_len=12), batch_size=3)
    hypos = task.inference_step(decoder.generator, [model], {"net_input": {
        k: v for k, v in batch["net_input"].items() if k != "prev_output_tokens"}})
    src, lengths = batch["net_input"]["src_tokens"], batch["net_input"]["src_lengths"]
    with torch.no_grad():
        encoder_out = model.encoder(src, lengths)
        for row, hypo in enumerate(hypos):
            tokens = hypo[0]["tokens"]
            prev = torch.cat([tokens.new_tensor([task.target_dictionary.bos()]), tokens[:-1]]).unsqueeze(0)
            one = {k: {n: v[row:row + 1] for n, v in d.items()} for k, d in encoder_out.items()}
            logits, _ = model.decoder(prev, one)
            forced = torch.log_softmax(logits.float(), -1)[0].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            assert torch.allclose(hypo[0]["positional_scores"], forced, atol=1e-4)
    text = decoder.reconstruct([corpus["lines"][0]])[0]
    assert isinstance(text, str) and "\u0120" not in text


def test_repeated_ngrams_are_blocked_in_the_generated_prefix_not_the_padded_buffer():
    # SequenceGenerator's buffer after step 2 of a 6-long budget: <s> 7 8 7, then padding (1).
    tokens = torch.tensor([[0, 7, 8, 7, 1, 1, 1, 1]])
    lprobs = torch.zeros(1, 10)
    blocked = GeneratedPrefixNGramBlock(2, use_extension=False)(tokens, lprobs.clone(), 1, 1, step=3)
    assert blocked[0, 8] == float("-inf")  # "7 8" was generated: 8 cannot follow the last 7 again
    assert torch.isfinite(blocked[0, [i for i in range(10) if i != 8]]).all()
    # fairseq's own CPU path compares the buffer's padding tail and blocks nothing (issues #4709, #5206)
    assert torch.isfinite(NGramRepeatBlock(2, use_extension=False)(tokens, lprobs.clone(), 1, 1, step=3)).all()


def test_no_repeat_ngram_size_reaches_vae_generation(corpus):
    task, model = pretrained(corpus)
    decoder = LatentDecoder(model.eval(), task, generation_args(beam=2, max_len=12, min_len=12,
                                                               no_repeat_ngram_size=1), batch_size=4)
    assert isinstance(decoder.generator.repeat_ngram_blocker, GeneratedPrefixNGramBlock)
    latents = decoder.prior_samples(4, torch.Generator().manual_seed(0))
    for row in range(4):
        hypos = task.inference_step(decoder.generator, [model], {"net_input": {
            "src_tokens": torch.empty(1, 0, dtype=torch.long), "src_lengths": torch.zeros(1, dtype=torch.long),
            "latents": {name: z[row:row + 1] for name, z in latents.items()}}})
        generated = hypos[0][0]["tokens"][:-1].tolist()  # without the final </s>
        assert len(generated) >= 12 and len(set(generated)) == len(generated)


def test_evaluation_reports_per_token_and_per_word_perplexity_of_one_bound(corpus):
    task, model = pretrained(corpus)
    results = evaluate_split(model, task, "valid", k=4, chunk_size=2, batch_size=8, mi_samples=2)
    assert results["num_words"] == sum(len(l.split()) + 1 for l in corpus["lines"][200:220])
    assert results["num_tokens"] > results["num_words"]  # BPE pieces outnumber words here
    # one log-likelihood sum, two units: log PPL_word * words == log PPL_token * tokens
    assert math.log(results["iw_ppl_word"]) * results["num_words"] == pytest.approx(
        math.log(results["iw_ppl"]) * results["num_tokens"], rel=1e-9)
    assert results["iw_ppl_word_ci95_low"] <= results["iw_ppl_word"] <= results["iw_ppl_word_ci95_high"]
    # Optimus' tables: GPT-2 tokens of <BOS> x <EOS>, i.e. fairseq's tokens (x </s>) + 1 per sentence
    assert math.log(results["ppl_optimus_units"]) * (results["num_tokens"] + 20) == pytest.approx(
        math.log(results["iw_ppl"]) * results["num_tokens"], rel=1e-9)
    assert "<BOS> x <EOS>" in results["estimators"]["ppl_optimus_units"]
    assert "13a" in results["estimators"]["rec_bleu"] and "per word" in results["estimators"]["ppl_unit"]
    assert 0.0 <= results["rec_bleu"] <= 100.0
    assert 0.0 < results["pc1_share"] == results["pc1_share_z"] <= 1.0 and "principal" in results["estimators"]["pc1_share"]


@pytest.mark.parametrize("extra, variant", [((), "hinge"), (("--kl-variant", "free_bits"), "free_bits")])
def test_defaults_are_the_authors_hinge_and_sentence_average(corpus, extra, variant):
    """Optimus' code: KL dimensions below lambda masked out (hinge) and the loss averaged over
    sentences; the paper's eq. 9 (free bits) is one option away."""
    argv = [str(corpus["data"]), "--user-dir", str(REPO / "user_dir"), "--task", "optimus_lm", "--criterion",
            "sentence_vae", "--arch", "optimus_small", "--latent-dim", "4", "--kl-threshold", "0.5", *extra]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    sample = first_batch(task, size=3)
    model.eval()
    with torch.no_grad():
        _, sample_size, log = criterion(model, sample)
    assert criterion.kl_variant == variant and criterion.regularizers["z"].variant == variant
    assert sample_size == 3  # sentences, without --sentence-avg


# ------------------------------------------------------------------------ low-resource helpers
def test_labelled_draws_and_the_feature_classifier(tmp_path):
    from latent_core.vae import VAEConfigError
    from user_dir.tools.optimus.low_resource import feature_based_accuracy, read_labelled, sample_per_class

    labels = ["0"] * 30 + ["1"] * 20
    rows = sample_per_class(labels, 5, seed=3)
    assert len(rows) == 10 and len(set(rows)) == 10
    assert sorted(labels[i] for i in rows) == ["0"] * 5 + ["1"] * 5
    assert rows == sample_per_class(labels, 5, seed=3) and rows != sample_per_class(labels, 5, seed=4)
    with pytest.raises(VAEConfigError, match="class '1' has only 20"):
        sample_per_class(labels, 21, seed=0)
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, generator=rng).numpy()
    x[:30, 0] += 4.0  # separable along the first feature
    assert feature_based_accuracy(x[rows], [labels[i] for i in rows], x, labels) >= 0.95
    bad = tmp_path / "bad.tsv"
    bad.write_text("text\tlabel\na b\t1\n")
    with pytest.raises(VAEConfigError, match=r"bad\.tsv:1: expected the header"):
        read_labelled(bad)
    bad.write_text("sentence\tlabel\na b\t1\nno label here\n")
    with pytest.raises(VAEConfigError, match=r"bad\.tsv:3: expected"):
        read_labelled(bad)


def test_latent_cgan_learns_where_each_label_lives():
    from user_dir.tools.optimus.conditional_generation import mean_sentence_bleu, self_bleu, train_cgan

    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[3.0, 0.0, 0.0, 0.0], [-3.0, 0.0, 0.0, 0.0]])
    labels = torch.arange(2).repeat(200)
    z = centres[labels] + 0.3 * torch.randn(400, 4, generator=g)
    gan = train_cgan(z, labels, num_labels=2, steps=600, batch=64, seed=0, hidden=64)
    with torch.no_grad():
        for label in (0, 1):
            made = gan.generate(torch.full((200,), label, dtype=torch.long), torch.Generator().manual_seed(1))
            own = (made - centres[label]).norm(dim=-1).mean()
            other = (made - centres[1 - label]).norm(dim=-1).mean()
            assert own < 1.5 < other  # the generated z of a label sit at that label's latents
    assert self_bleu(["the cat sat", "the cat sat"]) == pytest.approx(100.0)
    assert mean_sentence_bleu(["a b c d"], ["w x y z"]) < 5.0


def test_pair_speed_times_optimus_against_its_own_decoder_alone(corpus):
    from benchmarks.optimus.speed import time_pair_vs_gpt2

    small = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-attention-heads", "2",
             "--decoder-ffn-embed-dim", "64", "--latent-dim", "8"]
    result = time_pair_vs_gpt2(str(corpus["data"]), str(corpus["bert"]), sentences=8, rounds=2,
                               updates_per_round=1, extra=small)
    assert result["decoder"] == {"n_layer": 2, "n_embd": 32, "n_head": 2,
                                 "vocab_size": result["decoder"]["vocab_size"]}
    # the pairing does the GPT-2's work plus BERT's and the latent's: more FLOPs, bound < 1
    assert result["flops_per_update"]["optimus"] > result["flops_per_update"]["gpt2"] > 0
    assert 0 < result["flops_bound"] < 1
    assert len(result["wps_ratio"]["per_round"]) == 2 and result["wps_ratio"]["median"] > 0
    assert result["params"]["optimus"] > result["params"]["gpt2"]


def test_tokenizer_saved_with_other_data_is_refused(corpus, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(corpus["data"], data)
    other = train_gpt2_tokenizer([corpus["root"] / "test.txt"], tmp_path / "other_bpe", vocab_size=300)
    shutil.rmtree(data / "gpt2_tokenizer")
    shutil.copytree(other, data / "gpt2_tokenizer")
    task, _ = build(data)
    with pytest.raises(TaskDataError, match=r"symbols of the data's dictionary are not in gpt2_tokenizer/"):
        task.target_text(torch.tensor([task.target_dictionary.nspecial + 5]))
