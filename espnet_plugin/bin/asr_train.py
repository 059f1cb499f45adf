#!/usr/bin/env python3
"""``espnet2.bin.asr_train`` with the SDMA plugin: same options, plus the plugin's classes.

Every model file (``--resume``'s ``checkpoint.pth``, ``--init_param``, the n-best averaging
at the end) is read with ``torch.load(weights_only=True)`` (:mod:`espnet_plugin.safe_loading`;
``SDMAASRTask.main_worker`` applies it in each worker).
"""

from espnet_plugin.safe_loading import weights_only_loading
from espnet_plugin.tasks.sdma_asr import SDMAASRTask


def get_parser():
    return SDMAASRTask.get_parser()


def main(cmd=None):
    with weights_only_loading():
        SDMAASRTask.main(cmd=cmd)


if __name__ == "__main__":
    main()
