#!/usr/bin/env python3
"""LR / HR attention redundancy of an ESPnet2 ASR model.

Same as the console command ``sdma-espnet-redundancy`` (the code and its documentation: ``espnet_plugin.asr.redundancy``).
"""

from espnet_plugin.asr.redundancy import main

if __name__ == "__main__":
    raise SystemExit(main())
