#!/usr/bin/env python3
"""The ESPnet ASR recipe stages on synthetic Mandarin speech: SDMA-T vs a vanilla transformer.

The driver is ``experiments.espnet.synthetic_asr`` (stages, options, outputs documented there)::

    python examples/aishell_sdma/asr1/run_synthetic.py --work-dir outputs/aishell_sdma_synthetic
"""

from experiments.espnet.synthetic_asr import main

if __name__ == "__main__":
    raise SystemExit(main())
