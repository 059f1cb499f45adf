#!/usr/bin/env python3
"""Build a small real German-English sentence-pair corpus from the Ding dictionary.

Same as the console command ``prepare-ding`` (the code and its documentation: ``latent_core.data.ding``).
"""

from latent_core.data.ding import main

if __name__ == "__main__":
    raise SystemExit(main())
