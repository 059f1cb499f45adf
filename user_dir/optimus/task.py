"""``optimus_lm`` task: every sentence twice, BERT WordPiece in and GPT-2 byte-level BPE out.

Optimus reads a sentence into BERT as WordPiece and scores it from GPT-2 as BPE (Li et al., EMNLP 2020,
Sec. 4.2, "Tokenization"). Data come from ``prepare-optimus-data``
(:mod:`pipelines.data.optimus_text`): a fairseq language pair ``bert -> gpt2`` with the two
vocabularies as dictionaries (``dict.bert.txt``, ``dict.gpt2.txt``) and the two tokenizers
saved beside them (``bert_tokenizer/``, ``gpt2_tokenizer/``). Every example is a
:class:`LanguagePairDataset` pair:

* source ``src_tokens`` = WordPiece pieces + ``</s>`` (the encoder prepends ``<s>``: BERT's
  ``[CLS] x [SEP]``, see :mod:`.model`), right-padded;
* target = BPE tokens + ``</s>`` (GPT-2's ``<|endoftext|>`` when ``--gpt2-dir`` is given);
* ``prev_output_tokens`` = ``<s>`` + BPE tokens (``--decoder-start bos``, default): the
  authors' convention, ``<BOS> x <EOS>`` with ``<BOS>`` a new GPT-2 embedding row; fairseq's
  generator is started from ``<s>`` too. ``--decoder-start eos`` keeps fairseq's convention
  (``</s>`` + tokens).

fairseq batches by the longer side (``LanguagePairDataset.num_tokens`` = max of source and
target lengths), and ``--max-positions`` bounds both. Everything else (the update counter the
criterion's beta schedules read, checkpoints, the ``vae-eval`` / ``vae-generate`` tools) is
the ``sentence_vae`` task's; the tools tokenise input text with BERT's tokenizer and
detokenise GPT-2 output back to text through the hooks :meth:`source_ids`,
:meth:`target_text` and :meth:`target_word_count`.
"""

import logging
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

import numpy as np
import torch
from fairseq import utils
from fairseq.data import Dictionary, LanguagePairDataset, data_utils
from fairseq.tasks import register_task

from pipelines.data.optimus_text import SOURCE_LANG, TARGET_LANG
from latent_core.errors import PluginConfigError
from user_dir.sentence_vae.task import DecoderStartDataset, SentenceVAEConfig, SentenceVAETask, require_data

logger = logging.getLogger(__name__)

PREPARE_HINT = "prepare it with `prepare-optimus-data --out-dir DIR --train TXT --bert-dir BERT --gpt2-dir GPT2`"


class OptimusBinaryDataError(PluginConfigError):
    """Binarised data that do not fit the dictionaries or each other (the message names the file)."""


@dataclass
class OptimusLMConfig(SentenceVAEConfig):
    data: str = field(
        default="",
        metadata={"help": "directory made by `prepare-optimus-data` (dict.bert.txt, dict.gpt2.txt, "
                          "{split}.bert-gpt2.{bert,gpt2}.bin/.idx, bert_tokenizer/, gpt2_tokenizer/)"},
    )
    decoder_start: str = field(
        default="bos",
        metadata={"help": "first decoder input: 'bos' = <s> (the Optimus authors' <BOS>; default) or "
                          "'eos' = </s> (fairseq's convention); 'auto' = the model's (</s>)"},
    )


def _load_dictionary(directory: str, lang: str) -> Dictionary:
    path = os.path.join(directory, f"dict.{lang}.txt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: --task optimus_lm reads data of two tokenizations; {PREPARE_HINT}")
    return Dictionary.load(path)


def largest_index(dataset) -> int:
    """The largest token index in an indexed dataset (its whole binary file at once when it is
    fairseq's mmap format, else sentence by sentence)."""
    index = getattr(dataset, "_index", None)
    buffer = getattr(dataset, "_bin_buffer", None)
    if index is not None and buffer is not None:
        values = np.frombuffer(buffer, dtype=index.dtype)
        return int(values.max()) if values.size else -1
    return max((int(dataset[i].max()) for i in range(len(dataset)) if dataset[i].numel()), default=-1)


@register_task("optimus_lm", dataclass=OptimusLMConfig)
class OptimusLMTask(SentenceVAETask):
    """Optimus' sentence VAE over two tokenizations (module doc)."""

    def __init__(self, cfg: OptimusLMConfig, src_dict: Dictionary, tgt_dict: Dictionary):
        super().__init__(cfg, tgt_dict)
        self.src_dict, self.tgt_dict = src_dict, tgt_dict

    @classmethod
    def setup_task(cls, cfg: OptimusLMConfig, **kwargs):
        directory = utils.split_paths(require_data(cfg.data))[0]
        src_dict = _load_dictionary(directory, SOURCE_LANG)
        tgt_dict = _load_dictionary(directory, TARGET_LANG)
        logger.info("dictionaries: %d BERT pieces, %d GPT-2 tokens", len(src_dict), len(tgt_dict))
        return cls(cfg, src_dict, tgt_dict)

    # ------------------------------------------------------------------ data
    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, **kwargs):
        paths = utils.split_paths(require_data(self.cfg.data))
        training = split == getattr(self.cfg, "train_subset", "train")
        directory = paths[(epoch - 1) % len(paths)] if training else paths[0]
        sides = {}
        for lang, dictionary in ((SOURCE_LANG, self.src_dict), (TARGET_LANG, self.tgt_dict)):
            prefix = os.path.join(directory, f"{split}.{SOURCE_LANG}-{TARGET_LANG}.{lang}")
            missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise FileNotFoundError(f"split {split!r}: {' and '.join(missing)} not found; {PREPARE_HINT}")
            if os.path.getsize(prefix + ".bin") == 0:
                raise ValueError(f"split {split!r}: {prefix}.bin holds no sentences")
            dataset = data_utils.load_indexed_dataset(prefix, dictionary, self.cfg.dataset_impl, combine=combine)
            if dataset is None or len(dataset) == 0:
                raise ValueError(f"split {split!r}: {prefix}.bin holds no sentences")
            largest = largest_index(dataset)
            if largest >= len(dictionary):
                raise OptimusBinaryDataError(
                    f"{prefix}.bin has token index {largest}, but {directory}/dict.{lang}.txt has only "
                    f"{len(dictionary)} entries: the data were binarised with another dictionary; {PREPARE_HINT}"
                )
            sides[lang] = dataset
        src, tgt = sides[SOURCE_LANG], sides[TARGET_LANG]
        if len(src) != len(tgt):
            raise OptimusBinaryDataError(f"split {split!r}: {len(src)} BERT sentences but {len(tgt)} GPT-2 sentences in "
                                   f"{directory}; both sides must come from one prepare-optimus-data run")
        self.datasets[split] = self._pair(src, tgt, shuffle=(split != "test"))
        logger.info("%s: %d sentences from %s", split, len(src), directory)

    def _pair(self, src, tgt=None, shuffle=True):
        pair = LanguagePairDataset(
            src, src.sizes, self.src_dict, tgt=tgt, tgt_sizes=None if tgt is None else tgt.sizes,
            tgt_dict=self.tgt_dict, left_pad_source=self.cfg.left_pad_source, left_pad_target=False,
            shuffle=shuffle, input_feeding=True,
        )
        return DecoderStartDataset(pair, lambda: self.decoder_start_index) if tgt is not None else pair

    def build_dataset_for_inference(self, src_tokens, src_lengths, constraints=None):
        return LanguagePairDataset(src_tokens, src_lengths, self.src_dict, tgt_dict=self.tgt_dict,
                                   left_pad_source=self.cfg.left_pad_source, shuffle=False)

    @property
    def source_dictionary(self):
        return self.src_dict

    @property
    def target_dictionary(self):
        return self.tgt_dict

    # ------------------------------------------------------- text <-> tokens
    def _tokenizer(self, name: str):
        directory = os.path.join(utils.split_paths(require_data(self.cfg.data))[0], name)
        if name == "gpt2_tokenizer":
            from pipelines.data.optimus_text import load_gpt2_tokenizer

            return load_gpt2_tokenizer(directory, f"{name}/ of the data directory")
        from pipelines.data.bert_source import load_tokenizer

        return load_tokenizer(directory, f"{name}/ of the data directory")

    def _checked(self, name: str, dictionary: Dictionary):
        """The tokenizer saved with the data, refused when the dictionary has symbols it lacks
        (the dictionary and the tokenizer then come from different models)."""
        tokenizer = self._tokenizer(name)
        vocab = tokenizer.get_vocab()
        foreign = [s for s in dictionary.symbols[dictionary.nspecial:]
                   if s not in vocab and not s.startswith("madeupword")]
        if foreign:
            raise OptimusBinaryDataError(
                f"{len(foreign)} symbols of the data's dictionary are not in {name}/ (e.g. {foreign[:5]}): the "
                f"dictionary and the tokenizer come from different models; {PREPARE_HINT}"
            )
        return tokenizer

    @cached_property
    def bert_tokenizer(self):
        return self._checked("bert_tokenizer", self.src_dict)

    @cached_property
    def gpt2_tokenizer(self):
        return self._checked("gpt2_tokenizer", self.tgt_dict)

    def source_ids(self, sentence: str) -> torch.Tensor:
        """Raw text -> BERT pieces -> source dictionary ids + ``</s>`` ``[L + 1]``."""
        pieces = self.bert_tokenizer.tokenize(sentence)
        return self.src_dict.encode_line(" ".join(pieces), add_if_not_exist=False, append_eos=True).long()

    def target_text(self, tokens: torch.Tensor, post_process: Optional[str] = None) -> str:
        """GPT-2 token ids of the target dictionary -> detokenised text (specials dropped)."""
        symbols = [self.tgt_dict[int(i)] for i in tokens
                   if int(i) >= self.tgt_dict.nspecial]
        return self.gpt2_tokenizer.convert_tokens_to_string(symbols).strip()

    def target_word_count(self, tokens: torch.Tensor) -> int:
        """Words of a target: whitespace words of its text + 1 for the end of the sentence (the
        per-word perplexity of the LSTM-VAE literature Optimus compares with)."""
        return len(self.target_text(tokens).split()) + 1

    bleu_tokenize = "13a"  # reconstruction BLEU on detokenised text (sacreBLEU's default)
