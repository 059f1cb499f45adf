"""A few steps of a tiny Llama with SDMA in a plain PyTorch loop, on one process or under ``torchrun`` with torch's
FSDP2 (``fully_shard`` on every decoder layer and the model, gloo, CPUs); saves the final (full) parameters.

    python tests/integration/hf_fsdp_train.py one.pt
    torchrun --nproc_per_node 2 tests/integration/hf_fsdp_train.py two.pt

Each process takes its share of the same global batch of 8; FSDP averages the gradients over the processes, so the
parameters equal one process's. Noise variance 0, no dropout, sequences of one length (as hf_distributed_train).
"""

import os
import sys

import torch
import torch.distributed as dist

from hf_distributed_train import Sequences, build


def main(out: str) -> None:
    from transformers_plugin import sdma_loss, set_sdma_updates

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = build("llama", "authors")
    rank = 0
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = Sequences(seq2seq=False)
    model.train()
    share = 8 // world
    for step in range(3):
        rows = [data[i] for i in range(step * 8 + rank * share, step * 8 + (rank + 1) * share)]
        batch = {key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "attention_mask", "labels")}
        loss = model(**batch).loss + sdma_loss(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        set_sdma_updates(model, step + 1)
    parameters = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for name, p in model.named_parameters()}
    if rank == 0:
        torch.save({"parameters": parameters, "world_size": world}, out)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
