#!/usr/bin/env python3
"""The embedding-space test of QKVAE's Table 2 (Felhi et al., NAACL 2022, arXiv:2205.05943, Section 5.2).

Same as the console command ``qkvae-probe`` (the code and its documentation: ``user_dir.qkvae.probe``).
"""

from user_dir.qkvae.probe import main

if __name__ == "__main__":
    raise SystemExit(main())
