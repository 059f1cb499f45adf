"""Every Python snippet of the pages runs as written (parsed with sybil): each alone, as a user pastes it, and the
page's snippets one after another in one namespace. Placeholders become tiny things: ``"path/to/bert"``,
``"path/to/llama"`` and ``"path/to/marian"`` are small models saved under the working directory; ``batches``,
``train``, ``train_pairs``, ``valid_pairs``, ``model`` and ``sample`` are given to the snippets that name them.
A page with a Python snippet and no entry in :data:`PAGES` fails, so a new snippet cannot go untested."""

import os
from pathlib import Path

import pytest
import torch
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser

from conftest import REPO

PAGES = {
    "examples/transformers_sdma/README.md": "transformers",
    "examples/sdma_translation/README.md": "fairseq",
    "examples/sdma_translation/benchmark.md": "none",
    "examples/aishell_sdma/README.md": "espnet",
}
SYBIL = Sybil(parsers=[PythonCodeBlockParser()])


def test_every_page_with_python_snippets_is_listed():
    pages = [REPO / "README.md", *sorted((REPO / "examples").rglob("*.md")), *sorted((REPO / "docs").rglob("*.md"))]
    with_snippets = {str(p.relative_to(REPO)) for p in pages if "```python" in p.read_text(encoding="utf-8")}
    assert with_snippets == set(PAGES)


class Items(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def transformers_placeholders(directory: Path) -> dict:
    from transformers import (BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM,
                              MarianConfig, MarianMTModel)

    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        num_labels=2)).save_pretrained(directory / "path/to/bert")
    LlamaForCausalLM(LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)).save_pretrained(directory / "path/to/llama")
    MarianMTModel(MarianConfig(
        vocab_size=40, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        pad_token_id=0, decoder_start_token_id=0, forced_eos_token_id=None)).save_pretrained(directory / "path/to/marian")
    g = torch.Generator().manual_seed(0)

    def sentence(i):
        ids = torch.randint(5, 40, (6,), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": int(ids[0] > 22)}

    def pair(i):
        ids = torch.randint(5, 40, (6,), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.flip(0)}

    batches = []
    for _ in range(2):
        rows = [sentence(i) for i in range(4)]
        batches.append({"input_ids": torch.stack([r["input_ids"] for r in rows]),
                        "attention_mask": torch.stack([r["attention_mask"] for r in rows]),
                        "labels": torch.tensor([r["labels"] for r in rows])})
    return {"batches": batches, "train": Items([sentence(i) for i in range(16)]),
            "train_pairs": Items([pair(i) for i in range(16)]), "valid_pairs": Items([pair(i) for i in range(4)])}


def fairseq_placeholders(directory: Path) -> dict:
    from tests.unit.user_dir.test_sdma_fairseq import batch, build

    model, task, _ = build(directory)
    src, lengths, prev = batch(task)
    return {"model": model, "sample": {"net_input": {"src_tokens": src, "src_lengths": lengths,
                                                     "prev_output_tokens": prev}}}


def espnet_placeholders(directory: Path) -> dict:
    from tests.integration.espnet_model_dir import tiny_sdma_model_dir

    tiny_sdma_model_dir(directory / "exp" / "sdma")
    return {"waveform_16khz": torch.randn(8000).numpy()}


PLACEHOLDERS = {"transformers": transformers_placeholders, "fairseq": fairseq_placeholders,
                "espnet": espnet_placeholders, "none": lambda directory: {}}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_pages_python_snippets_run_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    placeholders = PLACEHOLDERS[PAGES[page]](tmp_path)
    document = SYBIL.parse(REPO / page)
    examples = list(document)
    assert examples
    from latent_core import sdma

    kernels = dict(sdma.KERNELS)
    try:
        for example in examples:  # each alone, as pasted into a fresh session
            document.namespace.clear()
            document.namespace.update(placeholders)
            example.evaluate()
        document.namespace.clear()
        document.namespace.update(placeholders)
        for example in examples:  # and one after another
            example.evaluate()
    finally:
        sdma.KERNELS.clear()
        sdma.KERNELS.update(kernels)  # benchmark.md registers a kernel of its own
    assert os.getcwd() == str(tmp_path)
