"""``attach_sdma`` on a BERT-architecture encoder: SDMA through transformers' attention interface."""

import copy

import pytest
import torch
from transformers import BertConfig, BertModel

from latent_core.sdma import SDMAConfigError, SDMACore, collect_sdma_losses, recording, sdma_attention
from transformers_plugin import attach_sdma, sdma_loss
from transformers_plugin import set_sdma_updates

from sdma_round_trip import save_and_reload

CONFIG = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert(seed=0):
    torch.manual_seed(seed)
    return BertModel(BertConfig(**CONFIG, attn_implementation="sdpa")).eval()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 50, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, -2:] = 0
    mask[2, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def cores(model):
    return [m for m in model.modules() if isinstance(m, SDMACore)]


@pytest.mark.parametrize("mode", ["none", "sdma"])
def test_off_equals_the_unmodified_model(mode):
    """mode none, or g = 0 at inference (no noise): outputs and gradients of the plain model."""
    base = bert()
    attached = attach_sdma(copy.deepcopy(base), mode=mode, reading="paper")
    outputs = {}
    for name, model in (("base", base), ("attached", attached)):
        model.zero_grad()
        hidden = model(**batch()).last_hidden_state
        hidden.pow(2).sum().backward()
        outputs[name] = (hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                           if p.grad is not None})
    torch.testing.assert_close(outputs["attached"][0], outputs["base"][0], atol=2e-6, rtol=1e-5)
    for name, grad in outputs["base"][1].items():
        torch.testing.assert_close(outputs["attached"][1][name], grad, atol=2e-5, rtol=1e-4)


def test_the_function_is_the_cores_explicit_kernel():
    """The registered function's output equals eq. (11) computed by the core on the same q, k, v, p(c|x)."""
    model = attach_sdma(bert(), mode="sdma", reading="paper")
    set_sdma_updates(model, 3000)
    module = model.encoder.layer[0].attention.self
    captured = {}
    module.register_forward_hook(
        lambda m, args, kwargs, out: captured.update(x=args[0] if args else kwargs["hidden_states"], out=out[0]),
        with_kwargs=True)
    inputs = batch()
    with torch.no_grad():
        model(**inputs)
        x = captured["x"]
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, 4, 8).transpose(1, 2) for proj in (module.query, module.key, module.value))
        resp = module.sdma.cluster(x)[1].exp().transpose(1, 2)
        blocked = (inputs["attention_mask"] == 0)[:, None, None, :]
        want, _ = sdma_attention(q / 8 ** 0.5, k, v, resp, resp, module.sdma.mix_weight, authors=False,
                                 blocked=blocked, kernel="explicit", need_weights=False, dropout=lambda a: a,
                                 dropout_p=0.0)
    got = captured["out"]
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[real], want.transpose(1, 2).reshape(B, T, 32)[real], atol=1e-6, rtol=1e-5)


def test_masks_mask_and_weights_are_the_mixed_attention():
    model = attach_sdma(bert(), mode="sdma", reading="paper")
    set_sdma_updates(model, 3000)
    with torch.no_grad():
        out = model(**batch(), output_attentions=True)
    weights = out.attentions[0]  # [B, H, T, S]
    assert weights.shape == (3, 4, 7, 7)
    assert torch.all(weights[0, :, :, -2:] == 0) and torch.all(weights[2, :, :, -4:] == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 7), atol=1e-5, rtol=0)
    assert float(cores(model)[0].mix_weight) > 0.5


def test_every_parameter_trains_and_the_loss_drops():
    model = attach_sdma(bert(), mode="sdma", reading="paper")
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(30):
        set_sdma_updates(model, 2000 + step)
        optimizer.zero_grad()
        hidden = model(**batch(step % 3)).last_hidden_state
        task = hidden[:, 0].pow(2).mean()
        regulariser = sdma_loss(model)
        (task + regulariser).backward()
        if step == 0:
            missing = [n for n, p in model.named_parameters() if p.grad is None and not n.startswith("pooler.")]
            assert not missing, missing
            assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if ".sdma." in n)
        losses.append(float(regulariser.detach()))
        optimizer.step()
    assert min(losses[-5:]) < losses[0]


def test_options_named_as_in_the_core_and_written_into_the_config():
    model = attach_sdma(bert(), mode="sma", reading="paper", clusters=3)
    assert model.config._attn_implementation == "sdma"
    assert model.config.sdma["clusters"] == 3 and model.config.sdma["mode"] == "sma"
    assert all(core.query_gmm is None for core in cores(model)) and len(cores(model)) == 2


def test_bad_input_is_a_named_error():
    with pytest.raises(SDMAConfigError, match="unknown keyword.*num_clusters"):
        attach_sdma(bert(), num_clusters=4)
    with pytest.raises(SDMAConfigError, match="clusters"):
        attach_sdma(bert(), clusters=0)
    with pytest.raises(SDMAConfigError, match="not a transformers PreTrainedModel"):
        attach_sdma(torch.nn.Linear(2, 2))
    model = attach_sdma(bert(), reading="paper")
    with pytest.raises(SDMAConfigError, match="called twice"):
        attach_sdma(model, reading="paper")
    with pytest.raises(SDMAConfigError, match="no forward"):
        sdma_loss(attach_sdma(bert(), reading="paper"))
    model(**batch())
    with pytest.raises(SDMAConfigError, match="unknown weight.*kl"):
        sdma_loss(model, weights={"kl": 1.0})


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_same_reading_as_the_fairseq_adapter(reading, monkeypatch):
    """In training, the Hugging Face module computes what the fairseq adapter's ``SDMAMultiheadAttention``
    computes on the same weights, input and noise: one core, one reading. The two lay tensors out differently
    (batch- vs time-first), so the same random draw would land on other positions; the noise of eq. (8) is made
    an element-wise function of its input here, the same on both sides."""
    from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention
    from latent_core.sdma import SDMAOptions

    model = attach_sdma(bert(), mode="sdma", reading=reading)
    set_sdma_updates(model, 3000)
    hf = model.encoder.layer[0].attention.self
    fs = SDMAMultiheadAttention(32, 4, sdma=SDMAOptions(mode="sdma", reading=reading), group="encoder_self",
                                self_attention=True, dropout=0.0)
    fs.sdma.load_state_dict(hf.sdma.state_dict())
    with torch.no_grad():
        for mine, theirs in ((fs.q_proj, hf.query), (fs.k_proj, hf.key), (fs.v_proj, hf.value)):
            mine.weight.copy_(theirs.weight)
            mine.bias.copy_(theirs.bias)
        fs.out_proj.weight.copy_(torch.eye(32))  # the context itself (BERT applies its output dense later)
        fs.out_proj.bias.zero_()
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1))
    valid = batch()["attention_mask"].bool()
    noise = {"calls": 0}

    def perturb(self, value, training, log_var=None):
        noise["calls"] += 1
        return value + 0.1 * torch.sin(7 * value) if training else value

    monkeypatch.setattr(SDMACore, "perturb", perturb)
    model.train()
    fs.train()
    with recording() as hf_records:
        got, _ = hf(x, attention_mask=valid[:, None, None, :].expand(3, 1, 7, 7))
    drawn = noise["calls"]
    assert drawn == (2 if reading == "authors" else 1)  # the authors' second draw on the queries
    with recording() as fs_records:
        want, _ = fs(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), key_padding_mask=~valid)
    torch.testing.assert_close(got[valid], want.transpose(0, 1)[valid], atol=1e-5, rtol=1e-4)
    # the regularisers of eq. (20)-(23), per sentence
    hf_terms, fs_terms = collect_sdma_losses(hf, hf_records), collect_sdma_losses(fs, fs_records)
    assert set(hf_terms) == set(fs_terms) and len(hf_records) == len(fs_records) == 1
    for name, value in fs_terms.items():
        torch.testing.assert_close(hf_terms[name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("reading", ["authors", "paper"])
def test_bf16_autocast_trains(reading):
    """Under bf16 autocast (the CPU's; CUDA's is the same code) the step is finite and every parameter gets a
    finite gradient: the core keeps its GMM densities in float32."""
    model = attach_sdma(bert(), mode="sdma", reading=reading)
    set_sdma_updates(model, 3000)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model(**batch()).last_hidden_state
        loss = hidden.float().pow(2).mean() + sdma_loss(model)
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters() if not n.startswith("pooler.")}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())


def test_the_cores_follow_the_model_to_a_device_and_dtype():
    model = attach_sdma(bert(), mode="sdma", reading="paper").to(torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    with torch.no_grad():
        out = model(**batch()).last_hidden_state
    assert out.dtype == torch.float64 and torch.isfinite(out).all()


def test_attentions_are_returned_where_sdma_is_off():
    """An attention without SDMA in the pass (mode none here) asked for ``output_attentions`` returns the unmodified
    model's eager weights (transformers' sdpa returns none)."""
    base = bert()
    base.set_attn_implementation("eager")
    model = attach_sdma(bert(), mode="none")
    with torch.no_grad():
        want = base(**batch(), output_attentions=True).attentions
        got = model(**batch(), output_attentions=True).attentions
    assert len(got) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["sdma", "sma"])
def test_save_pretrained_and_reload(tmp_path, mode):
    """An encoder applies its semantic mask at inference, so the reloaded model's outputs depend on the cores'
    GMM and mixture parameters: they must come back from the weights, bit for bit, with the options."""
    model = attach_sdma(bert(), mode=mode, reading="authors", clusters=3)
    set_sdma_updates(model, 4321)
    reloaded = save_and_reload(model, BertModel, tmp_path)
    assert reloaded.config.sdma["mode"] == mode and any(".sdma." in name for name in reloaded.state_dict())
    with torch.no_grad():
        want = model.eval()(**batch()).last_hidden_state
        torch.testing.assert_close(reloaded(**batch()).last_hidden_state, want, rtol=0, atol=0)
        fresh = attach_sdma(bert(), mode=mode, reading="authors", clusters=3)
        assert not torch.equal(fresh.eval()(**batch()).last_hidden_state, want)
