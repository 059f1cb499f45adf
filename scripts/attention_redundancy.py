#!/usr/bin/env python3
"""Layer redundancy (LR) and head redundancy (HR) of a fairseq encoder-decoder model.

Same as the console command ``sdma-redundancy`` (the code and its documentation: ``user_dir.sdma.redundancy``).
"""

from user_dir.sdma.redundancy import main

if __name__ == "__main__":
    raise SystemExit(main())
