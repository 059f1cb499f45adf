#!/usr/bin/env python3
"""What the semantic clusters of an SDMA checkpoint capture (SDMA paper, Section IV-B1).

Same as the console command ``sdma-cluster-tokens`` (the code and its documentation: ``user_dir.sdma.cluster_tokens``).
"""

from user_dir.sdma.cluster_tokens import main

if __name__ == "__main__":
    raise SystemExit(main())
