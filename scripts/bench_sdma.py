#!/usr/bin/env python3
"""Benchmark (``make bench``): vanilla transformer vs SMA-T vs SDMA-T, identical size, one run.

Same as the console command ``sdma-bench`` (the code and its documentation: ``user_dir.sdma.bench``).
"""

from user_dir.sdma.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
