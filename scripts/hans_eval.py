#!/usr/bin/env python3
"""HANS evaluation (McCoy et al., 2019) of an ``hf_sentence_prediction`` NLI checkpoint.

Same as the console command ``hans-eval`` (the code and its documentation: ``user_dir.hf_sentence.hans``).
"""

from user_dir.hf_sentence.hans import main

if __name__ == "__main__":
    raise SystemExit(main())
