"""Gaussian-softmax neural topic model (GSM) with embedded topics, and NPMI topic coherence.

Yu et al., "Learning Semantic Textual Similarity via Topic-informed Discrete Latent
Variables" (Yu et al. 2022, arXiv:2211.03616), Section 3.1: the NTM of Miao et al. (2017,
"Discovering discrete latent topics with neural variational inference"), the Gaussian
softmax construction (GSM), with the topic-word distributions of Wang & Yang (2020):

* encoder ``x -> (mu, log sigma^2)``: a two-layer ReLU MLP on the bag-of-words counts
  (hidden 256, as in GSM's inference network), then one linear map each;
* h = mu + sigma * eps, eps ~ N(0, I) (the reparameterisation trick; training only: in
  eval mode h = mu, so theta is deterministic);
* theta = softmax(W h + b), the sentence's topic proportions ``[B, K]`` (GSM);
* beta_k = softmax(omega phi_k^T) over the vocabulary, with word embeddings omega ``[V, E]``
  and topic embeddings phi ``[K, E]`` (Section 3.1; E = 64). phi is
  :attr:`NeuralTopicModel.topic_embeddings`, the ONE tensor that the topic-enhanced VQ-VAE
  uses as its codebook (Section 3.2, ``user_dir.topic_vq.vqvae``);
* L_NTM = KL(q(h|x) || N(0, I)) - E_q[sum_w x_w log (theta beta)_w]  (Section 3.1; the
  paper's "p(theta|x)" in the KL is GSM's N(0, I) prior of h). The expectation is
  estimated with one sample.

Symbols: B batch, V topic vocabulary, K topics, E embedding size. Losses are per document
``[B]`` (the caller sums or averages them).
"""

import math
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
from torch import Tensor

from latent_core.errors import check_positive_int
from latent_core.vae.distributions import DiagonalGaussian


class NTMOutput(NamedTuple):
    """What :meth:`NeuralTopicModel.forward` returns.

    ``theta`` topic proportions ``[B, K]``; ``mu``, ``logvar`` the posterior q(h|x)
    ``[B, K]``; ``rec_loss`` -sum_w x_w log p(w|theta) ``[B]``; ``kl`` KL(q(h|x) || N(0, I))
    ``[B]``; ``loss`` = kl + rec_loss, L_NTM per document ``[B]`` (Section 3.1).
    """

    theta: Tensor
    mu: Tensor
    logvar: Tensor
    rec_loss: Tensor
    kl: Tensor
    loss: Tensor


class NeuralTopicModel(nn.Module):
    """GSM topic model with embedded topics (Section 3.1).

    ``vocab_size`` V (the topic vocabulary: stop words and rare words removed),
    ``num_topics`` K (``--num-topics``, 1 <= K <= V), ``embed_dim`` E of omega and phi,
    ``hidden_dim`` of the two-layer ReLU encoder, ``dropout`` on the encoder's output.
    The options are checked where the configuration is read (``validate_topic_args`` and
    ``check_num_topics`` of ``user_dir.topic_vq``), not here.

    omega and phi are drawn from N(0, E^-1/2) so that the logits omega phi^T have unit
    variance at initialisation (beta starts neither uniform nor one-hot).
    """

    def __init__(self, vocab_size: int, num_topics: int, embed_dim: int = 64,
                 hidden_dim: int = 256, dropout: float = 0.0):
        super().__init__()
        check_positive_int("topic vocabulary size", vocab_size)
        self.vocab_size, self.num_topics, self.embed_dim = vocab_size, num_topics, embed_dim
        # inference network of GSM: x -> two ReLU layers -> (mu, log sigma^2)
        self.encoder = nn.Sequential(
            nn.Linear(vocab_size, hidden_dim), nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim), nn.ReLU(),
            nn.Dropout(dropout),
        )
        self.mu = nn.Linear(hidden_dim, num_topics)
        self.logvar = nn.Linear(hidden_dim, num_topics)
        self.theta_proj = nn.Linear(num_topics, num_topics)  # W, b of theta = softmax(W h + b)
        std = embed_dim ** -0.25
        self.word_embeddings = nn.Parameter(torch.randn(vocab_size, embed_dim) * std)  # omega [V, E]
        self.topic_embeddings = nn.Parameter(torch.randn(num_topics, embed_dim) * std)  # phi [K, E]

    def beta(self) -> Tensor:
        """Topic-word distributions beta_k = softmax(omega phi_k^T) (Section 3.1): ``[K, V]``,
        each row sums to 1."""
        return torch.softmax(self.topic_embeddings @ self.word_embeddings.t(), dim=-1)

    def encode(self, bow: Tensor) -> DiagonalGaussian:
        """The posterior q(h|x) = N(mu, sigma^2) of bag-of-words counts ``[B, V]``
        (mean and log-variance ``[B, K]``; the log-variance is clamped to ``LOGVAR_RANGE``)."""
        self._check_bow(bow)
        hidden = self.encoder(bow.to(self.mu.weight.dtype))
        return DiagonalGaussian(self.mu(hidden), self.logvar(hidden))

    def topic_proportions(self, h: Tensor) -> Tensor:
        """theta = softmax(W h + b), the Gaussian softmax construction: ``[B, K] -> [B, K]``."""
        return torch.softmax(self.theta_proj(h), dim=-1)

    def forward(self, bow: Tensor, eps: Optional[Tensor] = None) -> NTMOutput:
        """L_NTM of bag-of-words counts ``bow`` ``[B, V]`` (Section 3.1).

        h = mu + sigma * eps in training (``eps`` ``[B, K]`` standard-normal noise, drawn here
        when not given), h = mu in eval mode unless ``eps`` is given.
        """
        posterior = self.encode(bow)
        if eps is None and self.training:
            eps = torch.randn_like(posterior.mean)
        h = posterior.mean if eps is None else posterior.reparameterize(eps)
        theta = self.topic_proportions(h)
        rec_loss = -self.log_likelihood(bow, theta)
        kl = posterior.kl_standard_normal().sum(-1)
        return NTMOutput(theta, posterior.mean, posterior.logvar, rec_loss, kl, kl + rec_loss)

    def log_likelihood(self, bow: Tensor, theta: Tensor) -> Tensor:
        """log p(x|theta) = sum_w x_w log (theta beta)_w, ``[B]`` (in at least float32)."""
        dtype = torch.promote_types(theta.dtype, torch.float32)
        word_probs = theta.to(dtype) @ self.beta().to(dtype)  # p(w|theta) [B, V]
        log_probs = word_probs.clamp_min(torch.finfo(dtype).tiny).log()
        return (bow.to(dtype) * log_probs).sum(-1)

    @torch.no_grad()
    def perplexity(self, bow: Tensor, num_samples: int = 1, per_document: bool = False,
                   generator: Optional[torch.Generator] = None) -> float:
        """ELBO-based perplexity of a set of documents ``bow`` ``[B, V]`` (an upper bound).

        The negative ELBO of each document (its L_NTM, with E_q estimated from
        ``num_samples`` draws of h ~ q(h|x), drawn also in eval mode: the bound needs them)
        gives ``exp(sum_d L_d / sum_d N_d)`` (corpus level, default), or with
        ``per_document=True`` Miao et al.'s ``exp(mean_d L_d / N_d)`` (their eq. for
        NVDM/GSM). N_d is the document's word count; empty documents are left out. Call in
        eval mode (dropout off).
        """
        check_positive_int("num_samples", num_samples)
        posterior = self.encode(bow)
        kl = posterior.kl_standard_normal().sum(-1)
        rec = torch.zeros_like(kl)
        for _ in range(num_samples):
            eps = torch.randn(posterior.mean.shape, generator=generator,
                              device=posterior.mean.device, dtype=posterior.mean.dtype)
            rec = rec - self.log_likelihood(bow, self.topic_proportions(posterior.reparameterize(eps)))
        nll = kl + rec / num_samples  # [B], negative ELBO
        lengths = bow.to(nll.dtype).sum(-1)
        keep = lengths > 0
        if not bool(keep.any()):
            raise ValueError("perplexity needs at least one non-empty document")
        if per_document:
            return math.exp(float((nll[keep] / lengths[keep]).mean()))
        return math.exp(float(nll[keep].sum() / lengths[keep].sum()))

    def _check_bow(self, bow: Tensor) -> None:
        if bow.dim() != 2 or bow.size(1) != self.vocab_size:
            raise ValueError(
                f"bag-of-words must be [batch, {self.vocab_size}] (the topic vocabulary), "
                f"got {tuple(bow.shape)}"
            )


@torch.no_grad()
def topic_coherence(beta: Tensor, bow_matrix: Tensor, top_n: int = 10) -> Tensor:
    """NPMI coherence of each topic's ``top_n`` most probable words, ``[K]``.

    NPMI (Bouma 2009; as used for topic coherence by Lau et al. 2014 and Röder et al. 2015's
    C_NPMI with document-level co-occurrence) of a word pair, from the binary document-word
    matrix of a reference corpus (``bow_matrix`` ``[D, V]``, counts, dense or sparse COO):

        P(w) = D(w) / D,  P(wi, wj) = D(wi, wj) / D   (documents containing the word(s))
        NPMI(wi, wj) = log(P(wi, wj) / (P(wi) P(wj))) / -log P(wi, wj)

    with the limits as conventions (no epsilon smoothing): NPMI = -1 when the pair never
    co-occurs, NPMI = 1 when P(wi, wj) = 1 (both words in every document). A topic's
    coherence is the mean NPMI over its top_n (top_n - 1) / 2 word pairs. ``beta``: the
    topic-word distributions ``[K, V]`` (:meth:`NeuralTopicModel.beta`).
    """
    if beta.dim() != 2:
        raise ValueError(f"beta must be [topics, vocabulary], got {tuple(beta.shape)}")
    if bow_matrix.dim() != 2 or bow_matrix.size(1) != beta.size(1) or bow_matrix.size(0) < 1:
        raise ValueError(
            f"bow_matrix must be [documents >= 1, {beta.size(1)}], got {tuple(bow_matrix.shape)}"
        )
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 2 <= top_n <= beta.size(1):
        raise ValueError(f"top_n={top_n!r} must be an integer in [2, vocabulary size {beta.size(1)}]")
    top = beta.topk(top_n, dim=-1).indices  # [K, N]
    columns = torch.unique(top)  # sorted [U]
    docs = bow_matrix.index_select(1, columns.to(bow_matrix.device))
    if docs.is_sparse:
        docs = docs.to_dense()
    present = (docs > 0).to(torch.float64)  # [D, U]
    num_docs = present.size(0)
    p_word = present.sum(0) / num_docs  # [U]
    p_pair = (present.t() @ present) / num_docs  # [U, U]
    pos = torch.searchsorted(columns, top).to(p_word.device)  # [K, N] indices into U
    i, j = torch.triu_indices(top_n, top_n, offset=1, device=pos.device)
    wi, wj = pos[:, i], pos[:, j]  # [K, pairs]
    joint = p_pair[wi, wj]
    safe = joint.clamp(min=1e-300, max=1.0 - 1e-16)
    npmi = torch.log(safe / (p_word[wi] * p_word[wj])) / -torch.log(safe)
    npmi = torch.where(joint <= 0, torch.full_like(npmi, -1.0), npmi)
    npmi = torch.where(joint >= 1, torch.ones_like(npmi), npmi)
    return npmi.mean(-1).to(beta.dtype if beta.is_floating_point() else torch.float32)
