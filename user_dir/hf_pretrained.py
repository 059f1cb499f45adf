"""The one inspector of local Hugging Face model directories (``save_pretrained()`` output).

Shared by every package that loads pre-trained Hugging Face weights (``hf_sentence``,
``optimus``, ``qkvae``): one list of weight files, one directory check, one set of error
messages. Each caller passes its own error class (so its users keep catching
``HFSentenceConfigError``, ``OptimusConfigError``, ``BartInitError``) and checks the
``model_type`` its architecture needs through ``validate``.

This module imports nothing from ``user_dir``: it is a shared layer, arrows only point
into it (``tests/unit/user_dir/test_package_layers.py``).
"""

import json
import os
from typing import Callable, Optional, Type

CONFIG_FILE = "config.json"
# a directory holds its weights in one of these (sharded checkpoints: the index file)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def has_weights(path: str) -> bool:
    """Whether ``path`` holds one of :data:`WEIGHT_FILES`."""
    return any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES)


def read_json_config(config_path: str, option: str, error: Type[Exception] = ValueError) -> dict:
    """A ``config.json`` file as a dict; ``error`` naming ``option`` and the file otherwise."""
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as cause:
        raise error(f"{option} {config_path}: unreadable config.json ({cause})") from cause
    if not isinstance(config, dict):
        raise error(f"{option} {config_path}: config.json is not a JSON object")
    return config


def inspect_hf_directory(path: str, option: str, error: Type[Exception] = ValueError,
                         validate: Optional[Callable[[dict, str], None]] = None) -> dict:
    """Check a local Hugging Face model directory before loading it; returns its config.json.

    In order: the directory exists, has a readable ``config.json`` (a JSON object), passes
    ``validate(config, config_path)`` (the caller's ``model_type`` check, which raises its
    own error) and holds a weights file (:data:`WEIGHT_FILES`). Every failure raises
    ``error`` with a message naming ``option``, the directory and what is missing.
    """
    if not os.path.isdir(path):
        raise error(f"{option} {path}: no such directory")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise error(f"{option} {path}: no config.json; expected a Hugging Face model directory "
                    f"(save_pretrained() output: config.json and model.safetensors or pytorch_model.bin)")
    config = read_json_config(config_path, option, error)
    if validate is not None:
        validate(config, config_path)
    if not has_weights(path):
        raise error(f"{option} {path}: no weights file (looked for {', '.join(WEIGHT_FILES)})")
    return config
