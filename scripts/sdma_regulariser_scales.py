#!/usr/bin/env python3
"""How strongly should the SDMA regularisers weigh? Learning speed and cluster usage per scaling.

Same as the console command ``sdma-regulariser-scales`` (the code and its documentation:
``user_dir.sdma.regulariser_scales``).
"""

from user_dir.sdma.regulariser_scales import main

if __name__ == "__main__":
    raise SystemExit(main())
