"""The topic-informed VQ components (Yu et al., topic_vq_sts.txt, Section 3) against the paper,
computed the direct way: GSM topic model, topic-enhanced VQ-VAE (eq. 1, 6), and the
semantics-driven attention (eq. 4-5) on a tiny random BERT."""

import argparse
import copy
import math

import pytest
import torch
import torch.nn as nn
from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

from user_dir.hf_sentence.model import HFSentenceConfigError
from user_dir.topic_vq.model import TopicVQSTSConfig, validate_topic_args
from user_dir.topic_vq.ntm import NeuralTopicModel, topic_coherence
from user_dir.topic_vq.semantic_attention import (
    OutputEnhancement,
    SemanticAttentionContext,
    SemanticScores,
    align_to_pieces,
    attention_head_dim,
    install_semantic_attention,
    parse_semantic_attention_layers,
    semantic_attention_mask,
    uninstall_semantic_attention,
)
from user_dir.topic_vq.vocabulary import TopicVocabulary, check_num_topics
from user_dir.topic_vq.vqvae import TopicVQVAE, nearest_codes

PAD = 0  # user_dir.topic_vq.vocabulary.PAD_ID, the VQ-VAE's default padding_idx


# ---------------------------------------------------------------------------------------------
# Neural topic model (Section 3.1)


def test_beta_rows_are_distributions_over_the_vocabulary():
    torch.manual_seed(0)
    ntm = NeuralTopicModel(vocab_size=11, num_topics=4, embed_dim=8, hidden_dim=16)
    beta = ntm.beta()
    assert beta.shape == (4, 11)
    assert torch.allclose(beta.sum(-1), torch.ones(4))
    # beta_k = softmax(omega phi_k^T) over the vocabulary
    expected = torch.softmax(ntm.word_embeddings @ ntm.topic_embeddings[2], dim=0)
    assert torch.allclose(beta[2], expected)


def test_theta_on_the_simplex_and_deterministic_in_eval():
    torch.manual_seed(0)
    ntm = NeuralTopicModel(vocab_size=11, num_topics=4, embed_dim=8, hidden_dim=16)
    bow = torch.randint(0, 3, (5, 11)).float()
    out = ntm(bow)
    assert out.theta.shape == (5, 4) and bool((out.theta >= 0).all())
    assert torch.allclose(out.theta.sum(-1), torch.ones(5))
    ntm.eval()
    a, b = ntm(bow), ntm(bow)
    assert torch.equal(a.theta, b.theta)
    assert torch.allclose(a.theta, ntm.topic_proportions(a.mu))


def test_elbo_equals_hand_computation_on_three_words():
    torch.manual_seed(0)
    ntm = NeuralTopicModel(vocab_size=3, num_topics=2, embed_dim=4, hidden_dim=5)
    bow = torch.tensor([[2.0, 0.0, 1.0]])
    eps = torch.tensor([[0.3, -1.2]])
    out = ntm(bow, eps=eps)

    with torch.no_grad():
        l1, l2 = ntm.encoder[0], ntm.encoder[2]
        hidden = torch.relu(l2(torch.relu(l1(bow))))
        mu = hidden @ ntm.mu.weight.t() + ntm.mu.bias
        logvar = hidden @ ntm.logvar.weight.t() + ntm.logvar.bias
        h = mu + torch.exp(0.5 * logvar) * eps
        logits = h @ ntm.theta_proj.weight.t() + ntm.theta_proj.bias
        theta = torch.exp(logits) / torch.exp(logits).sum()
        omega, phi = ntm.word_embeddings, ntm.topic_embeddings
        rec = 0.0
        for w, count in enumerate(bow[0].tolist()):
            p_w = 0.0
            for k in range(2):
                scores = [float(omega[v] @ phi[k]) for v in range(3)]
                beta_kw = math.exp(scores[w]) / sum(math.exp(s) for s in scores)
                p_w += float(theta[0, k]) * beta_kw
            rec -= count * math.log(p_w)
        kl = 0.5 * sum(float(m) ** 2 + math.exp(float(lv)) - float(lv) - 1.0
                       for m, lv in zip(mu[0], logvar[0]))
    assert out.rec_loss.item() == pytest.approx(rec, rel=1e-5)
    assert out.kl.item() == pytest.approx(kl, rel=1e-5)
    assert out.loss.item() == pytest.approx(kl + rec, rel=1e-5)
    assert torch.allclose(out.theta, theta)


def test_perplexity_is_finite():
    torch.manual_seed(0)
    ntm = NeuralTopicModel(vocab_size=20, num_topics=3, embed_dim=8, hidden_dim=16).eval()
    bow = torch.randint(0, 3, (6, 20)).float()
    bow[0] = 0  # an empty document is left out
    gen = torch.Generator().manual_seed(1)
    ppl = ntm.perplexity(bow, num_samples=3, generator=gen)
    assert math.isfinite(ppl) and ppl > 1.0
    assert math.isfinite(ntm.perplexity(bow, per_document=True))
    with pytest.raises(ValueError, match="non-empty"):
        ntm.perplexity(torch.zeros(2, 20))


def test_npmi_of_perfect_and_never_cooccurring_pairs():
    # words: 0 and 1 always together (docs 0, 1); word 2 alone (docs 2, 3); word 3 in every doc
    docs = torch.tensor([[1, 2, 0, 1], [3, 1, 0, 1], [0, 0, 1, 1], [0, 0, 2, 1]]).float()
    beta = torch.tensor([
        [0.5, 0.4, 0.05, 0.05],  # top-2: words 0, 1 -> NPMI 1
        [0.5, 0.05, 0.4, 0.05],  # top-2: words 0, 2 -> never together -> NPMI -1
        [0.05, 0.05, 0.4, 0.5],  # top-2: words 3, 2 -> P(w3)=1: PMI 0 -> NPMI 0
    ])
    npmi = topic_coherence(beta, docs, top_n=2)
    assert torch.allclose(npmi, torch.tensor([1.0, -1.0, 0.0]), atol=1e-6)
    # a pair in every document: P(wi, wj) = 1, NPMI = 1 by convention
    assert topic_coherence(torch.tensor([[0.5, 0.5]]), torch.ones(3, 2), top_n=2).item() == 1.0
    # partial overlap against the formula; sparse input gives the same
    docs = torch.tensor([[1, 1], [1, 0], [0, 1], [1, 1], [0, 0]]).float()
    p_i, p_j, p_ij = 3 / 5, 3 / 5, 2 / 5
    expected = math.log(p_ij / (p_i * p_j)) / -math.log(p_ij)
    value = topic_coherence(torch.tensor([[0.6, 0.4]]), docs, top_n=2)
    assert value.item() == pytest.approx(expected, rel=1e-6)
    sparse = topic_coherence(torch.tensor([[0.6, 0.4]]), docs.to_sparse(), top_n=2)
    assert sparse.item() == pytest.approx(expected)
    with pytest.raises(ValueError, match="top_n"):
        topic_coherence(torch.tensor([[0.6, 0.4]]), docs, top_n=3)


def test_ntm_refuses_an_empty_topic_vocabulary():
    with pytest.raises(ValueError, match="vocabulary"):
        NeuralTopicModel(vocab_size=0, num_topics=1)


# The options of the components are checked once, where the model reads its configuration
# (TopicVQSTSModel.build_model): the components trust them.
TOPIC_OPTIONS = vars(TopicVQSTSConfig())


@pytest.mark.parametrize("option, value, match", [
    ("num_topics", 0, "--num-topics=0"),
    ("topic_embed_dim", 0, "--topic-embed-dim=0"),
    ("ntm_hidden_dim", 0, "--ntm-hidden-dim=0"),
    ("ntm_dropout", 1.0, r"--ntm-dropout 1.0 must lie in \[0, 1\)"),
    ("vq_heads", 3, "--vq-heads=3 must be >= 1 and divide --topic-embed-dim=64"),
    ("vq_dropout", -0.1, r"--vq-dropout -0.1 must lie in \[0, 1\)"),
    ("vq_commitment", math.inf, "--vq-commitment inf must be a finite number >= 0"),
    ("semantic_ffn_dim", 0, "--semantic-ffn-dim=0"),
])
def test_bad_component_options_are_named_where_the_config_is_read(option, value, match):
    validate_topic_args(argparse.Namespace(**TOPIC_OPTIONS))
    with pytest.raises(HFSentenceConfigError, match=match):
        validate_topic_args(argparse.Namespace(**{**TOPIC_OPTIONS, option: value}))


def test_more_topics_than_topic_words_are_refused():
    words = ["bird", "cat", "dog", "fish", "horse"]
    check_num_topics(5, TopicVocabulary(words, words))
    with pytest.raises(ValueError, match="--num-topics 6 exceeds the 5-word topic vocabulary"):
        check_num_topics(6, TopicVocabulary(words, words))


def test_ntm_wrong_bow_width_raises():
    ntm = NeuralTopicModel(vocab_size=5, num_topics=2, embed_dim=4, hidden_dim=8)
    with pytest.raises(ValueError, match=r"\[batch, 5\]"):
        ntm(torch.ones(2, 6))


# ---------------------------------------------------------------------------------------------
# Topic-enhanced VQ-VAE (Section 3.2, eq. 1 and 6)

VQ_VOCAB, TOPIC_VOCAB, K, E = 12, 6, 5, 8


def _vq_to_topic():
    # VQ ids 0..3 (pad=0, unk, ...) and 10, 11 have no topic word; 4..9 -> topic ids 0..5
    mapping = torch.full((VQ_VOCAB,), -1, dtype=torch.long)
    mapping[4:10] = torch.arange(6)
    return mapping


def _models(seed=0, **vq_kwargs):
    torch.manual_seed(seed)
    ntm = NeuralTopicModel(TOPIC_VOCAB, K, embed_dim=E, hidden_dim=16)
    kwargs = dict(codebook=ntm.topic_embeddings, topic_sensitive=True, max_positions=16, dropout=0.0,
                  num_heads=2, vq_to_topic=_vq_to_topic(), padding_idx=PAD)
    kwargs.update(vq_kwargs)
    return ntm, TopicVQVAE(VQ_VOCAB, K, E, **kwargs)


def _batch():
    tokens = torch.tensor([[4, 7, 11, 5, PAD, PAD], [9, 2, 6, 8, 4, 10]])
    bow = torch.zeros(2, TOPIC_VOCAB)
    mapping = _vq_to_topic()
    for b in range(2):
        for t in tokens[b].tolist():
            if mapping[t] >= 0:
                bow[b, mapping[t]] += 1
    return tokens, bow


def test_quantisation_picks_the_nearest_code():
    torch.manual_seed(0)
    z = torch.randn(3, 7, E)
    phi = torch.randn(K, E)
    brute = ((z[:, :, None, :] - phi) ** 2).sum(-1).argmin(-1)
    assert torch.equal(nearest_codes(z, phi), brute)

    ntm, vq = _models()
    tokens, bow = _batch()
    out = vq(tokens, ntm(bow).theta, ntm.beta())
    nonpad = tokens.ne(PAD)
    brute = ((out.z_e[:, :, None, :] - vq.codebook) ** 2).sum(-1).argmin(-1)
    assert torch.equal(out.codes[nonpad], brute[nonpad])
    assert bool((out.codes[~nonpad] == -1).all())
    assert torch.allclose(out.z_q[nonpad], vq.codebook[out.codes[nonpad]], atol=1e-6)  # value phi_k


def test_straight_through_gradient_reaches_the_encoder_unchanged():
    ntm, vq = _models()
    tokens, bow = _batch()
    out = vq(tokens, ntm(bow).theta, ntm.beta())
    w = torch.randn_like(out.z_q)
    grad_z_e, = torch.autograd.grad((out.z_q * w).sum(), out.z_e, retain_graph=True)
    nonpad = tokens.ne(PAD)
    assert torch.equal(grad_z_e[nonpad], w[nonpad])  # d z_q / d z_e = identity
    (out.z_q * w).sum().backward()
    for p in list(vq.encoder.parameters()) + [vq.input_proj.weight, vq.embed_tokens.weight]:
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_codebook_is_the_ntm_topic_embeddings_and_both_losses_train_it():
    ntm, vq = _models()
    assert vq.codebook is ntm.topic_embeddings
    assert vq.codebook.data_ptr() == ntm.topic_embeddings.data_ptr()
    both = nn.ModuleDict({"ntm": ntm, "vq": vq})
    assert sum(p is ntm.topic_embeddings for p in both.parameters()) == 1  # one tensor

    tokens, bow = _batch()
    ntm_out = ntm(bow)
    ntm_out.loss.sum().backward()
    assert ntm.topic_embeddings.grad.abs().sum() > 0
    ntm.zero_grad()
    vq_out = vq(tokens, ntm(bow).theta, ntm.beta())
    vq_out.codebook_loss.sum().backward()  # the codebook term of eq. (1) alone
    assert ntm.topic_embeddings.grad.abs().sum() > 0
    # eq. (6): a step on L_VQ + gamma L_NTM moves the shared phi
    both.zero_grad()
    ntm_out = ntm(bow)
    loss = vq(tokens, ntm_out.theta, ntm.beta()).loss.sum() + 1.0 * ntm_out.loss.sum()  # gamma = 1
    loss.backward()
    before = ntm.topic_embeddings.detach().clone()
    torch.optim.SGD(both.parameters(), lr=0.1).step()
    assert not torch.equal(before, vq.codebook.detach())


def test_frozen_codebook_gets_no_gradient_from_the_vq_loss():
    ntm, vq = _models(freeze_codebook=True)
    assert vq.codebook is ntm.topic_embeddings
    tokens, bow = _batch()
    out = vq(tokens, ntm(bow).theta, ntm.beta())
    out.loss.sum().backward()
    for p in ntm.parameters():  # Multistage: the NTM (phi, omega, encoder) is held fixed
        assert p.grad is None or p.grad.abs().sum() == 0
    assert vq.input_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("training", [True, False])
def test_padding_never_changes_the_loss(training):
    ntm, vq = _models()
    vq.train(training)
    ntm.eval()
    tokens, bow = _batch()
    theta, beta = ntm(bow).theta, ntm.beta()
    out = vq(tokens, theta, beta)
    padded = torch.cat([tokens, torch.full((2, 3), PAD)], dim=1)
    out_padded = vq(padded, theta, beta)
    for name in ("rec_loss", "codebook_loss", "commitment_loss", "loss"):
        assert torch.allclose(getattr(out, name), getattr(out_padded, name), atol=1e-5), name
    assert torch.equal(out.codes, out_padded.codes[:, :6])
    assert bool((out_padded.codes[:, 6:] == -1).all())
    assert out.perplexity == out_padded.perplexity
    left = vq(torch.cat([torch.full((2, 2), PAD), tokens], dim=1), theta, beta)  # positions count words
    assert torch.allclose(out.loss, left.loss, atol=1e-5)


def test_topical_embedding_is_theta_times_beta_column_and_zero_without_topic_word():
    ntm, vq = _models()
    tokens, bow = _batch()
    theta, beta = ntm(bow).theta, ntm.beta()
    x_t = vq.topical_embedding(tokens, theta, beta)
    assert x_t.shape == (2, 6, K)
    mapping = _vq_to_topic()
    for b in range(2):
        for m, word in enumerate(tokens[b].tolist()):
            if mapping[word] < 0:  # no topic word (11, 2, 10) and padding
                assert torch.equal(x_t[b, m], torch.zeros(K))
            else:
                assert torch.allclose(x_t[b, m], theta[b] * beta[:, mapping[word]])
    # each sentence uses its own words and theta (the authors used sentence 1's topic ids)
    alone = vq.topical_embedding(tokens[1:], theta[1:], beta)
    assert torch.allclose(alone[0], x_t[1])


def test_eq1_equals_hand_computation():
    ntm, vq = _models(commitment=0.25)
    tokens = torch.tensor([[4, 11, 5], [9, PAD, PAD]])
    bow = torch.zeros(2, TOPIC_VOCAB)
    out = vq(tokens, ntm(bow).theta, ntm.beta())
    phi = vq.codebook.detach()
    for b, n in enumerate([3, 1]):
        rec = cb = 0.0
        for i in range(n):
            log_p = torch.log_softmax(out.logits[b, i].detach(), -1)[tokens[b, i]]
            dist = ((out.z_e[b, i].detach() - phi[out.codes[b, i]]) ** 2).sum()
            rec, cb = rec - float(log_p), cb + float(dist)
        assert out.rec_loss[b].item() == pytest.approx(rec, rel=1e-5)
        assert out.codebook_loss[b].item() == pytest.approx(cb, rel=1e-5)
        assert out.commitment_loss[b].item() == pytest.approx(cb, rel=1e-5)
        assert out.loss[b].item() == pytest.approx(rec + cb + 0.25 * cb, rel=1e-5)
    # the two distance terms have the same value; eq. (1) puts weight 1 on the codebook's
    # gradient and lambda on the encoder's
    out = vq(tokens, ntm(bow).theta.detach(), ntm.beta().detach())  # no path to phi through beta
    nonpad = tokens.ne(PAD)
    diff = (out.z_e - vq.codebook[out.codes.clamp(min=0)]).detach() * nonpad.unsqueeze(-1)
    grad_phi, = torch.autograd.grad(out.loss.sum(), vq.codebook, retain_graph=True)
    expected = torch.zeros_like(phi).index_add_(0, out.codes[nonpad], -2.0 * diff[nonpad])
    assert torch.allclose(grad_phi, expected, atol=1e-5)
    grad_z_e, = torch.autograd.grad((out.loss - out.rec_loss).sum(), out.z_e)
    assert torch.allclose(grad_z_e[nonpad], 2 * 0.25 * diff[nonpad], atol=1e-5)


def test_ablations_and_bad_configurations():
    torch.manual_seed(0)
    plain = TopicVQVAE(VQ_VOCAB, K, E, None, topic_sensitive=False, max_positions=8, dropout=0.0,
                       num_heads=2, padding_idx=PAD)
    tokens, _ = _batch()
    out = plain(tokens)  # "w/o topic model": own codebook, no X^t
    assert isinstance(plain.codebook, nn.Parameter) and out.loss.shape == (2,)
    assert 1.0 <= out.perplexity <= K
    with pytest.raises(ValueError, match="codebook"):
        TopicVQVAE(VQ_VOCAB, K, E, nn.Parameter(torch.zeros(K + 1, E)), topic_sensitive=False)
    with pytest.raises(ValueError, match="vq_to_topic"):
        TopicVQVAE(VQ_VOCAB, K, E, None, topic_sensitive=True)
    with pytest.raises(ValueError, match="max_positions"):
        plain(torch.full((1, 9), 4))
    with pytest.raises(ValueError, match="non-pad"):
        plain(torch.tensor([[4, 5], [PAD, PAD]]))
    ntm, vq = _models()
    with pytest.raises(ValueError, match="theta"):
        vq(tokens)


# ---------------------------------------------------------------------------------------------
# Semantics-driven attention (Section 3.3, eq. 4-5)

CODE = 6


def _bert(implementation="eager", seed=0):
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, attn_implementation=implementation)
    return BertModel(config, add_pooling_layer=False).eval()


def _pair_inputs():
    # row 0: [CLS] a b b' [SEP] c d [SEP]; row 1: [CLS] a [SEP] c d d' [SEP] [PAD]
    torch.manual_seed(1)
    input_ids = torch.randint(5, 100, (2, 8))
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[1, 7] = 0
    piece_sentence = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, -1], [-1, 0, -1, 1, 1, 1, -1, -1]])
    piece_word = torch.tensor([[-1, 0, 1, 1, -1, 0, 1, -1], [-1, 0, -1, 0, 1, 1, -1, -1]])
    z_q_1 = torch.randn(2, 3, CODE)
    z_q_2 = torch.randn(2, 2, CODE)
    return input_ids, attention_mask, align_to_pieces(z_q_1, z_q_2, piece_sentence, piece_word)


def test_align_to_pieces_takes_each_sentences_own_vectors():
    z1 = torch.arange(2 * 3 * 2, dtype=torch.float).view(2, 3, 2)
    z2 = -torch.arange(1, 2 * 2 * 2 + 1, dtype=torch.float).view(2, 2, 2)
    sentence = torch.tensor([[-1, 0, 0, -1, 1, 1, -1], [-1, 0, -1, 1, 1, -1, -1]])
    word = torch.tensor([[-1, 0, 2, -1, 0, 1, -1], [-1, 1, -1, 1, 0, -1, -1]])
    out = align_to_pieces(z1, z2, sentence, word)
    assert out.shape == (2, 7, 2)
    assert torch.equal(out[0, 1], z1[0, 0]) and torch.equal(out[0, 2], z1[0, 2])
    assert torch.equal(out[0, 4], z2[0, 0]) and torch.equal(out[0, 5], z2[0, 1])  # sentence 2's vectors
    assert torch.equal(out[1, 3], z2[1, 1]) and torch.equal(out[1, 4], z2[1, 0])
    assert torch.equal(out[1, 1], z1[1, 1])
    special = sentence.eq(-1)
    assert bool((out[special] == 0).all())
    with pytest.raises(ValueError, match="past its sentence"):
        align_to_pieces(z1, z2, sentence, word.masked_fill(sentence.eq(1), 2))


def test_layer_spec_parser():
    assert parse_semantic_attention_layers("last", 12) == [11]
    assert parse_semantic_attention_layers("all", 3) == [0, 1, 2]
    assert parse_semantic_attention_layers("none", 3) == []
    assert parse_semantic_attention_layers("0, -1", 12) == [0, 11]
    with pytest.raises(ValueError, match=r"--semantic-attention-layers.*12 layers"):
        parse_semantic_attention_layers("12", 12)
    with pytest.raises(ValueError, match=r"--semantic-attention-layers.*12 layers"):
        parse_semantic_attention_layers("-13", 12)
    with pytest.raises(ValueError, match="--semantic-attention-layers"):
        parse_semantic_attention_layers("first", 12)
    with pytest.raises(ValueError, match="twice"):
        parse_semantic_attention_layers("11,-1", 12)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [True, False])
def test_zero_bias_equals_the_unwrapped_model(implementation, padded):
    bert = _bert(implementation)
    reference = copy.deepcopy(bert)
    input_ids, attention_mask, _ = _pair_inputs()
    if not padded:
        attention_mask = torch.ones_like(attention_mask)
    context = SemanticAttentionContext()
    assert set(install_semantic_attention(bert, "all", context)) == {0, 1}
    with torch.no_grad(), context.use(torch.zeros(2, 1, 8, 8)):
        out = bert(input_ids, attention_mask=attention_mask).last_hidden_state
    expected = reference(input_ids, attention_mask=attention_mask).last_hidden_state
    if implementation == "eager":
        assert torch.equal(out, expected)
    else:  # a float mask instead of sdpa's boolean (or no) mask: same up to rounding
        assert torch.allclose(out, expected, atol=1e-6)


@pytest.mark.parametrize("spec, first_changed", [("last", 2), ("all", 1), ("1", 2), ("0", 1)])
def test_bias_changes_only_the_chosen_layers(spec, first_changed):
    bert = _bert()
    reference = copy.deepcopy(bert)
    input_ids, attention_mask, z = _pair_inputs()
    scores = SemanticScores(CODE, 16, attention_head_dim(bert))
    context = SemanticAttentionContext()
    install_semantic_attention(bert, spec, context)
    with torch.no_grad(), context.use(scores(z)):
        hidden = bert(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    expected = reference(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    for i in range(3):  # hidden_states[i] is the input of layer i
        assert torch.equal(hidden[i], expected[i]) == (i < first_changed), i


def test_parameters_exist_once_and_all_receive_gradients():
    bert = _bert().train()
    n_bert = sum(p.numel() for p in bert.parameters())
    context = SemanticAttentionContext()
    installed = install_semantic_attention(bert, "all", context)
    assert sum(p.numel() for p in bert.parameters()) == n_bert  # hooks create no parameters
    assert installed == {0: bert.encoder.layer[0].attention.self, 1: bert.encoder.layer[1].attention.self}
    model = nn.ModuleDict({
        "bert": bert,
        "scores": SemanticScores(CODE, 16, attention_head_dim(bert)),
        "enhance": OutputEnhancement(CODE, 4),
    })
    assert attention_head_dim(bert) == 16
    input_ids, attention_mask, z = _pair_inputs()
    with context.use(model["scores"](z)):
        hidden = bert(input_ids, attention_mask=attention_mask).last_hidden_state
    keep = attention_mask.unsqueeze(-1).float()
    pooled = model["enhance"]((hidden * keep).sum(1) / keep.sum(1), z, attention_mask.bool())
    assert pooled.shape == (2, 32 + 4)
    pooled.pow(2).sum().backward()
    names = [name for name, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert names == []  # no unused parameter: DDP-safe
    assert sum(1 for _ in model["scores"].parameters()) == 6  # FFN (2 x weight, bias), W_q^Q, W_q^K


def test_attention_probabilities_match_eq5_by_hand():
    bert = _bert("eager")
    input_ids, attention_mask, z = _pair_inputs()
    scores = SemanticScores(CODE, 16, attention_head_dim(bert))
    with torch.no_grad():
        scores.query.weight.mul_(5.0)  # a bias large enough to matter
    context = SemanticAttentionContext()
    install_semantic_attention(bert, [-1], context)
    with torch.no_grad(), context.use(scores(z)):
        out = bert(input_ids, attention_mask=attention_mask, output_hidden_states=True, output_attentions=True)
        attn = bert.encoder.layer[1].attention.self
        h = out.hidden_states[1]
        d_k = 16

        def heads(x):
            return x.view(2, 8, 2, d_k).transpose(1, 2)

        q, k = heads(attn.query(h)), heads(attn.key(h))
        zz = scores.ffn(z)
        q_q, k_q = zz @ scores.query.weight.t(), zz @ scores.key.weight.t()  # eq. (4)
        mask = (1.0 - attention_mask.float())[:, None, None, :] * torch.finfo(torch.float32).min
        logits = (q @ k.transpose(-1, -2) + (q_q @ k_q.transpose(-1, -2)).unsqueeze(1)) / math.sqrt(d_k)
        expected = torch.softmax(logits + mask, dim=-1)  # eq. (5)
    assert torch.allclose(out.attentions[1], expected, atol=1e-6)
    # the first layer is plain attention (eq. 3)
    with torch.no_grad():
        h0 = out.hidden_states[0]
        first = bert.encoder.layer[0].attention.self
        q0, k0 = heads(first.query(h0)), heads(first.key(h0))
        plain = torch.softmax(q0 @ k0.transpose(-1, -2) / math.sqrt(d_k) + mask, dim=-1)
    assert torch.allclose(out.attentions[0], plain, atol=1e-6)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_padding_keys_stay_masked_under_a_huge_bias(implementation):
    bert = _bert(implementation)
    input_ids, attention_mask, _ = _pair_inputs()
    context = SemanticAttentionContext()
    install_semantic_attention(bert, "all", context)
    huge = torch.full((2, 1, 8, 8), 1e30)
    huge[..., 7] = torch.finfo(torch.float32).max  # min + max = 0 would un-mask the pad key
    with torch.no_grad(), context.use(huge):
        out = bert(input_ids, attention_mask=attention_mask, output_attentions=implementation == "eager")
    assert torch.isfinite(out.last_hidden_state).all()
    if implementation == "eager":
        for probs in out.attentions:
            assert bool((probs[1, :, :, 7] == 0).all())  # the pad key of row 1
    keep = attention_mask.bool()[:, None, None, :].expand(2, 1, 8, 8)
    for mask in (None, keep, torch.where(keep, 0.0, torch.finfo(torch.float32).min)):
        combined = semantic_attention_mask(mask, huge, torch.float32)
        if mask is not None:
            assert bool((combined[1, :, :, 7] == torch.finfo(torch.float32).min).all())
            assert bool((combined[0, :, :, :7] == 1e30).all())
    # fp16: finfo.min is only -65504, an ordinary large bias would un-mask a pad key
    mask = attention_mask.bool()[:, None, None, :].expand(2, 1, 8, 8)
    combined = semantic_attention_mask(mask, torch.full((2, 1, 8, 8), 1e5), torch.float16)
    assert bool((combined[1, :, :, 7] == torch.finfo(torch.float16).min).all())
    additive = torch.where(mask, 0.0, torch.finfo(torch.float16).min).half()
    combined = semantic_attention_mask(additive, torch.full((2, 1, 8, 8), 6e4), torch.float16)
    assert bool((combined[1, :, :, 7] == torch.finfo(torch.float16).min).all())
    assert bool((combined[0] == 6e4).all())


def test_eager_and_sdpa_give_the_same_outputs():
    eager = _bert("eager")
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    input_ids, attention_mask, z = _pair_inputs()
    scores = SemanticScores(CODE, 16, attention_head_dim(eager))
    outputs = []
    for bert in (eager, sdpa):
        context = SemanticAttentionContext()
        install_semantic_attention(bert, "all", context)
        with torch.no_grad(), context.use(scores(z)):
            outputs.append(bert(input_ids, attention_mask=attention_mask).last_hidden_state)
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5)


def test_roberta_layers_are_found_and_hooked():
    torch.manual_seed(0)
    config = RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=40, attn_implementation="sdpa")
    roberta = RobertaModel(config, add_pooling_layer=False).eval()
    reference = copy.deepcopy(roberta)
    input_ids, attention_mask, z = _pair_inputs()
    context = SemanticAttentionContext()
    install_semantic_attention(roberta, "last", context)
    scores = SemanticScores(CODE, 16, attention_head_dim(roberta))
    with torch.no_grad(), context.use(scores(z)):
        hidden = roberta(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    expected = reference(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    assert torch.equal(hidden[1], expected[1]) and not torch.allclose(hidden[2], expected[2])


def test_install_errors():
    bert = _bert()
    context = SemanticAttentionContext()
    input_ids, attention_mask, _ = _pair_inputs()
    with pytest.raises(ValueError, match=r"--semantic-attention-layers.*2 layers"):
        install_semantic_attention(bert, [2], context)
    install_semantic_attention(bert, "last", context)
    with pytest.raises(ValueError, match="already"):
        install_semantic_attention(bert, [1], context)
    with pytest.raises(RuntimeError, match="no bias"):
        bert(input_ids, attention_mask=attention_mask)
    with pytest.raises(ValueError, match=r"\[2, 1, 8, 8\]"), context.use(torch.zeros(2, 1, 7, 7)):
        bert(input_ids, attention_mask=attention_mask)
    assert context.bias is None  # cleared after use, also on error
    assert uninstall_semantic_attention(bert) == [1]
    bert(input_ids, attention_mask=attention_mask)  # plain again
    for implementation in ("flash_attention_2", "flex_attention"):
        other = _bert()
        other.config._attn_implementation = implementation
        with pytest.raises(ValueError, match="eager"):
            install_semantic_attention(other, "last", context)
    with pytest.raises(TypeError, match="BERT-family"):
        install_semantic_attention(nn.Linear(2, 2), "last", context)
