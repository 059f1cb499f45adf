#!/usr/bin/env python3
"""Prepare a parallel corpus for fairseq: (jieba) -> sentencepiece -> fairseq-preprocess.

Same as the console command ``prepare-translation`` (the code and its documentation: ``latent_core.data.translation``).
"""

from latent_core.data.translation import main

if __name__ == "__main__":
    raise SystemExit(main())
