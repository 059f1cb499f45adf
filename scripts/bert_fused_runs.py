#!/usr/bin/env python3
"""V-T, SDMA-T, BV-T and BSDMA-T trained and scored on one corpus (Tables II/III's four rows).

Same as the console command ``sdma-bert-runs`` (the code and its documentation: ``user_dir.sdma.bert_fused_runs``).
"""

from user_dir.sdma.bert_fused_runs import main

if __name__ == "__main__":
    raise SystemExit(main())
