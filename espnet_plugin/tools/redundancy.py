"""Layer redundancy (LR) and head redundancy (HR) of an ESPnet2 attention-based ASR model.

The ESPnet2 counterpart of ``sdma-redundancy`` (fairseq, ``user_dir.tools.sdma.redundancy``): same
metrics (SDMA paper, Sec. IV-A2, Table VII), same math (``latent_core.redundancy``'s
``RedundancyAccumulator`` is imported, not re-implemented), same result
structure, table and output options (``--json``, ``--hr-matrix``, ``--heatmap``).
Read ``latent_core.redundancy``'s docstring for how the formulas are interpreted.

* LR and HR are computed separately for the encoder self-attention
  (``encoder_self``, ``model.encoder.encoders[i].self_attn``), the decoder
  self-attention (``decoder_self``, ``model.decoder.decoders[i].self_attn``) and
  the encoder-decoder attention (``decoder_cross``, ``model.decoder.decoders[i].src_attn``).
* Every attention must be an ESPnet ``MultiHeadedAttention`` (or a subclass, e.g.
  the SDMA plugin's attention or conformer's relative-position attention): its
  ``.attn`` holds the probabilities of its last forward, ``(B, n_head, T_query,
  T_key)``, read by a forward hook right after each call.  ``use_sdpa`` and
  ``use_flash_attn`` are switched off during the measurement (those paths do
  not compute ``.attn``) and restored afterwards.
* Teacher forcing on the reference transcript, as in training: ``model.encode``
  on the waveforms, then the decoder on ``ys_in = <sos> y_1 .. y_m`` (ESPnet's
  ``add_sos_eos``), with ``model.eval()``.  The transcript is cleaned, tokenised
  and mapped to ids the way ESPnet's ``CommonPreprocessor`` does, from the train
  config's ``cleaner``, ``token_type``, ``bpemodel``, ``non_linguistic_symbols``,
  ``g2p`` and ``token_list`` (unknown tokens become ``<unk>``).
* Rows i: encoder self = the real (unpadded) encoder frames; decoder self and
  cross = the real decoder inputs.  Keys: encoder frames (self, cross) or
  decoder inputs (decoder self, causal zeros included).  Per-utterance LR / HR
  are averaged over utterances with equal weight (key ``sentences`` of the
  result, as in ``sdma-redundancy``).
* Batching is not neutral in ESPnet (unlike fairseq): a waveform padded in a
  batch gets slightly different features at its end (STFT frames over the
  padding) and, with ``conv2d`` subsampling, often one more encoder frame (the
  subsampled mask counts a frame whose receptive field reaches into the
  padding), which every other frame then attends to.  With peaked attention
  this moves LR / HR by a few hundredths.  Utterances are batched in order of
  length to keep padding small; ``batch_size=1`` gives batch-independent
  numbers, those of ESPnet's (unbatched) ``asr_inference``.

Data: a Kaldi-style directory with ``wav.scp`` (``uttid /path/to.wav``, plain
sound files readable by soundfile at the frontend's sampling rate; relative
paths are relative to the working directory) and ``text`` (``uttid transcript``).
The utterances of ``text`` are evaluated in its order (the first N with
``--max-utterances``). Both files (and ``utt2spk`` when present) are read by
``pipelines.kaldi_data`` (ESPnet's parsing, errors naming ``file:line``) and
must hold the same utterance ids.

Usage::

    sdma-espnet-redundancy --asr-train-config exp/asr/config.yaml \
        --asr-model-file exp/asr/valid.acc.ave.pth --data-dir data/test \
        [--max-utterances N] [--batch-size 1] [--json OUT.json] [--device cpu] \
        [--hr-matrix] [--heatmap OUT.png [--heatmap-kind encoder_self|decoder_self|decoder_cross|all]]

``LR`` is on the paper's [0, 1] scale (``LR_bits``: the printed formula, in bits);
the paper's Table VII values are encoder self-attention numbers (see
``latent_core.redundancy``'s docstring and the JSON's ``notes``).
``python -m espnet_plugin.tools.redundancy`` is the same command.

Python::

    from espnet_plugin.tools.redundancy import espnet_attention_redundancy
    result = espnet_attention_redundancy("config.yaml", "model.pth", "data/test")
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from latent_core.errors import command_error
from latent_core.redundancy import (
    ATTENTION_TYPES,
    RedundancyAccumulator,
    RedundancyError,
)
from latent_core.redundancy_plot import add_output_arguments, write_outputs

# attribute of each decoder layer that holds the attention of each decoder type
_DECODER_ATTRIBUTES = {"decoder_self": "self_attn", "decoder_cross": "src_attn"}


@dataclass(frozen=True)
class Utterance:
    """One utterance of a data directory."""

    uttid: str
    wav: str
    text: str


# ----------------------------------------------------------------------------
# Data directory
# ----------------------------------------------------------------------------


def read_data_dir(data_dir: str, max_utterances: Optional[int] = None) -> List[Utterance]:
    """The (first ``max_utterances``) utterances of ``data_dir/text``, with their ``wav.scp`` entries."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"data directory not found: {root}")
    wav_scp, text = root / "wav.scp", root / "text"
    for path in (wav_scp, text):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (a Kaldi data directory needs wav.scp and text)")
    from pipelines.kaldi_data import KaldiDataDirError, read_data_dir as read_kaldi_data_dir

    try:  # the plugin's reader: ESPnet's parsing, file:line errors, the same ids in every file
        kaldi = read_kaldi_data_dir(root)
    except KaldiDataDirError as error:
        raise RedundancyError(str(error)) from error
    uttids = kaldi.uttids[:max_utterances]
    if not uttids:
        raise RedundancyError(f"no utterances to evaluate in {text} (max_utterances={max_utterances})")
    return [Utterance(uttid, kaldi.wav_scp[uttid], kaldi.text[uttid]) for uttid in uttids]


def wav_length(utt: Utterance, sample_rate: int, wav_scp: Path) -> int:
    """Number of samples of ``utt``'s sound file, after checking it exists and its sampling rate."""
    import soundfile

    if not os.path.isfile(utt.wav):
        raise FileNotFoundError(f"{wav_scp}: sound file of utterance {utt.uttid} not found: {utt.wav} "
                                "(only plain file paths are supported, no pipes or ark entries)")
    info = soundfile.info(utt.wav)
    if info.samplerate != sample_rate:
        raise RedundancyError(f"{utt.wav} (utterance {utt.uttid}) is sampled at {info.samplerate} Hz, "
                              f"the model's frontend expects {sample_rate} Hz")
    return info.frames


def read_wav(utt: Utterance) -> np.ndarray:
    """The waveform of ``utt``, float32 ``(n_samples,)`` (or ``(n_samples, channels)``)."""
    import soundfile

    return soundfile.read(utt.wav, dtype="float32")[0]


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> Iterator[List[int]]:
    """Indices in order of increasing length, ``batch_size`` at a time."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    for start in range(0, len(order), batch_size):
        yield order[start:start + batch_size]


# ----------------------------------------------------------------------------
# Model, tokenizer, attention modules
# ----------------------------------------------------------------------------


def load_asr_model(asr_train_config: str, asr_model_file: str, device: str):
    """``(model, train_args)`` of a trained ESPnet2 ASR model, in eval mode."""
    for path in (asr_train_config, asr_model_file):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"file not found: {path}")
    from espnet_plugin.tasks.sdma_asr import build_asr_model_from_file  # registers the SDMA classes

    model, train_args = build_asr_model_from_file(asr_train_config, asr_model_file, device)
    model.eval()
    return model, train_args


def frontend_sample_rate(model, train_args) -> int:
    """The sampling rate the model's frontend expects (``frontend_conf.fs``, default 16 kHz)."""
    import humanfriendly

    if model.frontend is None:
        raise RedundancyError("the model has no frontend (it takes precomputed features): "
                              "waveforms from wav.scp cannot be fed to it")
    fs = (getattr(train_args, "frontend_conf", None) or {}).get("fs", 16000)
    return humanfriendly.parse_size(fs) if isinstance(fs, str) else int(fs)


def build_text_encoder(train_args, asr_train_config: str) -> Callable[[str], List[int]]:
    """transcript -> token ids, as ESPnet's ``CommonPreprocessor`` does in training."""
    from espnet2.text.build_tokenizer import build_tokenizer
    from espnet2.text.cleaner import TextCleaner
    from espnet2.text.token_id_converter import TokenIDConverter

    token_type = getattr(train_args, "token_type", None)
    if token_type is None:
        raise RedundancyError(f"{asr_train_config} has no token_type: cannot tokenise the transcripts")
    bpemodel = getattr(train_args, "bpemodel", None)
    if token_type == "bpe" and (bpemodel is None or not os.path.isfile(bpemodel)):
        raise FileNotFoundError(f"bpemodel of {asr_train_config} not found: {bpemodel}")
    cleaner = TextCleaner(getattr(train_args, "cleaner", None))
    tokenizer = build_tokenizer(
        token_type=token_type,
        bpemodel=bpemodel,
        non_linguistic_symbols=getattr(train_args, "non_linguistic_symbols", None),
        g2p_type=getattr(train_args, "g2p", None),
    )
    converter = TokenIDConverter(token_list=train_args.token_list)
    return lambda text: converter.tokens2ids(tokenizer.text2tokens(cleaner(text)))


def attention_modules(model) -> Dict[str, List[Tuple[str, torch.nn.Module]]]:
    """``{type: [(module path, MultiHeadedAttention), ...]}`` of an ESPnet2 ASR model, layer order."""
    from espnet.nets.pytorch_backend.transformer.attention import MultiHeadedAttention

    encoder_layers = getattr(getattr(model, "encoder", None), "encoders", None)
    decoder_layers = getattr(getattr(model, "decoder", None), "decoders", None)
    if encoder_layers is None:
        raise RedundancyError(f"model.encoder ({type(getattr(model, 'encoder', None)).__name__}) has no "
                              "attention layers model.encoder.encoders")
    if decoder_layers is None:
        raise RedundancyError(f"model.decoder ({type(getattr(model, 'decoder', None)).__name__}) is not a "
                              "transformer decoder with layers model.decoder.decoders")
    if len(encoder_layers) == 0 or len(decoder_layers) == 0:
        raise RedundancyError("the model has no encoder or no decoder layers")
    located = {"encoder_self": [(f"model.encoder.encoders[{i}].self_attn", layer, "self_attn")
                                for i, layer in enumerate(encoder_layers)]}
    for kind, attribute in _DECODER_ATTRIBUTES.items():
        located[kind] = [(f"model.decoder.decoders[{i}].{attribute}", layer, attribute)
                         for i, layer in enumerate(decoder_layers)]
    modules = {}
    for kind, entries in located.items():
        modules[kind] = []
        for path, layer, attribute in entries:
            module = getattr(layer, attribute, None)
            if not isinstance(module, MultiHeadedAttention):
                found = "missing" if module is None else type(module).__name__
                raise RedundancyError(f"{path} is {found}, not an ESPnet MultiHeadedAttention: "
                                      "cannot read its per-head attention probabilities")
            modules[kind].append((path, module))
    return modules


# ----------------------------------------------------------------------------
# Capturing the attention
# ----------------------------------------------------------------------------


def _clear_attn(module, args):
    """forward pre-hook: forget the previous call's ``.attn`` (a stale value must not be read)."""
    module.attn = None


def softmax_attention(module, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor]) -> Tensor:
    """ESPnet ``MultiHeadedAttention``'s probabilities ``(B, n_head, T, S)`` as its explicit path computes them
    (``forward_qkv``, then the masked softmax of ``forward_attention``): for a call that took a fast path
    (``use_sdpa``, ``use_flash_attn``), which keeps no ``.attn``."""
    q, k, _ = module.forward_qkv(query, key, value)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(module.d_k)
    if mask is None:
        return torch.softmax(scores, dim=-1)
    blocked = mask.unsqueeze(1).eq(0)  # (B, 1, *, S)
    scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1).masked_fill(blocked, 0.0)


def _record(store: List[Optional[Tensor]], index: int, path: str, module, args, kwargs, output):
    """forward hook: store the call's probabilities ``(B, n_head, T, S)`` as ``(n_head, B, T, S)``: ESPnet's
    ``.attn`` (what its explicit path and the SDMA attention keep), else recomputed from the call's inputs."""
    from espnet.nets.pytorch_backend.transformer.attention import MultiHeadedAttention

    attn = module.attn
    if attn is None and type(module).forward is MultiHeadedAttention.forward:
        call = inspect.signature(MultiHeadedAttention.forward).bind(module, *args, **kwargs).arguments
        with torch.no_grad():
            attn = softmax_attention(module, call["query"], call["key"], call["value"], call["mask"])
    if attn is None or attn.dim() != 4 or attn.size(1) != module.h:
        shape = None if attn is None else tuple(attn.shape)
        raise RedundancyError(f"{path}: expected attention probabilities (B, {module.h}, T, S) in .attn "
                              f"after its forward, got {shape}")
    store[index] = attn.detach().float().transpose(0, 1)


@contextlib.contextmanager
def capture_attention(modules: Dict[str, List[Tuple[str, torch.nn.Module]]]) -> Iterator[Dict[str, list]]:
    """Record each attention type's per-head probabilities during forward passes.

    Yields ``{type: [layer 0, layer 1, ...]}``, each entry ``(n_head, B, T, S)`` from
    the latest forward of that module: ESPnet's ``.attn`` (cleared before each call, so that a stale
    value is never read), or, after a fast path that keeps none (``use_sdpa``, ``use_flash_attn``),
    :func:`softmax_attention` of the call's inputs. Nothing in the model is switched.
    """
    store = {kind: [None] * len(entries) for kind, entries in modules.items()}
    handles = []
    try:
        for kind, entries in modules.items():
            for index, (path, module) in enumerate(entries):
                handles.append(module.register_forward_pre_hook(_clear_attn))
                handles.append(module.register_forward_hook(functools.partial(_record, store[kind], index, path),
                                                            with_kwargs=True))
        yield store
    finally:
        for handle in handles:
            handle.remove()


def teacher_forced_forward(model, wavs: List[np.ndarray], token_ids: List[List[int]],
                           device) -> Dict[str, Tuple[Tensor, Tensor]]:
    """Encoder and decoder forward of one batch; returns each type's ``(query mask, key mask)``.

    ``wavs``: B waveforms ``(n_samples,)``; ``token_ids``: their transcripts.  Masks are
    bool, True = real position: encoder ``(B, T_enc)``, decoder ``(B, T_dec)`` with
    ``T_dec = 1 + max transcript length`` (``<sos>`` prepended).
    """
    from espnet.nets.pytorch_backend.nets_utils import pad_list
    from espnet.nets.pytorch_backend.transformer.add_sos_eos import add_sos_eos

    speech = pad_list([torch.from_numpy(w) for w in wavs], 0.0).to(device)
    speech_lengths = torch.tensor([len(w) for w in wavs], device=device)
    encoder_out, encoder_lens = model.encode(speech, speech_lengths)
    if isinstance(encoder_out, tuple):  # (output, intermediate outputs) with interctc
        encoder_out = encoder_out[0]

    ys = [torch.tensor(ids, dtype=torch.long) for ids in token_ids]
    ys_pad = pad_list(ys, model.ignore_id).to(device)
    ys_lens = torch.tensor([len(y) for y in ys], device=device)
    if getattr(model, "lang_token_id", None) is not None:  # as ESPnetASRModel._calc_att_loss
        ys_pad = torch.cat([model.lang_token_id.repeat(ys_pad.size(0), 1).to(device), ys_pad], dim=1)
        ys_lens = ys_lens + 1
    ys_in_pad, _ = add_sos_eos(ys_pad, model.sos, model.eos, model.ignore_id)
    ys_in_lens = ys_lens + 1
    model.decoder(encoder_out, encoder_lens, ys_in_pad, ys_in_lens)

    encoder_valid = torch.arange(encoder_out.size(1), device=device)[None, :] < encoder_lens[:, None]
    decoder_valid = torch.arange(ys_in_pad.size(1), device=device)[None, :] < ys_in_lens[:, None]
    return {
        "encoder_self": (encoder_valid, encoder_valid),
        "decoder_self": (decoder_valid, decoder_valid),
        "decoder_cross": (decoder_valid, encoder_valid),
    }


# ----------------------------------------------------------------------------
# Accumulation over batches
# ----------------------------------------------------------------------------


def stack_layers(kind: str, layers: List[Optional[Tensor]]) -> Tensor:
    """``(N, n_head, B, T, S)`` from the per-layer captures ``(n_head, B, T, S)``, which are then cleared."""
    if any(layer is None for layer in layers):
        raise RedundancyError(f"{kind}: not every layer's attention was called in the forward pass")
    attn = torch.stack(layers)
    layers[:] = [None] * len(layers)
    return attn


def add_batch(accumulator: RedundancyAccumulator, store: Dict[str, List[Optional[Tensor]]],
              masks: Dict[str, Tuple[Tensor, Tensor]]) -> None:
    """Add one batch of every type: ``store[type]`` = per-layer ``(n_head, B, T, S)``,
    ``masks[type]`` = ``(query mask (B, T), key mask (B, S))``."""
    for kind in ATTENTION_TYPES:
        accumulator.add(kind, stack_layers(kind, store[kind]), *masks[kind])


# ----------------------------------------------------------------------------
# The measurement
# ----------------------------------------------------------------------------


def _forward_or_explain(model, wavs, token_ids, uttids, device):
    """:func:`teacher_forced_forward`, naming the utterances when one is too short for the encoder."""
    from espnet.nets.pytorch_backend.transformer.subsampling import TooShortUttError

    try:
        return teacher_forced_forward(model, wavs, token_ids, device)
    except TooShortUttError as error:
        raise RedundancyError(f"an utterance of {', '.join(uttids)} is too short for the encoder: {error}")


def espnet_attention_redundancy(asr_train_config: str, asr_model_file: str, data_dir: str,
                                max_utterances: Optional[int] = None, batch_size: int = 1,
                                device: str = "cpu", return_matrices: bool = False) -> dict:
    """LR and HR of each attention type of an ESPnet2 ASR model on a Kaldi data directory.

    Args:
        asr_train_config: the training ``config.yaml``.
        asr_model_file: the trained parameters (``*.pth``).
        data_dir: directory with ``wav.scp`` and ``text``.
        max_utterances: evaluate the first N utterances of ``text`` (all by default).
        batch_size: utterances per forward pass.
        device: torch device, e.g. ``cpu`` or ``cuda``.
        return_matrices: also return each type's head-pair ``HR_matrix`` (Figs. 10-11).
    Returns:
        the structure of ``attention_redundancy()`` (n utterances under ``sentences``):
        ``{"encoder_self": {"LR" ([0, 1], the paper's scale; None for one head), "LR_bits",
        "HR", "layers", "heads"}, "decoder_self": {..}, "decoder_cross": {..}, "sentences": n,
        "LR_scale", "HR_scale", "compare_with_paper", "notes"}``.
    """
    if batch_size < 1:
        raise RedundancyError(f"batch_size={batch_size} must be >= 1")
    if max_utterances is not None and max_utterances < 1:
        raise RedundancyError(f"max_utterances={max_utterances} must be >= 1")
    utterances = read_data_dir(data_dir, max_utterances)
    model, train_args = load_asr_model(asr_train_config, asr_model_file, device)
    modules = attention_modules(model)
    sample_rate = frontend_sample_rate(model, train_args)
    encode_text = build_text_encoder(train_args, asr_train_config)

    wav_scp = Path(data_dir) / "wav.scp"
    lengths = [wav_length(utt, sample_rate, wav_scp) for utt in utterances]
    token_ids = [encode_text(utt.text) for utt in utterances]
    accumulator = RedundancyAccumulator(return_matrices)
    with torch.no_grad(), capture_attention(modules) as store:
        for batch in length_sorted_batches(lengths, batch_size):
            masks = _forward_or_explain(model, [read_wav(utterances[i]) for i in batch],
                                        [token_ids[i] for i in batch], [utterances[i].uttid for i in batch], device)
            add_batch(accumulator, store, masks)
    return accumulator.result()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Layer / head redundancy (LR, HR) of the encoder self-, decoder self- and "
                    "encoder-decoder attention of an ESPnet2 ASR model (SDMA paper, Sec. IV-A2).",
    )
    parser.add_argument("--asr-train-config", required=True, help="training config.yaml of the ASR model")
    parser.add_argument("--asr-model-file", required=True, help="trained model parameters (.pth)")
    parser.add_argument("--data-dir", required=True, help="Kaldi-style data directory with wav.scp and text")
    parser.add_argument("--max-utterances", type=int, default=None, help="evaluate only the first N utterances")
    parser.add_argument("--batch-size", type=int, default=1, help="utterances per forward pass (default: 1 = "
                        "no padding, batch-independent results, as ESPnet's asr_inference)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    add_output_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Command line (``sdma-espnet-redundancy``): 0, or 2 after one ``PROG: error: ...`` line."""
    args = parse_args(argv)
    prog = os.path.basename(sys.argv[0]) or "sdma-espnet-redundancy"
    try:
        result = espnet_attention_redundancy(
            args.asr_train_config, args.asr_model_file, args.data_dir, max_utterances=args.max_utterances,
            batch_size=args.batch_size, device=args.device, return_matrices=args.hr_matrix or bool(args.heatmap),
        )
        write_outputs(result, args, str(Path(Path(args.asr_model_file).parent.name, Path(args.asr_model_file).name)))
    except (FileNotFoundError, RedundancyError) as error:
        return command_error(prog, error)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
