"""What Hugging Face users do next, and what they get wrong: errors that name the Python keyword they typed,
all-or-nothing attaching on the model's own config, saves that never reload as a silent vanilla model, wrappers SDMA
does not support refused by name, the Trainers' per-term logs."""

import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import (BertConfig, BertForSequenceClassification, BertModel, EncoderDecoderConfig,
                          EncoderDecoderModel, LlamaConfig, LlamaForCausalLM, TrainingArguments)

from latent_core.sdma import SDMAConfigError
from transformers_plugin import attach_sdma, from_pretrained_with_sdma, sdma_loss, set_sdma_updates
from transformers_plugin.trainer import SDMATrainer

from conftest import REPO

BERT = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
LLAMA = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)


def bert(config=None):
    torch.manual_seed(0)
    return BertModel(config or BertConfig(**BERT)).eval()


def batch():
    ids = torch.randint(5, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("options, message", [
    ({"clusters": -1}, r"^attach_sdma: clusters=-1: the number of GMM clusters must be an integer >= 1$"),
    ({"clusters": "4"}, r"^attach_sdma: clusters='4'"),
    ({"mix_max": 0.0}, r"^attach_sdma: mix_max=0.0: nu must lie in \(0, 1\]$"),
    ({"noise_var": float("nan")}, r"^attach_sdma: noise_var=nan must be a finite number$"),
    ({"reading": "paperr"}, r"^attach_sdma: reading='paperr' is not one of authors, paper$"),
    ({"num_clusters": 4}, r"^attach_sdma: unknown keyword\(s\) num_clusters; the options are"),
    ({"decoder_mask_at_inference": "yes"}, r"^attach_sdma: decoder_mask_at_inference='yes' must be True or False$"),
])
def test_option_errors_name_the_python_keyword(options, message):
    model = bert()
    with pytest.raises(SDMAConfigError, match=message) as error:
        attach_sdma(model, **options)
    assert "--sdma" not in str(error.value) and "\n" not in str(error.value)


def test_loss_and_schedule_errors_name_the_value():
    model = attach_sdma(bert(), reading="paper")
    model(**batch())
    for weights, message in (({"kl_weight": -5}, r"weights\['kl_weight'\]=-5: .* finite number >= 0"),
                             ({"kl_weight": math.nan}, r"weights\['kl_weight'\]=nan"),
                             ({"kl_weight": "1"}, r"weights\['kl_weight'\]='1'"),
                             ({"kl": 1.0}, r"unknown weight\(s\) kl; the weights are kl_weight, dqq_weight")):
        with pytest.raises(SDMAConfigError, match=message):
            sdma_loss(model, weights=weights)
    with pytest.raises(SDMAConfigError, match=r"regulariser_scale='sentences' is not one of sentence, batch, token"):
        sdma_loss(model, regulariser_scale="sentences", num_tokens=10)
    for updates in (-5, "10", 2.5, True):
        with pytest.raises(SDMAConfigError, match=rf"set_sdma_updates: num_updates={updates!r} must be an integer >= 0"):
            set_sdma_updates(model, updates)
    assert float(sdma_loss(model, weights={"kl_weight": 0.5})) == float(sdma_loss(model, weights={"kl_weight": 0.5}))
    for weights, message in (({"foo": 1}, r"SDMATrainer: sdma_weights: unknown weight\(s\) foo"),
                             ({"dqq_weight": -1}, r"SDMATrainer: sdma_weights\['dqq_weight'\]=-1")):
        with pytest.raises(SDMAConfigError, match=message):
            SDMATrainer(model=model, args=TrainingArguments("unused", report_to=[], use_cpu=True), sdma_weights=weights)
    with pytest.raises(SDMAConfigError, match="sdma_regulariser_scale='tokens'"):
        SDMATrainer(model=model, args=TrainingArguments("unused", report_to=[], use_cpu=True),
                    sdma_regulariser_scale="tokens")


def snapshot(model):
    """Everything attach_sdma could change: the state dict, every module's hooks, the config object and its contents,
    the attention implementation."""
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()],
            model.config, json.dumps(model.config.to_dict(), sort_keys=True, default=str),
            model.config._attn_implementation, sorted(vars(model)))


def assert_unchanged(model, before):
    after = snapshot(model)
    assert after[0].keys() == before[0].keys() and all(torch.equal(after[0][k], before[0][k]) for k in before[0])
    assert after[1:] == before[1:]
    assert not any(hasattr(m, "sdma") or hasattr(m, "sdma_state") for m in model.modules())


def test_a_failing_attach_leaves_the_model_as_it_was(monkeypatch):
    model = bert()
    before = snapshot(model)
    with pytest.raises(SDMAConfigError):  # refused before anything changes
        attach_sdma(model, clusters=0)
    assert_unchanged(model, before)

    def refuse(*args, **kwargs):  # a failure after the modules got their cores
        raise ValueError("this model does not support custom attention functions")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    with pytest.raises(ValueError, match="custom attention"):
        attach_sdma(model, mode="sdma")
    monkeypatch.undo()
    assert_unchanged(model, before)
    out = model(**batch()).last_hidden_state  # still the vanilla model
    torch.testing.assert_close(out, bert()(**batch()).last_hidden_state)


def test_attach_does_not_change_a_config_another_model_shares():
    shared = BertConfig(**BERT)
    first, second = bert(shared), bert(shared)
    attach_sdma(first, mode="sdma")
    assert first.config is not shared and second.config is shared
    assert getattr(shared, "sdma", None) is None and shared._attn_implementation != "sdma"
    assert all(m.config is first.config for m in first.modules() if hasattr(m, "config") and not m is first
               and m.config.__class__ is BertConfig)
    assert first.config.sdma["mode"] == "sdma" and first.config._attn_implementation == "sdma"
    set_sdma_updates(first, 3000)
    assert (first(**batch()).last_hidden_state - second(**batch()).last_hidden_state).abs().max() > 1e-4


@pytest.mark.integration  # a fresh interpreter without the plugin
def test_a_save_never_reloads_as_a_silent_vanilla_model(tmp_path):
    model = attach_sdma(LlamaForCausalLM(LlamaConfig(**LLAMA)), mode="sdma", decoder_mask_at_inference=True)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attn_implementation"] == "sdma"
    # with the plugin imported: plain from_pretrained builds the model, whose first forward refuses in one line
    plain = LlamaForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(SDMAConfigError, match=r"has no SDMA core.*from_pretrained_with_sdma") as error:
        plain(input_ids=torch.tensor([[3, 4, 5]]))
    assert "\n" not in str(error.value)
    reloaded = from_pretrained_with_sdma(LlamaForCausalLM, tmp_path)
    ids = torch.tensor([[3, 4, 5]])
    torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
    # without it (a fresh interpreter): transformers refuses the attention implementation the config names
    code = ("from transformers import LlamaForCausalLM\n"
            f"LlamaForCausalLM.from_pretrained({str(tmp_path)!r})\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode != 0 and 'attn_implementation="sdma"` is not supported' in run.stderr


def test_a_cross_attention_sdma_does_not_support_is_refused_by_name():
    encoder = BertConfig(**BERT)
    decoder = BertConfig(**BERT, is_decoder=True, add_cross_attention=True)
    torch.manual_seed(0)
    model = EncoderDecoderModel(EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder))
    before = snapshot(model)
    with pytest.raises(SDMAConfigError, match=r"decoder\.bert\.encoder\.layer\.0\.crossattention \(BertAttention\) "
                                              r"is a cross-attention SDMA does not support"):
        attach_sdma(model, mode="sdma")
    assert_unchanged(model, before)
    attach_sdma(model.encoder, mode="sdma")  # what the error advises
    assert sum(hasattr(m, "sdma") for m in model.encoder.modules()) == 2


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(5, 50, (6,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones(6, dtype=torch.long), "labels": int(ids[0] > 27)}


def test_the_trainer_logs_each_regulariser_under_its_own_key(tmp_path):
    torch.manual_seed(0)
    model = attach_sdma(BertForSequenceClassification(BertConfig(**BERT, num_labels=2)), mode="sdma", mix_rate=0.5)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, logging_steps=2,
                             report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    trainer = SDMATrainer(model=model, args=args, train_dataset=Pairs())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        for key in ("sdma/kl_z", "sdma/kl_q", "sdma/dqq", "sdma/dxq", "sdma/dv_z", "sdma/dv_q", "sdma/regulariser",
                    "sdma/g"):
            assert math.isfinite(entry[key]), key
        assert entry["sdma/kl_z"] > 0 and 0 < entry["sdma/g"] <= 0.9
    assert logs[1]["sdma/g"] > logs[0]["sdma/g"]  # g follows the updates
