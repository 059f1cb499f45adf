"""Attaching SDMA to a transformers model, all or nothing: :func:`attach_sdma`; the schedule of eq. (11)'s mixing
weight (:func:`set_sdma_updates`); reloading a save (:func:`from_pretrained_with_sdma`).

Supported: BERT-family encoders (self-attention modules with ``query``/``key``/``value`` projections: BERT,
RoBERTa, MiniLM, ...), GPT-2 decoders (``GPT2Attention``, causal), Llama-family decoders (Llama, Mistral, Qwen2:
rotary embeddings, grouped-query attention) and encoder-decoders (BART, Marian, mBART; T5 with its relative position
bias as the core's ``score_bias``): the paper's three attention types, encoder self-attention, decoder self-attention
and the decoder's cross-attention (queries from the decoder, keys from the encoder, each clustered by the module's
feature GMM; the authors reading perturbs the keys, whose projections are then of the noisy encoder states while
the values stay clean, as in their fairseq code). As in the fairseq adapter, a decoder self-attention's mask is off
at inference unless asked for (``decoder_mask_at_inference``); encoder self-attention and cross-attention keep
theirs. Pretrained projections are kept as loaded in both readings (the authors' initialisation of the projections
applies to training from scratch).
"""

import copy
import dataclasses
import os
from pathlib import Path
from typing import List, Tuple

import torch
from safetensors import safe_open
from torch import nn
from transformers import AttentionInterface, PreTrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.utils import logging as transformers_logging

from latent_core.sdma import SDMAConfigError, SDMACore, SDMAOptions, SDMARecording

from transformers_plugin.attention import (SDMA_ATTENTION, ForwardRecords, SDMAAttentionState, draw_sample,
                                           sdma_attention_forward)
from transformers_plugin.families import DECODER_CROSS, DECODER_SELF, AttentionFamily, attention_modules

OPTION_NAMES = tuple(f.name for f in dataclasses.fields(SDMAOptions))


def register_sdma_attention() -> None:
    """The attention function and its mask (transformers' sdpa form) under the name ``"sdma"``: done on import of
    ``transformers_plugin``, so that ``from_pretrained`` of a save whose config names it finds it."""
    AttentionInterface.register(SDMA_ATTENTION, sdma_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SDMA_ATTENTION, sdpa_mask)


def attach_sdma(model: nn.Module, decoder_mask_at_inference: bool = False, **options) -> nn.Module:
    """Give every attention module of ``model`` an SDMA core with ``options`` (the fields of
    :class:`latent_core.sdma.SDMAOptions`, named as there: ``mode``, ``reading``, ``clusters``, ...) and switch the
    model's attention implementation to ``"sdma"``. Pretrained weights are kept; only the cores' parameters (GMM means
    and variances, the mixing weight g) are new. Returns ``model``.

    All or nothing: a bad option, an unsupported or already attached model leaves ``model`` exactly as it was
    (state dict, hooks, config, attention implementation); the error names the keyword. The model gets its own copy
    of its config (``attach_sdma`` writes the options and the attention implementation there, and a config object
    may be shared by other models).

    A causal (decoder) self-attention applies its mask at inference only with ``decoder_mask_at_inference``, as the
    fairseq adapter's ``--sdma-decoder-mask-at-inference`` (the paper drops it there); ``generate()`` then caches
    the keys' cluster probabilities beside transformers' KV cache. Encoder self-attention and cross-attention keep it
    at inference (``mask_at_inference``), as in the fairseq adapter."""
    sdma, decoder = _checked_options(options, decoder_mask_at_inference)
    modules = _attachable_modules(model)
    records = ForwardRecords()
    planned = []
    for name, module, family in modules:
        role = family.role(module, name)
        core = SDMACore(family.heads(module) * family.head_dim(module), family.heads(module),
                        decoder if role == DECODER_SELF else sdma)
        core.sdma_group = role
        planned.append((name, module, core, SDMAAttentionState(family, role, records)))
    _pair_cross_attentions(planned)
    register_sdma_attention()
    undo = []
    try:
        for name, module, core, state in planned:
            module.sdma = core
            undo.append(lambda module=module: delattr(module, "sdma"))
            module.sdma_state = state
            undo.append(lambda module=module: delattr(module, "sdma_state"))
            handle = module.register_forward_pre_hook(draw_sample, with_kwargs=True)
            undo.append(handle.remove)
        undo.append(_own_config(model))
        model.set_attn_implementation(SDMA_ATTENTION)
        # saved in config.json: a plain from_pretrained of the save then refuses instead of loading a vanilla model
        model.config.attn_implementation = SDMA_ATTENTION
        model.config.sdma = {**dataclasses.asdict(sdma), "decoder_mask_at_inference": decoder_mask_at_inference}
        model.sdma_forward_records = records
        undo.append(lambda: delattr(model, "sdma_forward_records"))
        handle = model.register_forward_pre_hook(_start_records)
        undo.append(handle.remove)
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    return model


def _checked_options(options: dict, decoder_mask_at_inference) -> Tuple[SDMAOptions, SDMAOptions]:
    """The options of encoder/cross-attention cores and of decoder self-attention cores; errors name the keyword."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise SDMAConfigError(f"attach_sdma: unknown keyword(s) {', '.join(unknown)}; the options are "
                              f"decoder_mask_at_inference, {', '.join(OPTION_NAMES)}")
    sdma = SDMAOptions(**options).validate(prefix="attach_sdma: ", word_sep="_")
    if not isinstance(decoder_mask_at_inference, bool):
        raise SDMAConfigError(f"attach_sdma: decoder_mask_at_inference={decoder_mask_at_inference!r} must be "
                              "True or False")
    return sdma, dataclasses.replace(sdma, mask_at_inference=decoder_mask_at_inference)


def _attachable_modules(model: nn.Module) -> List[Tuple[str, nn.Module, AttentionFamily]]:
    """The attention modules to attach to, after every check that can refuse the model (nothing changed yet)."""
    if not isinstance(getattr(model, "config", None), PreTrainedConfig) or not hasattr(model, "set_attn_implementation"):
        raise SDMAConfigError(f"attach_sdma: {type(model).__name__} is not a transformers PreTrainedModel (attach SDMA "
                              "before wrapping the model, e.g. before get_peft_model or accelerator.prepare)")
    modules = attention_modules(model)
    attached = {id(module) for _, module, _ in modules}
    for name, module in model.named_modules():
        if _is_cross_attention(module) and not any(id(m) in attached for m in module.modules()):
            raise SDMAConfigError(
                f"attach_sdma: {name} ({type(module).__name__}) is a cross-attention SDMA does not support (it would "
                "stay vanilla beside SDMA self-attentions); SDMA's cross-attentions are BART's, Marian's, mBART's and "
                "T5's. For an EncoderDecoderModel, attach to its encoder alone: attach_sdma(model.encoder, ...)")
    for name, module, family in modules:
        if hasattr(module, "sdma"):
            raise SDMAConfigError(f"attach_sdma: {name} ({type(module).__name__}) already has an SDMA core "
                                  "(attach_sdma was called twice on this model)")
        heads, width = family.heads(module), family.heads(module) * family.head_dim(module)
        if family.input_dim is not None and family.input_dim(module) != width:
            raise SDMAConfigError(
                f"attach_sdma: {type(module).__name__} has {heads} heads of {family.head_dim(module)} over an input of "
                f"{family.input_dim(module)}: SDMA clusters the input in one slice per head, which needs a model width "
                "equal to heads * head dimension (hidden_size = num_attention_heads * head_dim: leave head_dim unset; "
                "T5: d_model = num_heads * d_kv)")
    return modules


def _is_cross_attention(module: nn.Module) -> bool:
    """A cross-attention module or its wrapper, by transformers' names (BertCrossAttention, T5LayerCrossAttention)
    or flag (GPT-2's ``is_cross_attention``)."""
    name = type(module).__name__
    return name.endswith("CrossAttention") or (name.endswith("Attention") and getattr(module, "is_cross_attention",
                                                                                       False) is True)


def _pair_cross_attentions(planned) -> None:
    """A cross-attention's queries are its decoder layer's: its partner is the decoder self-attention whose name
    shares the longest prefix with its own (BART: layers.3.self_attn for layers.3.encoder_attn; T5:
    block.3.layer.0.SelfAttention for block.3.layer.1.EncDecAttention)."""
    decoder_selves = [(name, module) for name, module, _, state in planned if state.role == DECODER_SELF]
    for name, _, _, state in planned:
        if state.role == DECODER_CROSS and decoder_selves:
            state.partner = max(decoder_selves, key=lambda item: len(os.path.commonprefix([item[0], name])))[1]


def _own_config(model: nn.Module):
    """Give ``model`` and every submodule that holds its config (or one of its sub-configs) a deep copy, so that what
    attach_sdma writes there reaches no other model sharing the config object. Returns the undo step."""
    original = model.config
    copied = copy.deepcopy(original)
    replacement = {id(original): copied}
    for key, value in vars(original).items():
        if isinstance(value, PreTrainedConfig) and isinstance(getattr(copied, key, None), PreTrainedConfig):
            replacement[id(value)] = getattr(copied, key)
    changed = []
    for module in model.modules():
        for key, value in list(vars(module).items()):
            if id(value) in replacement:
                changed.append((module, key, value))
                object.__setattr__(module, key, replacement[id(value)])

    def undo():
        for module, key, value in changed:
            object.__setattr__(module, key, value)

    return undo


def _start_records(model, _args) -> None:
    """Model forward pre-hook: the regularisers' records of this forward start empty."""
    model.sdma_forward_records.recording = SDMARecording()


def set_sdma_updates(model: nn.Module, num_updates: int) -> None:
    """The mixing weight g of eq. (11) after ``num_updates`` optimizer updates (an integer >= 0; call it after each
    step). ``model``: the attached model or a wrapper of it."""
    if isinstance(num_updates, bool) or not isinstance(num_updates, int) or num_updates < 0:
        raise SDMAConfigError(f"set_sdma_updates: num_updates={num_updates!r} must be an integer >= 0 (the optimizer "
                              "updates done)")
    cores = [module for module in model.modules() if isinstance(module, SDMACore)]
    if not cores:
        raise SDMAConfigError(f"set_sdma_updates: {type(model).__name__} has no SDMA attention (call attach_sdma "
                              "first)")
    for core in cores:
        core.set_num_updates(num_updates)


def from_pretrained_with_sdma(model_class, path, **kwargs) -> nn.Module:
    """Reload a model that ``save_pretrained`` wrote after :func:`attach_sdma`: ``model_class.from_pretrained(path,
    **kwargs)`` loads the pretrained weights, SDMA is attached again with the options the config records
    (``config.sdma``) and the cores' parameters are read from the same weight files (safetensors, or a
    ``pytorch_model*.bin`` through torch's safe loader)."""
    directory = Path(path)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its report would list the cores' weights as unexpected keys
    register_sdma_attention()
    try:
        model = model_class.from_pretrained(path, **kwargs)
    finally:
        transformers_logging.set_verbosity(verbosity)
    options = dict(getattr(model.config, "sdma", None) or {})
    if not options:
        raise SDMAConfigError(f"{path}: its config has no 'sdma' entry (not saved after attach_sdma); "
                              "load it with from_pretrained and call attach_sdma")
    decoder = options.pop("decoder_mask_at_inference", False)
    attach_sdma(model, decoder_mask_at_inference=decoder, **options)
    saved = {}
    for file in sorted(directory.glob("*.safetensors")):  # only the cores' tensors: from_pretrained read the rest
        with safe_open(str(file), framework="pt") as weights:
            saved.update({k: weights.get_tensor(k) for k in weights.keys() if ".sdma." in f".{k}"})
    for file in sorted(directory.glob("pytorch_model*.bin")):
        saved.update({k: v for k, v in torch.load(file, map_location="cpu", weights_only=True).items()
                      if ".sdma." in f".{k}"})
    loaded = {}
    for name in (name for name in model.state_dict() if ".sdma." in f".{name}"):
        # save_pretrained of a head model keeps the base model's prefix ("transformer.", "bert."), a base model none
        match = name if name in saved else next((key for key in saved if key.endswith("." + name)
                                                 or name.endswith("." + key)), None)
        if match is None:
            raise SDMAConfigError(f"{path}: the weights have no {name} (the SDMA parameters were not saved)")
        loaded[name] = saved[match]
    model.load_state_dict(loaded, strict=False)
    return model
