"""What one forward pass records for the regularisers: the clustering of every SDMA attention called
inside a :func:`recording` scope, and the decoder's real query positions (:func:`real_queries`); and
:func:`tie_to_output`, which keeps the records' parameters visible to distributed training's search for unused
parameters."""

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor


@dataclass
class ClusteringRecord:
    """One SDMA attention's clustering in one forward pass: the input of its regularisers.

    ``log_joint_*`` / ``log_resp_*``: log p(z, c) and log p(c | z), ``[T, B, n_h, C]`` (``_k``: the
    keys of a cross-attention, ``[S, B, n_h, C]``, which the authors' reading regularises too);
    ``valid`` ``[T, B]``: 1 at real (non-padding) query positions; ``log_vars``: learned posterior
    log-variances per position and head (``{"z": [T, B, n_h], "q": ..., "k": [S, B, n_h]}``, the
    authors' ESPnet ``var_estimation``) replacing sigma_tilde^2; ``gmm_parameters``: the GMMs' log-variances and
    prior logits as this pass's clustering read them (``{"z": (log_vars, prior_logits), "q": ...}``: the Triton
    kernel's views, whose gradients return through it), else the modules' own.
    """

    log_joint_z: Tensor
    log_resp_z: Tensor
    valid: Tensor
    log_joint_q: Optional[Tensor] = None
    log_resp_q: Optional[Tensor] = None
    log_joint_k: Optional[Tensor] = None
    log_resp_k: Optional[Tensor] = None
    log_vars: Dict[str, Tensor] = field(default_factory=dict)
    gmm_parameters: Dict[str, Tuple[Tensor, Tensor]] = field(default_factory=dict)

    def layout(self) -> Tuple:
        """The shapes that decide which records can be stacked into one batched computation."""
        return tuple(None if t is None else tuple(t.shape) for t in (self.log_joint_z, self.log_joint_q,
                                                                      self.log_joint_k))


class _TiedToOutput(torch.autograd.Function):
    """``output`` unchanged, with ``records`` among its inputs and no gradient sent to them."""

    @staticmethod
    def forward(ctx, output: Tensor, *records: Tensor) -> Tensor:
        ctx.count = len(records)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (grad,) + (None,) * ctx.count


def tie_to_output(output: Tensor, *records: Optional[Tensor]) -> Tensor:
    """``output`` (an attention's), unchanged, tied in the autograd graph to the ``records`` of the same call.

    Why: the query GMM of eq. (18) reaches the loss only through the regularisers, computed from the records
    after the forward. DistributedDataParallel with ``find_unused_parameters=True`` (transformers' Trainer's
    default) walks the graph from the forward's outputs, counts such parameters unused and marks them ready at
    once; their gradient, arriving later through the regularisers, is then "marked as ready twice". Tied here
    they count as used; their one gradient still comes through the regularisers (none flows back through the tie).
    Without autograd (or records that need no gradient) ``output`` itself.
    """
    needed = [t for t in records if t is not None and t.requires_grad]
    if not needed or not torch.is_grad_enabled():
        return output
    return _TiedToOutput.apply(output, *needed)


class SDMARecording:
    """The :class:`ClusteringRecord` of every SDMA attention called inside one :func:`recording`
    scope (the latest call of each core wins)."""

    def __init__(self):
        self._records: Dict[nn.Module, ClusteringRecord] = {}
        self._all_real: Dict[Tuple, Tensor] = {}

    def all_real(self, rows: int, batch: int, device: torch.device) -> Tensor:
        """``[rows, batch]`` float32 ones (every query real), one tensor per shape for the whole forward pass:
        the layers of a batch without padding share it (one fill, not one per layer)."""
        key = (rows, batch, device)
        if key not in self._all_real:
            self._all_real[key] = torch.ones(rows, batch, dtype=torch.float32, device=device)
        return self._all_real[key]

    def add(self, core: nn.Module, record: ClusteringRecord) -> None:
        self._records[core] = record

    def get(self, core: nn.Module) -> Optional[ClusteringRecord]:
        return self._records.get(core)

    def __len__(self) -> int:
        return len(self._records)


_RECORDING: contextvars.ContextVar[Optional[SDMARecording]] = contextvars.ContextVar("sdma_recording", default=None)
_REAL_QUERIES: contextvars.ContextVar[Optional[Tensor]] = contextvars.ContextVar("sdma_real_queries", default=None)


@contextlib.contextmanager
def recording() -> Iterator[SDMARecording]:
    """Record the clustering of the SDMA attentions called inside, for the regularisers::

        with recording() as records:
            output = model(batch)
        terms = collect_sdma_losses(model, records)

    Outside such a scope (decoding, analysis) nothing is recorded.
    """
    records = SDMARecording()
    token = _RECORDING.set(records)
    try:
        yield records
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def real_queries(valid: Optional[Tensor]) -> Iterator[None]:
    """The decoder's real (non-padding) positions, ``[B, T]`` bool, for the attentions called inside.

    A cross-attention receives only the padding of its keys; its regularisers average over the
    queries, so the decoder layer (or a fused attention) states which queries are real around the
    call. ``None``: every position is real.
    """
    token = _REAL_QUERIES.set(valid)
    try:
        yield
    finally:
        _REAL_QUERIES.reset(token)


def active_recording() -> Optional[SDMARecording]:
    """The innermost open :func:`recording` scope's records, or None (decoding, analysis)."""
    return _RECORDING.get()


def all_real_queries(rows: int, batch: int, device: torch.device) -> Tensor:
    """``[rows, batch]`` float32 ones: the active :func:`recording`'s shared tensor (:meth:`SDMARecording.all_real`),
    or a new one outside a scope."""
    records = _RECORDING.get()
    if records is None:
        return torch.ones(rows, batch, dtype=torch.float32, device=device)
    return records.all_real(rows, batch, device)


def current_real_queries() -> Optional[Tensor]:
    """What the innermost :func:`real_queries` scope set (``[B, T]`` bool), or None."""
    return _REAL_QUERIES.get()
