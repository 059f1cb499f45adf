"""TorchScript: ``--sdma-mode none`` is fairseq's transformer and scripts (model and fairseq's
``SequenceGenerator``, outputs equal to eager); SMA/SDMA and BERT-fused models refuse with one line."""

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from latent_core.sdma import SDMAConfigError
from test_bert_fused import bert_dir  # noqa: F401 (fixture)
from test_bert_fused import build as bert_build
from test_sdma_fairseq import batch, build
from user_dir.sdma.bert_fused import BertFusedConfigError


def test_vanilla_mode_scripts_and_scores_like_eager(tmp_path):
    model, task, _ = build(tmp_path, "--sdma-mode", "none")
    model.eval()
    scripted = torch.jit.script(model)
    src, lengths, prev = batch(task)
    with torch.no_grad():
        torch.testing.assert_close(scripted(src, lengths, prev)[0], model(src, lengths, prev)[0])
    generator = torch.jit.script(SequenceGenerator([model], task.target_dictionary, beam_size=2, max_len_b=5))
    hypos = generator.forward({"net_input": {"src_tokens": src, "src_lengths": lengths}})
    assert len(hypos) == src.size(0) and all(len(h) == 2 for h in hypos)


@pytest.mark.parametrize("mode", ["sdma", "sma"])
def test_sma_and_sdma_refuse_scripting_by_name(tmp_path, mode):
    model, _, _ = build(tmp_path, "--sdma-mode", mode)
    with pytest.raises(SDMAConfigError, match=f"--sdma-mode {mode} model cannot be scripted"):
        torch.jit.script(model)


def test_bert_fused_refuses_scripting_by_name(tmp_path, bert_dir):  # noqa: F811
    model, _, _ = bert_build(tmp_path, bert_dir, "--sdma-mode", "none")
    with pytest.raises(BertFusedConfigError, match="bert_fused_transformer cannot be scripted"):
        torch.jit.script(model)


def sdma_attention(mode="sdma"):
    from latent_core.sdma import SDMAOptions
    from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention

    return SDMAMultiheadAttention(16, 4, self_attention=True, sdma=SDMAOptions(mode=mode), group="encoder_self")


def test_the_attention_module_alone_refuses_scripting_in_one_line():
    with pytest.raises(SDMAConfigError) as error:
        torch.jit.script(sdma_attention())
    message = str(error.value)
    assert "SDMAMultiheadAttention cannot be scripted" in message and "\n" not in message


@pytest.mark.parametrize("mode", ["sdma", "sma"])
def test_head_pruning_is_refused_by_name(mode):
    """fairseq's ``test_pruning_heads`` sequence: a named error instead of a size mismatch in the core."""
    attention = sdma_attention(mode)
    reserve = attention._get_reserve_head_index(num_heads_to_keep=2)
    with pytest.raises(SDMAConfigError, match="head pruning .* not supported by SDMA attention.*4 heads"):
        attention._adaptive_prune_heads(reserve_head_index=reserve)
    assert attention.num_heads == 4  # nothing changed
    x = torch.randn(5, 2, 16)
    attention(x, x, x)  # still usable
