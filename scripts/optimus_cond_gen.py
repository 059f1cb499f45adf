#!/usr/bin/env python3
"""Optimus' label-conditional generation (Table 6): a conditional GAN in the frozen latent space.

Same as the console command ``optimus-cond-gen`` (the code and its documentation: ``user_dir.optimus.conditional_generation``).
"""

from user_dir.optimus.conditional_generation import main

if __name__ == "__main__":
    raise SystemExit(main())
