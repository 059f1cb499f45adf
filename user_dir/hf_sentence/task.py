"""``hf_sentence_prediction``: sentence(-pair) classification / regression on GLUE-style TSV
files, tokenised by a Hugging Face fast tokenizer.

``fairseq-train DIR --task hf_sentence_prediction --glue-task MRPC --hf-tokenizer-dir TOK``:
``DIR`` holds ``train.tsv``, ``dev.tsv`` and ``test.tsv`` (splits ``train``, ``valid`` or
``dev``, ``test``; any other split X reads ``X.tsv``); the column layouts are those of
:mod:`.data`. Classes are the label column's strings (GLUE: ``0``/``1``; ``custom``:
``--label-names``), ``--num-classes 1`` is regression (STS-B: scores in ``--label-range``
0,5). Batches are described in :class:`~.data.HFSentenceDataset`.

**Extensions**: a subclass adds per-example features without this package knowing them
(``user_dir/topic_vq/task.py`` adds the topic vocabulary and bags of words): it overrides
:attr:`keep_words` (keep each example's words when encoding), :meth:`extra_features` (arrays
handed to :class:`~.data.HFSentenceDataset` as ``topic``) and may register task-state
factories. This package imports no paper package (``tests/unit/user_dir/test_package_layers.py``).

For models: ``task.tokenizer``, ``task.num_classes``, ``task.is_regression``,
``task.padding_idx``, ``task.max_positions()``, ``task.topic_vocabulary`` (None here; set by
subclasses with topic features) and ``task.building_from_checkpoint`` (True while
``checkpoint_utils.load_model_ensemble_and_task`` builds the model, whose weights are then
overwritten: a model may skip loading pre-trained weights; :meth:`HFSentencePredictionTask.build_model`).
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.tasks import FairseqTask, register_task
from omegaconf import II

from ..exact_resume import batches_made_as_at_epoch_one
from .model import HFSentenceClassifier, record_in_config
from .data import (
    GLUE_TASKS,
    TASK_CHOICES,
    Encoded,
    Examples,
    HFSentenceDataset,
    LabelSpec,
    Layout,
    encode,
    parse_labels,
    read_tsv,
    split_file,
)

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "spiece.model", "sentencepiece.bpe.model")


@dataclass
class HFSentencePredictionConfig(FairseqDataclass):
    data: str = field(default="", metadata={"help": "directory with train.tsv, dev.tsv, test.tsv"})
    glue_task: ChoiceEnum(TASK_CHOICES) = field(
        default="custom",
        metadata={"help": "column layout of the TSV files (a GLUE task's, or custom: "
                          "--sentence1-column/--sentence2-column/--label-column/--skip-header)"},
    )
    sentence1_column: Optional[int] = field(default=None, metadata={"help": "custom: 0-based column of sentence 1"})
    sentence2_column: Optional[int] = field(
        default=None, metadata={"help": "custom: 0-based column of sentence 2 (omit for single sentences)"})
    label_column: Optional[int] = field(
        default=None, metadata={"help": "custom: 0-based column of the label (rows too short to have it, "
                                        "e.g. a test file, are read without labels)"})
    skip_header: bool = field(default=False, metadata={"help": "custom: the first line is a header"})
    num_classes: int = field(
        default=-1, metadata={"help": "number of classes, 1 = regression (default: the GLUE task's; "
                                      "custom: the number of --label-names)"})
    label_names: Optional[str] = field(
        default=None, metadata={"help": "comma-separated class labels as written in the label column, in "
                                        "class-id order (default 0,1,...,C-1)"})
    label_range: Optional[str] = field(
        default=None, metadata={"help": "regression: MIN,MAX of the scores (STS-B: 0,5); labels outside "
                                        "raise, predictions are clipped to it in glue_predict.py"})
    hf_tokenizer_dir: str = field(
        default="", metadata={"help": "local Hugging Face tokenizer directory (save_pretrained output; a fast "
                                      "tokenizer: tokenizer.json)"})
    max_positions: int = field(
        default=128, metadata={"help": "truncate examples to this many pieces, special tokens included "
                                       "(pairs: longest_first)"})
    train_subset: str = II("dataset.train_subset")


# --------------------------------------------------------------------- option checking
def parse_label_range(text: Optional[str]) -> Optional[Tuple[float, float]]:
    """``"0,5"`` (or ``"0:5"``, ``"0 5"``) -> (0.0, 5.0); None/empty -> None."""
    if text is None or not str(text).strip():
        return None
    parts = str(text).replace(":", ",").replace(" ", ",").split(",")
    parts = [p for p in parts if p]
    try:
        low, high = (float(p) for p in parts)
    except ValueError:
        raise ValueError(f"--label-range {text!r}: expected MIN,MAX (e.g. 0,5)") from None
    if not low < high:
        raise ValueError(f"--label-range {text!r}: MIN must be smaller than MAX")
    return low, high


def label_spec(cfg: HFSentencePredictionConfig) -> LabelSpec:
    """Classes or regression range from --glue-task, --num-classes, --label-names, --label-range."""
    glue = GLUE_TASKS.get(str(cfg.glue_task))
    names = tuple(n.strip() for n in cfg.label_names.split(",")) if cfg.label_names else None
    if names is not None and (len(set(names)) != len(names) or not all(names)):
        raise ValueError(f"--label-names {cfg.label_names!r}: empty or repeated class names")
    num = cfg.num_classes
    if glue is not None:
        if num not in (-1, glue.num_classes):
            raise ValueError(f"--num-classes {num}: --glue-task {glue.name} has {glue.num_classes} "
                             f"{'classes' if glue.label_names else '(regression) output'}")
        if names is not None and names != glue.label_names:
            raise ValueError(f"--label-names: --glue-task {glue.name} labels are {list(glue.label_names) or 'scores'}")
        num, names = glue.num_classes, glue.label_names
    elif num == -1:
        if names is None:
            raise ValueError("--glue-task custom needs --num-classes (1 = regression) or --label-names")
        num = len(names)
    if num < 1:
        raise ValueError(f"--num-classes {num} must be >= 1 (1 = regression)")
    if num == 1:
        if names:
            raise ValueError("--label-names makes no sense for regression (--num-classes 1)")
        given = parse_label_range(cfg.label_range)
        return LabelSpec((), given or (glue.label_range if glue is not None else None))
    if cfg.label_range:
        raise ValueError(f"--label-range is for regression (--num-classes 1), not {num} classes")
    names = names if names is not None else tuple(str(i) for i in range(num))
    if len(names) != num:
        raise ValueError(f"--num-classes {num} but {len(names)} --label-names {list(names)}")
    return LabelSpec(names)


def layouts(cfg: HFSentencePredictionConfig) -> Tuple[Layout, Optional[Layout]]:
    """(labelled layout, unlabelled test layout or None) of --glue-task / the custom columns."""
    glue = GLUE_TASKS.get(str(cfg.glue_task))
    custom = (cfg.sentence1_column, cfg.sentence2_column, cfg.label_column)
    if glue is not None:
        if any(c is not None for c in custom) or cfg.skip_header:
            raise ValueError(f"--sentence1-column/--sentence2-column/--label-column/--skip-header are for "
                             f"--glue-task custom; --glue-task {glue.name} fixes the columns")
        return glue.labelled, glue.unlabelled
    if cfg.sentence1_column is None or cfg.label_column is None:
        raise ValueError("--glue-task custom needs --sentence1-column and --label-column (0-based; "
                         "--sentence2-column for pairs), or name a GLUE task with --glue-task")
    if any(c is not None and c < 0 for c in custom):
        raise ValueError(f"column numbers must be >= 0 (0-based), got {custom}")
    used = [c for c in custom if c is not None]
    if len(set(used)) != len(used):
        raise ValueError(f"--sentence1-column, --sentence2-column and --label-column must differ: {custom}")
    return Layout(None, cfg.skip_header, cfg.sentence1_column, cfg.sentence2_column, cfg.label_column), None


def load_tokenizer(path: str):
    """The fast tokenizer of a local directory; ValueError naming --hf-tokenizer-dir otherwise."""
    from transformers import AutoTokenizer

    if not path:
        raise ValueError("--hf-tokenizer-dir is required: a local Hugging Face tokenizer directory "
                         "(tokenizer.save_pretrained(DIR))")
    if not os.path.isdir(path):
        raise ValueError(f"--hf-tokenizer-dir {path}: no such directory")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"--hf-tokenizer-dir {path}: no tokenizer files (looked for "
                         f"{', '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as error:  # transformers raises many types for unreadable directories
        raise ValueError(f"--hf-tokenizer-dir {path}: cannot load a tokenizer ({error})") from error
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"--hf-tokenizer-dir {path}: {type(tokenizer).__name__} is not a fast tokenizer "
                         f"(the word alignment needs tokenizer.json)")
    if tokenizer.pad_token_id is None:
        raise ValueError(f"--hf-tokenizer-dir {path}: the tokenizer has no pad token")
    return tokenizer


# ------------------------------------------------------------------------------- task
@register_task("hf_sentence_prediction", dataclass=HFSentencePredictionConfig)
class HFSentencePredictionTask(FairseqTask):
    """Sentence(-pair) classification/regression over TSV files; see the module docstring."""

    def __init__(self, cfg: HFSentencePredictionConfig, tokenizer, labels: LabelSpec):
        super().__init__(cfg)
        self.tokenizer = tokenizer
        self.labels = labels
        self.layout, self.unlabelled_layout = layouts(cfg)
        self.glue = GLUE_TASKS.get(str(cfg.glue_task))
        self.examples: Dict[str, Examples] = {}  # raw fields of each loaded split (for predictions)
        self.building_from_checkpoint = False
        self._train_cache = None  # (examples, encoded) of train.tsv when a subclass read it early

    @classmethod
    def setup_task(cls, cfg: HFSentencePredictionConfig, **kwargs):
        if not cfg.data or not os.path.isdir(cfg.data):
            raise ValueError(f"--task hf_sentence_prediction needs a data directory with train.tsv, dev.tsv, "
                             f"test.tsv (the positional DATA argument); got {cfg.data!r}")
        if cfg.max_positions < 2:
            raise ValueError(f"--max-positions {cfg.max_positions} must be >= 2 (special tokens count)")
        labels = label_spec(cfg)
        layouts(cfg)  # check the columns before the (slower) tokenizer
        task = cls(cfg, load_tokenizer(cfg.hf_tokenizer_dir), labels)
        logger.info("%s: %s, %s", cfg.glue_task, "pairs" if task.is_pair else "single sentences",
                    "regression" if labels.is_regression else f"{labels.num_classes} classes {list(labels.names)}")
        return task

    # ------------------------------------------------------------------ properties
    @property
    def num_classes(self) -> int:
        return self.labels.num_classes

    @property
    def is_regression(self) -> bool:
        return self.labels.is_regression

    @property
    def label_names(self):
        return self.labels.names

    @property
    def label_range(self) -> Optional[Tuple[float, float]]:
        return self.labels.range

    @property
    def padding_idx(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def is_pair(self) -> bool:
        return self.layout.sentence2 is not None

    @property
    def report_mcc(self) -> bool:
        return bool(self.glue is not None and self.glue.report_mcc)

    @property
    def source_dictionary(self):
        return None

    @property
    def target_dictionary(self):
        return None

    def max_positions(self):
        return self.cfg.max_positions

    # bit-identical resume (user_dir/exact_resume.py)
    get_batch_iterator = batches_made_as_at_epoch_one(FairseqTask.get_batch_iterator)

    # ------------------------------------------------------------ extension hooks
    @property
    def topic_vocabulary(self):
        """None: plain sentence prediction has no topic features (``user_dir/topic_vq/task.py``)."""
        return None

    @property
    def keep_words(self) -> bool:
        """Whether encoding keeps each example's words (for :meth:`extra_features`)."""
        return False

    def extra_features(self, encoded: Encoded):
        """Per-example arrays for :class:`~.data.HFSentenceDataset` (its ``topic`` argument); None here."""
        return None

    # ------------------------------------------------------------------------ data
    def split_path(self, split: str) -> str:
        path = os.path.join(self.cfg.data, split_file(split))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"split {split!r}: {path} not found (train -> train.tsv, valid/dev -> "
                                    f"dev.tsv, test -> test.tsv, any other split X -> X.tsv)")
        return path

    def _read_encoded(self, split: str, keep_words: bool):
        examples = read_tsv(self.split_path(split), self.layout, self.unlabelled_layout)
        return examples, encode(self.tokenizer, examples, self.cfg.max_positions, keep_words)

    def build_dataset(self, examples: Examples, targets=None, shuffle: bool = False,
                      encoded: Optional[Encoded] = None) -> HFSentenceDataset:
        """``examples`` encoded as every split is (this task's tokenizer, ``--max-positions``
        and a subclass's :meth:`extra_features`); ``encoded`` if already done."""
        if encoded is None:
            encoded = encode(self.tokenizer, examples, self.cfg.max_positions, self.keep_words)
        return HFSentenceDataset(encoded, targets, self.padding_idx, shuffle=shuffle,
                                 topic=self.extra_features(encoded))

    def build_model(self, cfg, from_checkpoint: bool = False):
        """fairseq's, with :attr:`building_from_checkpoint` set while it builds the model to load
        a checkpoint into (``load_model_ensemble_and_task`` passes ``from_checkpoint=True``): the
        encoder is then built from the config recorded in the checkpoint, without reading the
        pre-trained weights that the checkpoint's replace (nor copying a transfer's source again)."""
        self.building_from_checkpoint = from_checkpoint
        try:
            model = super().build_model(cfg, from_checkpoint)
        finally:
            self.building_from_checkpoint = False
        if isinstance(model, HFSentenceClassifier):
            record_in_config(cfg, model.recorded_options())
        return model

    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, **kwargs):
        if split_file(split) == "train.tsv" and self._train_cache is not None:
            (examples, encoded), self._train_cache = self._train_cache, None
        else:
            examples, encoded = self._read_encoded(split, self.keep_words)
        training = split == self.cfg.train_subset
        if examples.labels is not None:
            targets = parse_labels(examples, self.labels)
        elif training:
            raise ValueError(f"{examples.path}: no label column (an unlabelled test layout): cannot train on it")
        else:
            targets = None
        self.examples[split] = examples
        self.datasets[split] = self.build_dataset(examples, targets, shuffle=training, encoded=encoded)
        truncated = int((self.datasets[split].sizes >= self.cfg.max_positions).sum())
        logger.info("%s: %d examples from %s (%s)%s", split, len(examples), examples.path,
                    "labelled" if targets is not None else "no labels",
                    f", {truncated} reach --max-positions {self.cfg.max_positions}" if truncated else "")
        return self.datasets[split]
