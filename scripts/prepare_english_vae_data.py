#!/usr/bin/env python3
"""Real English sentences for the sentence-VAE runs, and parser-free syntax-probe triplets.

Same as the console command ``prepare-english-vae-data`` (the code and its documentation: ``latent_core.data.english_vae``).
"""

from latent_core.data.english_vae import main

if __name__ == "__main__":
    raise SystemExit(main())
