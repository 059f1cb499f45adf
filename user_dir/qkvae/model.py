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
from dataclasses import dataclass, field, make_dataclass
from typing import Dict, List, Optional, Tuple

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models import MODEL_REGISTRY, register_model
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer.transformer_base import Embedding

from latent_core.errors import check_heads_divide, option_flag
from latent_core.vae import VAEConfigError
from user_dir.model_config import (add_config_args, fill_unset, flat_transformer_fields, model_options,
                                   register_architecture)
from user_dir.sentence_vae.base import SentenceVAEModel

from .bart_init import initialise_from_bart
from .decoder import ADVAEDecoder, QKVDecoder
from .encoder import READINGS, LatentGroup, LatentQueryEncoder


def _option(name: str) -> str:
    return option_flag(name)


# -- options ----------------------------------------------------------------------------------
# Appendix B: BART-base truncated to 4 + 4 layers, with BART's conventions; where these models'
# defaults differ from fairseq's Transformer options
BART_BASE_DEFAULTS = dict(
    encoder_embed_dim=768, decoder_embed_dim=768, encoder_ffn_embed_dim=3072, decoder_ffn_embed_dim=3072,
    encoder_layers=4, decoder_layers=4, encoder_attention_heads=12, decoder_attention_heads=12,
    encoder_learned_pos=True, decoder_learned_pos=True, activation_fn="gelu", layernorm_embedding=True,
    no_scale_embedding=True, share_all_embeddings=True, share_decoder_input_output_embed=True,
)
BART_DROPOUT = 0.1  # BART's attention and activation dropout (QKVAE's authors' reading keeps it)


# fairseq's transformer options with BART-base values; the decoder's input/output dims follow --decoder-embed-dim
TransformerOptions = make_dataclass("TransformerOptions", flat_transformer_fields(
    {**BART_BASE_DEFAULTS, "decoder_input_dim": None, "decoder_output_dim": None}), bases=(FairseqDataclass,))


@dataclass
class LatentAttentionVAEConfig(TransformerOptions):
    """Options of both models: fairseq's Transformer options and the latent ones."""

    attention_dropout: Optional[float] = field(
        default=None, metadata={"help": "dropout of the attention weights (default: BART's under QKVAE's "
                                        "--qkvae-reading authors, else no dropout)"})
    activation_dropout: Optional[float] = field(
        default=None, metadata={"help": "dropout after the FFN activation (default: BART's under QKVAE's "
                                        "--qkvae-reading authors, else no dropout)", "alias": "--relu-dropout"})
    num_latent_slots: int = field(
        default=4, metadata={"help": "L, the number of slot latents (QKVAE: z_sem_1..L; ADVAE: z_1..L)"})
    posterior_layers: Optional[int] = field(
        default=None, metadata={"help": "layers of the encoder's latent-query decoder, Dec in eq. 3 "
                                        "(default: --decoder-layers)"})
    word_dropout: float = field(
        default=0.4, metadata={"help": "probability of replacing a decoder-input token by <unk> in training"})
    bart_dir: Optional[str] = field(
        default=None, metadata={"help": "initialise from a local Hugging Face BART directory (config.json + "
                                        "weights): first encoder layers, last decoder layers, embeddings (the "
                                        "dictionary must be BART's vocabulary)"})


@dataclass
class QKVAEConfig(LatentAttentionVAEConfig):
    syn_latent_dim: int = field(default=768, metadata={"help": "size of z_syn"})
    slot_latent_dim: int = field(default=192, metadata={"help": "size of each z_sem slot latent"})
    key_mlp_layers: int = field(
        default=2, metadata={"help": "layers of the z_syn -> keys network: 1 = the paper's linear M^s, "
                                     "2 = the authors' Linear-GELU-Linear"})
    qkvae_reading: ChoiceEnum(READINGS) = field(
        default="authors", metadata={"help": "authors: the model and training of the authors' code that made the "
                                             "paper's tables (one encoder pass per latent with its own input "
                                             "projection and causal queries, embedding word dropout scaled by 1-p "
                                             "in evaluation, a Linear before the tied output embedding, BART's "
                                             "dropout everywhere, loss averaged over sentences, optimizer state "
                                             "reset when --ae-steps ends); paper: the model as the paper "
                                             "describes it"})


@dataclass
class ADVAEConfig(LatentAttentionVAEConfig):
    slot_latent_dim: int = field(default=384, metadata={"help": "size of each slot latent z_i"})
    latent_encoder_layers: Optional[int] = field(
        default=None, metadata={"help": "layers of Enc in y = Cat(d; z) -> Enc(y) (default: --encoder-layers)"})


class LatentAttentionVAE(SentenceVAEModel):
    """Common part of QKVAE and ADVAE: argument handling, the shared embedding, the encoder,
    ``latent_sizes`` ``{name: D}`` and ``latent_slots`` ``{name: (L, d)}`` (D = L * d)."""

    def __init__(self, args, encoder: LatentQueryEncoder, decoder):
        # the authors' training (QKVAE reading "authors"): the decoder starts with <s> (qkv_train.py feeds
        # text[..., :-1]; the paper reading keeps fairseq's </s>), the loss is averaged over sentences
        # (their criteria.py sums tokens, means sentences) and the optimizer is re-created when the
        # auto-encoding phase ends (qkv_train.py)
        authors = encoder.reading == "authors"
        super().__init__(encoder, decoder, OrderedDict((g.name, g.size) for g in encoder.groups),
                         default_decoder_start="bos" if authors else "eos", sentence_average_loss=authors,
                         reset_optimizer_after_ae=authors)
        self.args = args
        self.latent_slots: "OrderedDict[str, Tuple[int, int]]" = OrderedDict(
            (g.name, (g.slots, g.slot_dim)) for g in encoder.groups
        )

    @classmethod
    def hub_models(cls):
        return {}

    # -- subclass hooks -------------------------------------------------------------------
    # options whose default is another option's value (None in the config): resolve_defaults
    DEFAULTS_FOLLOWING = {"posterior_layers": "decoder_layers", "decoder_input_dim": "decoder_embed_dim",
                          "decoder_output_dim": "decoder_embed_dim"}

    @classmethod
    def architecture_defaults(cls, args) -> None:
        """Give every option left unset its default (the model's paper-size architecture)."""
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
    def resolve_defaults(cls, args) -> None:
        """The defaults that depend on other options (run by the architectures and build_model)."""
        fill_unset(args, {name: getattr(args, source) for name, source in cls.DEFAULTS_FOLLOWING.items()})
        dropout = BART_DROPOUT if cls.reading(args) == "authors" else 0.0
        fill_unset(args, {"attention_dropout": dropout, "activation_dropout": dropout})

    @classmethod
    def build_model(cls, cfg, task):
        args = model_options(cls, cfg)
        cls.architecture_defaults(args)
        cls.resolve_defaults(args)
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
        check_heads_divide(f"--{side}-attention-heads", getattr(args, f"{side}_attention_heads"),
                           f"--{side}-embed-dim", getattr(args, f"{side}_embed_dim"), VAEConfigError)
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


# ---------------------------------------------------------------------------------------------
@register_model("qkvae", dataclass=QKVAEConfig)
class QKVAEModel(LatentAttentionVAE):
    """QKVAE: z_syn gives the keys and z_sem the values of the decoder's attention (Section 4)."""

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, QKVAEConfig)

    @classmethod
    def architecture_defaults(cls, args):
        qkvae_bart_base(args)

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


@register_model("advae", dataclass=ADVAEConfig)
class ADVAEModel(LatentAttentionVAE):
    """ADVAE: L slot latents decoded by cross-attention to Enc(Cat(d; z)) (Section 3.3)."""

    DEFAULTS_FOLLOWING = {**LatentAttentionVAE.DEFAULTS_FOLLOWING, "latent_encoder_layers": "encoder_layers"}

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, ADVAEConfig)

    @classmethod
    def architecture_defaults(cls, args):
        advae_bart_base(args)

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
# Architectures (the table of the module docstring): the fields each changes. ``qkvae`` and
# ``advae`` (the model names) are the configs' defaults, the ``*_bart_base`` sizes.
SMALL_GEOMETRY = dict(  # CPU-sized: d_model 256, 4 heads, FFN 1024, 2 + 2 layers
    encoder_embed_dim=256, decoder_embed_dim=256, encoder_ffn_embed_dim=1024, decoder_ffn_embed_dim=1024,
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
)
ARCHITECTURES = {
    "qkvae_bart_base": ("qkvae", {}),
    "qkvae_small": ("qkvae", {**SMALL_GEOMETRY, "syn_latent_dim": 64, "slot_latent_dim": 16}),
    "advae_bart_base": ("advae", {}),
    "advae_small": ("advae", {**SMALL_GEOMETRY, "slot_latent_dim": 32}),  # 4 x 32 = 128 = QKVAE small's 64 + 4 x 16
}


# each resolves the defaults that follow other options (LatentAttentionVAE.resolve_defaults), as the
# legacy architectures did
qkvae_bart_base, qkvae_small, advae_bart_base, advae_small = (
    register_architecture(model, arch, resolve=MODEL_REGISTRY[model].resolve_defaults, **overrides)
    for arch, (model, overrides) in ARCHITECTURES.items()
)


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
