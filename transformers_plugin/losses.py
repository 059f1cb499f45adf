"""The regularisers of eq. (24) for a transformers model with SDMA, from the clustering its attentions recorded in
the model's latest forward: :func:`sdma_loss` (the weighted sum to add to the task loss), :func:`sdma_terms` (each
term per sequence, for logging) and :func:`sdma_records` (the clustering itself)."""

import contextlib
import dataclasses
import math
from typing import Dict, Iterator, Mapping, Optional

from torch import Tensor, nn

from latent_core.sdma import (
    REGULARISER_SCALES,
    SDMAConfigError,
    SDMACore,
    SDMALossWeights,
    SDMARecording,
    check_finite,
    collect_sdma_losses,
    scale_regulariser,
    weighted_regulariser,
)

HF_ADVICE = ("lower the learning rate or the regulariser weights (sdma_loss(model, weights=...)), or train in float32 "
             "where it ran in half precision")
WEIGHT_NAMES = tuple(f.name for f in dataclasses.fields(SDMALossWeights))


def check_loss_weights(weights: Optional[Mapping[str, float]], keyword: str) -> Dict[str, float]:
    """The lambdas of eq. (24) by the field names of :class:`latent_core.sdma.SDMALossWeights`, Table I's where not
    given; :class:`SDMAConfigError` naming ``keyword`` (how the caller passed them, e.g. ``sdma_loss(weights=...)``)
    for an unknown name or a value that is not a finite number >= 0."""
    if weights is None:
        weights = {}
    if not isinstance(weights, Mapping):
        raise SDMAConfigError(f"{keyword}={weights!r} must be a dict of weights by name ({', '.join(WEIGHT_NAMES)})")
    unknown = sorted(str(name) for name in weights if name not in WEIGHT_NAMES)
    if unknown:
        raise SDMAConfigError(f"{keyword}: unknown weight(s) {', '.join(unknown)}; the weights are "
                              f"{', '.join(WEIGHT_NAMES)}")
    for name, value in weights.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise SDMAConfigError(f"{keyword}[{name!r}]={value!r}: a weight of eq. (24) must be a finite number >= 0")
    return {f"sdma_{name}": float(value) for name, value in {**dataclasses.asdict(SDMALossWeights()),
                                                              **weights}.items()}


def check_regulariser_scale(scale: Optional[str], keyword: str, optional: bool = False) -> Optional[str]:
    """``scale`` when it is one of :data:`latent_core.sdma.REGULARISER_SCALES` (or None where ``optional``)."""
    if (scale is None and optional) or scale in REGULARISER_SCALES:
        return scale
    raise SDMAConfigError(f"{keyword}={scale!r} is not one of {', '.join(REGULARISER_SCALES)}")


def latest_recording(model: nn.Module, caller: str) -> SDMARecording:
    """The records of ``model``'s latest forward: the model :func:`~transformers_plugin.attach_sdma` returned, or
    any wrapper of it (DistributedDataParallel, accelerate, PEFT)."""
    state = next((m.sdma_state for m in model.modules() if getattr(m, "sdma_state", None) is not None), None)
    if state is None:
        raise SDMAConfigError(f"{caller}: {type(model).__name__} has no SDMA attention (call attach_sdma first)")
    if state.records.recording is None:
        raise SDMAConfigError(f"{caller}: no forward of this model with SDMA has run yet (call attach_sdma, then the "
                              "model, then sdma_loss)")
    return state.records.recording


@contextlib.contextmanager
def _gathered_cores(model: nn.Module, caller: str) -> Iterator[None]:
    """FSDP2 (``fully_shard``): the regularisers read the GMMs' variances and priors after the forward, where FSDP has
    sharded them again. The FSDP modules that hold SDMA cores gather their parameters while the regularisers are
    built (an all-gather on every process, as sdma_loss runs on all) and shard them again; the gradients then
    accumulate into the same unsharded parameters as the forward's and reach FSDP's reduce-scatter with them.
    FSDP1's views of its flat parameters are freed after the forward: refused. Without FSDP, one pass over the
    modules and nothing else."""
    from torch.distributed.fsdp import FSDPModule

    fsdp, owners = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            fsdp[name] = module
        elif isinstance(module, SDMACore):
            for parameter_name, parameter in module.named_parameters():
                if type(parameter).__name__ != "DTensor" and parameter.untyped_storage().size() == 0:
                    raise SDMAConfigError(
                        f"{caller}: {name}.{parameter_name} is sharded (FSDP1) after the forward, where the "
                        "regularisers of eq. (20)-(23) read the GMMs; SDMA trains under DistributedDataParallel or "
                        "torch's FSDP2 (fully_shard: the Trainer's --fsdp with fsdp_version 2)")
            owner = max((n for n in fsdp if n == "" or name.startswith(n + ".")), key=len, default=None)
            if owner is not None:
                owners[owner] = fsdp[owner]
    for module in owners.values():
        module.unshard()
    try:
        yield
    finally:
        for module in owners.values():
            module.reshard()


def sdma_terms(model: nn.Module, caller: str = "sdma_terms") -> Dict[str, Tensor]:
    """Each regulariser of the model's latest forward, per sequence (``[B]``), by the names of
    :data:`latent_core.sdma.LOSS_NAMES` (``kl_z``, ``kl_q``: eq. 20; ``dqq``: eq. 21, the heads' MI upper bound;
    ``dxq``: eq. 22, the input-query MI lower bound; ``dv_z``, ``dv_q``: eq. 23), unweighted; fairseq logs the same
    names as ``sdma_<name>``. Raises :class:`SDMAConfigError` where a term is not finite."""
    recording = latest_recording(model, caller)
    with _gathered_cores(model, caller):
        terms = collect_sdma_losses(model, recording)
    check_finite(terms, HF_ADVICE)
    return terms


def regulariser_from_terms(terms: Dict[str, Tensor], weights: Dict[str, float], regulariser_scale: Optional[str],
                           num_tokens: Optional[float]) -> Tensor:
    """Eq. (24) without L_CE from :func:`sdma_terms` and checked weights (see :func:`sdma_loss`)."""
    per_sequence = weighted_regulariser(terms, weights)
    if regulariser_scale is None:
        return per_sequence.mean()
    return scale_regulariser(per_sequence, regulariser_scale, num_tokens) / float(num_tokens)


def sdma_loss(model: nn.Module, weights: Optional[Dict[str, float]] = None, regulariser_scale: Optional[str] = None,
              num_tokens: Optional[float] = None) -> Tensor:
    """The regularisers of eq. (24) (lambda_k KL + lambda_q L_Dqq - lambda_x L_Dxq + lambda_d DV) of the model's
    latest forward: a 0-dim tensor to add to the task loss. ``weights``: the lambdas by the field names of
    :class:`latent_core.sdma.SDMALossWeights` (``kl_weight``, ``dqq_weight``, ``dxq_weight``, ``diversity_weight``;
    default Table I's), each a finite number >= 0.

    Without ``regulariser_scale``: the mean over the batch's sequences. With it, next to a task loss that is a MEAN
    over ``num_tokens`` items (the target tokens of a token-mean cross-entropy): fairseq's
    ``--sdma-regulariser-scale`` divided by ``num_tokens``, so both toolkits weigh the terms alike. ``sentence``
    (the authors' criterion: each sequence's regularisers added to the token-SUMMED cross-entropy) is their sum over
    the sequences / ``num_tokens``; ``token`` the sequence mean (eq. 24 read with a per-token L_CE; ~tokens per
    sequence times stronger); ``batch`` the sequence mean / ``num_tokens``.

    ``model``: the model ``attach_sdma`` returned or a wrapper of it (DistributedDataParallel, accelerate, PEFT)."""
    checked = check_loss_weights(weights, "sdma_loss: weights")
    check_regulariser_scale(regulariser_scale, "sdma_loss: regulariser_scale", optional=True)
    if regulariser_scale is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, float))
                                          or not num_tokens > 0):
        raise SDMAConfigError(f"sdma_loss: regulariser_scale={regulariser_scale!r} needs num_tokens > 0 (the items "
                              f"the task loss averages over), got {num_tokens!r}")
    return regulariser_from_terms(sdma_terms(model, "sdma_loss"), checked, regulariser_scale, num_tokens)


def sdma_records(model: nn.Module) -> Dict[str, object]:
    """The clustering each SDMA attention recorded in the model's latest forward (the inputs of its regularisers):
    ``{module name: latent_core.sdma.ClusteringRecord}``, with p(c|z) of eq. (9) as ``log_resp_z`` ``[T, B, n_h, C]``
    and the real query positions as ``valid`` ``[T, B]``. Empty where no attention applied its mask."""
    recording = latest_recording(model, "sdma_records")
    return {name: recording.get(module.sdma) for name, module in model.named_modules()
            if getattr(module, "sdma_state", None) is not None and recording.get(module.sdma) is not None}
