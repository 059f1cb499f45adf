"""``qkvae`` and ``advae``: the sentence VAEs of Felhi et al. (NAACL 2022, arXiv:2205.05943).

Both models share one encoder (:class:`~user_dir.qkvae.encoder.LatentQueryEncoder`, ADVAE's
eq. 3) and differ in the decoder:

* ``qkvae``: latents ``z_syn`` ``[B, d_syn]`` and ``z_sem`` ``[B, L * d_sem]`` (L slot latents of
  size d_sem, grouped by slot); decoder :class:`~user_dir.qkvae.decoder.QKVDecoder` (keys from
  z_syn, values from z_sem);
* ``advae``: one latent ``z`` ``[B, L * d]`` (L slot latents, grouped by slot); decoder
  :class:`~user_dir.qkvae.decoder.ADVAEDecoder` (cross-attention to Enc(Cat(d; z))).

The models only produce posteriors and logits; the ``sentence_vae`` criterion computes the
losses (beta per latent, free bits, annealing; Section 4.3 and Appendix B).

Architectures (Appendix B, the paper's size is BART-base truncated to 4 + 4 layers):

================  ======  ===========  =====  =====  ============  ============
arch              d_model  heads / FFN  enc    dec    z_syn         slots
================  ======  ===========  =====  =====  ============  ============
qkvae_bart_base   768     12 / 3072    4      4      768           4 x 192
advae_bart_base   768     12 / 3072    4      4      --            4 x 384
qkvae_small       256     4 / 1024     2      2      64            4 x 16
advae_small       256     4 / 1024     2      2      --            4 x 32
================  ======  ===========  =====  =====  ============  ============

(``qkvae`` / ``advae`` are the ``*_bart_base`` sizes.) The query decoder of the encoder has
``--posterior-layers`` layers (default: ``--decoder-layers``).

``--qkvae-reading authors`` (default of every ``qkvae*`` architecture) builds and trains the model
of the authors' code (ghazi-f/QKVAE) that produced the paper's tables; ``paper`` the model as the
paper describes it. What differs is listed in :mod:`.encoder` (the posterior passes) and
:mod:`.decoder` (word dropout, output Linear); the authors' reading also sets BART's attention
and activation dropout (0.1), a loss averaged over sentences (``sentence_average_loss``, read by
the ``sentence_vae`` criterion) and an optimizer state reset when ``--ae-steps`` ends
(``reset_optimizer_after_ae``, read by the ``sentence_vae`` task). ADVAE is built as the paper reads.

``--bart-dir DIR`` initialises from a local Hugging Face BART directory (``config.json`` +
weights, as written by ``save_pretrained``): see :mod:`user_dir.qkvae.bart_init`, which also
explains how to binarise data with BART's vocabulary. When a checkpoint trained with
``--bart-dir`` is loaded where the directory is absent, pass
``--model-overrides "{'bart_dir': None}"`` (the checkpoint's weights replace BART's anyway).
"""

from collections import OrderedDict
from typing import Dict, List, Tuple

from fairseq.models import FairseqEncoderDecoderModel, register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig, TransformerModel
from fairseq.models.transformer.transformer_base import Embedding
from fairseq.models.transformer.transformer_legacy import base_architecture

from latent_core.vae import VAEConfigError

from .bart_init import initialise_from_bart
from .decoder import ADVAEDecoder, QKVDecoder
from .encoder import READINGS, LatentGroup, LatentQueryEncoder


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


class LatentAttentionVAE(FairseqEncoderDecoderModel):
    """Common part of QKVAE and ADVAE: argument handling, the shared embedding, the encoder,
    ``latent_sizes`` ``{name: D}`` and ``latent_slots`` ``{name: (L, d)}`` (D = L * d)."""

    def __init__(self, args, encoder: LatentQueryEncoder, decoder):
        super().__init__(encoder, decoder)
        self.args = args
        self.latent_slots: "OrderedDict[str, Tuple[int, int]]" = OrderedDict(
            (g.name, (g.slots, g.slot_dim)) for g in encoder.groups
        )
        self.latent_sizes: "OrderedDict[str, int]" = OrderedDict((g.name, g.size) for g in encoder.groups)
        # the authors' training (QKVAE reading "authors"): loss averaged over sentences (their
        # criteria.py sums tokens, means sentences) and the optimizer re-created when the
        # auto-encoding phase ends (qkv_train.py); read by the sentence_vae criterion and task
        authors = encoder.reading == "authors"
        self.sentence_average_loss = authors
        self.reset_optimizer_after_ae = authors

    @classmethod
    def hub_models(cls):
        return {}

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        group = parser.add_argument_group("latent attention VAE (ADVAE / QKVAE)")
        group.add_argument("--num-latent-slots", type=int, metavar="L",
                           help="L, the number of slot latents (QKVAE: z_sem_1..L; ADVAE: z_1..L) (paper: 4)")
        group.add_argument("--slot-latent-dim", type=int, metavar="D",
                           help="size of each slot latent (paper: 192 for QKVAE's z_sem, 384 for ADVAE)")
        group.add_argument("--posterior-layers", type=int, metavar="N",
                           help="layers of the encoder's latent-query decoder, Dec in eq. 3 "
                                "(default: --decoder-layers)")
        group.add_argument("--word-dropout", type=float, metavar="P",
                           help="probability of replacing a decoder-input token by <unk> in training (0.4)")
        group.add_argument("--bart-dir", type=str, metavar="DIR",
                           help="initialise from a local Hugging Face BART directory (config.json + weights): "
                                "first encoder layers, last decoder layers, embeddings (the dictionary must "
                                "be BART's vocabulary)")

    # -- subclass hooks -------------------------------------------------------------------
    @classmethod
    def architecture_defaults(cls, args) -> None:
        raise NotImplementedError  # abstract

    @classmethod
    def latent_groups(cls, args) -> List[LatentGroup]:
        raise NotImplementedError  # abstract

    @classmethod
    def validate_specific(cls, args) -> None:
        pass

    @classmethod
    def reading(cls, args) -> str:
        """``authors`` or ``paper`` (QKVAE's ``--qkvae-reading``; ADVAE is built as the paper reads)."""
        return "paper"

    @classmethod
    def build_latent_decoder(cls, cfg, args, dictionary, embed_tokens):
        raise NotImplementedError  # abstract

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def build_model(cls, args, task):
        cls.architecture_defaults(args)
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        validate_latent_vae_args(args, src_dict, tgt_dict)
        cls.validate_specific(args)
        cfg = TransformerConfig.from_namespace(args)
        # one embedding for the encoder, the decoder input and the output projection (BART)
        embed_tokens = Embedding(len(src_dict), args.encoder_embed_dim, src_dict.pad())
        encoder = LatentQueryEncoder(cfg, src_dict, embed_tokens, cls.latent_groups(args), args.posterior_layers,
                                     reading=cls.reading(args))
        decoder = cls.build_latent_decoder(cfg, args, tgt_dict, embed_tokens)
        model = cls(args, encoder, decoder)
        if getattr(args, "bart_dir", None):
            model.bart_parameter_map = initialise_from_bart(model, args.bart_dir)
        return model

    def max_positions(self):
        return (self.encoder.max_positions(), self.decoder.max_positions())


def validate_latent_vae_args(args, src_dict, tgt_dict) -> None:
    """Early, named errors for settings these models cannot honour."""
    if src_dict is None or tgt_dict is None:
        raise VAEConfigError("the task must provide a source and a target dictionary (the same one)")
    if src_dict is not tgt_dict and (len(src_dict) != len(tgt_dict) or src_dict.symbols != tgt_dict.symbols):
        raise VAEConfigError(
            "the source and target dictionaries differ; a sentence VAE reconstructs its input, "
            "so binarise with one dictionary (fairseq-preprocess --only-source)"
        )
    if args.encoder_embed_dim != args.decoder_embed_dim:
        raise VAEConfigError(
            f"--encoder-embed-dim={args.encoder_embed_dim} must equal --decoder-embed-dim="
            f"{args.decoder_embed_dim} (one shared embedding; the latent queries attend to the encoder)"
        )
    for side in ("encoder", "decoder"):
        dim, heads = getattr(args, f"{side}_embed_dim"), getattr(args, f"{side}_attention_heads")
        if heads < 1 or dim % heads != 0:
            raise VAEConfigError(f"--{side}-attention-heads={heads} must be >= 1 and divide --{side}-embed-dim={dim}")
    for name, minimum in (("encoder_layers", 1), ("decoder_layers", 1), ("posterior_layers", 1),
                          ("num_latent_slots", 1), ("slot_latent_dim", 1)):
        value = getattr(args, name)
        if value is None or value < minimum:
            raise VAEConfigError(f"{_option(name)}={value} must be >= {minimum}")
    if not 0.0 <= args.word_dropout <= 1.0:
        raise VAEConfigError(f"--word-dropout={args.word_dropout} must be in [0, 1]")
    if args.decoder_layerdrop:
        raise VAEConfigError(f"--decoder-layerdrop={args.decoder_layerdrop}: layer drop is not supported in the "
                             "latent-conditioned decoders (each layer has its own latent memory)")
    if args.cross_self_attention:
        raise VAEConfigError("--cross-self-attention is not supported by the latent-conditioned decoders")
    if args.adaptive_softmax_cutoff:
        raise VAEConfigError("--adaptive-softmax-cutoff is not supported: the decoder must return full logits")
    if getattr(args, "adaptive_input", False):
        raise VAEConfigError("--adaptive-input is not supported (one shared token embedding)")
    if args.decoder_output_dim != args.decoder_embed_dim or args.decoder_input_dim != args.decoder_embed_dim:
        raise VAEConfigError("--decoder-output-dim and --decoder-input-dim must equal --decoder-embed-dim "
                             "(the output projection is tied to the shared embedding)")


def _set_default(args, name, value):
    if getattr(args, name, None) is None:
        setattr(args, name, value)


def latent_vae_base_architecture(args):
    """BART-base geometry truncated to 4 + 4 layers (Appendix B) and BART's conventions."""
    for side in ("encoder", "decoder"):
        _set_default(args, f"{side}_embed_dim", 768)
        _set_default(args, f"{side}_ffn_embed_dim", 3072)
        _set_default(args, f"{side}_layers", 4)
        _set_default(args, f"{side}_attention_heads", 12)
        _set_default(args, f"{side}_learned_pos", True)
        _set_default(args, f"{side}_normalize_before", False)
    _set_default(args, "posterior_layers", args.decoder_layers)
    _set_default(args, "activation_fn", "gelu")
    _set_default(args, "dropout", 0.1)
    _set_default(args, "attention_dropout", 0.0)
    _set_default(args, "activation_dropout", 0.0)
    _set_default(args, "layernorm_embedding", True)
    _set_default(args, "no_scale_embedding", True)
    _set_default(args, "share_all_embeddings", True)
    _set_default(args, "share_decoder_input_output_embed", True)
    _set_default(args, "max_source_positions", 1024)
    _set_default(args, "max_target_positions", 1024)
    _set_default(args, "num_latent_slots", 4)
    _set_default(args, "word_dropout", 0.4)
    _set_default(args, "bart_dir", None)
    base_architecture(args)


# ---------------------------------------------------------------------------------------------
@register_model("qkvae")
class QKVAEModel(LatentAttentionVAE):
    """QKVAE: z_syn gives the keys and z_sem the values of the decoder's attention (Section 4)."""

    @staticmethod
    def add_args(parser):
        LatentAttentionVAE.add_args(parser)
        group = parser.add_argument_group("QKVAE")
        group.add_argument("--syn-latent-dim", type=int, metavar="D",
                           help="size of z_syn (paper: 768)")
        group.add_argument("--key-mlp-layers", type=int, metavar="N",
                           help="layers of the z_syn -> keys network: 1 = the paper's linear M^s, "
                                "2 = the authors' Linear-GELU-Linear (default: 2)")
        group.add_argument("--qkvae-reading", choices=READINGS, metavar="READING",
                           help="authors (default): the model and training of the authors' code that made "
                                "the paper's tables (one encoder pass per latent with its own input "
                                "projection and causal queries, embedding word dropout scaled by 1-p in "
                                "evaluation, a Linear before the tied output embedding, BART's dropout 0.1 "
                                "everywhere, loss averaged over sentences, optimizer state reset when "
                                "--ae-steps ends); paper: the model as the paper describes it")

    @classmethod
    def architecture_defaults(cls, args):
        qkvae_base_architecture(args)

    @classmethod
    def latent_groups(cls, args):
        return [LatentGroup("z_syn", 1, args.syn_latent_dim),
                LatentGroup("z_sem", args.num_latent_slots, args.slot_latent_dim)]

    @classmethod
    def validate_specific(cls, args):
        for name in ("syn_latent_dim", "key_mlp_layers"):
            value = getattr(args, name)
            if value is None or value < 1:
                raise VAEConfigError(f"{_option(name)}={value} must be >= 1")
        if args.qkvae_reading not in READINGS:
            raise VAEConfigError(f"--qkvae-reading={args.qkvae_reading!r} must be one of {', '.join(READINGS)}")

    @classmethod
    def reading(cls, args) -> str:
        return args.qkvae_reading

    @classmethod
    def build_latent_decoder(cls, cfg, args, dictionary, embed_tokens):
        return QKVDecoder(cfg, dictionary, embed_tokens, args.word_dropout, syn_dim=args.syn_latent_dim,
                          slots=args.num_latent_slots, slot_dim=args.slot_latent_dim,
                          key_mlp_layers=args.key_mlp_layers, reading=args.qkvae_reading)


@register_model("advae")
class ADVAEModel(LatentAttentionVAE):
    """ADVAE: L slot latents decoded by cross-attention to Enc(Cat(d; z)) (Section 3.3)."""

    @staticmethod
    def add_args(parser):
        LatentAttentionVAE.add_args(parser)
        group = parser.add_argument_group("ADVAE")
        group.add_argument("--latent-encoder-layers", type=int, metavar="N",
                           help="layers of Enc in y = Cat(d; z) -> Enc(y) (default: --encoder-layers)")

    @classmethod
    def architecture_defaults(cls, args):
        advae_base_architecture(args)

    @classmethod
    def latent_groups(cls, args):
        return [LatentGroup("z", args.num_latent_slots, args.slot_latent_dim)]

    @classmethod
    def validate_specific(cls, args):
        if args.latent_encoder_layers is None or args.latent_encoder_layers < 0:
            raise VAEConfigError(f"--latent-encoder-layers={args.latent_encoder_layers} must be >= 0")

    @classmethod
    def build_latent_decoder(cls, cfg, args, dictionary, embed_tokens):
        return ADVAEDecoder(cfg, dictionary, embed_tokens, args.word_dropout, slots=args.num_latent_slots,
                            slot_dim=args.slot_latent_dim, latent_encoder_layers=args.latent_encoder_layers)


# ---------------------------------------------------------------------------------------------
def qkvae_base_architecture(args):
    """The paper's QKVAE (Section 5.1, Appendix B): z_syn 768, z_sem 4 x 192; the authors'
    reading keeps BART's dropout 0.1 on attention weights and FFN activations too."""
    _set_default(args, "qkvae_reading", "authors")
    if args.qkvae_reading == "authors":
        _set_default(args, "attention_dropout", 0.1)
        _set_default(args, "activation_dropout", 0.1)
    _set_default(args, "syn_latent_dim", 768)
    _set_default(args, "slot_latent_dim", 192)
    _set_default(args, "key_mlp_layers", 2)
    latent_vae_base_architecture(args)


def advae_base_architecture(args):
    """The paper's ADVAE baseline (Section 5.1): L = 4, total size 1536 = 4 x 384."""
    _set_default(args, "slot_latent_dim", 384)
    latent_vae_base_architecture(args)
    _set_default(args, "latent_encoder_layers", args.encoder_layers)


def _small(args):
    """CPU-sized geometry: d_model 256, 4 heads, FFN 1024, 2 + 2 layers."""
    for side in ("encoder", "decoder"):
        _set_default(args, f"{side}_embed_dim", 256)
        _set_default(args, f"{side}_ffn_embed_dim", 1024)
        _set_default(args, f"{side}_layers", 2)
        _set_default(args, f"{side}_attention_heads", 4)


@register_model_architecture("qkvae", "qkvae")
def qkvae(args):
    qkvae_base_architecture(args)


@register_model_architecture("qkvae", "qkvae_bart_base")
def qkvae_bart_base(args):
    qkvae_base_architecture(args)


@register_model_architecture("qkvae", "qkvae_small")
def qkvae_small(args):
    _small(args)
    _set_default(args, "syn_latent_dim", 64)
    _set_default(args, "slot_latent_dim", 16)
    qkvae_base_architecture(args)


@register_model_architecture("advae", "advae")
def advae(args):
    advae_base_architecture(args)


@register_model_architecture("advae", "advae_bart_base")
def advae_bart_base(args):
    advae_base_architecture(args)


@register_model_architecture("advae", "advae_small")
def advae_small(args):
    _small(args)
    _set_default(args, "slot_latent_dim", 32)  # 4 x 32 = 128 = QKVAE small's 64 + 4 x 16
    advae_base_architecture(args)


def count_parameters(model) -> Dict[str, int]:
    """Number of (distinct) parameters, in total and per top-level part."""
    seen = set()
    counts: Dict[str, int] = {}
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        part = name.split(".")[0]
        counts[part] = counts.get(part, 0) + param.numel()
    counts["total"] = sum(counts.values())
    return counts
