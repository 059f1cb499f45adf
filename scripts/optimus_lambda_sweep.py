#!/usr/bin/env python3
"""Optimus' Table 1: fine-tune a pre-trained Optimus once per KL threshold lambda and evaluate it.

Same as the console command ``optimus-lambda-sweep`` (the code and its documentation: ``user_dir.optimus.lambda_sweep``).
"""

from user_dir.optimus.lambda_sweep import main

if __name__ == "__main__":
    raise SystemExit(main())
