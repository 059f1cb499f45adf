#!/usr/bin/env python3
"""Run a console script in this process and print its peak resident memory at exit.

Same as the console command ``peak-rss`` (the code and its documentation: ``latent_core.peak_rss``).
"""

from latent_core.peak_rss import main

if __name__ == "__main__":
    raise SystemExit(main())
