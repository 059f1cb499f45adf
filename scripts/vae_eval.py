#!/usr/bin/env python3
"""Evaluate a sentence-VAE checkpoint: IW perplexity, ELBO, KL, MI, active units.

    python scripts/vae_eval.py --path CKPT DATA_BIN --subset test --k 100 [--chunk-size 10]
        [--batch-size 32] [--json OUT] [--cpu] [--seed 1]

Same as the console command ``vae-eval``; see ``user_dir/sentence_vae/evaluate.py`` for the
definitions of the reported numbers.
"""

from user_dir.sentence_vae.evaluate import cli_main

if __name__ == "__main__":
    raise SystemExit(cli_main())
