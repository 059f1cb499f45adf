#!/usr/bin/env python3
"""Raw sentences -> BERT WordPiece source + GPT-2 byte-level BPE target for ``--task optimus_lm``.

Same as the console command ``prepare-optimus-data`` (the code and its documentation: ``latent_core.data.optimus_text``).
"""

from latent_core.data.optimus_text import main

if __name__ == "__main__":
    raise SystemExit(main())
