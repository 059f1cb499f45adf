"""Named profiler ranges around the steps of a model that a launch count attributes its kernels to
(:func:`benchmarks.op_counts.count_launches` with ``by_source``). They cost one flag check when no profiler runs."""

import contextlib
import functools
from typing import Callable

import torch

PREFIX = "source::"
HOST_PREFIX = "host::"


def profiler_range(label: str):
    """``torch.profiler.record_function(label)`` while a profiler runs, nothing otherwise."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(label)
    return contextlib.nullcontext()


def source_range(name: str):
    """A profiler range ``source::<name>`` while a profiler runs (nothing otherwise): the kernels launched inside it,
    and in backward those of the autograd nodes it created, count as ``name``'s."""
    return profiler_range(PREFIX + name)


def host_range(name: str):
    """A profiler range ``host::<name>`` around work that stays on the host on a GPU too (a Philox seed drawn from
    torch's CPU generator): a launch count skips what runs inside it."""
    return profiler_range(HOST_PREFIX + name)


def sourced(name: str) -> Callable:
    """Decorate a function so that what it launches counts as ``name``'s (:func:`source_range` around each call)."""

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def in_range(*args, **kwargs):
            with source_range(name):
                return function(*args, **kwargs)

        return in_range

    return decorate
