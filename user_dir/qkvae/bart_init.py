"""Initialising QKVAE / ADVAE from a local Hugging Face BART directory (``--bart-dir``).

Appendix B of Felhi et al., NAACL 2022, arXiv:2205.05943: "The encoders (resp. decoders) are initialized with
parameters from the 4 first layers (resp. 4 last layers) of BART encoders (resp. decoders)".
With N = ``--encoder-layers``, M = ``--decoder-layers``, P = ``--posterior-layers`` and a BART of
E encoder and D decoder layers, this copies

* ``shared`` -> the one token embedding (encoder input, decoder input, tied output projection);
* encoder / decoder ``embed_positions`` (the first rows, if ours are shorter) and
  ``layernorm_embedding``;
* BART encoder layers 0..N-1 -> the sentence encoder (``Enc`` of eq. 3);
* BART decoder layers D-P..D-1 -> the encoder's latent-query decoder (``Dec`` of eq. 3, full
  cross-attention), and BART's decoder ``layernorm_embedding`` -> the query layer norm; in
  QKVAE's ``authors`` reading also BART's decoder ``embed_positions`` -> the queries' positions;
* BART decoder layers D-M..D-1 -> the generating decoder; for QKVAE every parameter except
  the cross-attention's ``k_proj`` / ``v_proj`` (the QKV attention keeps BART's ``q_proj`` and
  ``out_proj``; keys and values come from the latents);
* ADVAE: BART encoder layers 0..K-1 (K = ``--latent-encoder-layers``) and BART's encoder
  ``layernorm_embedding`` -> ``Enc`` of y = Cat(d; z) (the authors' code took the *last* K
  encoder layers here; we follow the paper's rule for encoders).

The latent queries, M_mu / M_sigma, slot identifiers, the z_syn -> keys network, the
z_sem -> values / y projections and (``authors`` reading) the per-latent input projections and
the Linear before the output embedding have no BART counterpart and keep their random
initialisation, as in the authors' code.

BART's vocabulary: the fairseq dictionary must have exactly BART's ``vocab_size`` symbols
with index i = BART token id i. Build it and the tokenised text with
:mod:`pipelines.data.bart_data`:

    python -m pipelines.data.bart_data dict BART_DIR data-bin/dict.bart.txt
    python -m pipelines.data.bart_data tokenize BART_DIR < train.txt > train.bpe
    fairseq-preprocess --only-source --srcdict data-bin/dict.bart.txt \\
        --trainpref train.bpe --validpref valid.bpe --destdir data-bin

(``dict`` writes BART's tokenizer vocabulary in id order after fairseq's four special symbols,
which are BART's ids 0-3: <s>, <pad>, </s>, <unk>; ``tokenize`` writes each line as BART's
byte-level BPE tokens separated by spaces. Both need BART's tokenizer files in the directory.) A dictionary of another size is refused with an error.
"""

import os
from typing import Dict, List, Tuple

import torch

from latent_core.errors import option_flag
from latent_core.vae import VAEConfigError

from ..hf_pretrained import inspect_hf_directory

CONFIG_FILE = "config.json"


class BartInitError(VAEConfigError):
    """A BART directory that cannot initialise the model (the message names the file/field)."""


def load_bart_config(bart_dir: str) -> dict:
    """``config.json`` of a BART directory as a dict, after checking the files are there."""
    def check_type(config: dict, path: str) -> None:
        if config.get("model_type") != "bart":
            raise BartInitError(
                f"{path}: field 'model_type' is {config.get('model_type')!r}, expected 'bart' "
                "(only BART checkpoints can initialise QKVAE/ADVAE)"
            )

    return inspect_hf_directory(bart_dir, "--bart-dir", BartInitError, validate=check_type)


def _bart_field(config: dict, field: str, default=None):
    if field in config:
        return config[field]
    if default is not None:
        return default
    raise BartInitError(f"{CONFIG_FILE}: field {field!r} is missing")


def check_bart_architecture(config: dict, args, dictionary, bart_dir: str) -> None:
    """Every field of BART's config that the model must agree with, with named errors."""
    where = os.path.join(bart_dir, CONFIG_FILE)

    def mismatch(field, value, option, ours):
        raise BartInitError(f"{where}: field {field!r} is {value!r} but {option} is {ours!r}")

    d_model = _bart_field(config, "d_model")
    for side in ("encoder", "decoder"):
        if getattr(args, f"{side}_embed_dim") != d_model:
            mismatch("d_model", d_model, f"--{side}-embed-dim", getattr(args, f"{side}_embed_dim"))
        heads = _bart_field(config, f"{side}_attention_heads")
        if getattr(args, f"{side}_attention_heads") != heads:
            mismatch(f"{side}_attention_heads", heads, f"--{side}-attention-heads",
                     getattr(args, f"{side}_attention_heads"))
        ffn = _bart_field(config, f"{side}_ffn_dim")
        if getattr(args, f"{side}_ffn_embed_dim") != ffn:
            mismatch(f"{side}_ffn_dim", ffn, f"--{side}-ffn-embed-dim", getattr(args, f"{side}_ffn_embed_dim"))
        if getattr(args, f"{side}_normalize_before"):
            raise BartInitError(f"{where}: BART is post-norm; --{side}-normalize-before must be off")
        if not getattr(args, f"{side}_learned_pos"):
            raise BartInitError(f"{where}: BART has learned positions; --{side}-learned-pos must be on")
    activation = _bart_field(config, "activation_function", "gelu")
    if args.activation_fn != activation:
        mismatch("activation_function", activation, "--activation-fn", args.activation_fn)
    scale = bool(config.get("scale_embedding", False))
    if scale == bool(args.no_scale_embedding):
        mismatch("scale_embedding", scale, "--no-scale-embedding", args.no_scale_embedding)
    if not args.layernorm_embedding:
        raise BartInitError(f"{where}: BART has a layernorm_embedding; --layernorm-embedding must be on")

    enc_layers = _bart_field(config, "encoder_layers")
    dec_layers = _bart_field(config, "decoder_layers")
    wanted_enc = [("--encoder-layers", args.encoder_layers)]
    if getattr(args, "latent_encoder_layers", None):
        wanted_enc.append(("--latent-encoder-layers", args.latent_encoder_layers))
    for option, value in wanted_enc:
        if value > enc_layers:
            mismatch("encoder_layers", enc_layers, option, value)
    for option, value in (("--decoder-layers", args.decoder_layers), ("--posterior-layers", args.posterior_layers)):
        if value > dec_layers:
            mismatch("decoder_layers", dec_layers, option, value)

    vocab = _bart_field(config, "vocab_size")
    if len(dictionary) != vocab:
        raise BartInitError(
            f"{where}: field 'vocab_size' is {vocab} but the fairseq dictionary has {len(dictionary)} "
            "symbols; binarise with BART's vocabulary (python -m pipelines.data.bart_data dict "
            f"{bart_dir} dict.txt, then fairseq-preprocess --srcdict dict.txt)"
        )
    for field, ours, default in (("pad_token_id", dictionary.pad(), 1), ("bos_token_id", dictionary.bos(), 0),
                                 ("eos_token_id", dictionary.eos(), 2)):
        value = config.get(field, default)
        if value != ours:
            raise BartInitError(f"{where}: field {field!r} is {value} but the fairseq dictionary has it at {ours}")
    if dictionary.pad() != 1:
        # fairseq's learned positions start at padding_idx + 1; BART's at 2
        raise BartInitError(f"the dictionary's padding index is {dictionary.pad()}; BART's positions need 1")
    max_pos = _bart_field(config, "max_position_embeddings")
    for option in ("max_source_positions", "max_target_positions"):
        if getattr(args, option) > max_pos:
            mismatch("max_position_embeddings", max_pos, option_flag(option), getattr(args, option))


def bart_parameter_map(model, config: dict) -> Dict[str, str]:
    """``{our parameter name: BART parameter name}`` for everything BART initialises."""
    enc_layers, dec_layers = config["encoder_layers"], config["decoder_layers"]
    encoder, decoder = model.encoder, model.decoder
    prefixes: List[Tuple[str, str]] = [
        ("encoder.sentence_encoder.embed_tokens", "shared"),
        ("encoder.sentence_encoder.embed_positions", "encoder.embed_positions"),
        ("encoder.sentence_encoder.layernorm_embedding", "encoder.layernorm_embedding"),
        ("decoder.embed_positions", "decoder.embed_positions"),
        ("decoder.layernorm_embedding", "decoder.layernorm_embedding"),
    ]
    prefixes += [(f"encoder.sentence_encoder.layers.{i}", f"encoder.layers.{i}")
                 for i in range(len(encoder.sentence_encoder.layers))]
    num_query = len(encoder.query_layers)
    prefixes += [(f"encoder.query_layers.{i}", f"decoder.layers.{dec_layers - num_query + i}")
                 for i in range(num_query)]
    if encoder.query_layernorm is not None:
        prefixes.append(("encoder.query_layernorm", "decoder.layernorm_embedding"))
    if getattr(encoder, "query_positions", None) is not None:  # reading "authors": the queries' positions
        prefixes.append(("encoder.query_positions", "decoder.embed_positions"))
    num_dec = len(decoder.layers)
    prefixes += [(f"decoder.layers.{i}", f"decoder.layers.{dec_layers - num_dec + i}") for i in range(num_dec)]
    latent_layers = getattr(decoder, "latent_layers", None)
    if latent_layers is not None:
        if len(latent_layers) > enc_layers:
            raise BartInitError(f"{CONFIG_FILE}: field 'encoder_layers' is {enc_layers} but "
                                f"--latent-encoder-layers is {len(latent_layers)}")
        prefixes += [(f"decoder.latent_layers.{i}", f"encoder.layers.{i}") for i in range(len(latent_layers))]
        if decoder.latent_layernorm is not None:
            prefixes.append(("decoder.latent_layernorm", "encoder.layernorm_embedding"))

    ours = dict(model.named_parameters(remove_duplicate=False))
    mapping: Dict[str, str] = {}
    for our_prefix, bart_prefix in prefixes:
        names = [n for n in ours if n.startswith(our_prefix + ".")]
        if not names:
            raise RuntimeError(f"no parameters under {our_prefix!r}: the model layout changed")
        for name in names:
            mapping[name] = bart_prefix + name[len(our_prefix):]
    return mapping


def initialise_from_bart(model, bart_dir: str) -> Dict[str, str]:
    """Copy BART's weights into ``model`` (see the module docstring); returns the map used."""
    from transformers import BartModel

    config = load_bart_config(bart_dir)
    check_bart_architecture(config, model.args, model.encoder.dictionary, bart_dir)
    try:
        bart = BartModel.from_pretrained(bart_dir)
    except Exception as err:  # noqa: BLE001  (re-raised with the directory named)
        raise BartInitError(f"--bart-dir {bart_dir!r}: BartModel.from_pretrained failed: {err}") from err
    bart_state = bart.state_dict()
    mapping = bart_parameter_map(model, config)
    ours = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, bart_name in mapping.items():
            if bart_name not in bart_state:
                raise BartInitError(f"{bart_dir}: the BART weights have no parameter {bart_name!r} (for {name})")
            source, target = bart_state[bart_name], ours[name]
            if name.endswith("positions.weight") and source.size(0) >= target.size(0):
                source = source[: target.size(0)]  # our tables may be shorter (fewer positions)
            if source.shape != target.shape:
                raise BartInitError(f"{bart_dir}: {bart_name} has shape {tuple(source.shape)}, "
                                    f"{name} needs {tuple(target.shape)}")
            target.copy_(source.to(target.dtype))
    return mapping
