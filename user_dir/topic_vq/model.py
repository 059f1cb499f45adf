"""``topic_vq_sts``: a Hugging Face encoder with topic-informed discrete latents (DisBert).

Yu et al., "Learning Semantic Textual Similarity via Topic-informed Discrete Latent
Variables" (Yu et al. 2022, arXiv:2211.03616). One fairseq model, trained in the paper's
three stages with the same ``fairseq-train`` command and ``--topic-vq-stage``:

1. ``ntm``: the neural topic model alone (Section 3.1) on the bag-of-words of both
   sentences of every training pair; model selection by its loss (the paper: by the
   reconstruction perplexity). Everything else is frozen.
2. ``vqvae``: the topic-enhanced VQ-VAE (Section 3.2) on the words of both sentences,
   ``--topic-vq-init`` = the NTM checkpoint of stage 1. ``--codebook joint`` (default):
   NTM and VQ-VAE trained together, L = L_VQ + gamma L_NTM (eq. 6) and the codebook IS the
   NTM's topic embedding phi; ``--codebook multistage``: NTM and codebook held fixed.
3. ``sts``: the task (Section 3.3), ``--topic-vq-init`` = the VQ-VAE checkpoint of stage 2;
   NTM and VQ-VAE are frozen (eval mode: theta from the posterior mean, so the codes of a
   sentence are deterministic); the encoder, the semantics-driven attention (eq. 4-5) of
   ``--semantic-attention-layers`` and the output enhancement are fine-tuned.

Output enhancement: [h^l ; LayerNorm(Linear(Z))] (Section 3.3) is pooled before the
prediction layer: h^l with ``--pooling`` and the quantised part as the mean over the pieces
of the two sentences (special tokens and padding excluded; at [CLS] it would be a constant).

Ablations (``--ablate``, comma-separated; the paper's Figure 2):
``topic-model`` (a plain VQ-VAE: own random codebook, no topical embedding, no NTM stage),
``topic-sensitive-encoder`` (no X^t), ``topical-latent-embedding`` (random codebook instead
of phi), ``semantic-attention`` (no Q_q K_q^T), ``output-enhancement``.
"""

import logging
import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
from fairseq.dataclass import ChoiceEnum
from fairseq.models import register_model
from torch import Tensor

from latent_core.errors import check_heads_divide, check_positive_int

from ..hf_sentence.model import HFSentenceClassifier, HFSentenceClassifierConfig, HFSentenceConfigError
from ..model_config import model_options
from .ntm import NeuralTopicModel
from .semantic_attention import (
    OutputEnhancement,
    SemanticAttentionContext,
    SemanticScores,
    align_to_pieces,
    attention_head_dim,
    install_semantic_attention,
)
from .vocabulary import check_num_topics
from .vqvae import TopicVQVAE

logger = logging.getLogger(__name__)

STAGES = ("ntm", "vqvae", "sts")
CODEBOOK_MODES = ("joint", "multistage")
ABLATIONS = ("topic-model", "topic-sensitive-encoder", "topical-latent-embedding", "semantic-attention",
             "output-enhancement")


def ablation_names(spec: Optional[str]) -> Tuple[str, ...]:
    """The parts ``--ablate`` names, unchecked (:func:`parse_ablations` checks them)."""
    return tuple(s.strip() for s in (spec or "").split(",") if s.strip())


def parse_ablations(spec: Optional[str]) -> Tuple[str, ...]:
    names = ablation_names(spec)
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        raise HFSentenceConfigError(f"--ablate {','.join(unknown)}: unknown; choose from {', '.join(ABLATIONS)}")
    return names


@dataclass
class TopicVQSTSConfig(HFSentenceClassifierConfig):
    topic_vq_stage: ChoiceEnum(STAGES) = field(
        default="sts", metadata={"help": "ntm: pre-train the topic model; vqvae: train the topic-enhanced VQ-VAE; "
                                         "sts: fine-tune the encoder on the task"})
    topic_vq_init: Optional[str] = field(
        default=None, metadata={"help": "checkpoint of the previous stage: its NTM and VQ-VAE parameters are loaded"})
    num_topics: int = field(
        default=40, metadata={"help": "topics K = codebook size (Table 7: MRPC 30, STS-B 40, Quora 90)"})
    topic_embed_dim: int = field(default=64, metadata={"help": "topic/code size E"})
    ntm_hidden_dim: int = field(default=256, metadata={"help": "NTM encoder MLP size"})
    ntm_dropout: float = field(default=0.2, metadata={"help": "NTM encoder dropout"})
    ntm_gamma: float = field(default=1.0, metadata={"help": "gamma of eq. 6, L_VQ + gamma L_NTM"})
    vq_commitment: float = field(default=1e-4, metadata={"help": "commitment weight lambda of eq. 1"})
    vq_heads: int = field(default=4, metadata={"help": "attention heads of the VQ-VAE layers"})
    vq_dropout: float = field(default=0.1, metadata={"help": "VQ-VAE dropout"})
    codebook: ChoiceEnum(CODEBOOK_MODES) = field(
        default="joint", metadata={"help": "joint: train NTM and VQ-VAE together; multistage: codebook initialised "
                                           "from the NTM and frozen (Table 3)"})
    semantic_attention_layers: str = field(
        default="last", metadata={"help": "encoder layers with semantics-driven attention: last, all, or indices "
                                          "like 0,-1"})
    semantic_ffn_dim: int = field(default=256, metadata={"help": "hidden size of the FFN of eq. 4"})
    ablate: str = field(default="", metadata={"help": f"comma-separated parts to remove: {', '.join(ABLATIONS)}"})


@register_model("topic_vq_sts", dataclass=TopicVQSTSConfig)
class TopicVQSTSModel(HFSentenceClassifier):
    """HF encoder + NTM + topic-enhanced VQ-VAE + semantics-driven attention (module docstring)."""

    def __init__(self, args, backbone, head, padding_idx: int, ntm: Optional[NeuralTopicModel],
                 vqvae: TopicVQVAE, semantic_scores: Optional[SemanticScores],
                 enhancement: Optional[OutputEnhancement]):
        super().__init__(args, backbone, head, padding_idx)
        self.stage = str(args.topic_vq_stage)
        self.gamma = float(args.ntm_gamma)
        self.ntm, self.vqvae = ntm, vqvae
        self.semantic_scores, self.enhancement = semantic_scores, enhancement
        self.attention_context = SemanticAttentionContext()
        self.semantic_layers = []
        if semantic_scores is not None:
            self.semantic_layers = sorted(install_semantic_attention(
                backbone, args.semantic_attention_layers, self.attention_context))
        self._set_trainable()

    # ----------------------------------------------------------------- building
    @classmethod
    def build_model(cls, args, task):
        args = model_options(cls, args)
        vocabulary = getattr(task, "topic_vocabulary", None)
        if vocabulary is None:
            raise HFSentenceConfigError("--arch topic_vq_sts needs the task's topic features: add --topic-features "
                                        "(task topic_vq_sentence_prediction)")
        validate_topic_args(args)
        check_num_topics(args.num_topics, vocabulary)
        ablations = parse_ablations(args.ablate)
        backbone, head = cls.build_backbone_and_head(args, task)
        enhance = "output-enhancement" not in ablations
        topic_model = "topic-model" not in ablations
        ntm = None
        if topic_model:
            ntm = NeuralTopicModel(vocabulary.topic_size, args.num_topics, args.topic_embed_dim,
                                   args.ntm_hidden_dim, args.ntm_dropout)
        tied = topic_model and "topical-latent-embedding" not in ablations
        vqvae = TopicVQVAE(
            vocabulary.vq_size, args.num_topics, args.topic_embed_dim,
            codebook=ntm.topic_embeddings if tied else None,
            topic_sensitive=topic_model and "topic-sensitive-encoder" not in ablations,
            max_positions=task.max_positions(), dropout=args.vq_dropout, num_heads=args.vq_heads,
            vq_to_topic=vocabulary.vq_to_topic(), freeze_codebook=tied and args.codebook == "multistage",
            commitment=args.vq_commitment,
        )
        scores = None
        if "semantic-attention" not in ablations:  # __init__ installs (and checks) --semantic-attention-layers
            scores = SemanticScores(args.topic_embed_dim, args.semantic_ffn_dim, attention_head_dim(backbone))
        enhancement = OutputEnhancement(args.topic_embed_dim) if enhance else None
        model = cls(args, backbone, head, task.padding_idx, ntm, vqvae, scores, enhancement)
        if args.topic_vq_init:
            model.load_topic_vq(args.topic_vq_init)
        elif args.topic_vq_stage == "sts" or (args.topic_vq_stage == "vqvae" and ntm is not None):
            logger.warning("--topic-vq-stage %s without --topic-vq-init: the %s is untrained", args.topic_vq_stage,
                           "NTM and VQ-VAE" if args.topic_vq_stage == "sts" else "NTM")
        logger.info("topic_vq_sts: stage %s, K=%d, topic vocabulary %d, VQ vocabulary %d, semantic attention "
                    "layers %s, ablations %s", args.topic_vq_stage, args.num_topics, vocabulary.topic_size,
                    vocabulary.vq_size, model.semantic_layers or "none", ",".join(ablations) or "none")
        return model

    @classmethod
    def head_input_size(cls, args, backbone_config) -> int:
        """[pooled h^l ; pooled LayerNorm(Linear(Z))] with output enhancement (Section 3.3)."""
        enhanced = "output-enhancement" not in ablation_names(args.ablate)  # build_model checked them
        return int(backbone_config.hidden_size) + (args.topic_embed_dim if enhanced else 0)

    def _set_trainable(self) -> None:
        """Only the parameters of the current stage receive gradients (fairseq's optimizer and
        DDP see only those; frozen modules are never unused trainable parameters)."""
        if self.stage == "sts":  # encoder (as --freeze-layers left it), attention, head: trainable
            for module in (self.ntm, self.vqvae):
                if module is not None:
                    module.requires_grad_(False)
            return
        self.requires_grad_(False)
        if self.stage == "ntm":
            if self.ntm is None:
                raise HFSentenceConfigError("--topic-vq-stage ntm with --ablate topic-model: there is no topic model")
            self.ntm.requires_grad_(True)
            return
        self.vqvae.requires_grad_(True)
        if self.vqvae.freeze_codebook:  # multistage: codebook (phi) and NTM held fixed
            self.vqvae.codebook.requires_grad_(False)
        elif self.ntm is not None:
            self.ntm.requires_grad_(True)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.stage == "sts":  # frozen topic components: deterministic codes
            for module in (self.ntm, self.vqvae):
                if module is not None:
                    module.eval()
        return self

    def load_topic_vq(self, path: str) -> None:
        """Load the ``ntm.*`` and ``vqvae.*`` parameters of a previous stage's checkpoint."""
        from fairseq import checkpoint_utils

        checkpoint = checkpoint_utils.load_checkpoint_to_cpu(path)
        state = checkpoint["model"]
        own = self.state_dict()
        wanted = {k: v for k, v in state.items() if k.startswith(("ntm.", "vqvae."))}
        missing = [k for k in own if k.startswith(("ntm.", "vqvae.")) and k not in wanted]
        if self.stage == "sts" and any(k.startswith("vqvae.") for k in missing):
            raise HFSentenceConfigError(f"--topic-vq-init {path} has no VQ-VAE parameters ({missing[0]} ...): "
                                        "give the checkpoint of --topic-vq-stage vqvae")
        if self.stage == "vqvae" and saved_stage(checkpoint) == "ntm":
            # stage 2 takes the trained NTM of stage 1; that checkpoint's VQ-VAE is untrained (and an
            # ablated VQ-VAE, e.g. without the topic-sensitive encoder, has other tensors)
            wanted = {k: v for k, v in wanted.items() if k.startswith("ntm.")}
        for key, value in wanted.items():
            if key not in own:
                raise HFSentenceConfigError(f"--topic-vq-init {path}: parameter {key} does not exist in this model "
                                            "(different --ablate?)")
            if own[key].shape != value.shape:
                raise HFSentenceConfigError(
                    f"--topic-vq-init {path}: {key} has shape {tuple(value.shape)} there but {tuple(own[key].shape)} "
                    "here (different --num-topics, --topic-embed-dim or training data / topic vocabulary?)")
        if "vqvae.vq_to_topic" in wanted and not torch.equal(wanted["vqvae.vq_to_topic"], own["vqvae.vq_to_topic"]):
            raise HFSentenceConfigError(f"--topic-vq-init {path} was trained with another vocabulary (its VQ-to-topic "
                                        "word map differs): use the same training split and --topic-min-count")
        self.load_state_dict(wanted, strict=False)
        logger.info("loaded %d NTM/VQ-VAE tensors from %s", len(wanted), path)

    # ------------------------------------------------------------------ forward
    def sentence_topics(self, bow: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """(theta ``[B, K]``, beta ``[K, V]``, L_NTM ``[B]``) of one sentence's bag of words."""
        if self.ntm is None:
            return None, None, None
        out = self.ntm(bow)
        return out.theta, self.ntm.beta(), out.loss

    def quantised(self, words: Tensor, bow: Tensor):
        theta, beta, ntm_loss = self.sentence_topics(bow)
        return self.vqvae(words, theta, beta), ntm_loss

    def forward(self, **net_input) -> Tuple[Optional[Tensor], dict]:
        """Stage ntm/vqvae: (None, {"losses": ...}); stage sts: (logits ``[B, C]``, extra)."""
        sentences = [s for s in (1, 2) if f"words_{s}" in net_input]
        if not sentences:
            raise KeyError("the batch has no words_1/bow_1: train with --topic-features")
        if self.stage == "ntm":
            loss = sum(self.ntm(net_input[f"bow_{s}"]).loss for s in sentences)
            return None, {"losses": {"ntm": loss}}
        if self.stage == "vqvae":
            losses, stats = self._vqvae_losses(net_input, sentences)
            return None, {"losses": losses, "stats": stats}
        with torch.no_grad():
            z_q = [self.quantised(net_input[f"words_{s}"], net_input[f"bow_{s}"])[0].z_q for s in sentences]
        if len(z_q) == 1:
            z_q.append(z_q[0].new_zeros(z_q[0].size(0), 1, z_q[0].size(-1)))
        z = align_to_pieces(z_q[0], z_q[1], net_input["piece_sentence"], net_input["piece_word"])  # [B, T, E]
        if self.semantic_scores is not None:
            with self.attention_context.use(self.semantic_scores(z).to(z.dtype)):
                hidden, padding_mask = self.encode(net_input)
        else:
            hidden, padding_mask = self.encode(net_input)
        pooled = self.pool(hidden, net_input)
        if self.enhancement is not None:
            pooled = self.enhancement(pooled, z, net_input["piece_sentence"].ge(0))
        return self.classify(pooled), {"pooled": pooled, "hidden_states": hidden, "padding_mask": padding_mask}

    def _vqvae_losses(self, net_input: Dict[str, Tensor], sentences) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
        """Eq. (1) for every sentence of the pair (+ gamma L_NTM, eq. 6, in joint mode): the
        losses ``[B]`` and, logged only, the three terms of eq. (1) and the code-usage perplexity."""
        losses: Dict[str, Tensor] = {}
        stats: Dict[str, Tensor] = {}

        def add(store, key, value):
            store[key] = store[key] + value if key in store else value

        for s in sentences:
            out, ntm_loss = self.quantised(net_input[f"words_{s}"], net_input[f"bow_{s}"])
            add(losses, "vq", out.loss)
            if ntm_loss is not None and not self.vqvae.freeze_codebook:
                add(losses, "ntm", self.gamma * ntm_loss)  # L = L_VQ + gamma L_NTM (eq. 6)
            add(stats, "vq_rec", out.rec_loss.detach())
            add(stats, "vq_codebook", out.codebook_loss.detach())
            add(stats, "vq_commitment", out.commitment_loss.detach())
            add(stats, "code_perplexity", torch.as_tensor(out.perplexity, dtype=torch.float32).detach() / len(sentences))
        return losses, stats


def validate_topic_args(args) -> None:
    if args.topic_vq_stage not in STAGES:
        raise HFSentenceConfigError(f"--topic-vq-stage {args.topic_vq_stage!r}: choose {', '.join(STAGES)}")
    if args.codebook not in CODEBOOK_MODES:
        raise HFSentenceConfigError(f"--codebook {args.codebook!r}: choose {', '.join(CODEBOOK_MODES)}")
    for option, value in (("--num-topics", args.num_topics), ("--topic-embed-dim", args.topic_embed_dim),
                          ("--ntm-hidden-dim", args.ntm_hidden_dim), ("--semantic-ffn-dim", args.semantic_ffn_dim)):
        check_positive_int(option, value, HFSentenceConfigError)
    check_heads_divide("--vq-heads", args.vq_heads, "--topic-embed-dim", args.topic_embed_dim, HFSentenceConfigError)
    for option, value in (("--ntm-gamma", args.ntm_gamma), ("--vq-commitment", args.vq_commitment)):
        if not (math.isfinite(value) and value >= 0):
            raise HFSentenceConfigError(f"{option} {value!r} must be a finite number >= 0")
    for option, value in (("--ntm-dropout", args.ntm_dropout), ("--vq-dropout", args.vq_dropout)):
        if not 0 <= value < 1:
            raise HFSentenceConfigError(f"{option} {value!r} must lie in [0, 1)")


def saved_stage(checkpoint: dict):
    """The ``--topic-vq-stage`` a fairseq checkpoint was trained with (None if it does not say)."""
    from latent_core.safe_loading import model_config

    return getattr(model_config(checkpoint), "topic_vq_stage", None)
