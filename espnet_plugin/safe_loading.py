"""Read ESPnet model files with torch's safe loader on every path the plugin provides.

ESPnet 202511 calls ``torch.load(..., weights_only=False)`` in ``build_model_from_file``
(``Speech2Text``, ``asr_inference``), ``Trainer.resume`` (``--resume``),
``load_pretrained_model`` (``--init_param``) and ``average_nbest_models``: a model file's
pickle can run arbitrary code there. The plugin's entry points (``espnet_plugin.bin.*``, the
``asr.sh`` shim, ``SDMAASRTask.main_worker`` in every spawned worker, the redundancy script)
run ESPnet inside :func:`weights_only_loading`, which makes every ``torch.load`` of the
process read with ``weights_only=True`` for its duration, whatever the caller asked for.
ESPnet looks ``torch.load`` up at call time, so this covers its paths without a fork;
the original function is restored on exit. There is no opt-out.

ESPnet files need a few non-tensor globals beyond torch's own allow-list, found with
``torch.serialization.get_unsafe_globals_in_checkpoint`` on real files written by
``espnet_plugin.bin.asr_train``: ``checkpoint.pth`` (resume state) holds numpy scalars and
dtypes in the reporter's statistics and a ``datetime.timedelta`` (the reporter's elapsed
time); ``{N}epoch.pth``, ``valid.*.best.pth`` and averaged models are plain state dicts.
Exactly these are allow-listed; anything else in a pickle (``os.system`` via
``__reduce__``, ...) is refused with :class:`UnsafeModelFileError`.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import pickle
import threading
from typing import Iterator, List

import torch

from latent_core.safe_loading import checkpoint_types

_ORIGINAL_TORCH_LOAD = torch.load
_depth = 0
_lock = threading.Lock()


class UnsafeModelFileError(pickle.UnpicklingError):
    """A model file references a Python global that ESPnet checkpoints never contain."""


def espnet_checkpoint_types() -> List[type]:
    """The non-tensor globals that ESPnet checkpoints and model files of this plugin contain."""
    return checkpoint_types() + [datetime.timedelta]


def register_checkpoint_types() -> None:
    """Allow-list :func:`espnet_checkpoint_types` for ``torch.load(weights_only=True)``."""
    torch.serialization.add_safe_globals(espnet_checkpoint_types())


def _describe(f) -> str:
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)
    return getattr(f, "name", repr(f))


def _unsafe_globals(f) -> List[str]:
    if not isinstance(f, (str, os.PathLike)):
        return []
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception:  # not a zip checkpoint: torch's own message says enough
        return []


@functools.wraps(_ORIGINAL_TORCH_LOAD)
def safe_torch_load(f, map_location=None, pickle_module=None, *, weights_only=None, **kwargs):
    """``torch.load`` with ``weights_only=True`` forced; the caller's ``weights_only`` is ignored."""
    del weights_only
    try:
        return _ORIGINAL_TORCH_LOAD(f, map_location=map_location, pickle_module=pickle_module,
                                    weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        allowed = espnet_checkpoint_types()
        allowed_names = {f"{t.__module__}.{t.__qualname__}" for t in allowed}
        unsafe = [name for name in _unsafe_globals(f) if name not in allowed_names]
        found = f" it references {', '.join(unsafe)}," if unsafe else ""
        raise UnsafeModelFileError(
            f"refused to load {_describe(f)}:{found} which an ESPnet model file or checkpoint never "
            f"contains (allowed besides tensors: {', '.join(sorted(t.__qualname__ for t in allowed))}). Loading it "
            f"could run code from the file: if you wrote it yourself, re-save it as a plain state dict "
            f"(torch.save(model.state_dict(), path)); otherwise do not use it."
        ) from error


@contextlib.contextmanager
def weights_only_loading() -> Iterator[None]:
    """Within the block, every ``torch.load`` in this process reads with ``weights_only=True``.

    Re-entrant; the original ``torch.load`` is back once the outermost block exits.
    """
    global _depth
    register_checkpoint_types()
    with _lock:
        if _depth == 0:
            torch.load = safe_torch_load
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.load = _ORIGINAL_TORCH_LOAD
