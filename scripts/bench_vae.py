#!/usr/bin/env python3
"""Benchmark the sentence VAEs against plain fairseq models of the same size, in one run.

Same as the console command ``vae-bench`` (the code and its documentation: ``user_dir.sentence_vae.bench``).
"""

from user_dir.sentence_vae.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
