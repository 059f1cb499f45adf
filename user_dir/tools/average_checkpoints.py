"""Average the model parameters of the last N epoch checkpoints of a fairseq run.

fairseq's own ``scripts/average_checkpoints.py`` is not installed with the wheel;
this is the same operation for epoch checkpoints: the ``checkpoint{EPOCH}.pt``
files with the N highest epoch numbers are loaded with torch's safe loader
(``torch.load(path, map_location="cpu", weights_only=True)``;
``import user_dir`` allow-lists the few non-tensor types fairseq stores), the
floating-point tensors of ``state["model"]`` are averaged (in float64, then cast
back to their dtype), non-floating tensors (counters) are taken from the newest
checkpoint, and the newest checkpoint's dict, with the averaged model, is saved.

Usage::

    latent-average-checkpoints --inputs checkpoints/run --num-epoch-checkpoints 5 \\
        --output checkpoints/run/checkpoint_avg5.pt
"""

from __future__ import annotations

import argparse
import re
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

EPOCH_CHECKPOINT = re.compile(r"^checkpoint(\d+)\.pt$")


class AverageError(RuntimeError):
    """Missing or incompatible checkpoints."""


def register_user_dir() -> None:
    """Import the project's fairseq plugin so its checkpoint types load with weights_only=True."""
    import user_dir  # noqa: F401  (registers safe globals)


def last_epoch_checkpoints(directory: Path, count: int) -> List[Path]:
    """The ``count`` ``checkpoint{N}.pt`` files of ``directory`` with the highest N, newest first."""
    found = []
    for path in Path(directory).iterdir():
        match = EPOCH_CHECKPOINT.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    found.sort(reverse=True)
    if len(found) < count:
        raise AverageError(f"{directory} has {len(found)} epoch checkpoints (checkpointN.pt), "
                           f"{count} requested; lower --num-epoch-checkpoints")
    return [path for _, path in found[:count]]


def load_checkpoint(path: Path) -> Dict:
    """``torch.load`` on CPU with torch's safe loader (``weights_only=True``)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "model" not in state:
        raise AverageError(f"{path} is not a fairseq checkpoint (no 'model' entry)")
    return state


def average_checkpoints(paths: Sequence[Path]) -> Dict:
    """The first checkpoint's dict with ``model`` replaced by the parameter average of all ``paths``."""
    if not paths:
        raise AverageError("no checkpoints to average")
    base = load_checkpoint(paths[0])
    keys = list(base["model"].keys())
    sums = {key: value.double() for key, value in base["model"].items() if torch.is_floating_point(value)}
    for path in paths[1:]:
        model = load_checkpoint(path)["model"]
        if list(model.keys()) != keys:
            difference = sorted(set(model.keys()) ^ set(keys))[:5]
            raise AverageError(f"{path} has different parameters than {paths[0]} (e.g. {difference})")
        for key in sums:
            if model[key].shape != sums[key].shape:
                raise AverageError(f"{key}: shape {tuple(model[key].shape)} in {path} "
                                   f"but {tuple(sums[key].shape)} in {paths[0]}")
            sums[key] += model[key].double()
    averaged = OrderedDict()
    for key, value in base["model"].items():
        averaged[key] = (sums[key] / len(paths)).to(value.dtype) if key in sums else value
    base["model"] = averaged
    return base


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", nargs="+", required=True, type=Path,
                        help="a checkpoint directory (with --num-epoch-checkpoints) or checkpoint files")
    parser.add_argument("--num-epoch-checkpoints", type=int, default=None, metavar="N",
                        help="average the last N checkpoint{epoch}.pt files of the directory given in --inputs")
    parser.add_argument("--output", required=True, type=Path, help="where to write the averaged checkpoint")
    return parser


def resolve_inputs(inputs: Sequence[Path], count: Optional[int]) -> List[Path]:
    """Checkpoint files from the command-line inputs."""
    if count is not None:
        if len(inputs) != 1 or not inputs[0].is_dir():
            raise AverageError("--num-epoch-checkpoints needs exactly one directory in --inputs")
        if count < 1:
            raise AverageError("--num-epoch-checkpoints must be >= 1")
        return last_epoch_checkpoints(inputs[0], count)
    missing = [str(path) for path in inputs if not path.is_file()]
    if missing:
        raise AverageError(f"checkpoint file(s) not found: {', '.join(missing)}")
    return list(inputs)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    register_user_dir()
    try:
        paths = resolve_inputs(args.inputs, args.num_epoch_checkpoints)
        state = average_checkpoints(paths)
    except AverageError as error:
        raise SystemExit(f"error: {error}") from None
    args.output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, args.output)
    print(f"[average] {len(paths)} checkpoints ({', '.join(path.name for path in paths)}) -> {args.output}")


if __name__ == "__main__":
    main()
