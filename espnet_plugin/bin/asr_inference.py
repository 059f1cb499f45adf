#!/usr/bin/env python3
"""``espnet2.bin.asr_inference`` with the SDMA plugin imported: same options and behaviour."""

import espnet_plugin  # noqa: F401  (registers the SDMA classes before the model is built)
from espnet2.bin.asr_inference import get_parser, main  # noqa: F401

if __name__ == "__main__":
    main()
