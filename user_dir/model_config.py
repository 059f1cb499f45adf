"""One config per model: a ``FairseqDataclass`` registered with ``register_model(name, dataclass=...)``,
architectures as field overrides of it.

fairseq reads a dataclass model's options in two ways, and both stay in step with the one dataclass:

* ``fairseq-train --arch NAME`` (argparse): :func:`add_config_args` adds every field as
  ``--field-name`` (booleans take a value: ``--flag``, ``--flag true``, ``--flag false``), without
  defaults, so that the architecture function (:func:`register_architecture`) fills in what the
  command line left out: the architecture's overrides first, then the field defaults.
* ``fairseq-hydra-train`` (``model._name: NAME`` in a YAML file): fairseq merges the YAML into
  the dataclass; an architecture's overrides are the fields to write under ``model:``
  (:func:`architecture_overrides`).
"""

import argparse
import dataclasses
import re
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Type

from fairseq.dataclass import FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass, interpret_dc_type
from fairseq.models import MODEL_DATACLASS_REGISTRY, register_model_architecture
from fairseq.models.transformer import TransformerConfig
from omegaconf import OmegaConf

from latent_core.errors import option_flag, parse_bool


# arch name -> (model name, {field: value}), for documentation and the hydra tests
ARCHITECTURE_OVERRIDES: Dict[str, Tuple[str, Dict[str, Any]]] = {}


def config_fields(config_cls: Type[FairseqDataclass]):
    """The user-facing fields of a model config (not fairseq's private ``_name``)."""
    return [f for f in dataclasses.fields(config_cls) if not f.name.startswith("_")]


def field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ValueError(f"model config field {f.name} has no default")


def config_defaults(config_cls: Type[FairseqDataclass]) -> Dict[str, Any]:
    return {f.name: field_default(f) for f in config_fields(config_cls)}


def fill_unset(args, values: Mapping[str, Any]) -> None:
    """``args.<name> = value`` for every option ``args`` leaves unset (absent or None, fairseq's
    ``safe_getattr`` convention): what an architecture does to the command line's options."""
    for name, value in values.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def add_config_args(parser, config_cls: Type[FairseqDataclass]) -> None:
    """``add_args`` of a dataclass model: fairseq's ``gen_parser_from_dataclass`` (no defaults, as
    ``BaseFairseqModel.add_args``), except that a boolean takes an optional value (fairseq's
    ``store_true`` cannot be switched off on the command line once an architecture sets it)."""
    for f in config_fields(config_cls):
        if interpret_dc_type(f.type) is bool:
            parser.add_argument(option_flag(f.name), type=parse_bool, nargs="?", const=True,
                                metavar="BOOL", help=f"{f.metadata.get('help', '')} (true/false)")
    # the booleans above are already there: fairseq skips an option that exists (ArgumentError)
    gen_parser_from_dataclass(parser, config_cls(), delete_default=True)


_NESTED_REFERENCE = re.compile(r"\$\{model\.(encoder|decoder|quant_noise)\.")
_MODEL_REFERENCE = re.compile(r"\$\{model\.(\w+)\}")


def flat_transformer_fields(defaults: Mapping[str, Any] = {}):
    """fairseq's ``TransformerConfig`` as flat fields ``(name, type, field)`` for ``make_dataclass``,
    named as the options of its legacy ``transformer`` (``encoder.embed_dim`` -> ``encoder_embed_dim``,
    what ``TransformerModel.add_args`` generates), so that a checkpoint's model config stays flat
    (a nested one would not load it); fairseq's ``${model.decoder.embed_dim}`` defaults become
    ``${model.decoder_embed_dim}`` (:func:`config_namespace` resolves them). ``defaults`` replaces
    fairseq's default of the fields it names (None: unset, the field becomes Optional)."""
    flat = []
    for f in dataclasses.fields(TransformerConfig):
        nested = isinstance(f.type, type) and issubclass(f.type, FairseqDataclass)
        for prefix, sub in ([(f.name + "_", s) for s in dataclasses.fields(f.type)] if nested else [("", f)]):
            if sub.name != "_name":
                flat.append((prefix + sub.name, sub))
    unknown = sorted(set(defaults) - {name for name, _ in flat})
    if unknown:
        raise ValueError(f"{unknown} are not options of fairseq's transformer")
    result = []
    for name, f in flat:
        default = defaults[name] if name in defaults else field_default(f)
        kind = Optional[f.type] if default is None else f.type
        if isinstance(default, str):
            default = _NESTED_REFERENCE.sub(r"${model.\1_", default)
        result.append((name, kind, dataclasses.field(default=default, metadata=dict(f.metadata))))
    return result


def config_namespace(cfg, config_cls: Optional[Type[FairseqDataclass]] = None) -> argparse.Namespace:
    """A model's options as an ``argparse.Namespace`` (what fairseq's transformer code and the
    models read), from whatever fairseq hands ``build_model``: the Namespace an architecture filled
    (``--arch NAME_variant``, old checkpoints), a config dataclass (``--arch NAME``: fairseq's
    ``from_namespace``) or a DictConfig (fairseq-hydra-train, a checkpoint).

    With ``config_cls``, an option the caller left unset (absent or None) takes the config's default,
    as fairseq's own ``TransformerModel.build_model`` completes a sparse Namespace with its base
    architecture (fairseq's tests and scripts build models that way). A Namespace is completed in
    place. A default ``${model.decoder_embed_dim}`` that nothing resolved takes that field's value."""
    if OmegaConf.is_config(cfg):
        args = argparse.Namespace(**OmegaConf.to_container(cfg, enum_to_str=True))
    elif isinstance(cfg, argparse.Namespace):
        args = cfg
    else:
        args = argparse.Namespace(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    if config_cls is not None:
        fill_unset(args, config_defaults(config_cls))
    for name, value in vars(args).items():
        reference = _MODEL_REFERENCE.fullmatch(value) if isinstance(value, str) else None
        if reference:
            setattr(args, name, getattr(args, reference.group(1)))
    return args


def model_options(model_cls, cfg) -> argparse.Namespace:
    """The first line of every model's ``build_model``: whatever fairseq hands it (an architecture's
    Namespace, the model's config dataclass, a DictConfig from fairseq-hydra-train or a checkpoint) as
    a Namespace whose unset options take the defaults of the model's registered config
    (:func:`config_namespace`; a Namespace is completed in place)."""
    return config_namespace(cfg, getattr(model_cls, "__dataclass"))


def register_architecture(model_name: str, arch_name: str, resolve: Optional[Callable] = None, **overrides):
    """``--arch arch_name``: the config of ``model_name`` with ``overrides`` as its defaults.

    The registered function sets every field the command line (or a checkpoint's config) left
    unset (absent or None, fairseq's ``safe_getattr`` convention): the override if there is one,
    else the dataclass default; then ``resolve(args)`` where given (defaults that follow other
    options). Returns the function (so that tests and callers can apply it).
    """
    config_cls = MODEL_DATACLASS_REGISTRY[model_name]
    defaults = config_defaults(config_cls)
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"architecture {arch_name}: {unknown} are not fields of {config_cls.__name__}")
    values = {**defaults, **overrides}

    def architecture(args):
        fill_unset(args, values)
        if resolve is not None:
            resolve(args)

    architecture.__name__ = arch_name
    architecture.__doc__ = f"{model_name} with {overrides}" if overrides else f"{model_name} (its defaults)"
    register_model_architecture(model_name, arch_name)(architecture)
    ARCHITECTURE_OVERRIDES[arch_name] = (model_name, dict(overrides))
    return architecture


def architecture_overrides(arch_name: str) -> Dict[str, Any]:
    """The fields an architecture sets (what to write under ``model:`` in a hydra YAML)."""
    return dict(ARCHITECTURE_OVERRIDES[arch_name][1])
