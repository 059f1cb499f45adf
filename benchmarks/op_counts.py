"""What an update costs, counted by PyTorch: matrix-product FLOPs (``torch.utils.flop_counter``)
and the elementwise work beside them (ops and bytes, :class:`TrafficCounter`). Toolkit-free: any
callable is measured (``benchmarks.sdma.flops`` counts fairseq's SDMA models with it,
``benchmarks.optimus.speed`` Optimus against GPT-2).

Attention runs with PyTorch's math SDPA backend while counting, because ``FlopCounterMode`` has
no formula for the CPU flash-attention kernel and would otherwise miss its products.
"""

from contextlib import contextmanager
from typing import Callable, Dict, Tuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, bmm_flop, mm_flop


def _mm_flops(self_shape, a_shape, b_shape, *args, **kwargs) -> int:
    return mm_flop(a_shape, b_shape)


def _bmm_flops(self_shape, a_shape, b_shape, *args, **kwargs) -> int:
    return bmm_flop(a_shape, b_shape)


# FlopCounterMode's registry has the out-of-place products only; an in-place ``addmm_`` / ``baddbmm_``
# (accumulating a second product into the first's result, as the SDMA mixtures do) would go uncounted
_IN_PLACE_PRODUCTS = {torch.ops.aten.addmm_: _mm_flops, torch.ops.aten.baddbmm_: _bmm_flops}


@contextmanager
def _counting():
    """FlopCounterMode with the math SDPA backend (whose matmuls the counter sees), counting in-place products."""
    counter = FlopCounterMode(display=False, custom_mapping=_IN_PLACE_PRODUCTS)
    with sdpa_kernel(SDPBackend.MATH), counter:
        yield counter


def _by_op(counter: FlopCounterMode) -> Dict[str, int]:
    """FLOPs per ATen op (``mm``, ``bmm``...) of the whole counted region."""
    counts = counter.get_flop_counts().get("Global", {})
    return {str(op).removeprefix("aten."): int(v) for op, v in counts.items()}


def count_flops(fn: Callable[[], object]) -> Tuple[int, Dict[str, int], object]:
    """(total FLOPs, FLOPs per op, ``fn()``'s result) of running ``fn`` under the counter."""
    with _counting() as counter:
        result = fn()
    return int(counter.get_total_flops()), _by_op(counter), result


# ATen ops FlopCounterMode counts (matrix products); everything else that is not a view is
# "elementwise work" for :class:`TrafficCounter`
_MATMUL_OPS = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "addbmm", "matmul", "convolution", "_convolution",
               "convolution_backward", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward")


class TrafficCounter(TorchDispatchMode):
    """Counts the ATen ops that are neither matrix products nor views, and the bytes they touch.

    FlopCounterMode sees only matrix products; on a CPU the rest of an update (softmax, exp/log,
    masking, the sampling noise, layer norm, the optimizer's elementwise Adam step) is memory
    traffic and per-op overhead. Per op, the bytes are those of its distinct tensor inputs and
    outputs (an in-place op's tensor counted once); views (``transpose``, ``view``...) move no
    data and are skipped. ``ops`` / ``bytes`` are the elementwise (non-matmul) totals;
    ``matmul_ops`` the number of matrix products.
    """

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.bytes = 0
        self.matmul_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name in _MATMUL_OPS:
            self.matmul_ops += 1
        elif not func.is_view and name not in ("detach", "lift_fresh"):
            seen = set()
            # factories read only their argument's metadata (``new_ones``, ``zeros_like``...)
            read = () if name.startswith("new_") or name.endswith("_like") else (args, kwargs)
            for t in pytree.tree_leaves((read, out)):
                if isinstance(t, torch.Tensor) and t.numel() > 1:
                    key = (t.data_ptr(), t.numel(), t.dtype)
                    if key not in seen:
                        seen.add(key)
                        self.bytes += t.numel() * t.element_size()
            self.ops += 1
        return out


def count_traffic(fn: Callable[[], object]) -> Dict[str, int]:
    """``{"ops", "bytes", "matmul_ops"}`` of running ``fn`` (see :class:`TrafficCounter`); with
    the math SDPA backend, as :func:`count_flops`, so V-T's attention is split the same way."""
    counter = TrafficCounter()
    with sdpa_kernel(SDPBackend.MATH), counter:
        fn()
    return {"ops": counter.ops, "bytes": counter.bytes, "matmul_ops": counter.matmul_ops}


# ATen ops that launch no kernel: allocation and metadata (views are recognised by their schema)
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "resize_", "set_", "detach", "detach_", "lift_fresh",
              "alias", "_unsafe_view", "_reshape_alias", "as_strided", "is_nonzero", "item", "_local_scalar_dense",
              "record_stream", "resolve_conj", "resolve_neg"}


def _aten_op(name: str):
    """The overload packet of a profiler event ``aten::name``, or None."""
    return getattr(torch.ops.aten, name.removeprefix("aten::"), None)


def _decomposes(packet) -> bool:
    """Whether an ATen op is implemented by other ATen ops above the kernels (CompositeImplicitAutograd in every
    overload, e.g. ``matmul``, ``softmax``, ``to``; the profiler does not name the overload): it is counted
    through the ops it calls, as a dispatch-mode counter sees them."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    composite = []
    for overload in packet.overloads():
        try:
            composite.append(getattr(packet, overload).has_kernel_for_dispatch_key(key))
        except RuntimeError:  # an overload known to Python only (no dispatcher entry)
            continue
    return bool(composite) and all(composite)


def _launches_a_kernel(packet, op: str) -> bool:
    return op not in _NO_KERNEL and not any(getattr(packet, o).is_view for o in packet.overloads())


def count_launches(fn: Callable[[], object], by_source: bool = False) -> Dict:
    """Kernel launches of running ``fn`` once, from the profiler: ``{"aten", "inductor", "launches"}``.

    ``aten``: ATen ops that run a kernel, outside compiled graphs and inside them (inductor calls matrix products
    as extern ATen kernels): on each path of the profiler's call tree, the first op that is not a composite of
    other ATen ops, unless it is a view, allocation or metadata op (what :class:`TrafficCounter` counts, without
    its dispatch mode, under which ``torch.compile``'d functions would run eager), outside every
    :func:`latent_core.profiling.host_range` (host work on a GPU too); ``inductor``: the kernels inductor
    generated that ran (``cpp_fused_*`` on a CPU, visible when ``torch._inductor.config.cpp.enable_kernel_profile``
    was on while they were compiled; ``triton_*`` on CUDA); ``launches``: their sum, one launch each on a GPU.

    ``by_source``: also ``"by_source"``, the launches per innermost :func:`latent_core.profiling.source_range` they
    ran in (``"other"`` outside every one); a backward launch counts where the forward op that made its autograd
    node ran (the profiler's sequence numbers link the two).
    """
    from torch.profiler import ProfilerActivity, profile

    from latent_core.profiling import HOST_PREFIX, PREFIX

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts = {"aten": 0, "inductor": 0}
    sources: Dict[str, int] = {}
    node_source: Dict[int, str] = {}  # autograd sequence number -> the source of the forward op that made the node

    def visit(event, source: str) -> None:
        name = event.name
        if name.startswith(HOST_PREFIX):  # CPU tensors whatever the model's device: no kernel launch on a GPU
            return
        if name.startswith(PREFIX):
            source = name[len(PREFIX):]
        elif name.startswith("autograd::engine::evaluate_function"):
            source = node_source.get(event.sequence_nr, "other")
        elif event.sequence_nr >= 0 and event.sequence_nr not in node_source:
            node_source[event.sequence_nr] = source
        launched = 0
        if name.startswith("aten::"):
            packet = _aten_op(name)
            if packet is not None and not _decomposes(packet):
                launched = _launches_a_kernel(packet, name.removeprefix("aten::"))
                counts["aten"] += launched
                sources[source] = sources.get(source, 0) + launched
                return
        elif "cpp_fused" in name or name.startswith("triton_"):
            counts["inductor"] += 1
            sources[source] = sources.get(source, 0) + 1
            return
        for child in event.cpu_children:
            visit(child, source)

    for event in sorted((e for e in prof.events() if e.cpu_parent is None), key=lambda e: e.time_range.start):
        visit(event, "other")
    result = {**counts, "launches": counts["aten"] + counts["inductor"]}
    if by_source:
        result["by_source"] = dict(sorted(sources.items()))
    return result
