"""``sentence_vae`` task: monolingual text as a (sentence -> same sentence) pair dataset.

Data: one directory made by ``fairseq-preprocess --only-source`` (``dict.txt`` and
``{split}.bin``/``{split}.idx``). Every example is a :class:`LanguagePairDataset` pair whose

* source ``src_tokens`` = sentence + EOS (right-padded by default, ``--left-pad-source`` to
  left-pad; the encoders get ``src_lengths`` and mask padding);
* target = sentence + EOS;
* ``prev_output_tokens`` = START + sentence, START chosen by ``--decoder-start``: ``eos``
  (fairseq's input feeding, EOS starts decoding), ``bos`` (``<s>``), or ``auto`` (default): the
  model's ``default_decoder_start`` (``<s>`` for QKVAE's ``authors`` reading, whose
  ``qkv_train.py`` feeds ``text[..., :-1]``, which starts with ``<s>``; EOS otherwise). The
  generator starts from the same symbol.

``fairseq-preprocess`` already ends every binarized line with EOS; data binarized without it
get EOS appended here. Works with ``fairseq-train``, ``fairseq-validate`` and fairseq's
``SequenceGenerator`` (``build_generator``/``inference_step``; ``net_input`` may carry a
``latents`` dict, see :mod:`user_dir.sentence_vae.base`).

The task also attaches an :class:`~.base.UpdateCounter` to every model it builds: fairseq passes the
update count to models only (``model.set_num_updates`` in ``task.train_step``, at checkpoint
resume and in ``load_model_ensemble_and_task``), never to criterions, and the
``sentence_vae`` criterion reads its beta schedules' clock from this counter.
"""

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, NamedTuple, Optional

import torch
from fairseq import utils
from fairseq.data import AppendTokenDataset, BaseWrapperDataset, Dictionary, LanguagePairDataset, data_utils
from fairseq.dataclass import FairseqDataclass
from fairseq.tasks import FairseqTask, register_task
from omegaconf import II

from latent_core.errors import PluginConfigError
from user_dir.exact_resume import batches_made_as_at_epoch_one
from user_dir.model_wrappers import unwrap_model

from .base import AutoEncodingPhase, SentenceVAEModel, UpdateCounter, sentence_vae_model

logger = logging.getLogger(__name__)


def model_num_updates(model) -> Optional[int]:
    """The update count the task's counter saw, or None for a model not built by the task."""
    vae = unwrap_model(model)
    counter = vae.update_counter if isinstance(vae, SentenceVAEModel) else None
    return None if counter is None else counter.num_updates


class BuiltModelDefaults(NamedTuple):
    """What the task keeps of the sentence VAE it built (:class:`~.base.SentenceVAEModel`), for the
    criterion fairseq builds next (its schedules and thresholds are checked against the latents)."""
    latent_sizes: "OrderedDict[str, int]"
    default_kl_variant: str
    default_decoder_start: str


def reset_optimizer_state(optimizer, update_num: int) -> None:
    """Forget the optimizer's moments and step counts, as the QKVAE authors' ``qkv_train.py``
    does by re-creating Adafactor when the auto-encoding phase ends. The learning-rate schedule
    is fairseq's and goes on. Idempotent within an update (state fills only at ``step()``), so
    ``--update-freq`` > 1 is safe."""
    inner = getattr(optimizer, "optimizer", optimizer)  # FairseqOptimizer / FP16 wrappers -> torch's
    if inner.state:
        logger.info("update %d: optimizer state reset at the end of the auto-encoding phase "
                    "(the QKVAE authors' re-created optimizer)", update_num)
    inner.state.clear()


DECODER_STARTS = ("auto", "bos", "eos")


class DecoderStartDataset(BaseWrapperDataset):
    """A :class:`LanguagePairDataset` whose ``prev_output_tokens`` start with ``start()`` (asked at
    collation, so a task can learn it from the model it builds after loading the validation data)
    instead of fairseq's ``</s>``: targets are right-padded, so the start is column 0."""

    def __init__(self, dataset: LanguagePairDataset, start: Callable[[], int]):
        super().__init__(dataset)
        self.start = start

    def collater(self, samples):
        batch = self.dataset.collater(samples)
        prev = batch.get("net_input", {}).get("prev_output_tokens")
        if prev is not None:
            prev[:, 0] = self.start()
        return batch


@dataclass
class SentenceVAEConfig(FairseqDataclass):
    data: str = field(
        default="",
        metadata={"help": "directory made by `fairseq-preprocess --only-source` (dict.txt, "
                          "{split}.bin/.idx); colon-separated directories are used in turn per epoch "
                          "for training (fairseq's sharding), the first one for other splits"},
    )
    max_positions: int = field(
        default=1024, metadata={"help": "longest sentence (tokens incl. EOS) for source and target"}
    )
    left_pad_source: bool = field(
        default=False, metadata={"help": "left-pad the source (default: right padding)"}
    )
    decoder_start: str = field(
        default="auto",
        metadata={"help": "first decoder input, in training and generation: 'bos' = <s>, 'eos' = </s> "
                          "(fairseq's convention), 'auto' = the model's (<s> for QKVAE's authors reading, as "
                          "their qkv_train.py; </s> otherwise)"},
    )
    dataset_impl: Optional[str] = II("dataset.dataset_impl")
    train_subset: str = II("dataset.train_subset")


def require_data(path: str) -> str:
    if not path:
        raise PluginConfigError("--task sentence_vae needs the data directory (the positional DATA argument)")
    return path


@register_task("sentence_vae", dataclass=SentenceVAEConfig)
class SentenceVAETask(FairseqTask):
    """Sentence VAEs (QKVAE, ADVAE, Optimus) on monolingual binarized text; see the module doc."""

    def __init__(self, cfg: SentenceVAEConfig, dictionary: Dictionary):
        super().__init__(cfg)
        if cfg.decoder_start not in DECODER_STARTS:
            raise PluginConfigError(f"--decoder-start={cfg.decoder_start!r}: choose from {', '.join(DECODER_STARTS)}")
        self.dictionary = dictionary
        # the model this task built (build_model): its latents and defaults, for the criterion built next
        self.built_model_defaults: Optional[BuiltModelDefaults] = None

    @classmethod
    def setup_task(cls, cfg: SentenceVAEConfig, **kwargs):
        paths = utils.split_paths(require_data(cfg.data))
        dict_path = os.path.join(paths[0], "dict.txt")
        if not os.path.isfile(dict_path):
            raise FileNotFoundError(
                f"{dict_path} not found: --task sentence_vae reads data binarized with "
                f"`fairseq-preprocess --only-source --trainpref TRAIN.txt --validpref VALID.txt "
                f"--destdir {paths[0]}`"
            )
        dictionary = Dictionary.load(dict_path)
        logger.info("dictionary: %d types", len(dictionary))
        return cls(cfg, dictionary)

    # ------------------------------------------------------------------ data
    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, **kwargs):
        paths = utils.split_paths(require_data(self.cfg.data))
        training = split == getattr(self.cfg, "train_subset", "train")
        directory = paths[(epoch - 1) % len(paths)] if training else paths[0]  # fairseq's sharding
        prefix = os.path.join(directory, split)
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise FileNotFoundError(
                f"split {split!r}: {' and '.join(missing)} not found. Binarize the text into {directory} with "
                f"`fairseq-preprocess --only-source --srcdict {directory}/dict.txt --destdir {directory}` "
                "(--trainpref/--validpref/--testpref write train/valid/test), or name an existing split"
            )
        empty = ValueError(f"split {split!r}: {prefix}.bin holds no sentences")
        if os.path.getsize(prefix + ".bin") == 0:  # fairseq's mmap reader cannot open it
            raise empty
        dataset = data_utils.load_indexed_dataset(prefix, self.dictionary, self.cfg.dataset_impl, combine=combine)
        if dataset is None or len(dataset) == 0:
            raise empty
        dataset = self._with_eos(dataset)
        self.datasets[split] = self._pair_dataset(dataset, dataset.sizes, shuffle=(split != "test"))
        logger.info("%s: %d sentences from %s", split, len(dataset), prefix)

    def _with_eos(self, dataset):
        """Append EOS unless the data already end with it (fairseq-preprocess appends it)."""
        first = dataset[0]
        if first.numel() > 0 and int(first[-1]) == self.dictionary.eos():
            return dataset
        logger.warning("sentences do not end with EOS: appending it")
        return AppendTokenDataset(dataset, self.dictionary.eos())

    def _pair_dataset(self, dataset, sizes, shuffle=True, constraints=None):
        pair = LanguagePairDataset(
            dataset, sizes, self.dictionary,
            tgt=dataset, tgt_sizes=sizes, tgt_dict=self.dictionary,
            left_pad_source=self.cfg.left_pad_source, left_pad_target=False,
            shuffle=shuffle, input_feeding=True, constraints=constraints,
        )
        return DecoderStartDataset(pair, lambda: self.decoder_start_index)

    @property
    def decoder_start(self) -> str:
        """``bos`` or ``eos``: ``--decoder-start``, or with ``auto`` the built model's."""
        if self.cfg.decoder_start != "auto":
            return self.cfg.decoder_start
        return self.built_model_defaults.default_decoder_start if self.built_model_defaults else "eos"

    @property
    def decoder_start_index(self) -> int:
        return self.target_dictionary.bos() if self.decoder_start == "bos" else self.target_dictionary.eos()

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        """fairseq's generator, started from the decoder-start symbol (``--decoder-start``)."""
        with torch.no_grad():
            return generator.generate(models, sample, prefix_tokens=prefix_tokens, constraints=constraints,
                                      bos_token=self.decoder_start_index)

    def build_dataset_for_inference(self, src_tokens, src_lengths, constraints=None):
        """Sentences (each ending with EOS) to reconstruct, as for ``fairseq-interactive``."""
        return LanguagePairDataset(
            src_tokens, src_lengths, self.dictionary, tgt_dict=self.dictionary,
            left_pad_source=self.cfg.left_pad_source, constraints=constraints, shuffle=False,
        )

    # ---------------------------------------------------------------- model
    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        vae = sentence_vae_model(model, type(self).__name__)
        self.built_model_defaults = BuiltModelDefaults(OrderedDict(vae.latent_sizes), vae.default_kl_variant,
                                                       vae.default_decoder_start)
        vae.update_counter = UpdateCounter()
        return model

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        """fairseq's train step (the forward sees ``update_num`` completed updates); afterwards
        the counter is advanced to ``update_num + 1``, the trainer's count once this update is
        applied, so validation inside ``fairseq-train`` uses the same beta as ``fairseq-validate``
        on the checkpoint saved at that update. The next train step sets it again."""
        vae = sentence_vae_model(model, type(self).__name__)
        if vae.reset_optimizer_after_ae and isinstance(criterion, AutoEncodingPhase):
            if criterion.ae_steps and update_num == criterion.ae_steps:
                reset_optimizer_state(optimizer, update_num)
        result = super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)
        if vae.update_counter is not None:
            vae.update_counter.set_num_updates(update_num + 1)
        return result

    def build_generator(self, models, args, *rest, **kwargs):
        """fairseq's generator (also for ``fairseq-generate``), its ``--no-repeat-ngram-size``
        blocker comparing the generated prefix (:class:`.decoding.GeneratedPrefixNGramBlock`)."""
        from .decoding import with_generated_prefix_ngram_block

        return with_generated_prefix_ngram_block(super().build_generator(models, args, *rest, **kwargs))

    # bit-identical resume (user_dir/exact_resume.py)
    get_batch_iterator = batches_made_as_at_epoch_one(FairseqTask.get_batch_iterator)

    def max_positions(self):
        return (self.cfg.max_positions, self.cfg.max_positions)

    # ------------------------------------------------ text <-> tokens (the tools' hooks)
    bleu_tokenize = "none"  # reconstruction BLEU on the data's own tokens

    def source_ids(self, sentence: str) -> torch.Tensor:
        """A whitespace-tokenised sentence -> source ids + EOS ``[L + 1]`` (unknown words: ``<unk>``)."""
        return self.source_dictionary.encode_line(sentence, add_if_not_exist=False, append_eos=True).long()

    def target_text(self, tokens: torch.Tensor, post_process: Optional[str] = None) -> str:
        """Target ids -> the dictionary's tokens joined by spaces (``post_process`` removes a BPE)."""
        return self.target_dictionary.string(tokens.int().cpu(), bpe_symbol=post_process)

    def target_word_count(self, tokens: torch.Tensor) -> Optional[int]:
        """Words of a target for a per-word perplexity; ``None``: the data's tokens are the unit."""
        return None

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.dictionary
