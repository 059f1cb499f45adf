#!/usr/bin/env python3
"""``espnet2.bin.asr_train`` with the SDMA plugin: same options, plus the plugin's classes."""

from espnet_plugin.tasks.sdma_asr import SDMAASRTask


def get_parser():
    return SDMAASRTask.get_parser()


def main(cmd=None):
    SDMAASRTask.main(cmd=cmd)


if __name__ == "__main__":
    main()
