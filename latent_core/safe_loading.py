"""Let torch's safe loader (``weights_only=True``, the default since torch 2.6) read
fairseq checkpoints written with this plugin, without switching it off.

A fairseq checkpoint is a dict of tensors, numbers and strings plus a handful of
non-tensor types: the legacy ``argparse.Namespace`` holding a legacy model's
arguments (``cfg["model"]``) and the numpy scalars/dtypes that fairseq's meters
store in ``extra_state["metrics"]`` (BLEU counts). Exactly these are allow-listed here; any other
global in a pickle (for example ``os.system`` via ``__reduce__``) is still refused
by torch with an ``UnpicklingError``.

:func:`model_config` reads a loaded checkpoint's model configuration, wherever fairseq put it.
"""

import argparse

import numpy as np
import torch


def checkpoint_types():
    """The globals a fairseq checkpoint of this plugin may reference.

    Found with ``torch.serialization.get_unsafe_globals_in_checkpoint`` on checkpoints
    of ``fairseq-train`` (legacy architectures store ``argparse.Namespace``; with
    ``--eval-bleu`` the BLEU meters store numpy arrays).
    """
    from numpy._core.multiarray import _reconstruct, scalar

    types = [argparse.Namespace, np.ndarray, np.dtype, _reconstruct, scalar]
    # numpy >= 1.25 may pickle a dtype through its concrete class (np.dtypes.Int64DType, ...)
    for name in ("Float64DType", "Float32DType", "Float16DType", "Int64DType", "Int32DType",
                 "UInt8DType", "BoolDType"):
        types.append(getattr(np.dtypes, name))
    return types


def register_checkpoint_types() -> None:
    """Allow-list :func:`checkpoint_types` for ``torch.load(weights_only=True)``."""
    torch.serialization.add_safe_globals(checkpoint_types())


def model_config(state: dict):
    """The model configuration of a checkpoint loaded with ``load_checkpoint_to_cpu``:
    ``cfg["model"]`` (an ``argparse.Namespace`` for legacy architectures, else a DictConfig),
    or the pre-hydra ``args``; None when the checkpoint has neither."""
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("model") is not None:
        return cfg["model"]
    return state.get("args")
