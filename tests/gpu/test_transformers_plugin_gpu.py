"""The transformers adapter on the GPU: an attached BERT and GPT-2 train a step under autocast with finite losses
and gradients, and GPT-2's greedy generation on the device equals the CPU's."""

import pytest
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from transformers_plugin import attach_sdma, sdma_loss, set_sdma_updates

from gpu_support import DTYPES, device, needs_cuda_for  # noqa: F401 (fixture)


def _bert():
    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64))


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("reading", ["authors", "paper"])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_a_training_step_under_autocast(device, family, reading, precision):
    needs_cuda_for(precision)
    model = attach_sdma(_bert() if family == "bert" else _gpt2(), mode="sdma", reading=reading).to(device)
    set_sdma_updates(model, 3000)
    model.train()
    ids = torch.randint(3, 40, (4, 12), device=device)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    with torch.autocast(device.type, dtype=DTYPES[precision]):
        if family == "bert":
            task = model(input_ids=ids, attention_mask=mask).last_hidden_state.float().pow(2).mean()
        else:
            task = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss = task + sdma_loss(model)
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters() if not n.startswith("pooler.")}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert all(p.device.type == device.type for p in model.parameters())


def test_generation_on_the_device_equals_the_cpu(device):
    model = attach_sdma(_gpt2(), mode="sdma", reading="authors").eval()
    set_sdma_updates(model, 3000)
    prompt = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        cpu = model.generate(prompt, max_new_tokens=8, do_sample=False)
        on_device = model.to(device).generate(prompt.to(device), max_new_tokens=8, do_sample=False)
    assert torch.equal(on_device.cpu(), cpu)
