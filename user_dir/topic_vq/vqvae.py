"""Topic-enhanced VQ-VAE: topic-sensitive encoder and topical latent embedding (codebook).

Yu et al., "Learning Semantic Textual Similarity via Topic-informed Discrete Latent
Variables" (Yu et al. 2022, arXiv:2211.03616), Section 3.2, eq. (1), and the joint
objective eq. (6) of Section 3.4. Plain PyTorch.

One sentence of W words (VQ vocabulary ids, padded with ``padding_idx``) at a time:

* X^seq = word embedding + learned position embedding ``[B, W, E]`` (positions count the
  non-pad words, so padding anywhere does not move them). The paper's embedding layer
  "concatenates" the two; since a linear map follows, concatenation and sum are the same
  model up to parameterisation, and the sum keeps X^seq E-dimensional;
* topical embedding X^t ``[B, W, K]``: x_m^t = theta (x) beta_{w_m}, the elementwise product
  of the sentence's own topic proportions theta ``[B, K]`` and the column of beta ``[K, V]``
  of word w_m (looked up through ``vq_to_topic``; a word outside the topic vocabulary, id
  -1, and padding get zeros). Each row of the batch uses only its own words (the authors'
  code computed sentence 2's topic ids from sentence 1's words);
* Z^e = f_enc(X^seq (+) X^t): concatenation, a linear map to E, and a single-layer
  transformer encoder (``nn.TransformerEncoderLayer``, post-norm, padding keys masked);
* quantisation: z_i^q = phi_k, k = argmin_j ||z_i^e - phi_j||_2 over the codebook phi
  ``[K, E]``; the decoder gets the straight-through z^e + sg[z^q - z^e];
* decoder: a single-layer transformer (again a ``TransformerEncoderLayer``: bidirectional,
  no positions, padding keys masked) over the quantised sequence and a linear map to the VQ
  vocabulary, so that position i predicts word x_i: -log p(x_i | z_i^q) of eq. (1) is the
  cross entropy at position i. (Reading of "we feed Z^q into the decoder which is also a
  single-layer transformer to reconstruct the sentence X": a non-autoregressive
  reconstruction, one word per code.)

Loss, eq. (1), per sentence, summed over the non-pad positions only:

    L_VQ = sum_i -log p(x_i|z_i^q) + ||sg[z_i^e] - z_i^q||^2 + lambda ||z_i^e - sg[z_i^q]||^2

with the commitment weight lambda = 1e-4 (Section 4.3) on the LAST term, as eq. (1) writes
it; the squared norms are sums over the E dimensions.

Codebook modes (Section 3.2, ablations of Section 4.5, Table 3 of Section 4.6):

* ``codebook=ntm.topic_embeddings`` (an ``nn.Parameter``): the VQ-VAE uses that very tensor
  (tied, not copied): "Joint" training, L = L_VQ + gamma L_NTM (eq. 6) updates phi from both;
* ``freeze_codebook=True``: "Multistage": the codebook comes from the pretrained NTM and the
  NTM is held fixed: codebook, theta and beta are used detached, so no VQ loss reaches them
  (also call ``ntm.requires_grad_(False)``: under DDP a parameter without gradient is an
  unused parameter);
* ``codebook=None``: an own, randomly initialised codebook (ablations "w/o topical latent
  embedding" and, with ``topic_sensitive=False``, "w/o topic model");
* ``topic_sensitive=False``: no X^t ("w/o topic sensitive encoder").
"""

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from latent_core.errors import check_positive_int


class VQOutput(NamedTuple):
    """What :meth:`TopicVQVAE.forward` returns (B sentences, W positions, E code size).

    * ``z_e`` encoder output Z^e ``[B, W, E]`` (zero at padding);
    * ``z_q`` the quantised Z^q as the decoder sees it, straight-through
      z^e + sg[z^q - z^e] ``[B, W, E]``: its value is phi_k, its gradient goes to z^e
      (zero at padding);
    * ``codes`` the chosen code k per position ``[B, W]`` (long; -1 at padding);
    * ``logits`` decoder logits over the VQ vocabulary ``[B, W, V]``;
    * ``rec_loss`` sum_i -log p(x_i|z_i^q) ``[B]``;
    * ``codebook_loss`` sum_i ||sg[z_i^e] - z_i^q||^2 ``[B]``;
    * ``commitment_loss`` sum_i ||z_i^e - sg[z_i^q]||^2 ``[B]`` (before lambda);
    * ``loss`` eq. (1): rec_loss + codebook_loss + lambda commitment_loss ``[B]``;
    * ``perplexity`` exp(entropy) of the code usage over the batch's non-pad positions,
      a detached scalar (1 = one code used; K = all codes used uniformly).
    """

    z_e: Tensor
    z_q: Tensor
    codes: Tensor
    logits: Tensor
    rec_loss: Tensor
    codebook_loss: Tensor
    commitment_loss: Tensor
    loss: Tensor
    perplexity: Tensor


def nearest_codes(z_e: Tensor, codebook: Tensor) -> Tensor:
    """k = argmin_j ||z^e - phi_j||_2 (Section 3.2): ``[..., E]``, ``[K, E]`` -> ``[...]`` (long).

    Squared distances |z|^2 - 2 z.phi + |phi|^2, in at least float32.
    """
    dtype = torch.promote_types(z_e.dtype, torch.float32)
    flat = z_e.detach().reshape(-1, z_e.size(-1)).to(dtype)
    phi = codebook.detach().to(dtype)
    dist = (flat * flat).sum(-1, keepdim=True) - 2.0 * flat @ phi.t() + (phi * phi).sum(-1)
    return dist.argmin(-1).view(z_e.shape[:-1])


def code_perplexity(codes: Tensor, num_codes: int) -> Tensor:
    """exp(entropy) of the empirical code distribution over the entries of ``codes`` >= 0
    (a detached float scalar; 0 when there is none)."""
    used = codes[codes >= 0]
    if used.numel() == 0:
        return torch.zeros((), device=codes.device)
    probs = torch.bincount(used, minlength=num_codes).float() / used.numel()
    return torch.exp(-(probs * probs.clamp_min(1e-30).log()).sum())


class TopicVQVAE(nn.Module):
    """Topic-enhanced VQ-VAE of Section 3.2 (see the module docstring).

    * ``vq_vocab_size`` V of the VQ-VAE's word vocabulary (Table 7: larger than the topic
      vocabulary, which drops stop words and rare words);
    * ``num_codes`` K, the codebook size (= the number of topics when tied to the NTM);
    * ``code_dim`` E (64, Section 4.3), also the model size of both transformer layers;
    * ``codebook``: an ``nn.Parameter`` ``[K, E]`` to use as the codebook (the NTM's phi,
      tied), or None for an own codebook drawn from N(0, E^-1/2) like the NTM's phi;
    * ``freeze_codebook``: Multistage training (codebook, theta, beta used detached);
    * ``topic_sensitive``: add the topical embedding X^t (needs ``vq_to_topic`` and, in
      :meth:`forward`, theta and beta);
    * ``vq_to_topic``: LongTensor ``[vq_vocab_size]``, the topic-vocabulary id of each VQ
      word, -1 for words outside it (stored as a buffer, saved in checkpoints);
    * ``max_positions`` of the learned position embedding; ``padding_idx`` of the VQ
      vocabulary (0, ``user_dir.topic_vq.vocabulary.PAD_ID``);
    * ``num_heads``, ``ffn_dim`` (default 4E), ``dropout`` of the transformer layers;
    * ``commitment`` lambda of eq. (1) (1e-4, Section 4.3).

    The options (``--num-topics``, ``--topic-embed-dim``, ``--vq-heads``, ``--vq-dropout``,
    ``--vq-commitment``, ``--max-positions``) are checked where the configuration is read, not here.
    """

    def __init__(self, vq_vocab_size: int, num_codes: int, code_dim: int = 64,
                 codebook: Optional[nn.Parameter] = None, topic_sensitive: bool = True,
                 max_positions: int = 128, dropout: float = 0.1, num_heads: int = 4, *,
                 vq_to_topic: Optional[Tensor] = None, freeze_codebook: bool = False,
                 padding_idx: int = 0, ffn_dim: Optional[int] = None, commitment: float = 1e-4):
        super().__init__()
        check_positive_int("VQ vocabulary size", vq_vocab_size)
        if ffn_dim is None:
            ffn_dim = 4 * code_dim
        else:
            check_positive_int("ffn_dim", ffn_dim)
        if not 0 <= padding_idx < vq_vocab_size:
            raise ValueError(
                f"padding_idx={padding_idx} is not an id of the {vq_vocab_size}-word VQ vocabulary"
            )
        self.vq_vocab_size, self.num_codes, self.code_dim = vq_vocab_size, num_codes, code_dim
        self.topic_sensitive, self.freeze_codebook = topic_sensitive, freeze_codebook
        self.padding_idx, self.max_positions, self.commitment = padding_idx, max_positions, commitment

        if codebook is None:
            codebook = nn.Parameter(torch.randn(num_codes, code_dim) * code_dim ** -0.25)
        elif not isinstance(codebook, nn.Parameter):
            raise TypeError("codebook must be an nn.Parameter (the NTM's topic_embeddings) or None")
        if tuple(codebook.shape) != (num_codes, code_dim):
            raise ValueError(
                f"codebook is {tuple(codebook.shape)}, expected [num_codes={num_codes}, code_dim={code_dim}]"
            )
        self.codebook = codebook  # phi [K, E]; the same Parameter object when tied

        if topic_sensitive:
            if vq_to_topic is None:
                raise ValueError(
                    "topic_sensitive=True needs vq_to_topic, the topic-vocabulary id of each VQ word"
                )
            vq_to_topic = torch.as_tensor(vq_to_topic)
            if vq_to_topic.dtype != torch.long or tuple(vq_to_topic.shape) != (vq_vocab_size,):
                raise ValueError(
                    f"vq_to_topic must be a LongTensor [{vq_vocab_size}], got {vq_to_topic.dtype} "
                    f"{tuple(vq_to_topic.shape)}"
                )
            if bool((vq_to_topic < -1).any()):
                raise ValueError("vq_to_topic holds ids < -1 (use -1 for words outside the topic vocabulary)")
            self.register_buffer("vq_to_topic", vq_to_topic.clone())
        else:
            self.vq_to_topic = None

        self.embed_tokens = nn.Embedding(vq_vocab_size, code_dim, padding_idx=padding_idx)
        self.embed_positions = nn.Embedding(max_positions, code_dim)
        self.input_proj = nn.Linear(code_dim + (num_codes if topic_sensitive else 0), code_dim)
        self.encoder = nn.TransformerEncoderLayer(code_dim, num_heads, ffn_dim, dropout, batch_first=True)
        self.decoder = nn.TransformerEncoderLayer(code_dim, num_heads, ffn_dim, dropout, batch_first=True)
        self.output_proj = nn.Linear(code_dim, vq_vocab_size)

    def phi(self) -> Tensor:
        """The codebook as the VQ losses see it ``[K, E]`` (detached when frozen)."""
        return self.codebook.detach() if self.freeze_codebook else self.codebook

    def topical_embedding(self, tokens: Tensor, theta: Tensor, beta: Tensor) -> Tensor:
        """X^t: x_m^t = theta (x) beta_{w_m} (Section 3.2), ``[B, W, K]``.

        ``tokens`` ``[B, W]`` VQ ids, ``theta`` ``[B, K]`` each sentence's topic proportions,
        ``beta`` ``[K, V_topic]``. Zero for words without a topic id (-1) and for padding.
        """
        if self.vq_to_topic is None:
            raise RuntimeError("this VQ-VAE was built with topic_sensitive=False: it has no topical embedding")
        batch = tokens.size(0)
        if theta.dim() != 2 or theta.shape != (batch, self.num_codes):
            raise ValueError(f"theta must be [batch={batch}, K={self.num_codes}], got {tuple(theta.shape)}")
        if beta.dim() != 2 or beta.size(0) != self.num_codes:
            raise ValueError(f"beta must be [K={self.num_codes}, topic vocabulary], got {tuple(beta.shape)}")
        if int(self.vq_to_topic.max()) >= beta.size(1):
            raise ValueError(
                f"vq_to_topic maps to topic id {int(self.vq_to_topic.max())}, but beta has only "
                f"{beta.size(1)} words"
            )
        topic_ids = self.vq_to_topic[tokens]  # [B, W]; -1: no topic word
        has_topic = (topic_ids >= 0) & tokens.ne(self.padding_idx)
        word_topics = beta.t()[topic_ids.clamp(min=0)]  # beta_{w_m} [B, W, K]
        x_t = theta.unsqueeze(1) * word_topics  # theta (x) beta_{w_m}
        return x_t * has_topic.unsqueeze(-1).to(x_t.dtype)

    def encode(self, tokens: Tensor, theta: Optional[Tensor] = None,
               beta: Optional[Tensor] = None) -> Tensor:
        """Z^e = f_enc(X^seq (+) X^t) ``[B, W, E]`` (zero at padding) of ``tokens`` ``[B, W]``."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, length], got {tuple(tokens.shape)}")
        nonpad = tokens.ne(self.padding_idx)
        if not bool(nonpad.any(-1).all()):
            raise ValueError(
                "every sentence needs at least one non-pad word (an empty sentence cannot be encoded)"
            )
        positions = (torch.cumsum(nonpad, dim=-1) - 1).clamp(min=0)
        if int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"a sentence has {int(positions.max()) + 1} words, more than max_positions={self.max_positions}"
            )
        x = self.embed_tokens(tokens) + self.embed_positions(positions)  # X^seq [B, W, E]
        if self.topic_sensitive:
            if theta is None or beta is None:
                raise ValueError("the topic-sensitive encoder needs theta [B, K] and beta [K, V] from the NTM")
            if self.freeze_codebook:  # Multistage: the NTM is held fixed
                theta, beta = theta.detach(), beta.detach()
            x_t = self.topical_embedding(tokens, theta, beta).to(x.dtype)
            x = torch.cat([x, x_t], dim=-1)  # X^seq (+) X^t
        z_e = self.encoder(self.input_proj(x), src_key_padding_mask=~nonpad)
        return z_e * nonpad.unsqueeze(-1).to(z_e.dtype)

    def quantize(self, z_e: Tensor, nonpad: Tensor) -> Tuple[Tensor, Tensor]:
        """Nearest codes ``[B, W]`` (-1 at padding) and z^q = phi_k ``[B, W, E]`` (zero at
        padding; carries the codebook's gradient, no gradient to z^e)."""
        codes = nearest_codes(z_e, self.codebook)
        z_q = F.embedding(codes, self.phi()).to(z_e.dtype) * nonpad.unsqueeze(-1).to(z_e.dtype)
        return codes.masked_fill(~nonpad, -1), z_q

    def forward(self, tokens: Tensor, theta: Optional[Tensor] = None,
                beta: Optional[Tensor] = None) -> VQOutput:
        """Encode, quantise and reconstruct ``tokens`` ``[B, W]``; the loss of eq. (1) per sentence.

        ``theta`` ``[B, K]`` (the NTM's topic proportions of the same sentences) and ``beta``
        ``[K, V_topic]`` (:meth:`NeuralTopicModel.beta`) are needed when topic_sensitive.
        """
        nonpad = tokens.ne(self.padding_idx)
        weights = nonpad.to(torch.float32)
        z_e = self.encode(tokens, theta, beta)
        codes, z_q = self.quantize(z_e, nonpad)
        z_q_st = z_e + (z_q - z_e).detach()  # straight-through estimator
        hidden = self.decoder(z_q_st, src_key_padding_mask=~nonpad)
        logits = self.output_proj(hidden)  # [B, W, V]
        nll = F.cross_entropy(logits.float().transpose(1, 2), tokens, reduction="none")  # [B, W]
        rec_loss = (nll * weights).sum(-1)  # sum_i -log p(x_i|z_i^q)
        codebook_loss = ((z_e.detach().float() - z_q.float()) ** 2).sum(-1).mul(weights).sum(-1)
        commitment_loss = ((z_e.float() - z_q.detach().float()) ** 2).sum(-1).mul(weights).sum(-1)
        loss = rec_loss + codebook_loss + self.commitment * commitment_loss  # eq. (1)
        return VQOutput(z_e, z_q_st, codes, logits, rec_loss, codebook_loss, commitment_loss, loss,
                        code_perplexity(codes.detach(), self.num_codes))
