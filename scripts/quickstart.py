#!/usr/bin/env python3
"""The SDMA quickstart (``make demo``): real German->English data, end to end on a CPU.

Same as the console command ``sdma-demo`` (the code and its documentation: ``user_dir.sdma.quickstart``).
"""

from user_dir.sdma.quickstart import main

if __name__ == "__main__":
    raise SystemExit(main())
