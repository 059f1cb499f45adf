#!/usr/bin/env python3
"""Score translations two ways: sacreBLEU and the paper's tokenized BLEU.

Same as the console command ``sdma-bleu`` (the code and its documentation: ``user_dir.sdma.bleu``).
"""

from user_dir.sdma.bleu import main

if __name__ == "__main__":
    raise SystemExit(main())
