#!/usr/bin/env python3
"""Evaluate a sentence-VAE checkpoint: IW perplexity, ELBO, KL, MI, active units.

    python scripts/vae_eval.py --path CKPT DATA_BIN --subset test --k 100 [--chunk-size 10]
        [--batch-size 32] [--json OUT] [--cpu] [--seed 1]

See ``user_dir/sentence_vae/evaluate.py`` for the definitions of the reported numbers.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import user_dir  # noqa: E402,F401  (registers the models, task and criterion)
from user_dir.sentence_vae.evaluate import cli_main  # noqa: E402

if __name__ == "__main__":
    cli_main()
