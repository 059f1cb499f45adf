"""``--retain-dropout --retain-dropout-modules`` (MC-dropout decoding) reach SDMA models: their
``FairseqDropout`` modules carry the names fairseq's own transformer gives them."""

from collections import Counter

import pytest
import torch
from fairseq.modules import FairseqDropout

from test_sdma_fairseq import batch, build

NAMES = ["TransformerEncoder", "TransformerEncoderLayerBase", "MultiheadAttention", "TransformerDecoder",
         "TransformerDecoderLayerBase"]


def dropout_names(model):
    return Counter(m.module_name for m in model.modules() if isinstance(m, FairseqDropout))


@pytest.mark.parametrize("mode", ["sdma", "sma", "none"])
def test_dropout_modules_are_named_as_in_fairseqs_transformer(tmp_path, mode):
    vanilla, _, _ = build(tmp_path, arch="transformer_iwslt_de_en")
    model, _, _ = build(tmp_path, "--sdma-mode", mode, arch="sdma_transformer_iwslt_de_en")
    assert dropout_names(model) == dropout_names(vanilla)
    assert set(dropout_names(model)) == set(NAMES)


@pytest.mark.parametrize("mode", ["sdma", "sma"])
def test_retained_modules_drop_at_inference_and_the_others_do_not(tmp_path, mode):
    model, task, _ = build(tmp_path, "--sdma-mode", mode, "--dropout", "0.3", "--attention-dropout", "0.3")
    model.make_generation_fast_(retain_dropout=True, retain_dropout_modules=["TransformerEncoderLayerBase",
                                                                            "MultiheadAttention"])
    kept = {m.module_name for m in model.modules() if isinstance(m, FairseqDropout) and m.apply_during_inference}
    assert kept == {"TransformerEncoderLayerBase", "MultiheadAttention"}
    model.eval()
    src, lengths, prev = batch(task)
    with torch.no_grad():
        first, second = (model(src, lengths, prev)[0] for _ in range(2))
    assert not torch.allclose(first, second)  # dropout is on at inference: two passes differ
