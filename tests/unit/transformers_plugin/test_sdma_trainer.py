"""``SDMATrainer``: transformers' Trainer trains an attached model with eq. (24)'s regularisers and moves g."""

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from latent_core.sdma import SDMACore
from transformers_plugin import attach_sdma, sdma_loss
from transformers_plugin.trainer import SDMATrainer


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n=24):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(5, 50, (n, 8), generator=g)
        self.labels = (self.ids[:, 0] > 27).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(8, dtype=torch.long), "labels": self.labels[i]}


def model():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, num_labels=2)
    return attach_sdma(BertForSequenceClassification(config), mode="sdma", reading="authors", mix_rate=0.5)


def test_trainer_adds_the_regularisers_and_moves_g(tmp_path):
    sdma_model = model()
    before = {n: p.detach().clone() for n, p in sdma_model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, learning_rate=1e-3,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0)
    trainer = SDMATrainer(model=sdma_model, args=args, train_dataset=Pairs(), sdma_weights={"dqq_weight": 50.0})
    trainer.train()
    cores = [m for m in sdma_model.modules() if isinstance(m, SDMACore)]
    assert all(float(core.mix_weight) > 0.5 for core in cores)  # g after 4 updates at R = 0.5
    moved = [n for n, p in sdma_model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert any(".sdma." in n for n in moved) and any("classifier" in n for n in moved)
    # the training loss is the task's plus sdma_loss of the same forward, with the given weights
    sdma_model.train()
    batch = {k: torch.stack([Pairs()[i][k] for i in range(8)]) for k in ("input_ids", "attention_mask", "labels")}
    torch.manual_seed(1)
    total = trainer.compute_loss(sdma_model, batch)
    regulariser = sdma_loss(sdma_model, {"dqq_weight": 50.0})
    torch.manual_seed(1)
    task = sdma_model(**batch).loss
    torch.testing.assert_close(total, task + regulariser, atol=1e-5, rtol=1e-5)
    assert abs(float(regulariser.detach())) > 1e-4
