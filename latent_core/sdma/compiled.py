"""The compiled path (``SDMAOptions.compile``): the clustering, the mixing and the regulariser terms
through ``torch.compile`` (inductor), so that the many small operations around SDMA's attention run as a
few fused kernels instead of one kernel launch each.

Two functions are compiled, once each for every process (not once per module): the training forward of
an adapter's attention module (the clustering of eq. 9, the query clustering of eq. 16-18, eq. 10's mask
and the mixing of eq. 11, with the module's projections) and the regulariser terms of one attention type
(:func:`latent_core.sdma.regularisers.group_terms`, eq. 20-23). Both are compiled with dynamic shapes
(a new sentence length does not recompile) and as one graph each (``fullgraph``: a graph break is an
error, not a silent slowdown). What they cannot trace stays outside: the :func:`recording` scope (a
context variable) is read before the call and written after it, and the sampling noise of eq. (8) is
drawn inside (inductor's generator: the same distribution as eager, not the same numbers; set
``torch._inductor.config.fallback_random = True`` for eager's numbers, as the tests do).

The compile time is logged once when the next training forward begins (its :func:`recording` scope),
in seconds, and :func:`compile_seconds` returns it.
"""

import logging
import time
from typing import Callable, Dict

import torch

logger = logging.getLogger(__name__)

_COMPILED: Dict[Callable, Callable] = {}
_SECONDS = {"total": 0.0, "reported": 0.0, "graphs": 0, "reported_graphs": 0}
_STARTED: Dict[object, float] = {}


def compiled(fn: Callable) -> Callable:
    """``fn`` through ``torch.compile(fn, dynamic=True, fullgraph=True)`` (inductor), built once per function:
    every module that calls it shares its compiled graphs (dynamo keys them on the code and guards on what
    differs: the module's flags, the options, grad mode)."""
    if fn not in _COMPILED:
        _watch_compile_time()
        _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _COMPILED[fn]


def contiguous_inputs(*tensors):
    """The tensors (or None) as contiguous tensors that are not views, for a compiled call; those that were one
    tensor stay one. Dynamo guards on strides, on a view's base and on aliasing, so a transposed input
    (fairseq's first layer), a slice of a cached buffer (fairseq's future mask, a view of its own buffer when
    the lengths match and a copy's when they do not) or self-attention's ``key is query`` changing between
    calls would compile another graph."""
    made = []
    for tensor in tensors:
        same = next((new for old, new in zip(tensors, made) if old is tensor), None)
        if same is None and tensor is not None:
            same = tensor.clone(memory_format=torch.contiguous_format) if tensor._base is not None else tensor.contiguous()
        made.append(same)
    return made


def compile_seconds() -> float:
    """Seconds spent compiling (dynamo and inductor, forward graphs and their lazily compiled backward
    graphs) in this process since the first compiled function was built."""
    return _SECONDS["total"]


def log_new_compile_time() -> None:
    """Log the compile time spent since the last report, if any (called as a training forward begins)."""
    new = _SECONDS["total"] - _SECONDS["reported"]
    if new <= 0:
        return
    graphs = _SECONDS["graphs"] - _SECONDS["reported_graphs"]
    _SECONDS["reported"], _SECONDS["reported_graphs"] = _SECONDS["total"], _SECONDS["graphs"]
    logger.info("SDMA compiled path (torch.compile): %d compilation(s) (forward graphs and their backward) in %.1f s "
                "(%.1f s in this process)", graphs, new, _SECONDS["total"])


def _on_start(args) -> None:
    _STARTED[(args.callback_trigger, args.compile_id)] = time.perf_counter()


def _on_end(args) -> None:
    started = _STARTED.pop((args.callback_trigger, args.compile_id), None)
    if started is not None:
        _SECONDS["total"] += time.perf_counter() - started
        _SECONDS["graphs"] += 1


def _watch_compile_time() -> None:
    """Time every compilation (dynamo's callbacks run around each, the lazy backward ones included)."""
    if _COMPILED:
        return
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(_on_start)
    callback_handler.register_end_callback(_on_end)
