#!/usr/bin/env python3
"""Predict a split with an ``hf_sentence_prediction`` checkpoint and write a GLUE submission file.

Same as the console command ``glue-predict``
(the code and its documentation: ``user_dir.hf_sentence.predict``).
"""

from user_dir.hf_sentence.predict import main

if __name__ == "__main__":
    raise SystemExit(main())
