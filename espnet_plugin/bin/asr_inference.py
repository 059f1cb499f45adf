#!/usr/bin/env python3
"""``espnet2.bin.asr_inference`` with the SDMA plugin imported: same options and behaviour,
except that every model file is read with ``torch.load(weights_only=True)``
(:mod:`espnet_plugin.safe_loading`)."""

from typing import List, Optional

import espnet_plugin  # noqa: F401  (registers the SDMA classes before the model is built)
from espnet2.bin import asr_inference as espnet_asr_inference
from espnet2.bin.asr_inference import get_parser  # noqa: F401

from espnet_plugin.safe_loading import weights_only_loading


def main(cmd: Optional[List[str]] = None) -> None:
    with weights_only_loading():
        espnet_asr_inference.main(cmd)


if __name__ == "__main__":
    main()
