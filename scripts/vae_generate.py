#!/usr/bin/env python3
"""Decode from a sentence VAE's latent space: reconstruct, sample, interpolate, analogy, transfer.

    python scripts/vae_generate.py reconstruct --path CKPT [--input FILE]      (stdin by default)
    python scripts/vae_generate.py sample --path CKPT --num 10
    python scripts/vae_generate.py interpolate --path CKPT "sentence a" "sentence b" --steps 11
    python scripts/vae_generate.py analogy --path CKPT "a" "b" "c"
    python scripts/vae_generate.py transfer --path CKPT --latent z_syn "semantics source" "syntax source"

Decoding: greedy (default), --beam N, --sampling [--sampling-topk K | --sampling-topp P].
Input sentences are split on whitespace and must be tokenised like the training data. Same as
the console command ``vae-generate``; see ``user_dir/sentence_vae/generate.py``.
"""

from user_dir.sentence_vae.generate import cli_main

if __name__ == "__main__":
    raise SystemExit(cli_main())
