"""``fairseq-train`` with ``--ddp-backend pytorch_ddp`` on CPUs (run as ``python fairseq_cpu_ddp.py ARGS``): fairseq
passes ``device_ids=[args.device_id]`` to torch's DistributedDataParallel, which refuses device ids for a CPU module;
they are dropped here, and each rank then syncs gradients with DDP's own hooks (and, with
``--find-unused-parameters``, its unused-parameter search) as on GPUs."""

import sys

from torch.nn.parallel import DistributedDataParallel

_init = DistributedDataParallel.__init__


def _init_on_cpu(self, module, device_ids=None, output_device=None, *args, **kwargs):
    if next(module.parameters()).device.type == "cpu":
        device_ids = output_device = None
    _init(self, module, device_ids, output_device, *args, **kwargs)


DistributedDataParallel.__init__ = _init_on_cpu

if __name__ == "__main__":
    from fairseq_cli.train import cli_main

    sys.argv[0] = "fairseq-train"
    cli_main()
