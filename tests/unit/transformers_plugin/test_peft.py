"""LoRA with PEFT on a model with SDMA: ``attach_sdma`` then ``get_peft_model(..., modules_to_save=["sdma"])``
trains the LoRA weights and the SDMA cores with the base frozen (through ``SDMATrainer``), and the adapter saves,
reloads onto a freshly attached base and gives the same logits."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (BartConfig, BartForConditionalGeneration, LlamaConfig, LlamaForCausalLM,
                          Seq2SeqTrainingArguments, TrainingArguments)

from transformers_plugin import attach_sdma
from transformers_plugin.trainer import SDMASeq2SeqTrainer, SDMATrainer

MODELS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)),
    "bart": (BartForConditionalGeneration, lambda: BartConfig(
        vocab_size=40, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, pad_token_id=0, decoder_start_token_id=2, forced_eos_token_id=None)),
}
# the mask stays on at inference in every attention, so the reloaded cores decide the logits compared
OPTIONS = dict(mode="sdma", reading="authors", mix_rate=0.3, decoder_mask_at_inference=True)


class Sequences(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(3, 40, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.flip(0)}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_lora_trains_the_adapter_and_the_cores_with_the_base_frozen_and_reloads(family, tmp_path):
    model_class, config = MODELS[family]
    torch.manual_seed(0)
    model_class(config()).save_pretrained(tmp_path / "base")  # the pretrained model a user starts from
    model = attach_sdma(model_class.from_pretrained(tmp_path / "base"), **OPTIONS)
    targets = ["q_proj", "v_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=["sdma"]))
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or ".sdma.modules_to_save." in n for n in trainable)
    arguments, trainer_class = ((Seq2SeqTrainingArguments, SDMASeq2SeqTrainer) if family == "bart"
                                else (TrainingArguments, SDMATrainer))
    args = arguments(output_dir=str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=8, learning_rate=1e-2,
                     report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    trainer_class(model=peft_model, args=args, train_dataset=Sequences()).train()
    moved = {n for n, p in peft_model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert moved <= trainable  # the base is frozen
    assert any("lora_B" in n for n in moved)
    assert {"feature_gmm.means", "feature_gmm.log_vars", "query_gmm.means"} <= {n.split("default.")[-1] for n in moved
                                                                              if ".sdma." in n}
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(attach_sdma(model_class.from_pretrained(tmp_path / "base"), **OPTIONS),
                                         tmp_path / "adapter")
    batch = Sequences()[0]
    inputs = {"input_ids": batch["input_ids"][None], "attention_mask": batch["attention_mask"][None]}
    if family == "bart":
        inputs["decoder_input_ids"] = batch["labels"][None]
    with torch.no_grad():
        want, got = peft_model.eval()(**inputs).logits, reloaded.eval()(**inputs).logits
        bare = attach_sdma(model_class.from_pretrained(tmp_path / "base"), **OPTIONS).eval()(**inputs).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (want - bare).abs().max() > 1e-4  # the adapter and the trained cores changed the model
