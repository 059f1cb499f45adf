#!/usr/bin/env python3
"""Fig. 6 of the SDMA paper for one sentence: clustering probabilities, semantic mask, attention.

Same as the console command ``sdma-plot`` (the code and its documentation: ``user_dir.sdma.plot_attention``).
"""

from user_dir.sdma.plot_attention import main

if __name__ == "__main__":
    raise SystemExit(main())
