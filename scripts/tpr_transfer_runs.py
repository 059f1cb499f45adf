#!/usr/bin/env python3
"""The transfer protocol of HUBERT (Section 4.4, Table 2) for a (source, target) pair of tasks.

Same as the console command ``tpr-transfer-runs``
(the code and its documentation: ``user_dir.tpr.transfer_runs``).
"""

from user_dir.tpr.transfer_runs import main

if __name__ == "__main__":
    raise SystemExit(main())
