"""Transfer HUBERT parts from a source checkpoint (Section 4.4) and freeze them.

``--tpr-transfer-from CKPT --tpr-transfer encoder,roles,...`` copies exactly the parameters
of the named parts (one table, :data:`PARTS`); ``--tpr-freeze`` sets ``requires_grad`` False
on the named parts (transferred or not). The classification head, the concat projection and
the scale are never transferred. ``selectors`` is short for ``role_selector,filler_selector``.
What was copied is recorded in the model arguments (``tpr_transferred``, saved with every
checkpoint) and logged. The paper does not freeze transferred parts (Section 4.4).
"""

import logging
from typing import Dict, List, Tuple

from torch import nn

from latent_core.errors import PluginConfigError

logger = logging.getLogger(__name__)

# part -> parameter-name prefixes in TPRClassifier's state dict (a prefix ending in "." is a
# module; otherwise the exact name)
PARTS: Dict[str, Tuple[str, ...]] = {
    "encoder": ("backbone.",),
    "roles": ("tpr.R",),
    "fillers": ("tpr.S",),
    "role_selector": ("tpr.W_R.", "tpr.role_encoder.", "tpr.paths.cell_R."),
    "filler_selector": ("tpr.W_S.", "tpr.filler_encoder.", "tpr.paths.cell_S."),
}
ALIASES = {"selectors": ("role_selector", "filler_selector")}


class TPRTransferError(PluginConfigError):
    """A transfer/freeze request that cannot be honoured (the message names the parameter)."""


def parse_parts(spec, option: str) -> List[str]:
    """``"encoder,roles,selectors"`` -> ["encoder", "roles", "role_selector", "filler_selector"]."""
    parts: List[str] = []
    for name in (s.strip() for s in (spec or "").split(",")):
        if not name:
            continue
        expanded = ALIASES.get(name, (name,))
        for part in expanded:
            if part not in PARTS:
                raise TPRTransferError(f"{option} {name!r}: unknown part; choose from "
                                       f"{', '.join(list(PARTS) + list(ALIASES))}")
            if part not in parts:
                parts.append(part)
    return parts


def part_of(name: str, part: str) -> bool:
    return any(name.startswith(p) if p.endswith(".") else name == p for p in PARTS[part])


def part_keys(names, part: str) -> List[str]:
    return [n for n in names if part_of(n, part)]


def transfer(model: nn.Module, source_state: Dict, parts: List[str], source: str = "source") -> Dict[str, int]:
    """Copy the state-dict entries of ``parts`` from ``source_state`` into ``model``.
    Returns {part: number of tensors copied}. Raises :class:`TPRTransferError` naming the
    parameter when the source lacks one of them or its shape differs."""
    own = model.state_dict()
    wanted, counts = {}, {}
    for part in parts:
        keys = part_keys(own, part)
        if not keys:
            raise TPRTransferError(f"--tpr-transfer {part}: this model has no such parameters "
                                   f"({', '.join(PARTS[part])})")
        for key in keys:
            if key not in source_state:
                raise TPRTransferError(f"--tpr-transfer {part}: the source checkpoint {source} has no parameter "
                                       f"{key} (trained with another --tpr-encoder, or not a TPR model?)")
            value = source_state[key]
            if tuple(value.shape) != tuple(own[key].shape):
                raise TPRTransferError(f"--tpr-transfer {part}: {key} has shape {tuple(value.shape)} in {source} "
                                       f"but {tuple(own[key].shape)} in this model")
            wanted[key] = value
        counts[part] = len(keys)
    missing, unexpected = model.load_state_dict(wanted, strict=False)
    assert not unexpected, unexpected
    return counts


def freeze(model: nn.Module, parts: List[str]) -> Dict[str, int]:
    """requires_grad False for every parameter of ``parts``; {part: parameters frozen}."""
    counts = {}
    for part in parts:
        params = [p for n, p in model.named_parameters() if part_of(n, part)]
        if not params:
            raise TPRTransferError(f"--tpr-freeze {part}: this model has no such parameters ({', '.join(PARTS[part])})")
        for p in params:
            p.requires_grad_(False)
        counts[part] = len(params)
    return counts


def apply_transfer_options(model: nn.Module, args, building_from_checkpoint: bool = False) -> None:
    """``--tpr-transfer-from/--tpr-transfer/--tpr-freeze`` on a freshly built model.

    When fairseq rebuilds a model to load its own checkpoint (``building_from_checkpoint``)
    the weights come from that checkpoint: only the freezing is applied again."""
    transfer_parts = parse_parts(getattr(args, "tpr_transfer", None), "--tpr-transfer")
    freeze_parts = parse_parts(getattr(args, "tpr_freeze", None), "--tpr-freeze")
    source = getattr(args, "tpr_transfer_from", None)
    if transfer_parts and not source:
        raise TPRTransferError("--tpr-transfer needs --tpr-transfer-from CKPT")
    if source and not transfer_parts:
        raise TPRTransferError(f"--tpr-transfer-from {source}: name the parts with --tpr-transfer "
                               f"({', '.join(list(PARTS) + list(ALIASES))})")
    if transfer_parts and not building_from_checkpoint:
        from fairseq import checkpoint_utils

        state = checkpoint_utils.load_checkpoint_to_cpu(source)["model"]
        counts = transfer(model, state, transfer_parts, source)
        record = ",".join(f"{part}:{n}" for part, n in counts.items())
        try:
            args.tpr_transferred = f"{source}|{record}"
        except (AttributeError, KeyError):
            logger.warning("could not record the transferred parts in the model arguments")
        logger.info("transferred from %s: %s", source, ", ".join(f"{p} ({n} tensors)" for p, n in counts.items()))
    if freeze_parts:
        counts = freeze(model, freeze_parts)
        logger.info("frozen: %s", ", ".join(f"{p} ({n} tensors)" for p, n in counts.items()))
