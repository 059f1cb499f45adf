#!/usr/bin/env python3
"""Topic model and codebook report of a ``topic_vq_sts`` checkpoint (any stage).

Same as the console command ``topic-report`` (the code and its documentation: ``user_dir.topic_vq.report``).
"""

from user_dir.topic_vq.report import main

if __name__ == "__main__":
    raise SystemExit(main())
