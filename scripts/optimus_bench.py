#!/usr/bin/env python3
"""Training words/s of Optimus' BERT + GPT-2 pairing against the same GPT-2 trained alone.

Same as the console command ``optimus-bench`` (the code and its documentation: ``user_dir.optimus.speed``).
"""

from user_dir.optimus.speed import main

if __name__ == "__main__":
    raise SystemExit(main())
