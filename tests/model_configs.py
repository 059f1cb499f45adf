"""Build a model the way ``fairseq-train`` does and the way ``fairseq-hydra-train`` does, in this
process and without training, so that a test can check that a hydra YAML of ``examples/`` and the
equivalent command line give the same model (same config values, same parameters from one seed).

    model, cfg = build_like_fairseq_train([data, "--user-dir", USER_DIR, "--task", ..., "--arch", ...])
    model, cfg = build_like_hydra_train(config_dir, "config_name", ["task.data=...", ...])
    assert_same_model(a, b)
"""

from pathlib import Path
from typing import List, Sequence

import torch

from conftest import REPO

USER_DIR = REPO / "user_dir"


def _build(cfg):
    from fairseq import tasks

    task = tasks.setup_task(cfg.task)
    torch.manual_seed(cfg.common.seed)
    return task.build_model(cfg.model), cfg


def build_like_fairseq_train(argv: Sequence) -> tuple:
    """``fairseq-train ARGV`` up to ``task.build_model`` (its parser, architecture and config conversion)."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(a) for a in argv])
    return _build(convert_namespace_to_omegaconf(args))


def build_like_hydra_train(config_dir: Path, config_name: str, overrides: List[str]) -> tuple:
    """``fairseq-hydra-train --config-dir DIR --config-name NAME OVERRIDES`` up to ``task.build_model``
    (fairseq_cli.hydra_train: compose, add_defaults, resolve)."""
    from fairseq import utils
    from fairseq.dataclass.initialize import add_defaults, hydra_init
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from fairseq.dataclass.utils import omegaconf_no_object_check

    from hydra.version import VersionBase

    GlobalHydra.instance().clear()
    hydra_init(config_name)  # FairseqConfig as the schema of the YAML, as fairseq-hydra-train's cli_main
    # restored afterwards: fairseq's own hydra.experimental calls (every later
    # convert_namespace_to_omegaconf in this process) fail under version_base=None
    base = VersionBase.instance().version_base
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
            cfg = compose(config_name, overrides=list(overrides))
    finally:
        VersionBase.instance().version_base = base
        GlobalHydra.instance().clear()
    utils.import_user_module(cfg.common)
    add_defaults(cfg)
    with omegaconf_no_object_check():
        cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    OmegaConf.set_struct(cfg, True)
    return _build(cfg)


def assert_same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Same parameter and buffer names, shapes and values (both built from one seed)."""
    state_a, state_b = a.state_dict(), b.state_dict()
    assert list(state_a) == list(state_b)
    for name, tensor in state_a.items():
        assert tensor.shape == state_b[name].shape, name
        assert torch.equal(tensor, state_b[name]), name
    assert type(a) is type(b)
