"""Stand-in for fairseq's ``tests/utils.py``, which the fairseq-fixed sdist does not ship.

The sdist carries fairseq's ``tests/test_*.py`` but neither ``tests/__init__.py`` nor the helper
module they import (``from tests.utils import ...``). The runner installs this file as
``tests/utils.py`` of the extracted sdist (in the git-ignored cache, never committed). It
provides what the selected tests call, with the flags of fairseq 0.12's own helper (tiny data,
``--optimizer nag --lr 0.05 --max-tokens 500 --max-epoch 1``, beam 3 generation, then one
interactive sentence), so a test exercises fairseq's binaries as fairseq's own suite does. The
helpers of the excluded tests (language models, summarisation, LASER, the fake models of
``test_sequence_generator``) are named so the test modules import, and raise if called.
"""

import os
import random
import sys
from io import StringIO

import torch
from fairseq import distributed_utils, options
from fairseq.data import Dictionary
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq_cli import generate, interactive, preprocess, train, validate

LANG_FLAGS = ["--source-lang", "in", "--target-lang", "out"]


def dummy_dictionary(vocab_size, prefix="token_"):
    d = Dictionary()
    for i in range(vocab_size):
        d.add_symbol(prefix + str(i))
    d.finalize(padding_factor=1)  # no extra padding symbols
    return d


def create_dummy_data(data_dir, num_examples=100, maxlen=20, alignment=False):
    """Random lowercase 'sentences' as train/valid/test.{in,out} (alignment files unsupported)."""
    if alignment:
        raise NotImplementedError("alignment data: only the excluded alignment tests use it")
    for split in ("train", "valid", "test"):
        for side in ("in", "out"):
            letters = (97 + torch.floor(26 * torch.rand(num_examples * maxlen)).int()).tolist()
            with open(os.path.join(data_dir, f"{split}.{side}"), "w") as out:
                offset = 0
                for _ in range(num_examples):
                    length = random.randint(1, maxlen)
                    print(" ".join(map(chr, letters[offset:offset + length])), file=out)
                    offset += length


def preprocess_translation_data(data_dir, extra_flags=None):
    args = options.get_preprocessing_parser().parse_args(
        LANG_FLAGS + ["--trainpref", os.path.join(data_dir, "train"), "--validpref", os.path.join(data_dir, "valid"),
                      "--testpref", os.path.join(data_dir, "test"), "--thresholdtgt", "0", "--thresholdsrc", "0",
                      "--destdir", data_dir] + (extra_flags or []))
    preprocess.main(args)


def train_translation_model(data_dir, arch, extra_flags=None, task="translation", run_validation=False,
                            lang_flags=None, extra_valid_flags=None, world_size=1):
    lang_flags = LANG_FLAGS if lang_flags is None else lang_flags
    train_args = options.parse_args_and_arch(options.get_training_parser(), [
        "--task", task, data_dir, "--save-dir", data_dir, "--arch", arch, "--optimizer", "nag", "--lr", "0.05",
        "--max-tokens", "500", "--max-epoch", "1", "--no-progress-bar", "--distributed-world-size", str(world_size),
        "--num-workers", "0"] + lang_flags + (extra_flags or []))
    distributed_utils.call_main(convert_namespace_to_omegaconf(train_args), train.main)
    if run_validation:
        validate_args = options.parse_args_and_arch(options.get_validation_parser(), [
            "--task", task, data_dir, "--path", os.path.join(data_dir, "checkpoint_last.pt"), "--valid-subset",
            "valid", "--max-tokens", "500", "--no-progress-bar", "--num-workers", "0"]
            + lang_flags + (extra_valid_flags or []))
        validate.main(validate_args)


def generate_main(data_dir, extra_flags=None, path=None):
    """Batch generation of the valid set, then fairseq-interactive on one sentence."""
    extra_flags = ["--print-alignment"] if extra_flags is None else extra_flags
    args = options.parse_args_and_arch(options.get_generation_parser(), [
        data_dir, "--path", path or os.path.join(data_dir, "checkpoint_last.pt"), "--beam", "3", "--batch-size",
        "64", "--max-len-b", "5", "--gen-subset", "valid", "--no-progress-bar", "--num-workers", "0"] + extra_flags)
    generate.main(args)
    args.buffer_size, args.input, args.batch_size = 0, "-", None
    stdin, sys.stdin = sys.stdin, StringIO("h e l l o\n")
    try:
        interactive.main(args)
    finally:
        sys.stdin = stdin


def _not_provided(name):
    def helper(*args, **kwargs):
        raise NotImplementedError(f"tests.utils.{name}: not provided by the toolkit-contract stand-in "
                                  "(only excluded tests use it)")
    helper.__name__ = name
    return helper


for _name in ("create_laser_data_and_config_json", "preprocess_lm_data", "preprocess_summarization_data",
              "train_language_model", "sequence_generator_setup", "dummy_dataloader"):
    globals()[_name] = _not_provided(_name)
