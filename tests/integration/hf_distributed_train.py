"""Train a tiny transformers model with SDMA through ``SDMATrainer`` / ``SDMASeq2SeqTrainer`` for a few steps, on one
process or under a distributed launcher (``torchrun``, ``accelerate launch``), and save its final parameters.

    python tests/integration/hf_distributed_train.py --family llama --batch 8 --out one.pt
    torchrun --nproc_per_node 2 tests/integration/hf_distributed_train.py --family llama --batch 4 --out two.pt

The same global batch (``--batch`` per process times the processes) gives the same parameters: the test compares
them. Noise variance 0 and no dropout, so that nothing but the data split differs between the runs; sequences of one
length (the authors' regularisers average over the padded length, which a split batch would change).
"""

import argparse
import os
import sys

import torch


class Sequences(torch.utils.data.Dataset):
    def __init__(self, seq2seq: bool, n: int = 64, length: int = 8):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(4, 40, (n, length), generator=g)
        self.targets = torch.flip(self.ids, dims=[1])
        self.seq2seq = seq2seq

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        item = {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}
        item["labels"] = self.targets[i] if self.seq2seq else self.ids[i]
        return item


def build(family: str, reading: str):
    from transformers import BartConfig, BartForConditionalGeneration, LlamaConfig, LlamaForCausalLM

    from transformers_plugin import attach_sdma

    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0, pad_token_id=0,
            bos_token_id=1, eos_token_id=2))
    else:
        model = BartForConditionalGeneration(BartConfig(
            vocab_size=40, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None))
    return attach_sdma(model, mode="sdma", reading=reading, noise_var=0.0, mix_rate=0.2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=("llama", "bart"), required=True)
    parser.add_argument("--reading", choices=("authors", "paper"), default="authors")
    parser.add_argument("--batch", type=int, required=True, help="per process")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    from transformers_plugin.trainer import SDMASeq2SeqTrainer, SDMATrainer

    seq2seq = args.family == "bart"
    arguments = (Seq2SeqTrainingArguments if seq2seq else TrainingArguments)(
        output_dir=os.path.dirname(os.path.abspath(args.out)), max_steps=args.steps,
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulate, learning_rate=3e-3,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0, disable_tqdm=True,
        # transformers 5.23's BART takes num_items_in_batch among its kwargs but averages its loss itself, so the
        # Trainer's rescaling by the processes doubles a vanilla BART's task loss under 2 processes; not SDMA's doing
        average_tokens_across_devices=not seq2seq)
    trainer = (SDMASeq2SeqTrainer if seq2seq else SDMATrainer)(
        model=build(args.family, args.reading), args=arguments, train_dataset=Sequences(seq2seq),
        sdma_weights={"dqq_weight": 50.0, "dxq_weight": 5.0})
    trainer.train()
    if trainer.is_world_process_zero():
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        torch.save({"parameters": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                    "logs": [{k: float(v) for k, v in entry.items()} for entry in logged],
                    "world_size": trainer.args.world_size}, args.out)
        print(f"saved {args.out} (world size {trainer.args.world_size})", file=sys.stderr)


if __name__ == "__main__":
    main()
