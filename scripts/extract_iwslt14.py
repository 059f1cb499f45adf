#!/usr/bin/env python3
"""Plain parallel text from the IWSLT'14 De-En release (and from WMT ``.sgm`` files).

Same as the console command ``extract-iwslt14`` (the code and its documentation: ``latent_core.data.iwslt14``).
"""

from latent_core.data.iwslt14 import main

if __name__ == "__main__":
    raise SystemExit(main())
