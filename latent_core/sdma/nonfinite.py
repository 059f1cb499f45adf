"""Where a non-finite SDMA loss comes from: the first non-finite term, parameter or activation."""

from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor


def check_finite(terms: Dict[str, Tensor], advice: str,
                 diagnose: Optional[Callable[[], str]] = None) -> None:
    """Raise FloatingPointError naming the first non-finite SDMA loss term (one sync when all are finite).

    ``diagnose`` (e.g. :func:`diagnose_nonfinite` bound to the model and batch) runs only on
    that failure path; its sentence (which parameter or activation went non-finite first)
    is added to the message.
    """
    if not terms:
        return
    values = torch.cat([t.detach().float().reshape(-1) for t in terms.values()])
    if bool(torch.isfinite(values).all()):
        return
    for name, value in terms.items():
        if not torch.isfinite(value).all():
            bad = value.detach().reshape(-1)
            bad = bad[~torch.isfinite(bad)]
            where = f" {diagnose()}." if diagnose is not None else ""
            raise FloatingPointError(f"SDMA loss term '{name}' is {float(bad[0])} (NaN/inf) for "
                                     f"{bad.numel()} of {value.numel()} sentence(s).{where} {advice}")


def _nonfinite_count(tensor: Tensor) -> int:
    return int((~torch.isfinite(tensor.detach())).sum()) if tensor.is_floating_point() else 0


def _tensors(value) -> List[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def first_nonfinite_parameter(model: nn.Module) -> Optional[str]:
    """``"name [shape]: n of m values non-finite"`` of the first parameter or float buffer
    with a NaN/inf (in ``named_parameters`` then ``named_buffers`` order), else None."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            bad = _nonfinite_count(tensor)
            if bad:
                return f"{kind} {name} {list(tensor.shape)}: {bad} of {tensor.numel()} values non-finite"
    return None


def first_nonfinite_activation(model: nn.Module, forward: Callable[[], object]) -> Optional[str]:
    """Run ``forward()`` (no gradients) with hooks on every sub-module of ``model`` and name the
    first module, in completion order, whose output holds a NaN/inf (so the innermost, earliest
    one), saying whether its inputs were already non-finite. None when every output is finite."""
    names = {module: name or type(model).__name__ for name, module in model.named_modules()}
    found: List[str] = []

    def hook(module, inputs, output):
        if found:
            return
        outputs = [t for t in _tensors(output) if t.is_floating_point()]
        bad = sum(_nonfinite_count(t) for t in outputs)
        if bad:
            inputs_bad = sum(_nonfinite_count(t) for t in _tensors(inputs))
            origin = "its inputs were already non-finite" if inputs_bad else "its inputs were finite"
            found.append(f"output of {names[module]} ({type(module).__name__}): "
                         f"{bad} of {sum(t.numel() for t in outputs)} values non-finite; {origin}")

    handles = [module.register_forward_hook(hook) for module in model.modules()]
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def diagnose_nonfinite(model: nn.Module, forward: Optional[Callable[[], object]] = None) -> str:
    """One sentence on where a non-finite loss comes from: the first non-finite parameter or
    buffer, else (re-running ``forward``) the first module whose output is non-finite."""
    parameter = first_nonfinite_parameter(model)
    if parameter is not None:
        return f"First non-finite {parameter}"
    if forward is not None:
        try:
            activation = first_nonfinite_activation(model, forward)
        except Exception as error:  # the diagnosis must not hide the original failure
            return f"All parameters are finite; re-running the batch to find the activation failed ({error})"
        if activation is not None:
            return f"All parameters are finite; first non-finite activation: {activation}"
        return ("All parameters are finite and re-running the batch gave finite activations "
                "(a transient overflow, e.g. of the sampling noise)")
    return "All parameters are finite"
