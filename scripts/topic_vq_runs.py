#!/usr/bin/env python3
"""Cross-validated comparison of the plain encoder, DisBert (topic_vq_sts) and its ablations.

Same as the console command ``topic-vq-runs`` (the code and its documentation: ``user_dir.topic_vq.runs``).
"""

from user_dir.topic_vq.runs import main

if __name__ == "__main__":
    raise SystemExit(main())
