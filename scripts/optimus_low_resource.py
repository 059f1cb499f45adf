#!/usr/bin/env python3
"""Optimus' low-resource classification (Figure 3) and latent-space t-SNE (Figure 4).

Same as the console command ``optimus-low-resource`` (the code and its documentation: ``user_dir.optimus.low_resource``).
"""

from user_dir.optimus.low_resource import main

if __name__ == "__main__":
    raise SystemExit(main())
