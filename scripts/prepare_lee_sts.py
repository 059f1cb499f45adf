#!/usr/bin/env python3
"""Cross-validation folds of the Lee document-similarity ratings in the GLUE STS-B layout.

Same as the console command ``prepare-lee-sts`` (the code and its documentation: ``latent_core.data.lee_sts``).
"""

from latent_core.data.lee_sts import main

if __name__ == "__main__":
    raise SystemExit(main())
