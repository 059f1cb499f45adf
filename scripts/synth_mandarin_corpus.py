#!/usr/bin/env python3
"""Build a small synthetic Mandarin ASR corpus in ESPnet/Kaldi data-directory format.

Same as the console command ``synth-mandarin-corpus`` (the code and its documentation: ``latent_core.data.mandarin_synth``).
"""

from latent_core.data.mandarin_synth import main

if __name__ == "__main__":
    raise SystemExit(main())
