#!/usr/bin/env python3
"""Role types vs part of speech for a ``tpr_classifier`` (HUBERT) checkpoint (Section 4.5, Figure 4).

Same as the console command ``tpr-roles-pos`` (the code and its documentation: ``user_dir.tpr.roles_pos``).
"""

from user_dir.tpr.roles_pos import main

if __name__ == "__main__":
    raise SystemExit(main())
